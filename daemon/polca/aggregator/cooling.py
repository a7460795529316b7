"""Liquid-cooling loop supervision: CDU readings -> alarms, thermal power budgets, forced levels.

Why this module exists: a CDU removes only so much heat. When flow drops, a pump fails,
the supply temperature creeps up or a leak appears, the GPUs on that loop must draw less
before they throttle or trip, low priority first. This module turns one loop's CDU
telemetry and its racks' electrical power into (a) debounced alarm events, (b) a thermal
power budget per rack, which the row controller combines with the electrical one
(``effective_rack_budgets``), and (c) a control level forced on the loop's racks in an
emergency. Pure: no I/O, no asyncio, no logging; time comes in as ``now_s`` (monotonic).

**Heat.** The loop's heat load is the sum of its racks' power times ``capture_fraction``.
Heat removed is measured as flow x density x cp x (return - supply), or the CDU's
``heat_removed_kw`` when it does not report all three. The heat balance compares the two
after the same filter (``heat_balance_window_s``), the electrical side first delayed by the
loop's lag (``heat_balance_lag_s``); it is not judged below ``min_load_kw`` or while a
rack's power is unknown, nor while flow_low (or pump_failure at critical) is active: a loop
starved of flow stores heat rather than removing it. After each such gap (and at start) the
filters settle for two windows before the balance is judged again. A negative error (less
heat in the coolant than the racks put out) means a sensor reading low, or heat escaping to
room air because the cold plates are starved (a bypass, a clogged manifold); a positive one,
a sensor reading high or a ``capture_fraction`` set too low. Either way
``sensor_disagreement`` says: do not trust the loop's readings, and check them.

**Capacity and thermal budget** (``derate``): rated capacity x max(floor, min(flow, pumps)
x supply_temp), where flow = measured / design flow (at most 1); pumps = 1 with redundancy,
``redundancy_lost_fraction`` with only the required pumps left, proportionally less below
that; supply_temp = 1 up to ``derate_start_c``, linear to ``supply_floor_fraction`` at
``supply_critical_c``. Flow and pumps share a min() because a failed pump shows as lost
flow too. An unreported reading derates nothing (but its alarm cannot raise either). The
loop's thermal budget is capacity / capture_fraction (in rack electrical watts), split
between its racks by ``rack_weights`` (equally by default): a static split, not by current
load, so an idle rack keeps room to start and a busy one cannot starve the others.

**Stale CDU** (no message for ``stale_after_s``, counted from the first update): the
capacity is the last fresh one (the rating if the CDU never reported) times
``stale_fraction``; ``telemetry_stale`` raises at once (warning) and escalates with time like
any alarm (to degraded by default, which forces ``degraded_level``). Every other alarm holds
its state while stale: without evidence, nothing raises, clears or escalates.

**Alarms**, what each measures and the condition of each severity:

=====================  ==============================  ========================================
alarm                  value                           warning / degraded / critical
=====================  ==============================  ========================================
supply_temp_high       supply C                        >= supply_warning_c / - / >= critical_c
delta_t_high           return - supply C               >= max_delta_t_c / + margin / -
flow_low               flow / design flow              < warning / < degraded / < critical frac.
pump_failure           pumps running or standby        any failed or off / only N left / < N
leak                   detectors not ok                any warning / - / any critical
sensor_disagreement    heat balance error %            |error| > tolerance / - / -
telemetry_stale        seconds since last message      > stale_after_s / - / -
cdu_fault              CDU status (its own health)     status warning / status critical / -
=====================  ==============================  ========================================

A condition must hold ``raise_after_s`` (``critical_raise_after_s`` when critical,
``heat_balance_raise_after_s`` for the heat balance, 0 for staleness) to raise or escalate.
A persisting alarm escalates one severity per ``escalate_after_s`` up to
``escalation_ceiling``. An alarm steps down (to the severity its condition still holds, never
below one reached by persistence) or clears once that has held ``clear_after_s``, with
thresholds relaxed by the hysteresis while the alarm is active. Every change is an
``AlarmEvent``: raised, escalated, deescalated or cleared.

**Use.** ``CoolingSupervisor`` runs every loop: ``observe()`` each CDU message as it comes,
``step()`` once per control interval with every rack's power; its ``CoolingStep`` has the
events to publish, each loop's assessment, and per rack the thermal budget and forced level.

**Forced levels.** The loop's worst severity maps to a level (``ForcedLevels``: warning 0,
degraded 2 = T2, critical = the policy's top level, the brake). It rises at once and falls
one level per ``clear_after_s`` while the target stays lower. Every rack of the loop gets
it (``forced_levels``); racks of healthy loops get 0. ``emergency`` means critical.

**InfluxDB** (proposed for ``points.SCHEMA``; ``influx_fields()`` builds them):

- ``cooling_loop``, tags ``site, loop, cdu``, float fields ``heat_load_kw``,
  ``heat_removed_kw``, ``heat_balance_error_pct``, ``rated_capacity_kw``, ``capacity_kw``,
  ``headroom_kw``, ``load_pct``, ``derate_fraction``, ``supply_temp_c``, ``return_temp_c``,
  ``delta_t_c``, ``flow_lpm``, ``flow_fraction``, ``pumps_available``, ``pumps_failed``,
  ``leaks``, ``thermal_budget_w``, ``forced_level``, ``severity`` (0 none, 1 warning,
  2 degraded, 3 critical), ``alarms`` (active count), ``emergency`` and ``stale`` (0/1),
  ``telemetry_age_s``;
- ``cooling_alarm``, tags ``site, loop, alarm, severity, action``, fields ``value``,
  ``threshold``, ``rank`` (floats), ``previous_severity``, ``text`` (one line, for
  annotations) and ``detail`` (strings).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from polca.aggregator.cooling_config import (
    SEVERITIES,
    AlarmTiming,
    CoolingSettings,
    ForcedLevels,
    LoopSpec,
    Severity,
)
from polca.telemetry.schema import CduTelemetry

AlarmKind = Literal[
    "supply_temp_high",
    "delta_t_high",
    "flow_low",
    "pump_failure",
    "leak",
    "sensor_disagreement",
    "telemetry_stale",
    "cdu_fault",
]
ALARM_KINDS: Final[tuple[AlarmKind, ...]] = (
    "supply_temp_high",
    "delta_t_high",
    "flow_low",
    "pump_failure",
    "leak",
    "sensor_disagreement",
    "telemetry_stale",
    "cdu_fault",
)
AlarmAction = Literal["raised", "escalated", "deescalated", "cleared"]

_RANK: Final[dict[Severity, int]] = {"warning": 1, "degraded": 2, "critical": 3}
_SEVERITY: Final[tuple[Severity | None, ...]] = (None, *SEVERITIES)
_SECONDS_PER_MINUTE: Final = 60.0
_W_PER_KW: Final = 1000.0
# After a (re)start the heat balance settles this many filter windows before it is judged,
# so that neither the first sample nor a transient (heat stored while flow was lost and
# flushed when it returns) weighs more than e**-2 = 14% in the filtered values.
_BALANCE_SETTLE_WINDOWS: Final = 2.0

Thresholds = tuple[float | None, float | None, float | None]


def severity_rank(severity: Severity | None) -> int:
    """0 for none, 1 warning, 2 degraded, 3 critical."""
    return 0 if severity is None else _RANK[severity]


@dataclass(frozen=True, slots=True)
class AlarmEvent:
    """One change of one alarm of one loop, for MQTT (QoS 1) and the ``cooling_alarm`` series.

    ``severity`` is the severity after the change (for ``cleared``: the one it had);
    ``threshold`` the limit crossed (for ``cleared``: the hysteresis point passed back).
    """

    loop: str
    alarm: AlarmKind
    severity: Severity
    action: AlarmAction
    value: float | None
    threshold: float | None
    detail: str
    previous: Severity | None
    at_s: float

    @property
    def text(self) -> str:
        """One line for annotations and logs."""
        return f"{self.loop}: {self.alarm} {self.action} ({self.severity}): {self.detail}"

    def influx_fields(self) -> dict[str, float | str | None]:
        """The ``cooling_alarm`` fields (tags: site, loop, alarm, severity, action)."""
        return {
            "value": self.value,
            "threshold": self.threshold,
            "rank": float(severity_rank(self.severity)),
            "previous_severity": self.previous,
            "text": self.text,
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class ActiveAlarm:
    """An alarm in force at the time of an assessment."""

    alarm: AlarmKind
    severity: Severity
    since_s: float
    value: float | None
    threshold: float | None


@dataclass(frozen=True, slots=True)
class Derate:
    """The factors (0..1) applied to the rated capacity, and their product."""

    flow: float = 1.0
    pumps: float = 1.0
    supply_temp: float = 1.0
    stale: float = 1.0
    total: float = 1.0


def flow_factor(flow_fraction: float | None) -> float:
    """Capacity factor of the measured flow (fraction of design): clamped to 0..1."""
    if flow_fraction is None or not math.isfinite(flow_fraction):
        return 1.0
    return min(1.0, max(0.0, flow_fraction))


def pump_factor(spec: LoopSpec, pumps_available: int | None) -> float:
    """Capacity factor of pump redundancy (1 with a spare, less without, less below N)."""
    if pumps_available is None or pumps_available >= min(spec.pumps_required + 1, spec.pump_count):
        return 1.0
    lost = spec.derating.redundancy_lost_fraction if spec.redundant else 1.0
    if pumps_available >= spec.pumps_required:
        return lost
    return lost * max(0, pumps_available) / spec.pumps_required


def supply_temp_factor(spec: LoopSpec, supply_temp_c: float | None) -> float:
    """Capacity factor of the supply temperature: 1 up to the derate start, then linear."""
    if supply_temp_c is None or not math.isfinite(supply_temp_c):
        return 1.0
    start_c = spec.derate_start_c
    if supply_temp_c <= start_c:
        return 1.0
    floor = spec.derating.supply_floor_fraction
    if supply_temp_c >= spec.supply_critical_c:
        return floor
    span = (supply_temp_c - start_c) / (spec.supply_critical_c - start_c)
    return 1.0 - (1.0 - floor) * span


def derate(
    spec: LoopSpec,
    *,
    flow_fraction: float | None,
    pumps_available: int | None,
    supply_temp_c: float | None,
) -> Derate:
    """The capacity derating of fresh readings (see the module docstring); never below floor."""
    flow = flow_factor(flow_fraction)
    pumps = pump_factor(spec, pumps_available)
    temp = supply_temp_factor(spec, supply_temp_c)
    total = max(spec.derating.floor_fraction, min(flow, pumps) * temp)
    return Derate(flow=flow, pumps=pumps, supply_temp=temp, total=total)


def stale_derate(spec: LoopSpec, last_fresh: Derate | None) -> Derate:
    """The derating while the CDU is silent: the last fresh one times ``stale_fraction``."""
    base = last_fresh or Derate()
    stale = spec.derating.stale_fraction
    total = max(spec.derating.floor_fraction, base.total * stale)
    return Derate(
        flow=base.flow, pumps=base.pumps, supply_temp=base.supply_temp, stale=stale, total=total
    )


def thermal_budget_w(spec: LoopSpec, capacity_kw: float) -> float:
    """The rack electrical power a loop of ``capacity_kw`` can cool (capacity / capture)."""
    return capacity_kw * _W_PER_KW / spec.capture_fraction


def split_budget(spec: LoopSpec, budget_w: float) -> dict[str, float]:
    """A loop's thermal budget shared between its racks by ``rack_weights`` (default 1)."""
    weights = {rack: spec.rack_weights.get(rack, 1.0) for rack in spec.racks}
    total = sum(weights.values())
    return {rack: budget_w * weight / total for rack, weight in weights.items()}


def effective_rack_budgets(
    electrical: Mapping[str, float | None], thermal: Mapping[str, float]
) -> dict[str, float]:
    """Each rack's effective budget: the lower of its electrical and thermal budgets.

    A rack with only one of them gets that one; a rack with neither (no electrical budget,
    on no loop) is left out: it has no rack-scope budget at all.
    """
    out: dict[str, float] = {}
    for rack in dict.fromkeys([*electrical, *thermal]):
        budgets = [b for b in (electrical.get(rack), thermal.get(rack)) if b is not None]
        if budgets:
            out[rack] = min(budgets)
    return out


def effective_row_budget_w(
    row_budget_w: float, racks: Iterable[str], thermal: Mapping[str, float]
) -> float:
    """A row's budget lowered to the sum of its racks' thermal budgets when all have one.

    A row with any rack on no loop (air-cooled) keeps its electrical budget: its racks'
    thermal limits are then enforced by the rack-scope controllers alone.
    """
    names = list(racks)
    if not names or any(rack not in thermal for rack in names):
        return row_budget_w
    return min(row_budget_w, sum(thermal[rack] for rack in names))


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

    def influx_fields(self) -> dict[str, float | None]:
        """The ``cooling_loop`` fields (tags: site, loop, cdu); None values are left out."""

        def opt(value: float | None) -> float | None:
            return None if value is None else float(value)

        return {
            "heat_load_kw": self.heat_load_kw,
            "heat_removed_kw": opt(self.heat_removed_kw),
            "heat_balance_error_pct": opt(self.heat_balance_error_pct),
            "rated_capacity_kw": self.rated_capacity_kw,
            "capacity_kw": self.capacity_kw,
            "headroom_kw": self.headroom_kw,
            "load_pct": self.load_pct,
            "derate_fraction": self.derate.total,
            "supply_temp_c": opt(self.supply_temp_c),
            "return_temp_c": opt(self.return_temp_c),
            "delta_t_c": opt(self.delta_t_c),
            "flow_lpm": opt(self.flow_lpm),
            "flow_fraction": opt(self.flow_fraction),
            "pumps_available": opt(self.pumps_available),
            "pumps_failed": float(len(self.pumps_failed)),
            "leaks": float(len(self.leaks)),
            "thermal_budget_w": self.thermal_budget_w,
            "forced_level": float(self.forced_level),
            "severity": float(severity_rank(self.worst_severity)),
            "alarms": float(len(self.alarms)),
            "emergency": 1.0 if self.emergency else 0.0,
            "stale": 1.0 if self.stale else 0.0,
            "telemetry_age_s": opt(self.telemetry_age_s),
        }


# Not frozen: built for every CDU message, and a frozen dataclass's __init__ costs several
# times more; nothing mutates it after ``of``.
@dataclass(slots=True)
class _Reading:
    """The parts of a CDU message the supervisor uses."""

    supply_c: float | None
    return_c: float | None
    flow_lpm: float | None
    heat_removed_kw: float | None
    pumps_available: int | None  # None: the CDU reports no pumps
    pumps_down: tuple[str, ...]  # failed or off
    pumps_failed: tuple[str, ...]
    leaks: tuple[str, ...]  # detectors not ok, critical ones first
    leak_rank: int  # 0 all ok, 1 a warning, 3 a critical
    status_rank: int  # 0 ok, 1 warning, 2 critical

    @classmethod
    def of(cls, cdu: CduTelemetry) -> _Reading:
        sec = cdu.secondary
        available = 0
        down: list[str] = []
        failed: list[str] = []
        for pump in cdu.pumps:
            if pump.state in ("running", "standby"):
                available += 1
            else:
                down.append(pump.name)
                if pump.state == "failed":
                    failed.append(pump.name)
        warning: list[str] = []
        critical: list[str] = []
        for detector in cdu.leak_detectors:
            if detector.state == "critical":
                critical.append(detector.name)
            elif detector.state == "warning":
                warning.append(detector.name)
        return cls(
            sec.supply_temp_c,
            sec.return_temp_c,
            sec.flow_lpm,
            sec.heat_removed_kw,
            available if cdu.pumps else None,
            tuple(down),
            tuple(failed),
            (*critical, *warning),
            3 if critical else 1 if warning else 0,
            _STATUS_RANK[cdu.status],
        )


_STATUS_RANK: Final = {"ok": 0, "warning": 1, "critical": 2}


@dataclass(slots=True)
class _Obs:
    """One alarm's condition at one instant (absent: rank 0)."""

    rank: int
    value: float | None
    thresholds: Thresholds = (None, None, None)
    clear_at: float | None = None
    names: tuple[str, ...] = ()

    def threshold(self, rank: int) -> float | None:
        """The threshold of ``rank``, or of the nearest lower rank that has one."""
        for r in range(rank, 0, -1):
            limit = self.thresholds[r - 1]
            if limit is not None:
                return limit
        return None


_NOTHING: Final = _Obs(0, None)
"""The observation of an idle alarm whose condition is absent (shared, never mutated)."""
_NO_LIMITS: Final[tuple[Thresholds, float | None]] = ((None, None, None), None)


def _rising(value: float, thresholds: Thresholds, hysteresis: float, active: int) -> int:
    """Highest rank whose threshold ``value`` reaches; relaxed by hysteresis up to ``active``."""
    rank = 0
    for r, limit in enumerate(thresholds, 1):
        if limit is not None and value >= (limit - hysteresis if r <= active else limit):
            rank = r
    return rank


def _falling(value: float, thresholds: Thresholds, hysteresis: float, active: int) -> int:
    """Highest rank whose threshold ``value`` is below; relaxed by hysteresis up to ``active``."""
    rank = 0
    for r, limit in enumerate(thresholds, 1):
        if limit is not None and value < (limit + hysteresis if r <= active else limit):
            rank = r
    return rank


@dataclass(slots=True)
class _Alarm:
    """Debounce, escalation and clearing of one alarm (see the module docstring)."""

    kind: AlarmKind
    delays_s: tuple[float, float, float]  # to raise or escalate to warning/degraded/critical
    rank: int = 0
    raised_s: float = 0.0
    rank_since_s: float = 0.0
    time_rank: int = 0  # rank reached by persistence; held while the condition lasts
    above_since_s: list[float | None] = field(default_factory=lambda: [None, None, None, None])
    below_since_s: float | None = None
    last: _Obs | None = None

    def step(
        self, obs: _Obs | None, *, now_s: float, timing: AlarmTiming
    ) -> tuple[AlarmAction, int] | None:
        """Advance by one observation (None: no evidence); return (action, new rank) or None."""
        if obs is None:  # no evidence: hold the state, restart every debounce
            self.above_since_s = [None, None, None, None]
            self.below_since_s = None
            return None
        self.last = obs
        above = self.above_since_s
        if obs.rank == 0 and self.rank == 0 and above[1] is None:
            return None  # the common case: nothing wrong, nothing pending
        for r in (1, 2, 3):
            if obs.rank >= r:
                if above[r] is None:
                    above[r] = now_s
            else:
                above[r] = None
        target = 0
        for r in (3, 2, 1):
            since = above[r]
            if since is not None and now_s - since >= self.delays_s[r - 1]:
                target = r
                break
        if target > self.rank:
            if self.rank == 0:
                self.raised_s = now_s
                return self._move(target, "raised", now_s)
            return self._move(target, "escalated", now_s)
        if self.rank == 0:
            return None
        if (
            obs.rank > 0
            and self.rank < _RANK[timing.escalation_ceiling]
            and now_s - self.rank_since_s >= timing.escalate_after_s
        ):
            self.time_rank = self.rank + 1
            return self._move(self.rank + 1, "escalated", now_s)
        hold = max(obs.rank, self.time_rank) if obs.rank > 0 else 0
        if hold >= self.rank:
            self.below_since_s = None
            return None
        if self.below_since_s is None:
            self.below_since_s = now_s
        if now_s - self.below_since_s < timing.clear_after_s:
            return None
        if hold == 0:
            self.time_rank = 0
            return self._move(0, "cleared", now_s)
        return self._move(hold, "deescalated", now_s)

    def _move(self, rank: int, action: AlarmAction, now_s: float) -> tuple[AlarmAction, int]:
        self.rank = rank
        self.rank_since_s = now_s
        self.below_since_s = None
        return action, rank


@dataclass(slots=True)
class _Balance:
    """Filters of the heat balance (see the module docstring)."""

    last_s: float | None = None
    since_s: float = 0.0  # when the filters (re)started
    expected_kw: float = 0.0  # heat load, lagged like the loop
    expected_f_kw: float = 0.0
    measured_f_kw: float = 0.0

    def reset(self) -> None:
        self.last_s = None

    def update(self, spec: LoopSpec, load_kw: float, measured_kw: float, now_s: float) -> None:
        if self.last_s is None:
            self.since_s = now_s
            self.expected_kw = self.expected_f_kw = load_kw
            self.measured_f_kw = measured_kw
        else:
            dt_s = max(0.0, now_s - self.last_s)
            lag = (
                1.0
                if spec.heat_balance_lag_s <= 0
                else 1 - math.exp(-dt_s / spec.heat_balance_lag_s)
            )
            win = 1 - math.exp(-dt_s / spec.heat_balance_window_s)
            self.expected_kw += lag * (load_kw - self.expected_kw)
            self.expected_f_kw += win * (self.expected_kw - self.expected_f_kw)
            self.measured_f_kw += win * (measured_kw - self.measured_f_kw)
        self.last_s = now_s


class LoopSupervisor:
    """Supervision of one loop: call ``update`` once per control interval."""

    def __init__(
        self, spec: LoopSpec, *, stale_after_s: float = 5.0, forced: ForcedLevels | None = None
    ) -> None:
        self.spec = spec
        self.stale_after_s = stale_after_s
        self.forced = forced or ForcedLevels()
        timing = spec.timing
        normal = (timing.raise_after_s, timing.raise_after_s, timing.critical_raise_after_s)
        delays: dict[AlarmKind, tuple[float, float, float]] = {
            "sensor_disagreement": (timing.heat_balance_raise_after_s,) * 3,
            "telemetry_stale": (0.0, 0.0, 0.0),  # stale_after_s is its debounce
        }
        self._alarms = {kind: _Alarm(kind, delays.get(kind, normal)) for kind in ALARM_KINDS}
        hyst = spec.hysteresis
        # (thresholds of warning, degraded, critical; the point an alarm clears back past)
        self._limits: dict[AlarmKind, tuple[Thresholds, float | None]] = {
            "supply_temp_high": (
                (spec.supply_warning_c, None, spec.supply_critical_c),
                spec.supply_warning_c - hyst.temp_c,
            ),
            "delta_t_high": (
                (spec.max_delta_t_c, spec.max_delta_t_c + spec.delta_t_degraded_margin_c, None),
                spec.max_delta_t_c - hyst.delta_t_c,
            ),
            "flow_low": (
                (
                    spec.min_flow_warning_fraction,
                    spec.min_flow_degraded_fraction,
                    spec.min_flow_critical_fraction,
                ),
                spec.min_flow_warning_fraction + hyst.flow_fraction,
            ),
            "pump_failure": (
                (
                    float(spec.pump_count),
                    float(spec.pumps_required + 1) if spec.redundant else None,
                    float(spec.pumps_required),
                ),
                float(spec.pump_count),
            ),
            "sensor_disagreement": (
                (spec.heat_balance_tolerance_pct, None, None),
                spec.heat_balance_tolerance_pct - hyst.heat_balance_pct,
            ),
            "telemetry_stale": ((stale_after_s, None, None), stale_after_s),
        }
        weights = {rack: spec.rack_weights.get(rack, 1.0) for rack in spec.racks}
        self._shares = {rack: w / sum(weights.values()) for rack, w in weights.items()}
        self._reading: _Reading | None = None
        self._first_s: float | None = None
        self._seen_s: float | None = None
        self._last_fresh: Derate | None = None
        self._balance = _Balance()
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
            self._reading = _Reading.of(cdu)
            self._seen_s = now_s if received_s is None else received_s
        age_s = now_s - (self._seen_s if self._seen_s is not None else self._first_s)
        stale = age_s > self.stale_after_s
        reading = None if stale else self._reading

        load_kw, missing = self._load_kw(rack_power_w)
        flow_fraction = None
        delta_t_c = None
        measured_kw = None
        if reading is not None:
            if reading.flow_lpm is not None:
                flow_fraction = reading.flow_lpm / spec.design_flow_lpm
            if reading.supply_c is not None and reading.return_c is not None:
                delta_t_c = reading.return_c - reading.supply_c
            measured_kw = self._measured_kw(reading, delta_t_c)
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
        starved = self._alarms["flow_low"].rank > 0 or self._alarms["pump_failure"].rank >= 3
        if reading is not None and measured_kw is not None and not missing and not starved:
            self._balance.update(spec, load_kw, measured_kw, now_s)
        else:
            self._balance.reset()
        balance_pct = self._balance_error_pct(now_s)

        observations = self._observe(
            reading,
            stale=stale,
            age_s=age_s,
            flow_fraction=flow_fraction,
            delta_t_c=delta_t_c,
            balance_pct=balance_pct,
        )
        events = []
        worst_rank = 0
        for kind, alarm in self._alarms.items():
            before = alarm.rank
            obs = observations[kind]
            change = alarm.step(obs, now_s=now_s, timing=spec.timing)
            if change is not None and obs is not None:
                events.append(self._event(kind, obs, change, before, now_s))
            worst_rank = max(worst_rank, alarm.rank)
        active = self._active() if worst_rank else ()
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
            emergency=worst_rank == _RANK["critical"],
            thermal_budget_w=budget_w,
            rack_thermal_budget_w={rack: budget_w * f for rack, f in self._shares.items()},
            forced_level=forced_level,
            forced_levels=dict.fromkeys(spec.racks, forced_level),
            events=tuple(events),
        )

    def _load_kw(self, rack_power_w: Mapping[str, float]) -> tuple[float, tuple[str, ...]]:
        """The heat the racks put into the loop, and the racks whose power is unknown."""
        power_w = 0.0
        missing: tuple[str, ...] = ()
        for rack in self.spec.racks:  # a plain loop: this runs every second for every loop
            rack_w = rack_power_w.get(rack)
            if rack_w is None:
                missing = (*missing, rack)
            else:
                power_w += rack_w
        return power_w * self.spec.capture_fraction / _W_PER_KW, missing

    def _active(self) -> tuple[ActiveAlarm, ...]:
        return tuple(
            ActiveAlarm(
                alarm=a.kind,
                severity=SEVERITIES[a.rank - 1],
                since_s=a.raised_s,
                value=a.last.value if a.last is not None else None,
                threshold=a.last.threshold(a.rank) if a.last is not None else None,
            )
            for a in self._alarms.values()
            if a.rank > 0
        )

    def _measured_kw(self, reading: _Reading, delta_t_c: float | None) -> float | None:
        """Heat removed: flow x density x cp x dT, else the CDU's own figure, else None."""
        spec = self.spec
        if reading.flow_lpm is not None and delta_t_c is not None:
            kg_per_s = reading.flow_lpm / _SECONDS_PER_MINUTE * spec.coolant_density_kg_per_l
            return kg_per_s * spec.coolant_cp_kj_per_kg_k * delta_t_c
        return reading.heat_removed_kw

    def _balance_error_pct(self, now_s: float) -> float | None:
        """The filtered heat-balance error; None while not judged (see the module docstring)."""
        balance = self._balance
        spec = self.spec
        if (
            balance.last_s is None
            or now_s - balance.since_s < _BALANCE_SETTLE_WINDOWS * spec.heat_balance_window_s
            or balance.expected_f_kw < spec.min_load_kw
        ):
            return None
        return 100.0 * (balance.measured_f_kw - balance.expected_f_kw) / balance.expected_f_kw

    def _observe(
        self,
        reading: _Reading | None,
        *,
        stale: bool,
        age_s: float,
        flow_fraction: float | None,
        delta_t_c: float | None,
        balance_pct: float | None,
    ) -> dict[AlarmKind, _Obs | None]:
        """Each alarm's condition now; None where there is no evidence (stale, unreported)."""
        spec = self.spec
        hyst = spec.hysteresis
        alarms = self._alarms
        # kind -> (rank, value, names); kinds left out have no evidence.
        found: dict[AlarmKind, tuple[int, float, tuple[str, ...]]] = {
            "telemetry_stale": (int(stale), age_s, ())
        }
        if reading is not None:
            if reading.supply_c is not None:
                value = reading.supply_c
                high = self._limits["supply_temp_high"][0]
                r = _rising(value, high, hyst.temp_c, alarms["supply_temp_high"].rank)
                found["supply_temp_high"] = (r, value, ())
            if delta_t_c is not None:
                high = self._limits["delta_t_high"][0]
                r = _rising(delta_t_c, high, hyst.delta_t_c, alarms["delta_t_high"].rank)
                found["delta_t_high"] = (r, delta_t_c, ())
            if flow_fraction is not None:
                low = self._limits["flow_low"][0]
                r = _falling(flow_fraction, low, hyst.flow_fraction, alarms["flow_low"].rank)
                found["flow_low"] = (r, flow_fraction, ())
            if reading.pumps_available is not None:
                found["pump_failure"] = self._pump_found(reading)
            found["leak"] = (reading.leak_rank, float(len(reading.leaks)), reading.leaks)
            found["cdu_fault"] = (reading.status_rank, float(reading.status_rank), ())
            if balance_pct is not None:
                tol = spec.heat_balance_tolerance_pct
                relax = hyst.heat_balance_pct if alarms["sensor_disagreement"].rank else 0.0
                r = 1 if abs(balance_pct) > tol - relax else 0
                found["sensor_disagreement"] = (r, balance_pct, ())
        out: dict[AlarmKind, _Obs | None] = dict.fromkeys(ALARM_KINDS)
        for kind, (r, value, names) in found.items():
            alarm = alarms[kind]
            if r == 0 and alarm.rank == 0 and alarm.above_since_s[1] is None:
                out[kind] = _NOTHING  # the common case, without building an observation
            else:
                limits, clear = self._limits.get(kind, _NO_LIMITS)
                out[kind] = _Obs(r, value, limits, clear, names)
        return out

    def _pump_found(self, reading: _Reading) -> tuple[int, float, tuple[str, ...]]:
        """pump_failure: critical below N, degraded at N of N+1, warning on any pump down."""
        spec = self.spec
        available = reading.pumps_available or 0
        if available < spec.pumps_required:
            r = 3
        elif spec.redundant and available <= spec.pumps_required:
            r = 2
        elif reading.pumps_down or available < spec.pump_count:
            r = 1
        else:
            r = 0
        return r, float(available), reading.pumps_down

    def _event(
        self,
        kind: AlarmKind,
        obs: _Obs,
        change: tuple[AlarmAction, int],
        before: int,
        now_s: float,
    ) -> AlarmEvent:
        action, rank = change
        cleared = action == "cleared"
        threshold = obs.clear_at if cleared else obs.threshold(rank)
        detail = _describe(kind, obs, threshold, cleared=cleared)
        if action == "escalated" and obs.rank < rank:
            detail += f"; persisted {self.spec.timing.escalate_after_s:g} s"
        return AlarmEvent(
            loop=self.spec.name,
            alarm=kind,
            severity=SEVERITIES[(before if cleared else rank) - 1],
            action=action,
            value=obs.value,
            threshold=threshold,
            detail=detail,
            previous=_SEVERITY[before],
            at_s=now_s,
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


_WHAT: Final[dict[AlarmKind, tuple[str, str]]] = {
    "supply_temp_high": ("supply", "{:.1f} C"),
    "delta_t_high": ("supply-return difference", "{:.1f} C"),
    "flow_low": ("flow", "{:.0%} of design"),
    "pump_failure": ("pumps available", "{:.0f}"),
    "leak": ("leak detectors not ok", "{:.0f}"),
    "sensor_disagreement": ("heat balance error", "{:+.0f}%"),
    "telemetry_stale": ("no CDU telemetry for", "{:.1f} s"),
    "cdu_fault": ("CDU status rank", "{:.0f}"),
}


def _describe(kind: AlarmKind, obs: _Obs, threshold: float | None, *, cleared: bool) -> str:
    """One human line: what was measured against which limit, and what is involved."""
    what, fmt = _WHAT[kind]
    text = what if obs.value is None else f"{what} {fmt.format(obs.value)}"
    if threshold is not None:
        text += f" ({'back past' if cleared else 'limit'} {fmt.format(threshold)})"
    if obs.names:
        text += f": {', '.join(obs.names)}"
    return text


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
