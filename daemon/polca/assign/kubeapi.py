"""The Kubernetes API half of the Kubernetes assignment source: this node's pods, kept current.

``PodWatcher`` lists the pods bound to one node (all namespaces, ``fieldSelector=
spec.nodeName=NODE``), then watches from the list's ``resourceVersion``, through
lightkube's ``AsyncClient``. Every pod is parsed strictly into a ``PodMeta``
(``assign/model.py``): a pod that breaks a bound is dropped and counted by reason
(``malformed``, ``oversized``, ``identity``; ``capacity`` beyond ``max_pods``), the others
are kept. When the watch ends (an error, 410 Gone, a disconnect, the server closing it) or
every ``resync_s``, the pods are listed again, after a jittered backoff
(``polca.aiokit.backoff_delays``) unless it is the periodic re-list. A failed list leaves
the last pods in place and marks the watcher unhealthy (one log line when the API becomes
unreachable, one when it is back); ``run`` never raises but for cancellation.

This is the only module of polca that imports lightkube. Two things lightkube 1.0 does not
do the way polca needs, and what is used instead:

- Its typed ``Pod`` is a strict ``msgspec.Struct``: one pod with a field of the wrong type
  anywhere (``spec.priority: "high"``, a port as a string) fails the decode of the whole
  list, or ends the watch, for every pod: one hostile pod would hide the node. The
  requests here go through ``_RawPod``: a resource with ``Pod``'s API description whose
  objects stay plain JSON, so each pod is judged on its own.
- Its responses are unbounded (a list is read whole, a watch line is buffered until its
  newline). ``_BoundedTransport`` (lightkube takes a transport) caps a list response at
  ``max_response_bytes`` and a watch event at ``MAX_EVENT_BYTES``. With a transport of its
  own the client no longer builds the TLS context, so it is built here (the CA file, or
  the system's trust store).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, NoReturn, Self

import httpx2
import structlog
from lightkube import ALL_NS, ApiError, AsyncClient, KubeConfig, NotReadyError
from lightkube.config.models import Cluster, User
from lightkube.core import resource as lk_resource
from lightkube.resources.core_v1 import Pod
from pydantic import BaseModel, ConfigDict, Field, model_validator

from polca.aiokit import backoff_delays
from polca.assign.model import PodMeta
from polca.errors import ConfigError, IdentityError, OversizedError, SchemaError
from polca.telemetry.checks import DropLog

__all__ = [
    "MAX_EVENT_BYTES",
    "SERVICE_ACCOUNT_DIR",
    "KubeApiConfig",
    "PodWatcher",
    "parse_pod",
    "pod_uid",
]

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where the kubelet mounts a pod's service account token and the cluster's CA."""
MAX_EVENT_BYTES: Final = 4 * 1024 * 1024
"""The longest watch event (one line) read; etcd keeps objects up to 1.5 MiB."""

MAX_ENTRIES: Final = 64
"""Labels, and annotations, of one pod."""
MAX_KEY_CHARS: Final = 253 + 1 + 63
"""A label or annotation key: a DNS subdomain prefix, ``/``, a name."""
MAX_LABEL_VALUE_CHARS: Final = 63
MAX_ANNOTATION_VALUE_CHARS: Final = 4096
MAX_UID_CHARS: Final = 64
_MAX_RESOURCE_VERSION_CHARS: Final = 256
_INT32: Final = 2**31
PHASES: Final = frozenset({"Pending", "Running", "Succeeded", "Failed", "Unknown"})

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", re.ASCII)
_DNS_SUBDOMAIN = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", re.ASCII
)
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", re.ASCII)
_UID = re.compile(r"[A-Za-z0-9-]+", re.ASCII)
_SHOWN: Final = 64
"""Characters of a network string quoted in an error message."""


# --------------------------------------------------------------------------- settings


class KubeApiConfig(BaseModel):
    """How to reach the Kubernetes API: in the cluster (default), or at a given address."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    in_cluster: bool = Field(
        True,
        description="Use the pod's service account: the token and CA under "
        "service_account_dir, the API at KUBERNETES_SERVICE_HOST/PORT (HTTPS).",
    )
    service_account_dir: Path = Field(
        SERVICE_ACCOUNT_DIR, description="Where the service account is mounted (in_cluster)."
    )
    api_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s/?#]+/?$",
        max_length=512,
        description="The API server, e.g. https://10.0.0.1:6443 (only with in_cluster: false).",
    )
    token_file: Path | None = Field(
        None, description="A file holding the bearer token (re-read when the API answers 401)."
    )
    ca_file: Path | None = Field(
        None, description="The CA bundle that signed the API server's certificate."
    )
    allow_http: bool = Field(
        False, description="Accept an http:// api_url (labs and tests: the token travels clear)."
    )
    timeout_s: float = Field(10.0, gt=0, le=300, description="Connect, and whole list, limit.")
    resync_s: float = Field(300.0, gt=0, le=86_400, description="Full re-list period.")
    max_pods: int = Field(1024, ge=1, le=65_536, description="Pods kept (a node runs <= 110).")
    max_response_bytes: int = Field(
        64 * 1024 * 1024, ge=64 * 1024, le=1024**3, description="Largest list response read."
    )
    backoff_min_s: float = Field(0.5, gt=0, le=60, description="First retry delay.")
    backoff_max_s: float = Field(30.0, gt=0, le=600, description="Longest retry delay.")

    @model_validator(mode="after")
    def _one_way_in(self) -> Self:
        if self.in_cluster:
            if self.api_url is not None or self.token_file is not None or self.ca_file is not None:
                msg = "api_url, token_file and ca_file need in_cluster: false"
                raise ValueError(msg)
        elif self.api_url is None:
            msg = "in_cluster: false needs api_url"
            raise ValueError(msg)
        elif self.api_url.startswith("http://") and not self.allow_http:
            msg = "an http:// api_url sends the token in clear: set allow_http: true (labs only)"
            raise ValueError(msg)
        if self.backoff_max_s < self.backoff_min_s:
            msg = "backoff_max_s must not be below backoff_min_s"
            raise ValueError(msg)
        return self


# --------------------------------------------------------------------------- parsing


def _shown(value: object) -> str:
    text = value if isinstance(value, str) else type(value).__name__
    return text[:_SHOWN] + ("..." if len(text) > _SHOWN else "")


def _mapping(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        msg = f"{what} is not an object"
        raise SchemaError(msg)
    return value


def _is_subdomain(value: str) -> bool:
    return len(value) <= 253 and _DNS_SUBDOMAIN.fullmatch(value) is not None


def _is_qualified_name(key: str) -> bool:
    """A label or annotation key: ``[prefix/]name``, the prefix a DNS subdomain."""
    prefix, slash, name = key.rpartition("/")
    if slash and not _is_subdomain(prefix):
        return False
    return len(name) <= 63 and _NAME_PART.fullmatch(name) is not None


def _string_map(value: object, what: str, *, max_value_chars: int) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        msg = f"{what} is not an object"
        raise SchemaError(msg)
    if len(value) > MAX_ENTRIES:
        msg = f"{len(value)} {what} (at most {MAX_ENTRIES})"
        raise OversizedError(msg)
    out: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            msg = f"{what} {_shown(key)!r}: not a string (a {type(item).__name__})"
            raise SchemaError(msg)
        if len(key) > MAX_KEY_CHARS or len(item) > max_value_chars:
            msg = f"{what} {_shown(key)!r}: {len(key)}-char key, {len(item)}-char value"
            raise OversizedError(msg)
        if not _is_qualified_name(key):
            msg = f"{what} key {_shown(key)!r} is not a qualified name"
            raise SchemaError(msg)
        if what == "labels" and item and _NAME_PART.fullmatch(item) is None:
            msg = f"label {_shown(key)!r}: value {_shown(item)!r} is not a label value"
            raise SchemaError(msg)
        out[key] = item
    return out


def pod_uid(obj: object) -> str | None:
    """The pod's ``metadata.uid`` when it is a well-formed one, else None (never raises)."""
    if not isinstance(obj, Mapping):
        return None
    meta = obj.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    if isinstance(uid, str) and len(uid) <= MAX_UID_CHARS and _UID.fullmatch(uid):
        return uid
    return None


def _pod_ref(obj: object) -> str:
    """``namespace/name`` of a pod, for a log line (cut; never raises)."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    if not isinstance(meta, Mapping):
        return "?"
    return f"{_shown(meta.get('namespace'))}/{_shown(meta.get('name'))}"


def parse_pod(obj: object, node_name: str) -> PodMeta:
    """One pod of the API (a JSON object) as a ``PodMeta``, checked against every bound.

    Raises ``SchemaError`` (reason ``malformed``), ``OversizedError`` (a bound) or
    ``IdentityError`` (a pod bound to another node, or to none).
    """
    pod = _mapping(obj, "a pod")
    meta = _mapping(pod.get("metadata"), "metadata")
    spec = _mapping(pod.get("spec"), "spec")
    node = spec.get("nodeName")
    if node != node_name:
        msg = f"pod is on node {_shown(node)!r}, not {node_name!r}"
        raise IdentityError(msg)
    namespace, name, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
    if not isinstance(namespace, str) or len(namespace) > 63 or not _DNS_LABEL.fullmatch(namespace):
        msg = f"namespace {_shown(namespace)!r} is not a DNS-1123 label"
        raise SchemaError(msg)
    if not isinstance(name, str) or not _is_subdomain(name):
        msg = f"name {_shown(name)!r} is not a DNS-1123 subdomain"
        raise SchemaError(msg)
    if not isinstance(uid, str) or len(uid) > MAX_UID_CHARS or not _UID.fullmatch(uid):
        msg = f"uid {_shown(uid)!r} is not a uid of at most {MAX_UID_CHARS} characters"
        raise SchemaError(msg)
    priority = spec.get("priority")
    if priority is not None and (
        type(priority) is not int or not -_INT32 <= priority < _INT32
    ):  # bool is an int subclass: type() on purpose
        msg = f"spec.priority {_shown(priority)!r} is not a 32-bit integer"
        raise SchemaError(msg)
    status = pod.get("status")
    phase = "Unknown"
    if status is not None:
        phase = _mapping(status, "status").get("phase", "Unknown")
        if phase not in PHASES:
            msg = f"status.phase {_shown(phase)!r} is not a pod phase"
            raise SchemaError(msg)
    return PodMeta(
        namespace=namespace,
        name=name,
        uid=uid,
        node_name=node_name,
        phase=phase,
        priority=priority,
        labels=_string_map(meta.get("labels"), "labels", max_value_chars=MAX_LABEL_VALUE_CHARS),
        annotations=_string_map(
            meta.get("annotations"), "annotations", max_value_chars=MAX_ANNOTATION_VALUE_CHARS
        ),
    )


# --------------------------------------------------------------------------- lightkube seam


@dataclass(frozen=True, slots=True)
class _RawMeta:
    resourceVersion: str | None  # noqa: N815 - the name lightkube's watch driver reads


class _RawPod(lk_resource.NamespacedResourceG, dict[str, Any]):
    """A pod as the API sent it (plain JSON), requested as lightkube's ``Pod`` is."""

    _api_info = Pod._api_info  # the paths and verbs of core/v1 pods

    def __init__(self, data: object = None) -> None:
        # A list item that is not an object stays empty here and is dropped as malformed.
        super().__init__(data if isinstance(data, dict) else {})
        self.well_formed = isinstance(data, dict)

    @property
    def metadata(self) -> _RawMeta:
        """What lightkube's watch driver reads of each event's object."""
        meta = self.get("metadata")
        version = meta.get("resourceVersion") if isinstance(meta, dict) else None
        return _RawMeta(version if isinstance(version, str) else None)


class _WatchClosedError(Exception):
    """The server ended a watch stream: the watch is over, list again (never reconnect
    inside lightkube, which would do it at once, in a loop, against a server that keeps
    closing)."""


class _BoundedStream(httpx2.AsyncByteStream):
    """A response body read at most ``max_bytes`` in all, or per line (``per_line``)."""

    def __init__(self, inner: httpx2.AsyncByteStream, *, max_bytes: int, per_line: bool) -> None:
        self._inner = inner
        self._max_bytes = max_bytes
        self._per_line = per_line

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0  # bytes of the whole body, or of the line not yet ended
        async for chunk in self._inner:
            if self._per_line:
                parts = chunk.split(b"\n")
                longest = max([seen + len(parts[0]), *(len(part) for part in parts[1:])])
                seen = seen + len(chunk) if len(parts) == 1 else len(parts[-1])
            else:
                seen += len(chunk)
                longest = seen
            if longest > self._max_bytes:
                what = "a watch event" if self._per_line else "a list response"
                msg = f"{what} over {self._max_bytes} bytes"
                raise OversizedError(msg)
            yield chunk
        if self._per_line:
            msg = "the API server ended the watch"
            raise _WatchClosedError(msg)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _BoundedTransport(httpx2.AsyncBaseTransport):
    """Bounds every response body (see ``_BoundedStream``); the rest is ``inner``'s."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, *, max_body_bytes: int) -> None:
        self._inner = inner
        self._max_body_bytes = max_body_bytes

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        if response.status_code >= 400 and "content-type" not in response.headers:
            # lightkube reads an error's Content-Type unguarded (a KeyError without one).
            response.headers["Content-Type"] = "text/plain"
        stream = response.stream
        if not isinstance(stream, httpx2.AsyncByteStream):  # pragma: no cover - httpx2's own
            msg = "an async transport answered with a sync stream"
            raise TypeError(msg)
        watch = request.url.params.get("watch") in {"true", "1"}
        response.stream = _BoundedStream(
            stream,
            max_bytes=MAX_EVENT_BYTES if watch else self._max_body_bytes,
            per_line=watch,
        )
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _describe(exc: BaseException) -> str:
    """A failure in a line for ``error`` and the log (HTTP status and the API's message)."""
    code: int | None = None
    if isinstance(exc, ApiError):  # the API's own Status
        code = exc.status.code
        text = f"HTTP {code} {exc.status.reason or ''}: {exc.status.message or ''}"
    elif isinstance(exc, httpx2.HTTPStatusError):  # another body (a proxy, a balancer)
        code = exc.response.status_code
        text = f"HTTP {code} from {exc.request.url.copy_with(query=None)}"
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if code in {401, 403}:
        text += " (check the token, and RBAC: get, list and watch on pods)"
    return text[:300]


# --------------------------------------------------------------------------- the watcher


class PodWatcher:
    """This node's pods (by uid), from a list and then a watch of the Kubernetes API."""

    def __init__(
        self,
        node_name: str,
        config: KubeApiConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Watch the pods bound to ``node_name`` (``spec.nodeName``: the node's name)."""
        if not _is_subdomain(node_name):
            msg = f"node name {node_name!r} is not a DNS-1123 subdomain"
            raise ValueError(msg)
        self.node_name = node_name
        self.config = config
        self._clock = clock
        self._pods: dict[str, PodMeta] = {}
        self._drops = DropLog("kube_pod_dropped", clock=clock)
        self._down = False
        self.healthy = False
        """True since the last list succeeded; False before the first, and after a failed one."""
        self.last_ok_s: float | None = None
        """``clock()`` at the last successful list or watch event."""
        self.error: str | None = None
        """Why the last list failed, while unhealthy."""
        self.lists = 0
        """Successful lists."""
        self.list_failures = 0
        self.watch_events = 0
        self.watch_ends: Counter[str] = Counter()
        """Why watches ended: ``resync``, ``closed`` (by the server), ``gone`` (410),
        ``error``."""
        self.watch_error: str | None = None
        """Why the last watch that failed did."""

    def pods(self) -> Mapping[str, PodMeta]:
        """The pods now known, by uid (a copy: at most ``max_pods``)."""
        return dict(self._pods)

    @property
    def dropped(self) -> Counter[str]:
        """Pods refused, by reason: ``malformed``, ``oversized``, ``identity``, ``capacity``."""
        return self._drops.counts

    async def run(self) -> NoReturn:
        """List and watch until cancelled; failures are retried, never raised."""
        client: AsyncClient | None = None
        delays = self._delays()
        try:
            while True:
                end: str = "error"
                try:
                    if client is None:
                        client = self._client()
                    version = await self._list(client)
                    end = await self._watch(client, version)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # every failure is retried
                    self._failed(exc)
                if end == "resync":  # the periodic re-list: at once
                    delays = self._delays()
                    continue
                if end == "productive":
                    delays = self._delays()
                await asyncio.sleep(next(delays))
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()

    def _delays(self) -> Iterator[float]:
        return backoff_delays(self.config.backoff_min_s, self.config.backoff_max_s)

    def _client(self) -> AsyncClient:
        """A lightkube client for the configured API (raises ``ConfigError`` and OS errors)."""
        cfg = self.config
        if cfg.in_cluster:
            host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "")
            if not host or not port:
                msg = (
                    "KUBERNETES_SERVICE_HOST/PORT are not set: not in a pod? "
                    "(set in_cluster: false and api_url)"
                )
                raise ConfigError(msg)
            server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
            token_file: Path | None = cfg.service_account_dir / "token"
            ca_file: Path | None = cfg.service_account_dir / "ca.crt"
        else:
            server, token_file, ca_file = str(cfg.api_url), cfg.token_file, cfg.ca_file
        if token_file is not None and not token_file.is_file():
            msg = f"no token file {token_file}"
            raise ConfigError(msg)
        tls = ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
        kube_config = KubeConfig.from_one(
            cluster=Cluster(server=server),
            user=User(token_file=str(token_file)) if token_file is not None else User(),
        )
        transport = _BoundedTransport(
            httpx2.AsyncHTTPTransport(verify=tls, trust_env=False),
            max_body_bytes=cfg.max_response_bytes,
        )
        return AsyncClient(
            config=kube_config,
            timeout=httpx2.Timeout(cfg.timeout_s),
            trust_env=False,
            transport=transport,
        )

    async def _list(self, client: AsyncClient) -> str:
        """List this node's pods and replace the known ones; the list's resourceVersion."""
        listing = client.list(_RawPod, namespace=ALL_NS, fields={"spec.nodeName": self.node_name})
        try:
            async with asyncio.timeout(self.config.timeout_s):
                items = [item async for item in listing]
        except TimeoutError:
            msg = f"the list took over {self.config.timeout_s:g} s"
            raise TimeoutError(msg) from None
        try:
            version = listing.resourceVersion
        except NotReadyError:
            version = None
        if not isinstance(version, str) or len(version) > _MAX_RESOURCE_VERSION_CHARS:
            msg = "the pod list has no usable metadata.resourceVersion"
            raise SchemaError(msg)
        pods: dict[str, PodMeta] = {}
        for item in items:
            self._admit(pods, item)
        self._pods = pods
        self.lists += 1
        self._succeeded()
        return version

    async def _watch(self, client: AsyncClient, version: str) -> str:
        """Follow the watch until it ends: ``resync`` (due), else how it ended, or
        ``productive`` when it delivered an event or lasted ``backoff_max_s``. Never raises
        but for cancellation: a watch that fails (410 Gone, a disconnect, a bad event) is
        counted in ``watch_ends`` and the pods are listed again; the list says whether the
        API is healthy."""
        loop = asyncio.get_running_loop()
        started, events = loop.time(), self.watch_events
        stream = client.watch(
            _RawPod,
            namespace=ALL_NS,
            fields={"spec.nodeName": self.node_name},
            resource_version=version,
            server_timeout=max(1, int(self.config.resync_s)),
        )
        end: Literal["resync", "closed", "gone", "error"] = "closed"
        deadline = asyncio.timeout(self.config.resync_s)
        try:
            async with deadline:
                async for kind, obj in stream:
                    self._apply(kind, obj)
        except _WatchClosedError:
            end = "closed"
        except ApiError as exc:
            # 410: the API no longer has our resourceVersion (or the watch fell behind).
            end = "gone" if exc.status.code == 410 else "error"
            if end == "error":
                self.watch_error = _describe(exc)
        except Exception as exc:  # a disconnect, a bad line: list again
            if deadline.expired():
                end = "resync"
            else:
                end = "error"
                self.watch_error = _describe(exc)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        self.watch_ends[end] += 1
        structlog.get_logger().debug("kube_watch_ended", node=self.node_name, end=end)
        if end == "resync":
            return end
        lasted = loop.time() - started
        productive = self.watch_events > events or lasted >= self.config.backoff_max_s
        return "productive" if productive else end

    def _apply(self, kind: str, obj: object) -> None:
        """One watch event."""
        self.watch_events += 1
        self.last_ok_s = self._clock()
        if kind in {"ADDED", "MODIFIED"}:
            self._admit(self._pods, obj)
        elif kind == "DELETED":
            uid = pod_uid(obj)
            if uid is None:
                self._drops.drop("malformed", pod=_pod_ref(obj), error="DELETED without a uid")
            else:
                self._pods.pop(uid, None)
        elif kind != "BOOKMARK":
            self._drops.drop("malformed", error=f"watch event type {_shown(kind)!r}")

    def _admit(self, pods: dict[str, PodMeta], obj: object) -> None:
        """Keep ``obj`` in ``pods`` if it parses and there is room; else count its drop (a
        pod known before and now refused is forgotten: its last good state is not its
        state)."""
        if isinstance(obj, _RawPod) and not obj.well_formed:
            self._drops.drop("malformed", error="a list item that is not an object")
            return
        try:
            pod = parse_pod(obj, self.node_name)
        except SchemaError as exc:
            uid = pod_uid(obj)
            if uid is not None:
                pods.pop(uid, None)
            self._drops.drop(exc.reason, pod=_pod_ref(obj), error=str(exc))
            return
        if pod.uid not in pods and len(pods) >= self.config.max_pods:
            self._drops.drop("capacity", pod=f"{pod.namespace}/{pod.name}")
            return
        pods[pod.uid] = pod

    def _succeeded(self) -> None:
        self.healthy = True
        self.error = None
        self.last_ok_s = self._clock()
        if self._down:
            self._down = False
            structlog.get_logger().info(
                "kube_api_recovered",
                node=self.node_name,
                pods=len(self._pods),
                failed_lists=self.list_failures,
            )

    def _failed(self, exc: Exception) -> None:
        """A failed list (or client setup): unhealthy, the last pods kept; logged once."""
        self.list_failures += 1
        self.healthy = False
        self.error = _describe(exc)
        if not self._down:
            self._down = True
            structlog.get_logger().warning(
                "kube_api_unreachable",
                node=self.node_name,
                error=self.error,
                pods_kept=len(self._pods),
            )
