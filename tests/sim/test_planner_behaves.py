"""The planner on hard inputs: collapsed points stop early and fail, seeds must all pass,
results arrive point by point, the verdict names the grid's edge, --help shows defaults."""

from __future__ import annotations

import contextlib
import io
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib.pyplot
import numpy as np
import pytest

from polca.errors import SimCollapsedError, SimConfigError
from polca.policy import Policy
from polca.sim import cli
from polca.sim.plan import (
    Slo,
    Variant,
    bisect_plan,
    merge_seeds,
    point_violations,
    render_text,
    run_plan,
)
from polca.sim.scenario import run_once
from polca.sim.workload import load_trace
from tests.sim.conftest import A100_POLICY, tiny_scenario
from tests.sim.test_plan import point

TINY = ["--servers", "4", "--gpus-per-server", "4", "--duration", "2m", "--warmup", "20"]


def test_a_row_that_cannot_serve_its_load_collapses_early() -> None:
    """Ten times the load on a tiny row: requests pile up, the run stops well before its
    end with the time and the count, instead of growing without bound."""
    s = tiny_scenario(load_scale=40.0, max_in_flight_per_gpu=64, duration_s=3600.0)
    started = time.monotonic()
    with pytest.raises(SimCollapsedError, match="requests in flight, over 64 per GPU") as info:
        run_once(s, load_trace("azure-code"), None)
    assert info.value.at_s < 3600.0
    assert info.value.in_flight > 64 * 16
    assert time.monotonic() - started < 60.0


def test_a_run_over_its_time_limit_collapses() -> None:
    """A wall-time limit per run ends it as collapsed."""
    s = tiny_scenario(time_limit_s=1e-6, duration_s=600.0)
    with pytest.raises(SimCollapsedError, match="time limit"):
        run_once(s, load_trace("azure-code"), None)


def test_collapsed_points_fail_and_the_plan_still_answers(a100_policy: Policy) -> None:
    """With a bound the load exceeds, every point collapses early: each fails saying why,
    with no metrics, and the verdict says that even the lowest ratio misses."""
    s = tiny_scenario(duration_s=240.0, max_in_flight_per_gpu=32)
    trace = load_trace("azure-code")
    variants = [Variant("oob", a100_policy, s.control)]
    result = run_plan(s, trace, variants, ratios=[0.0, 0.5], slo=Slo())
    points = result["scenarios"][0]["points"]
    assert [p["servers"] for p in points] == [4, 6]
    for p in points:
        assert "requests in flight, over 32 per GPU" in p["collapsed"]
        assert p["violations"][0].startswith("collapsed (")
        assert p["hp_p99_impact_pct"] is None
    assert result["scenarios"][0]["best"] is None
    text = render_text(result)
    assert "already misses (collapsed (" in text
    healthy = run_plan(
        replace(s, max_in_flight_per_gpu=1024), trace, variants, ratios=[0.0], slo=Slo()
    )
    assert healthy["scenarios"][0]["points"][0].get("collapsed") is None


def test_seeds_report_a_spread_and_pass_only_together() -> None:
    """Means and (min, max) per metric; one seed over a limit fails the point."""
    slo = Slo()
    ok = {**point(0.1), "peak_pct": 90.0, "uncapped_peak_pct": 99.0, "capped_time_pct": 5.0}
    ok.update(capping_events=2, hp_throughput_loss_pct=0.0)
    worse = {**ok, "hp_p99_impact_pct": 6.0, "peak_pct": 94.0}
    merged = merge_seeds(0.1, [ok, worse], [7, 8], slo)
    assert merged["peak_pct"] == pytest.approx(92.0)
    assert merged["spread"]["peak_pct"] == [90.0, 94.0]
    assert merged["violations"] == ["seed 8: high P99 impact 6.0 > 5"]
    assert point_violations(merged, Slo(hp_p99_pct=10.0)) == []
    both_ok = merge_seeds(0.1, [ok, ok], [7, 8], slo)
    assert both_ok["violations"] == []


def test_points_arrive_one_by_one_with_progress(a100_policy: Policy) -> None:
    """Each finished ratio is handed over at once (an interrupted plan keeps them)."""
    s = tiny_scenario(duration_s=180.0)
    seen: list[tuple[float, list[tuple[str, dict[str, Any]]]]] = []
    ticks: list[tuple[int, int]] = []
    result = run_plan(
        s,
        load_trace("azure-code"),
        [Variant("oob", a100_policy, s.control)],
        ratios=[0.0, 0.25],
        slo=Slo(),
        seeds=2,
        on_point=lambda ratio, points: seen.append((ratio, points)),
        progress=lambda done, total, ratio, secs: ticks.append((done, total)),
    )
    assert [r for r, _ in seen] == [0.0, 0.25]
    assert ticks == [(1, 2), (2, 2)]
    assert result["seeds"] == [0, 1]
    first = result["scenarios"][0]["points"][0]
    assert first["seeds"] == [0, 1]
    assert len(first["by_seed"]) == 2
    assert set(first["spread"]) >= {"hp_p99_impact_pct", "peak_pct"}


def test_the_verdict_names_the_edge_of_the_grid() -> None:
    """Nothing passes: the lowest point and why; the top passes: sweep higher."""
    slo = Slo()

    def plan(*points: dict[str, Any]) -> dict[str, Any]:
        pts = [{**p, "violations": slo.violations(p), "peak_pct": 90.0, "capped_time_pct": 1.0}
               for p in points]  # fmt: skip
        best = None
        for p in pts:
            if p["violations"]:
                break
            best = p
        return {
            "base_servers": 40,
            "seeds": [0],
            "scenarios": [
                {"name": "v", "control": {"actuation_delay_s": 40.0}, "points": pts, "best": best}
            ],
        }

    text = render_text(plan(point(0.2, lp_throughput_loss_pct=3.9), point(0.3)))
    assert "the lowest swept, +20.0% (48 servers), already misses" in text
    assert "low throughput loss 3.9 > 2" in text
    assert "sweep lower" in text
    text = render_text(plan(point(0.1), point(0.2)))
    assert "48 servers (+20.0% over 40)" in text
    assert "sweep higher" in text


def test_help_shows_every_default() -> None:
    """plan --help prints the defaults (SLOs, seeds, grid, load, the collapse bounds)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.parse(["plan", "--help"])
    text = " ".join(out.getvalue().split())
    assert "(default: None)" not in text
    for fragment in (
        "high-priority P99 latency impact (default: 5.0)",
        "(default: 1)",  # --seeds, --jobs
        "--tenants TENANTS independent services the copies belong to (default: 16)",
        "--max-in-flight-per-gpu",
        "(default: 1024)",
    ):
        assert fragment in text, fragment


def test_plan_writes_points_as_they_finish(tmp_path: Path) -> None:
    """--out gets plan.points.jsonl line by line, and progress goes to stderr."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["plan", "--policy", str(A100_POLICY), "--oversubscription", "0,25%", "--seeds", "2"]
    code = cli.main(
        cli.parse([*argv, "--out", str(tmp_path), "--no-plots", *TINY]), out=out, err=err
    )
    assert code == 0, err.getvalue()
    lines = (tmp_path / "plan.points.jsonl").read_text().splitlines()
    assert [json.loads(line)["servers"] for line in lines] == [4, 5]
    assert "plan [" in err.getvalue()
    assert "2/2 points" in err.getvalue()
    assert "in every one of 2 seeds" in out.getvalue() or "no swept" in out.getvalue()


def test_simulate_reports_a_collapse(tmp_path: Path) -> None:
    """simulate on a collapsing row: exit 1 and one line saying why."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["simulate", "--policy", str(A100_POLICY), "--load-scale", "40"]
    argv += ["--max-in-flight-per-gpu", "16", *TINY]
    code = cli.main(cli.parse(argv), out=out, err=err)
    assert code == 1
    assert err.getvalue().startswith("the simulated row collapsed at t=")


def test_seeds_below_one_are_refused(a100_policy: Policy) -> None:
    """--seeds 0 is an input error."""
    s = tiny_scenario()
    from polca.sim.model import SimConfigError

    with pytest.raises(SimConfigError, match="seeds"):
        run_plan(s, load_trace("azure-code"), [Variant("v", a100_policy, s.control)],
                 ratios=[0.0], slo=Slo(), seeds=0)  # fmt: skip


def test_the_frontier_legend_is_outside_the_data_and_collapses_are_marked() -> None:
    """The legend sits under the panels, overlapping none; a collapsed point is an x."""
    from polca.sim import plots

    slo = Slo()
    pts = [
        {**point(0.1), "peak_pct": 90.0, "capped_time_pct": 1.0, "violations": []},
        {**point(0.2), "peak_pct": 99.0, "capped_time_pct": 9.0, "violations": []},
        {
            **dict.fromkeys(point(0.3)),
            "oversubscription_pct": 30.0,
            "servers": 52,
            "collapsed": "collapsed at t=45 s",
            "violations": ["collapsed"],
        },
    ]
    plan = {
        "slo": {
            "hp_p50_pct": slo.hp_p50_pct,
            "hp_p99_pct": slo.hp_p99_pct,
            "lp_loss_pct": slo.lp_loss_pct,
            "lp_p50_pct": slo.lp_p50_pct,
            "lp_p99_pct": slo.lp_p99_pct,
            "max_brakes": 0,
        },
        "scenarios": [{"name": f"variant {i}", "points": pts, "best": pts[1]} for i in range(5)],
    }
    fig = plots.frontier_figure(plan)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        tight = ax.get_tightbbox(renderer)
        assert tight is not None
        assert not box.overlaps(tight), ax.get_title()
    crosses = [
        line
        for ax in fig.axes
        for line in ax.get_lines()
        if line.get_marker() == "x" and np.asarray(line.get_xdata()).size == 1
    ]
    assert len(crosses) == 6 * 5  # every panel, every variant
    matplotlib.pyplot.close(fig)


def test_the_latency_figure_has_a_linear_impact_panel(a100_policy: Policy) -> None:
    """Beside the CDF, the impact per percentile on linear axes, positive under caps."""
    from polca.sim import plots
    from polca.sim.scenario import simulate

    s = tiny_scenario(oversubscription=0.5)
    capped, base, _ = simulate(s, load_trace("azure-code"), a100_policy)
    fig = plots.latency_figure(capped, base, warmup_s=s.warmup_s)
    cdf, impact = fig.axes
    assert cdf.get_xscale() == "log"
    assert (impact.get_xscale(), impact.get_yscale()) == ("linear", "linear")
    lines = {line.get_label(): line for line in impact.get_lines()}
    assert {"high", "low"} <= set(lines)
    low = np.asarray(lines["low"].get_ydata(), dtype=float)
    assert np.nanmax(low) > 0.0  # some percentile slower when capped
    matplotlib.pyplot.close(fig)


def test_bisection_finds_the_grids_answer_with_fewer_runs(a100_policy: Policy) -> None:
    """--search bisect: the same best deployment as the full grid, from fewer points."""
    s = tiny_scenario(duration_s=180.0)
    trace = load_trace("azure-code")
    variants = [Variant("oob", a100_policy, s.control)]
    grid = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    full = run_plan(s, trace, variants, ratios=grid, slo=Slo())
    fast = bisect_plan(s, trace, variants, ratios=grid, slo=Slo())
    assert fast["search"] == "bisect"
    (f,), (b,) = full["scenarios"], fast["scenarios"]
    assert b["best_servers"] == f["best_servers"]
    assert len(b["points"]) < len(f["points"])
    ratios = [p["ratio"] for p in b["points"]]
    assert ratios == sorted(ratios)
    assert ratios[0] == 0.0
    # Every evaluated point agrees with the grid's at the same ratio.
    by_ratio = {p["ratio"]: p for p in f["points"]}
    for p in b["points"]:
        assert p["violations"] == by_ratio[p["ratio"]]["violations"]


def test_decode_admission_is_bounded_per_gpu() -> None:
    """An overloaded tiny row: with a decode batch of at most 2 per GPU, prompts wait for a
    slot and time out instead of joining decode, so fewer are in flight at the end and more
    are dropped; the bound never changes a row that stays under it."""
    s = tiny_scenario(load_scale=40.0, duration_s=300.0, max_in_flight_per_gpu=100_000)
    trace = load_trace("azure-code")
    loose = run_once(replace(s, max_decode_batch=100_000), trace, None)
    tight = run_once(replace(s, max_decode_batch=2), trace, None)
    assert sum(tight.unfinished) < sum(loose.unfinished)
    assert sum(tight.dropped) > sum(loose.dropped)
    # In flight at the end: each GPU's batch (at most 2, plus prompts finishing in the same
    # step) and the prompts queued for at most --max-wait-s.
    assert sum(tight.unfinished) < sum(loose.unfinished) / 2
    healthy = tiny_scenario(duration_s=300.0)
    a = run_once(replace(healthy, max_decode_batch=100_000), trace, None)
    b = run_once(healthy, trace, None)
    assert a.dropped == b.dropped
    assert np.array_equal(a.req_latency_s, b.req_latency_s)


def test_decode_batch_must_be_positive() -> None:
    with pytest.raises(SimConfigError, match="max_decode_batch must be at least 1"):
        run_once(tiny_scenario(max_decode_batch=0), load_trace("azure-code"), None)
