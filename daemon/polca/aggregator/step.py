"""The aggregator's control step, without I/O: rollups and cooling in, levels out.

``RowControl`` holds what the aggregator decides with (a ``RowTracker`` per owned row,
a ``ScopeController`` per row and per rack with a budget or a cooling loop, the cooling
supervisor) and, once per control interval, ``step`` turns it into a ``StepResult``:
each row's rollup and trend, its effective budgets (electrical, lowered by the cooling
loops' thermal budgets), the decision of every scope (row first, then its racks, each
with the control message that renews the agents' lease) and the cooling assessment.
``core.py`` (``AggregatorCore.step``) builds the result's messages (``messages.py``) and
points (``points.py``), which the shell (``runtime.py``) publishes and writes; nothing here
touches MQTT, a database or a clock (time comes in).

A step is a transaction: ``checkpoint`` before it and ``restore`` after a failure put back
every controller's ladder and sequence and the cooling supervisor's alarms, so a step that
raised half-way (whatever the input) decides nothing, and the next one starts from the last
good state; ``AggregatorCore.step`` runs it so, and hands the shell a step's messages only
once all of them were built.

During ``control.warmup_s`` after ``start`` nothing is decided until every node has
reported, so a restarted aggregator never uncaps a row for lack of data; ``seed`` takes
the retained control of a previous run (clamped into the policy's levels) before that.
Likewise while the aggregator's own connections to the broker are down, and for
``control.warmup_s`` after they are back (``intake_cut``), no level goes below what it was
when they went down: the nodes' telemetry and the meter stopped arriving because of the
aggregator's connection, not because the row's power fell, and a control decided on
their absence would be published when the connection is back.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from polca.aggregator.budgets import BudgetInForce, RowDemandView, SiteBudgets, row_demand
from polca.aggregator.config import AggregatorSettings, RowSpec
from polca.aggregator.controller import ScopeController, ScopeDecision
from polca.aggregator.rollup import NodeHealth, RowRollup, RowTracker
from polca.aggregator.witness import MeterWitness
from polca.cooling.budgets import effective_rack_budgets, effective_row_budget_w
from polca.cooling.supervisor import CoolingStep, CoolingSupervisor
from polca.policy import LoadedPolicy, Policy
from polca.telemetry.checks import ClockWindow, DropLog
from polca.telemetry.schema import CduTelemetry, Control, Telemetry

_AUDIT_NODES = 32
"""Node names a level change's audit record lists per kind (with the counts of all)."""

Scope = tuple[str, str | None]
"""(row, rack), rack None for the row scope."""


@dataclass(frozen=True, slots=True)
class Budgets:
    """A row's budgets at one control step."""

    row_w: float  # effective: the provisioned budget, lowered by the loops' thermal ones
    racks: Mapping[str, float]  # effective: min(electrical, thermal)
    thermal: Mapping[str, float]  # from the cooling loops
    rack_levels: Mapping[str, int]  # rack-scope levels decided this step


@dataclass(frozen=True, slots=True)
class NodeResult:
    """One node at one step, as the row's points show it."""

    node: str
    rack: str
    health: NodeHealth
    power_w: float  # as counted in its health state
    telemetry: Telemetry | None  # the last received, fresh or not
    implausible: bool = False  # implausible telemetry within control.stale_after_s
    implausible_readings: int = 0  # implausible telemetry since start
    rate_limited: int = 0  # messages refused by admission since start
    quarantined: bool = False  # moved to a connection of its own for flooding
    quarantine_releases: int = 0  # times it was moved back, its flood over


@dataclass(frozen=True, slots=True)
class RowResult:
    """One row at one step."""

    spec: RowSpec
    rollup: RowRollup
    trend_w_per_s: float | None
    decision: ScopeDecision
    rack_decisions: Mapping[str, ScopeDecision]
    budgets: Budgets
    nodes: tuple[NodeResult, ...]
    electrical: BudgetInForce
    """The electrical budget in force and where it came from (``budgets.py``)."""
    demand: RowDemandView
    """The row's floor and power per class, for the site controller."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """Everything one control step decided."""

    now_ns: int
    cooling: CoolingStep
    rows: tuple[RowResult, ...]

    def decisions(self) -> Iterator[tuple[Scope, ScopeDecision]]:
        """Every scope's decision, in publishing order: each row, then its racks."""
        for row in self.rows:
            yield (row.spec.name, None), row.decision
            for rack, decision in row.rack_decisions.items():
                yield (row.spec.name, rack), decision


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The decision state before a step (``RowControl.checkpoint``)."""

    controllers: Mapping[Scope, ScopeController]
    cooling: CoolingSupervisor
    warm: bool
    last: StepResult | None


class RowControl:
    """The rows one aggregator owns, their controllers and cooling loops."""

    def __init__(self, settings: AggregatorSettings, *, epoch_ns: int, log: Any = None) -> None:
        """Trackers and controllers for every owned row; nothing decided before ``start``."""
        self.settings = settings
        self.lease_s = settings.lease_s  # resolved once (its default depends on mqtt)
        self.log: Any = log if log is not None else structlog.get_logger()
        witness = settings.control.witness()
        self.trackers = {
            row.name: RowTracker(row, settings.intake, witness=MeterWitness(witness))
            for row in settings.rows
        }
        self.budgets = SiteBudgets(
            {row.name: row for row in settings.rows},
            settings.site_budget,
            ClockWindow.of_seconds(settings.control.clock_skew_tolerance_s),
        )
        """The rows' leased budgets and feeds (taken by the intake)."""
        self.cooling = CoolingSupervisor(settings.cooling)
        self._shared: dict[int, Any] = {
            id(o): o for o in (settings.cooling, *settings.cooling.loops)
        }
        self.controllers: dict[Scope, ScopeController] = {}
        for row in settings.rows:
            self.controllers[(row.name, None)] = self._controller(row.name, None, epoch_ns)
            for rack in row.racks:
                on_loop = settings.cooling.loop_of(rack.name) is not None
                if rack.budget_w is not None or on_loop:
                    key = (row.name, rack.name)
                    self.controllers[key] = self._controller(row.name, rack.name, epoch_ns)
        self._now_s = 0.0  # the time of the step running: the meter log's pace
        self.meter_log = DropLog("meter_reading_unused", logger=self.log, clock=lambda: self._now_s)
        self.started_s: float | None = None
        self.warm = False
        self.last: StepResult | None = None
        self._held: dict[Scope, int] | None = None  # levels when the intake was cut
        self._held_until_s = math.inf  # the end of the hold, once the intake is back

    def _controller(self, row: str, rack: str | None, epoch_ns: int) -> ScopeController:
        return ScopeController(
            site=self.settings.site,
            row=row,
            rack=rack,
            issuer=self.settings.instance,
            epoch_ns=epoch_ns,
        )

    def checkpoint(self) -> Checkpoint:
        """What a step changes, to put back if it fails (``restore``)."""
        return Checkpoint(
            controllers={key: copy.copy(c) for key, c in self.controllers.items()},
            # The configuration is immutable: shared with the copy, not copied each step (a
            # fresh memo each time: deepcopy fills it with this step's copies).
            cooling=copy.deepcopy(self.cooling, memo=dict(self._shared)),
            warm=self.warm,
            last=self.last,
        )

    def restore(self, checkpoint: Checkpoint) -> None:
        """Undo a failed step: ladders, sequences and cooling as they were before it."""
        self.controllers = dict(checkpoint.controllers)
        self.cooling = checkpoint.cooling
        self.warm = checkpoint.warm
        self.last = checkpoint.last

    def start(self, now_s: float) -> None:
        """The aggregator started at ``now_s`` (the warm-up counts from here)."""
        self.started_s = now_s

    def intake_cut(self, *, cut: bool, now_s: float) -> None:
        """Whether the aggregator's broker connections are down at ``now_s`` (called before
        each step): while they are, and ``control.warmup_s`` after, no level falls below
        what it was when they went down."""
        if cut:
            if self._held is None or self._held_until_s != math.inf:
                # A new cut (or one again before the last hold ended): hold the levels as
                # they are now, never those of an earlier cut (a start-up's, before warm).
                self._held = {k: c.ladder.level for k, c in self.controllers.items()}
                self._held_until_s = math.inf
                self.log.warning("intake_cut_levels_held", levels=self._held_levels())
            return
        if self._held is None:
            return
        if self._held_until_s == math.inf:
            self._held_until_s = now_s + self.settings.control.warmup_s
        elif now_s >= self._held_until_s:
            self.log.info("intake_back_levels_free", levels=self._held_levels())
            self._held = None
            self._held_until_s = math.inf

    def _held_levels(self) -> dict[str, int]:
        return {f"{k[0]}/{k[1] or '-'}": v for k, v in (self._held or {}).items()}

    def seed(self, control: Control, *, policy: Policy) -> None:
        """Start a scope from the level a previous run left retained (before warm only)."""
        if self.warm:
            return
        controller = self.controllers.get((control.row, control.rack))
        if controller is None:
            return
        controller.seed(control, policy=policy)
        self.log.info(
            "control_seeded",
            row=control.row,
            rack=control.rack,
            seeded_level=controller.seeded_from,
            retained_level=control.level,
            seq=control.seq,
        )

    def follow(self, leader: Control, *, policy: Policy) -> None:
        """Track the shard leader's level for one scope (this instance a standby)."""
        controller = self.controllers.get((leader.row, leader.rack))
        if controller is not None:
            controller.follow(leader, policy=policy)

    def set_term(self, term: int) -> None:
        """The leadership term every control message carries from now on."""
        for controller in self.controllers.values():
            controller.term = term

    def observe_cdu(self, cdu: CduTelemetry, now_s: float) -> bool:
        """Keep a CDU reading for the next step; whether it is urgent (step now)."""
        if not self.cooling.observe(cdu, now_s):
            return False
        return (
            cdu.status != "ok"
            or any(d.state != "ok" for d in cdu.leak_detectors)
            or any(p.state == "failed" for p in cdu.pumps)
        )

    def step(self, now_s: float, now_ns: int, loaded: LoadedPolicy) -> StepResult | None:
        """Evaluate every owned row and rack scope once; None while warming up."""
        self._now_s = now_s
        ctl = self.settings.control
        rollups = {
            name: tracker.rollup(now_s, stale_after_s=ctl.stale_after_s)
            for name, tracker in self.trackers.items()
        }
        for rollup in rollups.values():
            if rollup.meter_partial is not None:
                self.meter_log.drop(
                    "partial",
                    topic=rollup.row,
                    detail=f"sources failed ({rollup.meter_partial}); computed "
                    f"{rollup.computed_power_w:.0f} W is used",
                )
            for change in rollup.meter_changes:
                log = self.log.warning if change.event == "meter_distrusted" else self.log.info
                log(
                    change.event,
                    row=rollup.row,
                    computed_power_w=round(rollup.computed_power_w, 1),
                    **change.fields,
                )
        if not self._warmed_up(now_s, rollups):
            return None
        rack_power_w = {r.rack: r.power_w for roll in rollups.values() for r in roll.racks}
        cooling = self.cooling.step(
            rack_power_w=rack_power_w, now_s=now_s, top_level=loaded.policy.top_level
        )
        for event in cooling.events:
            log = self.log.warning if event.action in ("raised", "escalated") else self.log.info
            log(
                "cooling_alarm",
                loop=event.loop,
                alarm=event.alarm,
                severity=event.severity,
                action=event.action,
                value=event.value,
                threshold=event.threshold,
                detail=event.detail,
            )
        rows = tuple(
            self._row(row, rollups[row.name], cooling, now_s=now_s, now_ns=now_ns, loaded=loaded)
            for row in self.settings.rows
        )
        self.last = StepResult(now_ns=now_ns, cooling=cooling, rows=rows)
        return self.last

    def _warmed_up(self, now_s: float, rollups: Mapping[str, RowRollup]) -> bool:
        if self.warm:
            return True
        elapsed = now_s - (self.started_s if self.started_s is not None else now_s)
        if elapsed < self.settings.control.warmup_s and not all(
            r.all_reported for r in rollups.values()
        ):
            return False
        self.warm = True
        # Power ramped up while nodes were still reporting in: not a trend.
        for tracker in self.trackers.values():
            tracker.history.clear()
        self.log.info(
            "aggregator_warm",
            after_s=round(elapsed, 2),
            levels={f"{k[0]}/{k[1] or '-'}": c.ladder.level for k, c in self.controllers.items()},
        )
        return True

    def _row(
        self,
        row: RowSpec,
        rollup: RowRollup,
        cooling: CoolingStep,
        *,
        now_s: float,
        now_ns: int,
        loaded: LoadedPolicy,
    ) -> RowResult:
        ctl = self.settings.control
        tracker = self.trackers[row.name]
        trend = tracker.trend_w_per_s(now_s, ctl.trend_window_s)
        thermal = cooling.rack_thermal_budget_w
        electrical = self.budgets.in_force(row.name, round(now_s * 1e9))
        row_budget_w = effective_row_budget_w(
            electrical.budget_w, [r.name for r in row.racks], thermal
        )
        decision = self._decide(
            (row.name, None),
            power_w=rollup.power_w,
            budget_w=row_budget_w,
            now_s=now_s,
            now_ns=now_ns,
            trend=trend,
            loaded=loaded,
            inputs={
                "power_source": rollup.power_source,
                # The first few names, and how many: an audit record stays small.
                "stale_nodes": list(rollup.stale_nodes[:_AUDIT_NODES]),
                "offline_nodes": list(rollup.offline_nodes[:_AUDIT_NODES]),
                "implausible_nodes": list(rollup.implausible_nodes[:_AUDIT_NODES]),
                "nodes_stale": len(rollup.stale_nodes),
                "nodes_offline": len(rollup.offline_nodes),
                "provisioned_budget_w": row.budget_w,
                "budget_origin": electrical.origin,
                "budget_limited_by": electrical.limited_by,
            },
        )
        rack_budgets = effective_rack_budgets(
            {r.rack: r.budget_w for r in rollup.racks},
            {r.rack: thermal[r.rack] for r in rollup.racks if r.rack in thermal},
        )
        rack_decisions: dict[str, ScopeDecision] = {}
        for rack in rollup.racks:
            budget = rack_budgets.get(rack.rack)
            if budget is None or (row.name, rack.rack) not in self.controllers:
                continue
            rack_decisions[rack.rack] = self._decide(
                (row.name, rack.rack),
                power_w=rack.power_w,
                budget_w=budget,
                now_s=now_s,
                now_ns=now_ns,
                trend=None,
                loaded=loaded,
                floor_level=cooling.forced_levels.get(rack.rack, 0),
                floor_reason=self._cooling_reason(cooling, rack.rack),
            )
        budgets = Budgets(
            row_budget_w,
            rack_budgets,
            thermal,
            {rack: d.level for rack, d in rack_decisions.items()},
        )
        # Between steps, the first reading that takes the row over the next threshold
        # wakes the next step (event-driven escalation; see RowTracker.arm).
        ladder_level = self.controllers[(row.name, None)].ladder.level
        thresholds_w = decision.thresholds_w
        tracker.arm(thresholds_w[ladder_level] if ladder_level < len(thresholds_w) else math.inf)
        nodes = []
        healths = [(view, view.health(now_s, ctl.stale_after_s)) for view in tracker.nodes.values()]
        demand = row_demand(row, healths, loaded.policy)
        for view, health in healths:
            nodes.append(
                NodeResult(
                    view.spec.name,
                    view.rack,
                    health,
                    view.power_w(health),
                    view.telemetry,
                    implausible=view.implausible(now_s, ctl.stale_after_s),
                    implausible_readings=view.implausible_readings,
                    rate_limited=view.rate_limited,
                    quarantined=view.quarantined,
                    quarantine_releases=view.releases,
                )
            )
        return RowResult(
            row,
            rollup,
            trend,
            decision,
            rack_decisions,
            budgets,
            tuple(nodes),
            electrical,
            demand,
        )

    def _cooling_reason(self, step: CoolingStep, rack: str) -> str:
        loop_name = self.settings.cooling.loop_of(rack)
        loop = step.loops.get(loop_name) if loop_name else None
        if loop is None:
            return ""
        alarms = ", ".join(f"{a.alarm} {a.severity}" for a in loop.alarms)
        return f"cooling loop {loop_name}: {alarms or 'recovering'}"

    def _decide(
        self,
        key: Scope,
        *,
        power_w: float,
        budget_w: float,
        now_s: float,
        now_ns: int,
        trend: float | None,
        loaded: LoadedPolicy,
        inputs: dict[str, Any] | None = None,
        floor_level: int = 0,
        floor_reason: str = "",
    ) -> ScopeDecision:
        ctl = self.settings.control
        held = self._held.get(key, 0) if self._held is not None else 0
        if held > floor_level:
            floor_level, floor_reason = held, "broker connection lost: level held"
        return self.controllers[key].step(
            floor_level=floor_level,
            floor_reason=floor_reason,
            power_w=power_w,
            budget_w=budget_w,
            policy=loaded.policy,
            revision=loaded.revision,
            now_s=now_s,
            now_ns=now_ns,
            lease_s=self.lease_s,
            observe=ctl.observe,
            trend_w_per_s=trend,
            inputs=inputs,
        )

    def row_levels(self) -> dict[str, str]:
        """Each row's level name in the last step (for the status line)."""
        if self.last is None:
            return {}
        return {row.spec.name: row.decision.level_name for row in self.last.rows}
