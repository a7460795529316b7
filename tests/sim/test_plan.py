"""The planner: SLO checks, the largest passing prefix, monotonicity, threshold sweeps."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from polca.policy import Policy
from polca.sim.model import ControlConfig
from polca.sim.plan import Slo, Variant, best_point, run_plan, threshold_variants
from polca.sim.workload import load_trace
from tests.sim.conftest import tiny_scenario


def point(ratio: float, **metrics: float) -> dict[str, Any]:
    """A plan point passing POLCA's SLOs unless ``metrics`` says otherwise."""
    values: dict[str, Any] = {
        "oversubscription_pct": 100.0 * ratio,
        "servers": round(40 * (1 + ratio)),
        "hp_p50_impact_pct": 0.0,
        "hp_p99_impact_pct": 0.0,
        "lp_p50_impact_pct": 0.0,
        "lp_p99_impact_pct": 0.0,
        "lp_throughput_loss_pct": 0.0,
        "brake_events": 0.0,
    }
    values.update(metrics)
    return values


def test_best_point_is_the_largest_passing_prefix() -> None:
    """A failure stops the walk: a later pass (noise) is not recommended."""
    points = [
        point(0.0),
        point(0.1, hp_p99_impact_pct=4.0),
        point(0.2, lp_throughput_loss_pct=2.5),
        point(0.3),
    ]
    best = best_point(points, Slo())
    assert best is not None
    assert best["servers"] == 44
    assert best_point([point(0.0, brake_events=1.0)], Slo()) is None
    assert best_point([point(0.0, brake_events=1.0)], Slo(max_brakes=1)) is not None


def test_violations_name_each_missed_slo() -> None:
    """Every limit missed is named with its value; NaN and missing values fail."""
    found = Slo().violations(point(0.3, hp_p50_impact_pct=1.5, lp_p99_impact_pct=float("nan")))
    assert found == ["high P50 impact 1.5 > 1", "low P99 impact nan > 50"]
    assert Slo().violations(point(0.3, brake_events=None)) == ["brake events None > 0"]  # type: ignore[arg-type]


metric = st.floats(0.0, 10.0, allow_nan=False)
point_strategy = st.fixed_dictionaries(
    {
        "hp_p50_impact_pct": metric,
        "hp_p99_impact_pct": metric,
        "lp_p50_impact_pct": metric,
        "lp_p99_impact_pct": metric,
        "lp_throughput_loss_pct": metric,
        "brake_events": st.integers(0, 3).map(float),
    }
)
slo_strategy = st.builds(
    Slo,
    hp_p50_pct=metric,
    hp_p99_pct=metric,
    lp_loss_pct=metric,
    lp_p50_pct=metric,
    lp_p99_pct=metric,
    max_brakes=st.integers(0, 3),
)


@given(
    metrics=st.lists(point_strategy, min_size=1, max_size=8),
    slo=slo_strategy,
    extra=st.tuples(metric, metric, metric, metric, metric, st.integers(0, 2)),
)
def test_plans_are_monotone_in_the_slos(
    metrics: list[dict[str, float]], slo: Slo, extra: tuple[float, ...]
) -> None:
    """Allowing more (looser limits, more brakes) never yields fewer servers."""
    points = [point(0.05 * i, **m) for i, m in enumerate(metrics)]
    looser = Slo(
        hp_p50_pct=slo.hp_p50_pct + extra[0],
        hp_p99_pct=slo.hp_p99_pct + extra[1],
        lp_loss_pct=slo.lp_loss_pct + extra[2],
        lp_p50_pct=slo.lp_p50_pct + extra[3],
        lp_p99_pct=slo.lp_p99_pct + extra[4],
        max_brakes=slo.max_brakes + int(extra[5]),
    )
    strict_best, loose_best = best_point(points, slo), best_point(points, looser)
    strict_servers = strict_best["servers"] if strict_best else 0
    loose_servers = loose_best["servers"] if loose_best else 0
    assert loose_servers >= strict_servers


def test_threshold_sweep_skips_combinations_the_rules_reject(a100_policy: Policy) -> None:
    """T1 x T2 grid: valid combinations become variants, others notes naming the rule."""
    base = Variant("polca", a100_policy, ControlConfig())
    variants, notes = threshold_variants(base, t1_pcts=[78, 86], t2_pcts=[87, 92])
    names = [v.name for v in variants]
    assert names == ["polca T1=78 T2=87", "polca T1=78 T2=92", "polca T1=86 T2=92"]
    assert [lvl.threshold_pct for lvl in variants[0].policy.levels] == [78, 87, 98]
    assert notes == [
        "polca T1=86 T2=87 skipped: 'T2' (87%) is less than release.margin_pct (5) above 'T1' (86%)"
    ]


def test_a_small_plan_runs_and_relaxing_slos_never_shrinks_it(a100_policy: Policy) -> None:
    """Two variants over three ratios of a tiny row; each point checked, best picked."""
    s = tiny_scenario(duration_s=240.0)
    in_band = replace(s.control, actuation_delay_s=0.012)
    variants = [
        Variant("oob", a100_policy, s.control),
        Variant("inband", a100_policy, in_band),
    ]
    trace = load_trace("azure-code")
    result = run_plan(s, trace, variants, ratios=[0.5, 0.0, 0.25], slo=Slo())
    assert result["ratios"] == [0.0, 0.25, 0.5]
    assert [v["name"] for v in result["scenarios"]] == ["oob", "inband"]
    for v in result["scenarios"]:
        assert [p["servers"] for p in v["points"]] == [4, 5, 6]
        zero = v["points"][0]
        assert zero["violations"] == [] or zero["uncapped_peak_pct"] > 80
    loose = Slo(
        hp_p50_pct=1e9,
        hp_p99_pct=1e9,
        lp_loss_pct=1e9,
        lp_p50_pct=1e9,
        lp_p99_pct=1e9,
        max_brakes=10**6,
    )
    for v in result["scenarios"]:
        best = best_point(v["points"], loose)
        assert best is not None
        assert best["servers"] == 6
        strict = v["best"]
        assert strict is None or strict["servers"] <= best["servers"]
