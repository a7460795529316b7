"""The agent's hands on its GPUs: carry out what the core plans for them, feed back results.

Four moments touch the GPUs, each the same round trip (ask the core, make the reads or
writes through ``gpus.py``, give the core the results, emit the effects it returns):

- ``take_over``: start-up after discovery; the first reading, the policy copy, and, when a
  previous run left a baseline behind, the fail-safe caps before anything else
  (``ending.py``'s rules), then the baseline saved before the first control write;
- ``sample``: one sampling tick's read of the GPUs the core asks for;
- ``step``: one control step's writes;
- ``leave``: the end of control (``on_stop`` after a clean stop, else the fail-safe).

No decision is made here (the core makes them all) and nothing but the GPUs and the
baseline file is touched; the effects go to the shell's ``carry_out``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from polca.agent import policy_copy
from polca.agent.actuator import ApplyResult
from polca.agent.config import AgentSettings
from polca.agent.core import AgentCore
from polca.agent.gpus import NodeGpus
from polca.agent.plans import Effects
from polca.gpu.backend import GpuSample
from polca.policy import PolicyStore


class GpuDriver:
    """One node's GPU round trips between ``core`` and ``gpus``."""

    def __init__(
        self,
        core: AgentCore,
        gpus: NodeGpus,
        *,
        carry_out: Callable[[Effects], None],
        clock_ns: Callable[[], int],
        mono_ns: Callable[[], int],
    ) -> None:
        self.core = core
        self.gpus = gpus
        self.carry_out = carry_out
        self.clock_ns = clock_ns  # wall clock: stamps only
        self.mono_ns = mono_ns  # every duration

    async def take_over(
        self,
        settings: AgentSettings,
        *,
        policy_store: PolicyStore,
        started_mono_ns: int,
        log: Any,
    ) -> None:
        """Open the GPUs and take them over (the package's start-up order)."""
        infos = await self.gpus.open()
        grace_ns = int(settings.startup_grace_s * 1e9)
        self.carry_out(self.core.discovered(infos, grace_until_mono_ns=started_mono_ns + grace_ns))
        samples = list((await self.sample()).values())
        self.core.adopt(samples)
        self.core.remote_policy = policy_copy.load_at_start(policy_store, settings, log)
        if settings.observe_only:
            return
        # Before anything else: a run that did not restore leaves at least fail-safe caps.
        existing = self.gpus.load_baseline()
        if existing is not None:
            plan = self.core.resume(existing, now_mono_ns=self.mono_ns())
            results = await self.gpus.write(plan.writes)
            self.carry_out(self.core.note_resume(plan, results, now_ns=self.clock_ns()))
        self.gpus.save_baseline(self.core.capture_baseline(samples, now_ns=self.clock_ns()))

    async def sample(self) -> Mapping[int, GpuSample]:
        """Read the GPUs the core asks for now; the samples read, by index."""
        now_s = asyncio.get_running_loop().time()
        indices = self.core.sample_indices(now_s)
        results = await self.gpus.sample(indices)
        sampled = self.core.note_samples(indices, results, now_s=now_s, now_ns=self.clock_ns())
        self.carry_out(sampled.effects)
        return sampled.samples

    async def step(self) -> ApplyResult | None:
        """One control step: the core decides, its writes are made, their results fed
        back; what the writes did (None: nothing was written)."""
        plan = self.core.control_step(now_mono_ns=self.mono_ns(), now_ns=self.clock_ns())
        self.carry_out(plan.effects)
        if not plan.writes:
            return None
        results = await self.gpus.write(plan.writes)
        applied = self.core.note_step(
            plan,
            results,
            now_s=asyncio.get_running_loop().time(),
            now_ns=self.clock_ns(),
            now_mono_ns=self.mono_ns(),
        )
        self.carry_out(applied.effects)
        return applied.result

    async def leave(self, *, clean: bool, timeout_s: float) -> str:
        """Leave the GPUs as the end of control requires, within ``timeout_s``; the
        reason for the final status."""
        plan = self.core.plan_stop(clean=clean, now_mono_ns=self.mono_ns())
        results = (
            await self.gpus.carry_out_stop(plan, timeout_s=timeout_s) if plan.mode != "none" else []
        )
        stopped = self.core.note_stop(plan, results, timeout_s=timeout_s, now_ns=self.clock_ns())
        if stopped.remove_baseline:
            self.gpus.remove_baseline()
        self.carry_out(stopped.effects)
        return stopped.reason
