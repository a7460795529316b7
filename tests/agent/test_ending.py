"""ending.py: how control starts after a run that did not restore, and how it ends.

The functions are driven directly with an actuator over simulated GPUs, a baseline, the
policy in force (or none) and a fail-safe decision made up here; the planned writes are
executed with ``execute_writes`` (what the GPU thread runs) and the results handed back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from polca.agent import ending
from polca.agent.actuator import Actuator, GpuPlan
from polca.agent.baseline import Baseline
from polca.agent.plans import LogBook, LogLine, StopPlan
from polca.errors import GpuError
from polca.gpu.backend import (
    GpuInfo,
    GpuWrite,
    LockSmClocks,
    ResetSmClocks,
    WriteResult,
    execute_writes,
)
from polca.gpu.simulated import SimulatedBackend
from polca.policy import Decision, EngineState, GpuTarget, LoadedPolicy, PolicyStore
from tests.row import policy_file

PATH = Path("/var/lib/polca/baseline.json")
FAIL_SAFE_MHZ = 1110


class Rig:
    """Two simulated GPUs, the actuator that plans their writes, and the originals."""

    def __init__(self) -> None:
        self.backend = SimulatedBackend(count=2, model="A100-SXM4", seed=1, clock=lambda: 0.0)
        self.infos: Sequence[GpuInfo] = self.backend.discover()
        self.actuator = Actuator({i.index: i for i in self.infos})
        samples = [self.backend.sample(i.index) for i in self.infos]
        self.actuator.adopt(samples)
        self.baseline = Baseline.capture(self.infos, samples, now_ns=7)
        self.log = LogBook()
        self.asked = 0  # how often the fail-safe was asked for

    def fail_safe(self) -> Decision:
        """The fail-safe decision: every GPU's clock capped at ``FAIL_SAFE_MHZ``."""
        self.asked += 1
        return decision(self.infos, FAIL_SAFE_MHZ)

    def write(self, plans: Sequence[GpuPlan]) -> list[list[WriteResult]]:
        """Execute ``plans`` on the simulated GPUs."""
        return execute_writes(self.backend, [plan.writes for plan in plans])

    def lock(self, mhz: int) -> None:
        """Lock every GPU at ``mhz`` through the actuator, as a control step would."""
        plans = self.actuator.plan(decision(self.infos, mhz).targets, baseline=None, samples={})
        self.actuator.record(plans, self.write(plans))

    def lines(self) -> list[LogLine]:
        """The log lines kept since the last call."""
        return list(self.log.take())

    def plan_stop(self, *, clean: bool, current: LoadedPolicy | None, **kw: bool) -> StopPlan:
        """``ending.plan_stop`` for this rig (GPUs, not observe-only, unless ``kw`` says)."""
        return ending.plan_stop(
            clean=clean,
            observe_only=kw.get("observe_only", False),
            has_gpus=kw.get("has_gpus", True),
            current=current,
            baseline=self.baseline if kw.get("baseline", True) else None,
            actuator=self.actuator,
            fail_safe=self.fail_safe,
        )

    def note_stop(
        self, plan: StopPlan, results: Sequence[Sequence[WriteResult]] | None
    ) -> ending.Ended:
        """``ending.note_stop`` for this rig."""
        return ending.note_stop(
            plan, results, actuator=self.actuator, log=self.log, timeout_s=5.0, baseline_path=PATH
        )


def decision(infos: Sequence[GpuInfo], mhz: int | None) -> Decision:
    """A decision capping every GPU's clock at ``mhz`` (None: no cap)."""
    targets = tuple(
        GpuTarget(i.index, i.uuid, "low", mhz, None, ("test",), None, None) for i in infos
    )
    return Decision(targets=targets, state=EngineState(), level=0, fail_safe=mhz is not None)


def policy(tmp_path: Path, on_stop: str) -> LoadedPolicy:
    """The test policy with ``on_stop``, loaded."""
    store = PolicyStore(policy_file(tmp_path, on_stop=on_stop))
    assert not store.reload().errors
    assert store.current is not None
    return store.current


def writes(plans: Sequence[GpuPlan]) -> list[GpuWrite]:
    """Every write of ``plans``, in order."""
    return [w for plan in plans for w in plan.writes]


def locked_mhz(plans: Sequence[GpuPlan]) -> list[int]:
    """The upper clock of every lock ``plans`` write, in order."""
    return [w.max_mhz for w in writes(plans) if isinstance(w, LockSmClocks)]


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("kept", [True, False])
def test_resume_keeps_the_originals_as_this_runs_and_ends_the_grace(kept: bool) -> None:
    """The baseline left behind stays the originals (this run's now: not kept), the grace
    ends at once, and the plan says whether the caps were kept on purpose."""
    rig = Rig()
    left = Baseline(rig.baseline.gpus, 123, kept=kept)
    fail_safe = rig.fail_safe()
    resumed = ending.resume(
        left, actuator=rig.actuator, fail_safe=fail_safe, grace_until_mono_ns=900, now_mono_ns=500
    )
    assert (resumed.baseline.gpus, resumed.baseline.saved_ns) == (left.gpus, 123)
    assert not resumed.baseline.kept
    assert resumed.grace_until_mono_ns == 500
    assert resumed.plan.kept is kept
    assert resumed.plan.decision is fail_safe


def test_resume_leaves_a_grace_already_over_as_it_is() -> None:
    """A grace that ended before ``now`` is not moved."""
    rig = Rig()
    resumed = ending.resume(
        rig.baseline,
        actuator=rig.actuator,
        fail_safe=rig.fail_safe(),
        grace_until_mono_ns=100,
        now_mono_ns=500,
    )
    assert resumed.grace_until_mono_ns == 100


def test_resume_rewrites_every_lock_even_one_polca_believes_is_there() -> None:
    """polca cannot read its old locks back: after a crash each lock is written again."""
    rig = Rig()
    rig.lock(FAIL_SAFE_MHZ)  # the actuator believes the fail-safe locks are in place
    resumed = ending.resume(
        rig.baseline,
        actuator=rig.actuator,
        fail_safe=rig.fail_safe(),
        grace_until_mono_ns=0,
        now_mono_ns=0,
    )
    assert [type(w) for w in writes(resumed.plan.writes)] == [LockSmClocks, LockSmClocks]
    assert locked_mhz(resumed.plan.writes) == [FAIL_SAFE_MHZ, FAIL_SAFE_MHZ]


def test_resume_with_nothing_to_write_plans_no_writes() -> None:
    """A fail-safe without targets needs no write: the plan's writes are empty."""
    rig = Rig()
    empty = Decision(targets=(), state=EngineState(), level=0, fail_safe=True)
    resumed = ending.resume(
        rig.baseline, actuator=rig.actuator, fail_safe=empty, grace_until_mono_ns=0, now_mono_ns=0
    )
    assert resumed.plan.writes == ()


def test_note_resume_records_the_writes_and_logs_their_counts() -> None:
    """What the fail-safe writes did is recorded and logged once, with the baseline path."""
    rig = Rig()
    resumed = ending.resume(
        rig.baseline,
        actuator=rig.actuator,
        fail_safe=rig.fail_safe(),
        grace_until_mono_ns=0,
        now_mono_ns=0,
    )
    results = rig.write(resumed.plan.writes)
    results[1] = [WriteResult(resumed.plan.writes[1].writes[0], GpuError("busy", index=1))]
    ending.note_resume(
        resumed.plan, results, actuator=rig.actuator, log=rig.log, baseline_path=PATH
    )
    (line,) = rig.lines()
    assert (line.level, line.event) == ("warning", "fail_safe_applied_at_start")
    assert dict(line.fields) == {
        "reason": "the previous run ended without restoring",
        "path": str(PATH),
        "applied": 1,
        "failed": 1,
        "lost": 0,
    }
    assert rig.actuator.applied[0].sm_clocks_mhz is not None
    assert rig.actuator.applied[0].sm_clocks_mhz[1] == FAIL_SAFE_MHZ


# ---------------------------------------------------------------- plan_stop


@pytest.mark.parametrize(
    ("observe_only", "has_gpus"), [(True, True), (False, False), (True, False)]
)
def test_observe_only_or_no_gpus_ends_with_nothing_to_do(
    tmp_path: Path, observe_only: bool, has_gpus: bool
) -> None:
    """Nothing was written, so nothing is saved or written at the end, clean or not."""
    rig = Rig()
    for clean in (True, False):
        plan = rig.plan_stop(
            clean=clean,
            current=policy(tmp_path, "fail_safe"),
            observe_only=observe_only,
            has_gpus=has_gpus,
        )
        assert (plan.mode, plan.save, plan.writes, plan.decision) == ("none", None, (), None)
        assert plan.reason == ("stopped" if clean else "failed")
    assert rig.asked == 0


def test_a_clean_stop_restores_under_on_stop_restore_or_without_a_policy(
    tmp_path: Path,
) -> None:
    """``on_stop: restore``, and a clean stop without a policy: every GPU back to its
    originals, nothing saved, the fail-safe never asked for."""
    rig = Rig()
    rig.lock(FAIL_SAFE_MHZ)
    for current in (policy(tmp_path, "restore"), None):
        plan = rig.plan_stop(clean=True, current=current)
        assert (plan.mode, plan.reason, plan.save) == ("restore", "stopped", None)
        assert writes(plan.writes) == [ResetSmClocks(0), ResetSmClocks(1)]
    assert rig.asked == 0


@pytest.mark.parametrize(("on_stop", "clean"), [("fail_safe", True), ("restore", False)])
def test_the_fail_safe_end_saves_the_baseline_kept_only_when_clean(
    tmp_path: Path, on_stop: str, clean: bool
) -> None:
    """``on_stop: fail_safe`` (clean) and any unclean end: the fail-safe caps planned, the
    baseline saved (kept on purpose only after a clean stop)."""
    rig = Rig()
    plan = rig.plan_stop(clean=clean, current=policy(tmp_path, on_stop))
    assert plan.mode == "fail_safe"
    assert plan.reason == ("stopped" if clean else "failed")
    assert plan.decision is not None
    assert plan.decision.fail_safe
    assert plan.save is not None
    assert (plan.save.gpus, plan.save.kept) == (rig.baseline.gpus, clean)
    assert locked_mhz(plan.writes) == [FAIL_SAFE_MHZ, FAIL_SAFE_MHZ]
    assert rig.asked == 1


def test_the_fail_safe_end_without_a_baseline_saves_nothing(tmp_path: Path) -> None:
    """No originals were captured (nothing written yet): there is nothing to save."""
    rig = Rig()
    plan = rig.plan_stop(clean=False, current=policy(tmp_path, "restore"), baseline=False)
    assert (plan.mode, plan.save) == ("fail_safe", None)


def test_an_unclean_end_without_a_policy_keeps_the_caps(tmp_path: Path) -> None:
    """No policy, so no fail-safe to apply: the caps in force stay, the baseline is kept."""
    rig = Rig()
    plan = rig.plan_stop(clean=False, current=None)
    assert (plan.mode, plan.reason, plan.writes) == ("keep", "failed", ())
    assert plan.save is not None
    assert plan.save.kept
    assert rig.asked == 0


def test_on_stop_keep_saves_the_baseline_as_kept(tmp_path: Path) -> None:
    """``on_stop: keep``: nothing written, the baseline saved as kept on purpose."""
    rig = Rig()
    plan = rig.plan_stop(clean=True, current=policy(tmp_path, "keep"))
    assert (plan.mode, plan.writes, plan.decision) == ("keep", (), None)
    assert plan.save is not None
    assert plan.save.kept
    assert rig.plan_stop(clean=True, current=policy(tmp_path, "keep"), baseline=False).save is None


# ---------------------------------------------------------------- note_stop


def test_nothing_to_do_ends_quietly() -> None:
    """Mode ``none``: the reason stays, the baseline is not removed, nothing is logged."""
    rig = Rig()
    ended = rig.note_stop(StopPlan("none", "failed", False), [])
    assert ended == ending.Ended("failed", remove_baseline=False)
    assert rig.lines() == []


def test_a_stop_past_its_bound_keeps_the_baseline_and_says_so(tmp_path: Path) -> None:
    """No results (the shell's bound ran out): an error line, the reason says so, the
    baseline stays, nothing new is in force."""
    rig = Rig()
    plan = rig.plan_stop(clean=True, current=policy(tmp_path, "fail_safe"))
    ended = rig.note_stop(plan, None)
    assert ended == ending.Ended("stopped; restore timed out", remove_baseline=False)
    (line,) = rig.lines()
    assert (line.level, line.event) == ("error", "restore_timed_out")
    assert dict(line.fields) == {"timeout_s": 5.0, "baseline": str(PATH)}


def test_a_full_restore_removes_the_baseline_and_a_partial_one_keeps_it() -> None:
    """Every GPU restored: the originals are done with; one GPU not: the file stays."""
    rig = Rig()
    rig.lock(FAIL_SAFE_MHZ)
    plan = rig.plan_stop(clean=True, current=None)
    results = rig.write(plan.writes)
    partial = [results[0], [WriteResult(plan.writes[1].writes[0], GpuError("busy", index=1))]]
    assert rig.note_stop(plan, partial) == ending.Ended("stopped", remove_baseline=False)
    assert [dict(line.fields) for line in rig.lines()] == [{"restored": 1, "failed": 1}]
    assert rig.note_stop(plan, results) == ending.Ended("stopped", remove_baseline=True)
    (line,) = rig.lines()
    assert (line.level, line.event, dict(line.fields)) == (
        "info",
        "gpu_settings_restored",
        {"restored": 2, "failed": 0},
    )


@pytest.mark.parametrize("clean", [True, False])
def test_the_fail_safe_end_puts_its_decision_in_force(tmp_path: Path, clean: bool) -> None:
    """The fail-safe writes recorded and logged (info after a clean stop, error after a
    failure), the baseline kept, and the fail-safe returned to be put in force."""
    rig = Rig()
    plan = rig.plan_stop(clean=clean, current=policy(tmp_path, "fail_safe"))
    ended = rig.note_stop(plan, rig.write(plan.writes))
    assert ended == ending.Ended(plan.reason, remove_baseline=False, in_force=plan.decision)
    (line,) = rig.lines()
    name, level = (
        ("gpu_fail_safe_on_stop", "info") if clean else ("gpu_fail_safe_on_failure", "error")
    )
    assert (line.level, line.event) == (level, name)
    assert (line.fields["applied"], line.fields["unchanged"], line.fields["failed"]) == (2, 0, 0)
    assert line.fields["caps"] == [
        {"gpu": i, "sm_clock_max_mhz": FAIL_SAFE_MHZ, "power_limit_mw": None} for i in (0, 1)
    ]
    assert {s.sm_clocks_mhz[1] for s in rig.actuator.applied.values() if s.sm_clocks_mhz} == {
        FAIL_SAFE_MHZ
    }


def test_kept_caps_are_logged_with_the_baseline_path(tmp_path: Path) -> None:
    """``keep``: one info line naming where the baseline is; nothing put in force."""
    rig = Rig()
    plan = rig.plan_stop(clean=True, current=policy(tmp_path, "keep"))
    assert rig.note_stop(plan, []) == ending.Ended("stopped", remove_baseline=False)
    (line,) = rig.lines()
    assert (line.level, line.event, dict(line.fields)) == (
        "info",
        "gpu_caps_kept",
        {"path": str(PATH)},
    )
