"""The agent's hold on its GPUs: reads and writes through the seam, the baseline, the end.

``NodeGpus`` is shell, not decision: it owns the ``ThreadedGpu`` (every NVML call on the
GPU thread), the ``Actuator`` (plans writes on the event loop and records their results)
and the baseline file. It opens the GPUs, applies what the core decides, and carries out
the two moments where control ends or resumes without a controller:

- ``resume_after_unclean_end``: a baseline left behind (a crash, a kill, a stop that kept
  caps) stays the originals, and the fail-safe caps go on before anything else;
- ``stop``: a clean stop does what ``on_stop`` says (``restore`` the originals, ``keep``
  the caps, or ``fail_safe``); any other end applies the fail-safe caps or keeps tighter
  ones, and keeps the baseline so the next start knows.

What it must not do: decide caps (``core.py`` and the policy engine do) or talk MQTT.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polca.agent.actuator import Actuator, ApplyResult, GpuPlan
from polca.agent.baseline import Baseline, BaselineStore
from polca.agent.core import AgentCore
from polca.gpu.backend import GpuInfo, GpuSample
from polca.gpu.threaded import ThreadedGpu
from polca.policy import Decision, GpuTarget


class NodeGpus:
    """The GPUs of one node, as the agent's shell drives them."""

    def __init__(
        self, gpu: ThreadedGpu, *, state_dir: Path, reassert: bool, observe_only: bool, log: Any
    ) -> None:
        """Drive ``gpu``; the baseline lives in ``state_dir``. No I/O until ``open()``."""
        self.gpu = gpu
        self.observe_only = observe_only
        self.log = log
        self.actuator = Actuator({}, reassert=reassert)
        self.baseline: Baseline | None = None
        self.baseline_store = BaselineStore(state_dir)

    async def open(self) -> tuple[list[GpuInfo], list[int]]:
        """Start the GPU thread, discover the GPUs, check write access; their indices."""
        await self.gpu.start()
        infos = list(await self.gpu.discover())
        for info in infos:
            self.log.info(
                "gpu_discovered",
                gpu=info.index,
                uuid=info.uuid,
                name=info.name,
                sm_clock_max_mhz=info.sm_clock_max_mhz,
                power_limit_default_mw=info.power_limit_default_mw,
            )
        self.actuator.infos = {info.index: info for info in infos}
        if not self.observe_only:
            await self.gpu.check_write_access()
        return infos, [info.index for info in infos]

    async def close(self, timeout_s: float) -> None:
        """Stop the GPU thread and close the backend, bounded."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.gpu.aclose()
        except TimeoutError:
            self.log.error("gpu_close_timed_out")

    def adopt(self, samples: Sequence[GpuSample]) -> None:
        """Take what the GPUs hold now as what is applied (before the first write)."""
        self.actuator.adopt(samples)

    def save_baseline(self, infos: Sequence[GpuInfo], samples: Sequence[GpuSample]) -> None:
        """Save the original settings before the first write (kept if one was found)."""
        if self.baseline is None:
            self.baseline = Baseline.capture(infos, samples)
        self.baseline_store.save(self.baseline)

    async def execute(self, plans: Sequence[GpuPlan]) -> ApplyResult:
        """Write ``plans`` through the seam (one hop to the GPU thread) and record them."""
        results = await self.gpu.write([plan.writes for plan in plans])
        return self.actuator.record(plans, results)

    async def apply(
        self, targets: Sequence[GpuTarget], samples: Mapping[int, GpuSample]
    ) -> ApplyResult | None:
        """Bring the GPUs to ``targets``; None when nothing needed writing."""
        plans = self.actuator.plan(targets, baseline=self.baseline, samples=samples)
        if not self.actuator.pending(plans):
            return None
        return await self.execute(plans)

    async def control_step(
        self, core: AgentCore, now_mono_ns: int, now_s: float
    ) -> tuple[ApplyResult | None, bool]:
        """Decide now and apply what changed: the outcome, and whether the state changed.

        When nothing the decision depends on changed, only a limit someone else moved
        (seen in a sample taken since the last write) is re-asserted.
        """
        decision = core.decide(now_mono_ns)
        if decision is None:
            if self.observe_only or core.decision is None or not self.actuator.drifted(core.fresh):
                return None, False
            return await self._actuate(core, core.decision, now_s), False
        taken = core.take(decision)
        result = None if self.observe_only else await self._actuate(core, decision, now_s)
        return result, taken.targets_changed or (result is not None and _wrote(result))

    async def _actuate(
        self, core: AgentCore, decision: Decision, now_s: float
    ) -> ApplyResult | None:
        samples = {i: s for i, s in core.fresh.items() if i not in core.lost}
        result = await self.apply(decision.targets, samples)
        if result is not None:
            core.fresh.clear()  # later samples are the ones that can show a drift
            core.note_outcomes(decision, result, now_s)
        return result

    async def resume_after_unclean_end(self, core: AgentCore, now_mono_ns: int) -> bool:
        """Apply the fail-safe caps first when a previous run did not restore the GPUs.

        Returns whether it did (then there is no start-up grace: the GPUs stay at or under
        the fail-safe until a controller grants a lease).
        """
        existing = self.baseline_store.load()
        if existing is None:
            return False
        self.baseline = Baseline(existing.gpus, existing.saved_ns, kept=False)
        # After an unclean end polca does not know which clock locks it left: relock all.
        self.actuator.forget_locks()
        decision = core.fail_safe_decision(now_mono_ns)
        result = await self.apply(decision.targets, {})
        core.take(decision)
        self.log.warning(
            "fail_safe_applied_at_start",
            reason="kept caps" if existing.kept else "the previous run ended without restoring",
            path=str(self.baseline_store.path),
            applied=len(result.by_action("applied")) if result else 0,
            failed=len(result.by_action("failed")) if result else 0,
            lost=len(result.by_action("lost")) if result else 0,
        )
        return True

    async def stop(
        self, core: AgentCore, *, clean: bool, now_mono_ns: int, timeout_s: float
    ) -> str:
        """Leave the GPUs as the end of control requires; the reason for the final status.

        ``clean`` is an operator-asked stop: ``on_stop`` decides. Anything else leaves the
        fail-safe caps or the caps in force, whichever is tighter.
        """
        reason = "stopped" if clean else "failed"
        if self.observe_only or not self.actuator.infos:
            return reason
        current = core.policy_store.current
        on_stop = current.policy.on_stop if current else "restore"
        if not clean:
            on_stop = "fail_safe"
        try:
            async with asyncio.timeout(timeout_s):
                if on_stop == "restore":
                    await self._restore()
                elif on_stop == "fail_safe" and current is not None:
                    await self._fail_safe(core, clean=clean, now_mono_ns=now_mono_ns)
                elif self.baseline is not None:
                    kept = Baseline(self.baseline.gpus, self.baseline.saved_ns, kept=True)
                    self.baseline_store.save(kept)
                    self.log.info("gpu_caps_kept", path=str(self.baseline_store.path))
        except TimeoutError:
            self.log.error(
                "restore_timed_out", timeout_s=timeout_s, baseline=str(self.baseline_store.path)
            )
            reason = f"{reason}; restore timed out"
        return reason

    async def _restore(self) -> None:
        result = await self.execute(self.actuator.plan_restore(self.baseline))
        failed = result.by_action("failed")
        if not failed:
            self.baseline_store.remove()
        self.log.info(
            "gpu_settings_restored", restored=len(result.by_action("applied")), failed=len(failed)
        )

    async def _fail_safe(self, core: AgentCore, *, clean: bool, now_mono_ns: int) -> None:
        """Apply the fail-safe caps (or keep tighter ones) and keep the baseline."""
        if self.baseline is not None:
            kept = Baseline(self.baseline.gpus, self.baseline.saved_ns, kept=clean)
            self.baseline_store.save(kept)
        decision: Decision = core.fail_safe_decision(now_mono_ns)
        result = await self.execute(
            self.actuator.plan(decision.targets, baseline=self.baseline, samples={})
        )
        (self.log.info if clean else self.log.error)(
            "gpu_fail_safe_on_stop" if clean else "gpu_fail_safe_on_failure",
            applied=len(result.by_action("applied")),
            unchanged=len(result.by_action("unchanged")),
            failed=len(result.by_action("failed")),
            caps=[
                {
                    "gpu": t.index,
                    "sm_clock_max_mhz": t.sm_clock_max_mhz,
                    "power_limit_mw": t.power_limit_mw,
                }
                for t in decision.targets
            ],
        )
        core.take(decision)


def _wrote(result: ApplyResult) -> bool:
    return any(o.action != "unchanged" for o in result.outcomes)
