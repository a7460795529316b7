"""Apply the engine's per-GPU targets to the hardware, idempotently and safely.

Runs on the GPU worker thread (``ThreadedGpu.run``), so every write of a decision happens
in one hop off the event loop. For each GPU it:

- turns the clock cap into a lock ``[lowest supported, cap snapped down to a supported
  clock]``, or an unlock when there is no cap or the cap is at the hardware maximum;
- turns the power cap into a limit clamped to the GPU's constraints, or the original
  limit from the baseline when there is no cap;
- skips writes that change nothing, reads the limit back after a write, and re-asserts
  (reporting it) when something else changed a limit polca set.

Outcomes are data (``ApplyResult``): one failing GPU never stops the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from polca.agent.baseline import Baseline
from polca.errors import GpuError, GpuLostError
from polca.gpu.backend import GpuBackend, GpuInfo, GpuSample
from polca.gpu.clocks import snap_sm_clock_mhz
from polca.policy import GpuTarget

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


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """The outcome of applying one decision to every GPU."""

    outcomes: tuple[GpuOutcome, ...]

    def by_action(self, action: Action) -> list[GpuOutcome]:
        """The outcomes of one kind."""
        return [o for o in self.outcomes if o.action == action]


def desired_setting(info: GpuInfo, target: GpuTarget, baseline_limit_mw: int | None) -> Setting:
    """The clamped, snapped hardware setting for one target."""
    clocks: tuple[int, int] | None = None
    cap = target.sm_clock_max_mhz
    hw_max = info.sm_clock_max_mhz
    if cap is not None and (hw_max is None or cap < hw_max):
        supported = info.supported_sm_clocks_mhz
        high = snap_sm_clock_mhz(cap, supported) if supported else cap
        low = min(supported) if supported else high
        clocks = (min(low, high), high)
    limit = target.power_limit_mw if target.power_limit_mw is not None else baseline_limit_mw
    if limit is not None:
        if info.power_limit_min_mw is not None:
            limit = max(limit, info.power_limit_min_mw)
        if info.power_limit_max_mw is not None:
            limit = min(limit, info.power_limit_max_mw)
    return Setting(clocks, limit)


@dataclass(slots=True)
class Actuator:
    """Idempotent writer of GPU settings; call only from the GPU worker thread."""

    backend: GpuBackend
    infos: Mapping[int, GpuInfo]
    reassert: bool = True
    applied: dict[int, Setting] = field(default_factory=dict)

    def adopt(self, samples: Sequence[GpuSample]) -> None:
        """Take the GPUs' current settings as what is applied (before the first apply)."""
        for s in samples:
            self.applied.setdefault(s.index, Setting(s.locked_sm_clocks_mhz, s.power_limit_mw))

    def apply(
        self,
        targets: Sequence[GpuTarget],
        *,
        baseline: Baseline | None,
        samples: Mapping[int, GpuSample],
    ) -> ApplyResult:
        """Bring every targeted GPU to its desired setting."""
        outcomes = []
        for target in targets:
            info = self.infos[target.index]
            original = baseline.for_uuid(info.uuid) if baseline else None
            base_limit = original.power_limit_mw if original else info.power_limit_default_mw
            want = desired_setting(info, target, base_limit)
            outcomes.append(self._apply_one(info, want, samples.get(target.index)))
        return ApplyResult(tuple(outcomes))

    def pending(
        self,
        targets: Sequence[GpuTarget],
        *,
        baseline: Baseline | None,
        samples: Mapping[int, GpuSample],
    ) -> bool:
        """Whether ``apply`` would write anything (cheap; safe to call on the event loop)."""
        for target in targets:
            info = self.infos[target.index]
            original = baseline.for_uuid(info.uuid) if baseline else None
            base_limit = original.power_limit_mw if original else info.power_limit_default_mw
            want = desired_setting(info, target, base_limit)
            have = self.applied.get(target.index, Setting(None, None))
            if want.sm_clocks_mhz != have.sm_clocks_mhz:
                return True
            if want.power_limit_mw is not None and want.power_limit_mw != have.power_limit_mw:
                return True
            sample = samples.get(target.index)
            if (
                self.reassert
                and sample is not None
                and sample.power_limit_mw is not None
                and have.power_limit_mw is not None
                and sample.power_limit_mw != have.power_limit_mw
            ):
                return True
        return False

    def drifted(self, samples: Mapping[int, GpuSample]) -> bool:
        """Whether a fresh sample shows a power limit other than the one polca set."""
        if not self.reassert:
            return False
        for index, sample in samples.items():
            have = self.applied.get(index)
            if (
                have is not None
                and have.power_limit_mw is not None
                and sample.power_limit_mw is not None
                and sample.power_limit_mw != have.power_limit_mw
            ):
                return True
        return False

    def restore(self, baseline: Baseline | None, *, force_unlock: bool = False) -> ApplyResult:
        """Put back the original settings (unlock clocks, original power limits)."""
        outcomes = []
        for info in self.infos.values():
            original = baseline.for_uuid(info.uuid) if baseline else None
            limit = original.power_limit_mw if original else None
            if force_unlock:
                # After a crash polca does not know which locks it left: unlock all.
                self.applied[info.index] = Setting(
                    (0, 0), self.applied.get(info.index, Setting(None, None)).power_limit_mw
                )
            current = self.applied.get(info.index, Setting(None, None))
            want = Setting(None, limit if limit is not None else current.power_limit_mw)
            outcomes.append(self._apply_one(info, want, None, reassert=False))
        return ApplyResult(tuple(outcomes))

    def _apply_one(
        self,
        info: GpuInfo,
        want: Setting,
        sample: GpuSample | None,
        *,
        reassert: bool | None = None,
    ) -> GpuOutcome:
        index = info.index
        have = self.applied.get(index, Setting(None, None))
        changes: list[str] = []
        drifted = False
        if (
            (self.reassert if reassert is None else reassert)
            and sample is not None
            and sample.power_limit_mw is not None
            and have.power_limit_mw is not None
            and sample.power_limit_mw != have.power_limit_mw
        ):
            # Something else (an operator, another tool) changed a limit polca set.
            drifted = True
            changes.append(f"power_limit_drift:{sample.power_limit_mw}")
            have = Setting(have.sm_clocks_mhz, sample.power_limit_mw)
        try:
            if want.sm_clocks_mhz != have.sm_clocks_mhz:
                if want.sm_clocks_mhz is None:
                    self.backend.reset_sm_clocks(index)
                    changes.append("sm_clock_unlocked")
                else:
                    low, high = want.sm_clocks_mhz
                    self.backend.lock_sm_clocks_mhz(index, low, high)
                    changes.append(f"sm_clock_locked:{low}-{high}")
                have = Setting(want.sm_clocks_mhz, have.power_limit_mw)
                self.applied[index] = have
            enforced = None
            if want.power_limit_mw is not None and want.power_limit_mw != have.power_limit_mw:
                self.backend.set_power_limit_mw(index, want.power_limit_mw)
                changes.append(f"power_limit:{want.power_limit_mw}")
                have = Setting(have.sm_clocks_mhz, want.power_limit_mw)
                self.applied[index] = have
                readback = self.backend.sample(index)
                enforced = readback.enforced_power_limit_mw
                if (
                    readback.power_limit_mw is not None
                    and readback.power_limit_mw != want.power_limit_mw
                ):
                    msg = (
                        f"power limit read back as {readback.power_limit_mw} mW after "
                        f"setting {want.power_limit_mw} mW"
                    )
                    return GpuOutcome(
                        index, info.uuid, "failed", have, enforced, tuple(changes), msg
                    )
        except GpuLostError as exc:
            return GpuOutcome(index, info.uuid, "lost", have, None, tuple(changes), str(exc))
        except GpuError as exc:
            return GpuOutcome(index, info.uuid, "failed", have, None, tuple(changes), str(exc))
        except Exception as exc:
            # Not a GPU error polca knows (a binding bug?): the other GPUs still get their
            # caps, which matters most on the way out, when the fail-safe is written.
            error = f"unexpected {type(exc).__name__}: {exc}"
            return GpuOutcome(index, info.uuid, "failed", have, None, tuple(changes), error)
        self.applied[index] = have
        if not changes:
            return GpuOutcome(index, info.uuid, "unchanged", have)
        action: Action = "reasserted" if drifted else "applied"
        return GpuOutcome(index, info.uuid, action, have, enforced, tuple(changes))
