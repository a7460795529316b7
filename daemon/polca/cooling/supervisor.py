"""Liquid-cooling loop supervision: CDU readings -> alarms, thermal power budgets, forced levels.

Why this module exists: a CDU removes only so much heat. When flow drops, a pump fails,
the supply temperature creeps up or a leak appears, the GPUs on that loop must draw less
before they throttle or trip, low priority first. This module turns one loop's CDU
telemetry and its racks' electrical power into (a) debounced alarm events, (b) a thermal
power budget per rack, which the row controller combines with the electrical one
(``budgets.effective_rack_budgets``), and (c) a control level forced on the loop's racks in
an emergency. It composes the parts, each in its own module: the heat balance (``heat``),
the capacity and budgets (``budgets``), the alarms (``alarms``, one spec per kind, debounced
by ``debounce``), over the evidence of one instant (``evidence``).

What it must not do: no I/O, no asyncio, no logging, no clock (time comes in as ``now_s``,
monotonic), and no names of the aggregator's outputs: it returns typed results
(``LoopAssessment``, ``AlarmEvent``), and the aggregator turns them into MQTT payloads and
InfluxDB points (``polca.aggregator.points``).

**Stale CDU** (no message for ``stale_after_s``, counted from the first update): the
capacity is the last fresh one (the rating if the CDU never reported) times
``stale_fraction``; ``telemetry_stale`` raises at once (warning) and escalates with time like
any alarm (to degraded by default, which forces ``degraded_level``). Every other alarm holds
its state while stale: without evidence, nothing raises, clears or escalates.

**Use.** ``CoolingSupervisor`` runs every loop: ``observe()`` each CDU message as it comes,
``step()`` once per control interval with every rack's power; its ``CoolingStep`` has the
events to publish, each loop's assessment, and per rack the thermal budget and forced level.

**Forced levels.** The loop's worst severity maps to a level (``ForcedLevels``: warning 0,
degraded 2 = T2, critical = the policy's top level, the brake). It rises at once and falls
one level per ``clear_after_s`` while the target stays lower. Every rack of the loop gets
it (``forced_levels``); racks of healthy loops get 0. ``emergency`` means critical.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from polca.cooling.alarms import ActiveAlarm, AlarmEngine, AlarmEvent
from polca.cooling.budgets import Derate, derate, rack_shares, stale_derate, thermal_budget_w
from polca.cooling.evidence import Evidence, Reading
from polca.cooling.heat import HeatBalance, heat_load_kw, heat_removed_kw
from polca.cooling.loops import SEVERITIES, CoolingSettings, ForcedLevels, LoopSpec, Severity
from polca.telemetry.schema import CduTelemetry

__all__ = [
    "CoolingStep",
    "CoolingSupervisor",
    "LoopAssessment",
    "LoopSupervisor",
    "forced_level_for",
]

_SEVERITY: tuple[Severity | None, ...] = (None, *SEVERITIES)
_CRITICAL = 3


def forced_level_for(severity: Severity | None, forced: ForcedLevels, *, top_level: int) -> int:
    """The control level the worst alarm severity forces on a loop's racks (at most top)."""
    if severity is None:
        return 0
    if severity == "warning":
        level = forced.warning_level
    elif severity == "degraded":
        level = forced.degraded_level
    else:
        level = top_level if forced.critical_level is None else forced.critical_level
    return max(0, min(level, top_level))


@dataclass(frozen=True, slots=True)
class LoopAssessment:
    """One loop at one instant: what the controller, MQTT and the dashboards need.

    Readings are None while stale or when the CDU does not report them.
    """

    loop: str
    cdu: str
    at_s: float
    racks: tuple[str, ...]
    stale: bool
    telemetry_age_s: float | None  # None: never heard from
    heat_load_kw: float  # racks' power x capture fraction (unknown racks count 0)
    racks_without_power: tuple[str, ...]
    heat_removed_kw: float | None
    heat_balance_error_pct: float | None  # filtered, signed: measured vs expected
    rated_capacity_kw: float
    capacity_kw: float  # derated
    headroom_kw: float  # capacity - heat load (negative: over capacity)
    load_pct: float  # heat load in % of the derated capacity
    derate: Derate
    supply_temp_c: float | None
    return_temp_c: float | None
    delta_t_c: float | None
    flow_lpm: float | None
    flow_fraction: float | None
    pumps_available: int | None
    pumps_failed: tuple[str, ...]
    leaks: tuple[str, ...]  # detectors not ok
    alarms: tuple[ActiveAlarm, ...]
    worst_severity: Severity | None
    emergency: bool
    thermal_budget_w: float
    rack_thermal_budget_w: Mapping[str, float]
    forced_level: int
    forced_levels: Mapping[str, int]
    events: tuple[AlarmEvent, ...]


class LoopSupervisor:
    """Supervision of one loop: call ``update`` once per control interval."""

    def __init__(
        self, spec: LoopSpec, *, stale_after_s: float = 5.0, forced: ForcedLevels | None = None
    ) -> None:
        self.spec = spec
        self.stale_after_s = stale_after_s
        self.forced = forced or ForcedLevels()
        self._alarms = AlarmEngine(spec, stale_after_s=stale_after_s)
        self._shares = rack_shares(spec)
        self._reading: Reading | None = None
        self._first_s: float | None = None
        self._seen_s: float | None = None
        self._last_fresh: Derate | None = None
        self._balance = HeatBalance()
        self._forced_level = 0
        self._release_since_s: float | None = None

    def update(
        self,
        cdu: CduTelemetry | None,
        *,
        rack_power_w: Mapping[str, float],
        now_s: float,
        top_level: int,
        received_s: float | None = None,
    ) -> LoopAssessment:
        """Assess the loop at ``now_s``.

        ``cdu`` is the newest message received since the last update (None: none came; the
        previous reading stands until it goes stale), ``received_s`` when it came (default
        ``now_s``). ``rack_power_w`` maps rack name -> electrical power (racks of other loops
        are ignored; a missing rack counts 0 and suspends the heat balance). ``top_level`` is
        the policy's top level (the brake).
        """
        spec = self.spec
        if self._first_s is None:
            self._first_s = now_s
        if cdu is not None:
            self._reading = Reading.of(cdu)
            self._seen_s = now_s if received_s is None else received_s
        age_s = now_s - (self._seen_s if self._seen_s is not None else self._first_s)
        stale = age_s > self.stale_after_s
        reading = None if stale else self._reading

        load_kw, missing = heat_load_kw(spec, rack_power_w)
        flow_fraction = None
        delta_t_c = None
        measured_kw = None
        if reading is not None:
            if reading.flow_lpm is not None:
                flow_fraction = reading.flow_lpm / spec.design_flow_lpm
            if reading.supply_c is not None and reading.return_c is not None:
                delta_t_c = reading.return_c - reading.supply_c
            measured_kw = heat_removed_kw(spec, reading, delta_t_c)
            rating = derate(
                spec,
                flow_fraction=flow_fraction,
                pumps_available=reading.pumps_available,
                supply_temp_c=reading.supply_c,
            )
            self._last_fresh = rating
        elif stale:
            rating = stale_derate(spec, self._last_fresh)
        else:
            rating = Derate()  # not yet heard from, not yet stale: the start-up grace

        # Starved of flow, the loop stores heat instead of removing it: that imbalance is
        # physics, already alarmed as flow_low, not a sensor fault.
        alarms = self._alarms
        starved = alarms.rank("flow_low") > 0 or alarms.rank("pump_failure") >= _CRITICAL
        if reading is not None and measured_kw is not None and not missing and not starved:
            self._balance.update(spec, load_kw, measured_kw, now_s)
        else:
            self._balance.reset()
        balance_pct = self._balance.error_pct(spec, now_s)

        evidence = Evidence(
            reading=reading,
            stale=stale,
            age_s=age_s,
            flow_fraction=flow_fraction,
            delta_t_c=delta_t_c,
            balance_pct=balance_pct,
        )
        events = alarms.step(evidence, now_s=now_s)
        worst_rank = alarms.worst_rank
        active = alarms.active() if worst_rank else ()
        worst = _SEVERITY[worst_rank]
        forced_level = self._step_forced(worst, now_s, top_level)

        capacity_kw = spec.heat_capacity_kw * rating.total
        budget_w = thermal_budget_w(spec, capacity_kw)
        return LoopAssessment(
            loop=spec.name,
            cdu=spec.cdu,
            at_s=now_s,
            racks=spec.racks,
            stale=stale,
            telemetry_age_s=None if self._seen_s is None else age_s,
            heat_load_kw=load_kw,
            racks_without_power=missing,
            heat_removed_kw=measured_kw,
            heat_balance_error_pct=balance_pct,
            rated_capacity_kw=spec.heat_capacity_kw,
            capacity_kw=capacity_kw,
            headroom_kw=capacity_kw - load_kw,
            load_pct=100.0 * load_kw / capacity_kw,
            derate=rating,
            supply_temp_c=None if reading is None else reading.supply_c,
            return_temp_c=None if reading is None else reading.return_c,
            delta_t_c=delta_t_c,
            flow_lpm=None if reading is None else reading.flow_lpm,
            flow_fraction=flow_fraction,
            pumps_available=None if reading is None else reading.pumps_available,
            pumps_failed=() if reading is None else reading.pumps_failed,
            leaks=() if reading is None else reading.leaks,
            alarms=active,
            worst_severity=worst,
            emergency=worst_rank == _CRITICAL,
            thermal_budget_w=budget_w,
            rack_thermal_budget_w={rack: budget_w * f for rack, f in self._shares.items()},
            forced_level=forced_level,
            forced_levels=dict.fromkeys(spec.racks, forced_level),
            events=events,
        )

    def _step_forced(self, worst: Severity | None, now_s: float, top_level: int) -> int:
        """Rise to the target level at once; fall one level per clear_after_s."""
        target = forced_level_for(worst, self.forced, top_level=top_level)
        self._forced_level = min(self._forced_level, max(0, top_level))
        if target >= self._forced_level:
            self._forced_level = target
            self._release_since_s = None
            return target
        if self._release_since_s is None:
            self._release_since_s = now_s
        if now_s - self._release_since_s >= self.spec.timing.clear_after_s:
            self._forced_level -= 1
            self._release_since_s = now_s if self._forced_level > target else None
        return self._forced_level


@dataclass(frozen=True, slots=True)
class CoolingStep:
    """Every loop at one control interval, and what the row controller must apply."""

    loops: Mapping[str, LoopAssessment]
    events: tuple[AlarmEvent, ...]
    rack_thermal_budget_w: Mapping[str, float]  # every rack on a loop
    forced_levels: Mapping[str, int]  # every rack on a loop (0: nothing forced)
    emergency_racks: tuple[str, ...]


class CoolingSupervisor:
    """All loops of the aggregator: route CDU messages by CDU id, step every loop."""

    def __init__(self, settings: CoolingSettings) -> None:
        self.settings = settings
        self.loops = {
            spec.name: LoopSupervisor(
                spec, stale_after_s=settings.stale_after_s, forced=settings.forced
            )
            for spec in settings.loops
        }
        self._loop_of_cdu = {spec.cdu: spec.name for spec in settings.loops}
        self._pending: dict[str, tuple[CduTelemetry, float]] = {}
        self.last: CoolingStep | None = None

    def observe(self, cdu: CduTelemetry, now_s: float) -> bool:
        """Keep a CDU message for the next step; False for an unknown CDU.

        Messages are routed by ``cdu`` (the message's ``loop`` is informational) and
        ordered by receipt (``now_s``, monotonic), never by the CDU's own ``ts_ns``: a
        reading stamped a year ahead, or a CDU whose clock steps back, must not make later
        readings look old and be ignored.
        """
        loop = self._loop_of_cdu.get(cdu.cdu)
        if loop is None:
            return False
        self._pending[loop] = (cdu, now_s)
        return True

    def step(
        self, *, rack_power_w: Mapping[str, float], now_s: float, top_level: int
    ) -> CoolingStep:
        """Assess every loop with the newest message each received since the last step."""
        assessments: dict[str, LoopAssessment] = {}
        for name, supervisor in self.loops.items():
            pending = self._pending.pop(name, None)
            assessments[name] = supervisor.update(
                None if pending is None else pending[0],
                rack_power_w=rack_power_w,
                now_s=now_s,
                top_level=top_level,
                received_s=None if pending is None else pending[1],
            )
        budgets: dict[str, float] = {}
        forced: dict[str, int] = {}
        emergency: list[str] = []
        for a in assessments.values():
            budgets.update(a.rack_thermal_budget_w)
            forced.update(a.forced_levels)
            if a.emergency:
                emergency.extend(a.racks)
        self.last = CoolingStep(
            loops=assessments,
            events=tuple(e for a in assessments.values() for e in a.events),
            rack_thermal_budget_w=budgets,
            forced_levels=forced,
            emergency_racks=tuple(emergency),
        )
        return self.last
