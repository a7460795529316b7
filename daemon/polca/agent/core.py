"""The node agent's decisions, without I/O: what control is in force, what each GPU gets.

``AgentCore`` holds what the agent knows (its GPUs and their latest samples, which are
lost, the runtime priority classes, the control messages it believes, the engine's state,
the decision in force, what polca has written to each GPU and the original settings) and
turns what it is given (times, samples, messages, write results) into decisions. Each call
returns what the shell must do, as data (``plans.py``): GPU writes to make, messages to
publish (numbered by the core's ``seq`` and stamped with the time passed in), log lines to
emit. The core never touches the GPUs, the broker, a clock or the disk; the shell
(``runtime.py`` with ``gpus.py``) carries the plans out and feeds the results back.

- ``sample_indices`` / ``note_samples`` / ``note_health``: which GPUs to read now, and what
  the readings mean (a GPU lost or recovered, a new XID);
- ``receive``: one MQTT message (control, policy bundle, priority assignment), checked and
  taken, or counted and dropped, never raised, by the core's ``MessageIntake``
  (``intake.py``, which also bounds what a message can make the agent do); ``Received``
  says what the shell must do;
- ``control_step`` -> ``StepPlan``, then ``note_step`` with the write results: the
  engine's decision for now made the one in force, the writes that carry it out (or put
  back a limit someone else moved), then what they did, as logs, events and the state;
- ``resume`` -> ``ResumePlan``, then ``note_resume``: the fail-safe caps first, at a start
  after a run that did not restore the GPUs;
- ``plan_stop`` -> ``StopPlan``, then ``note_stop``: what the end of control requires
  (``on_stop`` after a clean stop, the fail-safe or tighter caps after any other end);
- ``snapshot``, ``status_message``, ``state_message``, ``telemetry``, ``status_line``:
  the node's messages, built by ``messages.py`` from an immutable snapshot.

Time is passed in: ``now_mono_ns`` (leases, grace, dwell), ``now_s`` (the loop's
monotonic seconds, for lost-GPU retries and health reports) and ``now_ns`` (the wall
clock, only to stamp messages); a received message carries its own receipt times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from polca.agent import messages
from polca.agent.actuator import Actuator, ApplyResult, GpuPlan
from polca.agent.baseline import BASELINE_FILE, Baseline
from polca.agent.classes import ClassDwell
from polca.agent.control import ControlTracker, Lease
from polca.agent.gpu_health import HealthTracker
from polca.agent.intake import MessageIntake
from polca.agent.plans import (
    Applied,
    Effects,
    LogBook,
    Received,
    ResumePlan,
    Sampled,
    StepPlan,
    Stopped,
    StopPlan,
)
from polca.agent.window import TelemetryWindow
from polca.errors import GpuError, GpuLostError
from polca.gpu.backend import GpuHealth, GpuInfo, GpuSample, WriteResult
from polca.policy import (
    ControlInput,
    Decision,
    EngineState,
    GpuTarget,
    GpuView,
    LoadedPolicy,
    PolicyStore,
    decide,
    tighter,
)
from polca.settings import AgentSettings
from polca.telemetry.bus import InMessage, OutMessage
from polca.telemetry.checks import DropLog
from polca.telemetry.schema import Telemetry
from polca.telemetry.topics import NodeAddress, Topics

LOST_RETRY_S = 10.0
"""A lost GPU is read again this many seconds (loop time) after its last attempt."""


@dataclass(frozen=True, slots=True)
class Taken:
    """How a decision taken differs from the one before."""

    targets_changed: bool
    fail_safe_entered: bool
    fail_safe_left: bool
    level_changed: bool


class AgentCore:
    """Everything the agent decides, for one node."""

    def __init__(
        self,
        *,
        addr: NodeAddress,
        topics: Topics,
        settings: AgentSettings,
        policy_store: PolicyStore,
        identity: messages.Identity | None = None,
    ) -> None:
        """The core of the node at ``addr``; no GPUs until ``discovered``.

        ``identity`` is what the node's status says about the agent process.
        """
        self.addr = addr
        self.topics = topics
        self.settings = settings
        self.policy_store = policy_store
        self.identity = identity or messages.Identity(
            backend="", observe_only=settings.observe_only, started_ns=0
        )
        self.log = LogBook()  # emptied into the Effects of each call
        self._outbox: list[OutMessage] = []  # likewise: the messages of this call, in order
        self.infos: dict[int, GpuInfo] = {}
        self.latest: dict[int, GpuSample] = {}
        # Samples taken since the last write: only these can show that something else
        # changed a limit (older ones may predate polca's own write).
        self.fresh: dict[int, GpuSample] = {}
        self.lost: dict[int, float] = {}  # index -> loop time of the last attempt
        self.health = HealthTracker(every_s=settings.health_every_s)
        self.classes = ClassDwell(int(settings.class_dwell_s * 1e9))
        self.intake = MessageIntake(
            addr=addr,
            topics=topics,
            settings=settings,
            policy_store=policy_store,
            classes=self.classes,
            log=self.log,
            event=self.event,
        )
        # What polca has written to each GPU; plans the writes that reach a target.
        self.actuator = Actuator({}, reassert=settings.reassert)
        # The GPUs' original settings (saved by the shell before the first write).
        self.baseline: Baseline | None = None
        self.baseline_path = settings.state_dir / BASELINE_FILE  # where the shell keeps it
        self.engine_state = EngineState()
        self.decision: Decision | None = None
        self.last_targets: tuple[GpuTarget, ...] = ()
        self.outcome_errors: dict[int, str] = {}
        self.grace_until_mono_ns = 0
        self.seq = 0  # of the last message this node published (state, event, telemetry)
        self.crash_loop: str | None = None  # what ended the last runs, when it is a loop
        self._last_key: tuple[object, ...] | None = None

    @property
    def runtime_classes(self) -> Mapping[str, str]:
        """The priority classes the scheduler's assignment asks for (before the dwell)."""
        return self.classes.requested

    # What the intake believes of the messages received, as the shell and tests read it.

    @property
    def tracker(self) -> ControlTracker:
        """The control messages believed, and their leases."""
        return self.intake.tracker

    @property
    def drops(self) -> DropLog:
        """Messages (and telemetry) dropped, by reason."""
        return self.intake.drops

    @property
    def clock_skewed(self) -> bool:
        """Whether this node's clock and its controller's disagree beyond the tolerance."""
        return self.intake.clock_skewed

    @property
    def skew_s(self) -> float | None:
        """This node's clock minus its controller's, from the last live control message."""
        return self.intake.skew_s

    @property
    def policy_rejections(self) -> int:
        """Invalid policy bundles received."""
        return self.intake.policy_rejections

    @property
    def remote_policy(self) -> bool:
        """Whether the aggregator's policy is in force (the local file is then ignored)."""
        return self.intake.remote_policy

    @remote_policy.setter
    def remote_policy(self, value: bool) -> None:
        self.intake.remote_policy = value

    @property
    def policy(self) -> LoadedPolicy:
        """The policy in force (the last good one; ``MessageIntake.policy``)."""
        return self.intake.policy

    # ------------------------------------------------------------------ effects out

    def next_seq(self) -> int:
        """The sequence number of the next message this node publishes."""
        self.seq += 1
        return self.seq

    def event(self, name: str, *, now_ns: int, gpu: int | None = None, **detail: Any) -> None:
        """Queue one event of this node (logged and skipped if it does not fit the wire).

        Every name is a literal at its call (``tests/aggregator/test_points_events.py``).
        """
        uuid = self.infos[gpu].uuid if gpu is not None and gpu in self.infos else None
        seq = self.next_seq()  # taken even when the event does not fit: seq only ascends
        try:
            message = messages.event(
                self.addr,
                self.topics,
                name,
                seq=seq,
                now_ns=now_ns,
                gpu=gpu,
                uuid=uuid,
                detail=detail,
            )
        except ValidationError as exc:
            self.log.warning("event_not_published", event_name=name, error=str(exc)[:400])
            return
        self._outbox.append(message)

    def _effects(self, *, status_line: bool = False) -> Effects:
        """Everything queued by this call, handed over (the queues are empty after)."""
        out, self._outbox = tuple(self._outbox), []
        return Effects(
            messages=out,
            logs=self.log.take(),
            status_line=self.status_line() if status_line else None,
        )

    def snapshot(self) -> messages.NodeSnapshot:
        """What the node's messages say about it now: an immutable copy."""
        current = self.policy_store.current
        return messages.NodeSnapshot(
            addr=self.addr,
            topics=self.topics,
            identity=self.identity,
            observe_only=self.settings.observe_only,
            gpu_count=len(self.infos),
            lost=frozenset(self.lost),
            decision=self.decision,
            targets=self.last_targets,
            outcome_errors=MappingProxyType(dict(self.outcome_errors)),
            locked_sm_clock_max_mhz=MappingProxyType(
                {
                    index: setting.sm_clocks_mhz[1] if setting.sm_clocks_mhz else None
                    for index, setting in self.actuator.applied.items()
                }
            ),
            policy_name=current.policy.name if current else None,
            policy_revision=current.revision if current else None,
            crash_loop=self.crash_loop,
            skew_s=self.skew_s,
            clock_skewed=self.clock_skewed,
        )

    def lease(self, now_mono_ns: int) -> Lease | None:
        """The control lease in force at ``now_mono_ns`` (None: none, or lapsed)."""
        return self.tracker.current(now_mono_ns)

    def status_message(self, state: str, *, now_ns: int, reason: str | None = None) -> OutMessage:
        """The node's retained status (``online``/``offline``), stamped ``now_ns``."""
        return messages.status(self.snapshot(), state, now_ns=now_ns, reason=reason)

    def state_message(self, *, now_ns: int, now_mono_ns: int) -> OutMessage:
        """The node's retained state (the caps in force), with the next ``seq``."""
        return messages.state(
            self.snapshot(),
            lease=self.lease(now_mono_ns),
            seq=self.next_seq(),
            now_ns=now_ns,
            now_mono_ns=now_mono_ns,
        )

    def telemetry(
        self, window: TelemetryWindow, *, health: messages.Health, now_ns: int, now_s: float
    ) -> tuple[Telemetry, Effects]:
        """One telemetry message from the samples ``window`` folded (drained), with the
        next ``seq`` and the GPUs' health counters due at ``now_s``; its effects publish it
        (and log the readings the wire refused, nulled in it).

        Raises pydantic's ``ValidationError`` when a value does not fit the wire.
        """
        snapshot = self.snapshot()
        records, power_w, energy_j = window.drain(
            classes=snapshot.classes(),
            lost=set(snapshot.lost),
            locks=dict(snapshot.locked_sm_clock_max_mhz),
            health=self.health.due(now_s),
            log=self.log,
        )
        message, out = messages.telemetry(
            snapshot,
            gpus=records,
            node_gpu_power_w=power_w,
            node_energy_delta_j=energy_j,
            seq=self.next_seq(),
            interval_s=self.settings.publish_interval_s,
            health=health,
            now_ns=now_ns,
        )
        self._outbox.append(out)
        return message, self._effects()

    def telemetry_invalid(self, error: str, *, now_mono_ns: int) -> Effects:
        """A telemetry message did not fit the wire: count it as a drop (``telemetry_invalid``)."""
        self.intake.drop_at(now_mono_ns, "telemetry_invalid", topic="telemetry", detail=error)
        return self._effects()

    def status_line(self) -> str:
        """systemd's ``STATUS=`` line now."""
        return messages.status_line(self.snapshot())

    # ------------------------------------------------------------------ GPUs

    def discovered(self, infos: Sequence[GpuInfo], *, grace_until_mono_ns: int) -> Effects:
        """Take the node's GPUs; no caps before ``grace_until_mono_ns`` without a lease."""
        self.infos = {info.index: info for info in infos}
        self.actuator.infos = dict(self.infos)
        self.grace_until_mono_ns = grace_until_mono_ns
        if not self.settings.control_issuers:
            self.log.warning(
                "control_issuer_unchecked",
                hint="set agent.control_issuers to the aggregator instance(s) of this row",
            )
        return self._effects()

    def adopt(self, samples: Sequence[GpuSample]) -> None:
        """Take what the GPUs hold now as what polca has applied (before the first write)."""
        self.actuator.adopt(samples)

    def capture_baseline(self, samples: Sequence[GpuSample], *, now_ns: int) -> Baseline:
        """The original settings for the shell to save before the first write: the ones
        found at start-up (``resume``) if any, else what ``samples`` show (at ``now_ns``)."""
        if self.baseline is None:
            self.baseline = Baseline.capture(list(self.infos.values()), samples, now_ns=now_ns)
        return self.baseline

    def sample_indices(self, now_s: float) -> list[int]:
        """The GPUs to read now: all but the lost, which are retried every 10 s."""
        return [i for i in self.infos if i not in self.lost or now_s - self.lost[i] >= LOST_RETRY_S]

    def note_samples(
        self,
        indices: Sequence[int],
        results: Sequence[GpuSample | GpuError],
        *,
        now_s: float,
        now_ns: int,
    ) -> Sampled:
        """Take one round of readings of GPUs ``indices`` (same order)."""
        samples: dict[int, GpuSample] = {}
        for index, result in zip(indices, results, strict=True):
            if isinstance(result, GpuSample):
                samples[index] = result
                if index in self.lost:
                    del self.lost[index]
                    self.log.warning("gpu_recovered", gpu=index)
                    self.event("gpu_recovered", gpu=index, now_ns=now_ns)
            elif isinstance(result, GpuLostError):
                self._mark_lost(index, str(result), now_s=now_s, now_ns=now_ns)
            else:
                self.log.warning("gpu_sample_failed", gpu=index, error=str(result))
        self.latest.update(samples)
        self.fresh.update(samples)
        return Sampled(samples, self._effects())

    def note_health(
        self, indices: Sequence[int], results: Sequence[GpuHealth | GpuError], *, now_ns: int
    ) -> Effects:
        """Take one round of health readings; a new XID is logged and published as an event."""
        for xid in self.health.note(dict(zip(indices, results, strict=True))):
            self.log.error(
                "gpu_xid", gpu=xid.index, uuid=xid.uuid, xid=xid.last_xid, count=xid.count
            )
            self.event("gpu_xid", gpu=xid.index, xid=xid.last_xid, count=xid.count, now_ns=now_ns)
        return self._effects()

    def _mark_lost(self, index: int, error: str, *, now_s: float, now_ns: int) -> None:
        """GPU ``index`` is gone (logged and published once); retried later."""
        if index not in self.lost:
            self.log.error("gpu_lost", gpu=index, uuid=self.infos[index].uuid, error=error)
            self.event("gpu_lost", gpu=index, error=error, now_ns=now_ns)
        self.lost[index] = now_s

    def views(self) -> list[GpuView]:
        """What the engine needs of each GPU that is not lost."""
        views = []
        for index, info in sorted(self.infos.items()):
            if index in self.lost:
                continue
            sample = self.latest.get(index)
            cls = self.classes.of(index)
            supported = info.supported_sm_clocks_mhz
            views.append(
                GpuView(
                    index=index,
                    uuid=info.uuid,
                    priority_class=cls,
                    gpu_temp_c=sample.gpu_temp_c if sample else None,
                    mem_temp_c=sample.mem_temp_c if sample else None,
                    sm_clock_max_mhz=info.sm_clock_max_mhz,
                    sm_clock_min_mhz=min(supported) if supported else None,
                    power_limit_min_mw=info.power_limit_min_mw,
                    power_limit_max_mw=info.power_limit_max_mw,
                    power_limit_default_mw=info.power_limit_default_mw,
                )
            )
        return views

    # ------------------------------------------------------------------ the control step

    def control_step(self, *, now_mono_ns: int, now_ns: int) -> StepPlan:
        """Decide for now; the writes that carry the decision out, and what to emit first.

        A new decision is taken at once (its transitions logged and published) and its
        writes planned, unless observe-only. With no new decision, only a limit someone
        else moved (seen in a sample taken since the last write) is planned back. When
        there is nothing to write, a change of the caps in force republishes the state at
        once; otherwise ``note_step`` does, after the writes.
        """
        observe = self.settings.observe_only
        decision = self._decide(now_mono_ns)
        if decision is None:
            if observe or self.decision is None or not self.actuator.drifted(self.fresh):
                return StepPlan(
                    None, (), taken=False, targets_changed=False, effects=self._effects()
                )
            writes = self._plan_writes(self.decision)
            return StepPlan(
                self.decision, writes, taken=False, targets_changed=False, effects=self._effects()
            )
        taken = self._take(decision, now_ns=now_ns)
        writes = () if observe else self._plan_writes(decision)
        if not writes and taken.targets_changed:
            self._outbox.append(self.state_message(now_ns=now_ns, now_mono_ns=now_mono_ns))
            return StepPlan(
                decision,
                (),
                taken=True,
                targets_changed=True,
                effects=self._effects(status_line=True),
            )
        return StepPlan(
            decision,
            writes,
            taken=True,
            targets_changed=taken.targets_changed,
            effects=self._effects(),
        )

    def note_step(
        self,
        plan: StepPlan,
        results: Sequence[Sequence[WriteResult]],
        *,
        now_s: float,
        now_ns: int,
        now_mono_ns: int,
    ) -> Applied:
        """What ``plan``'s writes did (``results``, in its order): logs, events, and the
        state republished when the caps in force changed, or a new decision changed what a
        GPU holds (putting back a moved limit republishes nothing)."""
        decision = plan.decision
        if decision is None or not plan.writes:
            msg = "note_step takes the results of a plan with writes"
            raise ValueError(msg)
        result = self.actuator.record(plan.writes, results)
        self.fresh.clear()  # later samples are the ones that can show a drift
        self._note_outcomes(decision, result, now_s=now_s, now_ns=now_ns)
        wrote = any(o.action != "unchanged" for o in result.outcomes)
        changed = plan.targets_changed or (plan.taken and wrote)
        if changed:
            self._outbox.append(self.state_message(now_ns=now_ns, now_mono_ns=now_mono_ns))
        return Applied(result, self._effects(status_line=changed))

    def _plan_writes(self, decision: Decision) -> tuple[GpuPlan, ...]:
        """The writes that bring the GPUs to ``decision``'s targets; () when none is needed."""
        samples = {i: s for i, s in self.fresh.items() if i not in self.lost}
        plans = self.actuator.plan(decision.targets, baseline=self.baseline, samples=samples)
        return plans if self.actuator.pending(plans) else ()

    def control_input(self, now_mono_ns: int) -> ControlInput | None:
        """The control in force, its lease on the monotonic clock (as ``now_mono_ns``)."""
        lease = self.tracker.current(now_mono_ns)
        if lease is not None:
            source = f"{lease.control.scope}:{lease.control.issuer}#{lease.control.seq}"
            return ControlInput(lease.control.level, lease.expires_mono_ns, source=source)
        if now_mono_ns < self.grace_until_mono_ns:
            # No controller heard from yet: nominal during the start-up grace period.
            return ControlInput(0, self.grace_until_mono_ns, source="startup_grace")
        return None

    def _decide(self, now_mono_ns: int) -> Decision | None:
        """The engine's decision for now; None when nothing it depends on has changed.

        First puts in force the priority class changes whose dwell has passed: the
        controller runs every sampling tick, so a deferred change is decided here once its
        dwell ends (the key holds the classes in force, not those requested).
        """
        applied = self.classes.settle(self.infos.values(), now_mono_ns)
        if applied:
            self.log.info(
                "priority_assigned",
                classes={str(index): cls for index, cls in sorted(applied.items())},
            )
        control = self.control_input(now_mono_ns)
        temps = tuple((i, s.gpu_temp_c, s.mem_temp_c) for i, s in sorted(self.latest.items()))
        key = (
            control is not None and control.lease_expires_ns > now_mono_ns,  # valid or not
            self.policy.revision,
            None if control is None else control.level,
            self.classes.key(),
            tuple(sorted(self.lost)),
            temps,
        )
        if self.decision is not None and key == self._last_key:
            return None
        self._last_key = key
        return decide(
            self.views(),
            policy=self.policy.policy,
            control=control,
            state=self.engine_state,
            now_ns=now_mono_ns,
        )

    def _fail_safe_decision(self, now_mono_ns: int) -> Decision:
        """The fail-safe caps merged with the caps in force: per dimension the tighter."""
        decision = decide(
            self.views(),
            policy=self.policy.policy,
            control=None,
            state=self.engine_state,
            now_ns=now_mono_ns,
        )
        current = {t.index: t for t in self.last_targets}
        targets = tuple(
            tighter(t, current[t.index]) if t.index in current else t for t in decision.targets
        )
        return Decision(targets=targets, state=decision.state, level=0, fail_safe=True)

    def _take(self, decision: Decision, *, now_ns: int) -> Taken:
        """Make ``decision`` the one in force; log and publish what changed."""
        previous = self.decision
        self.engine_state = decision.state
        self.decision = decision
        taken = Taken(
            targets_changed=decision.targets != self.last_targets,
            fail_safe_entered=decision.fail_safe and (previous is None or not previous.fail_safe),
            fail_safe_left=previous is not None and previous.fail_safe and not decision.fail_safe,
            level_changed=previous is not None and decision.level != previous.level,
        )
        if taken.fail_safe_entered:
            reasons = list(decision.targets[0].reasons) if decision.targets else []
            self.log.warning("fail_safe_entered", reasons=reasons)
            self.event("fail_safe_entered", now_ns=now_ns)
        elif taken.fail_safe_left:
            self.log.info("fail_safe_left", control_level=decision.level)
            self.event("fail_safe_left", level=decision.level, now_ns=now_ns)
        if taken.level_changed and previous is not None:
            self.log.info("level_changed", old=previous.level, new=decision.level)
        self.last_targets = decision.targets
        return taken

    def _note_outcomes(
        self, decision: Decision, result: ApplyResult, *, now_s: float, now_ns: int
    ) -> None:
        """Log and publish what applying ``decision`` did to each GPU."""
        targets = {t.index: t for t in decision.targets}
        changed: list[dict[str, Any]] = []
        for outcome in result.outcomes:
            target = targets[outcome.index]
            if outcome.action in ("applied", "reasserted"):
                self.outcome_errors.pop(outcome.index, None)
                self.log.info(
                    "cap_reasserted" if outcome.action == "reasserted" else "cap_applied",
                    gpu=outcome.index,
                    changes=list(outcome.changes),
                    sm_clock_max_mhz=target.sm_clock_max_mhz,
                    power_limit_mw=target.power_limit_mw,
                    enforced_power_limit_mw=outcome.enforced_power_limit_mw,
                    reasons=list(target.reasons),
                    policy=self.policy.revision,
                )
                changed.append(
                    {
                        "gpu": outcome.index,
                        "uuid": outcome.uuid,
                        "action": outcome.action,
                        "changes": list(outcome.changes),
                        "reasons": list(target.reasons),
                    }
                )
            elif outcome.action == "lost":
                self._mark_lost(outcome.index, outcome.error or "lost", now_s=now_s, now_ns=now_ns)
            elif outcome.action == "failed":
                if self.outcome_errors.get(outcome.index) != outcome.error:
                    self.log.error("cap_failed", gpu=outcome.index, error=outcome.error)
                    self.event("cap_failed", gpu=outcome.index, error=outcome.error, now_ns=now_ns)
                self.outcome_errors[outcome.index] = outcome.error or "failed"
        if changed:
            # One event per decision applied, listing every GPU that changed.
            reasserted = any(c["action"] == "reasserted" for c in changed)
            self.event(
                "cap_reasserted" if reasserted else "cap_changed",
                level=decision.level,
                fail_safe=decision.fail_safe,
                policy_revision=self.policy.revision,
                gpus=changed,
                now_ns=now_ns,
            )

    # ------------------------------------------------------------------ start and end

    def resume(self, existing: Baseline, *, now_mono_ns: int) -> ResumePlan:
        """A baseline was left behind (``existing``): a previous run did not restore.

        It stays the originals, every clock lock is rewritten (polca does not know which it
        left), there is no start-up grace (the GPUs stay at or under the fail-safe until a
        controller grants a lease), and the fail-safe caps are planned before anything else.
        """
        self.baseline = Baseline(existing.gpus, existing.saved_ns, kept=False)
        self.actuator.forget_locks()
        self.grace_until_mono_ns = min(self.grace_until_mono_ns, now_mono_ns)
        decision = self._fail_safe_decision(now_mono_ns)
        plans = self.actuator.plan(decision.targets, baseline=self.baseline, samples={})
        writes = plans if self.actuator.pending(plans) else ()
        return ResumePlan(decision, writes, kept=existing.kept)

    def note_resume(
        self, plan: ResumePlan, results: Sequence[Sequence[WriteResult]], *, now_ns: int
    ) -> Effects:
        """What the fail-safe writes at start-up did; the fail-safe is in force after."""
        result = self.actuator.record(plan.writes, results)
        self._take(plan.decision, now_ns=now_ns)
        self.log.warning(
            "fail_safe_applied_at_start",
            reason="kept caps" if plan.kept else "the previous run ended without restoring",
            path=str(self.baseline_path),
            applied=len(result.by_action("applied")),
            failed=len(result.by_action("failed")),
            lost=len(result.by_action("lost")),
        )
        return self._effects()

    def plan_stop(self, *, clean: bool, now_mono_ns: int) -> StopPlan:
        """What the end of control requires of the GPUs.

        ``clean`` is an operator-asked stop: the policy's ``on_stop`` decides (``restore``
        without a policy). Any other end applies the fail-safe caps or keeps tighter ones
        in force, and keeps the baseline so the next start knows. Without a policy, a
        fail-safe end keeps the caps in force.
        """
        reason = "stopped" if clean else "failed"
        if self.settings.observe_only or not self.infos:
            return StopPlan("none", reason, clean)
        current = self.policy_store.current
        on_stop = current.policy.on_stop if current else "restore"
        if not clean:
            on_stop = "fail_safe"
        baseline = self.baseline
        if on_stop == "restore":
            return StopPlan("restore", reason, clean, writes=self.actuator.plan_restore(baseline))
        if on_stop == "fail_safe" and current is not None:
            decision = self._fail_safe_decision(now_mono_ns)
            return StopPlan(
                "fail_safe",
                reason,
                clean,
                save=Baseline(baseline.gpus, baseline.saved_ns, kept=clean) if baseline else None,
                writes=self.actuator.plan(decision.targets, baseline=baseline, samples={}),
                decision=decision,
            )
        kept = Baseline(baseline.gpus, baseline.saved_ns, kept=True) if baseline else None
        return StopPlan("keep", reason, clean, save=kept)

    def note_stop(
        self,
        plan: StopPlan,
        results: Sequence[Sequence[WriteResult]] | None,
        *,
        timeout_s: float,
        now_ns: int,
    ) -> Stopped:
        """How control ended: ``results`` of ``plan``'s writes, None when the shell's
        bound (``timeout_s``) ran out before they were done."""
        if plan.mode == "none":
            return Stopped(plan.reason, remove_baseline=False, effects=self._effects())
        if results is None:
            self.log.error(
                "restore_timed_out", timeout_s=timeout_s, baseline=str(self.baseline_path)
            )
            reason = f"{plan.reason}; restore timed out"
            return Stopped(reason, remove_baseline=False, effects=self._effects())
        remove = False
        if plan.mode == "restore":
            result = self.actuator.record(plan.writes, results)
            failed = result.by_action("failed")
            remove = not failed  # every GPU is back: the originals are no longer needed
            self.log.info(
                "gpu_settings_restored",
                restored=len(result.by_action("applied")),
                failed=len(failed),
            )
        elif plan.mode == "fail_safe" and plan.decision is not None:
            result = self.actuator.record(plan.writes, results)
            (self.log.info if plan.clean else self.log.error)(
                "gpu_fail_safe_on_stop" if plan.clean else "gpu_fail_safe_on_failure",
                applied=len(result.by_action("applied")),
                unchanged=len(result.by_action("unchanged")),
                failed=len(result.by_action("failed")),
                caps=[
                    {
                        "gpu": t.index,
                        "sm_clock_max_mhz": t.sm_clock_max_mhz,
                        "power_limit_mw": t.power_limit_mw,
                    }
                    for t in plan.decision.targets
                ],
            )
            self._take(plan.decision, now_ns=now_ns)
        elif plan.save is not None:
            self.log.info("gpu_caps_kept", path=str(self.baseline_path))
        return Stopped(plan.reason, remove_baseline=remove, effects=self._effects())

    # ------------------------------------------------------------------ messages in

    def subscriptions(self) -> list[tuple[str, int]]:
        """The topics the agent reads (``MessageIntake.subscriptions``)."""
        return self.intake.subscriptions()

    def receive(self, message: InMessage) -> Received:
        """Act on one received message (``MessageIntake.handle``); never raises.

        What it makes the node publish is stamped with the message's receipt time; a
        changed status is republished.
        """
        handled = self.intake.handle(message, self.infos)
        if handled.status_changed:
            self._outbox.append(self.status_message("online", now_ns=message.received_ns))
        return Received(
            wake=handled.wake,
            policy_copy=handled.policy_copy,
            effects=self._effects(status_line=handled.status_changed),
        )

    def policy_rejected(self, problems: Sequence[str], *, now_ns: int) -> Effects:
        """A local policy edit was refused: publish it (the last good one stays)."""
        self.event(
            "policy_rejected",
            problems=[p[:1000] for p in problems[:20]],
            revision_in_force=self.policy.revision,
            now_ns=now_ns,
        )
        return self._effects()

    def policy_reloaded_from_file(self, *, now_ns: int) -> Effects:
        """A new local policy file is in force: publish it and the new status (the shell
        wakes the controller to decide again)."""
        self.event("policy_applied", revision=self.policy.revision, now_ns=now_ns)
        self._outbox.append(self.status_message("online", now_ns=now_ns))
        return self._effects()
