"""A row's power from its sources' readings, and what changed about each source (pure).

A row may have several power sources (A and B feeds, one PDU per rack, a switchboard
meter): the row's power is their sum. ``row_meter`` turns one round of readings into the
row's ``Meter`` message: whole when every source gave a power, ``partial`` when one failed
(``missing`` says which and why; the aggregator never takes a partial reading as the
row's power and falls back to its computed power). ``SourceLog`` remembers each source's
last outcome so the service logs an outage once when it starts (and once more for each
other reason it fails for during it), once when it ends, and a change of the value a
source falls back on once, never once per poll.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from polca.meter.source import SourceReading
from polca.outages import OutageBook
from polca.telemetry.schema import Meter, SourceState

__all__ = ["Change", "SourceFailure", "SourceLog", "SourceResult", "row_meter"]

_REASON_CHARS = 64  # the wire schema's bound on a missing source's reason


@dataclass(frozen=True, slots=True)
class SourceFailure:
    """A source that gave no power this round."""

    reason: str
    """The drop counter's name: ``unreachable``, ``timeout``, ``auth``, ``config`` or a
    ``ReadingRejectedError`` reason (``unsupported``, ``nan``, ``absurd`` ...)."""
    error: str
    """What went wrong, for the log."""


SourceResult = SourceReading | SourceFailure


def row_meter(results: Sequence[tuple[str, SourceResult]], *, now_ns: int) -> Meter:
    """The row's meter message from one round of its sources' results (at least one)."""
    readings = [r for _, r in results if isinstance(r, SourceReading)]
    missing = {
        name: r.reason[:_REASON_CHARS] for name, r in results if isinstance(r, SourceFailure)
    }
    energies = [r.energy_j for r in readings]
    energy_j = (
        sum(e for e in energies if e is not None)
        if readings and not missing and all(e is not None for e in energies)
        else None
    )
    states = {
        name: SourceState(
            equipment=r.equipment,
            on_battery=r.on_battery,
            battery_minutes=r.battery_minutes,
            load_pct=r.load_pct,
            input_voltage_v=r.input_voltage_v,
        )
        for name, r in results
        if isinstance(r, SourceReading)
    }
    return Meter(
        ts_ns=now_ns,
        states=states,
        power_w=sum(r.power_w for r in readings),
        energy_j=energy_j,
        sources=len(readings),
        partial=bool(missing),
        missing=missing,
    )


@dataclass(frozen=True, slots=True)
class Change:
    """Something about a source worth one log line."""

    event: str
    """``meter_source_failed`` (warning), ``meter_source_recovered`` (info) or
    ``meter_source_fallback`` (info: the value it reports changed)."""
    fields: dict[str, object]


@dataclass(slots=True)
class _State:
    book: OutageBook = field(default_factory=OutageBook)
    detail: str | None = None


class SourceLog:
    """Each source's last outcome; ``note`` says what is worth logging about a new one."""

    def __init__(self) -> None:
        """No source known yet."""
        self._states: dict[str, _State] = {}  # keyed by configured names only
        self.reads: dict[str, int] = {}
        """Successful reads by source."""
        self.failures: dict[tuple[str, str], int] = {}
        """Failed reads by (source, reason)."""

    def note(self, name: str, result: SourceResult, now_s: float) -> list[Change]:
        """Record ``result`` of source ``name`` at ``now_s``; the changes to log."""
        state = self._states.setdefault(name, _State())
        changes: list[Change] = []
        if isinstance(result, SourceFailure):
            key = (name, result.reason)
            self.failures[key] = self.failures.get(key, 0) + 1
            if state.book.failed(result.reason, now_s) is not None:
                changes.append(
                    Change(
                        "meter_source_failed",
                        {"source": name, "reason": result.reason, "error": result.error},
                    )
                )
            return changes
        self.reads[name] = self.reads.get(name, 0) + 1
        ended = state.book.ok(now_s)
        if ended is not None:
            changes.append(
                Change(
                    "meter_source_recovered",
                    {"source": name, "outage_s": ended.outage_s, "failed_reads": ended.failures},
                )
            )
        if result.detail != state.detail:
            if result.fallbacks or state.detail is not None:
                changes.append(
                    Change(
                        "meter_source_fallback",
                        {
                            "source": name,
                            "value": result.detail,
                            "skipped": list(result.fallbacks),
                        },
                    )
                )
            state.detail = result.detail
        return changes

    def failing(self) -> list[str]:
        """The sources whose last read failed."""
        return sorted(n for n, s in self._states.items() if s.book.out)
