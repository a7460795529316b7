"""The SNMP meter source against a real agent (snmpsim on loopback): each vendor, v2c, v3,
failures and recovery."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from polca.errors import ConfigError, ReadingRejectedError, TransportAuthError, TransportError
from polca.meter.snmp import SnmpSource, SnmpSourceConfig, probe
from polca.meter.ups import UPS_OIDS
from tests.snmpsim import (
    V3_AUTH_KEY,
    V3_PRIV_KEY,
    V3_PROBE_PASSWORD,
    V3_PROBE_USER,
    V3_USER,
    SnmpSimProcess,
)


def config(agent: SnmpSimProcess, **fields: Any) -> SnmpSourceConfig:
    """A source of the agent, short timeouts."""
    base: dict[str, Any] = {
        "protocol": "snmp",
        "name": "pdu-a1",
        "host": agent.host,
        "port": agent.port,
        "timeout_s": 0.5,
        "retries": 1,
    }
    return SnmpSourceConfig.model_validate(base | fields)


async def read_once(cfg: SnmpSourceConfig, **secrets: str) -> Any:
    """One read through a fresh source, closed afterwards."""
    source = SnmpSource(cfg, **secrets)
    try:
        return await source.read()
    finally:
        await source.close()


@pytest.mark.parametrize(
    ("community", "fields", "watts", "detail", "fallbacks"),
    [
        ("apc", {}, 5230.0, "device power", ()),
        (
            "apc-phases",
            {},
            4800.0,
            "phase power (3 phases)",
            ("device power: -1 (not supported)",),
        ),
        (
            "apc-switched",
            {},
            (10.0 + 12.0 + 11.0) * 230 * 0.95,
            "phase current x phase voltage x power factor 0.95 (3 phases)",
            ("device power: -1 (not supported)", "phase power: -1 (not supported): row 2"),
        ),
        (
            "apc-legacy",
            {"profile": "apc_legacy", "nominal_voltage_v": 230.0},
            12.4 * 230 * 0.95,
            "phase current x nominal voltage 230 V x power factor 0.95 (1 phases)",
            (),
        ),
        ("raritan", {}, 2716.0, "inlet active power", ()),
        ("servertech", {}, 3120.0, "input cord active power", ()),
        ("eaton", {}, 4410.0, "input total power", ()),
        ("vertiv", {}, 3890.0, "total real power", ()),
        (
            "generic",
            {
                "profile": "generic",
                "generic": [
                    {"oid": "1.3.6.1.4.1.99999.2.9.0", "kind": "power_w"},
                    {"oid": "1.3.6.1.4.1.99999.2.1.0", "kind": "power_w", "scale": 0.1},
                ],
            },
            1234.5,
            "power_w",
            ("power_w: no such object",),
        ),
    ],
)
async def test_each_vendor_reads_its_power(
    snmpsim: SnmpSimProcess,
    *,
    community: str,
    fields: dict[str, Any],
    watts: float,
    detail: str,
    fallbacks: tuple[str, ...],
) -> None:
    """Every recorded PDU gives its watts through SnmpSource, with the value used and skipped."""
    reading = await read_once(config(snmpsim, **fields), community=community)
    assert reading.power_w == pytest.approx(watts)
    assert reading.detail == detail
    assert reading.fallbacks == fallbacks


async def test_auto_profile_is_discovered_once_and_kept(snmpsim: SnmpSimProcess) -> None:
    """``auto`` reads sysObjectID at the first poll and keeps the profile for later ones."""
    source = SnmpSource(config(snmpsim), community="servertech")
    try:
        assert source.profile is None
        first = await source.read()
        profile = source.profile
        assert profile is not None
        assert profile.name == "servertech"
        assert source.identity is not None
        assert source.identity.sys_object_id == "1.3.6.1.4.1.1718.4"
        second = await source.read()
        assert source.profile is profile
        assert first.power_w == second.power_w == 3120.0
    finally:
        await source.close()
        await source.close()  # idempotent


@pytest.mark.parametrize(
    ("community", "reason"), [("hostile-string", "type"), ("hostile-huge", "absurd")]
)
async def test_hostile_values_are_rejected(
    snmpsim: SnmpSimProcess, community: str, reason: str
) -> None:
    """A string or a huge number where device power should be is refused, not used."""
    with pytest.raises(ReadingRejectedError) as caught:
        await read_once(config(snmpsim), community=community)
    assert caught.value.reason == reason


async def test_wrong_community_times_out_quickly(snmpsim: SnmpSimProcess) -> None:
    """A v2c agent ignores a wrong community: a TransportError after the timeout."""
    cfg = config(snmpsim, timeout_s=0.3, retries=0)
    started = time.monotonic()
    with pytest.raises(TransportError, match="No SNMP response"):
        await read_once(cfg, community="no-such-community")
    assert time.monotonic() - started < 2.0


async def test_v3_auth_priv_reads_with_keys_from_files(
    snmpsim: SnmpSimProcess, tmp_path: Path
) -> None:
    """SNMPv3 authPriv (SHA/AES) with the keys in files reads the context's PDU."""
    (tmp_path / "auth").write_text(V3_AUTH_KEY + "\n")
    (tmp_path / "priv").write_text(V3_PRIV_KEY + "\n")
    cfg = config(
        snmpsim,
        version="3",
        username=V3_USER,
        auth_protocol="sha",
        auth_key_file=tmp_path / "auth",
        priv_protocol="aes",
        priv_key_file=tmp_path / "priv",
        context_name="eaton",
    )
    reading = await read_once(cfg)
    assert reading.power_w == 4410.0


async def test_v3_wrong_key_is_an_authentication_error(snmpsim: SnmpSimProcess) -> None:
    """A refused SNMPv3 key is fatal (``TransportAuthError``), not retried as a timeout."""
    cfg = config(snmpsim, version="3", username=V3_USER, context_name="eaton", retries=0)
    with pytest.raises(TransportAuthError):
        await read_once(cfg, auth_key="wrong-auth-key", priv_key=V3_PRIV_KEY)


async def test_unknown_vendor_and_missing_oids_are_config_errors(
    snmpsim: SnmpSimProcess,
) -> None:
    """Auto on an unknown vendor, or a profile whose OIDs the device lacks: ConfigError."""
    with pytest.raises(ConfigError, match="unknown PDU vendor"):
        await read_once(config(snmpsim), community="generic")
    with pytest.raises(ConfigError, match="has none of profile apc's values"):
        await read_once(config(snmpsim), community="apc-legacy")
    with pytest.raises(ConfigError, match="has none of profile raritan's values"):
        await read_once(config(snmpsim, profile="raritan"), community="vertiv")


async def test_missing_community_secret_is_a_config_error(
    snmpsim: SnmpSimProcess, tmp_path: Path
) -> None:
    """No community given, no file and no credential: ConfigError naming where to put it."""
    cfg = config(snmpsim, community_file=tmp_path / "absent")
    with pytest.raises(ConfigError, match="community secret missing"):
        await read_once(cfg)
    (tmp_path / "present").write_text("vertiv\n")
    reading = await read_once(config(snmpsim, community_file=tmp_path / "present"))
    assert reading.power_w == 3890.0


async def test_stopped_agent_is_a_transport_error_then_recovers(
    snmpsim_own: SnmpSimProcess,
) -> None:
    """While the agent is down reads fail with TransportError; once back, they succeed."""
    source = SnmpSource(config(snmpsim_own, timeout_s=0.3, retries=0), community="apc")
    try:
        assert (await source.read()).power_w == 5230.0
        await asyncio.to_thread(snmpsim_own.stop)
        with pytest.raises(TransportError):
            await source.read()
        await asyncio.to_thread(snmpsim_own.start)
        assert (await source.read()).power_w == 5230.0
    finally:
        await source.close()


async def test_probe_reports_the_auto_detected_vendor(snmpsim: SnmpSimProcess) -> None:
    """``polca meter probe snmp://...`` says the power, the value used and the vendor."""
    url = f"snmp://{snmpsim.host}:{snmpsim.port}"
    result = await probe(url, community="apc-phases", username=None, password=None, profile=None)
    assert result == {
        "power_w": 4800.0,
        "source": "phase power (3 phases)",
        "vendor": "apc",
        "profile": "apc",
        "sys_object_id": "1.3.6.1.4.1.318.1.3.4.6",
        "sys_descr": result["sys_descr"],
        "fallbacks": ["device power: -1 (not supported)"],
    }
    assert str(result["sys_descr"]).startswith("APC Web/SNMP Management Card")


async def test_probe_v3_uses_the_password_for_both_keys(snmpsim: SnmpSimProcess) -> None:
    """The probe's one password is the SHA and the AES key; the URL's path is the context."""
    url = f"snmp://{snmpsim.host}:{snmpsim.port}/eaton"
    result = await probe(
        url, community=None, username=V3_PROBE_USER, password=V3_PROBE_PASSWORD, profile="eaton"
    )
    assert (result["power_w"], result["profile"], result["vendor"]) == (4410.0, "eaton", "eaton")
    with pytest.raises(TransportAuthError):
        await probe(url, community=None, username=V3_USER, password=V3_AUTH_KEY, profile=None)


@pytest.mark.parametrize("url", ["http://pdu:161", "snmp://", "snmp:pdu", "snmp://pdu:99999"])
async def test_probe_refuses_other_urls(url: str) -> None:
    """Only ``snmp://host[:port]`` is probed."""
    with pytest.raises(ConfigError):
        await probe(url, community="public", username=None, password=None, profile=None)


async def test_probe_refuses_an_unknown_profile() -> None:
    """A profile name that does not exist is refused before any packet is sent."""
    with pytest.raises(ConfigError, match="cannot probe"):
        await probe("snmp://127.0.0.1", community="x", username=None, password=None, profile="hp")


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"community": "public"}, "Extra inputs are not permitted"),
        ({"auth_key": "secret"}, "Extra inputs are not permitted"),
        ({"version": "3"}, "username is required"),
        ({"username": "polca"}, "username is required"),
        ({"profile": "generic"}, "generic lists the OIDs"),
        ({"profile": "apc_legacy"}, "nominal_voltage_v"),
        ({"power_factor": 0.0}, "greater than 0"),
        ({"power_factor": 1.2}, "less than or equal to 1"),
        ({"name": "bad name"}, "should match pattern"),
        ({"generic": [{"oid": "1.3.x", "kind": "power_w"}], "profile": "generic"}, "pattern"),
    ],
)
def test_config_refuses_secrets_and_inconsistencies(fields: dict[str, Any], error: str) -> None:
    """No secret can be written in YAML, and options that do not fit together are refused."""
    base = {"protocol": "snmp", "name": "pdu", "host": "pdu.example"}
    with pytest.raises(ValidationError, match=error):
        SnmpSourceConfig.model_validate(base | fields)


class Counting(SnmpSource):
    """A source that counts the requests it sends (to the real agent)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gets: list[tuple[str, ...]] = []
        self.walks: list[str] = []

    async def _get(self, oids: tuple[str, ...]) -> dict[str, object]:
        self.gets.append(oids)
        return await super()._get(oids)

    async def _walk(self, prefix: str) -> dict[str, object]:
        self.walks.append(prefix)
        return await super()._walk(prefix)


@pytest.mark.parametrize(
    ("community", "walks_first", "walks_after"),
    [
        ("apc", 0, 0),  # its total power: one GET, then one GET
        ("apc-phases", 2, 2),  # total -1: then phase power and its device column
        ("apc-switched", 4, 3),  # phase power -1 too: then current, voltage (and device)
    ],
)
async def test_a_read_asks_for_the_preferred_value_first_and_then_only_what_the_device_has(
    snmpsim: SnmpSimProcess, community: str, walks_first: int, walks_after: int
) -> None:
    """The first read asks for the most preferred value first and for the next only when
    the device does not support it; the next reads for the value found only, with the
    same answer and the first read's fallbacks."""
    source = Counting(config(snmpsim, profile="apc"), community=community)
    try:
        first = await source.read()
        assert len(source.walks) == walks_first
        source.gets.clear()
        source.walks.clear()
        again = await source.read()
        assert again == first
        assert len(source.walks) == walks_after
        assert sum(len(g) for g in source.gets) == (1 if walks_after == 0 else 0)
        assert again.fallbacks == first.fallbacks
    finally:
        await source.close()


async def test_sources_share_one_engine_per_loop_and_credentials(snmpsim: SnmpSimProcess) -> None:
    """Two v2c sources use one engine; the last to close closes it, the other reads on."""
    from polca.meter import snmp as snmp_module

    a = SnmpSource(config(snmpsim, name="a"), community="apc")
    b = SnmpSource(config(snmpsim, name="b"), community="raritan")
    before = dict(snmp_module._ENGINES)
    try:
        assert (await a.read()).power_w == 5230.0
        assert (await b.read()).power_w == 2716.0
        new = {k: v for k, v in snmp_module._ENGINES.items() if k not in before}
        assert len(new) == 1
        [(key, shared)] = new.items()
        assert shared.users == 2
        await a.close()
        assert (await b.read()).power_w == 2716.0
        await b.close()
        assert key not in snmp_module._ENGINES
    finally:
        await a.close()
        await b.close()


UPS_SOURCE = "1.3.6.1.2.1.33.1.4.1.0"  # upsOutputSource
UPS_MINUTES = "1.3.6.1.2.1.33.1.2.3.0"  # upsEstimatedMinutesRemaining
UPS_BATTERY = "1.3.6.1.2.1.33.1.2.1.0"  # upsBatteryStatus
UPS_INPUT_V = "1.3.6.1.2.1.33.1.3.3.1.3.1"  # upsInputVoltage, line 1
UPS_LOAD = "1.3.6.1.2.1.33.1.4.4.1.5.1"  # upsOutputPercentLoad, line 1
UPS_POWER = "1.3.6.1.2.1.33.1.4.4.1.4"  # upsOutputPower, per line


async def test_a_ups_says_what_it_does_with_its_feed(snmpsim_own: SnmpSimProcess) -> None:
    """A UPS-MIB agent (auto: sysObjectID upsMIB) gives its output power and its state in
    each read: on mains, on battery with its minutes left, then its output off (down)."""
    source = Counting(config(snmpsim_own, name="ups-a", ups=True), community="ups")
    try:
        mains = await source.read()
        assert source.profile is not None
        assert source.profile.name == "ups"
        assert (mains.power_w, mains.detail) == (12_000.0, "output power (3 lines)")
        assert (mains.equipment, mains.on_battery) == ("up", False)
        assert (mains.battery_minutes, mains.load_pct, mains.input_voltage_v) == (42, 40, 231)
        source.gets.clear()
        source.walks.clear()
        snmpsim_own.set_records(
            "ups",
            {UPS_SOURCE: (2, 5), UPS_MINUTES: (2, 7), UPS_BATTERY: (2, 3), UPS_INPUT_V: (2, 0)},
        )
        battery = await source.read()
        assert (battery.equipment, battery.on_battery, battery.battery_minutes) == ("up", True, 7)
        assert battery.input_voltage_v == 0.0
        assert battery.power_w == 12_000.0
        # the state rides in the read's one GET; the power is the learnt column's walk
        assert source.gets == [tuple(UPS_OIDS.values())]
        assert source.walks == [UPS_POWER]
        snmpsim_own.set_records(
            "ups", {UPS_SOURCE: (2, 2), **{f"{UPS_POWER}.{line}": (2, 0) for line in (1, 2, 3)}}
        )
        off = await source.read()
        assert (off.equipment, off.on_battery, off.power_w) == ("down", False, 0.0)
    finally:
        await source.close()


async def test_ups_on_a_device_without_the_ups_mib_is_unsupported(
    snmpsim: SnmpSimProcess,
) -> None:
    """``ups: true`` on a PDU (no UPS-MIB): rejected as unsupported, saying why, not a
    reading without its feed state."""
    with pytest.raises(ReadingRejectedError, match="no UPS-MIB upsOutputSource") as caught:
        await read_once(config(snmpsim, ups=True), community="apc")
    assert caught.value.reason == "unsupported"
    assert (await read_once(config(snmpsim), community="apc")).equipment == "unknown"


@pytest.mark.parametrize(
    ("records", "reason"),
    [
        ({UPS_SOURCE: (2, 9)}, "absurd"),  # upsOutputSource is 1-7
        ({UPS_SOURCE: (4, "battery")}, "type"),
        ({UPS_MINUTES: (4, "7 min")}, "type"),
        ({UPS_LOAD: (2, 250)}, "absurd"),  # upsOutputPercentLoad is 0-200
        ({UPS_INPUT_V: (2, 100_000)}, "absurd"),
        ({UPS_SOURCE: None}, "unsupported"),
    ],
)
async def test_hostile_ups_state_is_rejected(
    snmpsim_own: SnmpSimProcess, records: dict[str, tuple[int, int | str] | None], reason: str
) -> None:
    """A UPS state outside the MIB (an enum out of range, a string, a load or a voltage
    beyond bounds, no output source) rejects the read, never a state taken from it."""
    cfg = config(snmpsim_own, name="ups-a", ups=True)
    assert (await read_once(cfg, community="ups")).equipment == "up"
    snmpsim_own.set_records("ups", records)
    with pytest.raises(ReadingRejectedError) as caught:
        await read_once(cfg, community="ups")
    assert caught.value.reason == reason
