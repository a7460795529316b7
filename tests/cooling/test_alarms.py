"""Alarm specs, one per kind: their limits, delays and words, the docs table, the engine."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import get_args

import pytest

from polca.cooling.alarms import (
    ALARM_KINDS,
    DELTA_T_HIGH,
    FLOW_LOW,
    PUMP_FAILURE,
    SENSOR_DISAGREEMENT,
    SPECS,
    SUPPLY_TEMP_HIGH,
    TELEMETRY_STALE,
    AlarmEngine,
    AlarmKind,
    Limits,
)
from polca.cooling.evidence import Evidence, Reading
from polca.cooling.loops import AlarmTiming, LoopSpec

ROOT = Path(__file__).resolve().parents[2]


def make_loop(**overrides: object) -> LoopSpec:
    """A 100 kW loop at 150 L/min serving r1 and r2 (defaults otherwise)."""
    fields: dict[str, object] = {
        "name": "loopA",
        "cdu": "cduA",
        "racks": ("r1", "r2"),
        "heat_capacity_kw": 100.0,
        "design_flow_lpm": 150.0,
        **overrides,
    }
    return LoopSpec.model_validate(fields)


def reading(**overrides: object) -> Reading:
    """A healthy reading: 30 C supply, design flow, N+1 pumps, no leak, status ok."""
    fields: dict[str, object] = {
        "supply_c": 30.0,
        "return_c": 36.0,
        "flow_lpm": 150.0,
        "heat_removed_kw": None,
        "pumps_available": 2,
        "pumps_down": (),
        "pumps_failed": (),
        "leaks": (),
        "leak_rank": 0,
        "status_rank": 0,
        **overrides,
    }
    return Reading(**fields)  # type: ignore[arg-type]


def evidence(**overrides: object) -> Evidence:
    """The evidence of one healthy step, with overrides."""
    fields: dict[str, object] = {
        "reading": reading(),
        "stale": False,
        "age_s": 0.0,
        "flow_fraction": 1.0,
        "delta_t_c": 6.0,
        "balance_pct": None,
        **overrides,
    }
    return Evidence(**fields)  # type: ignore[arg-type]


def test_every_alarm_kind_has_exactly_one_spec_in_kind_order() -> None:
    """SPECS names each AlarmKind once, in ALARM_KINDS order (the order of a step's events)."""
    assert tuple(spec.kind for spec in SPECS) == ALARM_KINDS == get_args(AlarmKind)


def test_docs_alarm_table_is_the_specs_descriptions() -> None:
    """docs/cooling.md's alarm table lists every spec's description, in order."""
    text = (ROOT / "docs" / "cooling.md").read_text(encoding="utf-8")
    table = text.split("| alarm | what it watches, and when each severity holds |", 1)[1]
    rows = re.findall(r"^ *\| `([a-z_]+)` \| ([^|]+) \|$", table.split("\n\n", 1)[0], re.M)
    assert rows == [(spec.kind, spec.description) for spec in SPECS]


def test_limits_come_from_the_loop_spec() -> None:
    """Each threshold, clear point and hysteresis is the loop's own setting."""
    loop = make_loop(supply_warning_c=33.0, supply_critical_c=38.0, max_delta_t_c=10.0)
    assert SUPPLY_TEMP_HIGH.limits(loop, 5.0) == Limits((33.0, None, 38.0), 32.0, 1.0)
    assert DELTA_T_HIGH.limits(loop, 5.0) == Limits((10.0, 13.0, None), 9.5, 0.5)
    assert FLOW_LOW.limits(loop, 5.0) == Limits((0.85, 0.7, 0.5), 0.9, 0.05)
    assert SENSOR_DISAGREEMENT.limits(loop, 5.0) == Limits((20.0, None, None), 15.0, 5.0)
    assert TELEMETRY_STALE.limits(loop, 7.0) == Limits((7.0, None, None), 7.0)
    # N+1 has a degraded limit (the spare lost); N of N has none.
    assert PUMP_FAILURE.limits(loop, 5.0).thresholds == (2.0, 2.0, 1.0)
    no_spare = make_loop(pump_count=2, pumps_required=2)
    assert PUMP_FAILURE.limits(no_spare, 5.0).thresholds == (2.0, None, 2.0)


def test_delays_are_each_specs_own() -> None:
    """Most alarms debounce by raise_after_s (critical faster); heat balance and staleness not."""
    timing = AlarmTiming(raise_after_s=7.0, critical_raise_after_s=1.0)
    assert SUPPLY_TEMP_HIGH.delays(timing) == (7.0, 7.0, 1.0)
    assert SENSOR_DISAGREEMENT.delays(timing) == (120.0, 120.0, 120.0)
    assert TELEMETRY_STALE.delays(timing) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("ev", "found"),
    [
        (evidence(reading=reading(supply_c=35.0)), (1, 35.0, ())),
        (evidence(reading=reading(supply_c=40.0)), (3, 40.0, ())),
        (evidence(reading=reading(supply_c=None)), None),
        (evidence(reading=None, stale=True), None),
    ],
)
def test_supply_condition_reaches_each_threshold_and_needs_a_reading(
    ev: Evidence, found: tuple[int, float, tuple[str, ...]] | None
) -> None:
    """At or above a limit is that severity; no supply reading is no evidence at all."""
    loop = make_loop()
    limits = SUPPLY_TEMP_HIGH.limits(loop, 5.0)
    assert SUPPLY_TEMP_HIGH.condition(ev, loop, limits, 0) == found


def test_hysteresis_holds_only_the_active_severity() -> None:
    """Flow at 87% holds an active warning (85% + 5%) but raises nothing from idle."""
    loop = make_loop()
    limits = FLOW_LOW.limits(loop, 5.0)
    ev = evidence(flow_fraction=0.87)
    assert FLOW_LOW.condition(ev, loop, limits, 0) == (0, 0.87, ())
    assert FLOW_LOW.condition(ev, loop, limits, 1) == (1, 0.87, ())


def test_engine_evaluates_the_specs_it_is_given_with_their_delays() -> None:
    """A spec with a 3 s delay raises at 3 s; the engine says what, against which limit."""
    fast = dataclasses.replace(SUPPLY_TEMP_HIGH, delays=lambda _timing: (3.0, 3.0, 3.0))
    engine = AlarmEngine(make_loop(), stale_after_s=5.0, specs=(fast,))
    hot = evidence(reading=reading(supply_c=36.0))
    assert [engine.step(hot, now_s=float(t)) for t in range(3)] == [(), (), ()]
    (event,) = engine.step(hot, now_s=3.0)
    assert (event.alarm, event.action, event.severity, event.previous) == (
        "supply_temp_high",
        "raised",
        "warning",
        None,
    )
    assert event.detail == "supply 36.0 C (limit 35.0 C)"
    assert engine.worst_rank == 1
    (active,) = engine.active()
    assert (active.alarm, active.since_s, active.threshold) == ("supply_temp_high", 3.0, 35.0)


def test_no_evidence_holds_an_alarm_and_restarts_its_debounce() -> None:
    """A stale CDU keeps a raised leak; a leak that was pending must hold again in full."""
    engine = AlarmEngine(make_loop(), stale_after_s=5.0)
    leak = evidence(reading=reading(leaks=("leak1",), leak_rank=3))
    stale = evidence(reading=None, stale=True, age_s=6.0)
    engine.step(leak, now_s=0.0)
    engine.step(stale, now_s=1.0)  # pending leak forgotten
    assert engine.step(leak, now_s=2.0) == ()
    assert engine.step(leak, now_s=3.0) == ()
    (raised,) = engine.step(leak, now_s=4.0)  # 2 s after it was seen again
    assert (raised.alarm, raised.severity) == ("leak", "critical")
    engine.step(stale, now_s=100.0)
    assert engine.rank("leak") == 3
    assert raised.detail == "leak detectors not ok 1: leak1"
