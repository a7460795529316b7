"""What the decoder cannot judge alone: identity, wall-clock stamps, and counted drops.

``decode()`` proves a payload is well formed. Before a listener trusts it, two more things
must hold, and both need context the payload does not carry:

- **Identity**: a payload that names a node, rack, row or CDU must name the one its topic
  does (``check_identity``); otherwise node1's credentials could speak for node2.
- **Wall clocks** belong to other machines. They are used for ordering and display only,
  within an explicit tolerance (``ClockWindow``): a stamp further in the future than the
  tolerance is refused or not trusted, and durations never come from them (leases and
  staleness run on the receiver's monotonic clock from the moment of receipt).

``TokenBucket`` admits a source's messages at a configured rate and burst, before they
are decoded, so one source cannot crowd out the others; ``RateGate`` lets one log line per
key through per interval (keys from configuration, never from the network).

``DropLog`` counts every dropped message by reason and logs it without letting a hostile
publisher flood the log or grow memory: the first drop of each reason is logged at once,
later ones at most once per ``every_s`` per reason, with the count since. Its memory is
one entry per reason, and reasons come from polca's code (``SchemaError.reason``), never
from the network. Every listener of polca (agent, aggregator, the simulated CDU) uses it.
Pure logic, no I/O besides the log line.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from polca.errors import ClockSkewError, IdentityError, StaleMessageError

_S = 1_000_000_000

__all__ = ["ClockWindow", "DropLog", "RateGate", "TokenBucket", "check_identity"]


def check_identity(what: str, *, payload: str | None, topic: str | None) -> None:
    """Raise ``IdentityError`` unless the payload's ``what`` is the topic's."""
    if payload != topic:
        msg = f"payload {what} {payload!r} is not the topic's {topic!r}"
        raise IdentityError(msg)


@dataclass(frozen=True, slots=True)
class ClockWindow:
    """How far another machine's wall-clock stamp may sit from the receiver's clock."""

    tolerance_ns: int

    @classmethod
    def of_seconds(cls, tolerance_s: float) -> ClockWindow:
        """A window of ``tolerance_s`` seconds either side."""
        return cls(int(tolerance_s * _S))

    def skewed(self, stamp_ns: int, now_ns: int) -> bool:
        """Whether ``stamp_ns`` is more than the tolerance away from ``now_ns``."""
        return abs(stamp_ns - now_ns) > self.tolerance_ns

    def trusted_stamp(self, stamp_ns: int, now_ns: int) -> int:
        """``stamp_ns`` when within the tolerance of ``now_ns``, else ``now_ns``."""
        return now_ns if self.skewed(stamp_ns, now_ns) else stamp_ns

    def check_not_future(self, what: str, stamp_ns: int, now_ns: int) -> None:
        """Raise ``ClockSkewError`` when ``stamp_ns`` lies beyond the tolerance ahead."""
        ahead_ns = stamp_ns - now_ns
        if ahead_ns > self.tolerance_ns:
            msg = (
                f"{what} is {ahead_ns / _S:.1f} s ahead of this clock "
                f"(tolerance {self.tolerance_ns / _S:g} s)"
            )
            raise ClockSkewError(msg)

    def check_age(self, what: str, stamp_ns: int, now_ns: int, *, max_age_ns: int) -> None:
        """Raise unless ``stamp_ns`` is at most ``max_age_ns`` old (plus the tolerance).

        ``ClockSkewError`` for a stamp ahead beyond the tolerance, ``StaleMessageError``
        for one older than the bound.
        """
        self.check_not_future(what, stamp_ns, now_ns)
        age_ns = now_ns - stamp_ns
        if age_ns > max_age_ns + self.tolerance_ns:
            msg = f"{what} is {age_ns / _S:.1f} s old (at most {max_age_ns / _S:g} s)"
            raise StaleMessageError(msg)


_SHOWN_CHARS = 256
"""Of a topic, detail or error message in a log line."""
_MAX_REASONS = 32
"""Distinct drop reasons kept; more are counted as ``other``."""


class DropLog:
    """Dropped messages counted by reason, and logged at most once per ``every_s`` a reason.

    Memory is bounded: at most ``_MAX_REASONS`` reasons (more count as ``other``; reasons
    come from polca's code, not the network), and log fields cut to 256 characters. Each
    line says how many were dropped for that reason since the last line (``dropped``) and
    in all (``total``).
    """

    def __init__(
        self,
        event: str = "message_dropped",
        *,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
    ) -> None:
        """Log drops as ``event`` (a snake_case event name) through ``logger``."""
        self.event = event
        self.every_s = every_s
        self._clock = clock
        self._log: Any = logger if logger is not None else structlog.get_logger()
        self._counts: Counter[str] = Counter()
        self._pending: Counter[str] = Counter()  # drops not yet logged, by reason
        self._logged_at: dict[str, float] = {}

    @property
    def counts(self) -> Counter[str]:
        """Drops by reason, since creation (a copy)."""
        return Counter(self._counts)

    @property
    def total(self) -> int:
        """Drops of every reason."""
        return sum(self._counts.values())

    def drop(self, reason: str, *, exc: BaseException | None = None, **context: str) -> None:
        """Count one drop; log it unless ``reason`` was logged less than ``every_s`` ago.

        With ``exc``, the line is an error carrying the traceback (an unexpected failure);
        otherwise a warning.
        """
        if reason not in self._counts and len(self._counts) >= _MAX_REASONS:
            reason = "other"
        self._counts[reason] += 1
        self._pending[reason] += 1
        now = self._clock()
        last = self._logged_at.get(reason)
        if last is not None and now - last < self.every_s:
            return
        self._logged_at[reason] = now
        fields = {key: value[:_SHOWN_CHARS] for key, value in context.items()}
        dropped = self._pending.pop(reason)
        total = self._counts[reason]
        if exc is not None:
            self._log.error(
                self.event, reason=reason, dropped=dropped, total=total, exc_info=exc, **fields
            )
        else:
            self._log.warning(self.event, reason=reason, dropped=dropped, total=total, **fields)


@dataclass(slots=True)
class TokenBucket:
    """Admission at ``rate_per_s`` with bursts of up to ``burst`` (time passed in, seconds).

    Starts full. ``take(cost, now_s)`` spends ``cost`` tokens when there are that many and
    says whether it did: a refused message costs nothing, so a source that keeps sending
    above the rate still gets the rate through. Monotonic time only; a clock that goes
    backwards refills nothing.
    """

    rate_per_s: float
    burst: float
    tokens: float = field(init=False)
    updated_s: float | None = None

    def __post_init__(self) -> None:
        """Start full."""
        self.tokens = self.burst

    def take(self, cost: float, now_s: float) -> bool:
        """Spend ``cost`` tokens now if there are that many; whether it was admitted."""
        if self.updated_s is not None and now_s > self.updated_s:
            self.tokens = min(self.burst, self.tokens + (now_s - self.updated_s) * self.rate_per_s)
        if self.updated_s is None or now_s > self.updated_s:
            self.updated_s = now_s
        if cost > self.tokens:
            return False
        self.tokens -= cost
        return True


class RateGate:
    """At most one pass per key per ``every_s``, with the count of what was held back.

    For warnings a remote source can trigger at message rate (a node going offline again
    and again): ``admit(key, now_s)`` returns None while the key passed less than
    ``every_s`` ago, else how many occurrences there were since it last passed (this one
    included). Memory: one entry per key, and keys come from configuration (node names of
    the topology), never from the network.
    """

    def __init__(self, every_s: float) -> None:
        """A gate letting one occurrence per key through per ``every_s``."""
        self.every_s = every_s
        self._passed_at: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def hold(self, key: str) -> None:
        """Count one occurrence that may not pass at all (it is in the next pass's count)."""
        self._held[key] += 1

    def admit(self, key: str, now_s: float) -> int | None:
        """None: hold this one back (counted); else the occurrences since the last pass."""
        self._held[key] += 1
        last = self._passed_at.get(key)
        if last is not None and now_s - last < self.every_s:
            return None
        self._passed_at[key] = now_s
        return self._held.pop(key)
