"""Turn the engine's per-GPU targets into GPU writes, and their results into outcomes.

Pure and on the event loop: ``plan`` compares what each GPU should have with what polca
applied (and what a fresh sample shows) and returns the writes that close the gap, as
data (``polca.gpu.backend.GpuWrite``); the core (``core.py``) plans through it, the shell
(``gpus.py`` ``NodeGpus.write``) hands the writes to ``ThreadedGpu.write``, which runs
them on the GPU thread, and ``record`` takes the results back (through the core) and
updates ``applied``. So the applied state is only ever touched on the loop, and a new
kind of action is one more write kind. For each GPU:

- the clock cap becomes a lock ``[lowest supported, cap snapped down to a supported
  clock]``, or an unlock when there is no cap or the cap is at the hardware maximum;
- the power cap becomes a limit clamped to the GPU's constraints (``policy.engine.within``,
  the engine's own clamp), or the original limit from the baseline when there is no cap;
- writes that change nothing are skipped; a limit is read back after it is set, and a
  limit someone else changed is re-asserted (reported as such).

Outcomes are data (``ApplyResult``): one failing GPU never stops the others. This is the
actuator shape of ``actuation.py``: the desired ``Setting``, the writes, the read-back
(``read_back_ok``), the retry (a failed GPU keeps its known setting, so the next step
writes again) and the outcome (``GpuOutcome``, an ``actuation.Outcome``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from polca.actuation import error_text, read_back_ok
from polca.agent.baseline import Baseline
from polca.errors import GpuLostError
from polca.gpu.backend import (
    GpuInfo,
    GpuSample,
    GpuWrite,
    LockSmClocks,
    ResetSmClocks,
    SetPowerLimit,
    WriteResult,
)
from polca.gpu.clocks import snap_sm_clock_mhz
from polca.policy import GpuTarget, within

Action = Literal["applied", "unchanged", "reasserted", "failed", "lost"]


@dataclass(frozen=True, slots=True)
class Setting:
    """What polca has on one GPU: a clock lock (min, max) or None, and a power limit."""

    sm_clocks_mhz: tuple[int, int] | None
    power_limit_mw: int | None


@dataclass(frozen=True, slots=True)
class GpuOutcome:
    """What happened to one GPU in one apply."""

    index: int
    uuid: str
    action: Action
    setting: Setting
    enforced_power_limit_mw: int | None = None
    changes: tuple[str, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The GPU's setting is in force (``actuation.Outcome``)."""
        return self.action in ("applied", "unchanged", "reasserted")


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """The outcome of applying one decision to every GPU."""

    outcomes: tuple[GpuOutcome, ...]

    def by_action(self, action: Action) -> list[GpuOutcome]:
        """The outcomes of one kind."""
        return [o for o in self.outcomes if o.action == action]


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """What one GPU needs: its writes, in order, and what they start from."""

    index: int
    uuid: str
    want: Setting
    have: Setting  # what polca applied, corrected by a drifted sample
    writes: tuple[GpuWrite, ...]
    drift_mw: int | None = None  # a power limit someone else set, found in a fresh sample


def desired_setting(info: GpuInfo, target: GpuTarget, baseline_limit_mw: int | None) -> Setting:
    """The clamped, snapped hardware setting for one target."""
    clocks: tuple[int, int] | None = None
    cap = target.sm_clock_max_mhz
    hw_max = info.sm_clock_max_mhz
    limit = target.power_limit_mw if target.power_limit_mw is not None else baseline_limit_mw
    if cap is not None and (hw_max is None or cap < hw_max):
        if info.capabilities.sm_clock_lock:
            supported = info.supported_sm_clocks_mhz
            high = snap_sm_clock_mhz(cap, supported) if supported else cap
            low = min(supported) if supported else high
            clocks = (min(low, high), high)
        elif hw_max and info.power_limit_max_mw:
            # No clock locks on this GPU (MIG mode refuses them): the same fraction of its
            # highest power limit instead, never above a power cap the target also sets.
            as_power_mw = int(info.power_limit_max_mw * cap / hw_max)
            limit = as_power_mw if limit is None else min(limit, as_power_mw)
    if limit is not None:
        limit = within(limit, info.power_limit_min_mw, info.power_limit_max_mw)
    return Setting(clocks, limit)


def _writes(
    index: int, want: Setting, have: Setting, *, can_lock: bool = True
) -> tuple[GpuWrite, ...]:
    """The writes from ``have`` to ``want``; none of clocks on a GPU that refuses locks
    (a refused write would stop the GPU's batch before its power limit)."""
    writes: list[GpuWrite] = []
    if can_lock and want.sm_clocks_mhz != have.sm_clocks_mhz:
        if want.sm_clocks_mhz is None:
            writes.append(ResetSmClocks(index))
        else:
            writes.append(LockSmClocks(index, *want.sm_clocks_mhz))
    if want.power_limit_mw is not None and want.power_limit_mw != have.power_limit_mw:
        writes.append(SetPowerLimit(index, want.power_limit_mw))
    return tuple(writes)


@dataclass(slots=True)
class Actuator:
    """Idempotent planner of GPU settings and keeper of what is applied; event loop only."""

    infos: Mapping[int, GpuInfo]
    reassert: bool = True
    applied: dict[int, Setting] = field(default_factory=dict)

    def adopt(self, samples: Sequence[GpuSample]) -> None:
        """Take the GPUs' current settings as what is applied (before the first apply)."""
        for s in samples:
            self.applied.setdefault(s.index, Setting(s.locked_sm_clocks_mhz, s.power_limit_mw))

    def forget_locks(self) -> None:
        """Assume an unknown clock lock on every GPU, so the next plan writes the lock.

        After a crash polca does not know which locks it left (NVML cannot read them back).
        """
        for index, setting in list(self.applied.items()):
            self.applied[index] = Setting((0, 0), setting.power_limit_mw)

    def plan(
        self,
        targets: Sequence[GpuTarget],
        *,
        baseline: Baseline | None,
        samples: Mapping[int, GpuSample],
    ) -> tuple[GpuPlan, ...]:
        """Every targeted GPU's writes (possibly none) to reach its desired setting."""
        plans = []
        for target in targets:
            info = self.infos[target.index]
            original = baseline.for_uuid(info.uuid) if baseline else None
            base_limit = original.power_limit_mw if original else info.power_limit_default_mw
            want = desired_setting(info, target, base_limit)
            plans.append(self._plan_one(info, want, samples.get(target.index), self.reassert))
        return tuple(plans)

    def plan_restore(self, baseline: Baseline | None) -> tuple[GpuPlan, ...]:
        """Every GPU back to its original settings: clocks unlocked, original limits."""
        plans = []
        for info in self.infos.values():
            original = baseline.for_uuid(info.uuid) if baseline else None
            limit = original.power_limit_mw if original else None
            current = self.applied.get(info.index, Setting(None, None))
            want = Setting(None, limit if limit is not None else current.power_limit_mw)
            plans.append(self._plan_one(info, want, None, reassert=False))
        return tuple(plans)

    def pending(self, plans: Sequence[GpuPlan]) -> bool:
        """Whether any plan writes something."""
        return any(plan.writes for plan in plans)

    def drifted(self, samples: Mapping[int, GpuSample]) -> bool:
        """Whether a fresh sample shows a power limit other than the one polca set."""
        if not self.reassert:
            return False
        return any(
            _drift(self.applied.get(index), sample) is not None for index, sample in samples.items()
        )

    def _plan_one(
        self, info: GpuInfo, want: Setting, sample: GpuSample | None, reassert: bool
    ) -> GpuPlan:
        have = self.applied.get(info.index, Setting(None, None))
        drift = _drift(have, sample) if reassert else None
        if drift is not None:
            # Something else (an operator, another tool) changed a limit polca set.
            have = Setting(have.sm_clocks_mhz, drift)
        can_lock = info.capabilities.sm_clock_lock
        writes = _writes(info.index, want, have, can_lock=can_lock)
        return GpuPlan(info.index, info.uuid, want, have, writes, drift)

    def record(
        self, plans: Sequence[GpuPlan], results: Sequence[Sequence[WriteResult]]
    ) -> ApplyResult:
        """Take the write results of ``plans`` (same order) and update ``applied``."""
        return ApplyResult(
            tuple(self._record_one(p, r) for p, r in zip(plans, results, strict=True))
        )

    def _record_one(self, plan: GpuPlan, results: Sequence[WriteResult]) -> GpuOutcome:
        have = plan.have
        changes = [f"power_limit_drift:{plan.drift_mw}"] if plan.drift_mw is not None else []
        enforced: int | None = None
        for result in results:
            write = result.write
            if result.error is not None:
                self.applied[plan.index] = have
                exc = result.error
                action: Action = "lost" if isinstance(exc, GpuLostError) else "failed"
                error = error_text(exc)
                return GpuOutcome(plan.index, plan.uuid, action, have, None, tuple(changes), error)
            if isinstance(write, ResetSmClocks):
                have = Setting(None, have.power_limit_mw)
                changes.append("sm_clock_unlocked")
            elif isinstance(write, LockSmClocks):
                have = Setting((write.min_mhz, write.max_mhz), have.power_limit_mw)
                changes.append(f"sm_clock_locked:{write.min_mhz}-{write.max_mhz}")
            else:
                have = Setting(have.sm_clocks_mhz, write.limit_mw)
                changes.append(f"power_limit:{write.limit_mw}")
                readback = result.readback
                enforced = readback.enforced_power_limit_mw if readback else None
                if (
                    readback is not None
                    and readback.power_limit_mw is not None
                    and not read_back_ok(write.limit_mw, readback.power_limit_mw)
                ):
                    self.applied[plan.index] = have
                    msg = (
                        f"power limit read back as {readback.power_limit_mw} mW after "
                        f"setting {write.limit_mw} mW"
                    )
                    return GpuOutcome(
                        plan.index, plan.uuid, "failed", have, enforced, tuple(changes), msg
                    )
        self.applied[plan.index] = have
        if not changes:
            return GpuOutcome(plan.index, plan.uuid, "unchanged", have)
        action = "reasserted" if plan.drift_mw is not None else "applied"
        return GpuOutcome(plan.index, plan.uuid, action, have, enforced, tuple(changes))


def _drift(have: Setting | None, sample: GpuSample | None) -> int | None:
    """The sample's power limit when it differs from the one polca set, else None."""
    if (
        have is not None
        and sample is not None
        and sample.power_limit_mw is not None
        and have.power_limit_mw is not None
        and sample.power_limit_mw != have.power_limit_mw
    ):
        return sample.power_limit_mw
    return None
