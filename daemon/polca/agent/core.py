"""The node agent's decisions, without I/O: what control is in force, what each GPU gets.

``AgentCore`` is what the shell (``runtime.py`` with ``gpus.py``) talks to: it turns what
it is given (times, samples, messages, write results) into what the shell must do, as data
(``plans.py``): GPU writes, messages to publish, log lines. It never touches the GPUs, the
broker, a clock or the disk. It owns the parts that decide, each with its own reason to
change, and lends them its ``LogBook`` and ``event`` (none of them imports this module):

- ``fleet.py`` ``GpuFleet``: ``sample_indices``, ``note_samples``, ``note_health``, which
  GPUs to read and what the readings mean (a GPU lost or recovered, a new XID);
- ``intake.py`` ``MessageIntake``: ``receive``, one MQTT message checked and taken, or
  counted and dropped, never raised; ``Received`` says what the shell must do;
- ``step.py`` ``NodeControl``: ``control_step`` -> ``StepPlan``, then ``note_step`` with
  the write results (the decision in force, the writes that carry it out, what they did);
- ``ending.py``: ``resume``/``note_resume`` (the fail-safe first, after a run that did not
  restore the GPUs) and ``plan_stop``/``note_stop`` (how control ends);
- ``outbox.py`` ``Outbox``: the ``seq`` of the node's messages and what a call queues.

What stays here is the wiring, the original settings (``baseline``) and what the node says
about itself (``snapshot``, ``status_message``, ``state_message``, ``telemetry``,
``status_line``, built by ``messages.py`` from an immutable snapshot) and when.

Time is passed in: ``now_mono_ns`` (leases, grace, dwell), ``now_s`` (the loop's
monotonic seconds, for lost-GPU retries and health reports) and ``now_ns`` (the wall
clock, only to stamp messages); a received message carries its own receipt times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

from polca.agent import ending, messages
from polca.agent.actuator import Actuator
from polca.agent.baseline import BASELINE_FILE, Baseline
from polca.agent.classes import ClassDwell
from polca.agent.config import AgentSettings
from polca.agent.control import Lease
from polca.agent.fleet import GpuFleet
from polca.agent.gpu_health import HealthTracker
from polca.agent.intake import Handled, MessageIntake
from polca.agent.outbox import Outbox
from polca.agent.plans import (
    Applied,
    Effects,
    LogBook,
    LogLine,
    Received,
    ResumePlan,
    Sampled,
    StepPlan,
    Stopped,
    StopPlan,
)
from polca.agent.step import NodeControl
from polca.agent.window import TelemetryWindow
from polca.assign.model import AssignmentUpdate
from polca.assign.rules import Classes
from polca.errors import GpuError
from polca.gpu.backend import GpuHealth, GpuInfo, GpuSample, WriteResult
from polca.policy import Decision, GpuTarget, LoadedPolicy, PolicyStore
from polca.telemetry.checks import DropLog
from polca.telemetry.messages import InMessage, OutMessage
from polca.telemetry.schema import Telemetry
from polca.telemetry.topics import NodeAddress, Topics


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
        assignment_source: Literal["mqtt", "kubernetes", "file"] = "mqtt",
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
        self.outbox = Outbox(addr, topics, log=self.log)
        self.fleet = GpuFleet(
            health_every_s=settings.health_every_s, log=self.log, event=self.event
        )
        self.classes = ClassDwell(int(settings.class_dwell_s * 1e9), source=assignment_source)
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
        self.control = NodeControl(
            fleet=self.fleet,
            classes=self.classes,
            intake=self.intake,
            actuator=self.actuator,
            observe_only=settings.observe_only,
            log=self.log,
            event=self.event,
        )
        # The GPUs' original settings (saved by the shell before the first write).
        self.baseline: Baseline | None = None
        self.baseline_path = settings.state_dir / BASELINE_FILE  # where the shell keeps it
        self.crash_loop: str | None = None  # what ended the last runs, when it is a loop
        self.mqtt_endpoint: str | None = None  # the broker endpoint the runtime is on

    # What the fleet knows of the GPUs, as the shell and tests read it.

    @property
    def infos(self) -> Mapping[int, GpuInfo]:
        """The node's GPUs, by index (``GpuFleet.infos``)."""
        return self.fleet.infos

    @property
    def latest(self) -> Mapping[int, GpuSample]:
        """Each GPU's latest good sample (``GpuFleet.latest``)."""
        return self.fleet.latest

    @property
    def lost(self) -> Mapping[int, float]:
        """The lost GPUs, with the loop time of their last attempt (``GpuFleet.lost``)."""
        return self.fleet.lost

    @property
    def health(self) -> HealthTracker:
        """The GPUs' health counters (``GpuFleet.health``)."""
        return self.fleet.health

    # What the control step decided, likewise.

    @property
    def decision(self) -> Decision | None:
        """The decision in force (None before the first)."""
        return self.control.decision

    @property
    def last_targets(self) -> tuple[GpuTarget, ...]:
        """The caps in force: the targets of the decision in force."""
        return self.control.last_targets

    @property
    def outcome_errors(self) -> dict[int, str]:
        """Why a GPU's caps are not applied, by index (``NodeControl.outcome_errors``)."""
        return self.control.outcome_errors

    @property
    def grace_until_mono_ns(self) -> int:
        """The end of the start-up grace (nominal until then without a lease)."""
        return self.control.grace_until_mono_ns

    @property
    def runtime_classes(self) -> Mapping[str, str]:
        """The priority classes the scheduler's assignment asks for (before the dwell)."""
        return self.classes.requested

    # What the intake believes of the messages received, as the shell and tests read it.

    @property
    def drops(self) -> DropLog:
        """Messages (and telemetry) dropped, by reason."""
        return self.intake.drops

    @property
    def clock_skewed(self) -> bool:
        """Whether this node's clock and its controller's disagree beyond the tolerance."""
        return self.intake.clock_skewed

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

    @property
    def seq(self) -> int:
        """The ``seq`` of the last message this node published (``Outbox.seq``)."""
        return self.outbox.seq

    def event(self, name: str, *, now_ns: int, gpu: int | None = None, **detail: Any) -> None:
        """Queue one event of this node, with its GPU's UUID (``Outbox.add_event``).

        Every name is a literal at its call (``tests/aggregator/test_points_events.py``).
        """
        info = self.infos.get(gpu) if gpu is not None else None
        uuid = info.uuid if info is not None else None
        self.outbox.add_event(name, now_ns=now_ns, gpu=gpu, uuid=uuid, detail=detail)

    def _effects(self, *, status_line: bool = False) -> Effects:
        """Everything queued by this call, handed over (the queues are empty after)."""
        return self.outbox.take(status_line=self.status_line() if status_line else None)

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
            skew_s=self.intake.skew_s,
            clock_skewed=self.clock_skewed,
            mqtt_endpoint=self.mqtt_endpoint,
            assignment=messages.AssignmentState(
                source=self.classes.source,
                healthy=self.classes.healthy,
                reason=self.classes.reason,
                origins=MappingProxyType(
                    {i: o for i, info in self.infos.items() if (o := self.classes.origin(info))}
                ),
                workloads=MappingProxyType(
                    {i: w for i, info in self.infos.items() if (w := self.classes.workload(info))}
                ),
            ),
        )

    def lease(self, now_mono_ns: int) -> Lease | None:
        """The control lease in force at ``now_mono_ns`` (None: none, or lapsed)."""
        return self.intake.tracker.current(now_mono_ns)

    def birth(self, endpoint: str | None, *, now_ns: int, now_mono_ns: int) -> list[OutMessage]:
        """What a new connection to ``endpoint`` publishes first: the status (naming the
        endpoint) and the state."""
        self.mqtt_endpoint = endpoint
        return [
            self.status_message("online", now_ns=now_ns),
            self.state_message(now_ns=now_ns, now_mono_ns=now_mono_ns),
        ]

    def status_message(self, state: str, *, now_ns: int, reason: str | None = None) -> OutMessage:
        """The node's retained status (``online``/``offline``), stamped ``now_ns``."""
        return messages.status(self.snapshot(), state, now_ns=now_ns, reason=reason)

    def state_message(self, *, now_ns: int, now_mono_ns: int) -> OutMessage:
        """The node's retained state (the caps in force), with the next ``seq``."""
        return messages.state(
            self.snapshot(),
            lease=self.lease(now_mono_ns),
            seq=self.outbox.next_seq(),
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
        mig = {
            index: tuple(d.uuid for d in info.mig_devices)
            for index, info in self.infos.items()
            if info.mig_enabled and info.mig_devices
        }
        records = messages.with_assignment(records, snapshot.assignment, mig)
        message, out = messages.telemetry(
            snapshot,
            gpus=records,
            node_gpu_power_w=power_w,
            node_energy_delta_j=energy_j,
            seq=self.outbox.next_seq(),
            interval_s=self.settings.publish_interval_s,
            health=health,
            now_ns=now_ns,
        )
        self.outbox.add(out)
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
        self.fleet.discovered(infos)
        self.actuator.infos = dict(self.fleet.infos)
        self.control.grace_until_mono_ns = grace_until_mono_ns
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
        """The GPUs to read now (``GpuFleet.sample_indices``)."""
        return self.fleet.sample_indices(now_s)

    def note_samples(
        self,
        indices: Sequence[int],
        results: Sequence[GpuSample | GpuError],
        *,
        now_s: float,
        now_ns: int,
    ) -> Sampled:
        """Take one round of readings of GPUs ``indices`` (``GpuFleet.note_samples``)."""
        samples = self.fleet.note_samples(indices, results, now_s=now_s, now_ns=now_ns)
        return Sampled(samples, self._effects())

    def note_health(
        self, indices: Sequence[int], results: Sequence[GpuHealth | GpuError], *, now_ns: int
    ) -> Effects:
        """Take one round of health readings (``GpuFleet.note_health``)."""
        self.fleet.note_health(indices, results, now_ns=now_ns)
        return self._effects()

    # ------------------------------------------------------------------ the control step

    def control_step(self, *, now_mono_ns: int, now_ns: int) -> StepPlan:
        """Decide for now (``NodeControl.step``); the writes that carry the decision out,
        and what to emit first.

        When a new decision changed the caps in force and there is nothing to write, the
        state is republished at once; otherwise ``note_step`` does, after the writes.
        """
        step = self.control.step(now_mono_ns=now_mono_ns, now_ns=now_ns, baseline=self.baseline)
        targets_changed = step.taken is not None and step.taken.targets_changed
        publish = targets_changed and not step.writes
        if publish:
            self.outbox.add(self.state_message(now_ns=now_ns, now_mono_ns=now_mono_ns))
        return StepPlan(
            step.decision,
            step.writes,
            taken=step.taken is not None,
            targets_changed=targets_changed,
            effects=self._effects(status_line=publish),
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
        result = self.control.note(decision, plan.writes, results, now_s=now_s, now_ns=now_ns)
        wrote = any(o.action != "unchanged" for o in result.outcomes)
        changed = plan.targets_changed or (plan.taken and wrote)
        if changed:
            self.outbox.add(self.state_message(now_ns=now_ns, now_mono_ns=now_mono_ns))
        return Applied(result, self._effects(status_line=changed))

    # ------------------------------------------------------------------ start and end

    def resume(self, existing: Baseline, *, now_mono_ns: int) -> ResumePlan:
        """A baseline was left behind (``existing``): the fail-safe caps first, no grace
        (``ending.resume``)."""
        resumed = ending.resume(
            existing,
            actuator=self.actuator,
            fail_safe=self.control.fail_safe(now_mono_ns),
            grace_until_mono_ns=self.control.grace_until_mono_ns,
            now_mono_ns=now_mono_ns,
        )
        self.baseline = resumed.baseline
        self.control.grace_until_mono_ns = resumed.grace_until_mono_ns
        return resumed.plan

    def note_resume(
        self, plan: ResumePlan, results: Sequence[Sequence[WriteResult]], *, now_ns: int
    ) -> Effects:
        """What the fail-safe writes at start-up did; the fail-safe is in force after."""
        self.control.take(plan.decision, now_ns=now_ns)
        ending.note_resume(
            plan, results, actuator=self.actuator, log=self.log, baseline_path=self.baseline_path
        )
        return self._effects()

    def plan_stop(self, *, clean: bool, now_mono_ns: int) -> StopPlan:
        """What the end of control requires of the GPUs (``ending.plan_stop``): ``on_stop``
        after a clean stop, the fail-safe or tighter caps after any other end."""
        return ending.plan_stop(
            clean=clean,
            observe_only=self.settings.observe_only,
            has_gpus=bool(self.infos),
            current=self.policy_store.current,
            baseline=self.baseline,
            actuator=self.actuator,
            fail_safe=lambda: self.control.fail_safe(now_mono_ns),
        )

    def note_stop(
        self,
        plan: StopPlan,
        results: Sequence[Sequence[WriteResult]] | None,
        *,
        timeout_s: float,
        now_ns: int,
    ) -> Stopped:
        """How control ended (``ending.note_stop``): ``results`` of ``plan``'s writes, None
        when the shell's bound (``timeout_s``) ran out before they were done."""
        ended = ending.note_stop(
            plan,
            results,
            actuator=self.actuator,
            log=self.log,
            timeout_s=timeout_s,
            baseline_path=self.baseline_path,
        )
        if ended.in_force is not None:
            self.control.take(ended.in_force, now_ns=now_ns)
        return Stopped(ended.reason, remove_baseline=ended.remove_baseline, effects=self._effects())

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
            self.outbox.add(self.status_message("online", now_ns=message.received_ns))
        return Received(
            wake=handled.wake,
            policy_copy=handled.policy_copy,
            effects=self._effects(status_line=handled.status_changed),
        )

    def assign(self, update: AssignmentUpdate, *, now_mono_ns: int, now_ns: int) -> Received:
        """Take an assignment source's update (Kubernetes, a file): the path the MQTT
        ``assign`` message takes (``MessageIntake.take_update``); never raises."""
        try:
            handled = self.intake.take_update(update, self.infos, now_mono_ns=now_mono_ns)
        except Exception as exc:  # one update must never end the source's task
            self.intake.drop_at(
                now_mono_ns, "internal", topic=f"assignment/{update.source}", detail=repr(exc)
            )
            handled = Handled()
        if handled.status_changed:
            self.outbox.add(self.status_message("online", now_ns=now_ns))
        return Received(
            wake=handled.wake, effects=self._effects(status_line=handled.status_changed)
        )

    def policy_classes(self) -> Classes:
        """The policy's classes and its default, as the assignment sources rank them."""
        policy = self.policy.policy
        return Classes(tuple(policy.classes), policy.default_class)

    def policy_file_ignored(self, trigger: str) -> Effects | None:
        """Why the local policy file is not to be reloaded now (the aggregator's policy is
        in force: a warning); None when it may be."""
        if not self.remote_policy:
            return None
        line = LogLine(
            "warning",
            "policy_file_ignored",
            {
                "trigger": trigger,
                "reason": "the aggregator's policy is in force",
                "revision": self.policy.revision,
            },
        )
        return Effects(logs=(line,))

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
        self.outbox.add(self.status_message("online", now_ns=now_ns))
        return self._effects()
