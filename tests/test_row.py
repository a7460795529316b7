"""A whole row in one process, on the in-memory broker and one fake clock (``tests/row.py``).

The production aggregator and agents, simulated GPUs and CDUs, driven step by step: the
control decisions and the fault cases of the end-to-end suite, deterministic and in well
under a second of wall time each. The same behaviours stay covered against real
processes and a real Mosquitto in ``tests/integration``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from polca.telemetry.messages import OutMessage
from polca.telemetry.schema import Assignment, Meter, encode
from tests.integration.test_hostile_retained import poison
from tests.row import HOUR_NS, ROW, SITE, Row

LOW_T1_MHZ = 1275
LOW_T2_MHZ = 1110
HIGH_T2_MHZ = 1305
BUDGET_W = 4 * 4 * 400.0  # 2 racks x 2 nodes x 4 A100s at their 400 W limit


def _row(tmp_path: Path, **kwargs: object) -> Row:
    racks = {"rack1": ["n1", "n2"], "rack2": ["n3", "n4"]}
    return Row(tmp_path, racks=racks, budget_w=BUDGET_W, **kwargs)  # type: ignore[arg-type]


def _at(row: Row, *, low: int | None, high: int | None) -> bool:
    """Every node's GPU 0 (high priority) and GPUs 1-3 (low) locked at or under these."""

    def ok(lock: int | None, cap: int | None) -> bool:
        return lock is None if cap is None else lock is not None and lock <= cap

    return all(
        ok(locks[0], high) and all(ok(lock, low) for lock in locks[1:])
        for locks in (node.locks_mhz() for node in row.nodes.values())
    )


async def _until(row: Row, condition: object, *, max_s: float = 20.0) -> float:
    """Step until ``condition()`` holds; the simulated seconds it took."""
    waited = 0.0
    while not condition():  # type: ignore[operator]
        assert waited < max_s, f"not within {max_s} simulated s"
        await row.step()
        waited += 0.5
    return waited


async def test_load_walks_t1_t2_and_back_one_level_at_a_time(tmp_path: Path) -> None:
    """80% caps low priority, 89% both classes; release waits the dwell, one level a step."""
    row = _row(tmp_path, meter_pct=70.0)
    await row.start()
    await row.run(2)
    assert _at(row, low=None, high=None)
    row.meter_pct = 85.0
    await _until(row, lambda: _at(row, low=LOW_T1_MHZ, high=None))
    row.meter_pct = 92.0
    await _until(row, lambda: _at(row, low=LOW_T2_MHZ, high=HIGH_T2_MHZ))
    row.meter_pct = 86.0  # inside T2's hysteresis band (89 - 5)
    await row.run(4)
    assert row.levels() == dict.fromkeys(row.nodes, 2)
    row.meter_pct = 70.0
    await _until(row, lambda: _at(row, low=None, high=None))
    levels = [c.level for c in row.controls()]
    down = levels[levels.index(2) :]
    assert down == sorted(down, reverse=True)
    assert 1 in down  # never 2 -> 0 directly
    await row.stop()
    assert _at(row, low=None, high=None)  # on_stop: restore


async def test_the_same_inputs_give_the_same_run(tmp_path: Path) -> None:
    """Two runs of the same scenario publish the same sequence of levels and caps."""
    runs = []
    for attempt in ("a", "b"):
        row = _row(tmp_path / attempt, meter_pct=70.0)
        await row.start()
        for pct in (85.0, 92.0, 86.0, 60.0):
            row.meter_pct = pct
            await row.run(4)
        runs.append(([c.level for c in row.controls()], row.nodes["n1"].locks_mhz()))
        await row.stop()
    assert runs[0] == runs[1]


async def test_aggregator_lost_agents_fail_safe_restart_resumes_at_the_same_level(
    tmp_path: Path,
) -> None:
    """The lease ends without a controller (fail-safe); a new aggregator starts from T2."""
    row = _row(tmp_path, meter_pct=92.0)
    await row.start()
    await _until(row, lambda: row.levels() == dict.fromkeys(row.nodes, 2))
    assert row.aggregator_bus() is not None
    row.kill_aggregator()  # the process died: its Last Will goes out, its control stays
    await row.run(4)  # past the 3 s lease
    assert row.levels() == dict.fromkeys(row.nodes)  # every agent in fail-safe
    assert _at(row, low=LOW_T2_MHZ, high=HIGH_T2_MHZ)  # the fail-safe caps are T2's
    seen = len(row.controls())
    row.meter_pct = 86.0  # below T2's threshold, inside its band: T2 must hold
    await row.restart_aggregator()
    await row.run(4)
    after = row.controls()[seen:]
    assert after
    assert all(c.level == 2 for c in after)
    assert row.levels() == dict.fromkeys(row.nodes, 2)
    await row.stop()


async def test_a_node_that_goes_away_counts_at_its_limits(tmp_path: Path) -> None:
    """Without a meter, a node whose agent is gone counts at 4 x 400 W, never at 0 W."""
    row = _row(tmp_path)
    await row.start()
    await row.run(3)
    row.nodes["n4"].bus.drop()  # its Last Will says offline
    await row.run(1)
    result = row.aggregator.rows.last
    assert result is not None
    rack2 = next(r for r in result.rows[0].rollup.racks if r.rack == "rack2")
    assert rack2.nodes_offline == 1
    assert rack2.power_w >= 4 * 400.0
    await row.stop()


async def test_hostile_retained_messages_change_nothing(tmp_path: Path) -> None:
    """Poison retained on every subscribed topic: no daemon breaks, T2 still caps."""
    row = _row(tmp_path, meter_pct=92.0)
    for original, payload in poison().items():
        topic = original.replace("/rack1/node1/", "/rack1/n1/").replace(
            "/rack2/node2/", "/rack2/n3/"
        )
        row.probe.publish_nowait(OutMessage(topic, payload, qos=1, retain=True))
    await row.start()
    await _until(row, lambda: _at(row, low=LOW_T2_MHZ, high=HIGH_T2_MHZ))
    assert row.aggregator.intake.dropped["internal"] == 0
    assert all(node.agent.core.drops.counts["internal"] == 0 for node in row.nodes.values())
    assert row.nodes["n1"].agent.core.drops.total > 0  # the poison was seen, and dropped
    await row.stop()


async def test_a_leak_brakes_its_own_rack_only(tmp_path: Path) -> None:
    """A critical leak on rack1's CDU brakes rack1's GPUs at once; rack2 runs on."""
    row = _row(tmp_path, cdus={"rack1": "cdu1", "rack2": "cdu2"}, meter_pct=50.0)
    await row.start()
    await row.run(3)
    assert row.levels() == dict.fromkeys(row.nodes, 0)
    row.plants["rack1"].leak(detector=0, escalate_after_s=0)
    took = await _until(row, lambda: row.levels()["n1"] == 3 and row.levels()["n2"] == 3)
    assert took <= 4.0  # the default critical debounce is 2 s
    assert row.levels()["n3"] == 0
    assert row.levels()["n4"] == 0
    await row.stop()


async def test_an_agent_clock_stepped_an_hour_keeps_following(tmp_path: Path) -> None:
    """One node's wall clock jumps an hour ahead: it follows T2 throughout, and says so."""
    row = _row(tmp_path, meter_pct=92.0)
    await row.start()
    await _until(row, lambda: row.levels() == dict.fromkeys(row.nodes, 2))
    row.nodes["n2"].wall.offset_ns = HOUR_NS
    for _ in range(10):  # 5 s: longer than the lease
        await row.step()
        assert row.levels()["n2"] == 2
    assert row.nodes["n2"].agent.core.clock_skewed
    assert not row.nodes["n1"].agent.core.clock_skewed
    await row.stop()


async def test_an_agent_that_fails_leaves_fail_safe_caps_and_restarts_capped(
    tmp_path: Path,
) -> None:
    """A sampler failure at nominal ends the agent at the fail-safe; its restart starts there."""
    row = _row(tmp_path, meter_pct=50.0)
    await row.start()
    await row.run(3)
    assert _at(row, low=None, high=None)
    node = row.nodes["n1"]
    node.backend.fail_samples(RuntimeError("binding bug"))
    with pytest.raises(RuntimeError, match="binding bug"):
        await node.agent.tick()
    await node.agent.stop(clean=False)  # what the shell does when a task fails
    assert all(lock is not None and lock <= HIGH_T2_MHZ for lock in node.locks_mhz())
    assert all(lock is not None and lock <= LOW_T2_MHZ for lock in node.locks_mhz()[1:])
    node.backend.fail_samples(None)
    row.nodes["n1"] = restarted = row.new_node("rack1", "n1", backend=node.backend)
    await row.start_agent(restarted)
    assert restarted.agent.core.decision is not None
    assert restarted.agent.core.decision.fail_safe  # capped before any control message
    assert restarted.agent.core.grace_until_mono_ns <= row.clock.mono()  # and no grace
    await _until(row, lambda: row.levels()["n1"] == 0)  # the controller takes it back
    await row.stop()


async def test_write_intervals_thin_each_measurement_to_its_own_rate(tmp_path: Path) -> None:
    """gpu every 2 s and node every 1 s, row every step (0.5 s): what a large site picks."""
    row = _row(
        tmp_path,
        meter_pct=70.0,
        aggregator_overrides={"influx": {"write_every_s": {"gpu": 2.0, "node": 1.0}}},
    )
    await row.start()
    await row.run(3)
    before = {m: len(row.sink.measurement(m)) for m in ("gpu", "node", "row")}
    await row.run(10)
    written = {m: len(row.sink.measurement(m)) - before[m] for m in before}
    series = 4 * 4  # 4 nodes x 4 GPUs
    assert 4 * series <= written["gpu"] <= 6 * series, written  # ~10 s / 2 s per GPU
    assert 9 * 4 <= written["node"] <= 11 * 4, written  # ~10 s / 1 s per node
    assert 19 <= written["row"] <= 21, written  # every 0.5 s step: not thinned
    await row.stop()


async def test_reading_over_the_next_threshold_escalates_without_waiting_for_the_interval(
    tmp_path: Path,
) -> None:
    """The meter reading that crosses T2 runs the control step at once: caps before the tick.

    No simulated time passes between the reading and the caps: the aggregator steps on the
    reading (not its interval) and each agent applies on the control message. A second
    reading over the same threshold does not step again until the next interval re-arms.
    """
    row = _row(tmp_path, meter_pct=70.0)
    await row.start()
    await row.run(2)
    assert _at(row, low=None, high=None)
    assert row.urgent_steps == 0
    meter = Meter(ts_ns=row.clock.wall(), power_w=BUDGET_W * 0.92)
    for _ in range(2):
        row.probe.publish_nowait(OutMessage(f"polca/v1/{SITE}/{ROW}/meter", encode(meter)))
        row.deliver()
    assert row.urgent_steps == 1
    for node in row.nodes.values():
        await node.agent.control_step()  # what each agent's wake runs
    assert _at(row, low=LOW_T2_MHZ, high=HIGH_T2_MHZ)
    assert row.controls()[-1].level == 2
    await row.stop()


async def test_telemetry_that_takes_the_row_over_a_threshold_steps_at_once(
    tmp_path: Path,
) -> None:
    """Without a meter, the node telemetry that lifts the computed row power over T1 does."""
    row = _row(tmp_path)
    await row.start()
    await row.run(3)
    assert row.controls()[-1].level == 0
    for node in row.nodes.values():
        for index in range(4):
            node.backend.set_utilization(index, 1.0)
    for _ in range(6):  # telemetry only: the aggregator's interval step never runs here
        row.clock.advance(0.5)
        for node in row.nodes.values():
            await node.agent.tick()
            node.agent.telemetry.publish()
        row.deliver()
        if row.urgent_steps:
            break
    assert row.urgent_steps == 1
    assert row.controls()[-1].level >= 1
    await row.stop()


async def test_flapping_priority_assignments_write_each_gpu_at_most_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 retained assignments flipping two GPUs' classes within 1 s, the agent's
    controller woken by each: at most one write per GPU in that second, the last assignment
    in force after the dwell (agent.class_dwell_s, 5 s), two writes per GPU at most."""
    row = _row(tmp_path, meter_pct=92.0)
    await row.start()
    await _until(row, lambda: _at(row, low=LOW_T2_MHZ, high=HIGH_T2_MHZ))
    node = row.nodes["n1"]
    writes: Counter[int] = Counter()

    def counting(write: Any) -> Any:
        def counted(index: int, *args: Any) -> None:
            writes[index] += 1
            write(index, *args)

        return counted

    for name in ("lock_sm_clocks_mhz", "reset_sm_clocks", "set_power_limit_mw"):
        monkeypatch.setattr(node.backend, name, counting(getattr(node.backend, name)))
    topic = f"polca/v1/{SITE}/{ROW}/rack1/n1/assign"
    flips = [{"1": "high", "2": "low"}, {"1": "low", "2": "high"}]
    for i in range(200):
        row.clock.advance(0.005)
        message = Assignment(ts_ns=row.clock.wall(), seq=i, classes=flips[i % 2])
        row.probe.publish_nowait(OutMessage(topic, encode(message), qos=1, retain=True))
        row.deliver()
        await node.agent.control_step()  # what the wake on each message runs
    assert writes == Counter({1: 1})  # GPU 1 raised to high; GPU 2's first was "low" again
    assert node.agent.core.classes.deferred >= 198
    await row.run(6)
    assert writes == Counter({1: 2, 2: 1})
    locks = node.locks_mhz()
    assert locks[1] is not None
    assert locks[1] <= LOW_T2_MHZ  # the last assignment: GPU 1 low, GPU 2 high
    assert locks[2] is not None
    assert LOW_T2_MHZ < locks[2] <= HIGH_T2_MHZ
    assert node.agent.core.classes.in_force == {1: "low", 2: "high"}
    await row.stop()
