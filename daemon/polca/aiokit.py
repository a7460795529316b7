"""Small asyncio helpers shared by the supervisors: guarded eternal tasks and backoff.

``guard`` wraps every long-running loop of a supervisor: it logs a failure, a
cancellation and an unexpected return differently, and turns an unexpected return into an
error so the owning TaskGroup tears everything down instead of running half a daemon.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import signal
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, NoReturn

import structlog

from polca.errors import StopRequestedError, UnexpectedReturnError
from polca.sdnotify import SystemdNotifier, WatchdogGate


async def guard(name: str, coro: Coroutine[Any, Any, object]) -> None:
    """Run an eternal coroutine, logging how it ended; re-raise everything."""
    log = structlog.get_logger().bind(task=name)
    try:
        await coro
    except asyncio.CancelledError:
        log.debug("task_cancelled")
        raise
    except Exception:
        log.exception("task_failed")
        raise
    log.error("task_returned")
    msg = f"task {name} returned, but it should run until cancelled"
    raise UnexpectedReturnError(msg)


def backoff_delays(
    min_s: float, max_s: float, *, rng: random.Random | None = None
) -> Iterator[float]:
    """The one retry schedule of polca: the n-th delay is uniform(min_s / 2, ceiling).

    ``ceiling`` doubles from ``min_s`` to ``max_s``. Jittered, so a fleet that lost its
    broker or database at once does not come back in lockstep; floored at half the minimum,
    so a retry never spins. A caller restarts the schedule (a new iterator) after a success.
    Used by the MQTT bus, the InfluxDB sink and the Modbus poller.
    """
    rand = rng or random.Random()  # noqa: S311 - jitter, not cryptography
    ceiling = min_s
    while True:
        yield rand.uniform(min_s / 2, ceiling) if ceiling > 0 else 0.0
        ceiling = min(max_s, ceiling * 2 if ceiling > 0 else max_s)


async def every(
    interval_s: float, tick: Callable[[], object], *, first_after_s: float = 0.0
) -> NoReturn:
    """Call ``tick`` (awaiting it if it returns an awaitable) every ``interval_s``, forever.

    Scheduled on ``loop.time()``; after a slow tick the missed ones are skipped, not
    bunched. The first call comes ``first_after_s`` after the start.
    """
    if interval_s <= 0:
        msg = f"interval_s must be > 0, got {interval_s}"
        raise ValueError(msg)
    loop = asyncio.get_running_loop()
    next_t = loop.time() + first_after_s
    while True:
        await asyncio.sleep(max(0.0, next_t - loop.time()))
        result = tick()
        if inspect.isawaitable(result):
            await result
        next_t = max(next_t + interval_s, loop.time())


async def every_or_woken(
    interval_s: float, wake: asyncio.Event, tick: Callable[[], object]
) -> NoReturn:
    """Call ``tick`` every ``interval_s``, and at once whenever ``wake`` is set, forever.

    The interval counts from the start on ``loop.time()``; a woken tick does not move the
    schedule (the next timed one still comes on time), and a slow tick skips the missed
    ones. ``wake`` is cleared before each tick, so a wake during it brings another.
    """
    if interval_s <= 0:
        msg = f"interval_s must be > 0, got {interval_s}"
        raise ValueError(msg)
    loop = asyncio.get_running_loop()
    next_t = loop.time() + interval_s
    while True:
        woken = await wait_first(wake, max(0.0, next_t - loop.time()))
        wake.clear()
        if not woken:
            next_t = max(next_t + interval_s, loop.time())
        tick()


async def wait_first(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for ``event`` at most ``timeout_s``; True when it was set."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


def install_signal_handlers(stop: asyncio.Event, reload: asyncio.Event) -> None:
    """SIGTERM/SIGINT request a stop; SIGHUP requests a policy reload."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload.set)


def stop_on_signals(
    stop: asyncio.Event, reload: asyncio.Event, *, duration_s: float | None = None
) -> None:
    """A process's signals (``install_signal_handlers``), and a stop after ``duration_s``
    when given (``--duration``)."""
    install_signal_handlers(stop, reload)
    if duration_s is not None:
        asyncio.get_running_loop().call_later(duration_s, stop.set)


async def raise_when_set(event: asyncio.Event) -> None:
    """Wait for ``event``, then raise ``StopRequestedError`` to end the TaskGroup."""
    await event.wait()
    raise StopRequestedError


async def repeat_on(event: asyncio.Event, action: Callable[[], object]) -> None:
    """Call ``action`` each time ``event`` is set (e.g. SIGHUP -> reload), forever."""
    while True:
        await event.wait()
        event.clear()
        action()


async def watch_file(path: Path, *, debounce_s: float, action: Callable[[], object]) -> None:
    """Call ``action`` whenever ``path`` changes, forever.

    Watches the directory, not the file: editors and configuration management replace
    files by rename, which a watch on the old inode would miss.
    """
    import watchfiles  # noqa: PLC0415 - a Rust extension, loaded only by the daemons

    async for _changes in watchfiles.awatch(
        path.parent,
        debounce=max(50, int(debounce_s * 1000)),
        step=50,
        recursive=False,
        # A Kubernetes ConfigMap volume swaps its ``..data`` symlink; the file's own
        # symlink never changes, so that swap counts as a change of the file too.
        watch_filter=lambda _change, changed: Path(changed).name in {path.name, "..data"},
    ):
        action()
    msg = f"the watcher of {path} ended"
    raise RuntimeError(msg)


async def feed_watchdog(
    notifier: SystemdNotifier, gate: WatchdogGate, *, extra_stall_s: float = 0.0
) -> None:
    """Ping systemd's watchdog while ``gate`` shows progress; idle if there is no watchdog."""
    interval = notifier.watchdog_interval_s()
    if interval is None:
        await asyncio.Event().wait()  # no watchdog configured: idle until cancelled
        return
    while True:
        await asyncio.sleep(interval)
        gate.feed(notifier, time.monotonic(), max_stall_s=interval + extra_stall_s)


async def run_until_stopped(
    tasks: dict[str, Coroutine[Any, Any, object]], stop: asyncio.Event
) -> None:
    """Run eternal tasks, each guarded, in one TaskGroup until ``stop`` is set.

    Returns normally after a stop; any task's failure tears the group down and propagates
    (as an ``ExceptionGroup``) to the supervisor, which then shuts down in order.
    """
    try:
        async with asyncio.TaskGroup() as tg:
            for name, coro in tasks.items():
                tg.create_task(guard(name, coro), name=name)
            tg.create_task(raise_when_set(stop), name="stopper")
    except* StopRequestedError:
        pass  # the stop we asked for; any other failure propagates
