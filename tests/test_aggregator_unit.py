"""polca-aggregator.service: no privilege, a comment on every directive, systemd's own checks.

Mirrors ``test_systemd_unit.py`` (the agent's unit), with the same parser and
``systemd-analyze`` runs (``tests/systemd_units.py``).
``systemd-analyze`` must be installed (Debian package ``systemd``); these tests fail, not
skip, without it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from polca.aggregator.config import AggregatorSettings
from polca.export.influx import resolve_token
from polca.settings import load_settings_as
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
UNIT = ROOT / "systemd" / "polca-aggregator.service"
AGENT_UNIT = ROOT / "systemd" / "polca-agent.service"
EXAMPLE_CONFIG = ROOT / "deploy" / "aggregator.example.yaml"

# The aggregator needs no privilege, so its sandbox must score well below this (and below
# the agent's, which needs CAP_SYS_ADMIN and the GPU device nodes).
MAX_EXPOSURE = 2.0

# Lines systemd-analyze may print about the host rather than the unit: units named in
# After=/Wants= that do not exist here, and probes that fail in containers.
_HOST_NOISE = (
    re.compile(r"(network-online\.target|mosquitto\.service|influxdb\.service)"),
    CONTAINER_NOISE,
)


@pytest.fixture(scope="module")
def unit() -> Unit:
    """The parsed unit file."""
    return parse_unit(UNIT.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("Unit", "Wants", "network-online.target"),
        ("Service", "Type", "notify"),
        ("Service", "NotifyAccess", "main"),
        (
            "Service",
            "ExecStart",
            "/opt/polca/bin/polca aggregator --config /etc/polca/aggregator.yaml",
        ),
        ("Service", "ExecReload", "/bin/kill -HUP $MAINPID"),
        ("Service", "WatchdogSec", "10s"),
        ("Service", "Restart", "on-failure"),
        ("Service", "RestartPreventExitStatus", "78"),
        ("Service", "KillSignal", "SIGTERM"),
        ("Service", "SyslogIdentifier", "polca-aggregator"),
        ("Service", "DynamicUser", "yes"),
        ("Service", "CapabilityBoundingSet", ""),
        ("Service", "AmbientCapabilities", ""),
        ("Service", "NoNewPrivileges", "yes"),
        ("Service", "PrivateUsers", "yes"),
        ("Service", "PrivateDevices", "yes"),
        ("Service", "DevicePolicy", "closed"),
        ("Service", "ProtectSystem", "strict"),
        ("Service", "ProtectHome", "yes"),
        ("Service", "PrivateTmp", "yes"),
        ("Service", "ProtectKernelModules", "yes"),
        ("Service", "ProtectKernelLogs", "yes"),
        ("Service", "ProtectKernelTunables", "yes"),
        ("Service", "ProtectControlGroups", "yes"),
        ("Service", "ProtectHostname", "yes"),
        ("Service", "ProtectClock", "yes"),
        ("Service", "ProtectProc", "invisible"),
        ("Service", "ProcSubset", "pid"),
        ("Service", "RestrictNamespaces", "yes"),
        ("Service", "RestrictRealtime", "yes"),
        ("Service", "RestrictSUIDSGID", "yes"),
        ("Service", "LockPersonality", "yes"),
        ("Service", "MemoryDenyWriteExecute", "yes"),
        ("Service", "RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
        ("Service", "SystemCallArchitectures", "native"),
        ("Service", "StateDirectory", "polca-aggregator"),
        ("Service", "StateDirectoryMode", "0700"),
        ("Service", "ConfigurationDirectory", "polca"),
        ("Install", "WantedBy", "multi-user.target"),
    ],
)
def test_key_directive(unit: Unit, section: str, key: str, value: str) -> None:
    """Each key directive is set exactly once, to the documented value."""
    assert unit[section].get(key) == [value]


def test_system_call_filter(unit: Unit) -> None:
    """The typical service set, minus privileged calls and resource tuning, EPERM on others."""
    assert unit["Service"]["SystemCallFilter"] == ["@system-service", "~@privileged @resources"]
    assert unit["Service"]["SystemCallErrorNumber"] == ["EPERM"]


def test_credentials(unit: Unit) -> None:
    """The MQTT password and the InfluxDB token come in as systemd credentials."""
    assert unit["Service"]["LoadCredential"] == [
        "mqtt_password:/etc/polca/aggregator-mqtt.pass",
        "influx_token:/etc/polca/influx.token",
    ]


def test_has_no_privilege(unit: Unit) -> None:
    """No fixed user, no capability, no device: unlike the agent, nothing to grant."""
    service = unit["Service"]
    for key in ("User", "Group", "DeviceAllow", "SupplementaryGroups"):
        assert key not in service, key
    assert [value for value in service["CapabilityBoundingSet"] if value] == []
    assert [value for value in service["AmbientCapabilities"] if value] == []


def test_every_directive_has_a_comment_above() -> None:
    """Every KEY=value line directly follows a comment line (systemd has no trailing comments)."""
    text = UNIT.read_text(encoding="utf-8")
    assert uncommented_directives(text) == []
    assert directive_count(text) >= 45


def test_no_trailing_comments_on_directive_lines() -> None:
    """systemd would take a trailing '# ...' as part of the value."""
    assert trailing_comments(UNIT.read_text(encoding="utf-8")) == []


def test_credential_names_are_what_the_aggregator_reads(
    unit: Unit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The LoadCredential= ids are the file names the aggregator reads its secrets from."""
    ids = [value.split(":", 1)[0] for value in unit["Service"]["LoadCredential"]]
    (tmp_path / ids[0]).write_text("s3cret\n", encoding="utf-8")
    (tmp_path / ids[1]).write_text("t0ken\n", encoding="utf-8")
    for name in [n for n in os.environ if n.startswith("POLCA_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    monkeypatch.setenv("POLCA_MQTT__USERNAME", "polca-aggregator")
    settings = load_settings_as(AggregatorSettings)
    assert settings.mqtt.password is not None
    assert settings.mqtt.password.get_secret_value() == "s3cret"
    assert resolve_token(settings.influx) == "t0ken"


def test_state_directory_is_the_settings_default(
    unit: Unit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """StateDirectory= is where the aggregator keeps its state when systemd says nothing."""
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    for name in [n for n in os.environ if n.startswith("POLCA_")]:
        monkeypatch.delenv(name)
    settings = load_settings_as(AggregatorSettings)
    assert settings.state_dir == Path("/var/lib") / unit["Service"]["StateDirectory"][0]


def test_example_spool_is_in_the_state_directory(unit: Unit) -> None:
    """The example configuration spools InfluxDB points under StateDirectory=, the one
    writable place."""
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
    spool = Path(config["influx"]["spool_dir"])
    state = Path("/var/lib") / unit["Service"]["StateDirectory"][0]
    assert spool.is_relative_to(state)


def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    """systemd-analyze verify reports no problem with the unit (ExecStart= made to exist)."""
    text = UNIT.read_text(encoding="utf-8")
    assert verify(tmp_path, UNIT.name, text, host_noise=_HOST_NOISE) == (0, [])


def test_systemd_analyze_verify_catches_mistakes(tmp_path: Path) -> None:
    """The verify check is real: a misspelt key and a bad value are reported."""
    text = UNIT.read_text(encoding="utf-8")
    text = text.replace("DynamicUser=yes", "DynamicUsr=yes")
    text = text.replace("ProtectProc=invisible", "ProtectProc=hidden-ish")
    _, problems = verify(tmp_path, UNIT.name, text, host_noise=_HOST_NOISE)
    assert "DynamicUsr" in "\n".join(problems)
    assert "/proc/ protection mode" in "\n".join(problems)


def test_security_exposure_is_below_the_agents() -> None:
    """systemd-analyze security --offline scores the sandbox below MAX_EXPOSURE and the agent."""
    score = exposure(UNIT)
    assert score < MAX_EXPOSURE, f"exposure {score} >= {MAX_EXPOSURE}"
    agent = exposure(AGENT_UNIT)
    assert score < agent, f"aggregator {score} >= agent {agent}"


HA_DROP_IN = ROOT / "systemd" / "polca-aggregator-ha.conf"


def test_ha_drop_in_is_commented_and_its_credential_is_what_settings_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The high-availability drop-in: a comment on every directive, and its etcd password
    credential is the file the aggregator reads ``ha.password`` from."""
    text = HA_DROP_IN.read_text(encoding="utf-8")
    assert uncommented_directives(text) == []
    assert trailing_comments(text) == []
    drop_in = parse_unit(text)
    assert drop_in["Unit"]["After"] == ["etcd.service"]
    (credential,) = drop_in["Service"]["LoadCredential"]
    credential_id = credential.split(":", 1)[0]
    (tmp_path / credential_id).write_text("etcd-s3cret\n", encoding="utf-8")
    for name in [n for n in os.environ if n.startswith("POLCA_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    config = tmp_path / "aggregator.yaml"
    config.write_text(
        yaml.safe_dump({"ha": {"etcd_endpoints": ["https://etcd1:2379"], "username": "polca-agg"}}),
        encoding="utf-8",
    )
    settings = load_settings_as(AggregatorSettings, config)
    assert settings.ha.secret() == "etcd-s3cret"


BMC_DROP_IN = ROOT / "systemd" / "polca-aggregator-bmc.conf"


def test_bmc_drop_in_is_commented_and_its_credential_is_what_the_bmc_endpoints_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The out-of-band caps drop-in: a comment on every directive, and its credential is
    the file a BMC endpoint configured as in deploy/aggregator.example.yaml reads."""
    from polca.redfish.api import RedfishEndpoint
    from polca.settings import read_secret

    text = BMC_DROP_IN.read_text(encoding="utf-8")
    assert uncommented_directives(text) == []
    assert trailing_comments(text) == []
    (credential,) = parse_unit(text)["Service"]["LoadCredential"]
    credential_id = credential.split(":", 1)[0]
    (tmp_path / credential_id).write_text("bmc-s3cret\n", encoding="utf-8")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    example = EXAMPLE_CONFIG.read_text(encoding="utf-8")
    assert f"credential: {credential_id}" in example
    endpoint = RedfishEndpoint(url="https://10.2.0.11", credential=credential_id)
    assert read_secret(endpoint.password_file, endpoint.credential) == "bmc-s3cret"
    config = yaml.safe_load(example)
    assert config["bmc"]["nodes"] == {}  # off until an operator lists the nodes
