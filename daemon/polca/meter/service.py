"""``polca meter``'s loop: read every source of every row, publish each row's meter reading.

``meter_once`` is one round: every source of every row is read concurrently (each bounded
by ``read_timeout_s``), each row's results become its ``Meter`` message (``meter/row.py``:
whole, or ``partial`` when a source failed), published at QoS 0, not retained, on the
row's meter topic as soon as that row's sources have answered, and what changed about a
source is logged once (``SourceLog``). ``run_meter`` repeats it every ``interval_s`` on
``loop.time()`` (a late round is skipped, not bunched).

A source's failure is its row's problem, never the service's: a source that raises
anything but cancellation is counted by reason and its row published as partial; an
unexpected exception (a bug in a reader) is logged with its traceback at most once a
minute (``meter_read_failed``, reason ``internal``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import structlog

from polca import aiokit
from polca.errors import ConfigError, ReadingRejectedError, TransportAuthError, TransportError
from polca.meter.row import SourceFailure, SourceLog, SourceResult, row_meter
from polca.meter.source import MeterSource
from polca.telemetry.checks import DropLog
from polca.telemetry.messages import OutMessage
from polca.telemetry.schema import Meter, encode

if TYPE_CHECKING:
    from polca.service import Publisher

__all__ = ["MeterRow", "RoundTimes", "meter_once", "read_source", "run_meter"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class MeterRow:
    """One row: where its reading goes and the sources summed into it."""

    row: str
    topic: str
    sources: tuple[MeterSource, ...]


async def read_source(
    source: MeterSource, *, timeout_s: float, internal: DropLog | None = None
) -> SourceResult:
    """One read of ``source``, bounded by ``timeout_s``: its reading or why it failed."""
    try:
        async with asyncio.timeout(timeout_s):
            return await source.read()
    except TimeoutError:
        return SourceFailure("timeout", f"no answer within {timeout_s:g} s")
    except TransportAuthError as exc:
        return SourceFailure("auth", str(exc))
    except TransportError as exc:
        return SourceFailure("unreachable", str(exc))
    except ReadingRejectedError as exc:
        return SourceFailure(exc.reason, str(exc))
    except ConfigError as exc:
        return SourceFailure("config", str(exc))
    except Exception as exc:  # a reader's bug costs one reading, never the service
        drops = internal if internal is not None else DropLog("meter_read_failed")
        drops.drop("internal", exc=exc, source=source.name)
        return SourceFailure("internal", f"{type(exc).__name__}: {exc}")


async def meter_once(
    bus: Publisher,
    rows: Sequence[MeterRow],
    *,
    sources_log: SourceLog,
    read_timeout_s: float,
    now_s: Callable[[], float] = time.monotonic,
    now_ns: Callable[[], int] = time.time_ns,
    internal: DropLog | None = None,
) -> list[tuple[MeterRow, Meter]]:
    """Read every source once, publish each row's reading; the rows and their readings.

    Each row is published as soon as its own sources have answered (or timed out), not
    when the slowest source of the site has: a feed's trip reaches the aggregator after its
    row's reads, whatever the other rows' devices take.
    """

    async def one_row(row: MeterRow) -> tuple[MeterRow, Meter]:
        results = await asyncio.gather(
            *(read_source(s, timeout_s=read_timeout_s, internal=internal) for s in row.sources)
        )
        done_s, stamp_ns = now_s(), now_ns()
        named = [(source.name, result) for source, result in zip(row.sources, results, strict=True)]
        for name, result in named:
            for change in sources_log.note(f"{row.row}/{name}", result, done_s):
                emit = log.warning if change.event == "meter_source_failed" else log.info
                emit(change.event, row=row.row, **change.fields)
        meter = row_meter(named, now_ns=stamp_ns)
        bus.publish_nowait(OutMessage(row.topic, encode(meter), qos=0))
        return row, meter

    return list(await asyncio.gather(*(one_row(row) for row in rows)))


class RoundTimes:
    """How long rounds take, summarised once per ``every_s`` (the ``meter_rounds`` line)."""

    def __init__(self, *, every_s: float = 60.0) -> None:
        """Summarise every ``every_s`` seconds of rounds."""
        self.every_s = every_s
        self._times_s: list[float] = []
        self._since_s: float | None = None

    def add(self, took_s: float, *, now_s: float) -> dict[str, float] | None:
        """Record one round; a summary (count, p50, p99, max in ms) once per period."""
        if self._since_s is None:
            self._since_s = now_s
        self._times_s.append(took_s)
        if now_s - self._since_s < self.every_s:
            return None
        times = sorted(self._times_s)
        self._times_s, self._since_s = [], now_s
        return {
            "rounds": len(times),
            "p50_ms": round(1000 * times[len(times) // 2], 2),
            "p99_ms": round(1000 * times[min(len(times) - 1, int(0.99 * len(times)))], 2),
            "max_ms": round(1000 * times[-1], 2),
        }


async def run_meter(
    bus: Publisher,
    rows: Sequence[MeterRow],
    *,
    interval_s: float,
    read_timeout_s: float,
    sources_log: SourceLog | None = None,
    stats_every_s: float = 60.0,
) -> NoReturn:
    """Publish every row's reading every ``interval_s``, forever (cancel to stop).

    Once per ``stats_every_s`` it logs how long its rounds took (``meter_rounds``: count,
    p50, p99 and max in ms) and which sources are failing.
    """
    log.info(
        "meter_started",
        rows=[row.row for row in rows],
        sources=sum(len(row.sources) for row in rows),
        interval_s=interval_s,
    )
    book = sources_log if sources_log is not None else SourceLog()
    internal = DropLog("meter_read_failed", every_s=60.0)
    rounds = RoundTimes(every_s=stats_every_s)

    async def one_round() -> None:
        started_s = time.monotonic()
        await meter_once(
            bus, rows, sources_log=book, read_timeout_s=read_timeout_s, internal=internal
        )
        summary = rounds.add(time.monotonic() - started_s, now_s=time.monotonic())
        if summary is not None:
            log.info("meter_rounds", **summary, failing=book.failing()[:32])

    try:
        await aiokit.every(interval_s, one_round)
    finally:
        for row in rows:
            for source in row.sources:
                await source.close()
