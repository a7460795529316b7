"""What the agent's and the aggregator's shells share: policy reloads and the side tasks.

Both daemons reload their policy file on change and on SIGHUP the same way (a bad edit is
reported with its ``FILE:LINE:COL`` problems and never replaces the last good policy),
tell systemd about it (``RELOADING=1``, then ``READY=1`` with the status line), and run
the same three side tasks beside their own loops: the policy file watcher, the SIGHUP
handler and the systemd watchdog (fed only while the control loop makes progress).
``PolicyReloader`` and ``side_tasks`` are that, once, and ``supervise`` is the shape of
both supervisors: the connections (bus, sink) run unguarded beside a TaskGroup of guarded
eternal loops, and the shutdown runs shielded whether the loops stopped on request (clean)
or because one failed. ``STOP_BOUNDS`` is how long each step of either shutdown may
take (one home: each systemd unit's ``TimeoutStopSec`` leaves room for their sum), and
``bounded`` runs one such step. A telemetry source (``polca cdu``, ``polca meter``) runs
its bus and loops under ``serve_source`` and publishes to a ``Publisher``. Exit codes live
in ``exits.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from polca import aiokit
from polca.policy import PolicyStore
from polca.sdnotify import SystemdNotifier, WatchdogGate

if TYPE_CHECKING:
    from polca.telemetry.messages import Bus, OutMessage

__all__ = [
    "STOP_BOUNDS",
    "PolicyReloader",
    "Publisher",
    "StopBounds",
    "bounded",
    "serve_source",
    "side_tasks",
    "supervise",
]


@dataclass(frozen=True, slots=True)
class StopBounds:
    """How long each step of a shutdown may take before it is abandoned and logged; the
    GPUs' own bound is ``agent.stop_timeout_s`` (configured: it depends on the node)."""

    final_messages_s: float = 3.0
    """The last words (the final state, the ``offline`` status) and their flush."""
    sinks_s: float = 5.0
    """The sinks' last writes (InfluxDB and its spool; ``/metrics`` closes at once)."""
    session_s: float = 2.0
    """A goodbye to another service: the BMC sessions, the leadership's resignation."""
    intake_s: float = 1.0
    """Each of the aggregator's intake connections (nothing to send: a DISCONNECT)."""

    def agent_s(self, gpu_stop_s: float) -> float:
        """The agent's whole shutdown at most: the GPUs, then the last words, the sinks."""
        return gpu_stop_s + self.final_messages_s + self.sinks_s

    def aggregator_s(self, intake_connections: int) -> float:
        """The aggregator's whole shutdown at most (BMC, resign, sinks, intake, last words)."""
        return (
            2 * self.session_s
            + self.sinks_s
            + intake_connections * self.intake_s
            + self.final_messages_s
        )


STOP_BOUNDS = StopBounds()


async def bounded(
    step: Coroutine[Any, Any, object], timeout_s: float, event: str, log: Any
) -> bool:
    """Await one step of a shutdown; after ``timeout_s`` abandon it and log ``event``
    (warning). Whether it finished."""
    try:
        async with asyncio.timeout(timeout_s):
            await step
    except TimeoutError:
        log.warning(event, timeout_s=timeout_s)
        return False
    return True


@dataclass(slots=True)
class PolicyReloader:
    """Reload a daemon's policy file: log, tell systemd, and call back on the outcome."""

    store: PolicyStore
    notifier: SystemdNotifier
    log: Any
    status_line: Callable[[], str]
    on_rejected: Callable[[Sequence[str]], None]
    on_changed: Callable[[], None]

    def reload(self, *, trigger: str) -> bool:
        """Read the file again; keep the last good policy when it is invalid; True if new."""
        self.notifier.reloading()
        try:
            result = self.store.reload()
            in_force = self.store.current.revision if self.store.current else None
            if result.errors:
                self.log.error(
                    "policy_rejected",
                    trigger=trigger,
                    path=str(self.store.path),
                    problems=list(result.errors),
                    revision_in_force=in_force,
                )
                self.on_rejected(result.errors)
                return False
            if not result.changed:
                self.log.info("policy_unchanged", trigger=trigger, revision=in_force)
                return False
            loaded = self.store.current
            self.log.info(
                "policy_reloaded",
                trigger=trigger,
                revision=in_force,
                policy=loaded.policy.name if loaded else None,
            )
            self.on_changed()
            return True
        finally:
            self.notifier.ready(self.status_line())


def side_tasks(
    *,
    policy_file: Path,
    debounce_s: float,
    reload: Callable[[str], object],
    reload_requested: asyncio.Event,
    notifier: SystemdNotifier,
    gate: WatchdogGate,
    extra_stall_s: float = 0.0,
) -> dict[str, Coroutine[Any, Any, object]]:
    """The policy watcher, the SIGHUP handler and the watchdog, as named eternal tasks."""
    return {
        "policy_watcher": aiokit.watch_file(
            policy_file, debounce_s=debounce_s, action=lambda: reload("file_changed")
        ),
        "sighup": aiokit.repeat_on(reload_requested, lambda: reload("sighup")),
        "watchdog": aiokit.feed_watchdog(notifier, gate, extra_stall_s=extra_stall_s),
    }


async def supervise(
    *,
    connections: dict[str, Coroutine[Any, Any, object]],
    loops: dict[str, Coroutine[Any, Any, object]],
    stop: asyncio.Event,
    shutdown: Callable[[bool], Coroutine[Any, Any, None]],
    log: Any,
    stopping_event: str,
) -> None:
    """Run ``loops`` (guarded) until ``stop``, then ``shutdown(clean)``, shielded.

    ``connections`` (the bus, the sink) are not guarded: they return by design once the
    shutdown has closed them, and are cancelled after it. ``clean`` is True only when the
    loops ended because ``stop`` was set.
    """
    async with asyncio.TaskGroup() as outer:
        tasks = [outer.create_task(coro, name=name) for name, coro in connections.items()]
        clean = False
        try:
            await aiokit.run_until_stopped(loops, stop)
            log.info(stopping_event)
            clean = True
        finally:
            await asyncio.shield(shutdown(clean))
            for task in tasks:
                task.cancel()


class Publisher(Protocol):
    """Where a source's readings go (CDU telemetry, meter readings): ``MqttBus`` or any
    object with ``publish_nowait``."""

    def publish_nowait(self, msg: OutMessage) -> None:
        """Queue ``msg`` for the broker without waiting."""


async def serve_source(
    bus: Bus,
    loops: Sequence[tuple[str, Coroutine[Any, Any, object]]],
    *,
    duration_s: float | None,
) -> None:
    """Run a telemetry source's bus and its guarded ``loops`` until SIGTERM/SIGINT or
    ``duration_s``, then close the bus cleanly (``polca cdu``, ``polca meter``)."""
    stop = asyncio.Event()
    aiokit.stop_on_signals(stop, asyncio.Event(), duration_s=duration_s)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(bus.run(), name="mqtt")  # returns after close()
        tasks = [tg.create_task(aiokit.guard(name, coro), name=name) for name, coro in loops]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        await bus.close(timeout_s=STOP_BOUNDS.final_messages_s)
