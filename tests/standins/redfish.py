"""A Redfish service stand-in: a real HTTP(S) server for tests and benchmarks (aiohttp.web).

Run as ``python -m tests.standins.redfish --port P [--username U --password PW]
[--no-session-service] [--tls-cert F --tls-key F] --device KIND:NAME[:OPTION] ...``
(repeatable) or ``--devices-file F`` (a JSON list of ``KIND:NAME[:OPTION]``: a benchmark
serves 200 PDUs). It serves ``/redfish/v1``: the service root (links ``Chassis``,
``PowerEquipment``, ``ThermalEquipment``, ``SessionService``), the collections that span
devices (``Chassis``, ``PowerEquipment/RackPDUs``, ``ThermalEquipment/CDUs``, built from
the devices' paths), a working session service (POST creates a session and answers its
``X-Auth-Token`` and ``Location``; DELETE ends it; basic auth is accepted too; the service
root needs no authentication) and each device's documents, as-is, with an ``ETag``; a
PATCH with a stale ``If-Match`` is answered 412.

Devices: each KIND is a module ``tests/standins/redfish_<kind>.py`` imported only when a
device of that kind is asked for, with ``resources(name[, option])`` (``@odata.id`` ->
document, served as-is and mutable), ``set_state(docs, name, state)`` and, when its
resources can be written, ``patch(docs, name, path, body) -> message | None`` (a message
is answered as HTTP 400 with a Redfish error body).

Control endpoints for tests (not Redfish, never faulted): ``POST /_standin/state``
``{"device": NAME, ...}`` (the device's ``set_state``; ``"dark": true`` makes any device
go dark until ``false`` or a reset: a request for one of its documents is never answered,
as a device powered by a lost feed answers nothing, and the client times out);
``POST /_standin/fault`` ``{"mode": MODE, ...options}`` (modes in ``FAULT_MODES``;
``path_prefix`` limits a fault to some paths); ``GET /_standin/log`` (the requests served:
method, path, status, If-Match, auth) and ``DELETE`` it; ``DELETE /_standin/sessions``
(every session expires); ``POST /_standin/reset`` (devices rebuilt, not dark, fault
cleared, log emptied).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import hashlib
import importlib
import json
import math
import secrets
import ssl
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from aiohttp import web

ROOT = "/redfish/v1"
SESSIONS = f"{ROOT}/SessionService/Sessions"
FAULT_MODES = frozenset(
    {
        "none",
        "slow",  # answers after delay_s (default 30)
        "error500",
        "redirect_offhost",  # 302 to another host
        "redirect_samehost",  # 302 to the same path, `hops` times (default 1)
        "oversized",  # a 20 MB body (`chunked`: without Content-Length)
        "deep",  # JSON nested 1000 (or `depth`) deep
        "wrong_types",  # every number as a string
        "nan",  # every number NaN (or `value`, e.g. -1)
        "liar",  # PATCH answered 200 and not applied
        "unauthorized",  # 401 to everything
    }
)
_COLLECTIONS = {  # path -> (Name, the collection's schema)
    f"{ROOT}/Chassis": ("Chassis", "ChassisCollection"),
    f"{ROOT}/PowerEquipment/RackPDUs": ("RackPDUs", "PowerDistributionCollection"),
    f"{ROOT}/ThermalEquipment/CDUs": ("CDUs", "CoolingUnitCollection"),
}
_SERVICE_DOCS = {ROOT, f"{ROOT}/PowerEquipment", f"{ROOT}/ThermalEquipment"}
_KINDS = {"bmc", "pdu", "cdu"}
_DARK_S = 3600.0  # how long a dark device's request waits: longer than any client's timeout


@dataclass
class Device:
    """One device of the registry: its kind's module and its documents."""

    kind: str
    name: str
    option: str | None
    module: ModuleType
    docs: dict[str, dict[str, Any]]
    dark: bool = False
    """It answers nothing (its feed is lost)."""


def parse_device(spec: str) -> tuple[str, str, str | None]:
    """``KIND:NAME[:OPTION]`` as its parts; ``ValueError`` when malformed."""
    parts = spec.split(":")
    if len(parts) not in {2, 3} or parts[0] not in _KINDS or not parts[1]:
        msg = f"device {spec!r}: expected KIND:NAME[:OPTION] with KIND in {sorted(_KINDS)}"
        raise ValueError(msg)
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


class StandIn:
    """The state of the stand-in: devices, sessions, the current fault and the log."""

    def __init__(
        self,
        devices: list[tuple[str, str, str | None]],
        *,
        username: str | None,
        password: str | None,
        session_service: bool,
    ) -> None:
        self.specs = devices
        self.username, self.password = username, password
        self.session_service = session_service
        self.sessions: dict[str, str] = {}  # token -> session path
        self.session_docs: dict[str, dict[str, Any]] = {}
        self.session_count = 0
        self.fault: dict[str, Any] = {"mode": "none"}
        self.log: deque[dict[str, Any]] = deque(maxlen=100_000)
        self.devices: dict[str, Device] = {}
        self.owner: dict[str, Device] = {}
        self.members: dict[str, list[str]] = {}
        self.build()

    def build(self) -> None:
        """(Re)build every device from its module and index its paths."""
        self.devices.clear()
        self.owner.clear()
        self.members = {path: [] for path in _COLLECTIONS}
        for kind, name, option in self.specs:
            if name in self.devices:
                msg = f"device name {name!r} given twice"
                raise ValueError(msg)
            module = importlib.import_module(f"tests.standins.redfish_{kind}")
            docs = module.resources(name) if option is None else module.resources(name, option)
            device = Device(kind, name, option, module, docs)
            self.devices[name] = device
            for path in docs:
                if path in _COLLECTIONS or path in _SERVICE_DOCS:
                    continue  # the server's own: built from every device
                if path in self.owner:
                    msg = f"{path} served by both {self.owner[path].name} and {name}"
                    raise ValueError(msg)
                self.owner[path] = device
                parent, _, _ = path.rpartition("/")
                if parent in self.members:
                    self.members[parent].append(path)

    def document(self, path: str) -> dict[str, Any] | None:
        """The document at ``path`` now, or None."""
        device = self.owner.get(path)
        if device is not None:
            return device.docs.get(path)
        if path in self.members:
            members = self.members[path]
            name, schema = _COLLECTIONS[path]
            return {
                "@odata.id": path,
                "@odata.type": f"#{schema}.{schema}",
                "Name": name,
                "Members": [{"@odata.id": m} for m in members],
                "Members@odata.count": len(members),
            }
        return self._service_document(path)

    def _service_document(self, path: str) -> dict[str, Any] | None:
        if path == ROOT:
            root: dict[str, Any] = {
                "@odata.id": ROOT,
                "@odata.type": "#ServiceRoot.v1_16_0.ServiceRoot",
                "Id": "RootService",
                "RedfishVersion": "1.18.0",
                "Chassis": {"@odata.id": f"{ROOT}/Chassis"},
                "PowerEquipment": {"@odata.id": f"{ROOT}/PowerEquipment"},
                "ThermalEquipment": {"@odata.id": f"{ROOT}/ThermalEquipment"},
            }
            if self.session_service:
                root["SessionService"] = {"@odata.id": f"{ROOT}/SessionService"}
                root["Links"] = {"Sessions": {"@odata.id": SESSIONS}}
            return root
        if path == f"{ROOT}/PowerEquipment":
            return {"@odata.id": path, "RackPDUs": {"@odata.id": f"{path}/RackPDUs"}}
        if path == f"{ROOT}/ThermalEquipment":
            return {"@odata.id": path, "CDUs": {"@odata.id": f"{path}/CDUs"}}
        if not self.session_service:
            return None
        if path == f"{ROOT}/SessionService":
            return {"@odata.id": path, "ServiceEnabled": True, "Sessions": {"@odata.id": SESSIONS}}
        if path == SESSIONS:
            return {
                "@odata.id": path,
                "Members": [{"@odata.id": p} for p in self.session_docs],
                "Members@odata.count": len(self.session_docs),
            }
        return self.session_docs.get(path)

    def authorized(self, request: web.Request) -> str | None:
        """How ``request`` authenticated (``token``, ``basic``, ``none``), or None: refused."""
        token = request.headers.get("X-Auth-Token")
        if token is not None and token in self.sessions:
            return "token"
        header = request.headers.get("Authorization", "")
        if header.startswith("Basic "):
            try:
                user, _, password = base64.b64decode(header[6:]).decode().partition(":")
            except ValueError:
                return None
            if (user, password) == (self.username, self.password):
                return "basic"
        return "none" if self.username is None else None


def _error(status: int, code: str, message: str) -> web.Response:
    body = {
        "error": {
            "code": f"Base.1.18.{code}",
            "message": message,
            "@Message.ExtendedInfo": [{"MessageId": f"Base.1.18.{code}", "Message": message}],
        }
    }
    return web.json_response(body, status=status)


def _etag(data: bytes) -> str:
    return '"' + hashlib.sha256(data).hexdigest()[:16] + '"'


def _numbers(value: Any, replace: Any) -> Any:
    """``value`` with every number (not bools) replaced by ``replace(number)``."""
    if isinstance(value, dict):
        return {k: _numbers(v, replace) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v, replace) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return replace(value)
    return value


def _faulted(doc: dict[str, Any], fault: Mapping[str, Any]) -> web.Response | None:
    """The answer a document-level fault gives instead of ``doc``, or None."""
    mode = fault["mode"]
    if mode == "oversized":
        return None  # streamed by the handler
    if mode == "deep":
        depth = int(fault.get("depth", 1000))
        text = '{"a":' * depth + "1" + "}" * depth
        return web.Response(text=text, content_type="application/json")
    if mode == "wrong_types":
        doc = _numbers(doc, str)
    elif mode == "nan":
        value = fault.get("value", "nan")
        doc = _numbers(doc, lambda _n: math.nan if value == "nan" else value)
    else:
        return None
    return web.Response(text=json.dumps(doc), content_type="application/json")


def make_app(state: StandIn) -> web.Application:
    """The aiohttp application serving ``state``."""
    app = web.Application(client_max_size=1024 * 1024)

    @web.middleware
    async def logged(request: web.Request, handler: Any) -> web.StreamResponse:
        response: web.StreamResponse = await handler(request)
        if not request.path.startswith("/_standin/"):
            state.log.append(
                {
                    "method": request.method,
                    "path": request.path,
                    "status": response.status,
                    "if_match": request.headers.get("If-Match"),
                    "auth": "token"
                    if "X-Auth-Token" in request.headers
                    else "basic"
                    if "Authorization" in request.headers
                    else None,
                }
            )
        return response

    app.middlewares.append(logged)
    app.router.add_route("*", "/_standin/{action}", functools.partial(control, state))
    app.router.add_route("*", "/{tail:.*}", functools.partial(serve, state))
    return app


async def control(state: StandIn, request: web.Request) -> web.Response:
    """The test-only endpoints."""
    action, method = request.match_info["action"], request.method
    if (action, method) == ("log", "GET"):
        return web.json_response({"requests": list(state.log)})
    if (action, method) == ("log", "DELETE"):
        state.log.clear()
        return web.json_response({})
    if (action, method) == ("sessions", "DELETE"):
        state.sessions.clear()
        state.session_docs.clear()
        return web.json_response({})
    if (action, method) == ("reset", "POST"):
        state.build()
        state.fault = {"mode": "none"}
        state.log.clear()
        return web.json_response({})
    body = await request.json()
    if (action, method) == ("fault", "POST"):
        if body.get("mode") not in FAULT_MODES:
            return web.json_response({"error": f"modes: {sorted(FAULT_MODES)}"}, status=400)
        state.fault = dict(body)
        return web.json_response(state.fault)
    if (action, method) == ("state", "POST"):
        device = state.devices.get(body.pop("device", None))
        if device is None:
            return web.json_response({"error": "unknown device"}, status=404)
        dark = body.pop("dark", device.dark)
        if not isinstance(dark, bool):
            return web.json_response({"error": "dark: expected true or false"}, status=400)
        try:
            if body:
                device.module.set_state(device.docs, device.name, body)
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        device.dark = dark
        return web.json_response({})
    return web.json_response({"error": "unknown control"}, status=404)


async def serve(state: StandIn, request: web.Request) -> web.StreamResponse:
    """A Redfish request: a dark device, faults, then authentication, then the resource."""
    path = request.path.rstrip("/") or "/"
    owner = state.owner.get(path)
    if owner is not None and owner.dark:
        # Nothing answers: the client's timeout ends the request (the connection is
        # dropped should one wait longer).
        await asyncio.sleep(_DARK_S)
        if request.transport is not None:
            request.transport.close()
        return web.Response(status=503)
    fault = state.fault
    mode = fault["mode"] if request.path.startswith(fault.get("path_prefix", "/")) else "none"
    if mode == "slow":
        await asyncio.sleep(float(fault.get("delay_s", 30.0)))
    if mode == "unauthorized":
        return _error(401, "NoValidSession", "unauthorized (fault)")
    if mode == "error500":
        return _error(500, "InternalError", "internal error (fault)")
    if mode == "redirect_offhost":
        location = f"http://192.0.2.1:{request.url.port}{request.path}"
        return web.Response(status=302, headers={"Location": location})
    if mode == "redirect_samehost" and int(fault.get("hops", 1)) > 0:
        fault["hops"] = int(fault.get("hops", 1)) - 1
        return web.Response(status=302, headers={"Location": request.path})
    if request.method == "POST" and path == SESSIONS and state.session_service:
        return await _login(state, request)
    if path != ROOT and state.authorized(request) is None:
        return _error(401, "NoValidSession", "authentication required")
    if request.method == "DELETE" and path in state.session_docs:
        del state.session_docs[path]
        for token in [t for t, p in state.sessions.items() if p == path]:
            del state.sessions[token]
        return web.Response(status=204)
    doc = state.document(path)
    if doc is None:
        return _error(404, "ResourceMissingAtURI", f"{path} not found")
    data = json.dumps(doc).encode()
    if request.method == "PATCH":
        return await _patch(state, request, path, data, liar=mode == "liar")
    if request.method != "GET":
        return _error(405, "OperationNotAllowed", f"{request.method} {path}")
    if mode == "oversized":
        return await _oversized(request, chunked=bool(fault.get("chunked", False)))
    faulted = _faulted(doc, {**fault, "mode": mode})
    if faulted is not None:
        return faulted
    return web.Response(body=data, content_type="application/json", headers={"ETag": _etag(data)})


async def _login(state: StandIn, request: web.Request) -> web.Response:
    body = await request.json()
    if state.username is not None and (body.get("UserName"), body.get("Password")) != (
        state.username,
        state.password,
    ):
        return _error(401, "NoValidSession", "wrong user or password")
    state.session_count += 1
    path = f"{SESSIONS}/{state.session_count}"
    token = secrets.token_hex(16)
    state.sessions[token] = path
    doc = {"@odata.id": path, "Id": str(state.session_count), "UserName": body.get("UserName")}
    state.session_docs[path] = doc
    return web.json_response(doc, status=201, headers={"X-Auth-Token": token, "Location": path})


async def _patch(
    state: StandIn, request: web.Request, path: str, current: bytes, *, liar: bool
) -> web.Response:
    device = state.owner.get(path)
    patcher = getattr(device.module, "patch", None) if device is not None else None
    if device is None or patcher is None:
        return _error(405, "OperationNotAllowed", f"PATCH {path}")
    if_match = request.headers.get("If-Match")
    if if_match is not None and if_match not in {"*", _etag(current)}:
        return _error(412, "PreconditionFailed", f"{path} changed since {if_match}")
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "MalformedJSON", "not JSON")
    if not isinstance(body, dict):
        return _error(400, "MalformedJSON", "not a JSON object")
    if liar:
        return web.json_response({"@Message.ExtendedInfo": [{"Message": "Success"}]})
    problem = patcher(device.docs, device.name, path, body)
    if problem is not None:
        return _error(400, "PropertyValueOutOfRange", problem)
    return web.Response(status=204)


async def _oversized(request: web.Request, *, chunked: bool) -> web.StreamResponse:
    """A 20 MB JSON answer, with or without a Content-Length."""
    chunk = b" " * (1024 * 1024)
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    if chunked:
        response.enable_chunked_encoding()
    else:
        response.content_length = 20 * len(chunk) + 2
    await response.prepare(request)
    try:
        await response.write(b"{")
        for _ in range(20):
            await response.write(chunk)
        await response.write(b"}")
        await response.write_eof()
    except ConnectionError:
        pass  # the client refused the body, as it should
    return response


def main(argv: list[str] | None = None) -> None:
    """Run the stand-in until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m tests.standins.redfish")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--username", default=None)
    parser.add_argument("--password", default=None)
    parser.add_argument("--no-session-service", action="store_true")
    parser.add_argument("--tls-cert", type=Path, default=None)
    parser.add_argument("--tls-key", type=Path, default=None)
    parser.add_argument("--device", action="append", default=[], metavar="KIND:NAME[:OPTION]")
    parser.add_argument("--devices-file", type=Path, default=None)
    args = parser.parse_args(argv)
    specs = list(args.device)
    if args.devices_file is not None:
        specs += json.loads(args.devices_file.read_text(encoding="utf-8"))
    state = StandIn(
        [parse_device(s) for s in specs],
        username=args.username,
        password=args.password,
        session_service=not args.no_session_service,
    )
    context = None
    if args.tls_cert is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.tls_cert, args.tls_key)
    web.run_app(
        make_app(state),
        host=args.host,
        port=args.port,
        ssl_context=context,
        print=None,
        access_log=None,
    )


if __name__ == "__main__":
    main()
