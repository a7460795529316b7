"""The control step driven directly: readings and time in, a ``StepResult`` out (no shell)."""

from __future__ import annotations

from pathlib import Path

import pytest

from polca.aggregator.config import AggregatorSettings
from polca.aggregator.step import RowControl
from polca.policy import LoadedPolicy, PolicyStore
from polca.telemetry.schema import (
    CduTelemetry,
    Control,
    CoolantConnector,
    GpuTelemetry,
    Meter,
    Status,
    Telemetry,
)

POLICY = Path(__file__).resolve().parents[2] / "policies" / "polca-a100.yaml"
BUDGET_W = 10_000.0
EPOCH_NS = 1_000
T0_S = 100.0  # the aggregator starts at this monotonic time


@pytest.fixture
def policy() -> LoadedPolicy:
    """The published A100 policy: T1 at 80%, T2 at 89%, brake at 98%."""
    store = PolicyStore(POLICY)
    store.reload()
    assert store.current is not None
    return store.current


def _rows(tmp_path: Path, **control: float) -> RowControl:
    settings = AggregatorSettings(
        site="dc1",
        instance="agg",
        policy_file=POLICY,
        state_dir=tmp_path,
        rows=[
            {
                "name": "row1",
                "budget_w": BUDGET_W,
                "racks": [
                    {"name": "r1", "budget_w": 6_000.0, "nodes": [{"name": "n1"}, {"name": "n2"}]}
                ],
            }
        ],
        control={"warmup_s": 5.0, "stale_after_s": 5.0, "lease_s": 10.0, **control},
        cooling={
            "loops": [
                {
                    "name": "loop1",
                    "cdu": "cdu1",
                    "racks": ["r1"],
                    "heat_capacity_kw": 40,
                    "design_flow_lpm": 100,
                }
            ]
        },
    )
    rows = RowControl(settings, epoch_ns=EPOCH_NS)
    rows.start(T0_S)
    return rows


def _meter(rows: RowControl, power_w: float, now_s: float) -> None:
    rows.trackers["row1"].ingest_meter(Meter(ts_ns=1, power_w=power_w), now_s)


def _telemetry(node: str, power_w: float, *, gpus: int = 4) -> Telemetry:
    """``power_w`` over ``gpus`` GPUs of a 400 W limit (plausible up to 1,600 W)."""
    return Telemetry(
        ts_ns=1,
        seq=1,
        node=node,
        interval_s=1,
        node_gpu_power_w=power_w,
        node_energy_delta_j=1,
        gpus=tuple(
            GpuTelemetry(
                index=i,
                uuid=f"GPU-{node}-{i}",
                name="A100",
                power_mean_w=power_w / gpus,
                power_limit_w=400.0,
                enforced_power_limit_w=400.0,
            )
            for i in range(gpus)
        ),
    )


def test_nothing_is_decided_while_warming_up_unless_every_node_reported(
    tmp_path: Path, policy: LoadedPolicy
) -> None:
    """A restarted aggregator never uncaps a row for lack of data: no result before
    ``warmup_s`` unless every node has reported; then one, with the row at nominal."""
    rows = _rows(tmp_path)
    assert rows.step(T0_S + 1, 1, policy) is None
    rows.trackers["row1"].ingest_telemetry("n1", _telemetry("n1", 1_000.0), T0_S + 1)
    assert rows.step(T0_S + 2, 2, policy) is None  # n2 has not reported
    rows.trackers["row1"].ingest_telemetry("n2", _telemetry("n2", 1_000.0), T0_S + 2)
    result = rows.step(T0_S + 3, 3, policy)
    assert result is not None
    assert rows.warm
    assert result.now_ns == 3
    (row,) = result.rows
    assert row.rollup.power_w == pytest.approx(2_000.0)
    assert row.decision.level == 0
    assert {n.node for n in row.nodes} == {"n1", "n2"}


def test_the_warmup_ends_at_its_time_even_with_nodes_missing(
    tmp_path: Path, policy: LoadedPolicy
) -> None:
    """``warmup_s`` after ``start`` the step decides with what it has (counted from the
    start time passed in, not a clock)."""
    rows = _rows(tmp_path)
    _meter(rows, 5_000.0, T0_S + 4)
    assert rows.step(T0_S + 4.9, 1, policy) is None
    result = rows.step(T0_S + 5.0, 2, policy)
    assert result is not None
    assert result.rows[0].rollup.power_source == "meter"


def test_a_row_over_t2_gets_t2_with_a_leased_control_per_scope(
    tmp_path: Path, policy: LoadedPolicy
) -> None:
    """92% of the row budget: T2, a control for the row and its budgeted rack, leased for
    ``lease_s`` from the step's wall-clock time; the same power next step: no change."""
    rows = _rows(tmp_path, warmup_s=0.0)
    _meter(rows, 9_200.0, T0_S + 1)
    result = rows.step(T0_S + 1, 5_000, policy)
    assert result is not None
    row = result.rows[0]
    assert (row.decision.level, row.decision.level_name, row.decision.changed) == (2, "T2", True)
    control = row.decision.control
    assert (control.scope, control.row, control.issuer, control.seq) == ("row", "row1", "agg", 1)
    assert (control.epoch_ns, control.issued_ns) == (EPOCH_NS, 5_000)
    assert control.lease_expires_ns - control.issued_ns == 10 * 10**9
    assert [scope for scope, _ in result.decisions()] == [("row1", None), ("row1", "r1")]
    again = rows.step(T0_S + 2, 6_000, policy)
    assert again is not None
    assert again.rows[0].decision.level == 2
    assert not again.rows[0].decision.changed
    assert again.rows[0].decision.control.seq == 2  # every step renews the lease


def test_restore_undoes_a_step(tmp_path: Path, policy: LoadedPolicy) -> None:
    """A checkpoint taken before a step and restored after it leaves the ladders and the
    sequences as they were: the step is decided again, not continued."""
    rows = _rows(tmp_path, warmup_s=0.0)
    _meter(rows, 5_000.0, T0_S + 1)
    assert rows.step(T0_S + 1, 1, policy) is not None
    checkpoint = rows.checkpoint()
    _meter(rows, 9_900.0, T0_S + 2)
    brake = rows.step(T0_S + 2, 2, policy)
    assert brake is not None
    assert brake.rows[0].decision.level == 3
    rows.restore(checkpoint)
    assert rows.controllers[("row1", None)].ladder.level == 0
    assert rows.last is not None
    assert rows.last.now_ns == 1
    redone = rows.step(T0_S + 2, 2, policy)
    assert redone is not None
    assert redone.rows[0].decision.control.seq == brake.rows[0].decision.control.seq


def _control(level: int, *, seq: int, term: int = 0, issuer: str = "agg") -> Control:
    return Control(
        ts_ns=1,
        scope="row",
        row="row1",
        issuer=issuer,
        term=term,
        epoch_ns=1,
        seq=seq,
        level=level,
        issued_ns=1,
        lease_expires_ns=10**10,
    )


def test_a_retained_control_seeds_the_ladder_before_warm_only(
    tmp_path: Path, policy: LoadedPolicy
) -> None:
    """The level a previous run left retained holds the row while this one learns: a row
    now under every threshold starts from it, not from nominal; after warm, it is ignored."""
    rows = _rows(tmp_path, warmup_s=0.0)
    rows.seed(_control(2, seq=40), policy=policy.policy)
    _meter(rows, 8_600.0, T0_S + 1)  # 86%: inside T2's release band
    result = rows.step(T0_S + 1, 1, policy)
    assert result is not None
    assert result.rows[0].decision.level == 2
    rows.seed(_control(0, seq=41), policy=policy.policy)
    assert rows.controllers[("row1", None)].ladder.level == 2


def test_a_standby_follows_the_leaders_level_and_a_leader_stamps_its_term(
    tmp_path: Path, policy: LoadedPolicy
) -> None:
    """``follow`` keeps a standby's ladder on the leader's level; ``set_term`` puts the
    leadership term in every control from then on."""
    rows = _rows(tmp_path, warmup_s=0.0)
    _meter(rows, 8_600.0, T0_S + 1)
    rows.follow(_control(2, seq=7, term=3, issuer="agg-b"), policy=policy.policy)
    rows.set_term(12)
    result = rows.step(T0_S + 1, 1, policy)
    assert result is not None
    assert result.rows[0].decision.level == 2
    assert {d.control.term for _, d in result.decisions()} == {12}


def test_a_cdu_reading_is_urgent_only_when_it_reports_trouble(tmp_path: Path) -> None:
    """A CDU that is fine waits for the interval; one in alarm wakes the step now."""
    rows = _rows(tmp_path)
    side = CoolantConnector(supply_temp_c=30.0, return_temp_c=38.0, flow_lpm=90.0)
    ok = CduTelemetry(ts_ns=1, cdu="cdu1", loop="loop1", secondary=side, status="ok")
    assert not rows.observe_cdu(ok, T0_S + 1)
    alarm = ok.model_copy(update={"ts_ns": 2, "status": "critical"})
    assert rows.observe_cdu(alarm, T0_S + 2)


def test_an_offline_node_counts_at_its_limits_not_at_zero(
    tmp_path: Path, policy: LoadedPolicy
) -> None:
    """A node that said goodbye still counts in the row's power, at its GPUs' limits."""
    rows = _rows(tmp_path, warmup_s=0.0)
    tracker = rows.trackers["row1"]
    tracker.ingest_telemetry("n1", _telemetry("n1", 1_000.0), T0_S)
    tracker.ingest_telemetry("n2", _telemetry("n2", 1_000.0), T0_S)
    tracker.ingest_status("n2", Status(ts_ns=1, state="offline", node="n2"))
    result = rows.step(T0_S + 1, 1, policy)
    assert result is not None
    nodes = {n.node: n for n in result.rows[0].nodes}
    assert (nodes["n1"].health, nodes["n2"].health) == ("fresh", "offline")
    assert nodes["n2"].power_w == pytest.approx(1_600.0)
    assert result.rows[0].rollup.power_w == pytest.approx(2_600.0)


def test_no_level_falls_while_the_intake_is_cut_nor_for_the_warmup_after(
    tmp_path: Path, policy: LoadedPolicy
) -> None:
    """The aggregator's broker connections down: the data stops because of them, so the
    row keeps its level however low the power it still computes; ``warmup_s`` after they
    are back the level is free to fall again (one level: the policy's dwell has passed)."""
    rows = _rows(tmp_path, warmup_s=5.0)
    rows.warm = True
    _meter(rows, 9_200.0, T0_S + 1)
    first = rows.step(T0_S + 1, 1, policy)
    assert first is not None
    assert first.rows[0].decision.level == 2
    rows.intake_cut(cut=True, now_s=T0_S + 2)
    for t in (60.0, 110.0):  # the meter low from 60 s on: past the dwell (40 s) at 110
        _meter(rows, 1_000.0, T0_S + t)
        rows.intake_cut(cut=True, now_s=T0_S + t)
        held = rows.step(T0_S + t, int(t), policy)
        assert held is not None
        assert held.rows[0].decision.level == 2
    _meter(rows, 1_000.0, T0_S + 120)
    rows.intake_cut(cut=False, now_s=T0_S + 120)  # back: held for warmup_s more
    after = rows.step(T0_S + 120, 120, policy)
    assert after is not None
    assert after.rows[0].decision.level == 2
    _meter(rows, 1_000.0, T0_S + 126)
    rows.intake_cut(cut=False, now_s=T0_S + 126)
    freed = rows.step(T0_S + 126, 126, policy)
    assert freed is not None
    assert freed.rows[0].decision.level == 1


def test_a_cut_that_comes_back_within_the_hold_keeps_the_levels(
    tmp_path: Path, policy: LoadedPolicy
) -> None:
    """Cut, back, cut again inside the hold: the levels are still held (the hold kept them
    from falling meanwhile), and the hold lasts until after the last cut."""
    rows = _rows(tmp_path, warmup_s=5.0)
    rows.warm = True
    _meter(rows, 9_200.0, T0_S + 1)
    assert rows.step(T0_S + 1, 1, policy) is not None
    rows.intake_cut(cut=True, now_s=T0_S + 2)
    rows.intake_cut(cut=False, now_s=T0_S + 3)
    rows.intake_cut(cut=True, now_s=T0_S + 4)
    rows.intake_cut(cut=False, now_s=T0_S + 60)
    _meter(rows, 1_000.0, T0_S + 62)
    rows.intake_cut(cut=False, now_s=T0_S + 62)
    held = rows.step(T0_S + 62, 62, policy)
    assert held is not None
    assert held.rows[0].decision.level == 2


def test_a_cut_inside_an_earlier_holds_tail_holds_the_levels_of_now(
    tmp_path: Path, policy: LoadedPolicy
) -> None:
    """The connections not yet subscribed at start hold level 0; the row rises to T2 in
    that hold's tail, then a broker node dies: the new cut holds T2 (as it is now), not
    the start-up's 0, so the meter that stopped with the connection lowers nothing."""
    rows = _rows(tmp_path, warmup_s=5.0)
    rows.warm = True
    rows.intake_cut(cut=True, now_s=T0_S)  # start-up: at level 0
    rows.intake_cut(cut=False, now_s=T0_S + 0.5)  # subscribed: held until T0 + 5.5
    _meter(rows, 9_200.0, T0_S + 1)
    rows.intake_cut(cut=False, now_s=T0_S + 1)
    risen = rows.step(T0_S + 1, 1, policy)
    assert risen is not None
    assert risen.rows[0].decision.level == 2
    rows.intake_cut(cut=True, now_s=T0_S + 2)  # the node dies inside the tail
    for t in (60.0, 110.0):  # past the dwell: a free ladder would fall
        _meter(rows, 1_000.0, T0_S + t)
        rows.intake_cut(cut=True, now_s=T0_S + t)
        held = rows.step(T0_S + t, int(t), policy)
        assert held is not None
        assert held.rows[0].decision.level == 2
