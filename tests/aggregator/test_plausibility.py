"""Plausible per node: a node is counted at most at what it can draw, and cannot grow its GPUs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polca.aggregator.config import IntakeSettings, NodeSpec, RackSpec, RowSpec
from polca.aggregator.rollup import IDENTITIES_PER_GPU, RowTracker
from polca.gpu.products import PUBLISHED_MAX_POWER_W, published_max_power_w
from polca.telemetry.schema import GpuTelemetry, Status, Telemetry

STALE_S = 5.0
BOUNDS = IntakeSettings(max_gpus_per_node=8, max_gpu_power_w=1400.0, power_headroom_fraction=0.25)


def _row(*nodes: NodeSpec) -> RowSpec:
    nodes = nodes or (NodeSpec(name="n1", non_gpu_w=500), NodeSpec(name="n2", non_gpu_w=500))
    return RowSpec(name="row1", budget_w=20_000, racks=(RackSpec(name="r1", nodes=nodes),))


def _gpu(
    index: int,
    power_w: float,
    *,
    uuid: str | None = None,
    limit_w: float | None = 700.0,
    max_w: float | None = 700.0,
) -> GpuTelemetry:
    return GpuTelemetry(
        index=index,
        uuid=uuid or f"GPU-{index}",
        name="H100",
        power_mean_w=power_w,
        enforced_power_limit_w=limit_w,
        power_limit_max_w=max_w,
    )


def _telemetry(
    node: str, gpus: tuple[GpuTelemetry, ...], *, node_w: float | None = None
) -> Telemetry:
    total = sum(g.power_mean_w or 0.0 for g in gpus)
    return Telemetry(
        ts_ns=1,
        seq=1,
        node=node,
        interval_s=1,
        node_gpu_power_w=min(node_w if node_w is not None else total, 1e7),
        node_energy_delta_j=1e12,
        gpus=gpus,
    )


def _eight(node: str, per_gpu_w: float, **kw: float | None) -> Telemetry:
    return _telemetry(node, tuple(_gpu(i, per_gpu_w, **kw) for i in range(8)))  # type: ignore[arg-type]


def _power(tracker: RowTracker, node: str, now_s: float = 0.5) -> float:
    rollup = tracker.rollup(now_s, stale_after_s=STALE_S)
    assert rollup.racks[0].power_w == pytest.approx(sum(r.power_w for r in rollup.racks))
    return tracker.nodes[node].counted_w


def test_an_honest_first_report_sets_a_tight_bound() -> None:
    """Eight H100s with a 700 W maximum limit: at most 8 x 700 x 1.25 W of GPUs."""
    tracker = RowTracker(_row(), BOUNDS)
    ingested = tracker.ingest_telemetry("n1", _eight("n1", 300.0), now_s=0)
    assert ingested.anomalies == ()
    view = tracker.nodes["n1"]
    assert view.gpu_count == 8
    assert view.gpu_bound_w == pytest.approx(8 * 700 * 1.25)
    assert _power(tracker, "n1") == pytest.approx(8 * 300 + 500)


def test_a_claim_of_ten_megawatts_counts_at_the_bound_and_is_flagged() -> None:
    """The wire's largest power is implausible: counted at the bound, never less."""
    tracker = RowTracker(_row(), BOUNDS)
    tracker.ingest_telemetry("n1", _eight("n1", 600.0), now_s=0)
    lie = _eight("n1", 600.0).model_copy(update={"node_gpu_power_w": 1e7})
    ingested = tracker.ingest_telemetry("n1", lie, now_s=0.1)
    assert ingested.anomalies == ("power",)
    assert _power(tracker, "n1") == pytest.approx(8 * 700 * 1.25 + 500)
    view = tracker.nodes["n1"]
    assert view.implausible(0.1, within_s=STALE_S)
    assert view.implausible_readings == 1
    assert tracker.energy_j <= 2 * 8 * 700 * 1.25  # energy held to the same bound
    # An honest reading again: counted as it is, the flag cleared, the count kept.
    assert tracker.ingest_telemetry("n1", _eight("n1", 200.0), now_s=0.2).anomalies == ()
    assert _power(tracker, "n1") == pytest.approx(8 * 200 + 500)
    assert not view.implausible(10.0, within_s=STALE_S)  # a clean spell clears the flag
    assert view.implausible_readings == 1


def test_a_lying_first_report_is_cut_to_the_site_maxima() -> None:
    """1,024 GPUs at 9 kW limits: 8 GPUs kept, each at most 1,400 W (plus headroom)."""
    tracker = RowTracker(_row(), BOUNDS)
    gpus = tuple(
        _gpu(i, 9_000.0, uuid=f"GPU-x{i}", limit_w=9_000.0, max_w=9_000.0) for i in range(1024)
    )
    ingested = tracker.ingest_telemetry("n1", _telemetry("n1", gpus), now_s=0)
    assert ingested.anomalies == ("gpu_list", "power")
    assert len(ingested.telemetry.gpus) == 8
    assert tracker.nodes["n1"].gpu_bound_w == pytest.approx(8 * 1400 * 1.25)
    assert _power(tracker, "n1") == pytest.approx(8 * 1400 * 1.25 + 500)


def test_an_offline_node_is_held_to_the_same_bound() -> None:
    """The limits an offline node last claimed count only up to its bound (declared here)."""
    spec = NodeSpec(name="n1", non_gpu_w=500, gpus=8, gpu_max_power_w=400)
    tracker = RowTracker(_row(spec, NodeSpec(name="n2")), BOUNDS)
    gpus = tuple(
        _gpu(i, 9_000.0, uuid=f"GPU-x{i}", limit_w=9_000.0, max_w=9_000.0) for i in range(1024)
    )
    tracker.ingest_telemetry("n1", _telemetry("n1", gpus), now_s=0)
    tracker.ingest_status("n1", Status(ts_ns=1, state="offline", node="n1"))
    rollup = tracker.rollup(60.0, stale_after_s=STALE_S)
    assert rollup.offline_nodes == ("n1", "n2")
    assert tracker.nodes["n1"].counted_w == pytest.approx(8 * 400 * 1.25 + 500)
    # ... and a stale one too.
    tracker.nodes["n1"].status = "online"
    tracker.rollup(60.0, stale_after_s=STALE_S)
    assert tracker.nodes["n1"].counted_w == pytest.approx(8 * 400 * 1.25 + 500)


def test_an_honest_offline_node_still_counts_at_its_limits() -> None:
    """Within the bound, an offline node counts at its enforced limits, as before."""
    tracker = RowTracker(_row(), BOUNDS)
    tracker.ingest_telemetry("n1", _eight("n1", 300.0, limit_w=600.0), now_s=0)
    tracker.ingest_status("n1", Status(ts_ns=1, state="offline", node="n1"))
    tracker.rollup(1.0, stale_after_s=STALE_S)
    assert tracker.nodes["n1"].counted_w == pytest.approx(8 * 600 + 500)


def test_a_declared_nameplate_bounds_fresh_readings() -> None:
    """nameplate_w caps what a fresh reading counts, and a claim over it is implausible."""
    spec = NodeSpec(name="n1", non_gpu_w=500, nameplate_w=4_000)
    tracker = RowTracker(_row(spec), BOUNDS)
    assert tracker.ingest_telemetry("n1", _eight("n1", 500.0), now_s=0).anomalies == ("power",)
    assert _power(tracker, "n1") == pytest.approx(4_000)
    assert tracker.ingest_telemetry("n1", _eight("n1", 300.0), now_s=0.1).anomalies == ()
    assert _power(tracker, "n1") == pytest.approx(8 * 300 + 500)


def test_a_node_cannot_grow_its_gpu_list_or_invent_gpus() -> None:
    """More GPUs than the first report: cut; new identities beyond twice the count: cut."""
    tracker = RowTracker(_row(), BOUNDS)
    four = tuple(_gpu(i, 100.0) for i in range(4))
    tracker.ingest_telemetry("n1", _telemetry("n1", four), now_s=0)
    assert tracker.nodes["n1"].gpu_count == 4
    six = tuple(_gpu(i, 100.0) for i in range(6))
    grown = tracker.ingest_telemetry("n1", _telemetry("n1", six), now_s=0.1)
    assert grown.anomalies == ("gpu_list",)
    assert [g.index for g in grown.telemetry.gpus] == [0, 1, 2, 3]
    # A replaced GPU (a new UUID at index 0) is taken, up to the identities allowed.
    seen = 4
    for n in range(20):
        renamed = (_gpu(0, 100.0, uuid=f"GPU-new{n}"), *four[1:])
        ingested = tracker.ingest_telemetry("n1", _telemetry("n1", renamed), now_s=0.2 + n)
        if seen < 4 * IDENTITIES_PER_GPU:
            seen += 1
            assert ingested.anomalies == ()
        else:
            assert ingested.anomalies == ("gpu_identity",)
            assert [g.index for g in ingested.telemetry.gpus] == [1, 2, 3]
    assert len(tracker.nodes["n1"].identities) == 4 * IDENTITIES_PER_GPU
    # The same index twice counts once.
    twice = tracker.ingest_telemetry("n1", _telemetry("n1", (four[0], four[0])), now_s=30)
    assert twice.anomalies == ("gpu_identity",)
    assert len(twice.telemetry.gpus) == 1


def test_the_topology_fixes_the_count_before_any_report() -> None:
    """Declared gpus and gpu_max_power_w win over whatever the first report says."""
    spec = NodeSpec(name="n1", gpus=2, gpu_max_power_w=500)
    tracker = RowTracker(_row(spec), BOUNDS)
    ingested = tracker.ingest_telemetry("n1", _eight("n1", 400.0), now_s=0)
    assert ingested.anomalies == ("gpu_list", "power")  # and it claimed its 8 GPUs' power
    assert tracker.nodes["n1"].gpu_bound_w == pytest.approx(2 * 500 * 1.25)
    assert _power(tracker, "n1") == pytest.approx(2 * 500 * 1.25)
    two = _telemetry("n1", tuple(_gpu(i, 400.0) for i in range(2)))
    assert tracker.ingest_telemetry("n1", two, now_s=0.1).anomalies == ()
    assert _power(tracker, "n1") == pytest.approx(800)


def test_a_report_without_gpus_learns_nothing_and_claims_nothing() -> None:
    """No GPUs listed: no GPU power is plausible, and the next report with GPUs is learned."""
    tracker = RowTracker(_row(), BOUNDS)
    assert tracker.ingest_telemetry(
        "n1", _telemetry("n1", (), node_w=900.0), now_s=0
    ).anomalies == ("power",)
    assert tracker.nodes["n1"].gpu_count is None
    assert _power(tracker, "n1") == pytest.approx(500)
    tracker.ingest_telemetry("n1", _eight("n1", 100.0), now_s=0.1)
    assert tracker.nodes["n1"].gpu_count == 8


def test_an_old_agent_without_maximum_limits_gets_the_site_maximum() -> None:
    """A first report without power_limit_max_w: the per-GPU bound is max_gpu_power_w."""
    tracker = RowTracker(_row(), BOUNDS)
    tracker.ingest_telemetry("n1", _eight("n1", 300.0, max_w=None), now_s=0)
    assert tracker.nodes["n1"].gpu_bound_w == pytest.approx(8 * 1400 * 1.25)


_READING = st.tuples(
    st.sampled_from(["n1", "n2"]),
    st.integers(min_value=0, max_value=40),  # GPUs listed
    st.sampled_from([0.0, 1.0, 350.0, 700.0, 1_000.0, 9_000.0, 1e7]),  # per GPU
    st.sampled_from([None, 0.0, 5_000.0, 1e7]),  # node_gpu_power_w claimed
    st.sampled_from([None, 400.0, 700.0, 1e7]),  # maximum limit reported
    st.booleans(),  # offline afterwards
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(readings=st.lists(_READING, min_size=1, max_size=12))
def test_no_sequence_of_readings_counts_a_node_above_its_bound(
    readings: list[tuple[str, int, float, float | None, float | None, bool]],
) -> None:
    """Whatever a node sends, it counts at most its bound, and never below an honest reading."""
    tracker = RowTracker(_row(), BOUNDS)
    for step, (node, count, per_gpu_w, node_w, max_w, offline) in enumerate(readings):
        gpus = tuple(_gpu(i, per_gpu_w, limit_w=per_gpu_w, max_w=max_w) for i in range(count))
        ingested = tracker.ingest_telemetry(node, _telemetry(node, gpus, node_w=node_w), step)
        view = tracker.nodes[node]
        ceiling_w = (view.gpu_bound_w or 0.0) + 500  # non-GPU power
        assert view.counted_w <= ceiling_w + 1e-6
        assert view.gpu_bound_w is None or view.gpu_bound_w <= 8 * 1400 * 1.25 + 1e-6
        if not ingested.anomalies:
            claimed = max(sum(g.power_mean_w or 0.0 for g in gpus), node_w or 0.0)
            assert view.counted_w == pytest.approx(claimed + 500)
        if offline:
            tracker.ingest_status(node, Status(ts_ns=1, state="offline", node=node))
        rollup = tracker.rollup(step + 0.5, stale_after_s=STALE_S)
        assert rollup.computed_power_w <= 2 * (8 * 1400 * 1.25 + 500) + 1e-6


def _product(node: str, name: str, declared_max_w: float, per_gpu_w: float = 100.0) -> Telemetry:
    gpus = tuple(
        GpuTelemetry(
            index=i,
            uuid=f"GPU-{node}-{i}",
            name=name,
            power_mean_w=per_gpu_w,
            enforced_power_limit_w=min(declared_max_w, 700.0),
            power_limit_max_w=declared_max_w,
        )
        for i in range(8)
    )
    return _telemetry(node, gpus)


def test_a_node_cannot_raise_its_own_bound_above_its_products() -> None:
    """An H100 node declaring a 10 kW maximum per GPU: its bound is the product's published
    700 W (x 1.25 headroom), not its word, so a 20 kW claim counts at 7 kW plus non-GPU."""
    tracker = RowTracker(_row(), BOUNDS)
    tracker.ingest_telemetry("n1", _product("n1", "NVIDIA H100 80GB HBM3", 10_000.0), 0.0)
    view = tracker.nodes["n1"]
    assert view.bound_source == "product"
    assert view.gpu_bound_w == pytest.approx(8 * 700 * 1.25)
    claim = _product("n1", "NVIDIA H100 80GB HBM3", 10_000.0, per_gpu_w=2_500.0)
    assert tracker.ingest_telemetry("n1", claim, 0.2).anomalies == ("power",)
    assert _power(tracker, "n1") == pytest.approx(8 * 700 * 1.25 + 500)


def test_a_declared_maximum_below_the_products_is_the_bound() -> None:
    """A node may lower its own bound (an A100 80 GB at 400 W, of the product's 500 W)."""
    tracker = RowTracker(_row(), BOUNDS)
    tracker.ingest_telemetry("n1", _product("n1", "NVIDIA A100-SXM4-80GB", 400.0), 0.0)
    assert tracker.nodes["n1"].gpu_bound_w == pytest.approx(8 * 400 * 1.25)
    assert tracker.nodes["n1"].bound_source == "product"


def test_an_unknown_product_rests_on_the_nodes_word_and_the_intakes_cap() -> None:
    """A product polca has no published limit for: the declared maximum, cut to
    intake.max_gpu_power_w (1,400 W); the bound says where it came from."""
    tracker = RowTracker(_row(), BOUNDS)
    tracker.ingest_telemetry("n1", _product("n1", "Some Future GPU", 10_000.0), 0.0)
    assert tracker.nodes["n1"].bound_source == "declared"
    assert tracker.nodes["n1"].gpu_bound_w == pytest.approx(8 * 1400 * 1.25)
    configured = RowTracker(_row(NodeSpec(name="n1", gpu_max_power_w=900.0)), BOUNDS)
    configured.ingest_telemetry("n1", _product("n1", "Some Future GPU", 10_000.0), 0.0)
    assert configured.nodes["n1"].bound_source == "topology"
    assert configured.nodes["n1"].gpu_bound_w == pytest.approx(8 * 900 * 1.25)


def test_the_product_table_matches_names_as_nvml_spells_them() -> None:
    """Exact names, compared without case or runs of spaces; unknown or empty: None."""
    assert published_max_power_w("NVIDIA H100 80GB HBM3") == 700.0
    assert published_max_power_w("nvidia  h100 80gb hbm3") == 700.0
    assert published_max_power_w("NVIDIA H100") is None
    assert published_max_power_w("") is None
    assert published_max_power_w(None) is None
    assert all(0 < w <= 1400.0 for w in PUBLISHED_MAX_POWER_W.values())
