"""A row's meter as one witness among the nodes (``polca.aggregator.witness`` through
``RowTracker``): refused above what the row can draw, below the nodes' own whole-node power
less the tolerance, and while frozen; held after a refusal so the choice does not flap; one
change per episode; and, fuzzed, never leaving the row below the nodes' own power."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from polca.aggregator.config import (
    AggregatorSettings,
    ControlSettings,
    NodeSpec,
    RackSpec,
    RowSpec,
)
from polca.aggregator.core import AggregatorCore
from polca.aggregator.points import step_points
from polca.aggregator.rollup import RowRollup, RowTracker
from polca.aggregator.witness import MeterWitness, TrustChange, WitnessSettings
from polca.policy import PolicyStore
from polca.telemetry.schema import Event, GpuTelemetry, Meter, RowSummary, Telemetry

POLICY = Path(__file__).resolve().parents[2] / "policies" / "polca-a100.yaml"

STALE_S = 5.0
NON_GPU_W = 1_200.0
GPUS = 8
GPU_MAX_W = 700.0


def _row(
    *, nodes: int = 3, meter_max_w: float | None = None, budget_w: float | None = None
) -> RowSpec:
    """A metered row of H100 nodes with 1,200 W of CPUs, fans and NICs each."""
    return RowSpec(
        name="row1",
        budget_w=budget_w or 12_000 * nodes,
        meter_topic="polca/v1/dc1/row1/meter",
        meter_max_age_s=5.0,
        meter_max_w=meter_max_w,
        racks=(
            RackSpec(
                name="r1",
                nodes=tuple(
                    NodeSpec(
                        name=f"n{i}", non_gpu_w=NON_GPU_W, gpus=GPUS, gpu_max_power_w=GPU_MAX_W
                    )
                    for i in range(nodes)
                ),
            ),
        ),
    )


def _tracker(row: RowSpec, *, hold_s: float = 30.0) -> RowTracker:
    return RowTracker(row, witness=MeterWitness(WitnessSettings(hold_s=hold_s)))


def _telemetry(node: str, gpu_w: float, seq: int = 1) -> Telemetry:
    gpus = tuple(
        GpuTelemetry(index=i, uuid=f"GPU-{node}-{i}", name="H100", power_mean_w=gpu_w / GPUS)
        for i in range(GPUS)
    )
    return Telemetry(
        ts_ns=seq,
        seq=seq,
        node=node,
        interval_s=1,
        node_gpu_power_w=gpu_w,
        node_energy_delta_j=gpu_w,
        gpus=gpus,
    )


def _report(tracker: RowTracker, gpu_w: float, now_s: float) -> None:
    """Every node reports ``gpu_w`` of GPU power."""
    for node in tracker.nodes:
        tracker.ingest_telemetry(node, _telemetry(node, gpu_w, seq=int(now_s) + 1), now_s=now_s)


def _step(tracker: RowTracker, now_s: float, meter_w: float | None) -> RowRollup:
    if meter_w is not None:
        tracker.ingest_meter(Meter(ts_ns=int(now_s * 1e9) + 1, power_w=meter_w), now_s=now_s)
    return tracker.rollup(now_s, stale_after_s=STALE_S)


def test_a_meter_reading_a_quarter_low_leaves_the_row_on_the_nodes_power() -> None:
    """The under-reading meter: it tracks 0.95 x the nodes' GPU power while each node also
    draws 1,200 W beside its GPUs, so it reads about a quarter below the row. It is refused
    at every step: the row runs on its computed power, which crosses what the meter hides."""
    tracker = _tracker(_row())
    for second in range(60):
        gpu_w = 2_000.0 + 60 * second  # the load climbs to near every GPU's maximum
        _report(tracker, gpu_w, float(second))
        rollup = _step(tracker, float(second), 0.95 * gpu_w * 3)
        whole_w = 3 * (gpu_w + NON_GPU_W)
        assert rollup.power_source == "computed"
        assert rollup.power_w == pytest.approx(whole_w)
        assert rollup.meter is not None
        assert rollup.meter.verdict == "under_reading"
        assert "below the nodes' own power" in rollup.power_note
    assert tracker.witness.refusals == {"under_reading": 60}


def test_a_meter_within_the_tolerance_is_believed() -> None:
    """A meter 5% under the nodes' whole-node estimate (their non-GPU power is a guess)
    is the row's power: the tolerance is 1 - meter_min_fraction (10%)."""
    tracker = _tracker(_row())
    _report(tracker, 4_000.0, 0.0)
    rollup = _step(tracker, 0.0, 0.95 * 3 * (4_000 + NON_GPU_W))
    assert rollup.power_source == "meter"
    assert rollup.power_note == ""
    assert rollup.meter_trusted is True


def test_a_wild_reading_is_refused_and_brakes_nothing() -> None:
    """10 MW for a 3-node row (at most 3 x (8 x 700 W x 1.25 + 1,200 W) = 24.6 kW) is
    implausible: the computed power is used, the reading counted once however many steps
    see it; a configured meter_max_w is the bound instead."""
    tracker = _tracker(_row())
    _report(tracker, 3_000.0, 0.0)
    assert tracker.ceiling_w() == pytest.approx(3 * (GPUS * GPU_MAX_W * 1.25 + NON_GPU_W))
    first = _step(tracker, 0.0, 10e6)
    again = tracker.rollup(0.5, stale_after_s=STALE_S)
    for rollup in (first, again):
        assert rollup.power_source == "computed"
        assert rollup.power_w == pytest.approx(3 * (3_000 + NON_GPU_W))
        assert "above what the row can draw" in rollup.power_note
    assert tracker.witness.refusals == {"implausible": 1}
    bounded = _tracker(_row(meter_max_w=15_000))
    _report(bounded, 3_000.0, 0.0)
    assert _step(bounded, 0.0, 16_000).meter.verdict == "implausible"  # type: ignore[union-attr]
    _report(bounded, 3_000.0, 40.0)
    assert _step(bounded, 40.0, 14_000).meter.verdict == "used"  # type: ignore[union-attr]


def test_a_node_never_heard_from_counts_at_the_intakes_maximum_in_the_ceiling() -> None:
    """Before a node reports, the ceiling holds it at the most a node may draw (the
    topology's GPUs and maximum here), so a true reading is not refused for its silence."""
    tracker = _tracker(_row())
    assert tracker.ceiling_w() == pytest.approx(3 * (GPUS * GPU_MAX_W * 1.25 + NON_GPU_W))
    undeclared = RowTracker(
        RowSpec(
            name="row1",
            budget_w=10_000,
            meter_topic="m",
            racks=(RackSpec(name="r1", nodes=(NodeSpec(name="n0", non_gpu_w=100),)),),
        )
    )
    assert undeclared.ceiling_w() == pytest.approx(8 * 1400 * 1.25 + 100)


def test_a_frozen_meter_is_refused_until_its_value_moves() -> None:
    """A PDU card that hangs answers its last value: ten equal readings while the row's
    computed power rose by more than 5% are frozen, and stay so while the value does not
    move, however the nodes go on; the value moving ends it (then the hold). Equal readings
    while the nodes hold steady are a steady row, not a fault."""
    tracker = _tracker(_row())
    steady_w = 3 * (3_000 + NON_GPU_W)
    for second in range(15):
        _report(tracker, 3_000.0, float(second))
        assert _step(tracker, float(second), steady_w).power_source == "meter"
    verdicts = []
    for second in range(15, 30):
        gpu_w = 3_000.0 + 100 * min(second - 14, 3)  # +7%: moved, yet above the floor
        _report(tracker, gpu_w, float(second))
        rollup = _step(tracker, float(second), steady_w)
        verdicts.append(rollup.meter.verdict if rollup.meter else None)
        if verdicts[-1] == "frozen":
            assert rollup.power_w == rollup.computed_power_w
    assert verdicts[:2] == ["used", "used"]  # within 5% of where the run began
    assert verdicts[-1] == "frozen"
    _report(tracker, 3_300.0, 30.0)
    moved = _step(tracker, 30.0, 3 * (3_300 + NON_GPU_W) + 7)
    assert moved.meter is not None
    assert moved.meter.verdict == "held"


def test_the_choice_does_not_flap_and_each_episode_is_one_change() -> None:
    """A meter hovering around the floor: refused below it, held above it, so the row stays
    on (at least) its computed power instead of switching every reading. One
    meter_distrusted when the episode starts (and one for a new reason in it), one
    meter_trusted when the meter is used again after the hold."""
    tracker = _tracker(_row(), hold_s=30.0)
    whole_w = 3 * (4_000 + NON_GPU_W)
    changes: list[TrustChange] = []
    powers: list[float] = []
    for second in range(40):
        _report(tracker, 4_000.0, float(second))
        reading = whole_w * (0.92 if second % 2 else 0.85)  # under the floor every other one
        rollup = _step(tracker, float(second), reading)
        changes.extend(rollup.meter_changes)
        powers.append(rollup.power_w)
    assert all(p == pytest.approx(whole_w) for p in powers)
    assert [c.event for c in changes] == ["meter_distrusted"]
    assert changes[0].fields["reason"] == "under_reading"
    _report(tracker, 4_000.0, 40.0)
    wild = _step(tracker, 40.0, 1e7)
    assert [c.fields["reason"] for c in wild.meter_changes] == ["implausible"]
    for second in range(41, 70):
        _report(tracker, 4_000.0, float(second))
        rollup = _step(tracker, float(second), whole_w * 0.97)
        assert rollup.meter is not None
        assert rollup.meter.verdict == "held"
        assert rollup.power_w == pytest.approx(whole_w)
    _report(tracker, 4_000.0, 70.0)
    trusted = _step(tracker, 70.0, whole_w * 0.97)  # 30 s after the last refusal
    assert trusted.power_source == "meter"
    assert [c.event for c in trusted.meter_changes] == ["meter_trusted"]
    assert trusted.meter_changes[0].fields["reasons"] == ["implausible", "under_reading"]
    assert trusted.meter_trusted is True


def test_control_settings_carry_the_witness_settings() -> None:
    """The meter_* control settings are what each row's witness applies."""
    control = ControlSettings(
        meter_min_fraction=0.8,
        meter_hold_s=5,
        meter_frozen_readings=4,
        meter_frozen_change_fraction=0.1,
    )
    assert control.witness() == WitnessSettings(0.8, 5.0, 4, 0.1)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=5_600),  # each node's GPU power
            st.one_of(
                st.none(),  # no reading this step
                st.floats(min_value=0, max_value=1e12),  # anything the wire allows
                st.sampled_from([0.0, 1.0, 20_000.0, 1e7]),
            ),
        ),
        min_size=1,
        max_size=60,
    )
)
def test_no_sequence_of_meter_readings_leaves_the_row_below_the_nodes_power(
    steps: list[tuple[float, float | None]],
) -> None:
    """Whatever the meter sends, the row's power is never below what its nodes report for
    the whole node less the tolerance, nor above the row's ceiling by the meter's word."""
    tracker = _tracker(_row())
    ceiling_w = tracker.ceiling_w()
    for second, (gpu_w, meter_w) in enumerate(steps):
        _report(tracker, gpu_w, float(second))
        rollup = _step(tracker, float(second), meter_w)
        reported_w = 3 * (gpu_w + NON_GPU_W)
        assert rollup.power_w >= 0.9 * reported_w - 1e-6
        assert rollup.power_w <= max(ceiling_w, rollup.computed_power_w) + 1e-6


def test_a_step_publishes_writes_and_summarises_the_meters_standing(tmp_path: Path) -> None:
    """Through the aggregator's core: an under-reading meter gives one ``meter_distrusted``
    audit event (then none while the episode lasts), the summary's power_note, a row point
    with meter_trusted 0 and the refusal count, and an annotation point."""
    settings = AggregatorSettings(
        site="dc1",
        instance="agg",
        policy_file=POLICY,
        state_dir=tmp_path,
        rows=[_row().model_dump()],
        control={"warmup_s": 0.0, "stale_after_s": 5.0, "lease_s": 10.0},
    )
    store = PolicyStore(POLICY)
    store.reload()
    core = AggregatorCore(settings, policy_store=store, epoch_ns=1, log=structlog.get_logger())
    core.rows.start(0.0)
    tracker = core.rows.trackers["row1"]
    published: list[Event] = []
    annotations: list[list[str]] = []
    for second in (1, 2):
        _report(tracker, 4_000.0, float(second))
        tracker.ingest_meter(Meter(ts_ns=second, power_w=0.9 * 3 * 4_000), float(second))
        stepped = core.step(float(second), now_ns=second, now_mono_ns=second * 10**9)
        assert stepped is not None
        published += [
            Event.model_validate_json(m.payload)
            for m in stepped.messages
            if m.topic.endswith("/events")
        ]
        (summary,) = [
            RowSummary.model_validate_json(m.payload)
            for m in stepped.messages
            if m.topic.endswith("/summary")
        ]
        assert summary.power_source == "computed"
        assert "below the nodes' own power" in summary.power_note
        written = step_points(stepped.result, site="dc1", instance="agg")
        annotations.append([p.tags["kind"] for p in written if p.measurement == "event"])
    assert [e.event for e in published] == ["meter_distrusted"]
    assert published[0].detail["row"] == "row1"
    assert published[0].detail["reason"] == "under_reading"
    assert annotations == [["meter_distrusted"], []]
    (row_point,) = [p for p in written if p.measurement == "row"]
    assert row_point.fields["meter_trusted"] == 0.0
    assert row_point.fields["meter_refusals"] == 2


_METER = st.one_of(
    st.none(),  # no reading this step
    st.tuples(st.just("W"), st.floats(min_value=0, max_value=1e12)),  # any figure
    st.tuples(st.just("x GPU"), st.floats(min_value=0, max_value=1.5)),  # near the nodes'
    st.tuples(st.just("x GPU"), st.floats(min_value=0.85, max_value=1.1)),  # GPUs' alone
)
_GPU_W = st.one_of(st.floats(min_value=0, max_value=5_600), st.floats(4_000, 5_600))
"""Each node's GPU power: anywhere, and often where the nodes' floor crosses a threshold."""


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(_GPU_W, _METER), min_size=1, max_size=20))
def test_no_meter_sequence_leaves_the_row_below_the_level_its_nodes_call_for(
    tmp_path_factory: pytest.TempPathFactory,
    steps: list[tuple[float, tuple[str, float] | None]],
) -> None:
    """The whole control step, fuzzed: whatever the meter reads, the level decided is at
    least the one the nodes' own whole-node power less the tolerance calls for (an 18 kW
    budget: the nodes' floor crosses T1 from 4.1 kW a node's GPUs, the brake from 5.3 kW)."""
    settings_ = AggregatorSettings(
        site="dc1",
        instance="agg",
        policy_file=POLICY,
        state_dir=tmp_path_factory.mktemp("agg"),
        rows=[_row(budget_w=18_000.0).model_dump()],
        control={"warmup_s": 0.0, "stale_after_s": 5.0, "lease_s": 10.0},
    )
    store = PolicyStore(POLICY)
    store.reload()
    core = AggregatorCore(settings_, policy_store=store, epoch_ns=1, log=structlog.get_logger())
    core.rows.start(0.0)
    tracker = core.rows.trackers["row1"]
    for i, (gpu_w, meter) in enumerate(steps):
        now_s = 1.0 + i
        _report(tracker, gpu_w, now_s)
        meter_w = None
        if meter is not None:
            unit, value = meter
            meter_w = value if unit == "W" else value * 3 * gpu_w  # x the nodes' GPU power
            tracker.ingest_meter(Meter(ts_ns=i + 1, power_w=meter_w), now_s)
        stepped = core.step(now_s, now_ns=i + 1, now_mono_ns=int(now_s * 1e9))
        assert stepped is not None
        decision = stepped.result.rows[0].decision
        floor_w = 0.9 * 3 * (gpu_w + NON_GPU_W)
        called_for = sum(1 for threshold_w in decision.thresholds_w if floor_w >= threshold_w)
        assert decision.level >= called_for, (gpu_w, meter_w, decision.thresholds_w)
