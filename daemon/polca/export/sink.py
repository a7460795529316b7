"""Where points go: the ``Sink`` protocol, one fan-out over many sinks, a memory sink.

The aggregator builds its points once (``aggregator/points.py``) and hands them to one
``FanOut``, which gives each to every configured sink: InfluxDB or VictoriaMetrics
(``influx.py``), memory (tests, simulations), and whatever exporter comes next. A sink must
never block or fail its caller: ``write`` only takes the points; ``run`` does the I/O in the
background; ``close`` is bounded. No I/O here.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Protocol

from polca.export.points import AnyPoint

__all__ = ["FanOut", "MemorySink", "Sink", "SinkStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class SinkStats:
    """A snapshot of a sink's counters (totals since start) and gauges (now)."""

    points_written: int = 0
    """Points the database accepted."""
    points_dropped: int = 0
    """Points given up, for any reason (see ``dropped``); includes ``points_rejected``."""
    points_rejected: int = 0
    """Points the database refused as bad data."""
    points_spooled: int = 0
    """Points written to the spool (a point replayed twice counts twice)."""
    spool_points: int = 0
    """Points waiting in the spool now."""
    spool_bytes: int = 0
    """Size of the spool now."""
    points_buffered: int = 0
    """Points waiting in memory now."""
    write_errors: int = 0
    """Write requests that failed (outage or rejection)."""
    last_error: str | None = None
    """The last write error, for operators."""
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    """Dropped points by reason: memory_full_bulk, spool_full_bulk (bulk points beyond a
    bound, see ``schema.BULK_MEASUREMENTS``), memory_full, spool_full (essential points
    beyond a bound: only when they alone exceed it), spool_unreadable (a segment that
    cannot be read, or is no file), spool_corrupt (records a segment lacks: cut, altered or
    foreign), rejected, closed, invalid (a value line protocol cannot carry)."""


class Sink(Protocol):
    """Where the aggregator's points go; the seam between its loops and the database."""

    def write(self, points: Sequence[AnyPoint]) -> None:
        """Queue points for writing; never blocks, never raises."""
        ...

    async def run(self) -> None:
        """Send queued points until closed (returns after ``close``)."""
        ...

    async def close(self, timeout_s: float) -> None:
        """Final flush, bounded by ``timeout_s``; later writes are dropped and counted."""
        ...

    @property
    def stats(self) -> SinkStats:
        """Counters and gauges of this sink."""
        ...


class MemorySink:
    """A sink that keeps points in a list: for tests and simulations without a database."""

    def __init__(self, *, max_points: int | None = None) -> None:
        self.points: list[AnyPoint] = []
        """Every point written and not dropped, in order."""
        self._max_points = max_points
        self._dropped: dict[str, int] = {}
        self._written = 0
        self._closed = asyncio.Event()

    def write(self, points: Sequence[AnyPoint]) -> None:
        """Record the points (dropped and counted once the sink is closed)."""
        if self._closed.is_set():
            self._dropped["closed"] = self._dropped.get("closed", 0) + len(points)
            return
        self.points.extend(points)
        self._written += len(points)
        if self._max_points is not None and len(self.points) > self._max_points:
            excess = len(self.points) - self._max_points
            del self.points[:excess]
            self._dropped["memory_full"] = self._dropped.get("memory_full", 0) + excess

    def measurement(self, name: str) -> list[AnyPoint]:
        """The recorded points of one measurement."""
        return [p for p in self.points if p.measurement == name]

    async def run(self) -> None:
        """Wait until closed."""
        await self._closed.wait()

    async def close(self, timeout_s: float) -> None:
        """Stop recording."""
        self._closed.set()

    @property
    def stats(self) -> SinkStats:
        """Points recorded and dropped."""
        return SinkStats(
            points_written=self._written,
            points_dropped=sum(self._dropped.values()),
            points_buffered=len(self.points),
            dropped=dict(self._dropped),
        )


class FanOut:
    """Every point to every sink; one sink's trouble is its own (each spools or drops)."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        """Fan out to ``sinks`` (none: points are dropped, uncounted)."""
        self.sinks = tuple(sinks)

    def __bool__(self) -> bool:
        """Whether there is any sink at all (builders can skip work when not)."""
        return bool(self.sinks)

    def write(self, points: Sequence[AnyPoint]) -> None:
        """Give ``points`` to every sink."""
        for sink in self.sinks:
            sink.write(points)

    async def run(self) -> None:
        """Run every sink until each is closed."""
        async with asyncio.TaskGroup() as tg:
            for sink in self.sinks:
                tg.create_task(sink.run(), name=f"sink:{type(sink).__name__}")

    async def close(self, timeout_s: float) -> None:
        """Close every sink, at most ``timeout_s`` in all."""
        async with asyncio.TaskGroup() as tg:
            for sink in self.sinks:
                tg.create_task(sink.close(timeout_s=timeout_s))

    @property
    def stats(self) -> SinkStats:
        """The counters of every sink, added up."""
        total = SinkStats()
        for sink in self.sinks:
            s = sink.stats
            dropped = dict(total.dropped)
            for reason, count in s.dropped.items():
                dropped[reason] = dropped.get(reason, 0) + count
            total = SinkStats(
                points_written=total.points_written + s.points_written,
                points_dropped=total.points_dropped + s.points_dropped,
                points_rejected=total.points_rejected + s.points_rejected,
                points_spooled=total.points_spooled + s.points_spooled,
                spool_points=total.spool_points + s.spool_points,
                spool_bytes=total.spool_bytes + s.spool_bytes,
                points_buffered=total.points_buffered + s.points_buffered,
                write_errors=total.write_errors + s.write_errors,
                last_error=s.last_error or total.last_error,
                dropped=dropped,
            )
        return total
