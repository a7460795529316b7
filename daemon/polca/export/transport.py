"""The HTTP write APIs of InfluxDB and compatible stores: the only importer of their clients.

``V2Transport`` posts to ``/api/v2/write`` through ``influxdb_client``'s async API (InfluxDB
1.8+, 2.x, 3.x, VictoriaMetrics); ``V1Transport`` to ``/write`` of InfluxDB 1.x with
``aiohttp``. Both are imported lazily (they are heavy, and only a running sink needs them).
Each ``send`` posts one body and turns the answer into polca's errors: an outage to retry
(``InfluxUnavailableError``) or data the database refused (``BatchRejectedError``, with the
points a partial write names). No batching, retrying or spooling here: ``influx.py`` does.
"""

from __future__ import annotations

import contextlib
import json
import re
import urllib.parse
from typing import TYPE_CHECKING, Final, Protocol, cast

from polca.errors import BatchRejectedError, InfluxUnavailableError, PolcaError

if TYPE_CHECKING:
    import aiohttp
    from influxdb_client.client.influxdb_client_async import InfluxDBClientAsync
    from influxdb_client.client.write_api_async import WriteApiAsync
    from influxdb_client.domain.write_precision import WritePrecision

    from polca.settings import InfluxSettings

PRECISION: Final = "ms"
"""Timestamp precision of every write and of the spool files."""

_RETRY_STATUSES: Final = frozenset({401, 403, 404, 408, 429})
_ERROR_MAX_CHARS: Final = 500
# InfluxDB 1.x: "partial write: <reason> dropped=N"; N leaves out the lines that failed to
# parse, which it lists instead, one "unable to parse '<line>': <why>" per line, joined by
# newlines (a line itself never holds a newline).
_DROPPED: Final = re.compile(r" dropped=([0-9]+)\s*\Z")
_UNPARSED: Final = re.compile(r"(?:\A|\n)(?:partial write: )?unable to parse '")


def redacted(url: str) -> str:
    """The URL without user:password, for logs."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _error_text(body: bytes | str | None) -> str:
    """The message in an InfluxDB error body (``{"error": ...}`` or ``{"message": ...}``)."""
    if body is None:
        return ""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    with contextlib.suppress(ValueError, AttributeError):
        parsed = json.loads(text)
        for key in ("error", "message"):
            if isinstance(parsed.get(key), str):
                return str(parsed[key])
    return text.strip()[:500]


def classify_status(status: int, message: str, *, retry_after: str | None = None) -> PolcaError:
    """The error for a non-2xx answer: retry later (outage) or drop the batch (bad data).

    For bad data, ``dropped_points`` is what a partial write names: the ``dropped=N`` of
    InfluxDB 1.x plus the lines it lists as unparsable; None when the answer names nothing
    (the whole batch, as far as the sink can tell).
    """
    if status >= 500 or status in _RETRY_STATUSES:
        delay_s = 0.0
        with contextlib.suppress(TypeError, ValueError):
            delay_s = float(retry_after) if retry_after is not None else 0.0
        hint = ""
        if status == 404:
            hint = " (wrong URL, missing database/bucket, or an InfluxDB 1.x needing api: v1?)"
        elif status in {401, 403}:
            hint = " (check the token / user name and password)"
        msg = f"HTTP {status}: {message}{hint}"
        return InfluxUnavailableError(msg, status=status, delay_s=delay_s)
    dropped_points: int | None = None
    dropped = _DROPPED.search(message)
    if dropped is not None and "partial write:" in message:
        dropped_points = int(dropped.group(1)) + len(_UNPARSED.findall(message))
    # One kind per class of error: quoted names and numbers vary from batch to batch.
    kind = re.sub(r"\d+", "N", re.split(r"[\"'`]", message, maxsplit=1)[0]).strip()
    if len(message) > _ERROR_MAX_CHARS:  # InfluxDB quotes every bad line: keep logs short
        message = message[: _ERROR_MAX_CHARS - 1] + "…"
    return BatchRejectedError(
        f"HTTP {status}: {message}",
        status=status,
        kind=f"{status}:{kind[:80]}",
        dropped_points=dropped_points,
    )


class Transport(Protocol):
    async def send(self, body: bytes) -> None:
        """POST one line-protocol body; raise InfluxUnavailableError or BatchRejectedError."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


class V2Transport:
    """``/api/v2/write`` through influxdb-client's async API (no batching or retries there)."""

    def __init__(self, settings: InfluxSettings, token: str | None) -> None:
        self._settings = settings
        self._token = token
        self._client: InfluxDBClientAsync | None = None
        self._write_api: WriteApiAsync | None = None

    async def send(self, body: bytes) -> None:
        import aiohttp  # noqa: PLC0415 - heavy; imported when the first batch goes out
        from influxdb_client.client.exceptions import InfluxDBError  # noqa: PLC0415
        from influxdb_client.client.influxdb_client_async import (  # noqa: PLC0415
            InfluxDBClientAsync,
        )
        from influxdb_client.domain.write_precision import (  # noqa: PLC0415
            WritePrecision as Precision,
        )
        from influxdb_client.rest import ApiException  # noqa: PLC0415

        settings = self._settings
        if self._client is None or self._write_api is None:
            # The async client must be made inside the running loop.
            self._client = InfluxDBClientAsync(
                url=str(settings.url),
                token=self._token or "",  # empty: no Authorization header
                org=settings.org,
                timeout=int(settings.timeout_s * 1000),
            )
            self._write_api = self._client.write_api()
        try:
            await self._write_api.write(
                bucket=settings.bucket,
                org=settings.org,
                record=body,
                write_precision=cast("WritePrecision", Precision.MS),
            )
        except ApiException as exc:
            status = int(exc.status or 0)
            message = _error_text(exc.body) or str(exc.reason)
            retry_after = exc.headers.get("Retry-After") if exc.headers else None
            raise classify_status(status, message, retry_after=retry_after) from exc
        except (InfluxDBError, aiohttp.ClientError, TimeoutError, OSError) as exc:
            msg = f"{type(exc).__name__}: {exc}"
            raise InfluxUnavailableError(msg) from exc

    async def aclose(self) -> None:
        client, self._client, self._write_api = self._client, None, None
        if client is not None:
            await client.close()  # type: ignore[no-untyped-call]


class V1Transport:
    """``/write?db=&rp=&precision=ms`` of InfluxDB 1.x, posted with aiohttp."""

    def __init__(self, settings: InfluxSettings, token: str | None) -> None:
        self._settings = settings
        self._password = token
        self._session: aiohttp.ClientSession | None = None
        params = {"db": settings.database, "precision": PRECISION}
        if settings.retention_policy:
            params["rp"] = settings.retention_policy
        self._url = f"{str(settings.url).rstrip('/')}/write?{urllib.parse.urlencode(params)}"

    async def send(self, body: bytes) -> None:
        import aiohttp  # noqa: PLC0415 - heavy; imported when the first batch goes out

        settings = self._settings
        if self._session is None:
            auth = None
            if settings.username is not None:
                auth = aiohttp.BasicAuth(settings.username, self._password or "")
            self._session = aiohttp.ClientSession(
                auth=auth, timeout=aiohttp.ClientTimeout(total=settings.timeout_s)
            )
        try:
            async with self._session.post(
                self._url, data=body, headers={"Content-Type": "text/plain; charset=utf-8"}
            ) as response:
                if 200 <= response.status < 300:
                    return
                message = _error_text(await response.read())
                raise classify_status(
                    response.status, message, retry_after=response.headers.get("Retry-After")
                )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            msg = f"{type(exc).__name__}: {exc}"
            raise InfluxUnavailableError(msg) from exc

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
