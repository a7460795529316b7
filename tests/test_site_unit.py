"""polca-site.service: no privilege, a comment on every directive, systemd's own checks,
credentials named as the site controller's settings read them, and its example settings.

Mirrors ``test_meter_unit.py``, with the same parser and ``systemd-analyze`` runs
(``tests/systemd_units.py``); ``systemd-analyze`` must be installed (Debian package
``systemd``): these tests fail, not skip, without it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from polca import service
from polca.export.influx import resolve_token
from polca.powertree.sitefile import load_site
from polca.settings import load_settings_as
from polca.sitectl.config import SiteSettings
from tests.systemd_units import (
    CONTAINER_NOISE,
    Unit,
    assert_documented,
    assert_verified,
    exposure,
    parse_unit,
)

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "polca-site.service"
AGENT_UNIT = ROOT / "systemd" / "polca-agent.service"
EXAMPLE = ROOT / "deploy" / "site" / "controller.example.yaml"
SITE_EXAMPLE = ROOT / "deploy" / "site" / "site.example.yaml"
_HOST_NOISE = (
    re.compile(r"(network-online\.target|mosquitto\.service|etcd\.service)"),
    CONTAINER_NOISE,
)


@pytest.fixture(scope="module")
def unit() -> Unit:
    """The parsed unit file."""
    return parse_unit(UNIT.read_text(encoding="utf-8"))


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No POLCA_* variable and no credentials directory from the test's environment."""
    for name in [n for n in os.environ if n.startswith("POLCA_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("ExecStart", "/opt/polca/bin/polca site run --config /etc/polca/site-controller.yaml"),
        ("Restart", "on-failure"),
        ("RestartPreventExitStatus", "78"),
        ("DynamicUser", "yes"),
        ("CapabilityBoundingSet", ""),
        ("PrivateDevices", "yes"),
        ("ProtectSystem", "strict"),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
        ("SyslogIdentifier", "polca-site"),
    ],
)
def test_key_directive(unit: Unit, key: str, value: str) -> None:
    """Each key directive is set exactly once, to the documented value."""
    assert unit["Service"].get(key) == [value]


def test_every_directive_is_commented_and_none_trails() -> None:
    """A comment above every KEY=value line, none after one."""
    assert_documented(UNIT.read_text(encoding="utf-8"), at_least=40)


def test_credentials_are_what_the_site_controller_reads(
    unit: Unit, tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    """LoadCredential= ids are the names the settings read the MQTT and etcd passwords
    and the InfluxDB token from, for the example's users."""
    ids = [value.split(":", 1)[0] for value in unit["Service"]["LoadCredential"]]
    assert ids == ["mqtt_password", "ha_password", "influx_token"]
    for name in ids:
        (tmp_path / name).write_text(f"{name}-secret\n", encoding="utf-8")
    clean_env.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    settings = load_settings_as(SiteSettings, EXAMPLE)
    assert settings.mqtt.username == "polca-site"
    assert settings.mqtt.password is not None
    assert settings.mqtt.password.get_secret_value() == "mqtt_password-secret"
    assert settings.ha.username == "polca-site"
    assert settings.ha.secret() == "ha_password-secret"
    assert resolve_token(settings.influx) == "influx_token-secret"


def test_the_spool_defaults_to_the_units_state_directory(
    unit: Unit, clean_env: pytest.MonkeyPatch
) -> None:
    """state_dir defaults to $STATE_DIRECTORY, which StateDirectory= makes the one
    writable place under ProtectSystem=strict."""
    (name,) = unit["Service"]["StateDirectory"]
    clean_env.setenv("STATE_DIRECTORY", f"/var/lib/{name}")
    settings = load_settings_as(SiteSettings, EXAMPLE)
    assert settings.state_dir == Path("/var/lib/polca-site")
    assert settings.influx.url is not None
    assert settings.influx.spool_dir is None  # the example leaves it to state_dir


def test_the_example_settings_load_and_name_the_installed_site_file(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """controller.example.yaml is valid SiteSettings, runs active/standby, names the site
    example's install path, and that site file is a sound tree."""
    settings = load_settings_as(SiteSettings, EXAMPLE)
    assert settings.tree_file == Path("/etc/polca/site.yaml")
    assert (settings.site, settings.instance) == ("dc1", "site1")
    assert settings.client_id == "polca-site-dc1-site1"
    assert settings.ha.enabled
    assert settings.ha.lease_ttl_s * 2 <= settings.lease_s
    assert settings.mqtt.password is None  # no credential here, and none in the file
    tree = load_site(SITE_EXAMPLE)
    assert sorted(tree.rows) == ["row1", "row2"]


def test_the_stop_fits_in_timeout_stop_sec(unit: Unit) -> None:
    """systemd kills the controller after TimeoutStopSec: the resignation on etcd, the
    sinks' last writes and the broker's last flush, each bounded, must fit, or the lead
    is not handed over."""
    (value,) = unit["Service"]["TimeoutStopSec"]
    bounds = service.STOP_BOUNDS
    assert bounds.session_s + bounds.sinks_s + bounds.final_messages_s < float(value)


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
