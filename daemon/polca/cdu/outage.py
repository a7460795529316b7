"""One CDU poller's outages: when to try again, and the two log lines an outage is worth.

Both pollers (``modbus.py``, ``redfish.py``) fail the same way: a poll that
cannot reach the device schedules the next connection attempt on a jittered, exponential
backoff (``aiokit.backoff_delays``), polls before it fail at once without touching the
network, the outage is logged once when it starts (``{prefix}_unreachable``, warning) and
once when it ends (``{prefix}_recovered``, info, with its length and the failed polls);
the failed polls between are debug lines (``{prefix}_poll_failed``). ``Outage`` is that,
once: the backoff and the lines over ``outages.OutageBook``, the record every source
keeps. Time is passed in (the event loop's clock).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from polca import aiokit
from polca.outages import OutageBook

__all__ = ["Outage"]


class Outage:
    """Backoff between connection attempts and the outage's log lines."""

    def __init__(
        self,
        *,
        prefix: str,
        log: Any,
        min_s: float,
        max_s: float,
        rng: random.Random | None = None,
    ) -> None:
        """Log through ``log`` as ``{prefix}_unreachable`` etc.; back off ``min_s``..``max_s``."""
        self._prefix = prefix
        self._log = log
        self._min_s, self._max_s, self._rng = min_s, max_s, rng
        self._backoff: Iterator[float] = self._new()
        self._retry_at = 0.0
        self.book = OutageBook()
        """The outage record (since, failed polls)."""

    @property
    def since(self) -> float | None:
        """When the current outage started (None: the last poll succeeded)."""
        return self.book.since_s

    @property
    def failed_polls(self) -> int:
        """Failed polls in the current outage."""
        return self.book.failures

    def _new(self) -> Iterator[float]:
        return aiokit.backoff_delays(self._min_s, self._max_s, rng=self._rng)

    def wait_s(self, now: float) -> float:
        """Seconds until the next connection attempt may be made (<= 0: now)."""
        return self._retry_at - now

    def skipped(self) -> None:
        """A poll that failed at once, inside the backoff."""
        self.book.failures += 1

    def failed(self, error: str, now: float, **fields: Any) -> float:
        """A failed poll at ``now``: schedule the next attempt, log; its delay in seconds."""
        delay_s = next(self._backoff)
        self._retry_at = now + delay_s
        line = self.book.failed("unreachable", now)
        if line is not None and line.started:
            self._log.warning(
                f"{self._prefix}_unreachable", error=error, **fields, retry_in_s=round(delay_s, 3)
            )
        else:
            self._log.debug(
                f"{self._prefix}_poll_failed", error=error, retry_in_s=round(delay_s, 3)
            )
        return delay_s

    def recovered(self, now: float) -> None:
        """A successful poll at ``now``: end the outage, if any (logged), reset the backoff."""
        ended = self.book.ok(now)
        if ended is None:
            return
        self._log.info(
            f"{self._prefix}_recovered", outage_s=ended.outage_s, failed_polls=ended.failures
        )
        self._retry_at = 0.0
        self._backoff = self._new()
