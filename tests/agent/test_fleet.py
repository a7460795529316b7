"""GpuFleet: which GPUs to read, and what the readings mean (lost, recovered, a new XID).

Driven directly with readings of simulated GPUs (or errors made up here), loop times
passed in, its log lines and events kept by the test.
"""

from __future__ import annotations

from typing import Any

from polca.agent.classes import ClassDwell
from polca.agent.fleet import LOST_RETRY_S, GpuFleet
from polca.agent.plans import LogBook
from polca.errors import GpuError, GpuLostError
from polca.gpu.backend import GpuHealth, GpuSample
from polca.gpu.simulated import SimulatedBackend

T0_S = 100.0


class Rig:
    """A fleet of four simulated GPUs; the events it queues, kept."""

    def __init__(self) -> None:
        self.backend = SimulatedBackend(count=4, model="A100-SXM4", seed=3, clock=lambda: 0.0)
        self.log = LogBook()
        self.events: list[tuple[str, int | None, dict[str, Any]]] = []
        self.fleet = GpuFleet(health_every_s=30.0, log=self.log, event=self.event)
        self.fleet.discovered(self.backend.discover())

    def event(self, name: str, *, now_ns: int, gpu: int | None = None, **detail: Any) -> None:
        """The fleet's event sink: keep (name, gpu, detail)."""
        self.events.append((name, gpu, detail))

    def read(self, now_s: float) -> dict[int, GpuSample]:
        """One round of the readings the fleet asks for, at loop time ``now_s``."""
        indices = self.fleet.sample_indices(now_s)
        results: list[GpuSample | GpuError] = []
        for index in indices:
            try:
                results.append(self.backend.sample(index))
            except GpuError as exc:
                results.append(exc)
        return self.fleet.note_samples(indices, results, now_s=now_s, now_ns=1)

    def logged(self) -> list[tuple[str, str]]:
        """(level, event) of every line logged since the last call."""
        return [(line.level, line.event) for line in self.log.take()]


def test_a_lost_gpu_is_reported_once_and_read_again_only_after_its_retry() -> None:
    """Lost: one error line and one event, then left out of the reads until
    ``LOST_RETRY_S`` after its last attempt; back: one warning and one event."""
    rig = Rig()
    rig.backend.lose_gpu(2)
    assert sorted(rig.read(T0_S)) == [0, 1, 3]
    assert rig.logged() == [("error", "gpu_lost")]
    assert [(name, gpu) for name, gpu, _ in rig.events] == [("gpu_lost", 2)]
    assert rig.fleet.sample_indices(T0_S + LOST_RETRY_S - 0.1) == [0, 1, 3]
    assert rig.fleet.sample_indices(T0_S + LOST_RETRY_S) == [0, 1, 2, 3]
    rig.read(T0_S + LOST_RETRY_S)  # still gone: tried, not reported again
    assert rig.logged() == []
    assert rig.fleet.lost == {2: T0_S + LOST_RETRY_S}
    rig.backend.restore_gpu(2)
    assert sorted(rig.read(T0_S + 2 * LOST_RETRY_S)) == [0, 1, 2, 3]
    assert rig.logged() == [("warning", "gpu_recovered")]
    assert [(name, gpu) for name, gpu, _ in rig.events][-1] == ("gpu_recovered", 2)
    assert rig.fleet.lost == {}


def test_a_failed_reading_is_logged_and_the_last_good_one_kept() -> None:
    """A read that fails without losing the GPU: a warning, the GPU not marked lost, its
    latest sample the last good one; good samples are fresh until cleared."""
    rig = Rig()
    first = rig.read(T0_S)
    samples = rig.fleet.note_samples(
        [0, 1], [GpuError("busy", index=0), first[1]], now_s=T0_S + 1, now_ns=2
    )
    assert list(samples) == [1]
    assert rig.logged() == [("warning", "gpu_sample_failed")]
    assert rig.fleet.lost == {}
    assert rig.fleet.latest[0] is first[0]
    assert set(rig.fleet.fresh) == {0, 1, 2, 3}
    rig.fleet.fresh.clear()
    rig.read(T0_S + 2)
    assert set(rig.fleet.fresh) == {0, 1, 2, 3}


def test_a_gpu_marked_lost_elsewhere_is_reported_once() -> None:
    """``mark_lost`` (a write found the GPU gone) reports once and moves its retry time."""
    rig = Rig()
    rig.fleet.mark_lost(1, "gone", now_s=T0_S, now_ns=1)
    rig.fleet.note_samples([1], [GpuLostError("gone", index=1)], now_s=T0_S + 20, now_ns=2)
    assert rig.logged() == [("error", "gpu_lost")]
    assert rig.events == [("gpu_lost", 1, {"error": "gone"})]
    assert rig.fleet.lost == {1: T0_S + 20}


def test_the_engine_sees_the_gpus_not_lost_with_their_class_and_temperatures() -> None:
    """``views``: lost GPUs left out; each view's class is the one in force, its
    temperatures the latest sample's (None before any)."""
    rig = Rig()
    classes = ClassDwell(0)
    classes.request({"0": "high"}, rig.fleet.infos.values(), 0)
    classes.settle(rig.fleet.infos.values(), 0)
    assert [v.gpu_temp_c for v in rig.fleet.views(classes)] == [None] * 4
    samples = rig.read(T0_S)
    rig.fleet.mark_lost(3, "gone", now_s=T0_S, now_ns=1)
    views = rig.fleet.views(classes)
    assert [v.index for v in views] == [0, 1, 2]
    assert [v.priority_class for v in views] == ["high", None, None]
    assert views[1].gpu_temp_c == samples[1].gpu_temp_c
    assert views[1].uuid == rig.fleet.infos[1].uuid


def test_a_new_xid_is_logged_and_published_once() -> None:
    """A rising XID count: one error line and one ``gpu_xid`` event; the same count again
    (or a failed read) reports nothing."""
    rig = Rig()

    def health(xids: int) -> GpuHealth:
        return GpuHealth(index=0, uuid="GPU-0", xid_errors=xids, last_xid=79 if xids else None)

    rig.fleet.note_health([0], [health(0)], now_ns=1)
    rig.fleet.note_health([0], [health(2)], now_ns=2)
    rig.fleet.note_health([0], [health(2)], now_ns=3)
    rig.fleet.note_health([0], [GpuLostError("gone", index=0)], now_ns=4)
    assert rig.logged() == [("error", "gpu_xid")]
    assert rig.events == [("gpu_xid", 0, {"xid": 79, "count": 2})]
    assert rig.fleet.health.latest[0].xid_errors == 2
