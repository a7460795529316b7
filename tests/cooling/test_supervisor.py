"""Cooling-loop supervision: alarms, escalation, thermal budgets, forced levels (pure, fast)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polca.cooling.alarms import AlarmEvent
from polca.cooling.budgets import (
    derate,
    effective_rack_budgets,
    effective_row_budget_w,
    split_budget,
)
from polca.cooling.loops import (
    AlarmTiming,
    CoolingSettings,
    Derating,
    ForcedLevels,
    LoopSpec,
)
from polca.cooling.supervisor import (
    CoolingSupervisor,
    LoopAssessment,
    LoopSupervisor,
    forced_level_for,
)
from polca.telemetry.schema import CduTelemetry, CoolantConnector, LeakDetector, Pump

CP_KJ_PER_KG_K = 4.18
DENSITY_KG_PER_L = 0.996
DESIGN_FLOW_LPM = 150.0
POWER_W = {"r1": 40_000.0, "r2": 40_000.0}  # 80 kW electrical -> 64 kW into the loop
LOAD_KW = 64.0
HEALTHY_PUMPS = ("running", "standby")


def make_spec(**overrides: object) -> LoopSpec:
    """A 100 kW loop at 150 L/min serving r1 and r2 (defaults otherwise)."""
    fields: dict[str, object] = {
        "name": "loopA",
        "cdu": "cduA",
        "racks": ("r1", "r2"),
        "heat_capacity_kw": 100.0,
        "design_flow_lpm": DESIGN_FLOW_LPM,
        **overrides,
    }
    return LoopSpec.model_validate(fields)


def cdu_msg(
    *,
    cdu: str = "cduA",
    supply_c: float = 30.0,
    flow_lpm: float | None = DESIGN_FLOW_LPM,
    load_kw: float = LOAD_KW,
    delta_t_c: float | None = None,
    return_c: float | None = None,
    pumps: tuple[str, ...] = HEALTHY_PUMPS,
    leaks: tuple[str, ...] = ("ok", "ok"),
    status: str = "ok",
    ts_ns: int = 0,
) -> CduTelemetry:
    """A CDU reading whose heat balance matches ``load_kw`` unless dT or return is given."""
    if return_c is None:
        if delta_t_c is None:
            flow = flow_lpm or DESIGN_FLOW_LPM
            delta_t_c = load_kw / (flow / 60 * DENSITY_KG_PER_L * CP_KJ_PER_KG_K)
        return_c = supply_c + delta_t_c
    return CduTelemetry.model_validate(
        {
            "ts_ns": ts_ns,
            "cdu": cdu,
            "loop": "loopA",
            "secondary": {
                "supply_temp_c": supply_c,
                "return_temp_c": return_c,
                "flow_lpm": flow_lpm,
            },
            "pumps": [{"name": f"pump{i}", "state": s} for i, s in enumerate(pumps)],
            "leak_detectors": [{"name": f"leak{i}", "state": s} for i, s in enumerate(leaks)],
            "status": status,
        }
    )


class Loop:
    """Drives one LoopSupervisor at 1 s steps with an injected clock."""

    def __init__(self, spec: LoopSpec | None = None, **kwargs: object) -> None:
        self.sup = LoopSupervisor(spec or make_spec(), **kwargs)  # type: ignore[arg-type]
        self.now_s = 0.0
        self.events: list[AlarmEvent] = []
        self.history: list[LoopAssessment] = []

    def run(
        self,
        seconds: int,
        msg: CduTelemetry | Callable[[float], CduTelemetry | None] | None,
        power_w: Mapping[str, float] = POWER_W,
        top_level: int = 3,
    ) -> LoopAssessment:
        """``seconds`` updates, one per second; returns the last assessment."""
        last = None
        for _ in range(seconds):
            message = msg(self.now_s) if callable(msg) else msg
            last = self.sup.update(
                message, rack_power_w=power_w, now_s=self.now_s, top_level=top_level
            )
            self.events.extend(last.events)
            self.history.append(last)
            self.now_s += 1.0
        assert last is not None
        return last

    def of(self, alarm: str) -> list[tuple[str, str, float]]:
        """(action, severity, at_s) of one alarm's events so far."""
        return [(e.action, e.severity, e.at_s) for e in self.events if e.alarm == alarm]


def test_healthy_loop_has_full_budget_split_equally_and_no_alarm() -> None:
    """100 kW at 80% capture cools 125 kW of racks, 62.5 kW each; nothing raised or forced."""
    loop = Loop()
    a = loop.run(60, cdu_msg())
    assert a.heat_balance_error_pct is None  # the filters settle for two 60 s windows first
    a = loop.run(61, cdu_msg())
    assert loop.events == []
    assert a.worst_severity is None
    assert a.alarms == ()
    assert not a.emergency
    assert not a.stale
    assert a.thermal_budget_w == pytest.approx(125_000.0)
    assert a.rack_thermal_budget_w == pytest.approx({"r1": 62_500.0, "r2": 62_500.0})
    assert a.forced_levels == {"r1": 0, "r2": 0}
    assert a.heat_load_kw == pytest.approx(LOAD_KW)
    assert a.heat_removed_kw == pytest.approx(LOAD_KW)
    assert a.headroom_kw == pytest.approx(36.0)
    assert a.heat_balance_error_pct == pytest.approx(0.0, abs=1e-6)


def test_rack_weights_split_the_budget() -> None:
    """rack_weights 3:1 gives r1 three quarters of the loop's thermal budget."""
    spec = make_spec(rack_weights={"r1": 3.0})
    a = Loop(spec).run(1, cdu_msg())
    assert a.rack_thermal_budget_w == pytest.approx({"r1": 93_750.0, "r2": 31_250.0})
    assert split_budget(spec, a.thermal_budget_w) == pytest.approx(a.rack_thermal_budget_w)


# (alarm, fault, in the hysteresis band, healthy, severity raised)
FAULTS = [
    ("supply_temp_high", cdu_msg(supply_c=35.5), cdu_msg(supply_c=34.5), cdu_msg(), "warning"),
    (
        "delta_t_high",
        cdu_msg(delta_t_c=12.4),
        cdu_msg(delta_t_c=11.7),
        cdu_msg(),
        "warning",
    ),
    (
        "flow_low",
        cdu_msg(flow_lpm=0.8 * DESIGN_FLOW_LPM),
        cdu_msg(flow_lpm=0.88 * DESIGN_FLOW_LPM),
        cdu_msg(),
        "warning",
    ),
    (
        "pump_failure",
        cdu_msg(pumps=("running", "failed")),
        cdu_msg(pumps=("running", "failed")),
        cdu_msg(),
        "degraded",
    ),
    (
        "leak",
        cdu_msg(leaks=("ok", "warning")),
        cdu_msg(leaks=("ok", "warning")),
        cdu_msg(),
        "warning",
    ),
    ("cdu_fault", cdu_msg(status="warning"), cdu_msg(status="warning"), cdu_msg(), "warning"),
]


@pytest.mark.parametrize(
    ("alarm", "fault", "band", "healthy", "severity"), FAULTS, ids=[f[0] for f in FAULTS]
)
def test_alarm_raises_after_debounce_and_clears_with_hysteresis(
    alarm: str,
    fault: CduTelemetry,
    band: CduTelemetry,
    healthy: CduTelemetry,
    severity: str,
) -> None:
    """No event for 10 s, raised at 10 s; held in the band; cleared 30 s after recovery."""
    loop = Loop()
    loop.run(20, cdu_msg())
    loop.run(10, fault)  # t = 20..29
    assert loop.of(alarm) == []
    a = loop.run(1, fault)  # t = 30: 10 s after it began
    assert loop.of(alarm) == [("raised", severity, 30.0)]
    assert [(x.alarm, x.severity) for x in a.alarms] == [(alarm, severity)]
    loop.run(60, band)
    assert len(loop.of(alarm)) == 1
    loop.run(30, healthy)  # t = 91..120
    assert len(loop.of(alarm)) == 1
    a = loop.run(1, healthy)  # 30 s after it went away
    assert loop.of(alarm)[-1] == ("cleared", severity, 121.0)
    assert a.worst_severity is None
    a = loop.run(60, healthy)  # forced levels (2 for degraded) step down by then
    assert a.forced_levels == {"r1": 0, "r2": 0}


def test_event_carries_value_threshold_and_detail() -> None:
    """A supply alarm says what was measured, against which limit, and what it cleared past."""
    loop = Loop()
    loop.run(11, cdu_msg(supply_c=36.0))
    loop.run(31, cdu_msg())
    raised, cleared = loop.events
    assert (raised.loop, raised.alarm, raised.action, raised.previous) == (
        "loopA",
        "supply_temp_high",
        "raised",
        None,
    )
    assert (raised.value, raised.threshold) == (36.0, 35.0)
    assert raised.detail == "supply 36.0 C (limit 35.0 C)"
    assert (cleared.value, cleared.threshold, cleared.previous) == (30.0, 34.0, "warning")
    assert (
        cleared.text
        == "loopA: supply_temp_high cleared (warning): supply 30.0 C (back past 34.0 C)"
    )


def test_short_glitches_and_noise_at_a_threshold_do_not_flap() -> None:
    """9 s over the limit raises nothing; once raised, noise inside the hysteresis never clears."""
    loop = Loop()
    loop.run(9, cdu_msg(supply_c=35.3))
    loop.run(5, cdu_msg())
    assert loop.events == []
    noisy = random.Random(7)  # noqa: S311 - seeded sensor noise, not cryptography
    loop.run(600, lambda _t: cdu_msg(supply_c=35.0 + noisy.uniform(-0.3, 0.3)))
    assert loop.events == []  # never 10 s in a row over the limit
    loop.run(15, lambda _t: cdu_msg(supply_c=35.5 + noisy.uniform(-0.3, 0.3)))
    loop.run(250, lambda _t: cdu_msg(supply_c=35.0 + noisy.uniform(-0.9, 0.9)))
    assert [(e.action, e.alarm) for e in loop.events] == [("raised", "supply_temp_high")]


def test_persisting_alarm_escalates_warning_degraded_critical_then_steps_down() -> None:
    """With escalation_ceiling critical: +300 s degraded (T2), +600 s critical (brake)."""
    timing = AlarmTiming(escalation_ceiling="critical")
    loop = Loop(make_spec(timing=timing))
    loop.run(1, cdu_msg())
    a = loop.run(11, cdu_msg(supply_c=36.0))  # t = 1..11
    assert a.worst_severity == "warning"
    assert a.forced_level == 0
    a = loop.run(300, cdu_msg(supply_c=36.0))  # t = 311
    assert a.worst_severity == "degraded"
    assert a.forced_levels == {"r1": 2, "r2": 2}
    a = loop.run(300, cdu_msg(supply_c=36.0))  # t = 611
    assert a.worst_severity == "critical"
    assert a.emergency
    assert a.forced_level == 3
    assert loop.of("supply_temp_high") == [
        ("raised", "warning", 11.0),
        ("escalated", "degraded", 311.0),
        ("escalated", "critical", 611.0),
    ]
    assert "persisted 300 s" in loop.events[-1].detail
    levels = [loop.run(1, cdu_msg()).forced_level for _ in range(200)]  # t = 612..811
    assert loop.of("supply_temp_high")[-1] == ("cleared", "critical", 642.0)
    # The forced level falls one level per 30 s after the alarm cleared, never two at once.
    assert [levels.index(n) + 612 for n in (2, 1, 0)] == [672, 702, 732]
    assert all(b - a in (0, -1) for a, b in itertools.pairwise(levels))


def test_escalation_stops_at_the_default_ceiling() -> None:
    """By default persistence alone reaches degraded, never critical."""
    loop = Loop()
    a = loop.run(2000, cdu_msg(supply_c=36.0))
    assert a.worst_severity == "degraded"
    assert not a.emergency
    assert [x[0] for x in loop.of("supply_temp_high")] == ["raised", "escalated"]


def test_worsening_flow_escalates_by_threshold_and_steps_down() -> None:
    """Flow 80% warning, 65% degraded, 40% critical within 2 s; back to 60%: degraded again."""
    loop = Loop()
    flow = DESIGN_FLOW_LPM
    loop.run(11, cdu_msg(flow_lpm=0.8 * flow))
    loop.run(11, cdu_msg(flow_lpm=0.65 * flow))
    a = loop.run(3, cdu_msg(flow_lpm=0.4 * flow))
    assert a.emergency
    assert a.forced_level == 3
    assert loop.of("flow_low") == [
        ("raised", "warning", 10.0),
        ("escalated", "degraded", 21.0),
        ("escalated", "critical", 24.0),
    ]
    a = loop.run(40, cdu_msg(flow_lpm=0.6 * flow))
    assert loop.of("flow_low")[-1] == ("deescalated", "degraded", 55.0)
    assert a.worst_severity == "degraded"
    assert not a.emergency


def test_leak_critical_caps_only_the_racks_of_its_loop_at_once() -> None:
    """A critical leak on loop A forces the brake on r1, r2 in 2 s; loop B's racks stay at 0."""
    cfg = CoolingSettings(
        loops=(
            make_spec(),
            make_spec(name="loopB", cdu="cduB", racks=("r3",), heat_capacity_kw=50.0),
        )
    )
    sup = CoolingSupervisor(cfg)
    power = {**POWER_W, "r3": 40_000.0}
    levels: list[dict[str, int]] = []
    for t in range(200):
        leaks = ("ok", "critical") if 10 <= t < 40 else ("ok", "ok")
        assert sup.observe(cdu_msg(leaks=leaks, ts_ns=t), now_s=t)
        assert sup.observe(cdu_msg(cdu="cduB", load_kw=32.0, ts_ns=t), now_s=t)
        step = sup.step(rack_power_w=power, now_s=t, top_level=3)
        levels.append(dict(step.forced_levels))
        if t == 12:
            assert step.emergency_racks == ("r1", "r2")
            assert [(e.loop, e.alarm, e.severity, e.action) for e in step.events] == [
                ("loopA", "leak", "critical", "raised")
            ]
            assert step.events[0].detail == "leak detectors not ok 1: leak1"
            assert step.loops["loopA"].leaks == ("leak1",)
    assert levels[11] == {"r1": 0, "r2": 0, "r3": 0}
    assert levels[12] == {"r1": 3, "r2": 3, "r3": 0}
    assert all(lv["r3"] == 0 for lv in levels)
    r1 = [lv["r1"] for lv in levels]
    # Leak gone at 40, alarm cleared at 70, then one level down per 30 s.
    assert [r1.index(n, 12) for n in (2, 1, 0)] == [100, 130, 160]
    assert sup.last is not None
    assert sup.last.emergency_racks == ()


def test_forced_levels_respect_the_policy_and_settings() -> None:
    """Critical means the policy's top level; every level is clamped to that top."""
    forced = ForcedLevels()
    assert [forced_level_for(s, forced, top_level=3) for s in (None, "warning", "degraded")] == [
        0,
        0,
        2,
    ]
    assert forced_level_for("critical", forced, top_level=5) == 5
    assert forced_level_for("degraded", forced, top_level=1) == 1
    custom = ForcedLevels(warning_level=1, degraded_level=1, critical_level=2)
    assert forced_level_for("critical", custom, top_level=3) == 2


def test_stale_cdu_reduces_the_budget_and_holds_other_alarms() -> None:
    """Silent > 5 s: budget x 0.75, telemetry_stale raised, supply alarm held; then recovery."""
    loop = Loop()
    loop.run(20, cdu_msg(supply_c=36.0))  # supply alarm raised at 10
    fresh = loop.run(1, cdu_msg(supply_c=36.0))
    assert loop.run(5, None).thermal_budget_w == fresh.thermal_budget_w  # 5 s: still fresh
    a = loop.run(1, None)  # 6 s without a message
    assert a.stale
    assert a.supply_temp_c is None
    assert a.telemetry_age_s == 6.0
    assert a.thermal_budget_w == pytest.approx(0.75 * fresh.thermal_budget_w)
    assert a.derate.stale == 0.75
    assert loop.of("telemetry_stale") == [("raised", "warning", 26.0)]
    a = loop.run(400, None)
    assert loop.of("telemetry_stale")[-1] == ("escalated", "degraded", 326.0)
    assert a.forced_level == 2
    # The supply alarm neither cleared nor escalated without evidence.
    assert loop.of("supply_temp_high") == [("raised", "warning", 10.0)]
    a = loop.run(31, cdu_msg())
    assert not a.stale
    assert a.thermal_budget_w == pytest.approx(125_000.0)
    assert loop.of("telemetry_stale")[-1][0] == "cleared"
    assert loop.of("supply_temp_high")[-1][0] == "cleared"


def test_cdu_never_heard_from_is_stale_after_the_grace() -> None:
    """No message at all: rated capacity for 5 s, then 75% of it and telemetry_stale."""
    loop = Loop()
    a = loop.run(6, None)
    assert not a.stale
    assert a.thermal_budget_w == pytest.approx(125_000.0)
    a = loop.run(1, None)
    assert a.stale
    assert a.telemetry_age_s is None
    assert a.thermal_budget_w == pytest.approx(0.75 * 125_000.0)
    assert loop.of("telemetry_stale") == [("raised", "warning", 6.0)]


def test_heat_balance_catches_a_stuck_return_sensor() -> None:
    """Load doubles while the return sensor stays put: sensor_disagreement after the debounce."""
    loop = Loop()
    stuck_c = cdu_msg().secondary.return_temp_c
    loop.run(300, cdu_msg())
    high = {"r1": 70_000.0, "r2": 70_000.0}  # 112 kW into the loop
    loop.run(600, cdu_msg(return_c=stuck_c), power_w=high)
    raised = loop.events[0]
    assert {e.alarm for e in loop.events} == {"sensor_disagreement"}
    assert raised.action == "raised"
    assert raised.value is not None
    assert raised.value < -20
    assert 300 + 120 < raised.at_s < 300 + 300
    a = loop.history[-1]
    assert a.heat_removed_kw == pytest.approx(LOAD_KW)
    assert a.heat_load_kw == pytest.approx(112.0)


def test_heat_balance_catches_a_drifting_sensor_but_not_before_tolerance() -> None:
    """Return temperature drifting +0.005 C/s: raised only once the error passed 20%."""
    loop = Loop()
    loop.run(60, cdu_msg())
    base_c = cdu_msg().secondary.return_temp_c
    assert base_c is not None
    loop.run(1200, lambda t: cdu_msg(return_c=base_c + 0.005 * (t - 60)))
    raised = loop.events[0]
    assert (raised.alarm, raised.action) == ("sensor_disagreement", "raised")
    # dT of 6.1 C; +20% is +1.22 C of drift, reached at 245 s, seen through the filters.
    drift_at_raise_c = 0.005 * (raised.at_s - 60)
    assert drift_at_raise_c > 1.22
    assert raised.at_s < 60 + 245 + 120 + 200


def test_heat_balance_is_not_judged_at_low_load_or_without_rack_power() -> None:
    """Below 10% of capacity, or with a rack's power missing, the heat balance is skipped."""
    loop = Loop()
    a = loop.run(600, cdu_msg(return_c=30.5), power_w={"r1": 5_000.0, "r2": 5_000.0})
    assert a.heat_balance_error_pct is None
    assert loop.events == []
    a = loop.run(600, cdu_msg(return_c=30.5), power_w={"r1": 40_000.0})
    assert a.racks_without_power == ("r2",)
    assert a.heat_balance_error_pct is None
    assert loop.events == []


def test_heat_balance_is_suspended_while_the_loop_is_starved_of_flow() -> None:
    """Loss of flow: the loop stores heat; flow_low is raised, not sensor_disagreement."""
    loop = Loop()
    healthy_return_c = cdu_msg().secondary.return_temp_c
    loop.run(60, cdu_msg())
    loop.run(900, cdu_msg(flow_lpm=0.3 * DESIGN_FLOW_LPM, return_c=healthy_return_c))
    assert {e.alarm for e in loop.events} == {"flow_low"}
    assert loop.history[-1].heat_balance_error_pct is None


def test_heat_balance_uses_the_cdus_heat_removed_without_flow() -> None:
    """No flow reading: the CDU's heat_removed_kw is compared instead."""
    loop = Loop()
    msg = CduTelemetry(
        ts_ns=0,
        cdu="cduA",
        loop="loopA",
        secondary=CoolantConnector(supply_temp_c=30.0, return_temp_c=36.0, heat_removed_kw=30.0),
    )
    loop.run(400, msg)
    assert loop.history[-1].heat_removed_kw == 30.0
    assert loop.history[-1].flow_fraction is None
    assert loop.history[-1].derate.flow == 1.0
    assert [(e.alarm, e.action) for e in loop.events] == [("sensor_disagreement", "raised")]


def test_heat_balance_tolerates_load_steps_through_the_loop_lag() -> None:
    """Load steps 40% <-> 90% every 10 min with a 20 s plant lag: no disagreement."""
    loop = Loop()
    removed_kw = [LOAD_KW]

    def power(t: float) -> dict[str, float]:
        rack_w = 25_000.0 if (t // 600) % 2 == 0 else 56_000.0
        return {"r1": rack_w, "r2": rack_w}

    for t in range(3600):
        load_kw = sum(power(t).values()) * 0.8 / 1000
        removed_kw[0] += (load_kw - removed_kw[0]) * (1 - math.exp(-1 / 20))
        a = loop.sup.update(
            cdu_msg(load_kw=removed_kw[0]), rack_power_w=power(t), now_s=float(t), top_level=3
        )
        assert a.events == ()


def test_thermal_budget_derates_with_flow_pumps_and_supply_temperature() -> None:
    """Flow 80% -> 80%; N of N+1 pumps -> 90%; none left -> floor; supply midway -> 75%."""
    spec = make_spec()
    full = 125_000.0

    def budget(msg: CduTelemetry) -> float:
        return (
            LoopSupervisor(spec)
            .update(msg, rack_power_w=POWER_W, now_s=0.0, top_level=3)
            .thermal_budget_w
        )

    assert budget(cdu_msg(flow_lpm=0.8 * DESIGN_FLOW_LPM)) == pytest.approx(0.8 * full)
    assert budget(cdu_msg(flow_lpm=1.2 * DESIGN_FLOW_LPM)) == pytest.approx(full)
    assert budget(cdu_msg(pumps=("running", "failed"))) == pytest.approx(0.9 * full)
    assert budget(cdu_msg(pumps=("failed", "failed"))) == pytest.approx(0.05 * full)
    assert budget(cdu_msg(supply_c=37.5)) == pytest.approx(0.75 * full)
    assert budget(cdu_msg(supply_c=45.0)) == pytest.approx(0.5 * full)
    both = budget(cdu_msg(flow_lpm=0.8 * DESIGN_FLOW_LPM, pumps=("running", "failed")))
    assert both == pytest.approx(0.8 * full)  # flow and pumps share a min(): no double count


def test_pump_alarm_grades_redundancy() -> None:
    """N+2: one pump off is a warning; down to N degraded; below N critical."""
    spec = make_spec(pump_count=3, pumps_required=1)
    sup = LoopSupervisor(spec)
    cases = [
        (("running", "standby", "off"), "warning"),
        (("running", "failed", "failed"), "degraded"),
        (("failed", "failed", "off"), "critical"),
    ]
    for pumps, severity in cases:
        sup = LoopSupervisor(spec)
        for t in range(12):
            a = sup.update(cdu_msg(pumps=pumps), rack_power_w=POWER_W, now_s=t, top_level=3)
        assert [(x.alarm, x.severity) for x in a.alarms] == [("pump_failure", severity)]


def test_effective_budget_is_the_lower_of_electrical_and_thermal() -> None:
    """min() per rack; a rack with one budget keeps it; a rack with neither has none."""
    electrical = {"r1": 50_000.0, "r2": None, "r3": 10_000.0, "r4": None}
    thermal = {"r1": 40_000.0, "r2": 30_000.0, "r3": 20_000.0}
    assert effective_rack_budgets(electrical, thermal) == {
        "r1": 40_000.0,
        "r2": 30_000.0,
        "r3": 10_000.0,
    }
    assert effective_row_budget_w(100_000.0, ["r1", "r2"], thermal) == 70_000.0
    assert effective_row_budget_w(60_000.0, ["r1", "r2"], thermal) == 60_000.0
    assert effective_row_budget_w(100_000.0, ["r1", "r4"], thermal) == 100_000.0


def test_supervisor_routes_by_cdu_and_orders_by_receipt() -> None:
    """Unknown CDUs are refused; a step uses the last message received, whatever its stamp."""
    sup = CoolingSupervisor(CoolingSettings(loops=(make_spec(),)))
    assert not sup.observe(cdu_msg(cdu="elsewhere"), now_s=0.0)
    assert sup.observe(cdu_msg(supply_c=31.0, ts_ns=10), now_s=0.0)
    assert sup.observe(cdu_msg(supply_c=32.0, ts_ns=5), now_s=0.5)
    step = sup.step(rack_power_w=POWER_W, now_s=1.0, top_level=3)
    assert step.loops["loopA"].supply_temp_c == 32.0
    assert step.loops["loopA"].telemetry_age_s == 0.5
    assert step.rack_thermal_budget_w == pytest.approx({"r1": 62_500.0, "r2": 62_500.0})


def test_future_stamped_reading_does_not_silence_later_ones() -> None:
    """After a reading stamped a year ahead, and the CDU's clock stepped back, a leak caps."""
    year_ns = 365 * 86_400 * 10**9
    sup = CoolingSupervisor(CoolingSettings(loops=(make_spec(),)))
    assert sup.observe(cdu_msg(ts_ns=10**18 + year_ns), now_s=0.0)
    sup.step(rack_power_w=POWER_W, now_s=0.0, top_level=3)
    stepped_back_ns = 10**18 - 3600 * 10**9  # the CDU's clock stepped back an hour
    leak = cdu_msg(leaks=("critical", "ok"), ts_ns=stepped_back_ns)
    forced: Mapping[str, int] = {}
    for tick in range(1, 20):
        assert sup.observe(leak, now_s=float(tick))
        forced = sup.step(rack_power_w=POWER_W, now_s=float(tick), top_level=3).forced_levels
    assert forced == {"r1": 3, "r2": 3}


def _healthy_day(seed: int) -> Callable[[int], tuple[CduTelemetry, dict[str, float]]]:
    """A noisy healthy loop: random-walk load with job steps and swings, lagged plant, sensors."""
    rng = random.Random(seed)  # noqa: S311 - seeded sensor noise, not cryptography
    pumps = (Pump(name="pump0", state="running"), Pump(name="pump1", state="standby"))
    leaks = (LeakDetector(name="leak0", state="ok"), LeakDetector(name="leak1", state="ok"))
    state = {"level_w": 40_000.0, "target_w": 40_000.0, "removed_kw": LOAD_KW}
    walk = {"flow": 0.0, "supply": 0.0}
    lag = 1 - math.exp(-1 / 20)  # the plant's lag differs from the supervisor's 30 s on purpose

    def at(t: int) -> tuple[CduTelemetry, dict[str, float]]:
        if t % 1800 == 0:  # a job starts or ends every half hour
            state["target_w"] = rng.uniform(30_000.0, 55_000.0)
        state["level_w"] += (state["target_w"] - state["level_w"]) * 0.05
        power = {"r1": state["level_w"] * rng.uniform(0.9, 1.1), "r2": state["level_w"]}
        load_kw = (power["r1"] + power["r2"]) * 0.8 / 1000
        state["removed_kw"] += (load_kw - state["removed_kw"]) * lag
        walk["flow"] = min(0.03, max(-0.03, walk["flow"] + rng.gauss(0, 0.002)))
        walk["supply"] = min(1.0, max(-1.0, walk["supply"] + rng.gauss(0, 0.02)))
        flow_lpm = DESIGN_FLOW_LPM * (1 + walk["flow"])
        supply_c = 30.0 + walk["supply"]
        delta_t_c = state["removed_kw"] / (flow_lpm / 60 * DENSITY_KG_PER_L * CP_KJ_PER_KG_K)
        msg = CduTelemetry.model_validate(
            {
                "ts_ns": t * 1_000_000_000,
                "cdu": "cduA",
                "loop": "loopA",
                "secondary": {
                    "supply_temp_c": supply_c + rng.gauss(0, 0.1),
                    "return_temp_c": supply_c + delta_t_c + rng.gauss(0, 0.1),
                    "flow_lpm": flow_lpm * (1 + rng.gauss(0, 0.01)),
                },
                "pumps": pumps,
                "leak_detectors": leaks,
            }
        )
        return msg, power

    return at


def test_a_day_of_healthy_noisy_operation_raises_no_alarm() -> None:
    """86,400 one-second readings of a healthy, noisy loop: no event, no budget cut below 90%."""
    sup = LoopSupervisor(make_spec())
    day = _healthy_day(seed=2024)
    lowest_w = math.inf
    for t in range(86_400):
        msg, power = day(t)
        a = sup.update(msg, rack_power_w=power, now_s=float(t), top_level=3)
        assert not a.events, a.events
        lowest_w = min(lowest_w, a.thermal_budget_w)
    assert lowest_w > 0.9 * 125_000.0


# ---- properties -------------------------------------------------------------------------

SPEC = make_spec()
flows = st.floats(min_value=0.0, max_value=2.0, allow_nan=False)
temps = st.floats(min_value=0.0, max_value=80.0, allow_nan=False)
pump_counts = st.integers(min_value=0, max_value=2)


@settings(max_examples=300, deadline=None)
@given(f1=flows, f2=flows, pumps=pump_counts, supply_c=temps)
def test_budget_is_monotone_in_flow(f1: float, f2: float, pumps: int, supply_c: float) -> None:
    """More flow never lowers the capacity."""
    lo, hi = sorted((f1, f2))
    a = derate(SPEC, flow_fraction=lo, pumps_available=pumps, supply_temp_c=supply_c)
    b = derate(SPEC, flow_fraction=hi, pumps_available=pumps, supply_temp_c=supply_c)
    assert a.total <= b.total


@settings(max_examples=300, deadline=None)
@given(t1=temps, t2=temps, flow=flows, pumps=pump_counts)
def test_budget_is_monotone_in_supply_margin(t1: float, t2: float, flow: float, pumps: int) -> None:
    """A warmer supply (less margin to the limit) never raises the capacity."""
    cool_c, warm_c = sorted((t1, t2))
    a = derate(SPEC, flow_fraction=flow, pumps_available=pumps, supply_temp_c=cool_c)
    b = derate(SPEC, flow_fraction=flow, pumps_available=pumps, supply_temp_c=warm_c)
    assert b.total <= a.total


@settings(max_examples=300, deadline=None)
@given(
    flow=st.one_of(st.none(), flows),
    pumps=st.one_of(st.none(), st.integers(min_value=0, max_value=16)),
    supply_c=st.one_of(st.none(), temps),
    floor=st.floats(min_value=0.01, max_value=1.0),
)
def test_budget_is_never_below_its_positive_floor(
    flow: float | None, pumps: int | None, supply_c: float | None, floor: float
) -> None:
    """Whatever the readings, 0 < floor <= derate <= 1, so every budget stays positive."""
    spec = make_spec(derating=Derating(floor_fraction=floor))
    d = derate(spec, flow_fraction=flow, pumps_available=pumps, supply_temp_c=supply_c)
    assert 0 < floor <= d.total <= 1.0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=28.0, max_value=46.0), min_size=1, max_size=300))
def test_alarm_events_follow_their_grammar(supplies: list[float]) -> None:
    """Any supply trace: raise first, then escalations/de-escalations, clear last; debounced."""
    spec = make_spec(timing=AlarmTiming(escalate_after_s=60, escalation_ceiling="critical"))
    sup = LoopSupervisor(spec)
    events: list[AlarmEvent] = []
    for t, supply_c in enumerate(supplies):
        events.extend(
            sup.update(
                cdu_msg(supply_c=supply_c), rack_power_w=POWER_W, now_s=t, top_level=3
            ).events
        )
    active = None
    for e in (e for e in events if e.alarm == "supply_temp_high"):
        if e.action == "raised":
            assert active is None
            t = int(e.at_s)
            held_s, limit_c = (2, 40.0) if e.severity == "critical" else (10, 35.0)
            assert t >= held_s
            assert min(supplies[t - held_s : t + 1]) >= limit_c
        else:
            assert active is not None
            assert e.previous == active
        active = None if e.action == "cleared" else e.severity
