"""Small asyncio helpers shared by the supervisors: guarded eternal tasks and backoff.

``guard`` wraps every long-running loop of a supervisor: it logs a failure, a
cancellation and an unexpected return differently, and turns an unexpected return into an
error so the owning TaskGroup tears everything down instead of running half a daemon.
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Coroutine, Iterator
from typing import Any

import structlog


class UnexpectedReturnError(RuntimeError):
    """An eternal task returned; the supervisor treats that as a failure."""


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
    """Exponential delays with full jitter: uniform(0, min(max_s, min_s * 2**n))."""
    rand = rng or random.Random()  # noqa: S311 - jitter, not cryptography
    ceiling = min_s
    while True:
        yield rand.uniform(min_s / 2, ceiling) if ceiling > 0 else 0.0
        ceiling = min(max_s, ceiling * 2 if ceiling > 0 else max_s)


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
