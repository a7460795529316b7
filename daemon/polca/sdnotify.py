"""Tell systemd when the agent is ready, reloading or stopping, and feed its watchdog.

The ``sd_notify`` protocol is one datagram of newline-separated ``KEY=value`` lines sent
to the ``AF_UNIX`` socket named by ``$NOTIFY_SOCKET`` (a leading ``@`` names an abstract
socket); systemd documents it as a stable interface and ships a dependency-free reference
(``man/notify-selfcontained-example.py``). So this module is a few lines of stdlib rather
than a dependency: ``sdnotify`` 0.3.2 (2017) silently swallows every error, and
``systemd-python`` must be compiled against ``libsystemd``.

Notifying must never take the agent down: without ``$NOTIFY_SOCKET`` (not started by
systemd) every call is a no-op, and a failed send is logged once (``sd_notify_failed``)
and never raised. The watchdog is fed only while the control loop makes progress:
``WatchdogGate`` remembers the loop's last tick, so a wedged loop on a live event loop
still gets the agent restarted.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

import structlog

log = structlog.get_logger()

# A datagram to systemd's queue only blocks when PID 1 is not reading; never stall the
# event loop longer than this for it.
_SEND_TIMEOUT_S = 1.0


class SystemdNotifier:
    """An ``sd_notify`` client; reads the environment at construction, opens the socket lazily.

    ``environ`` defaults to ``os.environ``; tests pass their own mapping.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        # "@name" is Linux's abstract namespace, spelled with a leading NUL on the wire.
        self._address = "\0" + raw[1:] if raw.startswith("@") else raw
        self._socket_name = raw
        self._watchdog_timeout_s = _watchdog_timeout_s(env)
        self._sock: socket.socket | None = None
        self._failure_logged = False

    @property
    def enabled(self) -> bool:
        """Whether systemd asked for notifications (``$NOTIFY_SOCKET`` is set)."""
        return bool(self._address)

    def send(self, *assignments: str) -> bool:
        """Send ``KEY=value`` lines as one datagram; True if sent, False if disabled or failed.

        A newline inside an assignment would start a new one, so it becomes a space.
        """
        if not self._address or not assignments:
            return False
        payload = "\n".join(a.replace("\n", " ") for a in assignments).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.settimeout(_SEND_TIMEOUT_S)
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            if not self._failure_logged:
                self._failure_logged = True
                log.warning("sd_notify_failed", socket=self._socket_name, error=str(exc))
            return False
        return True

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=value`` for each keyword (``notify(READY=1, STATUS="up")``)."""
        return self.send(*(f"{key}={value}" for key, value in fields.items()))

    def ready(self, status: str | None = None) -> bool:
        """Startup (or a reload) finished: ``READY=1``, with an optional status line."""
        return self.send("READY=1", f"STATUS={status}") if status else self.send("READY=1")

    def status(self, text: str) -> bool:
        """Set the one-line status shown by ``systemctl status``."""
        return self.send(f"STATUS={text}")

    def stopping(self) -> bool:
        """Shutdown began (``STOPPING=1``)."""
        return self.send("STOPPING=1")

    def reloading(self) -> bool:
        """A reload began: ``RELOADING=1`` and ``CLOCK_MONOTONIC`` in µs; ``ready()`` ends it."""
        now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={now_us}")

    def watchdog(self) -> bool:
        """Feed the watchdog (``WATCHDOG=1``); call only through ``WatchdogGate``'s judgement."""
        return self.send("WATCHDOG=1")

    def watchdog_timeout_s(self) -> float | None:
        """systemd's ``WatchdogSec`` for this process, or None when no watchdog applies."""
        return self._watchdog_timeout_s

    def watchdog_interval_s(self) -> float | None:
        """How often to feed the watchdog: half its timeout (systemd's advice), or None."""
        timeout_s = self._watchdog_timeout_s
        return None if timeout_s is None else timeout_s / 2

    def close(self) -> None:
        """Close the socket, if it was opened; a later send opens it again."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_timeout_s(env: Mapping[str, str]) -> float | None:
    """``$WATCHDOG_USEC`` in seconds if it is meant for this process (``$WATCHDOG_PID``)."""
    pid = env.get("WATCHDOG_PID")
    if pid is not None and pid.strip() != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 1_000_000 if usec > 0 else None


class WatchdogGate:
    """Allows a watchdog ping only while the control loop keeps ticking.

    The control loop calls ``beat()`` every tick; the watchdog task asks
    ``should_ping(now, max_stall_s)`` before each ping. Before the first beat the answer
    is no. ``clock`` must be the control loop's clock (``loop.time``; ``time.monotonic``
    by default).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last_beat_s: float | None = None
        self._withheld = False

    @property
    def last_beat_s(self) -> float | None:
        """Clock reading of the last beat, or None before the first."""
        return self._last_beat_s

    def beat(self, now: float | None = None) -> None:
        """Record that the control loop made progress at ``now`` (default: the clock)."""
        self._last_beat_s = self._clock() if now is None else now

    def should_ping(self, now: float, max_stall_s: float) -> bool:
        """True if the last beat is at most ``max_stall_s`` old at ``now``."""
        return self._last_beat_s is not None and now - self._last_beat_s <= max_stall_s

    def feed(self, notifier: SystemdNotifier, now: float, max_stall_s: float) -> bool:
        """Ping ``notifier``'s watchdog if the loop made progress; True if the gate let it through.

        Logs ``watchdog_withheld`` once when a stall begins and ``watchdog_resumed`` when
        beats come back, so a wedged loop leaves a trace before systemd kills the agent.
        """
        if not self.should_ping(now, max_stall_s):
            if not self._withheld:
                self._withheld = True
                stalled_s = None if self._last_beat_s is None else now - self._last_beat_s
                log.warning("watchdog_withheld", stalled_s=stalled_s, max_stall_s=max_stall_s)
            return False
        if self._withheld:
            self._withheld = False
            log.info("watchdog_resumed")
        notifier.watchdog()
        return True
