"""One node cannot take down, brake or starve its row (``tests/row.py``: one process).

An attacker holding one node's credentials (or a node with a firmware bug) sends
schema-valid lies on that node's topics while the row runs: the aggregator's control step
never raises, the row's level stays what the honest load calls for (the liar counted at
most at what it can draw), and every anomaly is counted. A step that fails for any reason
publishes nothing and is retried from the last good state. The same scenarios run against
real processes and a real Mosquitto in ``tests/integration/test_hostile_nodes_e2e.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from polca.aggregator import messages
from polca.aggregator.config import AggregatorSettings
from polca.aggregator.intake import node_shard
from polca.telemetry.memory import MemoryBus
from polca.telemetry.messages import OutMessage
from polca.telemetry.schema import (
    GpuHealthReport,
    GpuTelemetry,
    RowSummary,
    Status,
    Telemetry,
    encode,
)
from tests.row import ROW, SITE, Row

BUDGET_W = 4 * 4 * 400.0  # 2 racks x 2 nodes x 4 A100s at their 400 W limit
BASE = f"polca/v1/{SITE}/{ROW}"


def _row(tmp_path: Path, **kwargs: object) -> Row:
    racks = {"rack1": ["n1", "n2"], "rack2": ["n3", "n4"]}
    return Row(tmp_path, racks=racks, budget_w=BUDGET_W, **kwargs)  # type: ignore[arg-type]


def _lie(node: str, *, node_w: float, gpus: int = 4, limit_w: float = 400.0) -> bytes:
    return encode(
        Telemetry(
            ts_ns=time.time_ns(),
            seq=1,
            node=node,
            interval_s=0.5,
            node_gpu_power_w=node_w,
            node_energy_delta_j=1e12,
            gpus=tuple(
                GpuTelemetry(
                    index=i,
                    uuid=f"GPU-{node}-{i}",
                    name="NVIDIA A100-SXM4-80GB",
                    power_mean_w=min(node_w / max(gpus, 1), 1e7),
                    enforced_power_limit_w=limit_w,
                    power_limit_w=limit_w,
                )
                for i in range(gpus)
            ),
        )
    )


def _summary(row: Row) -> RowSummary:
    row.deliver()
    topic = f"{BASE}/summary"
    last = [m for m in row.seen if m.topic == topic][-1]
    return RowSummary.model_validate_json(last.payload)


def _levels_published(row: Row) -> set[int]:
    return {c.level for c in row.controls()}


@pytest.mark.parametrize("node_w", [1e7, 9e6])
async def test_a_node_claiming_megawatts_neither_crashes_nor_brakes_the_row(
    tmp_path: Path, node_w: float
) -> None:
    """10 MW (the wire's maximum) and 9 MW from n4, every step: the row stays nominal."""
    row = _row(tmp_path)
    await row.start()
    await row.run(3)
    honest = _summary(row).power_w
    for _ in range(20):
        row.probe.publish_nowait(
            OutMessage(f"{BASE}/rack2/n4/telemetry", _lie("n4", node_w=node_w))
        )
        await row.step()
    summary = _summary(row)
    assert summary.implausible_nodes == ("n4",)
    assert _levels_published(row) == {0}
    assert all(level == 0 for level in row.levels().values())
    # n4 counts at most 4 A100s at 400 W plus headroom, however much it claims.
    assert summary.power_w <= honest + 4 * 400 * 1.25
    assert row.aggregator.step_failures.total == 0
    assert row.aggregator.intake.implausible["power"] >= 20
    await row.stop()


async def test_a_lie_then_a_retained_offline_status_does_not_hold_the_row_at_brake(
    tmp_path: Path,
) -> None:
    """1,024 GPUs at 9 kW limits from a node never heard from, then a retained offline
    status: counted at its declared bound (4 x 400 W + headroom), not at 9.2 MW."""
    row = _row(tmp_path, node_specs={"n4": {"gpus": 4, "gpu_max_power_w": 400.0}})
    del row.nodes["n4"]  # its agent never runs: only the liar speaks for it
    row.probe.publish_nowait(
        OutMessage(f"{BASE}/rack2/n4/telemetry", _lie("n4", node_w=9e6, gpus=1024, limit_w=9_000.0))
    )
    offline = encode(Status(ts_ns=time.time_ns(), state="offline", node="n4"))
    row.probe.publish_nowait(OutMessage(f"{BASE}/rack2/n4/status", offline, qos=1, retain=True))
    await row.start()
    await row.run(30)
    summary = _summary(row)
    assert summary.offline_nodes == ("n4",)
    rack2 = next(r for r in summary.racks if r.rack == "rack2")
    n3_w = sum(s.power_mw or 0 for s in row.nodes["n3"].agent.core.latest.values()) / 1000
    assert rack2.power_w <= n3_w + 4 * 400 * 1.25 + 1
    assert _levels_published(row) == {0}
    await row.stop()


async def test_a_budget_beyond_a_node_message_makes_no_step_raise(tmp_path: Path) -> None:
    """A 20 MW row metered at 15 MW: the summary carries it (no step raises)."""
    row = _row(tmp_path, meter_pct=75.0)
    row.budget_w = 2e7
    row.aggregator = row._new_aggregator()
    await row.start()
    await row.run(3)
    summary = _summary(row)
    assert summary.power_w == pytest.approx(1.5e7)
    assert summary.budget_w == 2e7
    assert row.aggregator.step_failures.total == 0
    await row.stop()


def test_a_budget_beyond_the_wire_bounds_is_refused_at_load(tmp_path: Path) -> None:
    """Budgets above 1 GW are refused with the field named, not failed at every step."""
    with pytest.raises(ValidationError, match=r"rows\.0\.budget_w"):
        AggregatorSettings(
            policy_file=tmp_path / "policy.yaml",
            rows=[
                {"name": "r", "budget_w": 2e9, "racks": [{"name": "k", "nodes": [{"name": "n"}]}]}
            ],
        )


async def test_a_step_that_fails_publishes_nothing_and_resumes_from_the_last_good_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The meter jumps to the brake level, and building the summary raises: no control at
    the brake level goes out, the failure is logged with its traceback and counted, the
    ladders are as before; once the fault clears, the next step brakes as it should."""
    row = _row(tmp_path, meter_pct=50.0)
    await row.start()
    await row.run(3)
    published = len(row.controls())
    level_before = row.aggregator.rows.controllers[(ROW, None)].published_level
    seq_before = row.aggregator.rows.controllers[(ROW, None)].seq

    def broken(*args: object, **kwargs: object) -> OutMessage:
        msg = "a summary that cannot be built"
        raise RuntimeError(msg)

    monkeypatch.setattr(messages, "summary", broken)
    row.meter_pct = 120.0
    with capture_logs() as logs:
        for _ in range(4):
            await row.step()
    assert len(row.controls()) == published  # not one control went out
    controller = row.aggregator.rows.controllers[(ROW, None)]
    assert (controller.published_level, controller.seq) == (level_before, seq_before)
    assert row.aggregator.step_failures.total >= 4
    failures = [e for e in logs if e["event"] == "control_step_failed"]
    assert len(failures) == 1  # the first with its traceback; the rest counted
    assert failures[0]["exc_info"] is not None
    monkeypatch.undo()
    await row.step()
    top = len(row.aggregator.policy.policy.levels)
    assert row.controls()[-1].level == top
    assert all(level == top for level in row.levels().values())
    await row.stop()


async def test_gpu_health_points_obey_their_write_interval(tmp_path: Path) -> None:
    """A node sending health counters on every message gets one gpu_health write a second."""
    row = _row(tmp_path)  # gpu_health is thinned to 1 s unless configured otherwise
    await row.start()
    await row.run(1)
    before = len(row.sink.measurement("gpu_health"))
    payload = Telemetry.model_validate_json(_lie("n4", node_w=800.0))
    report = GpuHealthReport(xid_errors=1)
    gpus = tuple(g.model_copy(update={"health": report}) for g in payload.gpus)
    with_health = encode(payload.model_copy(update={"gpus": gpus}))
    for _ in range(4):  # 4 messages within one step
        row.probe.publish_nowait(OutMessage(f"{BASE}/rack2/n4/telemetry", with_health))
    await row.step(0.5)
    for _ in range(4):
        row.probe.publish_nowait(OutMessage(f"{BASE}/rack2/n4/telemetry", with_health))
    await row.step(0.5)
    written = len(row.sink.measurement("gpu_health")) - before
    assert 0 < written <= 2 * 4  # at most one write per second of n4's 4 GPUs
    await row.stop()


async def test_a_flooding_node_is_moved_to_a_connection_of_its_own(tmp_path: Path) -> None:
    """Past intake.quarantine_after refusals, n4's topics leave the connection it shared
    (its neighbours' readings get through the broker again) for the quarantine one, where
    its readings still count; the move is logged, published and in its node point."""
    row = _row(tmp_path)
    await row.start()
    await row.run(2)
    agg = row.aggregator
    shared = agg.intake_buses[node_shard("n4", agg.settings.intake.connections)]
    quarantine = agg.intake_buses["quarantine"]
    topic = f"{BASE}/rack2/n4/telemetry"
    assert isinstance(shared, MemoryBus)
    assert isinstance(quarantine, MemoryBus)
    assert shared.subscribed_to(topic)
    assert not quarantine.subscribed_to(topic)
    before = shared.filters
    payload = _lie("n4", node_w=800.0)
    with capture_logs() as logs:
        for _ in range(agg.settings.intake.quarantine_after + 20):
            row.probe.publish_nowait(OutMessage(topic, payload))
        row.deliver()
    assert [e["node"] for e in logs if e["event"] == "node_quarantined"] == ["n4"]
    assert not shared.subscribed_to(topic)
    assert quarantine.subscribed_to(topic)
    assert quarantine.subscribed_to(f"{BASE}/rack2/n4/status")
    # The neighbours' topics stay where they were: only n4's left.
    assert shared.filters == tuple(f for f in before if "/n4/" not in f)
    assert len(shared.filters) == len(before) - 3
    received = agg.intake.messages_in
    await row.run(2)  # n4's agent goes on: its readings arrive through the quarantine
    assert agg.intake.messages_in > received
    assert agg.rows.trackers[ROW].nodes["n4"].received_s == pytest.approx(row.clock.seconds())
    events = [m for m in row.seen if m.topic.endswith("/aggregator/agg/events")]
    assert any(b"node_quarantined" in m.payload for m in events)
    (point,) = [p for p in row.sink.measurement("node")[-4:] if p.tags["node"] == "n4"]
    assert point.fields["quarantined"] == 1.0
    await row.stop()
