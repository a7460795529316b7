"""The agent's hands on its GPUs: reads and writes through the seam, and the baseline file.

``NodeGpus`` is shell, not decision: it owns the ``ThreadedGpu`` (every NVML call on the
GPU thread) and the baseline file (``BaselineStore``). It opens the GPUs, reads them,
executes the writes of the plans the core makes (``plans.py``) and hands the results back
as data; the runtime feeds them to the core. Where a plan asks for it, it saves or removes
the baseline file, and it bounds the end of control in time (``carry_out_stop``).

What it must not do: decide caps or which writes to make (``core.py``, the actuator and
the policy engine do), pick how control ends (``AgentCore.plan_stop``), or talk MQTT.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polca.agent.actuator import GpuPlan
from polca.agent.baseline import Baseline, BaselineStore
from polca.agent.plans import StopPlan
from polca.errors import GpuError
from polca.gpu.backend import GpuHealth, GpuInfo, GpuSample, WriteResult
from polca.gpu.threaded import ThreadedGpu


class NodeGpus:
    """The GPUs of one node, as the agent's shell drives them."""

    def __init__(self, gpu: ThreadedGpu, *, state_dir: Path, observe_only: bool, log: Any) -> None:
        """Drive ``gpu``; the baseline lives in ``state_dir``. No I/O until ``open()``."""
        self.gpu = gpu
        self.observe_only = observe_only
        self.log = log
        self.baseline_store = BaselineStore(state_dir)

    async def open(self) -> list[GpuInfo]:
        """Start the GPU thread, discover the GPUs, check write access (unless observe-only)."""
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
        if not self.observe_only:
            await self.gpu.check_write_access()
        return infos

    async def close(self, timeout_s: float) -> None:
        """Stop the GPU thread and close the backend, bounded."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.gpu.aclose()
        except TimeoutError:
            self.log.error("gpu_close_timed_out")

    async def sample(self, indices: Sequence[int]) -> list[GpuSample | GpuError]:
        """Read GPUs ``indices`` (one hop to the GPU thread); a failed GPU gives its error."""
        return await self.gpu.sample_all(indices)

    async def read_health(self, indices: Sequence[int]) -> list[GpuHealth | GpuError]:
        """Read the health counters of GPUs ``indices`` (one hop to the GPU thread)."""
        return await self.gpu.health_all(indices)

    async def write(self, plans: Sequence[GpuPlan]) -> list[list[WriteResult]]:
        """Execute ``plans``' writes through the seam (one hop); the results, same order."""
        return await self.gpu.write([plan.writes for plan in plans])

    # ------------------------------------------------------------------ the baseline file

    def load_baseline(self) -> Baseline | None:
        """The original settings a previous run left behind, if any."""
        return self.baseline_store.load()

    def save_baseline(self, baseline: Baseline) -> None:
        """Save the original settings (before the first write)."""
        self.baseline_store.save(baseline)

    def remove_baseline(self) -> None:
        """The originals are restored: the file is done with."""
        self.baseline_store.remove()

    async def carry_out_stop(
        self, plan: StopPlan, *, timeout_s: float
    ) -> list[list[WriteResult]] | None:
        """Save the baseline ``plan`` asks for, then make its writes, within ``timeout_s``.

        The results of the writes; None when the bound ran out first (the calls finish on
        the GPU thread, unrecorded).
        """
        try:
            async with asyncio.timeout(timeout_s):
                if plan.save is not None:
                    self.baseline_store.save(plan.save)
                return await self.write(plan.writes)
        except TimeoutError:
            return None
