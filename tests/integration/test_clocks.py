"""Clock skew and clock steps, both ways, on the agent and the aggregator.

A real aggregator and a real agent (on simulated GPUs) run in this process on a real
Mosquitto, each with its own injected wall clock that the test skews and steps. Leases run
on the monotonic clock, so no skew or step of either wall clock may expire a valid lease
(fail-safe) or extend one; an agent whose clock is off says so and still follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from polca.agent.config import Settings
from polca.agent.runtime import Agent
from polca.aggregator.config import AggregatorSettings
from polca.aggregator.runtime import Aggregator
from polca.gpu.simulated import SimulatedBackend
from polca.policy import PolicyStore
from polca.telemetry.schema import Meter, encode
from tests.integration.rig import mqtt_config, mqtt_probe, wait_until
from tests.mqtt_broker import MosquittoProcess

ROOT = Path(__file__).resolve().parents[2]
SITE, ROW, RACK, NODE = "dc1", "row1", "rack1", "node1"
HOUR_NS = 3600 * 1_000_000_000
BUDGET_W = 10_000.0


@dataclass
class SteppedClock:
    """A wall clock that runs with real time plus an offset the test sets."""

    offset_ns: int = 0

    def __call__(self) -> int:
        return time.time_ns() + self.offset_ns


@dataclass
class Row:
    """An aggregator and one agent, running."""

    aggregator: Aggregator
    agent: Agent
    aggregator_clock: SteppedClock
    agent_clock: SteppedClock


def _policy(tmp_path: Path) -> Path:
    """The A100 policy, restoring at stop, without the trend brake: these tests hold the
    row at T2 by its meter, and on a loaded machine the first steps can see the row's
    power jump from its computed value to the meter's in a fraction of a second, a trend
    that would brake it (level 3) for the whole dwell."""
    text = (ROOT / "policies" / "polca-a100.yaml").read_text(encoding="utf-8")
    text = text.replace("on_stop: fail_safe", "on_stop: restore")
    start = text.index("trend:")
    end = text.index("\n", text.index("reaction_s", start)) + 1
    text = text[:start] + text[end:]
    assert "trend:" not in text
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@contextlib.asynccontextmanager
async def _row(
    tmp_path: Path, broker: MosquittoProcess, *, agent_offset_ns: int = 0
) -> AsyncIterator[Row]:
    policy = _policy(tmp_path)
    aggregator_clock = SteppedClock()
    agent_clock = SteppedClock(agent_offset_ns)
    aggregator = Aggregator(
        AggregatorSettings(
            site=SITE,
            instance="agg",
            policy_file=policy,
            state_dir=tmp_path / "aggregator",
            mqtt=mqtt_config(broker),
            rows=[
                {
                    "name": ROW,
                    "budget_w": BUDGET_W,
                    # The probe's meter is a figure of the test's, not a device: the row may
                    # read up to twice its budget (beyond what its two GPUs can draw) ...
                    "meter_max_w": 2 * BUDGET_W,
                    "racks": [{"name": RACK, "nodes": [{"name": NODE}]}],
                }
            ],
            control={
                "interval_s": 0.2,
                "lease_s": 2.0,
                "warmup_s": 0.0,
                "stale_after_s": 5,
                # ... and it repeats one figure while the agent caps: not a hung PDU card.
                "meter_frozen_readings": 100_000,
            },
        ),
        clock_ns=aggregator_clock,
    )
    agent = Agent(
        Settings(
            mqtt=mqtt_config(broker),
            topics={"site": SITE, "row": ROW, "rack": RACK, "node": NODE},
            agent={
                "policy_file": policy,
                "state_dir": tmp_path / "agent",
                "startup_grace_s": 0,
                "publish_interval_s": 0.2,
                "control_issuers": ["agg"],
            },
        ),
        backend=SimulatedBackend(count=2, model="A100-SXM4"),
        policy_store=PolicyStore(policy),
        clock_ns=agent_clock,
    )
    async with asyncio.TaskGroup() as tg:
        tg.create_task(aggregator.run(), name="aggregator")
        tg.create_task(agent.run(), name="agent")
        try:
            yield Row(aggregator, agent, aggregator_clock, agent_clock)
        finally:
            agent.stop_requested.set()
            aggregator.stop_requested.set()


async def _meter(broker: MosquittoProcess, stop: asyncio.Event, pct: float) -> None:
    """Publish the row meter at ``pct`` of the budget every 0.2 s until ``stop``."""
    async with mqtt_probe(broker) as probe:
        while not stop.is_set():
            meter = Meter(ts_ns=time.time_ns(), power_w=BUDGET_W * pct / 100)
            await probe.publish_raw(f"polca/v1/{SITE}/{ROW}/meter", encode(meter))
            await asyncio.sleep(0.2)


def _following(agent: Agent, level: int) -> bool:
    decision = agent.core.decision
    return decision is not None and not decision.fail_safe and decision.level == level


async def _hold(agent: Agent, level: int, seconds: float) -> None:
    """Assert the agent stays at ``level`` (never fail-safe) for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert _following(agent, level), agent.core.decision
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("who", "step_ns"),
    [("agent", HOUR_NS), ("agent", -HOUR_NS), ("aggregator", HOUR_NS), ("aggregator", -HOUR_NS)],
)
async def test_a_clock_step_of_an_hour_neither_expires_nor_extends_the_lease(
    tmp_path: Path, mosquitto: MosquittoProcess, who: str, step_ns: int
) -> None:
    """Either wall clock stepped an hour: the agent follows, and the lease still ends on time."""
    stop = asyncio.Event()
    async with _row(tmp_path, mosquitto) as row, asyncio.TaskGroup() as tg:
        tg.create_task(_meter(mosquitto, stop, 92.0))  # over T2 (89%), under the brake
        await wait_until(lambda: _following(row.agent, 2), timeout_s=20, what="agent at T2")
        clock = row.agent_clock if who == "agent" else row.aggregator_clock
        clock.offset_ns += step_ns
        await _hold(row.agent, 2, 3.0)  # longer than the 2 s lease: renewals kept coming
        # The controller stops: the lease ends on time, whatever the wall clocks say.
        row.aggregator.stop_requested.set()
        stopped = time.monotonic()
        await wait_until(
            lambda: row.agent.core.decision is not None and row.agent.core.decision.fail_safe,
            timeout_s=10,
            what="fail-safe after the lease",
        )
        # The 2 s lease and the agent's tick, seconds later where the machine is busy: not
        # an hour, which a wall-clock lease would take.
        assert time.monotonic() - stopped <= 2.0 + 5.0
        stop.set()


async def test_an_agent_eleven_seconds_ahead_follows_and_says_so(
    tmp_path: Path, mosquitto: MosquittoProcess
) -> None:
    """An agent whose clock is 11 s ahead (tolerance 5 s) logs the skew and still follows T2."""
    stop = asyncio.Event()
    with capture_logs() as logs:
        async with (
            _row(tmp_path, mosquitto, agent_offset_ns=11 * 10**9) as row,
            asyncio.TaskGroup() as tg,
        ):
            tg.create_task(_meter(mosquitto, stop, 92.0))
            await wait_until(lambda: _following(row.agent, 2), timeout_s=20, what="T2")
            await _hold(row.agent, 2, 3.0)
            assert row.agent.core.clock_skewed
            assert "clock off by +11" in row.agent.core.status_line()
            stop.set()
    skew = [e for e in logs if e["event"] == "clock_skew_detected"]
    assert skew
    assert skew[0]["skew_s"] == pytest.approx(11, abs=1)
    # The aggregator noticed the node's stamps too, and re-stamped its points on receipt.
    assert row.aggregator.intake.skewed.counts["telemetry"] > 0
