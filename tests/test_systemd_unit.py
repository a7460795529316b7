"""polca-agent.service: key directives, a comment on every directive, systemd's own checks.

``systemd-analyze`` must be installed (Debian package ``systemd``); these tests fail, not
skip, without it, so CI cannot silently stop checking the unit.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from polca.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "polca-agent.service"
ENV_EXAMPLE = ROOT / "systemd" / "polca-agent.env.example"

# systemd's overall exposure score (0 = locked down, 10 = unprotected) must stay below this.
MAX_EXPOSURE = 3.0

Unit = dict[str, dict[str, list[str]]]


def _parse_unit(text: str) -> Unit:
    """Sections -> key -> every value in order (unit files repeat keys, e.g. DeviceAllow=)."""
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"line {number}: continuation lines are not parsed"
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"line {number}: directive outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"line {number}: not a KEY=value line: {raw!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return unit


@pytest.fixture(scope="module")
def unit() -> Unit:
    """The parsed unit file."""
    return _parse_unit(UNIT.read_text(encoding="utf-8"))


def _systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.fail(
            "systemd-analyze not found: install it with `apt-get install systemd` "
            "(the unit file is checked by systemd itself)"
        )
    return path


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # Warnings and errors only, no colours, on the console; no man page lookups.
    env = {
        **os.environ,
        "SYSTEMD_LOG_LEVEL": "warning",
        "SYSTEMD_LOG_COLOR": "0",
        "SYSTEMD_LOG_TARGET": "console",
        "SYSTEMD_PAGER": "",
    }
    return subprocess.run(
        argv, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def _verifiable_copy(tmp_path: Path, text: str) -> Path:
    """The unit with ExecStart= pointing at an existing binary, as verify checks that."""
    rewritten, count = re.subn(r"(?m)^ExecStart=\S+", "ExecStart=/bin/true", text)
    assert count == 1
    path = tmp_path / UNIT.name
    path.write_text(rewritten, encoding="utf-8")
    return path


# Lines systemd-analyze may print about the host rather than the unit: units named in
# After=/Wants= that do not exist without a GPU driver, and probes that fail in containers.
_HOST_NOISE = (
    re.compile(r"nvidia-persistenced\.service"),
    re.compile(r"network-online\.target"),
    re.compile(r"Failed to read \$container|PR_SET_MM_|Cannot stat .*/transient"),
)


def _verify_problems(output: str) -> list[str]:
    lines = [line for line in output.splitlines() if line.strip()]
    return [line for line in lines if not any(p.search(line) for p in _HOST_NOISE)]


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
    lines = UNIT.read_text(encoding="utf-8").splitlines()
    uncommented = [
        f"{number}: {line}"
        for number, (previous, line) in enumerate(zip(["", *lines], lines, strict=False), 1)
        if re.match(r"^[A-Za-z]+=", line) and not previous.lstrip().startswith("#")
    ]
    assert uncommented == []
    assert sum(1 for line in lines if re.match(r"^[A-Za-z]+=", line)) >= 40


def test_no_trailing_comments_on_directive_lines() -> None:
    """systemd would take a trailing '# ...' as part of the value."""
    lines = UNIT.read_text(encoding="utf-8").splitlines()
    assert [line for line in lines if "=" in line and " #" in line.split("=", 1)[1]] == []


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
    analyze = _systemd_analyze()
    path = _verifiable_copy(tmp_path, UNIT.read_text(encoding="utf-8"))
    result = _run([analyze, "verify", "--man=no", "--recursive-errors=no", path.name], tmp_path)
    problems = _verify_problems(result.stdout + result.stderr)
    assert (result.returncode, problems) == (0, [])


def test_systemd_analyze_verify_catches_mistakes(tmp_path: Path) -> None:
    """The verify check is real: a misspelt key and a bad value are reported."""
    analyze = _systemd_analyze()
    text = UNIT.read_text(encoding="utf-8")
    text = text.replace("NoNewPrivileges=yes", "NoNewPrivilegs=yes")
    text = text.replace("DevicePolicy=closed", "DevicePolicy=shut")
    path = _verifiable_copy(tmp_path, text)
    result = _run([analyze, "verify", "--man=no", "--recursive-errors=no", path.name], tmp_path)
    problems = "\n".join(_verify_problems(result.stdout + result.stderr))
    assert "NoNewPrivilegs" in problems
    assert "device policy" in problems


def test_security_exposure_is_low() -> None:
    """systemd-analyze security --offline scores the sandbox below MAX_EXPOSURE."""
    analyze = _systemd_analyze()
    help_text = _run([analyze, "security", "--help"], ROOT).stdout
    if "--offline" not in help_text:
        pytest.skip("this systemd-analyze has no offline security review (needs systemd >= 250)")
    result = _run([analyze, "security", "--offline=true", str(UNIT)], ROOT)
    match = re.search(r"Overall exposure level for polca-agent\.service: ([0-9.]+)", result.stdout)
    assert match is not None, result.stdout + result.stderr
    exposure = float(match.group(1))
    assert exposure < MAX_EXPOSURE, f"exposure {exposure} >= {MAX_EXPOSURE}"
