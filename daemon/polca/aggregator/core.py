"""The aggregator's decisions around the control step, without I/O: inputs in, effects out.

``AggregatorCore`` holds what the aggregator decides with (the rows, ``step.RowControl``;
the intake, ``intake.Intake``; its shard's leadership, ``coord.leadership.Leadership``;
the write intervals, ``export.schedule.Thinning``) and turns each input into what the
shell (``runtime.py``) must do, as ``AgentCore`` does for the agent:

- ``receive``: one received message, checked by the intake, into ``Received``: batches of
  points to write, whether to wake the control step, the nodes to move to the quarantine
  connection or back (``connections.move_node``), a deposition to report; never raises;
- ``step``: one control step as a transaction, into ``Stepped``: the messages to publish
  once all were built and the level changes to audit; a step that raised is undone
  (``RowControl.restore``), counted (``control_step_failed``) and publishes nothing;
- ``step_points``: the points of a step, thinned; ``leadership_changed``: the term to
  stamp and the audit a change of leadership asks for;
- the aggregator's own messages: status, policy bundles, events, the status line.

The rules of high availability come from ``coord/leadership.py``: a standby writes none
of the rows' series (the leader does) but keeps its ladders warm and follows the leader's
control; a leader steps down when a peer publishes at a higher term; only an instance
alone, or leading within its lease, publishes. Time is passed in: ``received_s`` and
``now_s`` (monotonic seconds), ``now_mono_ns`` (the lease), ``now_ns`` (wall-clock stamps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from polca.aggregator import connections, messages, points
from polca.aggregator.config import AggregatorSettings
from polca.aggregator.controller import ScopeDecision
from polca.aggregator.intake import (
    Accepted,
    CduIn,
    EventIn,
    Intake,
    PeerControl,
    RetainedControl,
    TelemetryIn,
    Urgent,
)
from polca.aggregator.step import RowControl, StepResult
from polca.bmc.actuator import OobOutcome
from polca.bmc.plan import NodeState, OobPlanner, OobTarget
from polca.coord.leadership import Leadership, LeadershipChange
from polca.export.points import AnyPoint, Point, mqtt_points
from polca.export.schedule import Thinning
from polca.export.sink import FanOut
from polca.policy import LoadedPolicy, PolicyStore
from polca.telemetry.checks import ClockWindow, DropLog
from polca.telemetry.messages import BusStats, InMessage, OutMessage
from polca.telemetry.topics import Topics

__all__ = ["AggregatorCore", "Received", "Stepped"]


@dataclass(frozen=True, slots=True)
class Received:
    """What the shell does after one received message."""

    wake: bool = False
    """Run the control step now (an urgent reading), not at the interval."""
    writes: tuple[Sequence[AnyPoint], ...] = ()
    """Batches of points, each one write to the sinks, in order."""
    deposed: int | None = None
    """A peer published at this higher term: this instance stopped leading."""
    moves: tuple[connections.NodeMove, ...] = ()
    """Nodes newly over their refusals (their topics move to the quarantine connection) or
    released from it."""


@dataclass(frozen=True, slots=True)
class Stepped:
    """One control step that succeeded."""

    result: StepResult
    messages: list[OutMessage]
    """To publish, in order (none unless this instance may publish)."""
    changed: list[ScopeDecision]
    """Scopes whose level changed, to audit (none unless this instance may publish)."""
    oob: list[OobTarget] = field(default_factory=list)
    """Nodes to cap or release through their BMC (``bmc/plan.py``; only when publishing)."""


class AggregatorCore:
    """The rows one aggregator owns, what it receives for them and what it decides."""

    def __init__(
        self,
        settings: AggregatorSettings,
        *,
        policy_store: PolicyStore,
        epoch_ns: int,
        log: Any,
    ) -> None:
        """Rows, intake, leadership and write intervals for ``settings``; no I/O."""
        s = self.settings = settings
        self.policy_store = policy_store
        self.epoch_ns = epoch_ns
        self.log = log
        self.topics = Topics(s.topic_root)
        self.rows = RowControl(s, epoch_ns=epoch_ns, log=log)
        self.intake = Intake(
            site=s.site,
            topics=self.topics,
            trackers=self.rows.trackers,
            issuer=s.instance,
            cdus=tuple(loop.cdu for loop in s.cooling.loops),
            peers=frozenset(s.ha.peers) - {s.instance},
            window=ClockWindow.of_seconds(s.control.clock_skew_tolerance_s),
            limits=s.intake,
            budgets=self.rows.budgets,
        )
        self.leadership = Leadership.standby() if s.ha.enabled else Leadership()
        self.thinning = Thinning(s.influx.write_every_s, workload_series=s.influx.workload_series)
        self._step_s = 0.0  # the time of the step running: the failure log's pace
        self.step_failures = DropLog(
            "control_step_failed", every_s=60.0, logger=log, clock=lambda: self._step_s
        )
        """Control steps that raised (logged with the traceback, at most once a minute)."""
        self.crash_loop: str | None = None
        self.mqtt_endpoint: str | None = None  # the control connection's broker endpoint
        """The crash loop the exit record reported at start, if any (in the status)."""
        self.oob = OobPlanner(cap_from_level=s.bmc.cap_from_level, agent_back_s=s.bmc.agent_back_s)
        """Which nodes are capped through their BMC (only nodes listed in ``bmc.nodes``)."""
        self.oob_counts: dict[str, dict[str, int]] = {}
        """Out-of-band writes by node (configured nodes only): caps, releases, failures."""

    @property
    def policy(self) -> LoadedPolicy:
        """The policy in force (the last good one; ``PolicyStore.in_force``)."""
        return self.policy_store.in_force

    # ------------------------------------------------------------------ intake

    def receive(
        self, message: InMessage, *, received_s: float, now_s: float, writing: bool
    ) -> Received:
        """Take one message received at ``received_s``; what follows. Never raises.

        ``now_s`` is the monotonic time now (write intervals), ``writing`` whether there
        is any sink.
        """
        accepted = self.intake.handle(message, received_s)
        try:
            if accepted is None:
                return Received(moves=self._moves())
            received = self.route(accepted, writing=writing, now_s=now_s)
            moves = self._moves()
            return dataclasses.replace(received, moves=moves) if moves else received
        except Exception as exc:  # one message must never end the intake
            self.intake.drops.drop("internal", exc=exc, topic=message.topic, detail=repr(exc))
            return Received()

    def _moves(self) -> tuple[connections.NodeMove, ...]:
        connections_n = self.settings.intake.connections
        return tuple(
            connections.move_node(self.intake, row, node, kind, connections_n)
            for row, node, kind in self.intake.take_moves()
        )

    def route(self, accepted: Accepted, *, writing: bool, now_s: float) -> Received:
        """Apply what the intake accepted to the rows; what the shell does next."""
        if isinstance(accepted, TelemetryIn):
            # Over the next threshold: escalate now. A standby writes no series of the
            # rows (the leader does); per-GPU series are thinned to their interval.
            if not writing or not self.leadership.writes_row_series:
                return Received(wake=accepted.urgent)
            batches = self.thinning.telemetry_batches(
                accepted.telemetry,
                node=accepted.node,
                site=self.settings.site,
                row=accepted.row,
                rack=accepted.rack,
                now_s=now_s,
            )
            return Received(wake=accepted.urgent, writes=tuple(batches))
        if isinstance(accepted, EventIn):
            if not writing:
                return Received()
            site, row, rack = self.settings.site, accepted.row, accepted.rack
            return Received(
                writes=([points.event_point(accepted.event, site=site, row=row, rack=rack)],)
            )
        if isinstance(accepted, Urgent):
            return Received(wake=True)  # the row meter crossed the next threshold
        if isinstance(accepted, RetainedControl):
            self.rows.seed(accepted.control, policy=self.policy.policy)
            return Received()
        if isinstance(accepted, PeerControl):
            return self._peer_control(accepted)
        return self._cdu(accepted)

    def _peer_control(self, peer: PeerControl) -> Received:
        """Another instance of the shard published control: follow it, or step down."""
        control = peer.control
        verdict = self.leadership.peer_control(control.term, retained=peer.retained)
        if verdict == "follow":
            self.rows.follow(control, policy=self.policy.policy)
        return Received(deposed=control.term if verdict == "deposed" else None)

    def _cdu(self, cdu: CduIn) -> Received:
        # Cooling emergencies do not wait for the interval.
        return Received(wake=self.rows.observe_cdu(cdu.cdu, cdu.received_s))

    # ------------------------------------------------------------------ control

    def step(self, now_s: float, *, now_ns: int, now_mono_ns: int) -> Stepped | None:
        """Evaluate every owned row and rack scope once; None while warming up or failed.

        Only an instance alone, or leading within its lease at ``now_mono_ns``
        (``Leadership.may_publish``), publishes; a standby decides as well (its ladders
        stay warm, corrected by the leader's messages). A step that raises, whatever the
        input, is undone and counted; the next starts from the last good state.
        """
        self._step_s = now_s
        checkpoint = self.rows.checkpoint()
        try:
            result = self.rows.step(now_s, now_ns, self.policy)
            if result is None:
                return None  # warming up
            if not self.leadership.may_publish(now_mono_ns):
                return Stepped(result, [], [])
            s = self.settings
            out = list(
                messages.step_messages(self.topics, site=s.site, issuer=s.instance, result=result)
            )
            changed = [d for _scope, d in result.decisions() if d.changed]
            oob = self.oob.plan(self._bmc_nodes(result), now_s) if s.bmc.nodes else []
        except Exception as exc:  # no input may stop the control loop
            self.rows.restore(checkpoint)
            self.step_failures.drop(type(exc).__name__, exc=exc, topic="", detail=repr(exc))
            return None
        return Stepped(result, out, changed, oob)

    def _bmc_nodes(self, result: StepResult) -> list[NodeState]:
        """The nodes with a BMC as this step saw them, each with its scope's level."""
        bmc = self.settings.bmc.nodes
        top_level = self.policy.policy.top_level
        states: list[NodeState] = []
        for row in result.rows:
            for node in row.nodes:
                config = bmc.get(node.node)
                if config is None:
                    continue
                rack = row.rack_decisions.get(node.rack)
                level = max(row.decision.level, rack.level if rack is not None else 0)
                states.append(
                    NodeState(
                        node=node.node,
                        health=node.health,
                        fail_safe=node.telemetry is not None and node.telemetry.fail_safe,
                        level=level,
                        top_level=top_level,
                        fail_safe_w=config.fail_safe_w,
                        brake_w=config.brake_limit_w,
                    )
                )
        return states

    def step_points(
        self,
        result: StepResult,
        *,
        sinks: FanOut,
        now_s: float,
        connections: Mapping[str, BusStats] | None = None,
    ) -> list[Point] | None:
        """The points a step writes now: its rows' (not a standby's) and the aggregator's
        own health, each measurement thinned to its write interval; None (counted) when
        building them failed: a failure there loses points only."""
        s = self.settings
        try:
            out = (
                points.step_points(result, site=s.site, instance=s.instance)
                if self.leadership.writes_row_series
                else []
            )
            out.append(
                points.aggregator_point_of(
                    self.intake,
                    sinks.stats,
                    site=s.site,
                    instance=s.instance,
                    ts_ns=result.now_ns,
                    step_failures=self.step_failures.total,
                )
            )
            out.extend(
                mqtt_points(
                    connections or {},
                    ts_ns=result.now_ns,
                    site=s.site,
                    role="aggregator",
                    name=s.instance,
                )
            )
            return self.thinning.step_points(out, now_s)
        except Exception as exc:  # points are not worth a control step
            self.step_failures.drop("points", exc=exc, topic="", detail=repr(exc))
            return None

    def leadership_changed(self) -> LeadershipChange:
        """The leadership changed: when leading, every control carries its term from now."""
        change = self.leadership.changed(self.settings.shard)
        if change.lead_term is not None:
            self.rows.set_term(change.lead_term)
        return change

    def oob_reported(self, outcome: OobOutcome, *, now_ns: int) -> tuple[OutMessage | None, Point]:
        """One out-of-band write ended: the event to publish and the point to write (with
        the node's running counts: verified caps, verified releases, failed writes)."""
        counts = self.oob_counts.setdefault(outcome.node, {})
        key = (
            "failures"
            if outcome.error is not None or not outcome.verified
            else "caps"
            if outcome.action == "cap"
            else "releases"
        )
        counts[key] = counts.get(key, 0) + 1
        name = f"oob_{outcome.action}" + ("" if key != "failures" else "_failed")
        detail = {
            "target_node": outcome.node,
            "reason": outcome.reason,
            "target_w": outcome.target_w,
            "limit_w": outcome.limit_w,
            "verified": outcome.verified,
            "error": outcome.error,
            "latency_s": outcome.latency_s,
        }
        event = self.event(name, detail, now_ns=now_ns)
        capped = outcome.node in self.oob.capped
        point = points.oob_point(
            outcome, ts_ns=now_ns, site=self.settings.site, capped=capped, counts=counts
        )
        return event, point

    def leader_point(self, change: LeadershipChange, *, now_ns: int) -> Point:
        """The ``leadership`` point of an audited change (a dashboard annotation)."""
        return points.leader_point(
            site=self.settings.site,
            instance=self.settings.instance,
            ts_ns=now_ns,
            shard=change.shard,
            role=change.role,
            term=change.term,
            leader=change.leader,
            leader_term=change.leader_term,
        )

    # ------------------------------------------------------------------ messages out

    def status_message(
        self, state: str, *, now_ns: int, reason: str | None = None, endpoint: str | None = None
    ) -> OutMessage:
        """The aggregator's retained status (with its shard's leadership under ``ha``);
        ``endpoint``: the control connection's broker endpoint, kept for ``polca status``."""
        if endpoint is not None:
            self.mqtt_endpoint = endpoint
        s = self.settings
        return messages.status(
            self.topics,
            site=s.site,
            instance=s.instance,
            state=state,
            loaded=self.policy_store.current,
            started_ns=self.epoch_ns,
            now_ns=now_ns,
            reason=reason,
            crash_loop=self.crash_loop,
            ha=self.leadership.status(s.shard) if s.ha.enabled else None,
            mqtt_endpoint=self.mqtt_endpoint if state == "online" else None,
        )

    def policy_messages(self, *, now_ns: int) -> list[OutMessage]:
        """The node policy for every owned row (none unless ``control.publish_policy``)."""
        s = self.settings
        if not s.control.publish_policy:
            return []
        rows = [row.name for row in s.rows]
        return messages.policy_bundles(
            self.topics, site=s.site, rows=rows, loaded=self.policy, now_ns=now_ns
        )

    def event(self, name: str, detail: Mapping[str, Any], *, now_ns: int) -> OutMessage | None:
        """One audit event of the aggregator (None when it does not fit the wire)."""
        s = self.settings
        return messages.event(
            self.topics, site=s.site, instance=s.instance, name=name, detail=detail, now_ns=now_ns
        )

    def policy_rejected(self, problems: Sequence[str], *, now_ns: int) -> OutMessage | None:
        """The event of a policy file refused on reload: its first 20 problems, each cut to
        1,000 characters (one event stays small whatever the file), and the revision kept."""
        detail = {
            "problems": [p[:1000] for p in problems[:20]],
            "revision_in_force": self.policy.revision,
        }
        return self.event("policy_rejected", detail, now_ns=now_ns)

    def status_line(self) -> str:
        """systemd's ``STATUS=``: the rows' levels, the policy, a crash loop."""
        levels = ", ".join(f"{row}={name}" for row, name in self.rows.row_levels().items())
        loop = f"; {self.crash_loop}" if self.crash_loop else ""
        revision = self.policy.revision
        return f"{len(self.settings.rows)} rows ({levels or 'warming up'}), policy {revision}{loop}"
