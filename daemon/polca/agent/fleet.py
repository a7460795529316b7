"""The node's GPUs as the agent core knows them: found, read, lost, recovered (pure).

``GpuFleet`` keeps what the readings say: the GPUs discovered at start-up, each one's
latest sample, the samples taken since the last write (``fresh``: only these can show
that something else moved a limit), which GPUs are lost (and when they were last tried)
and their health counters (``HealthTracker``). It says which GPUs to read now
(``sample_indices``: a lost GPU only every ``LOST_RETRY_S``), takes each round of
readings, marks a GPU lost or recovered once, and gives the engine its view of the GPUs
(``views``).

It changes when what a reading means changes, not when a decision does: the caps are
decided in ``step.py``, the writes planned by ``actuator.py``. Part of the core (no I/O,
time passed in): ``AgentCore`` owns one; its log lines go to the core's ``LogBook`` and its
events through the core's ``event``, so this module never imports the core.
"""

from __future__ import annotations

from collections.abc import Sequence

from polca.agent.classes import ClassDwell
from polca.agent.gpu_health import HealthTracker
from polca.agent.plans import EventSink, LogBook
from polca.errors import GpuError, GpuLostError
from polca.gpu.backend import GpuHealth, GpuInfo, GpuSample
from polca.policy import GpuView

LOST_RETRY_S = 10.0
"""A lost GPU is read again this many seconds (loop time) after its last attempt."""


class GpuFleet:
    """The GPUs of one node and what their readings say."""

    def __init__(self, *, health_every_s: float, log: LogBook, event: EventSink) -> None:
        """No GPUs until ``discovered``; health counters go out at least every
        ``health_every_s``. ``log`` and ``event`` are the core's."""
        self.log = log
        self.event = event
        self.infos: dict[int, GpuInfo] = {}
        self.latest: dict[int, GpuSample] = {}
        # Samples taken since the last write: only these can show that something else
        # changed a limit (older ones may predate polca's own write).
        self.fresh: dict[int, GpuSample] = {}
        self.lost: dict[int, float] = {}  # index -> loop time of the last attempt
        self.health = HealthTracker(every_s=health_every_s)

    def discovered(self, infos: Sequence[GpuInfo]) -> None:
        """Take the node's GPUs, as discovered at start-up."""
        self.infos = {info.index: info for info in infos}

    def sample_indices(self, now_s: float) -> list[int]:
        """The GPUs to read now: all but the lost, which are retried every 10 s."""
        return [i for i in self.infos if i not in self.lost or now_s - self.lost[i] >= LOST_RETRY_S]

    def note_samples(
        self,
        indices: Sequence[int],
        results: Sequence[GpuSample | GpuError],
        *,
        now_s: float,
        now_ns: int,
    ) -> dict[int, GpuSample]:
        """Take one round of readings of GPUs ``indices`` (same order); the good samples.

        A GPU that answers again is recovered and one that is gone is marked lost (each
        logged and published once); any other failure is only logged.
        """
        samples: dict[int, GpuSample] = {}
        for index, result in zip(indices, results, strict=True):
            if isinstance(result, GpuSample):
                samples[index] = result
                if index in self.lost:
                    del self.lost[index]
                    self.log.warning("gpu_recovered", gpu=index)
                    self.event("gpu_recovered", gpu=index, now_ns=now_ns)
            elif isinstance(result, GpuLostError):
                self.mark_lost(index, str(result), now_s=now_s, now_ns=now_ns)
            else:
                self.log.warning("gpu_sample_failed", gpu=index, error=str(result))
        self.latest.update(samples)
        self.fresh.update(samples)
        return samples

    def note_health(
        self, indices: Sequence[int], results: Sequence[GpuHealth | GpuError], *, now_ns: int
    ) -> None:
        """Take one round of health readings; a new XID is logged and published as an event."""
        for xid in self.health.note(dict(zip(indices, results, strict=True))):
            self.log.error(
                "gpu_xid", gpu=xid.index, uuid=xid.uuid, xid=xid.last_xid, count=xid.count
            )
            self.event("gpu_xid", gpu=xid.index, xid=xid.last_xid, count=xid.count, now_ns=now_ns)

    def mark_lost(self, index: int, error: str, *, now_s: float, now_ns: int) -> None:
        """GPU ``index`` is gone (logged and published once); retried later."""
        if index not in self.lost:
            self.log.error("gpu_lost", gpu=index, uuid=self.infos[index].uuid, error=error)
            self.event("gpu_lost", gpu=index, error=error, now_ns=now_ns)
        self.lost[index] = now_s

    def views(self, classes: ClassDwell) -> list[GpuView]:
        """What the engine needs of each GPU that is not lost (its class from ``classes``)."""
        views = []
        for index, info in sorted(self.infos.items()):
            if index in self.lost:
                continue
            sample = self.latest.get(index)
            supported = info.supported_sm_clocks_mhz
            views.append(
                GpuView(
                    index=index,
                    uuid=info.uuid,
                    priority_class=classes.of(index),
                    gpu_temp_c=sample.gpu_temp_c if sample else None,
                    mem_temp_c=sample.mem_temp_c if sample else None,
                    sm_clock_max_mhz=info.sm_clock_max_mhz,
                    sm_clock_min_mhz=min(supported) if supported else None,
                    power_limit_min_mw=info.power_limit_min_mw,
                    power_limit_max_mw=info.power_limit_max_mw,
                    power_limit_default_mw=info.power_limit_default_mw,
                )
            )
        return views
