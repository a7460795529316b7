"""The agent's GPU round trips (``agent/driver.py``) on simulated GPUs behind the GPU
thread, without a bus: what reaches the GPUs and the baseline file at start-up, at each
step and at the end, and that every effect the core returns goes to the shell."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import structlog

from polca.agent.baseline import BASELINE_FILE
from polca.agent.config import AgentSettings
from polca.agent.core import AgentCore
from polca.agent.driver import GpuDriver
from polca.agent.gpus import NodeGpus
from polca.agent.messages import Identity
from polca.agent.plans import Effects
from polca.gpu.clocks import snap_sm_clock_mhz
from polca.gpu.simulated import SimulatedBackend
from polca.gpu.threaded import ThreadedGpu
from polca.policy import PolicyStore
from polca.telemetry.topics import NodeAddress, Topics
from tests.row import policy_file

S = 1_000_000_000
HIGH_T2_MHZ, LOW_T2_MHZ = 1305, 1110  # the test policy's fail-safe: GPU 0 high, the rest low


class Node:
    """One node's core, GPUs and driver; ``effects`` is what reached the shell."""

    def __init__(self, state_dir: Path, backend: SimulatedBackend, **settings: Any) -> None:
        path = policy_file(state_dir, on_stop=settings.pop("on_stop", "restore"))
        self.store = PolicyStore(path)
        assert not self.store.reload().errors
        self.settings = AgentSettings(
            policy_file=path, state_dir=state_dir, control_issuers=("agg",), **settings
        )
        self.mono_ns = 5_000 * S
        self.core = AgentCore(
            addr=NodeAddress("dc1", "row1", "rack1", "n1"),
            topics=Topics(),
            settings=self.settings,
            policy_store=self.store,
            identity=Identity("simulated", self.settings.observe_only, 1_700_000_000 * S),
            assignment_source="mqtt",
        )
        self.backend = backend
        log = structlog.get_logger()
        gpu = ThreadedGpu(backend)
        self.gpus = NodeGpus(
            gpu, state_dir=state_dir, observe_only=self.settings.observe_only, log=log
        )
        self.effects: list[Effects] = []
        self.driver = GpuDriver(
            self.core,
            self.gpus,
            carry_out=self.effects.append,
            clock_ns=lambda: 1_700_000_000 * S + self.mono_ns,
            mono_ns=lambda: self.mono_ns,
        )

    async def take_over(self) -> None:
        await self.driver.take_over(
            self.settings,
            policy_store=self.store,
            started_mono_ns=self.mono_ns,
            log=structlog.get_logger(),
        )

    def events(self, name: str) -> list[str]:
        return [line.event for e in self.effects for line in e.logs if line.event == name]

    def locks(self) -> dict[int, int | None]:
        """Each GPU's locked maximum SM clock (None: unlocked)."""
        return {
            i: (held[1] if held is not None else None)
            for i in range(4)
            for held in [self.backend.held(i)[0]]
        }

    def fail_safe_locks(self) -> dict[int, int | None]:
        supported = self.backend.discover()[0].supported_sm_clocks_mhz
        high, low = (snap_sm_clock_mhz(mhz, supported) for mhz in (HIGH_T2_MHZ, LOW_T2_MHZ))
        return {0: high, 1: low, 2: low, 3: low}


def _backend() -> SimulatedBackend:
    return SimulatedBackend(count=4, model="A100-SXM4", seed=7, clock=lambda: 0.0)


@pytest.fixture
async def make_node(tmp_path: Path) -> AsyncIterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(backend: SimulatedBackend | None = None, **settings: Any) -> Node:
        node = Node(tmp_path, backend or _backend(), **settings)
        made.append(node)
        return node

    yield make
    for node in made:
        await node.gpus.close(5.0)


async def test_take_over_saves_the_baseline_and_writes_nothing_after_a_clean_end(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """No baseline left behind: the originals are saved before any control write, no GPU
    is touched, and the first readings reach the core (its effects reach the shell)."""
    node = make_node()
    await node.take_over()
    assert (tmp_path / BASELINE_FILE).is_file()
    assert set(node.locks().values()) == {None}
    assert sorted(node.core.infos) == [0, 1, 2, 3]
    assert node.effects  # discovery and the first readings said what they did


async def test_take_over_after_a_crash_applies_the_fail_safe_before_anything_else(
    make_node: Callable[..., Node],
) -> None:
    """A baseline left behind (a run that ended without restoring): the fail-safe caps are
    on the GPUs when ``take_over`` returns, before any control step."""
    backend = _backend()
    first = make_node(backend)
    await first.take_over()  # ... and never leaves: a crash
    await first.gpus.close(5.0)
    second = make_node(backend)
    await second.take_over()
    assert second.locks() == second.fail_safe_locks()
    assert second.core.decision is not None
    assert second.core.decision.fail_safe


async def test_a_clean_stop_restores_the_gpus_and_drops_the_baseline(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """``on_stop: restore`` after a clean stop: every GPU unlocked, the baseline gone, the
    final status says ``stopped``."""
    node = make_node(on_stop="restore")
    await node.take_over()
    assert await node.driver.leave(clean=True, timeout_s=5.0) == "stopped"
    assert set(node.locks().values()) == {None}
    assert not (tmp_path / BASELINE_FILE).exists()


async def test_any_other_end_leaves_the_fail_safe_and_keeps_the_baseline(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """An end that is not a clean stop: the fail-safe caps on the GPUs, the baseline kept
    for the next start, the final status says ``failed``."""
    node = make_node(on_stop="restore")
    await node.take_over()
    assert await node.driver.leave(clean=False, timeout_s=5.0) == "failed"
    assert node.locks() == node.fail_safe_locks()
    assert (tmp_path / BASELINE_FILE).is_file()
    assert node.events("gpu_fail_safe_on_failure")


async def test_observe_only_touches_neither_the_gpus_nor_the_baseline(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """Observe-only: the GPUs are read, never written, and no baseline is saved, at the
    start or at an unclean end."""
    node = make_node(observe_only=True)
    await node.take_over()
    assert node.core.infos
    assert (await node.driver.sample()).keys() == {0, 1, 2, 3}
    assert await node.driver.step() is None
    await node.driver.leave(clean=False, timeout_s=5.0)
    assert set(node.locks().values()) == {None}
    assert not (tmp_path / BASELINE_FILE).exists()
