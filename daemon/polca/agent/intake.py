"""What the node agent makes of the messages it receives: control, policy, assignments.

``MessageIntake`` checks each MQTT message the agent subscribes to and takes it, or
counts and drops it (``DropLog``), never raising: a row or rack control becomes a lease
(``ControlTracker``: issuer, term and order, clock skew), the aggregator's policy bundle
replaces the policy in force when it is valid, a scheduler's priority assignment is asked
of ``ClassDwell``. What a message makes the agent do elsewhere is bounded, not paced by its
sender: a GPU's priority class changes at most once per ``agent.class_dwell_s``, an
invalid policy bundle is published as an event at most once per ``REPORT_EVERY_S`` (the
same revision again only counted), and a clock skew report flips at most once per
``REPORT_EVERY_S``.

Part of the core (no I/O, time from the message's receipt stamps): ``AgentCore`` owns
one, hands it each message and turns the ``Handled`` it returns into effects. Its log
lines go to the core's ``LogBook`` and its events through the core's ``event`` (which
numbers them), so this module never imports the core.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from polca.agent.classes import ClassDwell
from polca.agent.config import AgentSettings
from polca.agent.control import REFUSED, ControlTracker
from polca.agent.plans import EventSink, LogBook
from polca.assign.model import AssignmentUpdate
from polca.errors import SchemaError
from polca.gpu.backend import GpuInfo
from polca.policy import LoadedPolicy, PolicyStore
from polca.policy.loader import revision_of
from polca.telemetry.checks import ClockWindow, DropLog, RateGate
from polca.telemetry.messages import InMessage
from polca.telemetry.schema import Assignment, Control, PolicyBundle, decode
from polca.telemetry.topics import NodeAddress, Topics

REPORT_EVERY_S = 10.0
"""At most one report (event, info log) per this many seconds of a message-driven kind."""


@dataclass(frozen=True, slots=True)
class Handled:
    """What one message's handler found: wake the controller, the text of a policy to keep
    as the local copy, whether the node's status changed."""

    wake: bool = False
    policy_copy: str | None = None
    status_changed: bool = False


class MessageIntake:
    """The node's checks on what it receives, and what it believes of it."""

    def __init__(
        self,
        *,
        addr: NodeAddress,
        topics: Topics,
        settings: AgentSettings,
        policy_store: PolicyStore,
        classes: ClassDwell,
        log: LogBook,
        event: EventSink,
    ) -> None:
        """The intake of the node at ``addr``; ``classes``, ``log`` and ``event`` are the
        core's."""
        self.addr = addr
        self.topics = topics
        self.settings = settings
        self.policy_store = policy_store
        self.classes = classes
        self.log = log
        self.event = event
        self.clock_window = ClockWindow.of_seconds(settings.clock_skew_tolerance_s)
        self.tracker = ControlTracker(
            row=addr.row,
            rack=addr.rack,
            window=self.clock_window,
            issuers=frozenset(settings.control_issuers),
            max_term_step=settings.max_term_step,
            max_term=settings.max_term,
        )
        # Drops are logged at most once per reason and 10 s of the receipt clock (no clock
        # read here: ``handle`` and ``drop_at`` set the time).
        self._now_s = 0.0
        self.last_control_mono_ns: int | None = None
        """When a live control message for this node's row or rack last arrived (accepted
        or not): whether the broker connection still carries control at all."""
        self.drops = DropLog("message_rejected", clock=lambda: self._now_s, logger=log)
        self._deferred_logged = 0  # ``classes.deferred`` at the last log line about them
        self._reports = RateGate(REPORT_EVERY_S)  # message-driven reports, by kind
        self.policy_rejections = 0  # invalid policy bundles received
        self._rejected_revision: str | None = None  # the last invalid bundle's revision
        self._observed_levels: dict[str, int] = {}  # scope -> level of its last observed
        self.remote_policy = False  # the aggregator's policy is in force
        self.clock_skewed = False

    def drop_at(self, now_mono_ns: int, reason: str, *, topic: str, detail: str) -> None:
        """Count one drop of something other than a received message (at ``now_mono_ns``)."""
        self._now_s = now_mono_ns / 1e9
        self.drops.drop(reason, topic=topic, detail=detail)

    @property
    def policy(self) -> LoadedPolicy:
        """The policy in force (the last good one; ``PolicyStore.in_force``)."""
        return self.policy_store.in_force

    def subscriptions(self) -> list[tuple[str, int]]:
        """The topics the agent reads: its row's and rack's control, its assignment, the
        row's policy (unless it manages its own)."""
        t, a = self.topics, self.addr
        subscriptions = [
            (t.row_control(a.site, a.row), 1),
            (t.rack_control(a.site, a.row, a.rack), 1),
        ]
        if self.classes.source == "mqtt":  # other sources are not MQTT messages
            subscriptions.append((t.node(a, "assign"), 1))
        if self.settings.accept_remote_policy:
            subscriptions.append((t.policy(a.site, a.row), 1))
        return subscriptions

    def handle(self, message: InMessage, infos: Mapping[int, GpuInfo]) -> Handled:
        """Act on one received message for a node with GPUs ``infos``; count and drop a
        bad one. Never raises.

        Each message is handled on its own: one that fails validation is counted by reason
        (``SchemaError.reason``) and dropped, and one that trips an unexpected error is
        counted as ``internal`` and logged with its traceback, so no payload, retained or
        not, can end the listener or the agent.
        """
        self._now_s = message.received_mono_ns / 1e9
        try:
            return self._dispatch(message, infos)
        except SchemaError as exc:
            self.drops.drop(exc.reason, topic=message.topic, detail=str(exc))
        except Exception as exc:
            self.drops.drop("internal", exc=exc, topic=message.topic, detail=repr(exc))
        return Handled()

    def _dispatch(self, message: InMessage, infos: Mapping[int, GpuInfo]) -> Handled:
        t, a = self.topics, self.addr
        if message.topic in (t.row_control(a.site, a.row), t.rack_control(a.site, a.row, a.rack)):
            if not message.retain:
                self.last_control_mono_ns = message.received_mono_ns
            if not message.payload:  # an empty retained payload clears it: nothing to follow
                return Handled()
            return self._on_control(decode(message.payload, Control), message)
        if message.topic == t.policy(a.site, a.row):
            if not message.payload:  # retained policy cleared: keep what is in force
                return Handled()
            return self._on_policy_bundle(decode(message.payload, PolicyBundle), message)
        if message.topic == t.node(a, "assign") and self.classes.source == "mqtt":
            if not message.payload:  # retained assignment cleared
                update = AssignmentUpdate(source="mqtt", classes={})
                return self.take_update(update, infos, now_mono_ns=message.received_mono_ns)
            return self._on_assignment(decode(message.payload, Assignment), message, infos)
        self.drops.drop("topic", topic=message.topic, detail="not a topic the agent reads")
        return Handled()

    def _on_control(self, control: Control, message: InMessage) -> Handled:
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
            return Handled()
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
        skew_flipped = self._check_clock_skew(now_mono, now_ns=message.received_ns)
        return Handled(wake=True, status_changed=skew_flipped)

    @property
    def skew_s(self) -> float | None:
        """This node's clock minus its controller's, from the last live control message."""
        skew_ns = self.tracker.skew_ns
        return None if skew_ns is None else round(skew_ns / 1e9, 3)

    def _check_clock_skew(self, now_mono_ns: int, *, now_ns: int) -> bool:
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
            self.event("clock_skew_detected", skew_s=self.skew_s, now_ns=now_ns)
        else:
            self.log.info("clock_skew_cleared", skew_s=self.skew_s)
            self.event("clock_skew_cleared", skew_s=self.skew_s, now_ns=now_ns)
        return True

    def _on_policy_bundle(self, bundle: PolicyBundle, message: InMessage) -> Handled:
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
            return Handled()
        if bundle.revision == self._rejected_revision:
            self.policy_rejections += 1
            self._reports.hold("policy_rejected")  # said in the next report's ``suppressed``
            self.log.debug("policy_rejected_again", trigger="mqtt", revision=bundle.revision)
            return Handled()
        result = self.policy_store.replace(bundle.text, source=f"mqtt:{topic}")
        if result.errors:
            self._bundle_rejected(
                bundle.revision,
                result.errors,
                now_mono_ns=message.received_mono_ns,
                now_ns=message.received_ns,
            )
            return Handled()
        self._rejected_revision = None
        if not self.remote_policy:
            self.log.info("policy_remote_adopted", revision=bundle.revision, topic=topic)
        self.remote_policy = True
        if not result.changed:
            return Handled(policy_copy=bundle.text)
        self.log.info(
            "policy_reloaded",
            trigger="mqtt",
            revision=self.policy.revision,
            policy=self.policy.policy.name,
        )
        self.event(
            "policy_applied",
            revision=self.policy.revision,
            source="mqtt",
            now_ns=message.received_ns,
        )
        return Handled(wake=True, policy_copy=bundle.text, status_changed=True)

    def _bundle_rejected(
        self, revision: str, problems: Sequence[str], *, now_mono_ns: int, now_ns: int
    ) -> None:
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
            now_ns=now_ns,
        )

    def _on_assignment(
        self, assignment: Assignment, message: InMessage, infos: Mapping[int, GpuInfo]
    ) -> Handled:
        """A scheduler's assignment, through the one path every source takes."""
        update = AssignmentUpdate(
            source="mqtt",
            classes=assignment.classes,
            origins=dict.fromkeys(assignment.classes, "mqtt"),
        )
        return self.take_update(
            update, infos, now_mono_ns=message.received_mono_ns, topic=message.topic
        )

    def take_update(
        self,
        update: AssignmentUpdate,
        infos: Mapping[int, GpuInfo],
        *,
        now_mono_ns: int,
        topic: str = "",
    ) -> Handled:
        """Take one source's assignment: an unknown class refuses it whole; entries for
        GPUs this node does not have are dropped (counted once per update as
        ``unknown_gpu``) and the rest are asked of ``ClassDwell``: each GPU's change
        applies at the next decision, or waits for its dwell; held-back changes are logged
        at most once per ``REPORT_EVERY_S``. A change of the source's health changes the
        node's status."""
        self._now_s = now_mono_ns / 1e9
        topic = topic or f"assignment/{update.source}"
        declared = set(self.policy.policy.classes)
        unknown = sorted(set(update.classes.values()) - declared)
        if unknown:
            self.drops.drop(
                "unknown_class",
                topic=topic,
                detail=f"unknown priority classes {unknown[:8]}; policy declares "
                f"{sorted(declared)}",
            )
            return Handled()
        known = {info.uuid for info in infos.values()} | {str(i) for i in infos}
        strangers = sorted(key for key in update.classes if key not in known)
        if strangers:
            self.drops.drop(
                "unknown_gpu",
                topic=topic,
                detail=f"{len(strangers)} assignment entries name no GPU of this node "
                f"(by UUID or index), e.g. {strangers[:2]}; the others apply",
            )
        classes = {key: cls for key, cls in update.classes.items() if key in known}
        book = self.classes
        health_changed = (book.healthy, book.reason) != (update.healthy, update.reason)
        if health_changed:
            (self.log.info if update.healthy else self.log.warning)(
                "assignment_source_healthy" if update.healthy else "assignment_source_failed",
                source=update.source,
                reason=update.reason,
            )
        book.healthy, book.reason = update.healthy, update.reason
        book.origins = {k: v for k, v in update.origins.items() if k in classes}
        book.workloads = {k: v for k, v in update.workloads.items() if k in classes}
        self.log.debug("priority_assignment_received", classes=dict(classes), source=update.source)
        held = book.request(classes, infos.values(), now_mono_ns)
        if held and self._reports.admit("priority_change_deferred", now_mono_ns / 1e9) is not None:
            self.log.info(
                "priority_change_deferred",
                gpus=held,
                deferred=book.deferred - self._deferred_logged,
                total=book.deferred,
                dwell_s=self.settings.class_dwell_s,
            )
            self._deferred_logged = book.deferred
        return Handled(wake=True, status_changed=health_changed)
