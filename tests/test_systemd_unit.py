"""polca-agent.service: key directives, a comment on every directive, systemd's own checks.

``systemd-analyze`` must be installed (Debian package ``systemd``); these tests fail, not
skip, without it, so CI cannot silently stop checking the unit. The parser and the
``systemd-analyze`` runs are ``tests/systemd_units.py``, shared with the aggregator's unit.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from polca.agent.config import Settings, load_settings
from tests.systemd_units import (
    CONTAINER_NOISE,
    Unit,
    directive_count,
    exposure,
    parse_unit,
    trailing_comments,
    uncommented_directives,
    verify,
)

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "polca-agent.service"
ENV_EXAMPLE = ROOT / "systemd" / "polca-agent.env.example"

# systemd's overall exposure score (0 = locked down, 10 = unprotected) must stay below this.
MAX_EXPOSURE = 3.0

# Lines systemd-analyze may print about the host rather than the unit: units named in
# After=/Wants= that do not exist without a GPU driver, and probes that fail in containers.
_HOST_NOISE = (
    re.compile(r"nvidia-persistenced\.service"),
    re.compile(r"network-online\.target"),
    CONTAINER_NOISE,
)


@pytest.fixture(scope="module")
def unit() -> Unit:
    """The parsed unit file."""
    return parse_unit(UNIT.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("Unit", "After", "network-online.target nvidia-persistenced.service"),
        ("Unit", "Wants", "network-online.target"),
        ("Service", "Type", "notify"),
        ("Service", "NotifyAccess", "main"),
        ("Service", "ExecStart", "/opt/polca/bin/polca agent --config /etc/polca/agent.yaml"),
        ("Service", "ExecReload", "/bin/kill -HUP $MAINPID"),
        ("Service", "WatchdogSec", "10s"),
        ("Service", "Restart", "on-failure"),
        ("Service", "RestartSec", "2"),
        ("Service", "TimeoutStartSec", "60"),
        ("Service", "TimeoutStopSec", "20"),
        ("Service", "KillSignal", "SIGTERM"),
        ("Service", "EnvironmentFile", "-/etc/default/polca-agent"),
        ("Service", "SyslogIdentifier", "polca-agent"),
        ("Service", "CapabilityBoundingSet", "CAP_SYS_ADMIN"),
        ("Service", "NoNewPrivileges", "yes"),
        ("Service", "DevicePolicy", "closed"),
        ("Service", "PrivateDevices", "no"),
        ("Service", "ProtectSystem", "strict"),
        ("Service", "ProtectHome", "yes"),
        ("Service", "PrivateTmp", "yes"),
        ("Service", "ProtectKernelModules", "yes"),
        ("Service", "ProtectKernelLogs", "yes"),
        ("Service", "ProtectKernelTunables", "yes"),
        ("Service", "ProtectControlGroups", "yes"),
        ("Service", "ProtectHostname", "yes"),
        ("Service", "ProtectClock", "yes"),
        ("Service", "RestrictNamespaces", "yes"),
        ("Service", "RestrictRealtime", "yes"),
        ("Service", "RestrictSUIDSGID", "yes"),
        ("Service", "LockPersonality", "yes"),
        ("Service", "RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
        ("Service", "SystemCallArchitectures", "native"),
        ("Service", "SystemCallFilter", "@system-service"),
        ("Service", "StateDirectory", "polca"),
        ("Service", "RuntimeDirectory", "polca"),
        ("Service", "ConfigurationDirectory", "polca"),
        ("Service", "LoadCredential", "mqtt_password:/etc/polca/mqtt.pass"),
        ("Install", "WantedBy", "multi-user.target"),
    ],
)
def test_key_directive(unit: Unit, section: str, key: str, value: str) -> None:
    """Each key directive is set exactly once, to the documented value."""
    assert unit[section].get(key) == [value]


def test_device_allow_covers_nvidia_nodes(unit: Unit) -> None:
    """DeviceAllow= opens the NVML control, per-GPU and MIG capability device groups."""
    allowed = set(unit["Service"]["DeviceAllow"])
    assert {
        "char-nvidiactl rw",
        "char-nvidia-frontend rw",
        "char-nvidia-caps rw",
    } <= allowed
    assert all(entry.startswith("char-nvidia") for entry in allowed)


def test_runs_as_root_without_ambient_capabilities(unit: Unit) -> None:
    """No User=/DynamicUser=/AmbientCapabilities=: root limited by the bounding set alone."""
    for key in ("User", "DynamicUser", "AmbientCapabilities", "PrivateUsers"):
        assert key not in unit["Service"], key


def test_every_directive_has_a_comment_above() -> None:
    """Every KEY=value line directly follows a comment line (systemd has no trailing comments)."""
    text = UNIT.read_text(encoding="utf-8")
    assert uncommented_directives(text) == []
    assert directive_count(text) >= 40


def test_no_trailing_comments_on_directive_lines() -> None:
    """systemd would take a trailing '# ...' as part of the value."""
    assert trailing_comments(UNIT.read_text(encoding="utf-8")) == []


def test_stop_timeout_exceeds_restore_bound(unit: Unit) -> None:
    """TimeoutStopSec= leaves the agent time to restore GPU settings before SIGKILL."""
    stop_timeout_s = float(unit["Service"]["TimeoutStopSec"][0])
    assert stop_timeout_s >= 2 * Settings().agent.stop_timeout_s


def test_credential_name_is_what_settings_read(
    unit: Unit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The LoadCredential= id is the file name settings read from $CREDENTIALS_DIRECTORY."""
    credential_id = unit["Service"]["LoadCredential"][0].split(":", 1)[0]
    (tmp_path / credential_id).write_text("s3cret\n", encoding="utf-8")
    monkeypatch.delenv("POLCA_CONFIG", raising=False)
    monkeypatch.delenv("POLCA_MQTT__PASSWORD", raising=False)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    monkeypatch.setenv("POLCA_MQTT__USERNAME", "polca-agent")
    settings = load_settings()
    assert settings.mqtt.password is not None
    assert settings.mqtt.password.get_secret_value() == "s3cret"


def test_state_directory_is_the_settings_default(
    unit: Unit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """StateDirectory=polca is /var/lib/polca, where settings save GPU settings by default."""
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    assert Path("/var/lib") / unit["Service"]["StateDirectory"][0] == Settings().agent.state_dir


def test_env_example_names_real_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every POLCA_* line of the env example, uncommented, is accepted and applied."""
    examples = re.findall(r"(?m)^#(POLCA_\w+)=(.*)$", ENV_EXAMPLE.read_text(encoding="utf-8"))
    names = {name for name, _ in examples}
    assert {
        "POLCA_MQTT__HOST",
        "POLCA_TOPICS__ROW",
        "POLCA_TOPICS__RACK",
        "POLCA_AGENT__OBSERVE_ONLY",
    } <= names
    assert not any("PASSWORD" in name for name in names)
    for name in [n for n in os.environ if n.startswith("POLCA_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    for name, value in examples:
        monkeypatch.setenv(name, value)
    settings = load_settings()
    for name, value in examples:
        group, field = name.removeprefix("POLCA_").lower().split("__")
        actual = getattr(getattr(settings, group), field)
        shown = str(actual).lower() if isinstance(actual, bool) else str(actual)
        assert shown == value, name


def test_env_example_sets_nothing_by_default() -> None:
    """Copied as is, the env example overrides nothing: every assignment is commented out."""
    lines = ENV_EXAMPLE.read_text(encoding="utf-8").splitlines()
    assert [line for line in lines if line.strip() and not line.startswith("#")] == []


def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    """systemd-analyze verify reports no problem with the unit (ExecStart= made to exist)."""
    text = UNIT.read_text(encoding="utf-8")
    assert verify(tmp_path, UNIT.name, text, host_noise=_HOST_NOISE) == (0, [])


def test_systemd_analyze_verify_catches_mistakes(tmp_path: Path) -> None:
    """The verify check is real: a misspelt key and a bad value are reported."""
    text = UNIT.read_text(encoding="utf-8")
    text = text.replace("NoNewPrivileges=yes", "NoNewPrivilegs=yes")
    text = text.replace("DevicePolicy=closed", "DevicePolicy=shut")
    _, problems = verify(tmp_path, UNIT.name, text, host_noise=_HOST_NOISE)
    assert "NoNewPrivilegs" in "\n".join(problems)
    assert "device policy" in "\n".join(problems)


def test_security_exposure_is_low() -> None:
    """systemd-analyze security --offline scores the sandbox below MAX_EXPOSURE."""
    score = exposure(UNIT)
    assert score < MAX_EXPOSURE, f"exposure {score} >= {MAX_EXPOSURE}"
