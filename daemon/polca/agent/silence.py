"""When an agent leaves a broker endpoint that is connected but carries no control.

Pure: the runtime (``runtime.py``) feeds it the time and the bus's counters once a second
and calls ``MqttBus.move_on`` with the reason it returns.
"""

from __future__ import annotations

_MAX_SILENCE_S = 300.0


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
