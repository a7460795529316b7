"""How control starts after a run that did not restore the GPUs, and how it ends (pure).

The rules of the two moments when the GPUs must be left safe without a controller:

- ``resume``/``note_resume``: a baseline was left behind (a crash, or a stop that kept the
  caps on purpose). It stays the originals, every clock lock is rewritten, there is no
  start-up grace, and the fail-safe caps are planned before anything else;
- ``plan_stop``/``note_stop``: an operator-asked (clean) stop follows the policy's
  ``on_stop`` (``restore`` without a policy); any other end applies the fail-safe caps
  (or keeps tighter ones in force) and keeps the baseline so the next start knows.

It changes when those rules do, not when the control step does. The functions take what
they need (the actuator, the baseline, the policy in force, the fail-safe decision, the
core's ``LogBook``) and return plans (``plans.py``) or results; the only state they touch
is the actuator's record of what polca wrote (``forget_locks``, ``record``). ``AgentCore``
(``resume``, ``note_resume``, ``plan_stop``, ``note_stop``) calls them and puts the
fail-safe decision in force (``step.py`` ``NodeControl.take``); the shell
(``runtime.py``, ``gpus.py``) saves the baseline and makes the writes. This module never
imports the core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from polca.agent.actuator import Actuator
from polca.agent.baseline import Baseline
from polca.agent.plans import LogBook, ResumePlan, StopPlan
from polca.gpu.backend import WriteResult
from polca.policy import Decision, LoadedPolicy


@dataclass(frozen=True, slots=True)
class Resumed:
    """A start after a run that did not restore: the baseline to keep (the originals, now
    this run's), the end of the start-up grace (none left), and the fail-safe to apply."""

    baseline: Baseline
    grace_until_mono_ns: int
    plan: ResumePlan


@dataclass(frozen=True, slots=True)
class Ended:
    """How control ended: the reason for the final status, whether the saved baseline is
    done with, and the decision now in force on the GPUs (the fail-safe), if it changed."""

    reason: str
    remove_baseline: bool
    in_force: Decision | None = None


def resume(
    existing: Baseline,
    *,
    actuator: Actuator,
    fail_safe: Decision,
    grace_until_mono_ns: int,
    now_mono_ns: int,
) -> Resumed:
    """A baseline was left behind (``existing``): a previous run did not restore.

    It stays the originals, every clock lock is rewritten (polca does not know which it
    left), there is no start-up grace (the GPUs stay at or under the fail-safe until a
    controller grants a lease), and ``fail_safe``'s caps are planned before anything else.
    """
    baseline = Baseline(existing.gpus, existing.saved_ns, kept=False)
    actuator.forget_locks()
    plans = actuator.plan(fail_safe.targets, baseline=baseline, samples={})
    writes = plans if actuator.pending(plans) else ()
    return Resumed(
        baseline,
        min(grace_until_mono_ns, now_mono_ns),
        ResumePlan(fail_safe, writes, kept=existing.kept),
    )


def note_resume(
    plan: ResumePlan,
    results: Sequence[Sequence[WriteResult]],
    *,
    actuator: Actuator,
    log: LogBook,
    baseline_path: Path,
) -> None:
    """What the fail-safe writes at start-up did: recorded and logged."""
    result = actuator.record(plan.writes, results)
    log.warning(
        "fail_safe_applied_at_start",
        reason="kept caps" if plan.kept else "the previous run ended without restoring",
        path=str(baseline_path),
        applied=len(result.by_action("applied")),
        failed=len(result.by_action("failed")),
        lost=len(result.by_action("lost")),
    )


def plan_stop(
    *,
    clean: bool,
    observe_only: bool,
    has_gpus: bool,
    current: LoadedPolicy | None,
    baseline: Baseline | None,
    actuator: Actuator,
    fail_safe: Callable[[], Decision],
) -> StopPlan:
    """What the end of control requires of the GPUs.

    ``clean`` is an operator-asked stop: the policy's ``on_stop`` decides (``restore``
    without a policy, ``current`` None). Any other end applies the fail-safe caps (asked
    of ``fail_safe`` only then) or keeps tighter ones in force, and keeps the baseline so
    the next start knows. Without a policy, a fail-safe end keeps the caps in force.
    Observe-only, or without GPUs, there is nothing to do.
    """
    reason = "stopped" if clean else "failed"
    if observe_only or not has_gpus:
        return StopPlan("none", reason, clean)
    on_stop = current.policy.on_stop if current else "restore"
    if not clean:
        on_stop = "fail_safe"
    if on_stop == "restore":
        return StopPlan("restore", reason, clean, writes=actuator.plan_restore(baseline))
    if on_stop == "fail_safe" and current is not None:
        decision = fail_safe()
        return StopPlan(
            "fail_safe",
            reason,
            clean,
            save=Baseline(baseline.gpus, baseline.saved_ns, kept=clean) if baseline else None,
            writes=actuator.plan(decision.targets, baseline=baseline, samples={}),
            decision=decision,
        )
    kept = Baseline(baseline.gpus, baseline.saved_ns, kept=True) if baseline else None
    return StopPlan("keep", reason, clean, save=kept)


def note_stop(
    plan: StopPlan,
    results: Sequence[Sequence[WriteResult]] | None,
    *,
    actuator: Actuator,
    log: LogBook,
    timeout_s: float,
    baseline_path: Path,
) -> Ended:
    """How control ended: ``results`` of ``plan``'s writes, None when the shell's bound
    (``timeout_s``) ran out before they were done (the baseline then stays)."""
    if plan.mode == "none":
        return Ended(plan.reason, remove_baseline=False)
    if results is None:
        log.error("restore_timed_out", timeout_s=timeout_s, baseline=str(baseline_path))
        return Ended(f"{plan.reason}; restore timed out", remove_baseline=False)
    if plan.mode == "restore":
        result = actuator.record(plan.writes, results)
        failed = result.by_action("failed")
        log.info(
            "gpu_settings_restored",
            restored=len(result.by_action("applied")),
            failed=len(failed),
        )
        # Every GPU is back: the originals are no longer needed.
        return Ended(plan.reason, remove_baseline=not failed)
    if plan.mode == "fail_safe" and plan.decision is not None:
        result = actuator.record(plan.writes, results)
        (log.info if plan.clean else log.error)(
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
        return Ended(plan.reason, remove_baseline=False, in_force=plan.decision)
    if plan.save is not None:
        log.info("gpu_caps_kept", path=str(baseline_path))
    return Ended(plan.reason, remove_baseline=False)
