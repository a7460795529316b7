"""The kubelet pod-resources client against a real gRPC server on a unix socket.

Every test talks to ``tests.standins.kubelet`` run as a separate process (a real gRPC server
built from the same generated stubs, as the kubelet is a separate process), through
``polca.assign.podresources.PodResourcesClient``: what it lists and how it fails. The last
test checks that the committed stubs are what ``scripts/gen-podresources.sh`` writes from
the vendored proto.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from polca.assign.model import PodDevices
from polca.assign.podresources import (
    MAX_CONTAINERS_PER_POD,
    MAX_DEVICE_GROUPS_PER_CONTAINER,
    MAX_DEVICE_IDS_PER_GROUP,
    MAX_PODS,
    PodResourcesClient,
)
from polca.errors import ReadingRejectedError, TransportError
from tests.services import started
from tests.standins.kubelet import KubeletStandIn, pod

ROOT = Path(__file__).resolve().parents[2]
GPU = "nvidia.com/gpu"
MIG = "nvidia.com/mig-1g.10gb"
GPU_A = "GPU-5a1c8e2e-4f0b-8d7e-1b2c-3d4e5f6a7b8c"
GPU_B = "GPU-0b7e1f3a-92c4-4a5d-b6e7-f8091a2b3c4d"
GPU_C = "GPU-9c8b7a6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d"
MIG_1 = "MIG-11111111-2222-4333-8444-555555555555"
MIG_2 = "MIG-66666666-7777-4888-9999-aaaaaaaaaaaa"


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short folder for the socket: ``sun_path`` holds 107 bytes, ``tmp_path`` may not."""
    path = Path(tempfile.mkdtemp(prefix="polca-kl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(tmp_path: Path, socket_dir: Path) -> Iterator[KubeletStandIn]:
    """A stand-in kubelet, started with no pods."""
    yield from started(KubeletStandIn(tmp_path / "kubelet", socket_dir / "kubelet.sock"))


def _client(kubelet: KubeletStandIn, **kwargs: Any) -> PodResourcesClient:
    return PodResourcesClient(kubelet.socket_path, **kwargs)


def _training_node(kubelet: KubeletStandIn) -> None:
    """Two GPU pods (one with two GPU containers and a device-less sidecar), a MIG pod, and
    devices of other plugins that the client must leave out."""
    kubelet.set_pods(
        [
            pod(
                "train",
                "job-0",
                {
                    "trainer": {GPU: [GPU_B, GPU_A], "rdma/hca_shared_devices_a": ["r0"]},
                    "evaluator": {GPU: [GPU_C]},
                    "log-shipper": {},
                },
            ),
            pod("infer", "llm-7f9c.replica-1", {"server": {MIG: [MIG_2, MIG_1]}}),
            pod("net", "sriov-0", {"app": {"intel.com/sriov_netdevice": ["0000:3b:02.0"]}}),
            pod("kube-system", "coredns-5d78c9869d-x2x4q", {"coredns": {}}),
        ]
    )


EXPECTED_TRAINING = (
    PodDevices("train", "job-0", "trainer", GPU, (GPU_B, GPU_A)),
    PodDevices("train", "job-0", "evaluator", GPU, (GPU_C,)),
    PodDevices("infer", "llm-7f9c.replica-1", "server", MIG, (MIG_1, MIG_2)),
)


async def test_list_reports_gpu_and_mig_devices_per_container(kubelet: KubeletStandIn) -> None:
    """GPU and MIG UUIDs per container, ids sorted, other plugins' devices left out."""
    _training_node(kubelet)
    async with _client(kubelet) as client:
        devices = await client.list_devices()
    assert devices == EXPECTED_TRAINING


async def test_groups_of_one_resource_are_merged(kubelet: KubeletStandIn) -> None:
    """The kubelet sends one group per device and NUMA node (a device on two nodes comes
    twice); older kubelets one group per resource: both read the same."""
    one_per_device = pod("train", "job-0", {"trainer": {GPU: [GPU_A, GPU_B, GPU_A]}})
    one_group = pod("train", "job-1", {"trainer": {GPU: [GPU_B, GPU_A]}}, grouped=True)
    kubelet.set_pods([one_per_device, one_group])
    async with _client(kubelet) as client:
        devices = await client.list_devices()
    assert devices == (
        PodDevices("train", "job-0", "trainer", GPU, (GPU_B, GPU_A)),
        PodDevices("train", "job-1", "trainer", GPU, (GPU_B, GPU_A)),
    )


async def test_resource_prefixes_choose_the_resources(kubelet: KubeletStandIn) -> None:
    """Another vendor's prefix keeps its devices and leaves NVIDIA's out."""
    kubelet.set_pods([pod("ml", "mixed", {"a": {GPU: [GPU_A], "amd.com/gpu": ["0000:c1:00.0"]}})])
    kubelet.set_allocatable({GPU: [GPU_A], "amd.com/gpu": ["0000:c1:00.0", "0000:c2:00.0"]})
    async with _client(kubelet, resource_prefixes=("amd.com/",)) as client:
        assert await client.list_devices() == (
            PodDevices("ml", "mixed", "a", "amd.com/gpu", ("0000:c1:00.0",)),
        )
        assert await client.allocatable() == ("0000:c1:00.0", "0000:c2:00.0")


async def test_allocatable_lists_gpu_and_mig_devices(kubelet: KubeletStandIn) -> None:
    """Every allocatable device of the kept resources, sorted, others left out."""
    kubelet.set_allocatable(
        {
            GPU: [GPU_C, GPU_A, GPU_B],
            MIG: [MIG_2, MIG_1],
            "rdma/hca_shared_devices_a": ["r0", "r1"],
        }
    )
    async with _client(kubelet) as client:
        assert await client.allocatable() == tuple(sorted([GPU_A, GPU_B, GPU_C, MIG_1, MIG_2]))


async def test_an_empty_node_has_no_devices(kubelet: KubeletStandIn) -> None:
    async with _client(kubelet) as client:
        assert await client.list_devices() == ()
        assert await client.allocatable() == ()


async def test_pods_scheduled_and_deleted_are_seen_at_the_next_call(
    kubelet: KubeletStandIn,
) -> None:
    """One client, one channel: every call reads the kubelet's state of that moment."""
    first = pod("train", "job-0", {"trainer": {GPU: [GPU_A]}})
    second = pod("train", "job-1", {"trainer": {GPU: [GPU_B]}})
    async with _client(kubelet) as client:
        kubelet.set_pods([first])
        assert [d.pod for d in await client.list_devices()] == ["job-0"]
        kubelet.set_pods([first, second])
        assert [d.pod for d in await client.list_devices()] == ["job-0", "job-1"]
        kubelet.set_pods([second])
        assert [d.pod for d in await client.list_devices()] == ["job-1"]
        kubelet.set_pods([])
        assert await client.list_devices() == ()


async def test_a_missing_socket_is_a_transport_error_at_once(socket_dir: Path) -> None:
    """No kubelet (or its directory not mounted): TransportError well before the deadline
    (20 s here, so that a loaded machine cannot be mistaken for waiting on it)."""
    async with PodResourcesClient(socket_dir / "kubelet.sock", timeout_s=20.0) as client:
        start = time.monotonic()
        with pytest.raises(TransportError, match="does not exist"):
            await client.list_devices()
        with pytest.raises(TransportError):
            await client.allocatable()
        assert time.monotonic() - start < 10.0


async def test_a_killed_kubelet_is_a_transport_error_until_it_is_back(
    kubelet: KubeletStandIn,
) -> None:
    """SIGKILL leaves the socket file with nobody listening; the same client reads again
    as soon as the kubelet is back."""
    _training_node(kubelet)
    async with _client(kubelet, timeout_s=20.0) as client:
        assert len(await client.list_devices()) == 3
        await asyncio.to_thread(kubelet.kill)
        assert kubelet.socket_path.exists()
        start = time.monotonic()
        with pytest.raises(TransportError):
            await client.list_devices()
        assert time.monotonic() - start < 10.0, "waited for the deadline, not refused at once"
        await asyncio.to_thread(kubelet.start)
        assert len(await client.list_devices()) == 3


async def test_a_kubelet_past_the_deadline_is_a_transport_error(kubelet: KubeletStandIn) -> None:
    """An answer later than ``timeout_s`` is abandoned at the deadline; the next, prompt
    answer is read."""
    _training_node(kubelet)
    kubelet.set_hostile("slow", delay_s=10.0)
    async with _client(kubelet, timeout_s=0.3) as client:
        start = time.monotonic()
        with pytest.raises(TransportError, match=r"no answer within 0\.3 s"):
            await client.list_devices()
        assert time.monotonic() - start < 8.0, "waited for the answer (10 s), not the deadline"
        kubelet.set_hostile(None)
        assert len(await client.list_devices()) == 3


async def test_the_rate_limit_is_a_transport_error(kubelet: KubeletStandIn) -> None:
    """The kubelet's rate limiter answers RESOURCE_EXHAUSTED too, but it is not oversized."""
    kubelet.set_hostile("rate_limited")
    async with _client(kubelet) as client:
        with pytest.raises(TransportError, match="RESOURCE_EXHAUSTED"):
            await client.list_devices()


async def test_a_kubelet_without_allocatable_is_unsupported(kubelet: KubeletStandIn) -> None:
    kubelet.set_hostile("no_allocatable")
    async with _client(kubelet) as client:
        with pytest.raises(ReadingRejectedError) as caught:
            await client.allocatable()
        assert caught.value.reason == "unsupported"


def _gpu_pods(count: int, *, containers: int = 1, gpus: int = 1) -> list[dict[str, Any]]:
    return [
        pod(
            f"ns-{i % 50}",
            f"job-{i}",
            {
                f"c{c}": {GPU: [f"GPU-{i:08x}-{c:04x}-{g:04x}" for g in range(gpus)]}
                for c in range(containers)
            },
        )
        for i in range(count)
    ]


def _bad_pod(**changes: str) -> dict[str, Any]:
    fields = {"namespace": "train", "name": "job-0", "container": "trainer", "device": GPU_A}
    fields.update(changes)
    return pod(
        fields["namespace"],
        fields["name"],
        {fields["container"]: {fields.get("resource", GPU): [fields["device"]]}},
    )


HOSTILE_STATES: dict[str, tuple[str, Any]] = {
    "10,000 pods": ("oversized", lambda: _gpu_pods(10_000)),
    "a pod of 65 containers": (
        "oversized",
        lambda: _gpu_pods(1, containers=MAX_CONTAINERS_PER_POD + 1),
    ),
    "a container of 65 GPUs": (
        "oversized",
        lambda: _gpu_pods(1, gpus=MAX_DEVICE_GROUPS_PER_CONTAINER + 1),
    ),
    "a group of 257 ids": (
        "oversized",
        lambda: [
            pod(
                "x",
                "y",
                {"z": {GPU: [f"GPU-{i}" for i in range(MAX_DEVICE_IDS_PER_GROUP + 1)]}},
                grouped=True,
            )
        ],
    ),
    "a group of 257 ids of another resource": (
        "oversized",
        lambda: [
            pod(
                "x",
                "y",
                {"z": {"example.com/nic": [str(i) for i in range(MAX_DEVICE_IDS_PER_GROUP + 1)]}},
                grouped=True,
            )
        ],
    ),
    "an upper-case namespace": ("malformed", lambda: [_bad_pod(namespace="Train")]),
    "an empty namespace": ("malformed", lambda: [_bad_pod(namespace="")]),
    "a pod name of 254 chars": ("malformed", lambda: [_bad_pod(name="a" * 254)]),
    "a pod name with a slash": ("malformed", lambda: [_bad_pod(name="job/0")]),
    "a container name of 64 chars": ("malformed", lambda: [_bad_pod(container="c" * 64)]),
    "a container name with a dot": ("malformed", lambda: [_bad_pod(container="a.b")]),
    "a device id of 10 kB": ("malformed", lambda: [_bad_pod(device="GPU-" + "f" * 10_000)]),
    "a device id with a space": ("malformed", lambda: [_bad_pod(device="GPU 0")]),
    "a device id with a control char": ("malformed", lambda: [_bad_pod(device="GPU-\x1b[2J")]),
    "an empty device id": ("malformed", lambda: [_bad_pod(device="")]),
    "a resource without a domain": ("malformed", lambda: [_bad_pod(resource="gpu")]),
    "a resource with a bad domain": ("malformed", lambda: [_bad_pod(resource="nvidia_com/gpu")]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_STATES))
async def test_a_hostile_answer_is_refused_whole(kubelet: KubeletStandIn, case: str) -> None:
    """Beyond a bound (``oversized``) or breaking a rule (``malformed``): the whole answer
    is refused, next to a good pod, and the next good answer is read again."""
    reason, pods = HOSTILE_STATES[case]
    good = pod("ok", "fine", {"c": {GPU: [GPU_C]}})
    kubelet.set_pods([good, *pods()])
    async with _client(kubelet) as client:
        with pytest.raises(ReadingRejectedError) as caught:
            await client.list_devices()
        assert caught.value.reason == reason, caught.value
        kubelet.set_pods([good])
        assert await client.list_devices() == (PodDevices("ok", "fine", "c", GPU, (GPU_C,)),)


@pytest.mark.parametrize(("mode", "reason"), [("huge", "oversized"), ("garbage", "malformed")])
async def test_an_undecodable_answer_is_refused(
    kubelet: KubeletStandIn, mode: str, reason: str
) -> None:
    """20 MiB (over the receive limit, never decoded) or bytes that are not a message."""
    kubelet.set_hostile(mode)
    async with _client(kubelet) as client:
        with pytest.raises(ReadingRejectedError) as caught:
            await client.list_devices()
        assert caught.value.reason == reason, caught.value
        kubelet.set_hostile(None)
        assert await client.list_devices() == ()


async def test_thousands_of_pods_within_the_bounds_are_read_whole(
    kubelet: KubeletStandIn,
) -> None:
    """2,000 pods of 2 containers with 4 GPUs each are read whole; and the bound itself,
    4,096 pods, is accepted. (How fast: bench/bench_assignment.py, ``large_read``.)"""
    kubelet.set_pods(_gpu_pods(2000, containers=2, gpus=4))
    async with _client(kubelet) as client:
        devices = await client.list_devices()
        assert len(devices) == 4000
        assert all(len(d.device_ids) == 4 for d in devices)
        assert len({(d.namespace, d.pod, d.container) for d in devices}) == 4000
        kubelet.set_pods(_gpu_pods(MAX_PODS))
        assert len(await client.list_devices()) == MAX_PODS


# The generator's version stamps: which grpcio-tools and protobuf releases wrote the stubs.
# They are the only bytes a patch release of the generator changes; the stubs refuse a
# runtime older than their stamps, which test_the_stubs_stamps_are_within_the_declared_floors
# keeps within pyproject.toml's floors.
_GRPC_STAMP = re.compile(rb"^GRPC_GENERATED_VERSION = '([^']*)'$", re.MULTILINE)
_PROTOBUF_HEADER = re.compile(rb"^# Protobuf Python Version: (\S+)$", re.MULTILINE)
_PROTOBUF_CHECK = re.compile(
    rb"(ValidateProtobufRuntimeVersion\(\n\s*_runtime_version\.Domain\.PUBLIC,\n)"
    rb"\s*(\d+),\n\s*(\d+),\n\s*(\d+),\n\s*'([^']*)',\n"
)
_STUBS = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")
COMMITTED = ROOT / "daemon" / "polca" / "assign" / "_pb"
PROTO = ROOT / "daemon" / "polca" / "assign" / "proto" / "podresources_v1.proto"


def _unstamped(code: bytes) -> bytes:
    """Generated code with its version stamps replaced by a placeholder."""
    code = _GRPC_STAMP.sub(b"GRPC_GENERATED_VERSION = '<stamp>'", code)
    code = _PROTOBUF_HEADER.sub(b"# Protobuf Python Version: <stamp>", code)
    return _PROTOBUF_CHECK.sub(rb"\1    <stamp>\n", code)


def _generate(out: Path, proto: Path = PROTO) -> None:
    """Run scripts/gen-podresources.sh into ``out`` with this test's interpreter."""
    env = dict(os.environ, PYTHON=sys.executable, PROTO=str(proto))
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen-podresources.sh"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def _stale(committed: Path, fresh: Path) -> list[str]:
    """The stubs in ``committed`` whose code differs from ``fresh`` beyond the stamps."""
    return [
        name
        for name in _STUBS
        if _unstamped((committed / name).read_bytes()) != _unstamped((fresh / name).read_bytes())
    ]


def _stamps(stubs: Path) -> dict[str, Version]:
    """The grpcio and protobuf releases the stubs record (and refuse to run below)."""
    grpc_stamp = _GRPC_STAMP.search((stubs / "api_pb2_grpc.py").read_bytes())
    check = _PROTOBUF_CHECK.search((stubs / "api_pb2.py").read_bytes())
    assert grpc_stamp is not None
    assert check is not None
    major, minor, patch, suffix = (part.decode() for part in check.groups()[1:])
    return {
        "grpcio": Version(grpc_stamp.group(1).decode()),
        "protobuf": Version(f"{major}.{minor}.{patch}{suffix}"),
    }


def _declared_floors() -> dict[str, Version]:
    """``name -> floor`` of every ``name>=X`` runtime dependency in pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    floors: dict[str, Version] = {}
    for dep in project["dependencies"]:
        match = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([0-9][^,;]*)", dep)
        if match:
            floors[match.group(1).lower()] = Version(match.group(2))
    return floors


def test_stubs_are_current(tmp_path: Path) -> None:
    """The committed stubs are what ``scripts/gen-podresources.sh`` writes from the vendored
    proto now, byte for byte but for the generator's version stamps: a changed proto, a hand
    edit, or a generator that writes different code fails here; a patch release of the
    generator (a new stamp alone) does not."""
    _generate(tmp_path)
    stale = _stale(COMMITTED, tmp_path)
    assert not stale, (
        f"{', '.join(stale)} in {COMMITTED} is stale: run scripts/gen-podresources.sh and commit it"
    )
    assert b"from . import api_pb2" in (COMMITTED / "api_pb2_grpc.py").read_bytes()


def test_the_stubs_stamps_are_within_the_declared_floors() -> None:
    """The stubs refuse a grpcio or protobuf older than the releases that wrote them: those
    stamps may not be above pyproject.toml's floors, or a runtime the ranges allow would be
    refused at import (regenerating with a newer generator means raising the floors)."""
    floors = _declared_floors()
    for name, stamp in _stamps(COMMITTED).items():
        assert stamp <= floors[name], (
            f"the stubs need {name} {stamp}, above the declared floor {floors[name]}: "
            "raise it in pyproject.toml or regenerate with the floor's grpcio-tools"
        )


def test_a_hand_edit_or_a_changed_proto_is_stale_a_new_stamp_is_not(tmp_path: Path) -> None:
    """What the freshness check compares: it fails on an edited stub and on stubs of a changed
    proto, and passes stubs that differ from the committed ones only in their stamps."""
    restamped = tmp_path / "restamped"
    restamped.mkdir()
    for name in _STUBS:
        code = (COMMITTED / name).read_bytes()
        code = _GRPC_STAMP.sub(b"GRPC_GENERATED_VERSION = '9.99.9'", code)
        code = _PROTOBUF_HEADER.sub(b"# Protobuf Python Version: 9.99.9", code)
        (restamped / name).write_bytes(code)
    assert (restamped / "api_pb2_grpc.py").read_bytes() != (
        COMMITTED / "api_pb2_grpc.py"
    ).read_bytes()
    assert _stale(restamped, COMMITTED) == []

    edited = tmp_path / "edited"
    shutil.copytree(COMMITTED, edited)
    grpc_stub = edited / "api_pb2_grpc.py"
    grpc_stub.write_bytes(grpc_stub.read_bytes().replace(b"def List(", b"def List_(", 1))
    assert _stale(edited, COMMITTED) == ["api_pb2_grpc.py"]

    changed = tmp_path / "changed.proto"
    text = PROTO.read_text(encoding="utf-8")
    marker = "message ListPodResourcesRequest {}"
    assert marker in text
    changed.write_text(
        text.replace(marker, "message ListPodResourcesRequest {\n    string namespace = 1;\n}"),
        encoding="utf-8",
    )
    fresh = tmp_path / "fresh"
    _generate(fresh, changed)
    assert _stale(COMMITTED, fresh) == ["api_pb2.py", "api_pb2.pyi"]
