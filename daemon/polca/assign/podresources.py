"""Which pod and container holds which GPU on this node: the kubelet's pod-resources API.

The kubelet serves ``v1.PodResourcesLister`` over gRPC on a unix socket
(``/var/lib/kubelet/pod-resources/kubelet.sock``, mounted read-only into the agent's pod).
``PodResourcesClient.list_devices`` asks it (``List``) for every pod's containers' devices and
returns one ``PodDevices`` per (pod, container, resource); ``allocatable``
(``GetAllocatableResources``) returns the ids of every device the kubelet can hand out. Only
resources whose name starts with one of ``resource_prefixes`` are kept (default
``nvidia.com/``: ``nvidia.com/gpu`` with GPU UUIDs or indices, and the MIG resources
``nvidia.com/mig-<profile>`` with MIG device UUIDs). The kubelet reports one device group per
device and NUMA node, in Go map order; the groups of one container and resource are merged
here, their ids deduplicated and sorted, so two answers with the same allocation compare equal.
This is the only polca module that imports ``grpc`` (with the generated stubs in ``_pb``).

How it fails (nothing else escapes; no call logs anything, the caller counts and logs):

- ``TransportError``: the socket is missing or nobody listens on it (kubelet down or
  restarting), the answer did not come within ``timeout_s`` (the per-call deadline), the
  kubelet's rate limit refused the call, or any other gRPC failure. The channel is dropped
  then, so the next call connects afresh (no reconnect backoff left over from the outage).
- ``ReadingRejectedError``: the kubelet answered, but not with something polca can use:
  ``oversized`` (a message over ``MAX_MESSAGE_BYTES``, refused by gRPC before decoding, or
  more pods, containers, device groups or device ids than the bounds below), ``malformed``
  (not a decodable message, or a namespace, pod or container name that breaks Kubernetes'
  DNS-1123 rules, a resource name that is not a qualified extended resource name, a kept
  device id that is empty, longer than ``MAX_DEVICE_ID_CHARS`` or not printable ASCII),
  ``unsupported`` (a kubelet without that RPC: ``UNIMPLEMENTED``).

A bad answer is refused as a whole, never used in part: the caller treats every GPU no
listed pod holds as idle, so dropping the pods that failed a check would silently turn
their GPUs idle (and re-class them), which is worse than keeping the last good map or the
fail-safe fallback, which is what the caller does with the error. Counts are checked for
every device group (they bound the work), names and ids only where polca reads them: the
device ids of resources outside ``resource_prefixes`` belong to other device plugins.

Keeping the stubs current: the proto is vendored in ``assign/proto/podresources_v1.proto``
(from the kubernetes repository, without the gogo options); ``scripts/gen-podresources.sh``
regenerates ``assign/_pb``, and ``tests/assign/test_podresources.py::test_stubs_are_current``
fails when the committed stubs differ from what that script writes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final, Self

import grpc  # type: ignore[import-untyped]

from polca.assign._pb import api_pb2
from polca.assign.model import PodDevices
from polca.errors import PolcaError, ReadingRejectedError, TransportError

__all__ = [
    "DEFAULT_RESOURCE_PREFIXES",
    "DEFAULT_SOCKET",
    "MAX_ALLOCATABLE_GROUPS",
    "MAX_CONTAINERS_PER_POD",
    "MAX_DEVICE_GROUPS_PER_CONTAINER",
    "MAX_DEVICE_IDS_PER_GROUP",
    "MAX_DEVICE_ID_CHARS",
    "MAX_MESSAGE_BYTES",
    "MAX_PODS",
    "PodResourcesClient",
]

DEFAULT_SOCKET: Final = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
"""Where the kubelet serves the pod-resources API."""
DEFAULT_RESOURCE_PREFIXES: Final = ("nvidia.com/",)
"""Resources kept by default: NVIDIA's device plugin (GPUs and MIG devices)."""
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
"""The largest answer gRPC accepts (4,096 pods of 8 GPUs take well under 1 MiB)."""
MAX_PODS: Final = 4096
"""Pods in one ``List`` answer (the kubelet's default ``maxPods`` is 110)."""
MAX_CONTAINERS_PER_POD: Final = 64
"""Containers (init and sidecar containers included) of one pod."""
MAX_DEVICE_GROUPS_PER_CONTAINER: Final = 64
"""Device groups of one container: the kubelet sends one per device and NUMA node."""
MAX_ALLOCATABLE_GROUPS: Final = 4096
"""Device groups in one ``GetAllocatableResources`` answer (one per device and NUMA node)."""
MAX_DEVICE_IDS_PER_GROUP: Final = 256
"""Device ids in one group."""
MAX_DEVICE_ID_CHARS: Final = 128
"""The longest device id kept (a GPU UUID has 40 characters, a MIG UUID 40)."""

_MAX_LABEL_CHARS: Final = 63
_MAX_SUBDOMAIN_CHARS: Final = 253
_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*")
_RESOURCE_NAME = re.compile(r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DEVICE_ID = re.compile(r"[\x21-\x7e]+")
_SERVICE: Final = api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
_TOO_LARGE: Final = "larger than max"
"""Part of gRPC's own status details when an answer exceeds the receive limit; the kubelet
uses the same status code (``RESOURCE_EXHAUSTED``) for its rate limit, so the details are
the only way to tell the two apart."""


class PodResourcesClient:
    """A client of one kubelet's pod-resources API; one channel, opened on first use."""

    def __init__(
        self,
        socket_path: Path = DEFAULT_SOCKET,
        *,
        timeout_s: float = 2.0,
        resource_prefixes: Sequence[str] = DEFAULT_RESOURCE_PREFIXES,
    ) -> None:
        """``timeout_s`` is each call's deadline; ``resource_prefixes`` the resources kept."""
        if timeout_s <= 0:
            msg = f"timeout_s must be positive, not {timeout_s}"
            raise ValueError(msg)
        self._socket_path = socket_path
        self._timeout_s = timeout_s
        self._prefixes = tuple(resource_prefixes)
        self._channel: Any = None

    @property
    def socket_path(self) -> Path:
        """The kubelet's socket this client talks to."""
        return self._socket_path

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def list_devices(self) -> tuple[PodDevices, ...]:
        """Every container's kept devices: one ``PodDevices`` per (pod, container, resource).

        Pods in the kubelet's order; within a container, resources and ids sorted.
        """
        answer = await self._call("List", api_pb2.ListPodResourcesRequest())
        response = _decode(api_pb2.ListPodResourcesResponse, answer, "List")
        return _pod_devices(response, self._prefixes)

    async def allocatable(self) -> tuple[str, ...]:
        """The sorted ids of every device of the kept resources the kubelet can allocate."""
        method = "GetAllocatableResources"
        answer = await self._call(method, api_pb2.AllocatableResourcesRequest())
        response = _decode(api_pb2.AllocatableResourcesResponse, answer, method)
        return _allocatable_ids(response, self._prefixes)

    async def close(self) -> None:
        """Close the channel; a later call opens a new one."""
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def _call(self, method: str, request: Any) -> bytes:
        """The answer's bytes: decoded by ``_decode``, not by gRPC, which would log every
        undecodable answer and hand back None."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(
                f"unix://{self._socket_path.absolute()}",
                options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.enable_retries", 0),
                ],
            )
        call = self._channel.unary_unary(
            f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name[method].name}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=None,
        )
        try:
            answer: bytes = await call(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            error = self._translate(method, exc)
        else:
            return answer
        if isinstance(error, TransportError):
            await self.close()
        raise error

    def _translate(self, method: str, exc: Any) -> PolcaError:
        code, details = exc.code(), str(exc.details() or "")
        where = f"kubelet pod-resources {method} on {self._socket_path}"
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _TOO_LARGE in details:
            msg = f"{where}: answer larger than {MAX_MESSAGE_BYTES} bytes"
            return ReadingRejectedError(msg, reason="oversized")
        if code == grpc.StatusCode.UNIMPLEMENTED:
            msg = f"{where}: this kubelet does not serve {method}"
            return ReadingRejectedError(msg, reason="unsupported")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            msg = f"{where}: no answer within {self._timeout_s} s"
        elif code == grpc.StatusCode.UNAVAILABLE and not self._socket_path.exists():
            msg = f"{where}: the socket does not exist (kubelet down, or its directory not mounted)"
        else:
            msg = f"{where}: {code.name} {details[:200]}"
        return TransportError(msg, delay_s=self._timeout_s)


def _decode(message_type: Any, answer: bytes, method: str) -> Any:
    """``answer`` as ``message_type``, or ``ReadingRejectedError`` (malformed)."""
    try:
        return message_type.FromString(answer)
    except Exception as exc:  # protobuf's DecodeError; google.protobuf is not imported here
        msg = f"kubelet pod-resources {method}: undecodable answer ({exc})"
        raise ReadingRejectedError(msg, reason="malformed") from exc


def _pod_devices(response: Any, prefixes: tuple[str, ...]) -> tuple[PodDevices, ...]:
    pods = response.pod_resources
    _bound(len(pods), MAX_PODS, "pods")
    found: list[PodDevices] = []
    for pod in pods:
        namespace = _name(pod.namespace, _LABEL, _MAX_LABEL_CHARS, "namespace")
        name = _name(pod.name, _SUBDOMAIN, _MAX_SUBDOMAIN_CHARS, "pod name")
        containers = pod.containers
        _bound(len(containers), MAX_CONTAINERS_PER_POD, f"containers in pod {namespace}/{name}")
        for container in containers:
            cname = _name(container.name, _LABEL, _MAX_LABEL_CHARS, "container name")
            groups = container.devices
            where = f"{namespace}/{name}/{cname}"
            _bound(len(groups), MAX_DEVICE_GROUPS_PER_CONTAINER, f"device groups of {where}")
            for resource, ids in sorted(_kept(groups, prefixes, where).items()):
                found.append(PodDevices(namespace, name, cname, resource, ids))
    return tuple(found)


def _allocatable_ids(response: Any, prefixes: tuple[str, ...]) -> tuple[str, ...]:
    groups = response.devices
    _bound(len(groups), MAX_ALLOCATABLE_GROUPS, "allocatable device groups")
    kept = _kept(groups, prefixes, "allocatable")
    return tuple(sorted({device for ids in kept.values() for device in ids}))


def _kept(
    groups: Iterable[Any], prefixes: tuple[str, ...], where: str
) -> dict[str, tuple[str, ...]]:
    """The checked ids of each kept resource in ``groups``, merged, deduplicated, sorted."""
    merged: dict[str, set[str]] = {}
    for group in groups:
        resource = _resource(group.resource_name)
        ids = group.device_ids
        _bound(len(ids), MAX_DEVICE_IDS_PER_GROUP, f"device ids in a {resource} group of {where}")
        if not resource.startswith(prefixes):
            continue
        merged.setdefault(resource, set()).update(_device_id(device) for device in ids)
    return {resource: tuple(sorted(ids)) for resource, ids in merged.items() if ids}


def _bound(count: int, limit: int, what: str) -> None:
    if count > limit:
        msg = f"{count} {what} (at most {limit})"
        raise ReadingRejectedError(msg, reason="oversized")


def _name(value: str, pattern: re.Pattern[str], limit: int, what: str) -> str:
    if len(value) > limit or not pattern.fullmatch(value):
        msg = f"{what} {value[:80]!r} is not a Kubernetes name (DNS-1123, at most {limit} chars)"
        raise ReadingRejectedError(msg, reason="malformed")
    return value


def _resource(value: str) -> str:
    """An extended resource name, ``<DNS-1123 subdomain>/<name of at most 63 chars>``."""
    prefix, slash, name = value.partition("/")
    if (
        not slash
        or len(prefix) > _MAX_SUBDOMAIN_CHARS
        or len(name) > _MAX_LABEL_CHARS
        or not _SUBDOMAIN.fullmatch(prefix)
        or not _RESOURCE_NAME.fullmatch(name)
    ):
        msg = f"resource name {value[:80]!r} is not a qualified extended resource name"
        raise ReadingRejectedError(msg, reason="malformed")
    return value


def _device_id(value: str) -> str:
    if len(value) > MAX_DEVICE_ID_CHARS or not _DEVICE_ID.fullmatch(value):
        msg = (
            f"device id {value[:40]!r} ({len(value)} chars) is not 1 to "
            f"{MAX_DEVICE_ID_CHARS} printable ASCII characters"
        )
        raise ReadingRejectedError(msg, reason="malformed")
    return value
