"""The kubelet's pod-resources API as a real gRPC server on a unix socket, for the tests.

Run as a process, ``python -m tests.standins.kubelet --socket PATH --state FILE``: it serves
``v1.PodResourcesLister`` from the generated stubs (``polca.assign._pb``) like a kubelet does:
``List`` answers every pod's containers' devices, ``GetAllocatableResources`` the node's
allocatable devices, and ``Get`` is ``UNIMPLEMENTED`` (a kubelet without the
``KubeletPodResourcesGet`` feature gate). Like the kubelet's device manager, it reports one
device group per device (with its NUMA node when given), in no promised order.

The state is a JSON file, read at every call and used anew when it changed (so a test
schedules and deletes pods while the server runs; ``KubeletStandIn`` writes it atomically)::

    {"pods": [{"namespace": "ns", "name": "pod", "containers": [
         {"name": "c", "devices": [{"resource": "nvidia.com/gpu", "ids": ["GPU-..."],
                                    "numa": 0, "grouped": false}]}]}],
     "allocatable": [{"resource": "nvidia.com/gpu", "ids": ["GPU-..."]}],
     "hostile": null}

``grouped`` sends a device entry's ids as one group (as kubelets before 1.21 did) instead of
one group per id. ``hostile`` makes ``List`` misbehave where valid state cannot: ``garbage``
(bytes that are not a message), ``huge`` (a valid message of 20 MiB), ``slow`` (answers after
``delay_s``, default 5), ``rate_limited`` (``RESOURCE_EXHAUSTED`` as the kubelet's rate
limiter sends it); ``no_allocatable`` makes ``GetAllocatableResources`` ``UNIMPLEMENTED``
(a kubelet before 1.21, or with its feature gate off). Everything else hostile (10,000
pods, bad names, a 10 kB device id) is plain state: the stand-in checks nothing, as a
broken or hostile kubelet would not.

``KubeletStandIn`` is that process as a ``tests.services.ServiceProcess``: start, stop, kill,
``set_pods``, ``set_allocatable``, ``set_hostile``; ``pod`` builds one pod's state.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]

from polca.assign._pb import api_pb2, api_pb2_grpc
from tests.services import ServiceProcess

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVICE = "v1.PodResourcesLister"
HUGE_BYTES = 20 * 1024 * 1024

Json = dict[str, Any]


def pod(
    namespace: str,
    name: str,
    containers: Mapping[str, Mapping[str, Sequence[str]]],
    *,
    grouped: bool = False,
) -> Json:
    """One pod's state: ``containers`` maps a container's name to resource -> device ids."""
    return {
        "namespace": namespace,
        "name": name,
        "containers": [
            {
                "name": cname,
                "devices": [
                    {"resource": resource, "ids": list(ids), "grouped": grouped}
                    for resource, ids in devices.items()
                ],
            }
            for cname, devices in containers.items()
        ],
    }


class _State:
    """The state file, read at every call and decoded again when its bytes changed."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._seen: bytes | None = None
        self._lock = threading.Lock()
        self.hostile: str | None = None
        self.delay_s = 5.0
        self.list_answer = api_pb2.ListPodResourcesResponse()
        self.allocatable_answer = api_pb2.AllocatableResourcesResponse()

    def refresh(self) -> None:
        with self._lock:
            try:
                raw = self._path.read_bytes()
            except FileNotFoundError:
                return
            if raw == self._seen:
                return
            data = json.loads(raw)
            self.list_answer = api_pb2.ListPodResourcesResponse(
                pod_resources=[_pod_resources(p) for p in data.get("pods", [])]
            )
            self.allocatable_answer = api_pb2.AllocatableResourcesResponse(
                devices=_groups(data.get("allocatable", []))
            )
            self.hostile = data.get("hostile")
            self.delay_s = float(data.get("delay_s", 5.0))
            self._seen = raw


def _pod_resources(state: Json) -> Any:
    return api_pb2.PodResources(
        name=state["name"],
        namespace=state["namespace"],
        containers=[
            api_pb2.ContainerResources(name=c["name"], devices=_groups(c.get("devices", [])))
            for c in state.get("containers", [])
        ],
    )


def _groups(devices: Sequence[Json]) -> list[Any]:
    """The kubelet's device groups: one per device id (and NUMA node), unless ``grouped``."""
    groups = []
    for entry in devices:
        topology = None
        if entry.get("numa") is not None:
            topology = api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=int(entry["numa"]))])
        ids = list(entry["ids"])
        chunks = [ids] if entry.get("grouped") else [[device] for device in ids]
        groups += [
            api_pb2.ContainerDevices(
                resource_name=entry["resource"], device_ids=chunk, topology=topology
            )
            for chunk in chunks
        ]
    return groups


class _Lister(api_pb2_grpc.PodResourcesListerServicer):
    """The servicer; ``Get`` stays the generated base's ``UNIMPLEMENTED``."""

    def __init__(self, state: _State) -> None:
        self._state = state

    def List(self, request: Any, context: Any) -> Any:  # noqa: N802 - the RPC's name
        self._state.refresh()
        hostile = self._state.hostile
        if hostile == "garbage":
            return b"\x0a\xff\xff\xff\xff\x0f\x01\x02"  # a field longer than the message
        if hostile == "huge":
            name = "a" * HUGE_BYTES
            return api_pb2.ListPodResourcesResponse(
                pod_resources=[api_pb2.PodResources(name=name, namespace="default")]
            )
        if hostile == "slow":
            time.sleep(self._state.delay_s)
        if hostile == "rate_limited":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")
        return self._state.list_answer

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._state.refresh()
        if self._state.hostile == "no_allocatable":
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "unknown method")
        return self._state.allocatable_answer


def _serialize(response: Any) -> bytes:
    """A message's bytes, or raw bytes as they are (the hostile answers)."""
    if isinstance(response, bytes):
        return response
    data: bytes = response.SerializeToString()
    return data


def _handler(servicer: _Lister) -> Any:
    """The service's handlers: the generated stubs' messages, a serializer that lets raw
    bytes through (the generated ``add_..._to_server`` would not)."""

    def unary(method: Callable[[Any, Any], Any], request: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(
            method, request_deserializer=request.FromString, response_serializer=_serialize
        )

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "List": unary(servicer.List, api_pb2.ListPodResourcesRequest),
            "GetAllocatableResources": unary(
                servicer.GetAllocatableResources, api_pb2.AllocatableResourcesRequest
            ),
            "Get": unary(servicer.Get, api_pb2.GetPodResourcesRequest),
        },
    )


def serve(socket_path: Path, state_path: Path) -> None:
    """Serve until SIGTERM or SIGINT."""
    state = _State(state_path)
    state.refresh()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((_handler(_Lister(state)),))
    socket_path.unlink(missing_ok=True)  # a stale socket of a killed run, as kubelet does
    server.add_insecure_port(f"unix://{socket_path.absolute()}")
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=0.5).wait()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m tests.standins.kubelet --socket PATH --state FILE``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--state", type=Path, required=True)
    args = parser.parse_args(argv)
    serve(args.socket, args.state)


class KubeletStandIn(ServiceProcess):
    """The stand-in kubelet as a test service on ``socket_path`` (state in ``workdir``).

    Keep ``socket_path`` short (``sun_path`` holds 107 bytes): pytest's ``tmp_path`` can
    be too long.
    """

    name = "kubelet-standin"

    def __init__(self, workdir: Path, socket_path: Path) -> None:
        self.socket_path = socket_path
        super().__init__(workdir, port=0)  # no TCP port: the service is the unix socket
        self.state_path = workdir / "kubelet-state.json"
        self._state: Json = {"pods": [], "allocatable": [], "hostile": None}
        self._write()

    def set_pods(self, pods: Sequence[Json]) -> None:
        """The pods on the node from now on (see ``pod``)."""
        self._state["pods"] = list(pods)
        self._write()

    def set_allocatable(self, devices: Mapping[str, Sequence[str]]) -> None:
        """The node's allocatable devices from now on: resource -> device ids."""
        self._state["allocatable"] = [
            {"resource": resource, "ids": list(ids)} for resource, ids in devices.items()
        ]
        self._write()

    def set_hostile(self, mode: str | None, *, delay_s: float = 5.0) -> None:
        """``garbage``, ``huge``, ``slow`` (after ``delay_s``), ``rate_limited``,
        ``no_allocatable``, or None (a well-behaved kubelet)."""
        self._state["hostile"] = mode
        self._state["delay_s"] = delay_s
        self._write()

    def _write(self) -> None:
        # Atomic: the server never reads half a file.
        partial = self.state_path.with_suffix(".partial")
        partial.write_text(json.dumps(self._state), encoding="utf-8")
        partial.replace(self.state_path)

    def _argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "tests.standins.kubelet",
            "--socket",
            str(self.socket_path),
            "--state",
            str(self.state_path),
        ]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        return env

    def _ready(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            probe.connect(str(self.socket_path))
        return True


if __name__ == "__main__":
    main()
