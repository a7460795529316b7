"""The pure reader of a Redfish ``CoolingUnit``: fields, units, conservative states, fuzzing."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.errors import ReadingRejectedError
from polca.redfish.cooling import CduDocuments, read_cooling_unit
from polca.redfish.documents import check_type, member_links, odata_link
from tests.fuzzing import FUZZ
from tests.standins import redfish_cdu

BASE = "/redfish/v1/ThermalEquipment/CDUs/cdu1"
LEAK = f"{BASE}/LeakDetection"


def tree(**state: Any) -> dict[str, dict[str, Any]]:
    """The stand-in CDU's documents, with ``state`` applied."""
    docs = redfish_cdu.resources("cdu1")
    if state:
        redfish_cdu.set_state(docs, "cdu1", state)
    return docs


def documents(docs: dict[str, dict[str, Any]], *, detectors: bool = False) -> CduDocuments:
    """One poll's documents as the poller gathers them from ``docs``."""
    return CduDocuments(
        unit=docs[BASE],
        secondary=[docs[f"{BASE}/SecondaryCoolantConnectors/1"]],
        primary=[docs[f"{BASE}/PrimaryCoolantConnectors/1"]],
        pumps=[docs[f"{BASE}/Pumps/1"], docs[f"{BASE}/Pumps/2"]],
        leak_detection=docs[LEAK],
        leak_detectors=(
            [docs[f"{LEAK}/LeakDetectors/Tray"], docs[f"{LEAK}/LeakDetectors/Floor"]]
            if detectors
            else []
        ),
        filters=[docs[f"{BASE}/Filters/1"]],
        environment=docs[f"{BASE}/EnvironmentMetrics"],
    )


def read(docs: CduDocuments) -> Any:
    """``read_cooling_unit`` with fixed names and time."""
    return read_cooling_unit(docs, cdu="cdu1", loop="loop1", ts_ns=1)


def test_realistic_cdu_fills_every_field() -> None:
    """The OCP-profile shaped CDU fills the same fields, in the same units, as Modbus."""
    reading = read(documents(tree()))
    t = reading.telemetry
    assert reading.problems == ()
    assert (t.cdu, t.loop, t.status) == ("cdu1", "loop1", "ok")
    assert t.secondary.supply_temp_c == 30.0
    assert t.secondary.return_temp_c == 40.0
    assert t.secondary.flow_lpm == 150.0
    assert t.secondary.delta_pressure_kpa == 80.0
    assert t.secondary.heat_removed_kw == 60.0
    assert t.primary is not None
    assert t.primary.supply_temp_c == 22.0
    assert [(p.name, p.state, p.speed_pct) for p in t.pumps] == [
        ("1", "running", 62.5),
        ("2", "standby", 0.0),
    ]
    assert [(d.name, d.state) for d in t.leak_detectors] == [("Tray", "ok"), ("Floor", "ok")]
    assert reading.cooling_capacity_w == 100_000
    assert reading.power_w == 2100.0
    assert reading.filters == (("1", "ok"),)


@pytest.mark.parametrize("state", ["Warning", "Critical"])
def test_leak_is_reported(state: str) -> None:
    """A detector's Warning or Critical reaches the telemetry under its own name."""
    t = read(documents(tree(leak=state))).telemetry
    assert {d.name: d.state for d in t.leak_detectors}["Tray"] == state.lower()


def test_leak_read_from_detectors_when_no_groups() -> None:
    """Without LeakDetectorGroups the individual LeakDetector documents are read."""
    docs = tree(leaks={"Floor": "Critical"})
    del docs[LEAK]["LeakDetectorGroups"]
    t = read(documents(docs, detectors=True)).telemetry
    assert [(d.name, d.state) for d in t.leak_detectors] == [
        ("Tray", "ok"),
        ("Floor", "critical"),
    ]


@pytest.mark.parametrize("bad", [None, "Dry", 3, {"a": 1}])
def test_unknown_detector_state_is_critical(bad: object) -> None:
    """A leak detector in an unknown state is not ok: critical, and a problem."""
    docs = tree()
    docs[LEAK]["LeakDetectorGroups"][0]["Detectors"][0]["DetectorState"] = bad
    reading = read(documents(docs))
    assert reading.telemetry.leak_detectors[0].state == "critical"
    assert ("leak_detectors.0.state", "unknown_state") in [
        (p.field, p.reason) for p in reading.problems
    ]


def test_unreadable_leak_detection_is_critical() -> None:
    """A LeakDetection document of the wrong type is not 'no leak'."""
    docs = documents(tree())
    broken = CduDocuments(unit=docs.unit, leak_detection={"@odata.type": "#Pump.v1_0_0.Pump"})
    reading = read(broken)
    assert [(d.name, d.state) for d in reading.telemetry.leak_detectors] == [
        ("leak_detection", "critical")
    ]


@pytest.mark.parametrize(
    ("pump", "state"),
    [("running", "running"), ("standby", "standby"), ("failed", "failed"), ("off", "off")],
)
def test_pump_states(pump: str, state: str) -> None:
    """Redfish State/Health map to polca's pump states."""
    t = read(documents(tree(pumps={"1": pump}))).telemetry
    assert t.pumps[0].state == state


def test_unknown_pump_state_is_failed() -> None:
    """A pump whose State is unknown or missing counts as failed."""
    docs = tree()
    docs[f"{BASE}/Pumps/1"]["Status"] = {"State": "Spinning"}
    del docs[f"{BASE}/Pumps/2"]["Status"]
    reading = read(documents(docs))
    assert [p.state for p in reading.telemetry.pumps] == ["failed", "failed"]
    assert {p.field for p in reading.problems} == {"pumps.0.state", "pumps.1.state"}


@pytest.mark.parametrize(
    ("value", "reason"),
    [("30", "type"), (math.nan, "nan"), (-5.0, "negative"), (1e9, "absurd"), (None, "unsupported")],
)
def test_bad_flow_is_left_out(value: object, reason: str) -> None:
    """An unusable flow reading is left out and named as a problem with its reason."""
    docs = tree()
    docs[f"{BASE}/SecondaryCoolantConnectors/1"]["FlowLitersPerMinute"]["Reading"] = value
    reading = read(documents(docs))
    assert reading.telemetry.secondary.flow_lpm is None
    assert reading.telemetry.secondary.supply_temp_c == 30.0  # the others still read
    assert [(p.field, p.reason) for p in reading.problems] == [("secondary.flow_lpm", reason)]


def test_several_connectors_fold_conservatively() -> None:
    """Warmest supply, summed flow and heat, lowest delta pressure."""
    docs = tree()
    one = docs[f"{BASE}/SecondaryCoolantConnectors/1"]
    two = copy.deepcopy(one)
    two["SupplyTemperatureCelsius"]["Reading"] = 33.0
    two["FlowLitersPerMinute"]["Reading"] = 50.0
    two["DeltaPressurekPa"]["Reading"] = 40.0
    base = documents(docs)
    reading = read(CduDocuments(unit=base.unit, secondary=[one, two]))
    s = reading.telemetry.secondary
    assert (s.supply_temp_c, s.flow_lpm, s.delta_pressure_kpa, s.heat_removed_kw) == (
        33.0,
        200.0,
        40.0,
        120.0,
    )


@pytest.mark.parametrize(
    ("status", "expected", "problem"),
    [
        ({"State": "Enabled", "Health": "Warning"}, "warning", False),
        ({"State": "Enabled", "Health": "Critical"}, "critical", False),
        ({"State": "Enabled", "Health": "Meh"}, "critical", True),
        ({"State": "Enabled", "Health": None}, "warning", True),
        ({"State": "Disabled", "Health": "OK"}, "critical", False),
        ({"State": "Enabled"}, "ok", False),
    ],
)
def test_status_is_the_unit_health(status: object, expected: str, problem: bool) -> None:
    """Status.Health becomes status; unknown is critical, a disabled CDU is critical."""
    docs = tree()
    docs[BASE]["Status"] = status
    reading = read(documents(docs))
    assert reading.telemetry.status == expected
    assert any(p.field == "status" for p in reading.problems) is problem


@pytest.mark.parametrize(
    "unit",
    [None, [], "CoolingUnit", {}, {"@odata.type": 5}, {"@odata.type": "#Pump.v1_0_0.Pump"}],
)
def test_not_a_cooling_unit_is_rejected(unit: object) -> None:
    """Only a document that is not a CoolingUnit at all raises, and only ReadingRejectedError."""
    with pytest.raises(ReadingRejectedError) as caught:
        read(CduDocuments(unit=unit))
    assert caught.value.reason in {"malformed", "identity"}


def test_document_helpers() -> None:
    """Links and collections: paths under /redfish/v1 only, bounded members."""
    doc = {"A": {"@odata.id": "/redfish/v1/X/Y"}, "B": {"@odata.id": "http://evil/x"}}
    assert odata_link(doc, "A", what="d") == "/redfish/v1/X/Y"
    assert odata_link(doc, "C", what="d") is None
    for bad in ("B",):
        with pytest.raises(ReadingRejectedError, match="not a Redfish path"):
            odata_link(doc, bad, what="d")
    with pytest.raises(ReadingRejectedError, match="not a Redfish path"):
        odata_link({"A": {"@odata.id": "/redfish/v1/../../etc"}}, "A", what="d")
    members = {"Members": [{"@odata.id": f"/redfish/v1/C/{i}"} for i in range(3)]}
    assert member_links(members, what="c", limit=3) == tuple(f"/redfish/v1/C/{i}" for i in range(3))
    with pytest.raises(ReadingRejectedError) as caught:
        member_links(members, what="c", limit=2)
    assert caught.value.reason == "oversized"
    with pytest.raises(ReadingRejectedError):
        check_type({"@odata.type": "#Circuit.v1_0_0.Circuit"}, "CoolingUnit", what="x")


# -- fuzzing: any JSON value anywhere never raises anything but ReadingRejectedError -----------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = [
    "Status", "Health", "State", "Reading", "DetectorState", "Detectors",
    "LeakDetectorGroups", "PumpSpeedPercent", "FlowLitersPerMinute", "Id",
    "SupplyTemperatureCelsius", "CoolingCapacityWatts", "@odata.type", "PowerWatts",
    "DataSourceUri", "HeatRemovedkW",
]  # fmt: skip


def _plant(data: st.DataObject, value: Any) -> Any:
    """``value`` with one randomly chosen place replaced by arbitrary JSON."""
    if isinstance(value, dict) and value and data.draw(st.integers(0, 3)) > 0:
        known = [k for k in _FIELDS if k in value]
        prefer_known = bool(known) and data.draw(st.booleans())
        keys = known if prefer_known else sorted(value) + _FIELDS
        key = data.draw(st.sampled_from(keys))
        value[key] = _plant(data, value[key]) if key in value else data.draw(JSON)
        return value
    if isinstance(value, list) and value and data.draw(st.integers(0, 3)) > 0:
        i = data.draw(st.integers(0, len(value) - 1))
        value[i] = _plant(data, value[i])
        return value
    return data.draw(JSON)


@FUZZ
@given(st.data())
def test_fuzzed_documents_never_raise_anything_else(data: st.DataObject) -> None:
    """Hostile values in any field of any document: telemetry or ReadingRejectedError only."""
    docs = documents(tree(), detectors=data.draw(st.booleans()))
    parts: dict[str, Any] = {
        "unit": docs.unit,
        "secondary": list(docs.secondary),
        "primary": list(docs.primary),
        "pumps": list(docs.pumps),
        "leak_detection": docs.leak_detection,
        "leak_detectors": list(docs.leak_detectors),
        "filters": list(docs.filters),
        "environment": docs.environment,
    }
    for _ in range(data.draw(st.integers(1, 4))):
        key = data.draw(st.sampled_from(sorted(parts)))
        parts[key] = _plant(data, copy.deepcopy(parts[key]))
    for key in ("secondary", "primary", "pumps", "leak_detectors", "filters"):
        if not isinstance(parts[key], list):
            parts[key] = [parts[key]]
    try:
        reading = read(CduDocuments(**parts))
    except ReadingRejectedError:
        return
    # what came out is valid on the wire and every leak state is a real one
    assert reading.telemetry.model_validate(reading.telemetry.model_dump()) == reading.telemetry
    assert all(d.state in {"ok", "warning", "critical"} for d in reading.telemetry.leak_detectors)
