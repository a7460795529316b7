"""When an agent leaves a broker endpoint that is connected but carries no control.

``watch_for`` says whether to watch at all and ``SilenceWatch`` when to move (pure);
``look`` feeds the watch the time and the bus's counters and calls ``Bus.move_on`` with
the reason it returns; ``watch_task`` is the loop the runtime (``runtime.py``) starts, a
look once a second.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from polca import aiokit
from polca.telemetry.messages import Bus

_MAX_SILENCE_S = 300.0


def watch_for(silence_s: float | None, endpoint_count: int) -> SilenceWatch | None:
    """The watch an agent runs: none without ``agent.control_silence_failover_s`` or with
    a single broker endpoint (nowhere to move to)."""
    if silence_s is None or endpoint_count < 2:
        return None
    return SilenceWatch(silence_s)


class SilenceWatch:
    """When to leave a broker endpoint that is connected but carries no control: after
    ``agent.control_silence_failover_s`` without a live control message on the connection,
    then twice as long after each such move while no endpoint brings control (up to
    ``_MAX_SILENCE_S``); control arriving makes the next move prompt again. Pure: time and
    the bus's counters come in, the reason to move (or None) goes out."""

    def __init__(self, silence_s: float) -> None:
        self.base_ns = int(silence_s * 1e9)
        self.silence_ns = self.base_ns
        self.connects = -1
        self.since_ns = 0
        self.heard_ns: int | None = None

    def check(
        self, now_ns: int, *, connects: int, connected: bool, heard_ns: int | None
    ) -> str | None:
        """One look: the reason to move on now, or None."""
        if connects != self.connects:  # a new connection: the silence counts anew
            self.connects, self.since_ns = connects, now_ns
        if heard_ns is not None and heard_ns != self.heard_ns:
            self.heard_ns = heard_ns
            self.silence_ns = self.base_ns
        if not connected:
            return None
        last_ns = max(self.since_ns, self.heard_ns or 0)
        if now_ns - last_ns < self.silence_ns:
            return None
        self.since_ns = now_ns  # one move per silence
        self.silence_ns = min(self.silence_ns * 2, int(_MAX_SILENCE_S * 1e9))
        return f"no control for {(now_ns - last_ns) / 1e9:.0f} s"


def look(
    watch: SilenceWatch,
    bus: Bus,
    *,
    now_ns: int,
    heard_ns: int | None,
    log: Any,
) -> str | None:
    """One look at ``bus`` (the agent's once a second): move it on when ``watch`` says
    so, with a warning naming the endpoint left and why. The reason, or None."""
    stats = bus.stats
    reason = watch.check(
        now_ns, connects=stats.connects, connected=stats.endpoint is not None, heard_ns=heard_ns
    )
    if reason is not None:
        log.warning("broker_silent_moving_on", endpoint=stats.endpoint, why=reason)
        bus.move_on(reason)
    return reason


def watch_task(
    silence_s: float | None,
    bus: Bus,
    *,
    heard_ns: Callable[[], int | None],
    mono_ns: Callable[[], int],
    log: Any,
) -> Coroutine[Any, Any, None] | None:
    """The agent's ``broker-silence`` loop (a ``look`` a second), or None when
    ``watch_for`` says not to watch. ``heard_ns``: when the last live control message
    arrived (monotonic), read at each look."""
    watch = watch_for(silence_s, bus.endpoint_count)
    if watch is None:
        return None

    def once() -> None:
        look(watch, bus, now_ns=mono_ns(), heard_ns=heard_ns(), log=log)

    return aiokit.every(1.0, once)
