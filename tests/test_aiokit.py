"""The periodic loops of ``aiokit``: the timed schedule and the early wake."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from polca import aiokit


async def test_every_or_woken_ticks_on_the_interval_and_at_once_when_woken() -> None:
    """A wake brings a tick at once (task switches, no waiting) without moving the timed
    schedule: the first timed tick still comes one interval after the start, not one
    interval after the wake. Only lower bounds and a wide upper one: load cannot fail it."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    ticks: list[float] = []
    two = asyncio.Event()
    start = loop.time()

    def tick() -> None:
        ticks.append(loop.time() - start)
        if len(ticks) == 2:
            two.set()

    task = asyncio.ensure_future(aiokit.every_or_woken(2.0, wake, tick))
    try:
        await asyncio.sleep(0.5)
        assert ticks == []  # a timed tick never comes early
        wake.set()
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(ticks) == 1  # woken: at once
        assert not wake.is_set()  # cleared for the next wake
        async with asyncio.timeout(30):
            await two.wait()
        assert ticks[1] >= 2.0  # the schedule from the start ...
        assert ticks[1] < 2.5 + 2.0  # ... not from the wake (that one would come at >= 4.5 s)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_every_or_woken_refuses_an_interval_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        await aiokit.every_or_woken(0.0, asyncio.Event(), lambda: None)
