"""Cooling alarms, one spec per kind, and the engine that evaluates them for one loop.

Why this module exists: an alarm kind is one decision (which evidence, against which of the
loop's limits, held how long, said how), so each kind is one ``AlarmSpec`` below, and
adding or changing a kind touches its spec only. ``AlarmEngine`` evaluates every spec of a
loop once per step, lets ``debounce.AlarmState`` decide what changed, and returns the
changes as ``AlarmEvent``s. Pure: no I/O, no clock (``now_s`` comes in, monotonic), and no
names of a sink or a topic: the aggregator builds its messages and points from the events.

Every spec's ``description`` is the row of the alarm table in ``docs/cooling.md`` (a test
keeps them equal). Every alarm escalates alike, by persistence (``AlarmTiming``), so
escalation is the debounce's and not part of a spec.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from polca.cooling.debounce import AlarmAction, AlarmState, Delays
from polca.cooling.evidence import Evidence
from polca.cooling.loops import SEVERITIES, AlarmTiming, LoopSpec, Severity

__all__ = [
    "ALARM_KINDS",
    "SPECS",
    "ActiveAlarm",
    "AlarmEngine",
    "AlarmEvent",
    "AlarmKind",
    "AlarmSpec",
    "Limits",
]

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
ALARM_KINDS: Final[tuple[AlarmKind, ...]] = get_args(AlarmKind)

Thresholds = tuple[float | None, float | None, float | None]
"""The limits of warning, degraded and critical (None: that severity has no limit)."""

Found = tuple[int, float, tuple[str, ...]]
"""A condition now: the rank it holds (0 none .. 3 critical), the value, the names involved."""

_SEVERITY: Final[tuple[Severity | None, ...]] = (None, *SEVERITIES)


@dataclass(frozen=True, slots=True)
class Limits:
    """One alarm's limits on one loop, taken from its ``LoopSpec`` once."""

    thresholds: Thresholds
    clear_at: float | None  # the point a clearing alarm went back past (its event says so)
    hysteresis: float = 0.0  # how far back past a limit an active severity holds


_NO_LIMITS: Final = Limits((None, None, None), None)

Condition = Callable[[Evidence, LoopSpec, Limits, int], Found | None]
"""(evidence, loop, its limits, the alarm's active rank) -> the condition now; None: no
evidence (nothing reported, or stale), which holds the alarm and restarts its debounce."""


@dataclass(frozen=True, slots=True)
class AlarmSpec:
    """One alarm kind: its condition, its limits on a loop, its delays and its words."""

    kind: AlarmKind
    description: str  # what it watches and when each severity holds (docs/cooling.md)
    measures: str  # the value as an event's detail names it
    value_format: str  # how the value and its limits are written in the detail
    condition: Condition
    limits: Callable[[LoopSpec, float], Limits] = lambda _loop, _stale_after_s: _NO_LIMITS
    delays: Callable[[AlarmTiming], Delays] = lambda timing: (
        timing.raise_after_s,
        timing.raise_after_s,
        timing.critical_raise_after_s,
    )


def _rising_rank(value: float, limits: Limits, active: int) -> int:
    """Highest rank whose threshold ``value`` reaches; relaxed by hysteresis up to ``active``."""
    rank = 0
    for r, limit in enumerate(limits.thresholds, 1):
        if limit is not None and value >= (limit - limits.hysteresis if r <= active else limit):
            rank = r
    return rank


def _falling_rank(value: float, limits: Limits, active: int) -> int:
    """Highest rank whose threshold ``value`` is below; relaxed by hysteresis up to ``active``."""
    rank = 0
    for r, limit in enumerate(limits.thresholds, 1):
        if limit is not None and value < (limit + limits.hysteresis if r <= active else limit):
            rank = r
    return rank


def rising(value_of: Callable[[Evidence], float | None]) -> Condition:
    """The condition of a value too high: each severity at or above its threshold."""

    def condition(ev: Evidence, _loop: LoopSpec, limits: Limits, active: int) -> Found | None:
        value = value_of(ev)
        return None if value is None else (_rising_rank(value, limits, active), value, ())

    return condition


def falling(value_of: Callable[[Evidence], float | None]) -> Condition:
    """The condition of a value too low: each severity below its threshold."""

    def condition(ev: Evidence, _loop: LoopSpec, limits: Limits, active: int) -> Found | None:
        value = value_of(ev)
        return None if value is None else (_falling_rank(value, limits, active), value, ())

    return condition


def _pumps(ev: Evidence, loop: LoopSpec, _limits: Limits, _active: int) -> Found | None:
    """Critical below N, degraded at N of N+1, warning on any pump down."""
    reading = ev.reading
    if reading is None or reading.pumps_available is None:
        return None
    available = reading.pumps_available
    if available < loop.pumps_required:
        rank = 3
    elif loop.redundant and available <= loop.pumps_required:
        rank = 2
    elif reading.pumps_down or available < loop.pump_count:
        rank = 1
    else:
        rank = 0
    return rank, float(available), reading.pumps_down


def _heat_balance(ev: Evidence, loop: LoopSpec, _limits: Limits, active: int) -> Found | None:
    """Beyond the tolerance either way; within tolerance less hysteresis while active."""
    pct = ev.balance_pct
    if ev.reading is None or pct is None:
        return None
    relax = loop.hysteresis.heat_balance_pct if active else 0.0
    return (1 if abs(pct) > loop.heat_balance_tolerance_pct - relax else 0), pct, ()


SUPPLY_TEMP_HIGH: Final = AlarmSpec(
    kind="supply_temp_high",
    description="supply temperature: warning at supply_warning_c, critical at "
    "supply_critical_c (at or above)",
    measures="supply",
    value_format="{:.1f} C",
    condition=rising(lambda ev: None if ev.reading is None else ev.reading.supply_c),
    limits=lambda loop, _: Limits(
        (loop.supply_warning_c, None, loop.supply_critical_c),
        clear_at=loop.supply_warning_c - loop.hysteresis.temp_c,
        hysteresis=loop.hysteresis.temp_c,
    ),
)
DELTA_T_HIGH: Final = AlarmSpec(
    kind="delta_t_high",
    description="return minus supply temperature: warning at max_delta_t_c, degraded at "
    "max_delta_t_c + delta_t_degraded_margin_c (at or above)",
    measures="supply-return difference",
    value_format="{:.1f} C",
    condition=rising(lambda ev: ev.delta_t_c),
    limits=lambda loop, _: Limits(
        (loop.max_delta_t_c, loop.max_delta_t_c + loop.delta_t_degraded_margin_c, None),
        clear_at=loop.max_delta_t_c - loop.hysteresis.delta_t_c,
        hysteresis=loop.hysteresis.delta_t_c,
    ),
)
FLOW_LOW: Final = AlarmSpec(
    kind="flow_low",
    description="flow over design_flow_lpm: warning, degraded, critical below "
    "min_flow_warning_fraction, min_flow_degraded_fraction, min_flow_critical_fraction",
    measures="flow",
    value_format="{:.0%} of design",
    condition=falling(lambda ev: ev.flow_fraction),
    limits=lambda loop, _: Limits(
        (
            loop.min_flow_warning_fraction,
            loop.min_flow_degraded_fraction,
            loop.min_flow_critical_fraction,
        ),
        clear_at=loop.min_flow_warning_fraction + loop.hysteresis.flow_fraction,
        hysteresis=loop.hysteresis.flow_fraction,
    ),
)
PUMP_FAILURE: Final = AlarmSpec(
    kind="pump_failure",
    description="pumps running or on standby: warning with any pump failed or off, "
    "degraded with only pumps_required left (N of N+1), critical below pumps_required",
    measures="pumps available",
    value_format="{:.0f}",
    condition=_pumps,
    limits=lambda loop, _: Limits(
        (
            float(loop.pump_count),
            float(loop.pumps_required + 1) if loop.redundant else None,
            float(loop.pumps_required),
        ),
        clear_at=float(loop.pump_count),
    ),
)
LEAK: Final = AlarmSpec(
    kind="leak",
    description="leak detectors not ok: warning for a detector's warning, critical for a "
    "critical one",
    measures="leak detectors not ok",
    value_format="{:.0f}",
    condition=lambda ev, _loop, _limits, _active: (
        None
        if ev.reading is None
        else (ev.reading.leak_rank, float(len(ev.reading.leaks)), ev.reading.leaks)
    ),
)
SENSOR_DISAGREEMENT: Final = AlarmSpec(
    kind="sensor_disagreement",
    description="heat-balance error, heat removed against the racks' captured heat "
    "(filtered, lagged): warning beyond heat_balance_tolerance_pct either way",
    measures="heat balance error",
    value_format="{:+.0f}%",
    condition=_heat_balance,
    limits=lambda loop, _: Limits(
        (loop.heat_balance_tolerance_pct, None, None),
        clear_at=loop.heat_balance_tolerance_pct - loop.hysteresis.heat_balance_pct,
        hysteresis=loop.hysteresis.heat_balance_pct,
    ),
    delays=lambda timing: (timing.heat_balance_raise_after_s,) * 3,
)
TELEMETRY_STALE: Final = AlarmSpec(
    kind="telemetry_stale",
    description="seconds since the CDU's last message: warning beyond stale_after_s, at once",
    measures="no CDU telemetry for",
    value_format="{:.1f} s",
    condition=lambda ev, _loop, _limits, _active: (int(ev.stale), ev.age_s, ()),
    limits=lambda _loop, stale_after_s: Limits((stale_after_s, None, None), stale_after_s),
    delays=lambda _timing: (0.0, 0.0, 0.0),  # stale_after_s is its debounce
)
CDU_FAULT: Final = AlarmSpec(
    kind="cdu_fault",
    description="the CDU's own status: warning while it says warning, degraded while it "
    "says critical",
    measures="CDU status rank",
    value_format="{:.0f}",
    condition=lambda ev, _loop, _limits, _active: (
        None if ev.reading is None else (ev.reading.status_rank, float(ev.reading.status_rank), ())
    ),
)

SPECS: Final[tuple[AlarmSpec, ...]] = (
    SUPPLY_TEMP_HIGH,
    DELTA_T_HIGH,
    FLOW_LOW,
    PUMP_FAILURE,
    LEAK,
    SENSOR_DISAGREEMENT,
    TELEMETRY_STALE,
    CDU_FAULT,
)
"""Every alarm kind's spec, in ``ALARM_KINDS`` order (the order of a step's events)."""


@dataclass(frozen=True, slots=True)
class AlarmEvent:
    """One change of one alarm of one loop (the aggregator publishes and records it).

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


@dataclass(frozen=True, slots=True)
class ActiveAlarm:
    """An alarm in force at the time of an assessment."""

    alarm: AlarmKind
    severity: Severity
    since_s: float
    value: float | None
    threshold: float | None


@dataclass(slots=True)
class Observation:
    """One alarm's condition at one instant, with the limits it was judged against."""

    rank: int
    value: float | None
    limits: Limits = _NO_LIMITS
    names: tuple[str, ...] = ()

    def threshold(self, rank: int) -> float | None:
        """The threshold of ``rank``, or of the nearest lower rank that has one."""
        for r in range(rank, 0, -1):
            limit = self.limits.thresholds[r - 1]
            if limit is not None:
                return limit
        return None


_NOTHING: Final = Observation(0, None)
"""The observation of an idle alarm whose condition is absent (shared, never mutated)."""


@dataclass(slots=True)
class _Tracked:
    """One alarm of one loop: its spec, its limits there, its state, its last observation."""

    spec: AlarmSpec
    limits: Limits
    state: AlarmState
    last: Observation | None = None


class AlarmEngine:
    """Every alarm of one loop: ``step`` once per control interval with the evidence."""

    def __init__(
        self, loop: LoopSpec, *, stale_after_s: float, specs: Iterable[AlarmSpec] = SPECS
    ) -> None:
        self.loop = loop
        self._tracked = {
            spec.kind: _Tracked(
                spec, spec.limits(loop, stale_after_s), AlarmState(spec.delays(loop.timing))
            )
            for spec in specs
        }
        self.worst_rank = 0  # after the last step: 0 none .. 3 critical

    def __deepcopy__(self, _memo: dict[int, Any]) -> AlarmEngine:
        """A copy owning the alarms' states and sharing what never changes (the loop's
        spec, the alarm specs and limits): the aggregator checkpoints its cooling every
        control step (``RowControl.checkpoint``), which must stay cheap."""
        clone = copy.copy(self)
        clone._tracked = {
            kind: _Tracked(t.spec, t.limits, t.state.copy(), t.last)
            for kind, t in self._tracked.items()
        }
        return clone

    def rank(self, kind: AlarmKind) -> int:
        """The severity rank an alarm is at (0: not raised)."""
        return self._tracked[kind].state.rank

    def step(self, evidence: Evidence, *, now_s: float) -> tuple[AlarmEvent, ...]:
        """Judge every alarm's condition on ``evidence``; return the changes, in spec order."""
        loop = self.loop
        timing = loop.timing
        events: list[AlarmEvent] = []
        worst = 0
        for tracked in self._tracked.values():
            state = tracked.state
            before = state.rank
            found = tracked.spec.condition(evidence, loop, tracked.limits, before)
            if found is None:
                state.step(None, now_s=now_s, timing=timing)
            else:
                rank, value, names = found
                if rank == 0 and state.idle:
                    obs = _NOTHING  # the common case, without building an observation
                else:
                    obs = Observation(rank, value, tracked.limits, names)
                tracked.last = obs
                change = state.step(rank, now_s=now_s, timing=timing)
                if change is not None:
                    events.append(self._event(tracked.spec, obs, change, before, now_s))
            worst = max(worst, state.rank)
        self.worst_rank = worst
        return tuple(events)

    def active(self) -> tuple[ActiveAlarm, ...]:
        """The alarms raised now, in spec order."""
        return tuple(
            ActiveAlarm(
                alarm=t.spec.kind,
                severity=SEVERITIES[t.state.rank - 1],
                since_s=t.state.raised_s,
                value=t.last.value if t.last is not None else None,
                threshold=t.last.threshold(t.state.rank) if t.last is not None else None,
            )
            for t in self._tracked.values()
            if t.state.rank > 0
        )

    def _event(
        self,
        spec: AlarmSpec,
        obs: Observation,
        change: tuple[AlarmAction, int],
        before: int,
        now_s: float,
    ) -> AlarmEvent:
        action, rank = change
        cleared = action == "cleared"
        threshold = obs.limits.clear_at if cleared else obs.threshold(rank)
        detail = _describe(spec, obs, threshold, cleared=cleared)
        if action == "escalated" and obs.rank < rank:
            detail += f"; persisted {self.loop.timing.escalate_after_s:g} s"
        return AlarmEvent(
            loop=self.loop.name,
            alarm=spec.kind,
            severity=SEVERITIES[(before if cleared else rank) - 1],
            action=action,
            value=obs.value,
            threshold=threshold,
            detail=detail,
            previous=_SEVERITY[before],
            at_s=now_s,
        )


def _describe(spec: AlarmSpec, obs: Observation, threshold: float | None, *, cleared: bool) -> str:
    """One human line: what was measured against which limit, and what is involved."""
    fmt = spec.value_format
    text = spec.measures if obs.value is None else f"{spec.measures} {fmt.format(obs.value)}"
    if threshold is not None:
        text += f" ({'back past' if cleared else 'limit'} {fmt.format(threshold)})"
    if obs.names:
        text += f": {', '.join(obs.names)}"
    return text
