"""Thinning: the write intervals applied to a node's telemetry and to a step's points."""

from __future__ import annotations

from polca.export.points import make_point
from polca.export.schedule import Thinning
from polca.telemetry.schema import GpuHealthReport, GpuTelemetry, Telemetry


def _telemetry(node: str, *, xids: int | None = None, ts_ns: int = 1) -> Telemetry:
    health = GpuHealthReport(xid_errors=xids) if xids is not None else None
    return Telemetry(
        ts_ns=ts_ns,
        seq=1,
        node=node,
        interval_s=1,
        node_gpu_power_w=400.0,
        node_energy_delta_j=1,
        gpus=tuple(
            GpuTelemetry(
                index=i, uuid=f"GPU-{node}-{i}", name="A100", power_mean_w=200.0, health=health
            )
            for i in range(2)
        ),
    )


def _batches(thinning: Thinning, telemetry: Telemetry, now_s: float) -> list[list[str]]:
    out = thinning.telemetry_batches(
        telemetry, node=telemetry.node, site="dc1", row="row1", rack="r1", now_s=now_s
    )
    return [[p.measurement for p in batch] for batch in out]


def test_gpu_points_are_written_once_per_interval_per_node() -> None:
    """10 s for ``gpu``: the first message writes, the next ones within 9 s do not."""
    thinning = Thinning({"gpu": 10.0})
    assert _batches(thinning, _telemetry("n1"), 0.0) == [["gpu", "gpu"]]
    assert _batches(thinning, _telemetry("n1"), 5.0) == []
    assert _batches(thinning, _telemetry("n2"), 5.0) == [["gpu", "gpu"]]
    assert _batches(thinning, _telemetry("n1"), 9.0) == [["gpu", "gpu"]]


def test_health_counters_that_come_early_wait_for_the_next_due_message() -> None:
    """``gpu_health`` at most once a second per node, in its own batch before the GPU
    points; counters arriving sooner are written with the next due message, never lost."""
    thinning = Thinning({})
    first = thinning.telemetry_batches(
        _telemetry("n1", xids=1), node="n1", site="dc1", row="row1", rack="r1", now_s=0.0
    )
    assert [[p.measurement for p in b] for b in first] == [["gpu_health"] * 2, ["gpu"] * 2]
    assert _batches(thinning, _telemetry("n1", xids=2), 0.5) == [["gpu", "gpu"]]
    assert _batches(thinning, _telemetry("n1"), 0.7) == [["gpu", "gpu"]]
    late = thinning.telemetry_batches(
        _telemetry("n1", ts_ns=9), node="n1", site="dc1", row="row1", rack="r1", now_s=1.0
    )
    health = late[0]
    assert [p.measurement for p in health] == ["gpu_health", "gpu_health"]
    assert {p.fields["xid_errors"] for p in health} == {2}  # the counters that waited
    assert _batches(thinning, _telemetry("n1"), 2.5) == [["gpu", "gpu"]]  # nothing waits


def test_a_steps_points_are_thinned_per_measurement_all_or_none() -> None:
    """One decision per measurement and step: every ``row`` point or none; measurements
    without an interval are always written."""
    thinning = Thinning({"row": 5.0})

    def step(now_s: float) -> list[str]:
        points = [
            make_point("row", ts_ns=1, tags={"site": "dc1", "row": row}, fields={"power_w": 1.0})
            for row in ("row1", "row2")
        ]
        points.append(
            make_point("aggregator", ts_ns=1, tags={"site": "dc1", "instance": "agg"}, fields={})
        )
        return [p.measurement for p in thinning.step_points(points, now_s)]

    assert step(0.0) == ["row", "row", "aggregator"]
    assert step(1.0) == ["aggregator"]
    assert step(4.5) == ["row", "row", "aggregator"]
