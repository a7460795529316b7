"""Which broker endpoint the MQTT bus tries next: rotation, hold-down, attempts, failovers.

Why it exists: ``MqttBus.run()`` connects to one of several endpoints (``mqtt.endpoints``,
the nodes of a clustered broker) at a time, and what it does after a lost or refused
connection is a decision: which endpoint comes next, whether the one-shot command's
attempts are spent, whether the new connection is a failover, whether leaving a silent
node is worth it. ``EndpointRotation`` makes those decisions on plain values, with time
passed in, so a test drives them without a broker or an event loop; the bus asks it and
does the I/O (the client, the backoff sleep, the log lines, the errors).

The rules:

- Endpoints are tried in their configured order. After a failure the next one is the first
  after it (wrapping around) that has not failed within ``hold_down_s``; when every one
  has, the one that failed longest ago (the failed one itself comes last in that order).
- A successful connection clears its endpoint's failure, and counts a failover when it
  goes to another endpoint than the connection before.
- ``attempts`` (one-shot commands; None for the daemons: forever) counts rounds: a failure
  of a connection attempt that never got a CONNACK, whose next endpoint wraps around to
  one at or before it, ends a round; the attempts are spent when ``attempts`` rounds ended.
  A connection lost after its CONNACK counts nothing.
- ``move_on`` (a process that finds its node connected but silent) is warranted only while
  connected and only with another endpoint to go to.

What it must not do: read a clock, sleep, log, raise for a failed connection, or know the
MQTT client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final, Generic, TypeVar

__all__ = ["HOLD_DOWN_S", "EndpointRotation", "Failure"]

HOLD_DOWN_S: Final = 30.0
"""An endpoint that failed is passed over for this long while another one has not failed."""

EndpointT = TypeVar("EndpointT")


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """What a failed connection leads to."""

    next_index: int
    """The endpoint to try next (the rotation's ``current`` from now on)."""
    spent: bool
    """The attempts are used up: give up instead of trying ``next_index``."""


class EndpointRotation(Generic[EndpointT]):
    """The order, hold-down and attempt counting of a bus's broker endpoints.

    Built from the endpoints in order of preference (any values: the bus's are
    ``MqttEndpoint``); starts at the first. Keeps when each endpoint last failed (monotonic
    seconds, as passed in), the endpoint last connected to and the failovers since it was
    made; the attempts left count from ``begin()``.
    """

    def __init__(
        self,
        endpoints: Sequence[EndpointT],
        *,
        hold_down_s: float = HOLD_DOWN_S,
        attempts: int | None = None,
    ) -> None:
        """``attempts``: rounds over the endpoints before ``failed`` says they are spent;
        None: never."""
        if not endpoints:
            msg = "a bus needs at least one broker endpoint"
            raise ValueError(msg)
        self.endpoints: tuple[EndpointT, ...] = tuple(endpoints)
        self.hold_down_s = hold_down_s
        self.attempts = attempts
        self._current = 0
        self._rounds_left = attempts
        self._failed_at_s: dict[int, float] = {}  # endpoint index -> when it last failed
        self._last_connected: int | None = None
        self._failovers = 0
        self._move_reason = ""

    @property
    def count(self) -> int:
        """How many endpoints there are."""
        return len(self.endpoints)

    @property
    def current(self) -> int:
        """The index of the endpoint to try now."""
        return self._current

    @property
    def failovers(self) -> int:
        """Connections made to another endpoint than the one before."""
        return self._failovers

    @property
    def move_reason(self) -> str:
        """Why the last warranted ``move_on`` asked to leave ("" before any)."""
        return self._move_reason

    def begin(self) -> None:
        """A new connect loop: the attempts count from the start again (the endpoint to
        try, the failures and the failovers carry on)."""
        self._rounds_left = self.attempts

    def held_down(self, index: int, now_s: float) -> bool:
        """Whether endpoint ``index`` failed within the hold-down before ``now_s``."""
        failed_at = self._failed_at_s.get(index)
        return failed_at is not None and now_s - failed_at < self.hold_down_s

    def next_after(self, failed: int, now_s: float) -> int:
        """The endpoint after ``failed`` (in order, wrapping) that is not held down at
        ``now_s``, else the one that failed longest ago."""
        order = [(failed + step) % self.count for step in range(1, self.count + 1)]
        for index in order:
            if not self.held_down(index, now_s):
                return index
        return min(order, key=lambda i: self._failed_at_s.get(i, 0.0))

    def failed(self, index: int, now_s: float, *, connected: bool) -> Failure:
        """Endpoint ``index`` failed at ``now_s``: after a CONNACK (``connected``) or
        before one. Marks it, moves on to the next endpoint, and counts the round."""
        self._check(index)
        self._failed_at_s[index] = now_s
        self._current = self.next_after(index, now_s)
        spent = False
        if not connected and self._rounds_left is not None and self._current <= index:
            self._rounds_left -= 1  # every endpoint was tried once more
            spent = self._rounds_left <= 0
        return Failure(next_index=self._current, spent=spent)

    def connected(self, index: int) -> bool:
        """A connection to endpoint ``index`` was made (CONNACK): clears its failure;
        whether it is a failover (another endpoint than the connection before)."""
        self._check(index)
        failover = self._last_connected not in (None, index)
        self._failovers += int(failover)
        self._last_connected = index
        self._failed_at_s.pop(index, None)
        return failover

    def move_on(self, reason: str, *, connected: bool) -> bool:
        """Whether leaving the connected endpoint for the next one is warranted: only while
        ``connected`` and with another endpoint to go to. Keeps ``reason`` when it is."""
        if self.count > 1 and connected:
            self._move_reason = reason
            return True
        return False

    def _check(self, index: int) -> None:
        if not 0 <= index < self.count:
            msg = f"no broker endpoint {index}: there are {self.count}"
            raise ValueError(msg)
