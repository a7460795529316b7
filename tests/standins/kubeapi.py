"""A Kubernetes API server stand-in for pods: a real HTTP server for tests (aiohttp.web).

Run as ``python -m tests.standins.kubeapi --port P --token T [--state FILE] [--tls-cert F
--tls-key F]`` (``FILE``: a JSON list of pods to start with; with a certificate, HTTPS).
It serves, in the API's own JSON, what a node-local pod watcher uses of ``core/v1``:

- ``GET /api/v1/pods`` and ``GET /api/v1/namespaces/{ns}/pods``: a ``PodList`` (items
  without ``kind``/``apiVersion``, as the API sends them) whose ``metadata.resourceVersion``
  is the store's; ``fieldSelector`` on ``metadata.name``, ``metadata.namespace``,
  ``spec.nodeName`` and ``status.phase`` with ``=``, ``==`` and ``!=`` (another field is
  answered 400, as the API does).
- the same with ``watch=true`` (or ``1``): newline-delimited ``{"type", "object"}`` events
  (``ADDED``, ``MODIFIED``, ``DELETED``) after the given ``resourceVersion``; with none (or
  ``0``) the current pods first, as ``ADDED``. A version older than the history kept is
  answered, as the API does, with HTTP 200 and one ``ERROR`` event carrying a ``Status``
  with code 410 (reason ``Expired``). ``timeoutSeconds`` ends the stream cleanly.
- every API request needs ``Authorization: Bearer TOKEN``; else 401 with a ``Status``.

Control endpoints for tests (no authentication, never faulted):

- ``POST /_standin/pods`` ``{"put": [pod, ...], "delete": [{"namespace", "name"}, ...],
  "leaky": bool}``: create or replace pods (the store fills in ``uid`` when missing or
  keeps the old one, ``resourceVersion``, ``creationTimestamp``) and delete them; open
  watches see the events. ``leaky`` pods are served whatever the field selector says (a
  misbehaving server). Answers ``{"resourceVersion", "uids"}``.
- ``POST /_standin/fault`` ``{"mode": MODE, ...}``: ``none`` (serve normally); ``outage``
  (every API request answered 503 ``text/plain``, open watches cut: ``close: "abort"``,
  the default, drops the connection, ``"eof"`` ends the stream cleanly); ``gone`` (the
  history is compacted: open watches get the 410 ``ERROR`` event and end, older versions
  are refused; the mode stays ``none``); ``hostile`` (adds, for ``node``, pods that break
  polca's bounds: 10,000 labels, a 1 MB annotation, another node's pod leaked through the
  selector, values that are not strings, an invalid name).
- ``GET /_standin/stats``: lists and watches served, watches open, the resourceVersion.
- ``GET /_standin/health``: 200 once serving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import ssl
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

HISTORY = 10_000
"""Events kept for watches that resume from a resourceVersion."""
FIELDS = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
    "spec.nodeName": ("spec", "nodeName"),
    "status.phase": ("status", "phase"),
}

Key = tuple[str, str]


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A ``meta/v1`` ``Status`` object, as the API answers a failure."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def api_json(body: Any, *, code: int = 200) -> web.Response:
    """JSON as the API sends it: ``Content-Type: application/json`` exactly, no charset
    (lightkube recognizes an API error only by that exact value)."""
    return web.Response(
        status=code, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )


def status_response(code: int, reason: str, message: str) -> web.Response:
    """A failure answered with a ``Status`` body, as the API does."""
    return api_json(status(code, reason, message), code=code)


def parse_selector(text: str) -> list[tuple[tuple[str, str], str, bool]]:
    """``a=b,c!=d`` -> [(path, value, equal)]; ``ValueError`` on an unknown field."""
    terms = []
    for term in filter(None, text.split(",")):
        if "!=" in term:
            name, value = term.split("!=", 1)
            equal = False
        elif "==" in term:
            name, value = term.split("==", 1)
            equal = True
        elif "=" in term:
            name, value = term.split("=", 1)
            equal = True
        else:
            msg = f"invalid selector: {term!r}"
            raise ValueError(msg)
        if name not in FIELDS:
            msg = f'"{name}" is not a known field selector: only "{", ".join(FIELDS)}"'
            raise ValueError(msg)
        terms.append((FIELDS[name], value, equal))
    return terms


def field_of(pod: dict[str, Any], path: tuple[str, str]) -> Any:
    """A field of a pod by its two-step path, or ``""`` when absent."""
    part = pod.get(path[0])
    return part.get(path[1], "") if isinstance(part, dict) else ""


@dataclass(eq=False)  # hashed by identity: kept in a set
class Watch:
    """One open watch: its filter and the queue of events (or commands) it streams."""

    namespace: str | None
    selector: list[tuple[tuple[str, str], str, bool]]
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)


@dataclass
class Store:
    """Pods, their history of events, the open watches and the fault in force."""

    token: str
    version: int = 1
    pods: dict[Key, dict[str, Any]] = field(default_factory=dict)
    leaky: set[Key] = field(default_factory=set)
    history: deque[tuple[int, str, dict[str, Any]]] = field(
        default_factory=lambda: deque(maxlen=HISTORY)
    )
    compacted: int = 0
    """A watch from a version below this one is answered 410."""
    watches: set[Watch] = field(default_factory=set)
    fault: str = "none"
    stats: Counter[str] = field(default_factory=Counter)

    def matches(self, key: Key, pod: dict[str, Any], watch: Watch) -> bool:
        """Whether ``pod`` is in the namespace and selection of ``watch`` (or leaks)."""
        if watch.namespace is not None and key[0] != watch.namespace:
            return False
        if key in self.leaky:
            return True
        return all((field_of(pod, path) == value) == equal for path, value, equal in watch.selector)

    def _event(self, kind: str, key: Key, pod: dict[str, Any]) -> None:
        if len(self.history) == self.history.maxlen:
            self.compacted = self.history[0][0]  # its successors remain: from it is fine
        self.history.append((self.version, kind, pod))
        for watch in list(self.watches):
            if self.matches(key, pod, watch):
                watch.queue.put_nowait(("event", {"type": kind, "object": pod}))

    def put(self, pod: dict[str, Any], *, leaky: bool = False) -> str:
        """Create or replace a pod; its uid."""
        meta = pod.setdefault("metadata", {})
        key = (str(meta.get("namespace", "default")), str(meta.get("name", "")))
        meta.setdefault("namespace", key[0])
        old = self.pods.get(key)
        if "uid" not in meta:
            meta["uid"] = old["metadata"]["uid"] if old is not None else str(uuid.uuid4())
        if old is not None:
            meta.setdefault("creationTimestamp", old["metadata"].get("creationTimestamp"))
        else:
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            meta.setdefault("creationTimestamp", now)
        self.version += 1
        meta["resourceVersion"] = str(self.version)
        pod.setdefault("kind", "Pod")
        pod.setdefault("apiVersion", "v1")
        self.pods[key] = pod
        if leaky:
            self.leaky.add(key)
        self._event("MODIFIED" if old is not None else "ADDED", key, pod)
        return str(meta["uid"])

    def delete(self, namespace: str, name: str) -> None:
        """Delete a pod (nothing if there is none)."""
        pod = self.pods.pop((namespace, name), None)
        if pod is None:
            return
        self.version += 1
        pod = {**pod, "metadata": {**pod["metadata"], "resourceVersion": str(self.version)}}
        self._event("DELETED", (namespace, name), pod)
        self.leaky.discard((namespace, name))

    def end_watches(self, how: str) -> None:
        """Tell every open watch to end: ``abort``, ``eof`` or ``gone``."""
        for watch in list(self.watches):
            watch.queue.put_nowait((how, None))


def hostile_pods(node: str) -> list[dict[str, Any]]:
    """Pods that a strict reader must refuse (each for one reason)."""

    def pod(name: str, **meta: Any) -> dict[str, Any]:
        return {
            "metadata": {"namespace": "hostile", "name": name, **meta},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
            "status": {"phase": "Running"},
        }

    many_labels = pod("many-labels", labels={f"k{i}": "v" for i in range(10_000)})
    huge = pod("huge-annotation", annotations={"polca.io/class": "x" * 1_000_000})
    elsewhere = pod("elsewhere")
    elsewhere["spec"]["nodeName"] = "another-node"
    not_strings = pod("not-strings", labels={"app": 5}, annotations={"a": ["x"]})
    bad_priority = pod("bad-priority")
    bad_priority["spec"]["priority"] = "high"
    bad_name = pod("Not_A_Name")
    return [many_labels, huge, elsewhere, not_strings, bad_priority, bad_name]


class Api:
    """The request handlers over one ``Store``."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def pods(self, request: web.Request) -> web.StreamResponse:
        """A pod list, or a watch (``watch=true``)."""
        store = self.store
        if store.fault == "outage":
            return web.Response(status=503, text="service unavailable\n")
        if request.headers.get("Authorization") != f"Bearer {store.token}":
            return status_response(401, "Unauthorized", "Unauthorized")
        namespace = request.match_info.get("namespace")
        try:
            selector = parse_selector(request.query.get("fieldSelector", ""))
        except ValueError as exc:
            return status_response(400, "BadRequest", str(exc))
        watch = Watch(namespace, selector)
        if request.query.get("watch") in {"true", "1"}:
            return await self.stream(request, watch)
        store.stats["lists"] += 1
        items = [
            {k: v for k, v in pod.items() if k not in {"kind", "apiVersion"}}
            for key, pod in store.pods.items()
            if store.matches(key, pod, watch)
        ]
        body = {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(store.version)},
            "items": items,
        }
        return api_json(body)

    async def stream(self, request: web.Request, watch: Watch) -> web.StreamResponse:
        """A watch: the backlog after ``resourceVersion``, then live events."""
        store = self.store
        since = request.query.get("resourceVersion", "")
        try:
            since_version = int(since) if since not in {"", "0"} else None
            timeout_s = float(request.query.get("timeoutSeconds", "0")) or None
        except ValueError:
            return status_response(400, "BadRequest", "resourceVersion: not a version")
        store.stats["watches"] += 1
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        async def send(event: dict[str, Any]) -> None:
            await response.write(json.dumps(event).encode() + b"\n")

        if since_version is not None and since_version < store.compacted:
            message = f"too old resource version: {since_version} ({store.compacted})"
            await send({"type": "ERROR", "object": status(410, "Expired", message)})
            await response.write_eof()
            return response
        # Registered before the backlog is taken, with no await between: nothing is missed.
        store.watches.add(watch)
        if since_version is None:
            backlog: Iterable[tuple[str, dict[str, Any]]] = [
                ("ADDED", pod) for key, pod in store.pods.items() if store.matches(key, pod, watch)
            ]
        else:
            backlog = [
                (kind, pod)
                for version, kind, pod in store.history
                if version > since_version and store.matches(_key(pod), pod, watch)
            ]
        try:
            for kind, pod in backlog:
                await send({"type": kind, "object": pod})
            if await self._follow(request, watch, send, timeout_s):
                await response.write_eof()
        except ConnectionError:
            pass  # the client went away
        finally:
            store.watches.discard(watch)
        return response

    async def _follow(
        self,
        request: web.Request,
        watch: Watch,
        send: Callable[[dict[str, Any]], Awaitable[None]],
        timeout_s: float | None,
    ) -> bool:
        """Stream ``watch``'s queue until told to end; False when the connection was cut."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s else None
        while True:
            wait_s = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                what, event = await asyncio.wait_for(watch.queue.get(), wait_s)
            except TimeoutError:
                return True  # timeoutSeconds: a clean end
            if what == "event":
                await send(event)
            elif what == "gone":
                message = f"too old resource version: ({self.store.compacted})"
                await send({"type": "ERROR", "object": status(410, "Expired", message)})
                return True
            elif what == "abort":
                if request.transport is not None:
                    request.transport.abort()
                return False
            else:  # "eof"
                return True

    async def control_pods(self, request: web.Request) -> web.Response:
        """``POST /_standin/pods``: put and delete pods."""
        body = await request.json()
        leaky = bool(body.get("leaky", False))
        uids = [self.store.put(pod, leaky=leaky) for pod in body.get("put", [])]
        for ref in body.get("delete", []):
            self.store.delete(ref["namespace"], ref["name"])
        return web.json_response({"resourceVersion": str(self.store.version), "uids": uids})

    async def control_fault(self, request: web.Request) -> web.Response:
        """``POST /_standin/fault``: ``none``, ``outage``, ``gone``, ``hostile``."""
        store = self.store
        body = await request.json()
        mode = body.get("mode")
        if mode == "none":
            store.fault = "none"
        elif mode == "outage":
            store.fault = "outage"
            store.end_watches("abort" if body.get("close", "abort") == "abort" else "eof")
        elif mode == "gone":
            store.compacted = store.version  # only a watch from now on can be served
            store.history.clear()
            store.end_watches("gone")
        elif mode == "hostile":
            for pod in hostile_pods(str(body["node"])):
                store.put(pod, leaky=pod["spec"]["nodeName"] != body["node"])
        else:
            return web.json_response({"error": f"unknown mode {mode!r}"}, status=400)
        return web.json_response({"mode": store.fault, "resourceVersion": str(store.version)})

    async def control_stats(self, _request: web.Request) -> web.Response:
        """``GET /_standin/stats``."""
        return web.json_response(
            {
                "lists": self.store.stats["lists"],
                "watches": self.store.stats["watches"],
                "open_watches": len(self.store.watches),
                "resourceVersion": str(self.store.version),
            }
        )

    async def health(self, _request: web.Request) -> web.Response:
        """``GET /_standin/health``."""
        return web.json_response({"ok": True})

    async def close_watches(self, _app: web.Application) -> None:
        """On shutdown: cut the open watches (they would hold the server up)."""
        self.store.end_watches("abort")


def make_app(store: Store) -> web.Application:
    """The stand-in's routes over ``store``."""
    api = Api(store)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/api/v1/pods", api.pods)
    app.router.add_get("/api/v1/namespaces/{namespace}/pods", api.pods)
    app.router.add_post("/_standin/pods", api.control_pods)
    app.router.add_post("/_standin/fault", api.control_fault)
    app.router.add_get("/_standin/stats", api.control_stats)
    app.router.add_get("/_standin/health", api.health)
    app.on_shutdown.append(api.close_watches)
    return app


def _key(pod: dict[str, Any]) -> Key:
    meta = pod["metadata"]
    return (str(meta["namespace"]), str(meta["name"]))


def main(argv: list[str] | None = None) -> None:
    """Run the stand-in until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m tests.standins.kubeapi")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--state", type=Path, default=None, help="a JSON list of pods")
    parser.add_argument("--tls-cert", type=Path, default=None)
    parser.add_argument("--tls-key", type=Path, default=None)
    args = parser.parse_args(argv)
    store = Store(token=args.token)
    if args.state is not None:
        for pod in json.loads(args.state.read_text(encoding="utf-8")):
            store.put(pod)
    context = None
    if args.tls_cert is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.tls_cert, args.tls_key)
    with contextlib.suppress(KeyboardInterrupt):
        web.run_app(
            make_app(store),
            host=args.host,
            port=args.port,
            ssl_context=context,
            print=None,
            access_log=None,
        )


if __name__ == "__main__":
    main()
