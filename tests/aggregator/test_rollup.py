"""Row rollups: fresh, stale, offline and unknown nodes; meters; the power trend."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polca.aggregator.config import NodeSpec, RackSpec, RowSpec
from polca.aggregator.rollup import RowTracker
from polca.telemetry.schema import GpuTelemetry, Meter, Status, Telemetry

STALE_S = 5.0


def _row(meter: bool = False) -> RowSpec:
    return RowSpec(
        name="row1",
        budget_w=20_000,
        meter_topic="polca/v1/dc1/row1/meter" if meter else None,
        meter_max_age_s=2.0,
        racks=(
            RackSpec(
                name="r1",
                budget_w=9_000,
                nodes=(
                    NodeSpec(name="n1", non_gpu_w=500, non_gpu_factor=0.1),
                    NodeSpec(name="n2", non_gpu_w=500),
                ),
            ),
            RackSpec(name="r2", nodes=(NodeSpec(name="n3", nameplate_w=6_000),)),
        ),
    )


def _telemetry(node: str, gpu_w: float, *, limit_w: float = 700.0, temp_c: float = 60) -> Telemetry:
    gpus = tuple(
        GpuTelemetry(
            index=i,
            uuid=f"GPU-{node}-{i}",
            name="H100",
            power_mean_w=gpu_w / 4,
            enforced_power_limit_w=limit_w,
            gpu_temp_c=temp_c + i,
        )
        for i in range(4)
    )
    return Telemetry(
        ts_ns=1,
        seq=1,
        node=node,
        interval_s=1,
        node_gpu_power_w=gpu_w,
        node_energy_delta_j=gpu_w,
        gpus=gpus,
    )


def test_fresh_nodes_add_non_gpu_power_and_factor() -> None:
    """Fresh power = GPU power x (1 + factor) + non-GPU base, summed per rack and row."""
    tracker = RowTracker(_row())
    tracker.ingest_telemetry("n1", _telemetry("n1", 2000), now_s=0)
    tracker.ingest_telemetry("n2", _telemetry("n2", 1000), now_s=0)
    tracker.ingest_telemetry("n3", _telemetry("n3", 1500), now_s=0)
    roll = tracker.rollup(1.0, stale_after_s=STALE_S)
    r1 = roll.racks[0]
    assert r1.power_w == pytest.approx(2000 * 1.1 + 500 + 1000 + 500)
    assert roll.power_w == pytest.approx(r1.power_w + 1500)
    assert roll.power_source == "computed"
    assert roll.fresh_nodes == ("n1", "n2", "n3")
    assert roll.all_reported
    assert r1.gpu_temp_max_c == 63
    assert roll.energy_j == pytest.approx(4500)


def test_stale_offline_and_unknown_nodes_count_at_nameplate() -> None:
    """Silent or offline nodes count at their limits (or configured nameplate), never at 0."""
    tracker = RowTracker(_row())
    tracker.ingest_telemetry("n1", _telemetry("n1", 2000, limit_w=700), now_s=0)
    tracker.ingest_telemetry("n2", _telemetry("n2", 1000, limit_w=500), now_s=0)
    tracker.ingest_status("n2", Status(ts_ns=2, state="offline", node="n2"))
    roll = tracker.rollup(STALE_S + 1, stale_after_s=STALE_S)
    assert roll.stale_nodes == ("n1",)
    assert roll.offline_nodes == ("n2", "n3")  # n3 never reported
    assert not roll.all_reported
    n1 = 4 * 700 * 1.1 + 500
    n2 = 4 * 500 + 500
    assert roll.racks[0].power_w == pytest.approx(n1 + n2)
    assert roll.racks[1].power_w == pytest.approx(6000)  # configured nameplate
    assert roll.racks[0].nodes_stale == 1
    assert roll.racks[0].nodes_offline == 1


def test_fresh_meter_wins_and_stale_meter_is_ignored() -> None:
    """A meter reading replaces the computed row power only while it is fresh."""
    tracker = RowTracker(_row(meter=True))
    tracker.ingest_telemetry("n1", _telemetry("n1", 2000), now_s=0)
    tracker.ingest_meter(Meter(ts_ns=1, power_w=15_000), now_s=0)
    fresh = tracker.rollup(1.0, stale_after_s=STALE_S)
    assert fresh.power_w == 15_000
    assert fresh.power_source == "meter"
    assert fresh.measured_power_w == 15_000
    old = tracker.rollup(3.5, stale_after_s=STALE_S)
    assert old.power_source == "computed"
    assert old.power_w == pytest.approx(old.computed_power_w)


def test_trend_is_the_least_squares_slope() -> None:
    """A steady ramp of 100 W/s in the meter shows as a +100 W/s trend."""
    tracker = RowTracker(_row(meter=True))
    for step in range(12):
        t = step * 0.5
        tracker.ingest_meter(Meter(ts_ns=1, power_w=10_000 + 100 * t), now_s=t)
        tracker.rollup(t, stale_after_s=STALE_S)
    assert tracker.trend_w_per_s(5.5, 5.0) == pytest.approx(100.0)
    assert RowTracker(_row()).trend_w_per_s(0, 5.0) is None


def test_meter_far_below_node_telemetry_is_not_trusted() -> None:
    """A 0 W meter reading while the nodes report 21 kW of GPUs leaves the computed power;
    a plausible reading right after it is only a floor under the computed power (held)."""
    tracker = RowTracker(_row(meter=True))
    for node in ("n1", "n2", "n3"):
        tracker.ingest_telemetry(node, _telemetry(node, 7_000), now_s=0)
    tracker.ingest_meter(Meter(ts_ns=1, power_w=0.0), now_s=0)
    rollup = tracker.rollup(0.5, stale_after_s=STALE_S)
    assert rollup.power_source == "computed"
    assert rollup.power_w == rollup.computed_power_w > 21_000
    assert rollup.meter is not None
    assert rollup.meter.verdict == "under_reading"
    tracker.rollup(0.6, stale_after_s=STALE_S)
    assert tracker.witness.refusals["under_reading"] == 1  # once per reading, not per step
    tracker.ingest_meter(Meter(ts_ns=2, power_w=21_000.0), now_s=1)
    held = tracker.rollup(1.5, stale_after_s=STALE_S)
    assert held.meter is not None
    assert held.meter.verdict == "held"
    assert held.power_w == held.computed_power_w  # the larger of the two
    tracker.ingest_meter(Meter(ts_ns=3, power_w=21_001.0), now_s=31)
    used = tracker.rollup(31.0, stale_after_s=STALE_S)
    assert used.power_source == "meter"
    assert used.power_w == 21_001.0


def test_a_node_cannot_under_report_by_contradicting_itself() -> None:
    """A node summing its GPUs to 0 W while each GPU reports 500 W counts its GPUs' sum."""
    tracker = RowTracker(_row())
    honest = _telemetry("n2", 2_000)
    lying = honest.model_copy(update={"node_gpu_power_w": 0.0})
    tracker.ingest_telemetry("n2", lying, now_s=0)
    rack = tracker.rollup(0.5, stale_after_s=STALE_S).racks[0]
    assert rack.power_w >= 2_000 + 500  # its GPUs' 2 kW plus non-GPU power


@settings(max_examples=200, deadline=None)
@given(
    readings=st.lists(
        st.tuples(st.sampled_from(["n1", "n2", "n3"]), st.floats(min_value=0, max_value=4000)),
        max_size=30,
    )
)
def test_estimate_between_steps_is_the_rollup_of_the_same_readings(
    readings: list[tuple[str, float]],
) -> None:
    """The running estimate that wakes the step equals the computed power a step would see."""
    tracker = RowTracker(_row())
    tracker.rollup(0.0, stale_after_s=STALE_S)  # every node unknown: counted at nameplate
    for node, gpu_w in readings:
        tracker.ingest_telemetry(node, _telemetry(node, gpu_w), now_s=1.0)
        estimate = tracker.estimate_w
        assert estimate == pytest.approx(
            tracker.rollup(1.0, stale_after_s=STALE_S).computed_power_w, abs=1e-6
        )


def test_crossing_the_armed_threshold_reports_once_per_arming() -> None:
    """Meter or telemetry over the threshold: True the first time only; re-armed by a step."""
    tracker = RowTracker(_row(meter=True))
    assert not tracker.ingest_meter(Meter(ts_ns=1, power_w=19_000), now_s=0)  # not armed yet
    tracker.arm(16_000.0)
    assert not tracker.ingest_meter(Meter(ts_ns=1, power_w=15_000), now_s=0.1)
    assert tracker.ingest_meter(Meter(ts_ns=1, power_w=16_000), now_s=0.2)
    assert not tracker.ingest_meter(Meter(ts_ns=1, power_w=17_000), now_s=0.3)
    tracker.rollup(0.4, stale_after_s=STALE_S)
    tracker.arm(8_000.0)
    assert not tracker.ingest_telemetry("n1", _telemetry("n1", 1000), now_s=0.5).urgent
    # n2 never reported (0 W) and n3 is counted at its nameplate (6,000 W)
    assert tracker.estimate_w == pytest.approx(1000 * 1.1 + 500 + 6_000)
    assert tracker.ingest_telemetry("n2", _telemetry("n2", 1000), now_s=0.6).urgent
    assert not tracker.ingest_telemetry("n2", _telemetry("n2", 2000), now_s=0.7).urgent


def test_a_partial_meter_reading_is_never_the_rows_power() -> None:
    """A row whose B feed's PDU failed falls back to its computed power at once, says why,
    and takes the meter again at its next whole reading."""
    tracker = RowTracker(_row(meter=True))
    for node in ("n1", "n2", "n3"):
        tracker.ingest_telemetry(node, _telemetry(node, 1_000), now_s=0)
    tracker.ingest_meter(Meter(ts_ns=1, power_w=9_000.0), now_s=0)
    assert tracker.rollup(0.5, stale_after_s=STALE_S).power_source == "meter"
    half = Meter(ts_ns=2, power_w=4_500.0, sources=1, partial=True, missing={"pdu-b": "timeout"})
    tracker.arm(1_000.0)
    assert tracker.ingest_meter(half, now_s=1) is False  # a partial reading never escalates
    rollup = tracker.rollup(1.2, stale_after_s=STALE_S)
    assert rollup.power_source == "computed"
    assert rollup.power_w == rollup.computed_power_w
    assert rollup.meter_partial == "pdu-b: timeout"
    assert tracker.meter_partial == 1
    later = tracker.rollup(5.0, stale_after_s=STALE_S)  # the partial reading is old now
    assert later.meter_partial is None
    tracker.ingest_meter(Meter(ts_ns=3, power_w=9_100.0, sources=2), now_s=6)
    whole = tracker.rollup(6.5, stale_after_s=STALE_S)
    assert whole.power_source == "meter"
    assert whole.power_w == 9_100.0
    assert whole.meter_partial is None
