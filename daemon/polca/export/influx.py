"""The InfluxDB sink: points from the aggregator into InfluxDB, without losing them.

Why this module exists: the aggregator's loops must never wait for, or fail because of, the
time-series database. ``Sink.write`` only appends to memory; ``run`` sends batches in the
background; an outage of the database is bridged by an on-disk spool (``spool.py``) that is
replayed when the database answers again, including after a restart of the aggregator. The
HTTP write itself is ``transport.py``'s, the only importer of ``influxdb_client`` and
``aiohttp``.

What it must not do: retry bad data forever, grow without bound, or block the event loop on
the network. The rules, each counted in ``stats`` and logged:

- A batch goes out when ``batch_size`` points wait or ``flush_interval_s`` after the first
  of them arrived. One request at a time, oldest data first (the spool before memory;
  essential points before bulk ones, below).
- Connection errors, timeouts, HTTP 5xx, 429, 408, and 401/403/404 (credentials, URL,
  database: an operator fixes those, the data is fine) are an *outage*: the batch is kept,
  the next try waits a jittered, doubling delay from ``retry_min_s`` to ``retry_max_s``
  (or the server's ``Retry-After``). ``influx_unreachable`` is logged once per outage and
  ``influx_recovered`` once the backlog has been replayed.
- Other 4xx answers (bad data) drop that batch, count its points as rejected and log
  ``influx_batch_rejected`` once per kind of error. A *partial write* (InfluxDB 1.x: 400
  ``partial write: ... dropped=N``, where lines that failed to parse are listed but not in
  N) counts only the lines the answer names as rejected; an answer that names none counts
  the whole batch (at least one point, whatever it says).
- During an outage, points go to the spool (``spool_dir``) in segments of up to
  ``batch_size`` points, at the latest ``flush_interval_s`` after they arrived. Memory also
  spills to the spool when it nears ``max_buffer_points`` while the database is slow. Beyond
  ``spool_max_mb`` the oldest segments are deleted and their points counted as dropped;
  without a spool, memory holds ``max_buffer_points`` and the oldest points are dropped.
- Points come in two classes (``schema.py`` ``ESSENTIAL_MEASUREMENTS``: rows, racks,
  nodes, control, cooling, leadership, the aggregator's health; the rest is *bulk*: per-GPU
  series, GPU health, agent reports, events, whose volume the nodes set). Memory holds one
  queue per class under the one ``max_buffer_points`` bound, and the spool one kind of
  segment per class under the one ``spool_max_mb`` bound: both evict bulk points first, so
  essential points are lost only when they alone exceed a bound. A batch sends essential
  lines first; within a class, oldest first. Drops of bulk points are counted as
  ``memory_full_bulk`` and ``spool_full_bulk``, of essential ones as ``memory_full`` and
  ``spool_full``.
- ``close`` spends at most ``timeout_s``: it sends what is in memory if the database is
  reachable and spools the rest (or, without a spool, drops and counts it).

The spool (``spool.py``) is a directory of segment files with a checksum per line, locked by
one process at a time; whatever is wrong in it (cut or altered segments, foreign files,
leftovers of a crash or a full disk) is counted and logged here, never fatal. See
``docs/influxdb.md`` for the format and the loss bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import structlog

from polca import aiokit
from polca.errors import BatchRejectedError, ConfigError, InfluxUnavailableError
from polca.export.schema import ESSENTIAL_MEASUREMENTS
from polca.export.sink import SinkStats
from polca.export.spool import Spool
from polca.export.transport import PRECISION, Transport, V1Transport, V2Transport, redacted

if TYPE_CHECKING:
    from polca.export.points import AnyPoint
    from polca.settings import InfluxSettings

_T = TypeVar("_T")

_DROP_LOG_INTERVAL_S: Final = 60.0
_SPOOL_RETRY_S: Final = 5.0
_CLOSE_RESERVE_FRACTION: Final = 0.3


def resolve_token(settings: InfluxSettings) -> str | None:
    """The v2 token (or v1 password): ``influx.token``, ``token_file``, or the credential.

    The systemd credential is ``$CREDENTIALS_DIRECTORY/influx_token`` (``LoadCredential=``).
    Only the first line of a file counts. A ``token_file`` that cannot be read is a
    ``ConfigError``; no token at all is fine (VictoriaMetrics, InfluxDB without auth).
    """
    if settings.token is not None:
        return settings.token.get_secret_value()
    if settings.token_file is not None:
        try:
            return _first_line(settings.token_file)
        except OSError as exc:
            msg = f"cannot read influx.token_file {settings.token_file}: {exc}"
            raise ConfigError(msg) from exc
    cred_dir = os.environ.get("CREDENTIALS_DIRECTORY")
    if cred_dir:
        credential = Path(cred_dir) / "influx_token"
        if credential.is_file():
            return _first_line(credential)
    return None


def _first_line(path: Path) -> str:
    lines = path.read_text(encoding="utf-8").splitlines()
    return lines[0].strip() if lines else ""


async def _in_thread(function: Callable[..., _T], *args: Any) -> _T:
    """Run blocking file I/O in a worker thread; a cancellation waits for it to finish.

    A spool operation abandoned halfway would leave memory and disk disagreeing about
    which points are where, so it always completes before the cancellation propagates.
    """
    future = asyncio.get_running_loop().run_in_executor(None, function, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


@dataclasses.dataclass(frozen=True, slots=True)
class _Lines:
    """Lines taken from memory for one batch: essential ones (sent first), then bulk ones."""

    essential: list[bytes]
    bulk: list[bytes]

    def __len__(self) -> int:
        return len(self.essential) + len(self.bulk)

    def __bool__(self) -> bool:
        return bool(self.essential or self.bulk)

    def body(self) -> bytes:
        """The request body: one line of line protocol per point, essential ones first."""
        return b"\n".join(self.essential + self.bulk)


class InfluxSink:
    """Batches, retries and spools points into InfluxDB (v2 or v1 write API).

    Construct anywhere (no I/O); ``run`` inside the event loop that calls ``write``.
    ``token`` overrides ``resolve_token(settings)``; ``clock`` is a monotonic clock in
    seconds.
    """

    def __init__(
        self,
        settings: InfluxSettings,
        *,
        token: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if settings.url is None:
            msg = "influx.url is not set: nothing to write to"
            raise ConfigError(msg)
        self._settings = settings
        self._token = token
        self._clock = clock
        self._log_context = {"sink": "influx", "url": redacted(settings.url), "api": settings.api}
        # Lines waiting in memory, oldest first: essential ones, and bulk ones (evicted first).
        self._essential: deque[bytes] = deque()
        self._bulk: deque[bytes] = deque()
        self._oldest_at: float | None = None
        self._wake = asyncio.Event()
        self._finished = asyncio.Event()
        self._closing = False
        self._close_deadline = 0.0
        self._running = False
        self._started = False
        self._send_timeout: asyncio.Timeout | None = None
        self._spool = (
            Spool(settings.spool_dir, max_bytes=int(settings.spool_max_mb * 1024 * 1024))
            if settings.spool_dir is not None
            else None
        )
        self._spool_retry_at = 0.0
        self._transport: Transport | None = None
        # Outage bookkeeping: when it began, when to try next, how to back off.
        self._outage_since: float | None = None
        self._recovered_at: float | None = None
        self._recovered_outage_s = 0.0
        self._replayed = 0
        self._retry_at = 0.0
        self._delays: Iterator[float] | None = None
        self._rejected_kinds: set[str] = set()
        self._drop_logged_at: dict[str, float] = {}
        # Counters.
        self._written = 0
        self._rejected = 0
        self._write_errors = 0
        self._last_error: str | None = None
        self._dropped: dict[str, int] = {}

    def _log(self) -> Any:
        # Bound per call, not once: logging configuration (and capture_logs in tests) may
        # change after the sink is built. The sink logs rarely.
        return structlog.get_logger().bind(**self._log_context)

    # -- the caller's side ----------------------------------------------------------------

    def write(self, points: Sequence[AnyPoint]) -> None:
        """Queue points (as line protocol) for the next batch; never blocks or raises."""
        if self._closing:
            self._drop("closed", len(points))
            return
        was_empty = not self._buffered
        essential, bulk = self._essential, self._bulk
        invalid = 0
        for point in points:
            try:
                line = point.encode(PRECISION)
            except (AttributeError, TypeError, ValueError):
                invalid += 1  # a value line protocol cannot carry: a caller's bug
                continue
            if line:
                (essential if point.measurement in ESSENTIAL_MEASUREMENTS else bulk).append(line)
        self._drop("invalid", invalid)
        if not self._buffered:
            return
        if was_empty:
            self._oldest_at = self._clock()
        self._enforce_memory_bound()
        if was_empty or self._buffered >= self._settings.batch_size:
            self._wake.set()

    @property
    def _buffered(self) -> int:
        """Lines waiting in memory, of both classes."""
        return len(self._essential) + len(self._bulk)

    @property
    def stats(self) -> SinkStats:
        """Counters since start and the current memory and spool backlog."""
        spool = self._spool
        dropped = dict(self._dropped)
        if spool is not None and spool.evicted_points:
            dropped["spool_full"] = spool.evicted_points
        if spool is not None and spool.evicted_bulk_points:
            dropped["spool_full_bulk"] = spool.evicted_bulk_points
        if spool is not None and spool.unreadable_points:
            dropped["spool_unreadable"] = spool.unreadable_points
        if spool is not None and spool.corrupt_points:
            dropped["spool_corrupt"] = spool.corrupt_points
        return SinkStats(
            points_written=self._written,
            points_dropped=sum(dropped.values()),
            points_rejected=self._rejected,
            points_spooled=spool.appended_points if spool else 0,
            spool_points=spool.points if spool else 0,
            spool_bytes=spool.size_bytes if spool else 0,
            points_buffered=self._buffered,
            write_errors=self._write_errors,
            last_error=self._last_error,
            dropped=dropped,
        )

    @property
    def in_outage(self) -> bool:
        """Whether the last write attempt failed and the database is considered down."""
        return self._outage_since is not None

    # -- lifecycle ------------------------------------------------------------------------

    async def run(self) -> None:
        """Open the spool (replaying what a previous run left) and send until closed."""
        if self._running:
            msg = "InfluxSink.run() is already running"
            raise RuntimeError(msg)
        if self._closing:
            # close() came first (before this task got to run) and flushes by itself; a
            # second flush beside it would open the spool twice.
            await self._finished.wait()
            return
        self._running = True
        try:
            await self._open()
            while not self._closing:
                await self._step()
            # Closing: the final flush is bounded by the deadline close() set.
            await self._final_flush()
        finally:
            self._running = False
            await self._close_transport()

    async def close(self, timeout_s: float) -> None:
        """Send what memory holds if the database answers, spool the rest; at most ``timeout_s``.

        Works whether ``run`` is active (it is asked to finish), was cancelled, or never ran.
        """
        if self._finished.is_set():
            return
        if not self._closing:
            self._closing = True
            self._close_deadline = self._clock() + timeout_s
        self._wake.set()
        # A request in flight must not outlive the close deadline.
        self._limit_send_to(self._close_deadline)
        if self._running:
            try:
                async with asyncio.timeout(max(0.0, self._close_deadline - self._clock())):
                    await self._finished.wait()
            except TimeoutError:
                self._log().error("influx_close_timeout", timeout_s=timeout_s)
            return
        await self._final_flush()

    async def _open(self) -> None:
        if self._started:
            return
        if self._token is None:
            self._token = resolve_token(self._settings)
        if self._spool is not None:
            report = await _in_thread(self._spool.open)
            if report.debris:
                # Once per start: what is not a segment is reported, never fatal.
                self._log().warning(
                    "influx_spool_debris",
                    spool_dir=str(self._spool.directory),
                    tmp_removed=report.tmp_removed,
                    unreadable=list(report.unreadable),
                    unreadable_points=report.unreadable_points,
                    stray=list(report.stray),
                    stray_count=report.stray_count,
                )
            if report.unreadable_points:
                self._log_drop(
                    "spool_unreadable", report.unreadable_points, self._spool.unreadable_points
                )
            if not self._spool.empty:
                self._log().info(
                    "influx_spool_found",
                    spool_points=self._spool.points,
                    spool_bytes=self._spool.size_bytes,
                )
        self._started = True

    def _get_transport(self) -> Transport:
        if self._transport is None:
            factory = V2Transport if self._settings.api == "v2" else V1Transport
            self._transport = factory(self._settings, self._token)
        return self._transport

    async def _close_transport(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            await transport.aclose()

    # -- one iteration of the send loop ---------------------------------------------------

    async def _step(self) -> None:
        """Spill, send or sleep until the next deadline: one decision per call."""
        self._wake.clear()
        now = self._clock()
        if self._spill_due(now):
            await self._spill(self._take(self._settings.batch_size))
            return
        if now >= self._retry_at and self._send_due(now):
            await self._send_next()
            return
        sleep_s = self._sleep_s(now)
        if sleep_s is None:
            await self._wake.wait()
        else:
            await aiokit.wait_first(self._wake, sleep_s)

    def _send_due(self, now: float) -> bool:
        if self._spool is not None and not self._spool.empty:
            return True
        return self._flush_due(now)

    def _flush_due(self, now: float) -> bool:
        if self._buffered >= self._settings.batch_size:
            return True
        return (
            bool(self._buffered)
            and self._oldest_at is not None
            and (now - self._oldest_at >= self._settings.flush_interval_s)
        )

    def _spill_due(self, now: float) -> bool:
        if self._spool is None or not self._buffered or now < self._spool_retry_at:
            return False
        settings = self._settings
        high_water = settings.max_buffer_points - min(
            settings.batch_size, settings.max_buffer_points // 2
        )
        if self._buffered > high_water:
            return True  # the database is slower than the input: spill, don't drop
        return self.in_outage and self._flush_due(now)

    def _sleep_s(self, now: float) -> float | None:
        """Seconds until something becomes due (None: until ``write`` or ``close`` wakes us)."""
        spool = self._spool
        flush_at = (
            self._oldest_at + self._settings.flush_interval_s
            if self._buffered and self._oldest_at is not None
            else None
        )
        wake_at: list[float] = []
        if self.in_outage:
            if self._buffered or (spool is not None and not spool.empty):
                wake_at.append(self._retry_at)  # the next try
            if flush_at is not None and spool is not None:
                wake_at.append(max(flush_at, self._spool_retry_at))  # the next spill
        elif flush_at is not None:
            wake_at.append(max(flush_at, self._retry_at))  # the next time-triggered batch
        if spool is not None and self._buffered and now < self._spool_retry_at:
            wake_at.append(self._spool_retry_at)  # the spool failed: try it again then
        return max(0.0, min(wake_at) - now) if wake_at else None

    def _take(self, count: int) -> _Lines:
        """Pop up to ``count`` lines from memory: essential ones first, each class oldest first."""
        essential, bulk = self._essential, self._bulk
        from_essential = min(count, len(essential))
        from_bulk = min(count - from_essential, len(bulk))
        taken = _Lines(
            [essential.popleft() for _ in range(from_essential)],
            [bulk.popleft() for _ in range(from_bulk)],
        )
        self._oldest_at = self._clock() if self._buffered else None
        return taken

    def _put_back(self, lines: _Lines) -> None:
        """Return lines to the head of memory (they are older than what is there)."""
        if not lines:
            return
        self._essential.extendleft(reversed(lines.essential))
        self._bulk.extendleft(reversed(lines.bulk))
        if self._oldest_at is None:
            self._oldest_at = self._clock()
        self._enforce_memory_bound()

    def _enforce_memory_bound(self) -> None:
        """Drop the oldest lines beyond ``max_buffer_points``: bulk ones while there are any."""
        excess = self._buffered - self._settings.max_buffer_points
        if excess <= 0:
            return
        bulk = min(excess, len(self._bulk))
        for _ in range(bulk):
            self._bulk.popleft()
        for _ in range(excess - bulk):
            self._essential.popleft()  # essential lines alone exceed the bound
        self._drop("memory_full_bulk", bulk)
        self._drop("memory_full", excess - bulk)

    async def _send_next(self) -> None:
        """Send one batch: spool segments first, else memory lines; essential ones first,
        each class oldest first."""
        spool = self._spool
        if spool is not None and not spool.empty:
            unreadable_before = spool.unreadable_points
            corrupt_before = spool.corrupt_points
            batch = await _in_thread(spool.read_oldest, self._settings.batch_size)
            if spool.unreadable_points > unreadable_before:
                lost = spool.unreadable_points - unreadable_before
                self._log_drop("spool_unreadable", lost, spool.unreadable_points)
            if spool.corrupt_points > corrupt_before:
                lost = spool.corrupt_points - corrupt_before
                self._log_drop("spool_corrupt", lost, spool.corrupt_points)
            if not batch.segments:
                return
            outcome = await self._attempt(batch.body, batch.points)
            if outcome != "retry":
                await _in_thread(spool.remove, batch.segments)
            return
        lines = self._take(self._settings.batch_size)
        try:
            outcome = await self._attempt(lines.body(), len(lines))
        except BaseException:
            self._put_back(lines)  # cancelled mid-request: nothing is lost
            raise
        if outcome == "retry":
            if self._spool is not None and self._spool_retry_at <= self._clock():
                await self._spill(lines)
            else:
                self._put_back(lines)

    async def _attempt(self, body: bytes, count: int) -> str:
        """One request; ``sent``, ``rejected`` or ``retry``, with the bookkeeping done."""
        if not body:
            return "sent"
        try:
            async with asyncio.timeout(self._settings.timeout_s + 1.0) as timeout:
                self._send_timeout = timeout
                if self._closing:
                    self._limit_send_to(self._close_deadline)
                await self._get_transport().send(body)
        except TimeoutError:
            msg = f"no answer within {self._settings.timeout_s} s (or the close deadline)"
            self._on_unavailable(InfluxUnavailableError(msg))
            return "retry"
        except InfluxUnavailableError as exc:
            self._on_unavailable(exc)
            return "retry"
        except BatchRejectedError as exc:
            self._on_rejected(exc, count)
            self._on_answer(count)
            return "rejected"
        finally:
            self._send_timeout = None
        self._written += count
        self._on_answer(count)
        return "sent"

    def _limit_send_to(self, deadline: float) -> None:
        timeout = self._send_timeout
        if timeout is None:
            return
        remaining = deadline - self._clock()
        reserve = max(0.0, remaining * _CLOSE_RESERVE_FRACTION)
        when = asyncio.get_running_loop().time() + max(0.0, remaining - reserve)
        current = timeout.when()
        if current is None or when < current:
            timeout.reschedule(when)

    def _on_unavailable(self, exc: InfluxUnavailableError) -> None:
        now = self._clock()
        self._write_errors += 1
        self._last_error = str(exc)
        if self._outage_since is None:
            self._outage_since = now
            self._log().warning("influx_unreachable", error=str(exc), status=exc.status)
        if self._delays is None:
            self._delays = aiokit.backoff_delays(
                self._settings.retry_min_s, self._settings.retry_max_s
            )
        # The server's Retry-After wins over our schedule, but never beyond retry_max_s.
        delay_s = min(max(next(self._delays), exc.delay_s), self._settings.retry_max_s)
        self._retry_at = now + delay_s

    def _on_rejected(self, exc: BatchRejectedError, count: int) -> None:
        self._write_errors += 1
        self._last_error = str(exc)
        # A partial write (InfluxDB 1.x) kept the other points of the batch. A refusal that
        # names no point (or none of a count) still lost one at least.
        named = count if exc.dropped_points is None else exc.dropped_points
        rejected = min(count, max(1, named))
        self._written += count - rejected
        self._rejected += rejected
        self._drop("rejected", rejected, log=False)
        if exc.kind not in self._rejected_kinds:
            self._rejected_kinds.add(exc.kind)
            self._log().error(
                "influx_batch_rejected",
                status=exc.status,
                error=str(exc),
                points=rejected,
                kind=exc.kind,
            )

    def _on_answer(self, count: int) -> None:
        """The database answered: end an outage, and log recovery once the backlog is gone."""
        now = self._clock()
        if self._outage_since is not None:
            self._recovered_outage_s += now - self._outage_since
            self._recovered_at = self._recovered_at or now
            self._outage_since = None
            self._delays = None
            self._retry_at = 0.0
            self._replayed = 0
        if self._recovered_at is None:
            return
        self._replayed += count
        backlog_gone = (self._spool is None or self._spool.empty) and (
            self._buffered < self._settings.batch_size
        )
        if backlog_gone:
            self._log().info(
                "influx_recovered",
                outage_s=round(self._recovered_outage_s, 3),
                points_replayed=self._replayed,
                replay_s=round(now - self._recovered_at, 3),
            )
            self._recovered_at = None
            self._recovered_outage_s = 0.0
            self._replayed = 0

    async def _spill(self, lines: _Lines) -> None:
        """Move lines to new spool segments, one per class; on a disk error keep them in
        memory a while."""
        spool = self._spool
        if not lines or spool is None:
            self._put_back(lines)
            return
        for bulk in (False, True):
            part = lines.bulk if bulk else lines.essential
            if not part:
                continue
            evicted_before = spool.evicted_points
            bulk_evicted_before = spool.evicted_bulk_points
            try:
                await _in_thread(functools.partial(spool.append, part, bulk=bulk))
            except OSError as exc:
                self._spool_retry_at = self._clock() + _SPOOL_RETRY_S
                self._log().error(
                    "influx_spool_failed", error=str(exc), spool_dir=str(spool.directory)
                )
                # What is not on disk yet goes back: this class and, after it, the bulk one.
                self._put_back(_Lines([] if bulk else lines.essential, lines.bulk))
                return
            evicted = spool.evicted_points - evicted_before
            if evicted:
                self._log_drop("spool_full", evicted, spool.evicted_points)
            bulk_evicted = spool.evicted_bulk_points - bulk_evicted_before
            if bulk_evicted:
                self._log_drop("spool_full_bulk", bulk_evicted, spool.evicted_bulk_points)

    def _drop(self, reason: str, count: int, *, log: bool = True) -> None:
        if count <= 0:
            return
        self._dropped[reason] = self._dropped.get(reason, 0) + count
        if log:
            self._log_drop(reason, count, self._dropped[reason])

    def _log_drop(self, reason: str, count: int, total: int) -> None:
        """``influx_points_dropped``, at most once a minute per reason (with the total)."""
        now = self._clock()
        last = self._drop_logged_at.get(reason)
        if last is None or now - last >= _DROP_LOG_INTERVAL_S:
            self._drop_logged_at[reason] = now
            self._log().warning("influx_points_dropped", reason=reason, points=count, total=total)

    async def _final_flush(self) -> None:
        """Send memory if the database answers, within the close deadline; spool the rest."""
        try:
            await self._open()
            reserve_s = (self._close_deadline - self._clock()) * _CLOSE_RESERVE_FRACTION
            while self._buffered and not self.in_outage:
                if self._clock() >= self._close_deadline - reserve_s:
                    break
                lines = self._take(self._settings.batch_size)
                outcome = await self._attempt(lines.body(), len(lines))
                if outcome == "retry":
                    self._put_back(lines)
            while self._buffered and self._spool is not None:
                before = self._buffered
                await self._spill(self._take(self._settings.batch_size))
                if self._buffered >= before:
                    break  # the spool fails: what is left is dropped below
            if self._buffered:
                count = self._buffered
                self._essential.clear()
                self._bulk.clear()
                self._drop("closed", count)
        finally:
            await self._close_transport()
            if self._spool is not None:
                self._spool.close()
            self._finished.set()
            if self._spool is not None and not self._spool.empty:
                self._log().info(
                    "influx_spool_kept",
                    spool_points=self._spool.points,
                    spool_bytes=self._spool.size_bytes,
                )


def make_sink(influx: InfluxSettings, *, state_dir: Path) -> InfluxSink | None:
    """The InfluxDB sink the settings ask for (spooling under ``state_dir``), or None."""
    if influx.url is None:
        return None
    if influx.spool_dir is None:
        influx = influx.model_copy(update={"spool_dir": state_dir / "spool"})
    return InfluxSink(influx, token=resolve_token(influx))
