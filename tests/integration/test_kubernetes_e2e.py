"""The Kubernetes assignment source end to end: a real agent, real stand-ins, Mosquitto.

A real ``polca agent`` process on the fake NVML library (6 A100s, GPU 3 in MIG mode with
two MIG devices) with ``assignment.source: kubernetes``, reading a real gRPC pod-resources
server on a unix socket (``KubeletStandIn``) and a Kubernetes API stand-in process over
plain HTTP with a bearer token. The test's MQTT probe holds the row at T2, so every class
change shows twice: in the agent's telemetry (class, origin, workload) and on the fake
GPUs (the clock lock, or under MIG the power limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from polca.telemetry.schema import GpuTelemetry, Status, Telemetry
from tests.fake_nvml import FakeMig, FakeNvml, mig_uuid
from tests.integration.rig import AgentProcess, MqttProbe, mqtt_probe, wait_until
from tests.mqtt_broker import MosquittoProcess
from tests.standins.kubeapi_process import KubeApiStandIn
from tests.standins.kubelet import KubeletStandIn, pod

GPUS = 6
MIG_GPU = 3
MIG_A = FakeMig(mig_uuid(MIG_GPU, 0), "3g.40gb", 1, 0, 40192)
MIG_B = FakeMig(mig_uuid(MIG_GPU, 1), "3g.40gb", 2, 0, 40192)
NODE_NAME = "gpu-node-1"
TOP_NAMESPACE = "prod"
TOKEN = "e2e-token"  # noqa: S105 - the stand-in's test token
REFRESH_S = 0.3
GRACE_S = 3.0
PUBLISH_S = 0.5
CLASS_WITHIN_S = 6.0
"""A generous bound on pod scheduled -> class in telemetry (a refresh, a publish, a loaded
machine): the benchmark measures the real figure."""
HIGH_MHZ, LOW_MHZ = 1305, 1110  # polca-a100.yaml at T2
A100_MAX_MHZ, A100_LIMIT_MW = 1410, 400_000
GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE = "nvidia.com/mig-3g.40gb"


def mig_limit_mw(clock_mhz: int) -> int:
    """The power limit a clock cap becomes under MIG: the same fraction of the range."""
    return int(A100_LIMIT_MW * clock_mhz / A100_MAX_MHZ)


@dataclass
class Node:
    """One Kubernetes GPU node: the fake GPUs, the kubelet, the API, the agent, a probe."""

    fake: FakeNvml
    kubelet: KubeletStandIn
    api: KubeApiStandIn
    agent: AgentProcess
    probe: MqttProbe
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    def uuid(self, gpu: int) -> str:
        """GPU ``gpu``'s UUID on the fake."""
        value = self.fake.get(gpu)["uuid"]
        assert isinstance(value, str)
        return value

    def schedule(
        self,
        namespace: str,
        name: str,
        devices: Mapping[str, Sequence[str]],
        *,
        annotations: Mapping[str, str] | None = None,
    ) -> None:
        """Bind a pod to the node (the API) and give it ``devices`` (the kubelet)."""
        self.api.put_pod(namespace, name, node=NODE_NAME, annotations=annotations)
        self.pods[namespace, name] = pod(namespace, name, {"main": devices})
        self.kubelet.set_pods(list(self.pods.values()))

    def annotate(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        """Replace a pod's annotations (a MODIFIED event on the watch)."""
        self.api.put_pod(namespace, name, node=NODE_NAME, annotations=annotations)

    def delete(self, namespace: str, name: str) -> None:
        """The pod ends: the kubelet frees its devices and the API deletes it."""
        del self.pods[namespace, name]
        self.kubelet.set_pods(list(self.pods.values()))
        self.api.delete_pod(namespace, name)

    def telemetry(self) -> Telemetry | None:
        """The last telemetry message received."""
        messages = [m for m in self.probe.of("telemetry") if isinstance(m, Telemetry)]
        return messages[-1] if messages else None

    def gpu(self, index: int) -> GpuTelemetry | None:
        """GPU ``index`` in the last telemetry."""
        last = self.telemetry()
        if last is None:
            return None
        return next((g for g in last.gpus if g.index == index), None)

    def status(self) -> Status | None:
        """The agent's last status."""
        statuses = [m for m in self.probe.of("status") if isinstance(m, Status)]
        return statuses[-1] if statuses else None

    def locked_max(self, gpu: int) -> int:
        """The fake's locked SM clock ceiling (0: unlocked)."""
        value = self.fake.get(gpu)["locked_max_mhz"]
        assert isinstance(value, int)
        return value

    def power_limit_mw(self, gpu: int) -> int:
        """The fake's power limit."""
        value = self.fake.get(gpu)["power_limit_mw"]
        assert isinstance(value, int)
        return value

    async def until_class(
        self,
        gpu: int,
        cls: str,
        origin: str,
        *,
        timeout_s: float = CLASS_WITHIN_S,
        extra: Callable[[GpuTelemetry], bool] = lambda _g: True,
    ) -> GpuTelemetry:
        """Wait for telemetry showing GPU ``gpu`` at ``cls`` from ``origin``."""

        def shown() -> bool:
            g = self.gpu(gpu)
            return (
                g is not None and g.priority_class == cls and g.class_origin == origin and extra(g)
            )

        try:
            await wait_until(shown, timeout_s=timeout_s, what=f"GPU {gpu} at {cls} ({origin})")
        except AssertionError as exc:
            msg = f"{exc}; last: {self.gpu(gpu)}; agent log:\n{self.agent.log_text()[-3000:]}"
            raise AssertionError(msg) from None
        g = self.gpu(gpu)
        assert g is not None
        return g

    async def until_lock(self, gpu: int, mhz: int) -> None:
        """Wait for the fake's clock lock of GPU ``gpu`` to be ``mhz``."""
        await wait_until(
            lambda: self.locked_max(gpu) == mhz,
            timeout_s=CLASS_WITHIN_S,
            what=f"GPU {gpu} locked at {mhz} MHz (now {self.locked_max(gpu)})",
        )


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for the kubelet's socket (``sun_path`` holds 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="polca-k8s-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def node(
    tmp_path: Path, short_dir: Path, fake_nvml_lib: Path, mosquitto: MosquittoProcess
) -> AsyncIterator[Node]:
    """The node running at T2 (renewed every 5 s), no pod scheduled, every GPU idle."""
    (tmp_path / "nvml").mkdir()
    fake = FakeNvml(
        tmp_path / "nvml", gpus=GPUS, model="NVIDIA A100-SXM4-80GB", lib_path=fake_nvml_lib
    )
    fake.set_mig(MIG_GPU, [MIG_A, MIG_B])
    kubelet = KubeletStandIn(tmp_path / "kubelet", short_dir / "kubelet.sock")
    kubelet.set_allocatable(
        {GPU_RESOURCE: [fake_uuid(fake, g) for g in range(GPUS) if g != MIG_GPU]}
    )
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n", encoding="utf-8")
    api = KubeApiStandIn(tmp_path / "kubeapi", token=TOKEN)
    agent = AgentProcess(
        tmp_path / "agent",
        fake=fake,
        broker=mosquitto,
        startup_grace_s=60,
        extra={
            "agent": {"class_dwell_s": 0, "publish_interval_s": PUBLISH_S},
            "assignment": {
                "source": "kubernetes",
                "kubernetes": {
                    "pod_resources_socket": str(kubelet.socket_path),
                    "refresh_s": REFRESH_S,
                    "node_name": NODE_NAME,
                    "api_url": api.url,
                    "token_file": str(token_file),
                    "allow_http": True,
                    "grace_s": GRACE_S,
                    "top_class_namespaces": [TOP_NAMESPACE],
                    "idle_class": "low",
                },
            },
        },
    )
    await asyncio.to_thread(kubelet.start)
    await asyncio.to_thread(api.start)
    try:
        async with mqtt_probe(mosquitto) as probe:
            agent.start()
            await agent.wait_log("assignment_kubernetes_started", timeout_s=30)
            made = Node(fake, kubelet, api, agent, probe)
            await wait_until(
                lambda: (s := made.status()) is not None and s.assignment_healthy is True,
                timeout_s=30,
                what=f"a healthy kubernetes source; status: {made.status()}",
            )

            async def hold_t2() -> None:
                while True:
                    await probe.control(2)
                    await asyncio.sleep(5.0)

            renew = asyncio.create_task(hold_t2())
            try:
                for gpu in range(GPUS):
                    await made.until_class(gpu, "low", "idle", timeout_s=20)
                yield made
            finally:
                renew.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await renew
    finally:
        agent.kill()
        await asyncio.to_thread(kubelet.kill)
        await asyncio.to_thread(api.kill)


def fake_uuid(fake: FakeNvml, gpu: int) -> str:
    """GPU ``gpu``'s UUID on ``fake``."""
    value = fake.get(gpu)["uuid"]
    assert isinstance(value, str)
    return value


async def test_an_annotated_pod_brings_its_class_and_its_caps(node: Node) -> None:
    """A pod of a top-class namespace annotated high: its GPU is high (annotation, the
    workload named) within a refresh and locked at T2 high; the others stay at low's lock.
    Re-annotated low, the class follows; deleted, the GPU is idle again."""
    for gpu in range(GPUS):
        if gpu != MIG_GPU:
            await node.until_lock(gpu, LOW_MHZ)
    scheduled = time.monotonic()
    node.schedule(
        TOP_NAMESPACE,
        "chat-0",
        {GPU_RESOURCE: [node.uuid(0)]},
        annotations={"polca.io/class": "high"},
    )
    g0 = await node.until_class(0, "high", "annotation")
    assert time.monotonic() - scheduled < CLASS_WITHIN_S
    assert g0.workload is not None
    assert (g0.workload.namespace, g0.workload.pod, g0.workload.container) == (
        TOP_NAMESPACE,
        "chat-0",
        "main",
    )
    await node.until_lock(0, HIGH_MHZ)
    for gpu in (1, 2, 4, 5):
        assert node.locked_max(gpu) == LOW_MHZ, gpu
        g = node.gpu(gpu)
        assert g is not None
        assert (g.priority_class, g.class_origin, g.workload) == ("low", "idle", None)

    node.annotate(TOP_NAMESPACE, "chat-0", {"polca.io/class": "low"})
    g0 = await node.until_class(0, "low", "annotation")
    assert g0.workload is not None
    assert g0.workload.pod == "chat-0"
    await node.until_lock(0, LOW_MHZ)

    node.annotate(TOP_NAMESPACE, "chat-0", {"polca.io/class": "high"})
    await node.until_class(0, "high", "annotation")
    await node.until_lock(0, HIGH_MHZ)
    node.delete(TOP_NAMESPACE, "chat-0")
    g0 = await node.until_class(0, "low", "idle", extra=lambda g: g.workload is None)
    await node.until_lock(0, LOW_MHZ)


async def test_a_tenant_outside_the_listed_namespaces_cannot_claim_high(node: Node) -> None:
    """An unlisted namespace annotating the top class gets the next class (low), while a
    listed one on the next GPU gets high: the claim is judged by namespace."""
    node.schedule(
        "tenant-a",
        "greedy",
        {GPU_RESOURCE: [node.uuid(1)]},
        annotations={"polca.io/class": "high"},
    )
    node.schedule(
        TOP_NAMESPACE,
        "chat-1",
        {GPU_RESOURCE: [node.uuid(2)]},
        annotations={"polca.io/class": "high"},
    )
    await node.until_class(2, "high", "annotation")
    g1 = await node.until_class(1, "low", "annotation", extra=lambda g: g.workload is not None)
    assert g1.workload is not None
    assert (g1.workload.namespace, g1.workload.pod) == ("tenant-a", "greedy")
    await node.until_lock(2, HIGH_MHZ)
    # The tenant's GPU stays at low's lock, however long it asks.
    await asyncio.sleep(2 * REFRESH_S + PUBLISH_S)
    g1_now = node.gpu(1)
    assert g1_now is not None
    assert g1_now.priority_class == "low"
    assert node.locked_max(1) == LOW_MHZ


async def test_mig_instances_of_two_classes_give_the_parent_the_higher(node: Node) -> None:
    """Two pods on the two MIG devices of one GPU, high and low: the parent is high,
    attributed to the high pod, lists both instances, and is capped at T2 by its power
    limit (clock locks are refused under MIG); the high pod gone, the parent is low."""
    idle = await node.until_class(MIG_GPU, "low", "idle")
    assert set(idle.mig_instances) == {MIG_A.uuid, MIG_B.uuid}
    await wait_until(
        lambda: node.power_limit_mw(MIG_GPU) == mig_limit_mw(LOW_MHZ),
        timeout_s=CLASS_WITHIN_S,
        what=f"MIG GPU at low's power limit (now {node.power_limit_mw(MIG_GPU)} mW)",
    )
    node.schedule(
        "batch", "summarize", {MIG_RESOURCE: [MIG_B.uuid]}, annotations={"polca.io/class": "low"}
    )
    node.schedule(
        TOP_NAMESPACE,
        "search",
        {MIG_RESOURCE: [MIG_A.uuid]},
        annotations={"polca.io/class": "high"},
    )
    parent = await node.until_class(MIG_GPU, "high", "annotation")
    assert parent.workload is not None
    assert (parent.workload.namespace, parent.workload.pod) == (TOP_NAMESPACE, "search")
    assert set(parent.mig_instances) == {MIG_A.uuid, MIG_B.uuid}
    await wait_until(
        lambda: node.power_limit_mw(MIG_GPU) == mig_limit_mw(HIGH_MHZ),
        timeout_s=CLASS_WITHIN_S,
        what=f"MIG GPU at high's power limit (now {node.power_limit_mw(MIG_GPU)} mW)",
    )
    assert node.locked_max(MIG_GPU) == 0
    for gpu in range(GPUS):
        if gpu != MIG_GPU:
            assert node.power_limit_mw(gpu) == A100_LIMIT_MW, gpu  # capped by clock

    node.delete(TOP_NAMESPACE, "search")
    parent = await node.until_class(
        MIG_GPU, "low", "annotation", extra=lambda g: g.workload is not None
    )
    assert parent.workload is not None
    assert parent.workload.pod == "summarize"
    await wait_until(
        lambda: node.power_limit_mw(MIG_GPU) == mig_limit_mw(LOW_MHZ),
        timeout_s=CLASS_WITHIN_S,
        what=f"MIG GPU back at low's power limit (now {node.power_limit_mw(MIG_GPU)} mW)",
    )
    assert node.locked_max(MIG_GPU) == 0


def _unhealthy_since(node: Node, since: int) -> Status | None:
    """The first status after ``since`` (a probe message count) with the source unhealthy."""
    statuses = [m for m in node.probe.of("status")[since:] if isinstance(m, Status)]
    return next((s for s in statuses if s.assignment_healthy is False), None)


async def _outage(
    node: Node, begin: Callable[[], None], end: Callable[[], None], what: str
) -> None:
    """``begin`` an outage: unhealthy with a reason, the last map kept for the grace, then
    every GPU at the fallback (low); ``end`` it: healthy, the classes back."""
    node.schedule(
        TOP_NAMESPACE,
        "chat-0",
        {GPU_RESOURCE: [node.uuid(0)]},
        annotations={"polca.io/class": "high"},
    )
    await node.until_class(0, "high", "annotation")
    await node.until_lock(0, HIGH_MHZ)
    statuses_before = len(node.probe.of("status"))
    began = time.monotonic()
    await asyncio.to_thread(begin)
    await wait_until(
        lambda: _unhealthy_since(node, statuses_before) is not None,
        timeout_s=GRACE_S + 10,
        what="a status with the assignment source unhealthy",
    )
    unhealthy = _unhealthy_since(node, statuses_before)
    assert unhealthy is not None
    assert unhealthy.assignment_reason, unhealthy
    assert what in unhealthy.assignment_reason, unhealthy.assignment_reason
    telemetry_then = len(node.probe.of("telemetry"))
    kept = time.monotonic()

    def fallen() -> bool:
        last = node.telemetry()
        return last is not None and all(
            g.priority_class == "low" and g.class_origin == "fallback" for g in last.gpus
        )

    await wait_until(fallen, timeout_s=GRACE_S + 15, what="every GPU at the fallback class")
    fell = time.monotonic()
    # The last map stood through the grace: nothing fell back before it ran out (the last
    # good read was at most a refresh before the outage began).
    assert fell - began >= GRACE_S - REFRESH_S, fell - began
    between = [m for m in node.probe.of("telemetry")[telemetry_then:] if isinstance(m, Telemetry)]
    kept_map = [m for m in between if m.gpus[0].class_origin == "annotation"]
    if fell - kept > PUBLISH_S * 2:  # the grace had not run out when the status came
        assert kept_map, "no telemetry with the last map kept while within the grace"
    for m in kept_map:
        assert m.gpus[0].priority_class == "high"
    await node.until_lock(0, LOW_MHZ)
    status = node.status()
    assert status is not None
    assert status.assignment_healthy is False
    assert status.assignment_reason

    await asyncio.to_thread(end)
    await wait_until(
        lambda: (s := node.status()) is not None and s.assignment_healthy is True,
        timeout_s=45,
        what="a healthy source again",
    )
    await node.until_class(0, "high", "annotation", timeout_s=15)
    await node.until_lock(0, HIGH_MHZ)
    for gpu in (1, 2, 4, 5):
        await node.until_class(gpu, "low", "idle")


async def test_kubelet_gone_keeps_the_map_for_the_grace_then_falls_back(node: Node) -> None:
    """The kubelet killed: unhealthy at once, the last map for ``grace_s``, then the
    fallback; the kubelet back, the classes return."""
    await _outage(node, node.kubelet.kill, node.kubelet.start, "pod-resources")


async def test_api_outage_keeps_the_map_for_the_grace_then_falls_back(node: Node) -> None:
    """The API answering 503 (its watches cut): the same, then healthy once it serves."""
    await _outage(node, lambda: node.api.fault("outage"), lambda: node.api.fault("none"), "503")


async def test_a_long_outage_is_reported_once_not_every_second(node: Node) -> None:
    """An outage well past the grace: the status says unhealthy twice at most (the last
    map kept, then the fallback) and the log warns as often, however long it lasts."""
    statuses_before = len(node.probe.of("status"))

    def warnings() -> int:
        return sum(1 for e in node.agent.logs() if e.get("event") == "assignment_source_failed")

    warned_before = warnings()
    await asyncio.to_thread(node.kubelet.kill)
    await asyncio.sleep(GRACE_S + 6.0)
    unhealthy = [
        m
        for m in node.probe.of("status")[statuses_before:]
        if isinstance(m, Status) and m.assignment_healthy is False
    ]
    assert unhealthy, "no unhealthy status at all"
    reasons = [s.assignment_reason for s in unhealthy]
    assert len(unhealthy) <= 2, reasons
    assert warnings() - warned_before <= 2, reasons
