"""The one HTTP client polca speaks Redfish with: the only module here that imports aiohttp.

``connect`` logs in to one Redfish service (a BMC, a PDU, a CDU) and returns an
``HttpRedfishSession``, the HTTP implementation of ``polca.redfish.api.RedfishSession``.
Everything a service answers is hostile until checked, so this module bounds what it
accepts and turns every failure into polca's taxonomy (nothing else escapes):

- ``TransportError``: unreachable, connection reset, TLS refused, a request over
  ``timeout_s``, an HTTP 5xx; ``TransportAuthError`` for 401/403 (after one re-login when a
  session token expired).
- ``ReadingRejectedError``: an answer larger than ``max_body_bytes`` (refused from its
  Content-Length, else after a bounded streamed read: ``oversized``); not JSON, not an
  object, nested deeper than ``MAX_DEPTH`` or a path that is not a Redfish path
  (``malformed``); a redirect to another scheme, host or port, or more than
  ``MAX_REDIRECTS`` (``redirect``); 404 (``not_found``); another 4xx, such as a PATCH the
  service refused (``refused``, with the service's message).
- ``ConfigError``: a user is configured but no password can be read.

Authentication: with a user, a Redfish session (``POST SessionService/Sessions``, then
``X-Auth-Token``; ``close`` deletes it), or HTTP basic when the service has no session
service. TLS is verified (``ca_file`` or the system's CAs) unless ``verify_tls`` is off.
Redirects are never followed by aiohttp; this module follows a few, on the same origin.
A PATCH carries ``If-Match`` with the ETag of the last GET of that path, if it had one.
It does not read the readers' values: readers check every value they use.
"""

from __future__ import annotations

import base64
import contextlib
import json
import ssl
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

import aiohttp
from yarl import URL

from polca.errors import ConfigError, ReadingRejectedError, TransportAuthError, TransportError
from polca.redfish.api import RedfishEndpoint, RedfishSession
from polca.redfish.documents import checked_path
from polca.settings import read_secret

__all__ = [
    "MAX_DEPTH",
    "MAX_REDIRECTS",
    "SESSIONS_PATH",
    "HttpRedfishSession",
    "connect",
    "decode_document",
]

MAX_DEPTH: Final = 32
"""The deepest nesting of objects and arrays accepted in a document (the object is 1)."""
MAX_REDIRECTS: Final = 3
"""The most redirects followed for one request, each to the service's own origin."""
SESSIONS_PATH: Final = "/redfish/v1/SessionService/Sessions"
"""Where a Redfish session is created (POST) on every service."""
CONNECTIONS: Final = 4
"""Connections kept to one service at most."""
_MAX_ETAGS: Final = 256
_MAX_TOKEN_CHARS: Final = 1024
_CHUNK_BYTES: Final = 64 * 1024
_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})


def decode_document(body: bytes, *, what: str) -> dict[str, Any]:
    """``body`` as a JSON object nested at most ``MAX_DEPTH`` deep, else ``ReadingRejectedError``.

    The size is bounded before this is called. NaN and infinities parse (the readers
    refuse them with reason ``nan``); anything that is not a JSON object is ``malformed``.
    """
    try:
        parsed = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        msg = f"{what}: not JSON ({type(exc).__name__})"
        raise ReadingRejectedError(msg, reason="malformed") from exc
    if not isinstance(parsed, dict):
        msg = f"{what}: not a JSON object but {type(parsed).__name__}"
        raise ReadingRejectedError(msg, reason="malformed")
    if _depth(parsed) > MAX_DEPTH:
        msg = f"{what}: JSON nested deeper than {MAX_DEPTH} levels"
        raise ReadingRejectedError(msg, reason="malformed")
    return parsed


def _depth(value: object) -> int:
    """How deep objects and arrays nest in ``value`` (iterative: no recursion limit)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


async def connect(endpoint: RedfishEndpoint, *, password: str | None = None) -> HttpRedfishSession:
    """A session with ``endpoint``, logged in when it has a user.

    ``password`` defaults to the endpoint's password file or systemd credential. Raises
    ``ConfigError`` when a user is set and no password can be read, else as the session's
    methods do.
    """
    if endpoint.username is not None and password is None:
        try:
            password = read_secret(endpoint.password_file, endpoint.credential)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if password is None:
            msg = (
                f"{endpoint.url}: user {endpoint.username!r} has no password: set "
                f"password_file or the systemd credential {endpoint.credential!r}"
            )
            raise ConfigError(msg)
    session = HttpRedfishSession(endpoint, password=password)
    try:
        await session.login()
    except BaseException:
        await session.close()
        raise
    return session


class HttpRedfishSession(RedfishSession):
    """A ``RedfishSession`` over HTTP(S) with one bounded aiohttp session (no I/O here)."""

    def __init__(self, endpoint: RedfishEndpoint, *, password: str | None = None) -> None:
        """Speak to ``endpoint``; ``login`` (``connect`` calls it) authenticates."""
        self.endpoint = endpoint
        self._base = URL(endpoint.url.rstrip("/"))
        self._password = password
        self._http: aiohttp.ClientSession | None = None
        self._token: str | None = None
        self._logout_path: str | None = None
        self._basic: str | None = None  # the Authorization header of basic auth
        self._etags: OrderedDict[str, str] = OrderedDict()
        self._closed = False

    def _ssl(self) -> ssl.SSLContext | bool:
        if self._base.scheme != "https":
            return True  # unused for http://
        if not self.endpoint.verify_tls:
            return False
        ca = self.endpoint.ca_file
        return ssl.create_default_context(cafile=str(ca) if ca is not None else None)

    def _client(self) -> aiohttp.ClientSession:
        if self._closed:
            msg = f"{self.endpoint.url}: the Redfish session is closed"
            raise TransportError(msg)
        if self._http is None:
            connector = aiohttp.TCPConnector(
                limit=CONNECTIONS, limit_per_host=CONNECTIONS, ssl=self._ssl()
            )
            self._http = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.endpoint.timeout_s),
                headers={"Accept": "application/json", "OData-Version": "4.0"},
                auto_decompress=True,
            )
        return self._http

    async def login(self) -> None:
        """Authenticate: a Redfish session, else basic auth; no-op without a user.

        Raises ``TransportAuthError`` when the service refuses the credentials.
        """
        user = self.endpoint.username
        if user is None:
            return
        self._token = None
        sessions = await self._sessions_path()
        body = {"UserName": user, "Password": self._password or ""}
        status, headers, _ = (
            (404, {}, b"")
            if sessions is None
            else await self._send("POST", sessions, body, read=False)
        )
        if status in {404, 405, 501}:
            # No session service: HTTP basic on every request instead.
            if ":" in user:
                msg = f"{self.endpoint.url}: a user name with ':' cannot use basic auth"
                raise ConfigError(msg)
            pair = f"{user}:{self._password or ''}".encode()
            self._basic = "Basic " + base64.b64encode(pair).decode("ascii")
            return
        self._raise_for(status, "POST", sessions or SESSIONS_PATH, b"")
        token = headers.get("X-Auth-Token")
        if not token or len(token) > _MAX_TOKEN_CHARS:
            msg = f"{self.endpoint.url}: session created without a usable X-Auth-Token"
            raise ReadingRejectedError(msg, reason="malformed")
        self._token = token
        location = headers.get("Location")
        self._logout_path = self._same_origin_path(location) if location else None

    async def _sessions_path(self) -> str | None:
        """Where to create a session: the service root's ``Links.Sessions``.

        None when the root (which needs no authentication) has no such link: the service
        has no session service. ``SESSIONS_PATH`` when the root cannot be read anonymously.
        """
        status, _, data = await self._send("GET", "/redfish/v1", None)
        if status != 200:
            return SESSIONS_PATH
        root = decode_document(data, what=f"{self.endpoint.url}/redfish/v1")
        links = root.get("Links")
        sessions = links.get("Sessions") if isinstance(links, dict) else None
        target = sessions.get("@odata.id") if isinstance(sessions, dict) else None
        return None if target is None else checked_path(target)

    async def get(self, path: str) -> Mapping[str, Any]:
        """The JSON object at ``path`` (bounded in size and depth)."""
        path = checked_path(path)
        status, headers, body = await self._authed("GET", path, None)
        self._raise_for(status, "GET", path, body)
        document = decode_document(body, what=f"{self.endpoint.url}{path}")
        etag = headers.get("ETag")
        self._etags.pop(path, None)
        if etag and len(etag) <= 256:
            self._etags[path] = etag
            while len(self._etags) > _MAX_ETAGS:
                self._etags.popitem(last=False)
        return document

    async def patch(self, path: str, body: Mapping[str, Any]) -> None:
        """PATCH ``body`` to ``path``, with ``If-Match`` when its last GET had an ETag."""
        path = checked_path(path)
        status, _, answer = await self._authed("PATCH", path, dict(body))
        self._etags.pop(path, None)  # the resource changed (or was refused): GET it again
        self._raise_for(status, "PATCH", path, answer)

    async def close(self) -> None:
        """Delete the Redfish session (best effort) and close the connections; idempotent.

        A failed logout is not an error: the service expires the session on its own.
        """
        if self._closed:
            return
        try:
            if self._token is not None and self._logout_path is not None:
                # A failed logout: the session times out on the service.
                with contextlib.suppress(TransportError, ReadingRejectedError):
                    await self._send("DELETE", self._logout_path, None, read=False)
        finally:
            self._closed = True
            self._token = None
            if self._http is not None:
                await self._http.close()
                self._http = None

    async def _authed(
        self, method: str, path: str, body: dict[str, Any] | None
    ) -> tuple[int, Mapping[str, str], bytes]:
        """One request; on a 401 with a session token, log in again and retry once."""
        had_token = self._token is not None
        answer = await self._send(method, path, body)
        if answer[0] == 401 and had_token:
            await self.login()
            answer = await self._send(method, path, body)
        return answer

    def _auth_headers(self, method: str, path: str) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self._token is not None:
            headers["X-Auth-Token"] = self._token
        elif self._basic is not None:
            headers["Authorization"] = self._basic
        if method == "PATCH" and path in self._etags:
            headers["If-Match"] = self._etags[path]
        return headers

    async def _send(
        self, method: str, path: str, body: dict[str, Any] | None, *, read: bool = True
    ) -> tuple[int, Mapping[str, str], bytes]:
        """Status, headers and bounded body of one request, following same-origin redirects."""
        client = self._client()
        target = path
        for _hop in range(MAX_REDIRECTS + 1):
            url = URL(str(self._base) + target, encoded=True)
            try:
                async with client.request(
                    method,
                    url,
                    json=body,
                    headers=self._auth_headers(method, target),
                    allow_redirects=False,
                ) as response:
                    status = response.status
                    if status in _REDIRECTS:
                        target = self._redirect(method, target, response.headers.get("Location"))
                        continue
                    data = await self._read(response, target) if read else b""
                    return status, response.headers, data
            except aiohttp.ClientConnectorCertificateError as exc:
                msg = (
                    f"{self.endpoint.url}: TLS certificate not trusted ({exc.certificate_error}); "
                    "set ca_file to the CA that signed it (verify_tls: false only in a lab)"
                )
                raise TransportError(msg) from exc
            except TimeoutError as exc:
                msg = f"{self.endpoint.url}{target}: no answer within {self.endpoint.timeout_s:g} s"
                raise TransportError(msg) from exc
            except (aiohttp.ClientError, OSError) as exc:
                msg = f"{self.endpoint.url}{target}: cannot reach ({type(exc).__name__}: {exc})"
                raise TransportError(msg) from exc
        msg = f"{self.endpoint.url}{path}: more than {MAX_REDIRECTS} redirects"
        raise ReadingRejectedError(msg, reason="redirect")

    def _redirect(self, method: str, path: str, location: str | None) -> str:
        """The path a redirect points to, if it stays on this service's origin."""
        if location is None:
            msg = f"{self.endpoint.url}{path}: redirect without a Location"
            raise ReadingRejectedError(msg, reason="redirect")
        if method != "GET":
            msg = f"{self.endpoint.url}{path}: {method} redirected to {location[:120]}"
            raise ReadingRejectedError(msg, reason="redirect")
        return self._same_origin_path(location)

    def _same_origin_path(self, location: str) -> str:
        try:
            target = self._base.join(URL(location))
        except ValueError as exc:
            msg = f"{self.endpoint.url}: unusable Location {location[:120]!r}"
            raise ReadingRejectedError(msg, reason="redirect") from exc
        base = self._base
        if (target.scheme, target.host, target.port) != (base.scheme, base.host, base.port):
            msg = f"{self.endpoint.url}: refused a redirect to another origin: {location[:120]}"
            raise ReadingRejectedError(msg, reason="redirect")
        if target.query_string or target.fragment:
            msg = f"{self.endpoint.url}: refused a redirect with a query: {location[:120]}"
            raise ReadingRejectedError(msg, reason="redirect")
        return checked_path(target.raw_path)

    async def _read(self, response: aiohttp.ClientResponse, path: str) -> bytes:
        """The body, refused as ``oversized`` beyond ``max_body_bytes`` (never read whole)."""
        limit = self.endpoint.max_body_bytes
        declared = response.content_length
        if declared is not None and declared > limit:
            msg = f"{self.endpoint.url}{path}: answer of {declared} bytes (limit {limit})"
            raise ReadingRejectedError(msg, reason="oversized")
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
            size += len(chunk)
            if size > limit:
                msg = f"{self.endpoint.url}{path}: answer over {limit} bytes"
                raise ReadingRejectedError(msg, reason="oversized")
            chunks.append(chunk)
        return b"".join(chunks)

    def _raise_for(self, status: int, method: str, path: str, body: bytes) -> None:
        """Nothing for 2xx, else the error the status means."""
        where = f"{self.endpoint.url}{path}"
        if 200 <= status < 300:
            return
        if status in {401, 403}:
            msg = f"{where}: {method} refused with HTTP {status}: check the user and password"
            raise TransportAuthError(msg)
        if status == 404:
            msg = f"{where}: not found (HTTP 404)"
            raise ReadingRejectedError(msg, reason="not_found")
        if status >= 500:
            msg = f"{where}: {method} failed with HTTP {status}{_message(body)}"
            raise TransportError(msg)
        msg = f"{where}: {method} refused with HTTP {status}{_message(body)}"
        raise ReadingRejectedError(msg, reason="refused")


def _message(body: bytes) -> str:
    """The message of a Redfish error body, if it has one (bounded, for error texts)."""
    try:
        error = decode_document(body, what="error").get("error")
    except ReadingRejectedError:
        return ""
    if not isinstance(error, dict):
        return ""
    message = error.get("message")
    info = error.get("@Message.ExtendedInfo")
    if isinstance(info, list) and info and isinstance(info[0], dict):
        message = info[0].get("Message", message)
    return f": {str(message)[:200]}" if isinstance(message, str) else ""
