"""The Kubernetes source's loop body: what it hands the agent as pod-resources and the API
answer, fail, come back (the seams filled by in-memory stand-ins; the real clients and
stand-in servers are in test_podresources.py, test_kubeapi.py and the end-to-end test)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import NoReturn

import pytest

from polca.assign.config import KubernetesAssignment
from polca.assign.kubernetes import KubernetesSource, node_name_of
from polca.assign.model import AssignmentUpdate, PodDevices, PodMeta
from polca.assign.rules import Classes
from polca.errors import ConfigError, ReadingRejectedError, TransportError

CLASSES = Classes(("high", "low"), default="low")
GPUS = {"GPU-a": "GPU-a", "GPU-b": "GPU-b", "0": "GPU-a", "1": "GPU-b"}
SETTINGS = KubernetesAssignment.model_validate(
    {"grace_s": 10.0, "refresh_s": 0.05, "top_class_namespaces": ["prod"], "idle_class": "low"}
)
POD = PodMeta(
    namespace="prod",
    name="chat-0",
    uid="u1",
    node_name="n1",
    phase="Running",
    annotations={"polca.io/class": "high"},
)
HELD = PodDevices("prod", "chat-0", "main", "nvidia.com/gpu", ("GPU-a",))


class Kubelet:
    """Answers what it is told, or fails as told."""

    def __init__(self) -> None:
        self.devices: tuple[PodDevices, ...] = (HELD,)
        self.fail: Exception | None = None
        self.closed = False

    async def list_devices(self) -> tuple[PodDevices, ...]:
        if self.fail is not None:
            raise self.fail
        return self.devices

    async def close(self) -> None:
        self.closed = True


class Api:
    """The pods, healthy or not."""

    def __init__(self) -> None:
        self.healthy = True
        self.error: str | None = None
        self.known: dict[str, PodMeta] = {POD.uid: POD}

    def pods(self) -> Mapping[str, PodMeta]:
        return self.known

    async def run(self) -> NoReturn:
        await asyncio.Event().wait()
        raise AssertionError  # pragma: no cover


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


async def test_a_read_maps_pods_and_a_failed_read_keeps_the_map_for_the_grace() -> None:
    kubelet, api, clock = Kubelet(), Api(), Clock()
    source = KubernetesSource(SETTINGS, devices=kubelet, pods=api, clock=clock)
    good = await source.refresh_once(gpus=GPUS, classes=CLASSES)
    assert good.healthy
    assert good.classes == {"GPU-a": "high", "GPU-b": "low"}
    assert good.origins == {"GPU-a": "annotation", "GPU-b": "idle"}
    kubelet.fail = TransportError("pod-resources socket /x: no such file")
    clock.now_s = 105.0
    kept = await source.refresh_once(gpus=GPUS, classes=CLASSES)
    assert not kept.healthy
    assert kept.classes == good.classes  # the last map, within the grace
    assert "no such file" in kept.reason
    clock.now_s = 111.0
    late = await source.refresh_once(gpus=GPUS, classes=CLASSES)
    assert late.classes == {"GPU-a": "low", "GPU-b": "low"}
    assert set(late.origins.values()) == {"fallback"}
    assert late.reason.startswith("pod-resources unreadable for more than 10 s")
    kubelet.fail = None
    clock.now_s = 112.0
    back = await source.refresh_once(gpus=GPUS, classes=CLASSES)
    assert back.healthy
    assert back.classes == good.classes
    assert (source.refreshes, source.failures) == (2, 2)


async def test_one_outage_keeps_its_first_reason_whatever_the_later_errors_say() -> None:
    """The kubelet killed mid-stream fails with one message, then with another while it is
    down: one outage, one reason (so one status change and one warning), until a read
    succeeds; the next outage names its own first error."""
    kubelet, api, clock = Kubelet(), Api(), Clock()
    source = KubernetesSource(SETTINGS, devices=kubelet, pods=api, clock=clock)
    await source.refresh_once(gpus=GPUS, classes=CLASSES)
    kubelet.fail = TransportError("UNAVAILABLE: Stream removed")
    first = await source.refresh_once(gpus=GPUS, classes=CLASSES)
    kubelet.fail = TransportError("UNAVAILABLE: failed to connect to all addresses")
    clock.now_s = 102.0
    second = await source.refresh_once(gpus=GPUS, classes=CLASSES)
    assert second.reason == first.reason
    assert "Stream removed" in second.reason
    kubelet.fail = None
    assert (await source.refresh_once(gpus=GPUS, classes=CLASSES)).healthy
    kubelet.fail = TransportError("UNAVAILABLE: failed to connect to all addresses")
    again = await source.refresh_once(gpus=GPUS, classes=CLASSES)
    assert "failed to connect" in again.reason


async def test_an_api_outage_keeps_the_last_pods_then_falls_back() -> None:
    kubelet, api, clock = Kubelet(), Api(), Clock()
    source = KubernetesSource(SETTINGS, devices=kubelet, pods=api, clock=clock)
    await source.refresh_once(gpus=GPUS, classes=CLASSES)
    api.healthy, api.error = False, "HTTP 503 Service Unavailable"
    clock.now_s = 105.0
    kept = await source.refresh_once(gpus=GPUS, classes=CLASSES)
    assert not kept.healthy
    assert kept.classes["GPU-a"] == "high"  # the pods it knew
    assert "503" in kept.reason
    clock.now_s = 116.0
    late = await source.refresh_once(gpus=GPUS, classes=CLASSES)
    assert set(late.classes.values()) == {"low"}
    assert "the Kubernetes API" in late.reason


async def test_a_hostile_answer_counts_as_a_failed_read() -> None:
    kubelet, api, clock = Kubelet(), Api(), Clock()
    source = KubernetesSource(SETTINGS, devices=kubelet, pods=api, clock=clock)
    kubelet.fail = ReadingRejectedError("10,000 pods", reason="oversized")
    first = await source.refresh_once(gpus=GPUS, classes=CLASSES)
    assert not first.healthy  # nothing read yet: the default map, not trusted
    assert "10,000 pods" in first.reason


async def test_run_hands_each_refresh_on_and_closes_the_kubelet_channel() -> None:
    kubelet, api = Kubelet(), Api()
    source = KubernetesSource(SETTINGS, devices=kubelet, pods=api)
    updates: list[AssignmentUpdate] = []
    three = asyncio.Event()

    def take(update: AssignmentUpdate) -> None:
        updates.append(update)
        if len(updates) >= 3:
            three.set()

    task = asyncio.create_task(source.run(take, gpus=lambda: GPUS, classes=lambda: CLASSES))
    try:
        async with asyncio.timeout(5):
            await three.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert updates[-1].classes["GPU-a"] == "high"
    assert kubelet.closed


def test_the_node_name_comes_from_the_setting_or_the_downward_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    assert node_name_of(SETTINGS) == "gpu-node-7"
    named = SETTINGS.model_copy(update={"node_name": "n1"})
    assert node_name_of(named) == "n1"
    monkeypatch.delenv("NODE_NAME")
    with pytest.raises(ConfigError, match="NODE_NAME"):
        node_name_of(SETTINGS)
