"""The one outage book: how a source that reads a device or an API is doing (pure).

Every source polca polls (a row's meter sources, a CDU poller, the Kubernetes assignment
source's two reads) keeps the same record of its outages: when the last good read was,
since when it has failed (the first failure of the outage), the reasons seen in it and
how many reads failed, and when it recovered. It also says which moments are worth a log
line: an outage starting, a new reason within one, and its end (with its length and the
failed reads); the repeats between are not. Time is passed in (each user's monotonic
seconds); nothing here logs, sleeps or reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Failed", "OutageBook", "Recovered"]

_MAX_REASONS = 16
"""Reasons kept per outage: reasons are polca's own short words, but a bound all the same."""


@dataclass(frozen=True, slots=True)
class Failed:
    """A failed read worth a log line: the outage ``started``, or a ``reason`` new to it."""

    reason: str
    started: bool


@dataclass(frozen=True, slots=True)
class Recovered:
    """An outage ended: it lasted ``outage_s`` over ``failures`` failed reads."""

    outage_s: float
    failures: int


@dataclass(slots=True)
class OutageBook:
    """One source's record: its last good read and the outage in progress, if any."""

    ok_s: float | None = None
    """When the last good read was (None: never)."""
    since_s: float | None = None
    """When the outage in progress started (None: none)."""
    failures: int = 0
    """Failed reads in the outage in progress."""
    reasons: set[str] = field(default_factory=set)
    """The reasons seen in the outage in progress."""

    @property
    def out(self) -> bool:
        """Whether an outage is in progress."""
        return self.since_s is not None

    def failed(self, reason: str, now_s: float) -> Failed | None:
        """A failed read at ``now_s`` for ``reason``; what is worth logging of it (None:
        a repeat within the outage)."""
        self.failures += 1
        started = self.since_s is None
        if started:
            self.since_s = now_s
        new = reason not in self.reasons
        if new and len(self.reasons) < _MAX_REASONS:
            self.reasons.add(reason)
        return Failed(reason, started) if started or new else None

    def ok(self, now_s: float) -> Recovered | None:
        """A good read at ``now_s``; the outage it ends, if one was in progress."""
        self.ok_s = now_s
        if self.since_s is None:
            return None
        ended = Recovered(round(now_s - self.since_s, 3), self.failures)
        self.since_s, self.failures, self.reasons = None, 0, set()
        return ended

    def unread_s(self, now_s: float, *, started_s: float) -> float:
        """How long since the last good read (since ``started_s`` when there was none)."""
        return now_s - (self.ok_s if self.ok_s is not None else started_s)
