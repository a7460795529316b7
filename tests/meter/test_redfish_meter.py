"""RedfishMeterSource and probe against the Redfish stand-in process, through the real client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from polca.errors import ConfigError, ReadingRejectedError, TransportError
from polca.meter.redfish import RedfishMeterConfig, RedfishMeterSource, probe
from polca.meter.row import SourceLog
from polca.meter.service import MeterRow, meter_once
from polca.meter.source import MeterSource
from polca.redfish.api import RedfishEndpoint
from polca.telemetry.messages import OutMessage
from polca.telemetry.schema import Meter, decode
from tests.standins.fixtures import PASSWORD, USERNAME
from tests.standins.process import RedfishStandIn

# The module's stand-in is its own fixture, not one tests/conftest.py knows by name.
pytestmark = pytest.mark.integration

BASE = "/redfish/v1/PowerEquipment/RackPDUs"
TOPIC = "polca/v1/dc1/row1/meter"


@pytest.fixture(scope="module")
def _pdus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedfishStandIn]:
    standin = RedfishStandIn(
        tmp_path_factory.mktemp("pdus"),
        devices=["pdu:pdu1", "pdu:pdu2:single"],
        username=USERNAME,
        password=PASSWORD,
    )
    standin.start()
    yield standin
    standin.kill()


@pytest.fixture
def pdus(_pdus: RedfishStandIn) -> RedfishStandIn:
    """Two PDUs (pdu1: mains AC1+AC2, pdu2: AC1 only), reset for this test."""
    _pdus.reset()
    return _pdus


class Collect:
    """A publisher that keeps what it is given."""

    def __init__(self) -> None:
        self.messages: list[OutMessage] = []

    def publish_nowait(self, msg: OutMessage) -> None:
        self.messages.append(msg)


def source_for(
    standin: RedfishStandIn, tmp_path: Path, *, name: str = "row1-pdu", **options: Any
) -> RedfishMeterSource:
    """A source reading ``standin`` with the test account."""
    password_file = tmp_path / "pw"
    password_file.write_text(PASSWORD + "\n", encoding="utf-8")
    endpoint = RedfishEndpoint(
        url=standin.url,
        username=USERNAME,
        password_file=password_file,
        allow_http=True,
        timeout_s=2.0,
    )
    config = RedfishMeterConfig.model_validate(
        {"protocol": "redfish", "name": name, "endpoint": endpoint, **options}
    )
    return RedfishMeterSource(config)


async def test_mains_of_a_and_b_feeds_are_summed(pdus: RedfishStandIn, tmp_path: Path) -> None:
    """A PDU with A and B mains reads the sum; later reads GET only the two mains."""
    pdus.set_state("pdu1", mains={"AC1": 5200.0, "AC2": 4800.0})
    source: MeterSource = source_for(pdus, tmp_path, pdu="pdu1")
    try:
        first = await source.read()
        assert first.power_w == 10_000.0
        assert "sum of 2" in first.detail
        assert first.energy_j == pytest.approx(2 * 1234.5 * 3.6e6)
        pdus.clear_log()
        pdus.set_state("pdu1", power_w=7000.0)
        second = await source.read()
        assert second.power_w == pytest.approx(7000.0)
        paths = [r["path"] for r in pdus.requests() if r["method"] == "GET"]
        assert paths == [f"{BASE}/pdu1/Mains/AC1", f"{BASE}/pdu1/Mains/AC2"]
    finally:
        await source.close()


async def test_pdu_choice_and_branches(pdus: RedfishStandIn, tmp_path: Path) -> None:
    """The named PDU, the first by default, and chosen branches."""
    pdus.set_state("pdu2", power_w=3100.0)
    pdus.set_state("pdu1", mains={"AC1": 2600.0, "AC2": 2000.0})
    sources = [
        source_for(pdus, tmp_path, pdu="pdu2"),
        source_for(pdus, tmp_path),
        source_for(pdus, tmp_path, resource="circuits", pdu="pdu1", circuits=["AC1A", "AC2B"]),
        source_for(pdus, tmp_path, resource="circuits", pdu="pdu1"),
    ]
    try:
        readings = [await s.read() for s in sources]
    finally:
        for s in sources:
            await s.close()
    assert [r.power_w for r in readings] == pytest.approx([3100.0, 4600.0, 2300.0, 4600.0])


async def test_misconfiguration_is_a_config_error(pdus: RedfishStandIn, tmp_path: Path) -> None:
    """No such PDU or circuit: ConfigError naming what the service has."""
    for options in ({"pdu": "pdu9"}, {"resource": "circuits", "pdu": "pdu1", "circuits": ["X"]}):
        source = source_for(pdus, tmp_path, **options)
        try:
            with pytest.raises(ConfigError, match="has no"):
                await source.read()
        finally:
            await source.close()


async def test_current_and_voltage_with_a_power_factor(
    pdus: RedfishStandIn, tmp_path: Path
) -> None:
    """A PDU reporting only current and voltage needs the configured power factor."""
    pdus.set_state("pdu2", power_w=2300.0, report="current")
    bare = source_for(pdus, tmp_path, pdu="pdu2")
    with_pf = source_for(pdus, tmp_path, pdu="pdu2", power_factor=0.9)
    try:
        with pytest.raises(ReadingRejectedError) as caught:
            await bare.read()
        assert caught.value.reason == "unsupported"
        reading = await with_pf.read()
        assert reading.power_w == pytest.approx(2300.0 * 0.9)
        assert reading.fallbacks[:2] == (
            "PowerWatts: not reported",
            "PolyPhasePowerWatts: not reported",
        )
    finally:
        await bare.close()
        await with_pf.close()


async def test_outage_drops_the_session_and_reconnects(
    pdus: RedfishStandIn, tmp_path: Path
) -> None:
    """A 5xx is a TransportError; the next read reconnects, discovers and reads again."""
    source = source_for(pdus, tmp_path, pdu="pdu1")
    try:
        assert (await source.read()).power_w == 5000.0
        pdus.fault("error500")
        with pytest.raises(TransportError):
            await source.read()
        assert source.resources == ()  # forgotten with the session
        pdus.fault("none")
        assert (await source.read()).power_w == 5000.0
        assert (source.connects, source.discoveries) == (2, 2)
    finally:
        await source.close()


@pytest.mark.parametrize(("mode", "reason"), [("nan", "nan"), ("wrong_types", "type")])
async def test_hostile_values_are_rejected(
    pdus: RedfishStandIn, tmp_path: Path, mode: str, reason: str
) -> None:
    """NaN or strings for numbers: ReadingRejectedError with the reason, never a number."""
    source = source_for(pdus, tmp_path, pdu="pdu1")
    try:
        await source.read()
        pdus.fault(mode)
        with pytest.raises(ReadingRejectedError) as caught:
            await source.read()
        assert caught.value.reason == reason
    finally:
        await source.close()


async def test_probe_walks_from_the_service_root(pdus: RedfishStandIn) -> None:
    """probe finds the first PDU's mains and reports its power and resources."""
    pdus.set_state("pdu1", mains={"AC1": 1000.0, "AC2": 1500.0})
    found = await probe(pdus.url, username=USERNAME, password=PASSWORD)
    assert found["power_w"] == 2500.0
    assert found["source"] == "mains"
    assert found["resources"] == [f"{BASE}/pdu1/Mains/AC1", f"{BASE}/pdu1/Mains/AC2"]


async def test_probe_without_pdus_says_why(
    standin_factory: Callable[..., RedfishStandIn],
) -> None:
    """A service with only a CDU: ConfigError listing what was tried."""
    standin = standin_factory(devices=["cdu:cdu1"])
    with pytest.raises(ConfigError, match="no usable power"):
        await probe(standin.url)


@pytest.mark.parametrize(
    ("device", "kind"),
    [("bmc:node1:controls", "sensor"), ("bmc:node1:legacy", "PowerConsumedWatts")],
)
async def test_a_chassis_power_is_read_from_its_sensor_or_its_legacy_power(
    standin_factory: Callable[..., RedfishStandIn], tmp_path: Path, device: str, kind: str
) -> None:
    """``resource: chassis``: a chassis's power sensor (ReadingType Power, for the chassis
    as a whole), else its legacy Power resource; the server's draw (900 W) either way."""
    standin = standin_factory(devices=[device], username=USERNAME, password=PASSWORD)
    source = source_for(standin, tmp_path, resource="chassis", chassis="node1")
    try:
        reading = await source.read()
        assert reading.power_w == pytest.approx(900.0)
        assert "chassis node1" in reading.detail
        assert kind in reading.detail
        assert (reading.equipment, reading.input_voltage_v) == ("unknown", None)
    finally:
        await source.close()
    missing = source_for(standin, tmp_path, resource="chassis", chassis="node9")
    try:
        with pytest.raises(ConfigError, match="no chassis 'node9'"):
            await missing.read()
    finally:
        await missing.close()
    without_id = source_for(standin, tmp_path, resource="chassis")
    try:
        with pytest.raises(ConfigError, match="needs a chassis id"):
            await without_id.read()
    finally:
        await without_id.close()


async def test_a_tripped_main_is_down_in_the_rows_meter(
    pdus: RedfishStandIn, tmp_path: Path
) -> None:
    """A PDU's main reads up (BreakerState Normal, PowerState On) with its voltage; tripped,
    it carries 0 W and its source reads down, and the row's Meter message says so."""
    source = source_for(pdus, tmp_path, name="pdu-b", pdu="pdu2")
    row = MeterRow("row1", TOPIC, (source,))
    out = Collect()
    try:
        up = await source.read()
        assert (up.equipment, up.input_voltage_v, up.power_w) == ("up", 230.0, 2500.0)
        pdus.set_state("pdu2", breakers={"AC1": "Tripped"})
        pdus.clear_log()
        [(_, meter)] = await meter_once(out, [row], sources_log=SourceLog(), read_timeout_s=2.0)
        assert not meter.partial
        assert meter.power_w == 0.0
        assert meter.states["pdu-b"].equipment == "down"
        assert decode(out.messages[-1].payload, Meter).states["pdu-b"].equipment == "down"
        paths = {r["path"] for r in pdus.requests() if r["method"] == "GET"}
        assert paths == {f"{BASE}/pdu2/Mains/AC1"}  # the state came with the power
    finally:
        await source.close()


async def test_each_main_speaks_for_its_own_feed(pdus: RedfishStandIn, tmp_path: Path) -> None:
    """A source of both mains cannot speak for one feed when they differ (unknown); a
    source of one main can: tripped or powered off is down, and the other stays up."""
    both = source_for(pdus, tmp_path, pdu="pdu1")
    a_feed = source_for(pdus, tmp_path, pdu="pdu1", circuits=["AC1"])
    b_feed = source_for(pdus, tmp_path, pdu="pdu1", circuits=["AC2"])
    branches = source_for(pdus, tmp_path, resource="circuits", pdu="pdu1", circuits=["AC2A"])
    sources = (both, a_feed, b_feed, branches)
    try:
        assert [(await s.read()).equipment for s in sources] == ["up"] * 4
        pdus.set_state("pdu1", breakers={"AC2": "Tripped"})
        readings = [await s.read() for s in sources]
        assert [r.equipment for r in readings] == ["unknown", "up", "down", "down"]
        assert [r.power_w for r in readings] == [2500.0, 2500.0, 0.0, 0.0]
        pdus.set_state("pdu1", breakers={"AC2": "Normal"}, power_states={"AC1": "Off"})
        assert [(await s.read()).equipment for s in sources] == ["unknown", "down", "up", "up"]
        with pytest.raises(AssertionError, match="expected one of"):
            pdus.set_state("pdu1", breakers={"AC1": "Open"})  # not in DSP0268's enum
    finally:
        for s in sources:
            await s.close()


async def test_a_dark_pdu_is_missing_from_its_row(pdus: RedfishStandIn, tmp_path: Path) -> None:
    """A PDU gone dark (its feed lost) answers nothing: its row's reading is partial with it
    missing (timeout) and no state for it, until it answers again."""
    a = source_for(pdus, tmp_path, name="pdu-a", pdu="pdu1")
    b = source_for(pdus, tmp_path, name="pdu-b", pdu="pdu2")
    row = MeterRow("row1", TOPIC, (a, b))
    out, book = Collect(), SourceLog()
    try:
        [(_, whole)] = await meter_once(out, [row], sources_log=book, read_timeout_s=1.0)
        assert set(whole.states) == {"pdu-a", "pdu-b"}
        pdus.set_state("pdu2", dark=True)
        [(_, dark)] = await meter_once(out, [row], sources_log=book, read_timeout_s=0.5)
        assert (dark.partial, dark.missing, set(dark.states)) == (
            True,
            {"pdu-b": "timeout"},
            {"pdu-a"},
        )
        assert dark.power_w == 5000.0
        pdus.set_state("pdu2", dark=False)
        [(_, back)] = await meter_once(out, [row], sources_log=book, read_timeout_s=1.0)
        assert not back.partial
        assert back.states["pdu-b"].equipment == "up"
    finally:
        await a.close()
        await b.close()
