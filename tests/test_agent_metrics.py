"""The agent's health counters and /metrics points in a whole row (``tests/row.py``):
an XID reaches the aggregator's sinks and the event stream; the agent's points name the
caps in force and why, the level and the lease, and a lapsed lease reads 0."""

from __future__ import annotations

from pathlib import Path

from polca.export.points import AnyPoint
from polca.export.sink import FanOut, MemorySink
from polca.telemetry.schema import Event
from tests.row import Row

BUDGET_W = 2 * 4 * 400.0


def _row(tmp_path: Path, meter_pct: float) -> Row:
    return Row(tmp_path, racks={"rack1": ["n1", "n2"]}, budget_w=BUDGET_W, meter_pct=meter_pct)


def _of(points: list[AnyPoint], measurement: str) -> list[AnyPoint]:
    return [p for p in points if p.measurement == measurement]


async def test_an_xid_reaches_the_aggregator_and_the_events(tmp_path: Path) -> None:
    """The agent reads the counters, sends them with telemetry; the aggregator writes a
    gpu_health point per GPU (also when per-GPU points are thinned) and an event names
    the XID."""
    row = _row(tmp_path, meter_pct=70.0)
    await row.start()
    await row.run(1)
    node = row.nodes["n1"]
    await node.agent.telemetry.read_health()
    first = node.agent.telemetry.publish()
    assert all(g.health is not None for g in first.gpus)  # the first reading goes out
    row.deliver()
    node.backend.inject_xid(2, 79)
    await node.agent.telemetry.read_health()
    second = node.agent.telemetry.publish()
    assert [g.index for g in second.gpus if g.health is not None] == [2]  # only the change
    row.deliver()
    # Within the node's gpu_health interval (1 s): written with its next message after it.
    assert len(row.sink.measurement("gpu_health")) == 4
    await row.step(1.0)
    health = row.sink.measurement("gpu_health")
    assert len(health) == 4 + 1
    last = health[-1]
    assert last.tags["node"] == "n1"
    assert last.tags["gpu_index"] == "2"
    assert (last.fields["xid_errors"], last.fields["last_xid"]) == (1, 79)
    events = [
        Event.model_validate_json(m.payload) for m in row.seen if m.topic.endswith("/n1/events")
    ]
    xids = [e for e in events if e.event == "gpu_xid"]
    assert [(e.gpu, e.detail["xid"]) for e in xids] == [(2, 79)]
    assert row.sink.measurement("event")  # the aggregator wrote it for the annotations
    await row.stop()


async def test_agent_points_name_caps_reasons_level_and_lease(tmp_path: Path) -> None:
    """At T2 the agent's points carry each GPU's caps with the winning source, its level
    and the lease; once the aggregator is gone the lease reads 0 and fail-safe 1."""
    row = _row(tmp_path, meter_pct=92.0)
    await row.start()
    await row.run(4)
    node = row.nodes["n1"]
    sink = MemorySink()
    node.agent.telemetry.sinks = FanOut([sink])
    node.agent.telemetry.write_points(node.agent.telemetry.publish())
    caps = _of(sink.points, "gpu_cap")
    assert len(caps) == 4
    reasons = {p.tags["gpu_index"]: p.tags["clock_reason"] for p in caps}
    assert set(reasons.values()) == {"level:T2"}
    assert all(p.fields["applied"] == 1.0 for p in caps)
    assert all(isinstance(p.fields["sm_clock_max_mhz"], float) for p in caps)
    (agent,) = _of(sink.points, "agent")
    assert agent.fields["level"] == 2.0
    assert agent.fields["fail_safe"] == 0.0
    assert agent.fields["lease_s"] == 3.0
    remaining = agent.fields["lease_remaining_s"]
    assert isinstance(remaining, float)
    assert 0.0 < remaining <= 3.0
    assert agent.fields["gpu_errors"] == 0
    assert len(_of(sink.points, "gpu")) == 4
    assert len(_of(sink.points, "gpu_health")) == 0  # not read yet in this run
    await row.aggregator.stop()
    row.clock.advance(4.0)
    await node.agent.tick()
    await node.agent.control_step()
    await node.agent.telemetry.read_health()
    sink.points.clear()
    node.agent.telemetry.write_points(node.agent.telemetry.publish())
    (agent,) = _of(sink.points, "agent")
    assert agent.fields["lease_remaining_s"] == 0.0
    assert agent.fields["fail_safe"] == 1.0
    assert len(_of(sink.points, "gpu_health")) == 4
    await row.stop()
