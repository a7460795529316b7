"""When an agent leaves a broker endpoint that is connected but carries no control."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog
from structlog.testing import capture_logs

from polca.agent.silence import SilenceWatch, look, watch_for, watch_task
from polca.telemetry.messages import BusStats

S = 1_000_000_000


def test_moves_after_the_silence_then_waits_twice_as_long() -> None:
    watch = SilenceWatch(10.0)
    assert watch.check(0, connects=1, connected=True, heard_ns=None) is None
    assert watch.check(9 * S, connects=1, connected=True, heard_ns=None) is None
    assert watch.check(10 * S, connects=1, connected=True, heard_ns=None) == ("no control for 10 s")
    # Connected elsewhere at 11 s, silent there too: 20 s this time.
    assert watch.check(11 * S, connects=2, connected=True, heard_ns=None) is None
    assert watch.check(30 * S, connects=2, connected=True, heard_ns=None) is None
    assert watch.check(31 * S, connects=2, connected=True, heard_ns=None) is not None


def test_control_resets_the_silence_and_its_doubling() -> None:
    watch = SilenceWatch(10.0)
    watch.check(0, connects=1, connected=True, heard_ns=None)
    assert watch.check(10 * S, connects=1, connected=True, heard_ns=None) is not None
    watch.check(11 * S, connects=2, connected=True, heard_ns=None)
    # Control arrives on the new endpoint at 12 s, then stops: 10 s again, from 12 s.
    assert watch.check(12 * S, connects=2, connected=True, heard_ns=12 * S) is None
    assert watch.check(21 * S, connects=2, connected=True, heard_ns=12 * S) is None
    assert watch.check(22 * S, connects=2, connected=True, heard_ns=12 * S) is not None


def test_no_move_while_disconnected_and_the_count_restarts_on_connect() -> None:
    watch = SilenceWatch(10.0)
    watch.check(0, connects=0, connected=False, heard_ns=None)
    assert watch.check(50 * S, connects=0, connected=False, heard_ns=None) is None
    assert watch.check(51 * S, connects=1, connected=True, heard_ns=None) is None
    assert watch.check(60 * S, connects=1, connected=True, heard_ns=None) is None
    assert watch.check(61 * S, connects=1, connected=True, heard_ns=None) is not None


def test_the_wait_stops_doubling_at_five_minutes() -> None:
    watch = SilenceWatch(100.0)
    now = 0
    for connects in range(1, 7):
        watch.check(now, connects=connects, connected=True, heard_ns=None)
        now += watch.silence_ns
        assert watch.check(now, connects=connects, connected=True, heard_ns=None) is not None
    assert watch.silence_ns == 300 * S


def test_a_watch_runs_only_with_a_bound_and_somewhere_to_go() -> None:
    """No silence bound, or a single broker endpoint: no watch (nowhere to move to)."""
    assert watch_for(None, 3) is None
    assert watch_for(10.0, 1) is None
    watch = watch_for(10.0, 2)
    assert watch is not None
    assert watch.base_ns == 10 * S


class _Bus:
    """What ``look`` reads and calls of a bus: its counters and ``move_on``."""

    def __init__(self, endpoint_count: int = 2) -> None:
        self.endpoint_count = endpoint_count
        self.stats = BusStats(connects=1, endpoint="nats-1:8883")
        self.moves: list[str] = []

    def move_on(self, reason: str) -> None:
        self.moves.append(reason)


def test_a_look_moves_the_bus_on_once_per_silence_and_says_so() -> None:
    watch = SilenceWatch(10.0)
    bus = _Bus()
    log = structlog.get_logger()
    with capture_logs() as logs:
        assert look(watch, bus, now_ns=0, heard_ns=None, log=log) is None  # type: ignore[arg-type]
        assert look(watch, bus, now_ns=10 * S, heard_ns=None, log=log) == "no control for 10 s"  # type: ignore[arg-type]
        assert look(watch, bus, now_ns=11 * S, heard_ns=None, log=log) is None  # type: ignore[arg-type]
    assert bus.moves == ["no control for 10 s"]
    assert [(e["event"], e["endpoint"]) for e in logs] == [
        ("broker_silent_moving_on", "nats-1:8883")
    ]


async def test_the_watch_task_looks_once_a_second_where_a_watch_runs() -> None:
    """The agent's ``broker-silence`` loop: none without a bound or with one endpoint;
    otherwise a look a second at the time and the last control heard, moving a silent bus."""
    log = structlog.get_logger()
    for bound, endpoints in ((None, 3), (10.0, 1)):
        quiet: Any = _Bus(endpoints)
        assert watch_task(bound, quiet, heard_ns=lambda: None, mono_ns=lambda: 0, log=log) is None
    bus, now = _Bus(), [0]
    seen: Any = bus
    task = watch_task(0.5, seen, heard_ns=lambda: None, mono_ns=lambda: now[0], log=log)
    assert task is not None
    running = asyncio.ensure_future(task)
    await asyncio.sleep(0.05)  # the first look, at 0 s: the silence starts
    now[0] = S
    await asyncio.sleep(1.1)  # the second, at "1 s": half a second over the bound
    running.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await running
    assert bus.moves == ["no control for 1 s"]
