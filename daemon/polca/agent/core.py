"""The node agent's decisions, without I/O: what control is in force, what each GPU gets.

``AgentCore`` holds what the agent knows (its GPUs and their latest samples, which are
lost, the runtime priority classes, the control messages it believes, the engine's state
and the decision in force) and turns inputs into decisions and effects:

- ``sample_indices`` / ``note_samples``: which GPUs to read now, and what the readings
  mean (a GPU lost or recovered);
- ``receive``: one MQTT message (control, policy bundle, priority assignment), checked and
  taken, or counted and dropped, never raised (``Received`` says what the shell must do);
  what a message makes the agent do elsewhere is bounded, not paced by the sender: a GPU's
  priority class changes at most once per ``agent.class_dwell_s`` (``ClassDwell``), an
  invalid policy bundle is published as an event at most once per 10 s (the same revision
  again only counted), and a clock skew report flips at most once per 10 s;
- ``decide``: the engine's decision for now, or None when its inputs have not changed;
  ``take`` makes a decision the one in force and reports the transitions;
- ``fail_safe_decision``: what a GPU gets when control ends (crash, stop, start-up after
  an unclean end): the fail-safe caps, or the caps in force where tighter;
- ``note_outcomes``: what the GPU writes did, as logs and events.

Time is passed in: ``now_mono_ns`` (leases, grace) and ``now_s`` (the loop's monotonic
seconds, for lost-GPU retries); the injected wall clock only stamps the events it hands to
``publish``. The core never touches the GPUs, the broker or the disk; the shell
(``runtime.py``) does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from polca.agent import messages
from polca.agent.actuator import ApplyResult
from polca.agent.classes import ClassDwell
from polca.agent.control import REFUSED, ControlTracker
from polca.agent.gpu_health import HealthTracker
from polca.errors import GpuError, GpuLostError, PolicyError, SchemaError
from polca.gpu.backend import GpuHealth, GpuInfo, GpuSample
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
from polca.policy.loader import revision_of
from polca.settings import AgentSettings
from polca.telemetry.bus import InMessage, OutMessage
from polca.telemetry.checks import ClockWindow, DropLog, RateGate
from polca.telemetry.schema import Assignment, Control, PolicyBundle, decode
from polca.telemetry.topics import NodeAddress, Topics

LOST_RETRY_S = 10.0
REPORT_EVERY_S = 10.0
"""At most one report (event, info log) per this many seconds of a message-driven kind."""


@dataclass(frozen=True, slots=True)
class Received:
    """What the shell must do after one message: wake the controller, save a policy copy,
    republish the status."""

    wake: bool = False
    policy_copy: str | None = None  # the text of a newly adopted aggregator policy
    status_changed: bool = False


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
        publish: Callable[[OutMessage], None],
        clock_ns: Callable[[], int],
        log: Any = None,
    ) -> None:
        """The core of the node at ``addr``; no GPUs until ``discovered``.

        ``clock_ns`` (the wall clock) only stamps the events the core publishes.
        """
        self.addr = addr
        self.now_ns = clock_ns
        self.topics = topics
        self.settings = settings
        self.policy_store = policy_store
        self.publish = publish
        self.log: Any = log if log is not None else structlog.get_logger()
        self.clock_window = ClockWindow.of_seconds(settings.clock_skew_tolerance_s)
        self.tracker = ControlTracker(
            row=addr.row,
            rack=addr.rack,
            window=self.clock_window,
            issuers=frozenset(settings.control_issuers),
            max_term_step=settings.max_term_step,
        )
        self.drops = DropLog("message_rejected", logger=self.log)
        self.infos: dict[int, GpuInfo] = {}
        self.latest: dict[int, GpuSample] = {}
        # Samples taken since the last write: only these can show that something else
        # changed a limit (older ones may predate polca's own write).
        self.fresh: dict[int, GpuSample] = {}
        self.lost: dict[int, float] = {}  # index -> loop time of the last attempt
        self.health = HealthTracker(every_s=settings.health_every_s)
        self.classes = ClassDwell(int(settings.class_dwell_s * 1e9))
        self._deferred_logged = 0  # ``classes.deferred`` at the last log line about them
        self._reports = RateGate(REPORT_EVERY_S)  # message-driven reports, by kind
        self.policy_rejections = 0  # invalid policy bundles received
        self._rejected_revision: str | None = None  # the last invalid bundle's revision
        self._observed_levels: dict[str, int] = {}  # scope -> level of its last observed
        self.engine_state = EngineState()
        self.decision: Decision | None = None
        self.last_targets: tuple[GpuTarget, ...] = ()
        self.outcome_errors: dict[int, str] = {}
        self.grace_until_mono_ns = 0
        self.remote_policy = False  # the aggregator's policy is in force
        self.clock_skewed = False
        self.seq = 0
        self.identity = messages.Identity(backend="", observe_only=False, started_ns=0)
        self.crash_loop: str | None = None  # what ended the last runs, when it is a loop
        self._last_key: tuple[object, ...] | None = None

    @property
    def runtime_classes(self) -> Mapping[str, str]:
        """The priority classes the scheduler's assignment asks for (before the dwell)."""
        return self.classes.requested

    @property
    def policy(self) -> LoadedPolicy:
        """The policy in force (the last good one)."""
        current = self.policy_store.current
        if current is None:
            msg = "no valid policy loaded"
            raise PolicyError(msg)
        return current

    def next_seq(self) -> int:
        """The sequence number of the next message this node publishes."""
        self.seq += 1
        return self.seq

    def event(self, name: str, *, gpu: int | None = None, **detail: Any) -> None:
        """Publish one event of this node (logged and skipped if it does not fit the wire)."""
        uuid = self.infos[gpu].uuid if gpu is not None and gpu in self.infos else None
        message = messages.event(self, name, gpu=gpu, uuid=uuid, detail=detail)
        if message is not None:
            self.publish(message)

    # ------------------------------------------------------------------ GPUs

    def discovered(self, infos: Sequence[GpuInfo], *, grace_until_mono_ns: int) -> None:
        """Take the node's GPUs; no caps before ``grace_until_mono_ns`` without a lease."""
        self.infos = {info.index: info for info in infos}
        self.grace_until_mono_ns = grace_until_mono_ns
        if not self.settings.control_issuers:
            self.log.warning(
                "control_issuer_unchecked",
                hint="set agent.control_issuers to the aggregator instance(s) of this row",
            )

    def sample_indices(self, now_s: float) -> list[int]:
        """The GPUs to read now: all but the lost, which are retried every 10 s."""
        return [i for i in self.infos if i not in self.lost or now_s - self.lost[i] >= LOST_RETRY_S]

    def note_samples(
        self, indices: Sequence[int], results: Sequence[GpuSample | GpuError], now_s: float
    ) -> dict[int, GpuSample]:
        """Take one round of readings; returns the good samples."""
        samples: dict[int, GpuSample] = {}
        for index, result in zip(indices, results, strict=True):
            if isinstance(result, GpuSample):
                samples[index] = result
                if index in self.lost:
                    del self.lost[index]
                    self.log.warning("gpu_recovered", gpu=index)
                    self.event("gpu_recovered", gpu=index)
            elif isinstance(result, GpuLostError):
                self.mark_lost(index, str(result), now_s)
            else:
                self.log.warning("gpu_sample_failed", gpu=index, error=str(result))
        self.latest.update(samples)
        self.fresh.update(samples)
        return samples

    def note_health(self, indices: Sequence[int], results: Sequence[GpuHealth | GpuError]) -> None:
        """Take one round of health readings; a new XID is logged and published as an event."""
        for xid in self.health.note(dict(zip(indices, results, strict=True))):
            self.log.error(
                "gpu_xid", gpu=xid.index, uuid=xid.uuid, xid=xid.last_xid, count=xid.count
            )
            self.event("gpu_xid", gpu=xid.index, xid=xid.last_xid, count=xid.count)

    def mark_lost(self, index: int, error: str, now_s: float) -> None:
        """GPU ``index`` is gone (logged and published once); retried later."""
        if index not in self.lost:
            self.log.error("gpu_lost", gpu=index, uuid=self.infos[index].uuid, error=error)
            self.event("gpu_lost", gpu=index, error=error)
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

    # ------------------------------------------------------------------ decisions

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

    def decide(self, now_mono_ns: int) -> Decision | None:
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

    def fail_safe_decision(self, now_mono_ns: int) -> Decision:
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

    def take(self, decision: Decision) -> Taken:
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
            self.event("fail_safe_entered")
        elif taken.fail_safe_left:
            self.log.info("fail_safe_left", control_level=decision.level)
            self.event("fail_safe_left", level=decision.level)
        if taken.level_changed and previous is not None:
            self.log.info("level_changed", old=previous.level, new=decision.level)
        self.last_targets = decision.targets
        return taken

    def note_outcomes(self, decision: Decision, result: ApplyResult, now_s: float) -> None:
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
                self.mark_lost(outcome.index, outcome.error or "lost", now_s)
            elif outcome.action == "failed":
                if self.outcome_errors.get(outcome.index) != outcome.error:
                    self.log.error("cap_failed", gpu=outcome.index, error=outcome.error)
                    self.event("cap_failed", gpu=outcome.index, error=outcome.error)
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
            )

    # ------------------------------------------------------------------ messages in

    def subscriptions(self) -> list[tuple[str, int]]:
        """The topics the agent reads: its row's and rack's control, its assignment, the
        row's policy (unless it manages its own)."""
        t, a = self.topics, self.addr
        subscriptions = [
            (t.row_control(a.site, a.row), 1),
            (t.rack_control(a.site, a.row, a.rack), 1),
            (t.node(a, "assign"), 1),
        ]
        if self.settings.accept_remote_policy:
            subscriptions.append((t.policy(a.site, a.row), 1))
        return subscriptions

    def receive(self, message: InMessage) -> Received:
        """Act on one received message; count and drop a bad one. Never raises.

        Each message is handled on its own: one that fails validation is counted by reason
        (``SchemaError.reason``) and dropped, and one that trips an unexpected error is
        counted as ``internal`` and logged with its traceback, so no payload, retained or
        not, can end the listener or the agent.
        """
        try:
            return self._dispatch(message)
        except SchemaError as exc:
            self.drops.drop(exc.reason, topic=message.topic, detail=str(exc))
        except Exception as exc:
            self.drops.drop("internal", exc=exc, topic=message.topic, detail=repr(exc))
        return Received()

    def _dispatch(self, message: InMessage) -> Received:
        t, a = self.topics, self.addr
        if message.topic in (t.row_control(a.site, a.row), t.rack_control(a.site, a.row, a.rack)):
            if not message.payload:  # an empty retained payload clears it: nothing to follow
                return Received()
            return self._on_control(decode(message.payload, Control), message)
        if message.topic == t.policy(a.site, a.row):
            if not message.payload:  # retained policy cleared: keep what is in force
                return Received()
            return self._on_policy_bundle(decode(message.payload, PolicyBundle), message)
        if message.topic == t.node(a, "assign"):
            if not message.payload:  # retained assignment cleared
                return self._assign({}, message)
            return self._on_assignment(decode(message.payload, Assignment), message)
        self.drops.drop("topic", topic=message.topic, detail="not a topic the agent reads")
        return Received()

    def _on_control(self, control: Control, message: InMessage) -> Received:
        now_mono = message.received_mono_ns
        before = self.tracker.current(now_mono)
        verdict = self.tracker.offer(
            control,
            received_mono_ns=now_mono,
            received_wall_ns=message.received_ns,
            retained=message.retain,
            max_lease_ns=int(self.policy.policy.fail_safe.max_lease_s * 1e9),
        )
        if verdict in REFUSED:
            self.drops.drop(
                f"control_{verdict}",
                topic=message.topic,
                detail=f"control from {control.issuer} term {control.term} seq {control.seq} "
                f"level {control.level}",
            )
            self.log.debug(
                "control_ignored",
                verdict=verdict,
                scope=control.scope,
                seq=control.seq,
                issuer=control.issuer,
                retained=message.retain,
            )
            return Received()
        # Lease renewals at an unchanged level are routine: debug only. Shadow-mode control
        # sets no lease: it is routine when its scope's last observed level was the same.
        if verdict == "observed":
            routine = self._observed_levels.get(control.scope) == control.level
            self._observed_levels[control.scope] = control.level
        else:
            routine = before is not None and before.control.level == control.level
        (self.log.debug if routine else self.log.info)(
            "control_accepted" if verdict == "accepted" else "control_observed",
            scope=control.scope,
            control_level=control.level,
            seq=control.seq,
            issuer=control.issuer,
            retained=message.retain,
        )
        return Received(wake=True, status_changed=self._check_clock_skew(now_mono))

    @property
    def skew_s(self) -> float | None:
        """This node's clock minus its controller's, from the last live control message."""
        skew_ns = self.tracker.skew_ns
        return None if skew_ns is None else round(skew_ns / 1e9, 3)

    def _check_clock_skew(self, now_mono_ns: int) -> bool:
        """Say so when this node's clock and its controller's disagree beyond the tolerance.

        The state flips at most once per ``REPORT_EVERY_S`` (the first time at once):
        stamps alternating either side of the tolerance (a clock at its edge, or a sender
        doing it on purpose) would otherwise log, publish an event and republish the
        retained status at message rate. A flip held back is judged again on the next
        control message.
        """
        skew_ns = self.tracker.skew_ns
        skewed = skew_ns is not None and self.clock_window.skewed(skew_ns, 0)
        if skewed == self.clock_skewed:
            return False
        if self._reports.admit("clock_skew", now_mono_ns / 1e9) is None:
            return False
        self.clock_skewed = skewed
        if skewed:
            self.log.warning(
                "clock_skew_detected",
                skew_s=self.skew_s,
                tolerance_s=self.settings.clock_skew_tolerance_s,
                hint="this node's clock and its controller's disagree; check NTP on both. "
                "Control is still followed: leases run on the monotonic clock.",
            )
            self.event("clock_skew_detected", skew_s=self.skew_s)
        else:
            self.log.info("clock_skew_cleared", skew_s=self.skew_s)
            self.event("clock_skew_cleared", skew_s=self.skew_s)
        return True

    def _on_policy_bundle(self, bundle: PolicyBundle, message: InMessage) -> Received:
        """Validate and apply the aggregator's policy; the shell keeps the text as a copy.

        The revision is the digest of the text, so a bundle with the revision last rejected
        is the same text: it is counted and logged at debug, not validated or published
        again. Other invalid bundles publish a ``policy_rejected`` event (and an error
        line) at most once per ``REPORT_EVERY_S``; the next one says how many were not
        published (``suppressed``).
        """
        topic = message.topic
        if revision_of(bundle.text.encode("utf-8")) != bundle.revision:
            msg = f"policy bundle revision {bundle.revision} is not the digest of its text"
            raise SchemaError(msg)
        current = self.policy_store.current
        if current is not None and current.revision == bundle.revision and self.remote_policy:
            return Received()
        if bundle.revision == self._rejected_revision:
            self.policy_rejections += 1
            self._reports.hold("policy_rejected")  # said in the next report's ``suppressed``
            self.log.debug("policy_rejected_again", trigger="mqtt", revision=bundle.revision)
            return Received()
        result = self.policy_store.replace(bundle.text, source=f"mqtt:{topic}")
        if result.errors:
            self._bundle_rejected(bundle.revision, result.errors, message.received_mono_ns)
            return Received()
        self._rejected_revision = None
        if not self.remote_policy:
            self.log.info("policy_remote_adopted", revision=bundle.revision, topic=topic)
        self.remote_policy = True
        if not result.changed:
            return Received(policy_copy=bundle.text)
        self.log.info(
            "policy_reloaded",
            trigger="mqtt",
            revision=self.policy.revision,
            policy=self.policy.policy.name,
        )
        self.event("policy_applied", revision=self.policy.revision, source="mqtt")
        return Received(wake=True, policy_copy=bundle.text, status_changed=True)

    def _bundle_rejected(self, revision: str, problems: Sequence[str], now_mono_ns: int) -> None:
        """Count one invalid policy bundle; publish it unless one was less than 10 s ago."""
        self._rejected_revision = revision
        self.policy_rejections += 1
        times = self._reports.admit("policy_rejected", now_mono_ns / 1e9)
        if times is None:
            self.log.debug("policy_rejected_suppressed", trigger="mqtt", revision=revision)
            return
        suppressed = times - 1  # held back since the last report
        self.log.error(
            "policy_rejected",
            trigger="mqtt",
            problems=list(problems),
            revision=revision,
            revision_in_force=self.policy.revision,
            suppressed=suppressed,
        )
        self.event(
            "policy_rejected",
            problems=[p[:1000] for p in problems[:20]],
            revision=revision,
            revision_in_force=self.policy.revision,
            suppressed=suppressed,
        )

    def _on_assignment(self, assignment: Assignment, message: InMessage) -> Received:
        """Check a scheduler's assignment: an unknown class refuses it whole; entries for
        GPUs this node does not have are dropped (counted once per message as
        ``unknown_gpu``) and the rest apply."""
        declared = set(self.policy.policy.classes)
        unknown = sorted(set(assignment.classes.values()) - declared)
        if unknown:
            self.drops.drop(
                "unknown_class",
                topic=message.topic,
                detail=f"unknown priority classes {unknown[:8]}; policy declares "
                f"{sorted(declared)}",
            )
            return Received()
        known = {info.uuid for info in self.infos.values()} | {str(i) for i in self.infos}
        strangers = sorted(key for key in assignment.classes if key not in known)
        if strangers:
            self.drops.drop(
                "unknown_gpu",
                topic=message.topic,
                detail=f"{len(strangers)} assignment entries name no GPU of this node "
                f"(by UUID or index), e.g. {strangers[:2]}; the others apply",
            )
        classes = {key: cls for key, cls in assignment.classes.items() if key in known}
        return self._assign(classes, message)

    def _assign(self, classes: Mapping[str, str], message: InMessage) -> Received:
        """Ask for ``classes``: each GPU's change applies at the next decision, or waits
        for its dwell; held-back changes are logged at most once per ``REPORT_EVERY_S``."""
        now = message.received_mono_ns
        self.log.debug("priority_assignment_received", classes=dict(classes))
        held = self.classes.request(classes, self.infos.values(), now)
        if held and self._reports.admit("priority_change_deferred", now / 1e9) is not None:
            self.log.info(
                "priority_change_deferred",
                gpus=held,
                deferred=self.classes.deferred - self._deferred_logged,
                total=self.classes.deferred,
                dwell_s=self.settings.class_dwell_s,
            )
            self._deferred_logged = self.classes.deferred
        return Received(wake=True)

    def policy_rejected(self, problems: Sequence[str]) -> None:
        """A local policy edit was refused: publish it (the last good one stays)."""
        self.event(
            "policy_rejected",
            problems=[p[:1000] for p in problems[:20]],
            revision_in_force=self.policy.revision,
        )

    def policy_reloaded_from_file(self) -> None:
        """A new local policy file is in force: decide again."""
        self.event("policy_applied", revision=self.policy.revision)

    def gpu_classes(self) -> Mapping[int, str]:
        """Each GPU's priority class in the decision in force."""
        return {t.index: t.priority_class for t in self.last_targets}
