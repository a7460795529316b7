"""The pure readers of Redfish power: PDU circuits, chassis sensors and metrics, fuzzing."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.errors import ReadingRejectedError
from polca.redfish.power import (
    PowerReading,
    circuit_power,
    circuit_state,
    environment_power,
    legacy_power,
    power_supply_power,
    sensor_power,
    sum_readings,
)
from tests.fuzzing import FUZZ
from tests.redfish.test_cooling import JSON, _plant
from tests.standins import redfish_pdu

BASE = "/redfish/v1/PowerEquipment/RackPDUs/pdu1"


def pdu(**state: Any) -> dict[str, dict[str, Any]]:
    """The stand-in PDU's documents, with ``state`` applied."""
    docs = redfish_pdu.resources("pdu1")
    if state:
        redfish_pdu.set_state(docs, "pdu1", state)
    return docs


def test_main_power_and_energy() -> None:
    """PowerWatts.Reading is the power; EnergykWh becomes joules."""
    docs = pdu(mains={"AC1": 5200.0, "AC2": 4800.0}, energy_kwh=10.0)
    reading = circuit_power(docs[f"{BASE}/Mains/AC1"], what="AC1")
    assert reading.power_w == 5200.0
    assert reading.detail == "AC1 PowerWatts"
    assert reading.energy_j == pytest.approx(10.0 * 3.6e6)
    assert reading.fallbacks == ()


def test_polyphase_fallback() -> None:
    """Without PowerWatts the line-to-neutral powers are summed, and the skip is said."""
    reading = circuit_power(pdu(power_w=6000.0, report="polyphase")[f"{BASE}/Mains/AC2"])
    assert reading.power_w == pytest.approx(3000.0)
    assert "PolyPhasePowerWatts" in reading.detail
    assert reading.fallbacks == ("PowerWatts: not reported",)


def test_polyphase_never_adds_line_to_line_to_line_to_neutral() -> None:
    """Line-to-neutral readings win; line-to-line ones are used only without them."""
    doc = copy.deepcopy(pdu(report="polyphase")[f"{BASE}/Mains/AC1"])
    doc["PolyPhasePowerWatts"]["Line1ToLine2"] = {"Reading": 9999.0}
    assert circuit_power(doc).power_w == pytest.approx(2500.0)
    doc["PolyPhasePowerWatts"] = {
        "Line1ToLine2": {"Reading": 700.0},
        "Line2ToLine3": {"Reading": 300.0},
    }
    assert circuit_power(doc).power_w == 1000.0


def test_current_voltage_needs_a_power_factor() -> None:
    """Current x voltage is used only with a configured power factor."""
    doc = pdu(power_w=4600.0, report="current")[f"{BASE}/Mains/AC1"]
    with pytest.raises(ReadingRejectedError, match="no power_factor configured") as caught:
        circuit_power(doc)
    assert caught.value.reason == "unsupported"
    reading = circuit_power(doc, power_factor=0.9)
    assert reading.power_w == pytest.approx(2300.0 * 0.9)
    assert "power factor 0.9" in reading.detail


@pytest.mark.parametrize(
    ("value", "reason"),
    [("5200", "type"), (math.nan, "nan"), (-1.0, "negative"), (3e6, "absurd"), (True, "type")],
)
def test_bad_power_falls_back_then_rejects(value: object, reason: str) -> None:
    """A bad PowerWatts is skipped for PolyPhase; with nothing usable, ReadingRejectedError."""
    doc = copy.deepcopy(pdu()[f"{BASE}/Mains/AC1"])
    doc["PowerWatts"]["Reading"] = value
    reading = circuit_power(doc)
    assert reading.power_w == pytest.approx(2500.0)
    assert reading.fallbacks[0].startswith("PowerWatts:")
    del doc["PolyPhasePowerWatts"], doc["CurrentAmps"]
    with pytest.raises(ReadingRejectedError) as caught:
        circuit_power(doc)
    assert caught.value.reason == reason


def test_bad_energy_is_dropped_not_fatal() -> None:
    """An unusable energy counter is left out and noted; the power stands."""
    doc = copy.deepcopy(pdu()[f"{BASE}/Mains/AC1"])
    doc["EnergykWh"]["Reading"] = -3
    reading = circuit_power(doc)
    assert (reading.power_w, reading.energy_j) == (2500.0, None)
    assert reading.fallbacks[-1].startswith("EnergykWh:")


def test_sum_of_mains() -> None:
    """A and B mains are summed; energy only when every main has it."""
    docs = pdu(mains={"AC1": 5200.0, "AC2": 4800.0})
    readings = [circuit_power(docs[f"{BASE}/Mains/{m}"], what=m) for m in ("AC1", "AC2")]
    total = sum_readings(readings, what="PDU pdu1 mains")
    assert total.power_w == 10_000.0
    assert total.energy_j == pytest.approx(2 * 1234.5 * 3.6e6)
    assert "sum of 2" in total.detail
    partial = sum_readings([readings[0], PowerReading(1.0, "x")], what="t")
    assert partial.energy_j is None
    with pytest.raises(ReadingRejectedError):
        sum_readings([], what="none")
    with pytest.raises(ReadingRejectedError) as caught:
        sum_readings([PowerReading(1.5e6, "a"), PowerReading(1.5e6, "b")], what="too much")
    assert caught.value.reason == "absurd"


def test_chassis_readers() -> None:
    """Sensor, EnvironmentMetrics, power supplies and the legacy Power resource."""
    sensor = {"@odata.type": "#Sensor.v1_7_0.Sensor", "ReadingType": "Power", "Reading": 812.5}
    assert sensor_power(sensor).power_w == 812.5
    assert sensor_power({**sensor, "ReadingUnits": "kW", "Reading": 1.5}).power_w == 1500.0
    with pytest.raises(ReadingRejectedError):
        sensor_power({**sensor, "ReadingType": "Temperature"})
    env = {
        "@odata.type": "#EnvironmentMetrics.v1_3_0.EnvironmentMetrics",
        "PowerWatts": {"Reading": 6438},
    }
    assert environment_power(env).power_w == 6438.0
    supply = {"@odata.type": "#PowerSupplyMetrics.v1_1_0.PowerSupplyMetrics"}
    supplies = [{**supply, "InputPowerWatts": {"Reading": w}} for w in (400.0, 420.0)]
    assert power_supply_power(supplies).power_w == 820.0
    with pytest.raises(ReadingRejectedError):
        power_supply_power([*supplies, supply])  # one supply unread: no partial sum
    legacy = {"@odata.type": "#Power.v1_7_0.Power", "PowerControl": [{"PowerConsumedWatts": 344}]}
    assert legacy_power(legacy).power_w == 344.0
    with pytest.raises(ReadingRejectedError):
        legacy_power({**legacy, "PowerControl": [{"PowerConsumedWatts": None}]})


def _with_factor(doc: object) -> PowerReading:
    return circuit_power(doc, power_factor=0.95)


def _one_supply(doc: object) -> PowerReading:
    return power_supply_power([doc])


_READERS: list[Callable[[object], PowerReading]] = [
    _with_factor,
    circuit_power,
    environment_power,
    sensor_power,
    legacy_power,
    _one_supply,
]


@FUZZ
@given(st.data())
def test_fuzzed_documents_never_raise_anything_else(data: st.DataObject) -> None:
    """Any JSON value in any field: a bounded power or ReadingRejectedError, nothing else."""
    docs = pdu(report=data.draw(st.sampled_from(["power", "polyphase", "current"])))
    seeds = [
        docs[f"{BASE}/Mains/AC1"],
        docs[f"{BASE}/Branches/AC2B"],
        {"@odata.type": "#Sensor.v1_7_0.Sensor", "ReadingType": "Power", "Reading": 5.0},
        {"@odata.type": "#Power.v1_7_0.Power", "PowerControl": [{"PowerConsumedWatts": 3}]},
        {
            "@odata.type": "#EnvironmentMetrics.v1_3_0.EnvironmentMetrics",
            "PowerWatts": {"Reading": 1},
        },
    ]
    doc = _plant(data, copy.deepcopy(data.draw(st.sampled_from(seeds))))
    if data.draw(st.booleans()):
        doc = data.draw(JSON)
    for reader in _READERS:
        try:
            reading = reader(doc)
        except ReadingRejectedError:
            continue
        assert 0.0 <= reading.power_w <= 2_000_000.0
        assert reading.energy_j is None or math.isfinite(reading.energy_j)


@pytest.mark.parametrize(
    ("fields", "state"),
    [
        ({"BreakerState": "Normal", "PowerState": "On"}, "up"),
        ({"BreakerState": "Normal"}, "up"),
        ({"PowerState": "On"}, "up"),
        ({"BreakerState": "Tripped", "PowerState": "On"}, "down"),
        ({"BreakerState": "Off"}, "down"),
        ({"BreakerState": "Normal", "PowerState": "Off"}, "down"),
        ({"PowerState": "PoweringOff"}, "down"),
        ({}, "unknown"),
        ({"BreakerState": "Normal", "PowerState": "PoweringOn"}, "unknown"),
        ({"BreakerState": "Sparking"}, "unknown"),
        ({"BreakerState": 1, "PowerState": None}, "unknown"),
    ],
)
def test_a_circuits_breaker_and_power_state_say_whether_it_carries_power(
    fields: dict[str, object], state: str
) -> None:
    doc = {"@odata.type": "#Circuit.v1_7_0.Circuit", "Id": "A", **fields}
    assert circuit_state(doc) == state


def test_a_circuit_state_of_another_type_is_refused() -> None:
    with pytest.raises(ReadingRejectedError):
        circuit_state({"@odata.type": "#Sensor.v1_0_0.Sensor"})


@FUZZ
@given(doc=JSON)
def test_any_document_is_a_circuit_state_or_refused(doc: object) -> None:
    """No JSON makes circuit_state raise anything but ReadingRejectedError."""
    reason: str | None = None
    state: str | None = None
    try:
        state = circuit_state(doc)
    except ReadingRejectedError as exc:
        reason = exc.reason
    assert (state is None) != (reason is None)
    assert reason in {None, "malformed", "identity"}
    assert state in {None, "up", "down", "unknown"}
