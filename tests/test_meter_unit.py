"""polca-meter.service: no privilege, a comment on every directive, systemd's own checks,
and credentials named as the meter's settings read them."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from polca.meter.config import MeterSettings
from polca.meter.snmp import SnmpSource
from polca.settings import load_settings_as, read_secret
from tests.systemd_units import (
    CONTAINER_NOISE,
    Unit,
    assert_documented,
    assert_verified,
    exposure,
    parse_unit,
)

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "polca-meter.service"
AGENT_UNIT = ROOT / "systemd" / "polca-agent.service"
EXAMPLE = ROOT / "deploy" / "meter.example.yaml"
_HOST_NOISE = (re.compile(r"(network-online\.target|mosquitto\.service)"), CONTAINER_NOISE)


@pytest.fixture(scope="module")
def unit() -> Unit:
    """The parsed unit file."""
    return parse_unit(UNIT.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("ExecStart", "/opt/polca/bin/polca meter run --config /etc/polca/meter.yaml"),
        ("Restart", "on-failure"),
        ("RestartPreventExitStatus", "78"),
        ("DynamicUser", "yes"),
        ("CapabilityBoundingSet", ""),
        ("PrivateDevices", "yes"),
        ("ProtectSystem", "strict"),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
        ("SyslogIdentifier", "polca-meter"),
    ],
)
def test_key_directive(unit: Unit, key: str, value: str) -> None:
    """Each key directive is set exactly once, to the documented value."""
    assert unit["Service"].get(key) == [value]


def test_every_directive_is_commented_and_none_trails() -> None:
    """A comment above every KEY=value line, none after one."""
    assert_documented(UNIT.read_text(encoding="utf-8"), at_least=40)


def test_credentials_are_what_the_meter_reads(
    unit: Unit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LoadCredential= ids are the names the settings and the sources read secrets from."""
    ids = [value.split(":", 1)[0] for value in unit["Service"]["LoadCredential"]]
    assert ids == ["mqtt_password", "snmp_community", "redfish_password"]
    for name in ids:
        (tmp_path / name).write_text(f"{name}-secret\n", encoding="utf-8")
    for name in [n for n in os.environ if n.startswith("POLCA_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    monkeypatch.setenv("POLCA_MQTT__USERNAME", "polca-meter")
    settings = load_settings_as(MeterSettings, EXAMPLE)
    assert settings.mqtt.password is not None
    assert settings.mqtt.password.get_secret_value() == "mqtt_password-secret"
    snmp = settings.rows[0].sources[0]
    assert snmp.protocol == "snmp"
    assert read_secret(snmp.community_file, snmp.community_credential) == "snmp_community-secret"
    SnmpSource(snmp)  # finds its community without a file
    redfish = settings.rows[1].sources[0]
    assert redfish.protocol == "redfish"
    endpoint = redfish.endpoint
    assert read_secret(endpoint.password_file, endpoint.credential) == "redfish_password-secret"


def test_systemd_analyze_verify_is_clean_and_catches_mistakes(tmp_path: Path) -> None:
    """systemd-analyze verify is clean, and reports a misspelt key."""
    text = UNIT.read_text(encoding="utf-8")
    misspelt = ("DynamicUser=yes", "DynamicUsr=yes")
    assert_verified(tmp_path, UNIT.name, text, misspelt=misspelt, host_noise=_HOST_NOISE)


def test_security_exposure_is_below_the_agents() -> None:
    """The sandbox scores well below the agent's (which needs the GPUs)."""
    score = exposure(UNIT)
    assert score < 2.0
    assert score < exposure(AGENT_UNIT)


def test_two_meters_of_one_site_hold_different_client_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One meter process per row (a broker user per row's meter) must not evict another."""
    for name in [n for n in os.environ if n.startswith("POLCA_")]:
        monkeypatch.delenv(name)
    whole = load_settings_as(MeterSettings, EXAMPLE)
    assert [r.row for r in whole.rows][:2] == ["row1", "row2"]
    ids = {whole.model_copy(update={"rows": (row,)}).client_id: row.row for row in whole.rows}
    assert ids == {"polca-meter-site-row1": "row1", "polca-meter-site-row2": "row2"}
    assert whole.client_id == "polca-meter-site-row1"
    assert whole.model_copy(update={"rows": ()}).client_id == "polca-meter-site"
    chosen = whole.model_copy(update={"mqtt": whole.mqtt.model_copy(update={"client_id": "m7"})})
    assert chosen.client_id == "m7"
