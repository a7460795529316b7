"""The agent's control step, without I/O: the decision in force and the writes that carry it out.

``NodeControl`` holds what the node decides with and what it decided: the engine's state,
the decision in force and its targets, the end of the start-up grace, and why a GPU's caps
are not applied (``outcome_errors``). Once per step it puts in force the priority class
changes whose dwell has passed, runs ``policy/engine.py`` ``decide`` when anything the
decision depends on changed (the lease, the policy, the classes, the lost GPUs, the
temperatures), makes the new decision the one in force (``take``: its transitions logged
and published) and has the actuator plan the writes; with no new decision, only a limit
someone else moved is planned back. ``note`` takes what the writes did: logs and events
per GPU, a GPU lost while writing. ``fail_safe`` is the decision the end of control and a
start after a crash put in force (``ending.py``).

It changes when how the node decides changes. ``core.py`` (``AgentCore.control_step``,
``note_step``) turns a ``Step`` into the ``StepPlan`` the shell carries out and republishes
the node's state; the GPUs' readings are ``fleet.py``'s, the messages' meaning
``intake.py``'s. Part of the core (no I/O, time passed in): its log lines go to the core's
``LogBook`` and its events through the core's ``event``, so this module never imports the
core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polca.agent.actuator import Actuator, ApplyResult, GpuPlan
from polca.agent.baseline import Baseline
from polca.agent.classes import ClassDwell
from polca.agent.fleet import GpuFleet
from polca.agent.intake import MessageIntake
from polca.agent.plans import EventSink, LogBook
from polca.gpu.backend import WriteResult
from polca.policy import ControlInput, Decision, EngineState, GpuTarget, decide, tighter


@dataclass(frozen=True, slots=True)
class Taken:
    """How a decision taken differs from the one before."""

    targets_changed: bool
    fail_safe_entered: bool
    fail_safe_left: bool
    level_changed: bool


@dataclass(frozen=True, slots=True)
class Step:
    """What one control step decided: ``decision`` to carry out with ``writes`` (empty when
    nothing needs writing); ``taken``, how it differs from the one before when it was decided
    in this step (None: no new decision; ``decision`` is then the one in force, carried out
    again to put back a limit someone else moved, or None when nothing is to be done)."""

    decision: Decision | None
    writes: tuple[GpuPlan, ...]
    taken: Taken | None


class NodeControl:
    """The decision in force on one node, and how it is reached and carried out."""

    def __init__(
        self,
        *,
        fleet: GpuFleet,
        classes: ClassDwell,
        intake: MessageIntake,
        actuator: Actuator,
        observe_only: bool,
        log: LogBook,
        event: EventSink,
    ) -> None:
        """Decide for the GPUs of ``fleet`` with the control and policy ``intake`` believes
        and the classes ``classes`` puts in force; plan writes with ``actuator``. Every
        argument but ``observe_only`` is the core's (shared)."""
        self.fleet = fleet
        self.classes = classes
        self.intake = intake
        self.actuator = actuator
        self.observe_only = observe_only
        self.log = log
        self.event = event
        self.engine_state = EngineState()
        self.decision: Decision | None = None
        self.last_targets: tuple[GpuTarget, ...] = ()
        self.outcome_errors: dict[int, str] = {}
        self.grace_until_mono_ns = 0
        self._last_key: tuple[object, ...] | None = None

    def control_input(self, now_mono_ns: int) -> ControlInput | None:
        """The control in force, its lease on the monotonic clock (as ``now_mono_ns``)."""
        lease = self.intake.tracker.current(now_mono_ns)
        if lease is not None:
            source = f"{lease.control.scope}:{lease.control.issuer}#{lease.control.seq}"
            return ControlInput(lease.control.level, lease.expires_mono_ns, source=source)
        if now_mono_ns < self.grace_until_mono_ns:
            # No controller heard from yet: nominal during the start-up grace period.
            return ControlInput(0, self.grace_until_mono_ns, source="startup_grace")
        return None

    def step(self, *, now_mono_ns: int, now_ns: int, baseline: Baseline | None) -> Step:
        """Decide for now; the writes that carry the decision out (to ``baseline``'s
        originals where a target leaves a limit to them).

        A new decision is taken at once (its transitions logged and published) and its
        writes planned, unless observe-only. With no new decision, only a limit someone
        else moved (seen in a sample taken since the last write) is planned back.
        """
        decision = self._decide(now_mono_ns)
        if decision is None:
            if (
                self.observe_only
                or self.decision is None
                or not self.actuator.drifted(self.fleet.fresh)
            ):
                return Step(None, (), None)
            return Step(self.decision, self._plan_writes(self.decision, baseline), None)
        taken = self.take(decision, now_ns=now_ns)
        writes = () if self.observe_only else self._plan_writes(decision, baseline)
        return Step(decision, writes, taken)

    def note(
        self,
        decision: Decision,
        writes: Sequence[GpuPlan],
        results: Sequence[Sequence[WriteResult]],
        *,
        now_s: float,
        now_ns: int,
    ) -> ApplyResult:
        """What ``writes`` (carrying out ``decision``) did (``results``, in their order):
        recorded, then logged and published per GPU."""
        result = self.actuator.record(writes, results)
        self.fleet.fresh.clear()  # later samples are the ones that can show a drift
        self._note_outcomes(decision, result, now_s=now_s, now_ns=now_ns)
        return result

    def fail_safe(self, now_mono_ns: int) -> Decision:
        """The fail-safe caps merged with the caps in force: per dimension the tighter."""
        decision = decide(
            self.fleet.views(self.classes),
            policy=self.intake.policy.policy,
            control=None,
            state=self.engine_state,
            now_ns=now_mono_ns,
        )
        current = {t.index: t for t in self.last_targets}
        targets = tuple(
            tighter(t, current[t.index]) if t.index in current else t for t in decision.targets
        )
        return Decision(targets=targets, state=decision.state, level=0, fail_safe=True)

    def take(self, decision: Decision, *, now_ns: int) -> Taken:
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

    def _plan_writes(self, decision: Decision, baseline: Baseline | None) -> tuple[GpuPlan, ...]:
        """The writes that bring the GPUs to ``decision``'s targets; () when none is needed."""
        fleet = self.fleet
        samples = {i: s for i, s in fleet.fresh.items() if i not in fleet.lost}
        plans = self.actuator.plan(decision.targets, baseline=baseline, samples=samples)
        return plans if self.actuator.pending(plans) else ()

    def _decide(self, now_mono_ns: int) -> Decision | None:
        """The engine's decision for now; None when nothing it depends on has changed.

        First puts in force the priority class changes whose dwell has passed: the
        controller runs every sampling tick, so a deferred change is decided here once its
        dwell ends (the key holds the classes in force, not those requested).
        """
        fleet = self.fleet
        applied = self.classes.settle(fleet.infos.values(), now_mono_ns)
        if applied:
            self.log.info(
                "priority_assigned",
                classes={str(index): cls for index, cls in sorted(applied.items())},
            )
        control = self.control_input(now_mono_ns)
        policy = self.intake.policy
        temps = tuple((i, s.gpu_temp_c, s.mem_temp_c) for i, s in sorted(fleet.latest.items()))
        key = (
            control is not None and control.lease_expires_ns > now_mono_ns,  # valid or not
            policy.revision,
            None if control is None else control.level,
            self.classes.key(),
            tuple(sorted(fleet.lost)),
            temps,
        )
        if self.decision is not None and key == self._last_key:
            return None
        self._last_key = key
        return decide(
            fleet.views(self.classes),
            policy=policy.policy,
            control=control,
            state=self.engine_state,
            now_ns=now_mono_ns,
        )

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
                    policy=self.intake.policy.revision,
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
                self.fleet.mark_lost(
                    outcome.index, outcome.error or "lost", now_s=now_s, now_ns=now_ns
                )
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
                policy_revision=self.intake.policy.revision,
                gpus=changed,
                now_ns=now_ns,
            )
