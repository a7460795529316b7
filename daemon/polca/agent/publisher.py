"""The agent's telemetry loop: the samples' window, one telemetry message per interval, its
points for the sinks.

``sampled`` takes each tick's samples into the window (and times the tick); ``once`` is
one publish interval: read the GPUs' health counters, build the telemetry message from
the window (``AgentCore.telemetry``, which queues it through the effects), and hand the
interval's points to the sinks. Decisions stay in the core; this does the reads and
hands on what comes back, like the shell that owns it (``runtime.py``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable

import structlog
from structlog.typing import FilteringBoundLogger

from polca.agent import messages
from polca.agent.core import AgentCore
from polca.agent.gpus import NodeGpus
from polca.agent.plans import Effects
from polca.agent.points import agent_points
from polca.agent.window import TelemetryWindow
from polca.errors import GpuError
from polca.export.points import mqtt_points
from polca.export.sink import FanOut
from polca.gpu.backend import GpuSample
from polca.telemetry.messages import BusStats
from polca.telemetry.schema import Telemetry

__all__ = ["TelemetryPublisher"]

TICKS_KEPT = 1000
"""Tick durations kept for the health's tick percentiles."""


class TelemetryPublisher:
    """One node's telemetry, from the samples of its ticks (construct, then ``start``)."""

    def __init__(
        self,
        core: AgentCore,
        gpus: NodeGpus,
        *,
        sinks: FanOut,
        site: str,
        carry_out: Callable[[Effects], None],
        bus_stats: Callable[[], BusStats | None],
        clock_ns: Callable[[], int],
        mono_ns: Callable[[], int],
        log: FilteringBoundLogger | None = None,
    ) -> None:
        """``carry_out`` emits the core's effects (the shell's); ``bus_stats`` the bus's
        counters, None before the bus exists."""
        self.core = core
        self.gpus = gpus
        self.sinks = sinks
        self.site = site
        self._carry_out = carry_out
        self._bus_stats = bus_stats
        self._clock_ns = clock_ns
        self._mono_ns = mono_ns
        self._log = log if log is not None else structlog.get_logger(__name__)
        self.window: TelemetryWindow | None = None
        self.ticks = 0
        self.tick_durations_s: deque[float] = deque(maxlen=TICKS_KEPT)

    def start(self) -> None:
        """The window, once the GPUs are known (after discovery)."""
        self.window = TelemetryWindow(dict(self.core.infos))

    def sampled(self, samples: Iterable[GpuSample], *, duration_s: float) -> None:
        """One tick's samples, read in ``duration_s``."""
        assert self.window is not None  # noqa: S101 - start() comes first
        for sample in samples:
            self.window.add(sample)
        self.ticks += 1
        self.tick_durations_s.append(duration_s)

    async def once(self) -> None:
        """One publish interval: health counters, the telemetry message, its points."""
        await self.read_health()
        try:
            message = self.publish()
        except ValueError as exc:  # pydantic's ValidationError: readings out of bounds
            self._carry_out(self.core.telemetry_invalid(str(exc), now_mono_ns=self._mono_ns()))
            return
        if self.sinks:
            self.write_points(message)

    async def read_health(self) -> None:
        """Read every GPU's health counters (once per telemetry interval)."""
        indices = [i for i in sorted(self.core.infos) if i not in self.core.lost]
        if not indices:
            return
        try:
            results = await self.gpus.read_health(indices)
        except GpuError as exc:  # the GPU thread is stuck: the counters wait for it
            self._log.warning("gpu_health_unread", error=str(exc))
            return
        self._carry_out(self.core.note_health(indices, results, now_ns=self._clock_ns()))

    def publish(self) -> Telemetry:
        """Build and queue one telemetry message from the samples since the last one."""
        assert self.window is not None  # noqa: S101 - start() comes first
        stats = self.gpus.gpu.stats()
        health = messages.Health.of(
            ticks=self.ticks,
            tick_durations_s=self.tick_durations_s,
            gpu_call_p99_s=stats.get("latency_p99_s"),
            bus=self._bus_stats(),
            rejected=self.core.drops.total,
            gpu_errors=int(stats.get("errors", 0)),
        )
        message, effects = self.core.telemetry(
            self.window,
            health=health,
            now_ns=self._clock_ns(),
            now_s=asyncio.get_running_loop().time(),
        )
        self._carry_out(effects)
        return message

    def write_points(self, message: Telemetry) -> None:
        """Hand the interval's points (GPUs, health, caps, the agent, its bus) to the sinks."""
        now_mono_ns = self._mono_ns()
        batch = agent_points(
            self.core.snapshot(),
            message,
            lease=self.core.lease(now_mono_ns),
            site=self.site,
            health=self.core.health.reports,
            gpu_errors=message.health.gpu_errors,
            now_mono_ns=now_mono_ns,
        )
        bus = self._bus_stats()
        if bus is not None:
            batch.extend(
                mqtt_points(
                    {"mqtt": bus},
                    ts_ns=message.ts_ns,
                    site=self.site,
                    role="agent",
                    name=self.core.addr.node,
                )
            )
        self.sinks.write(batch)
