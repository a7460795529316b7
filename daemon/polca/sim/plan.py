"""Capacity planning: sweep oversubscription, keep what meets the SLOs with zero brakes.

``run_plan`` simulates a scenario at each oversubscription ratio of a grid, for every
variant (a policy, optionally with other thresholds, and a control timing), against the
uncapped reference at the same ratio (shared by all variants: it depends on neither).
``best_point`` then picks, per variant, the largest deployment that meets the SLOs (POLCA's
by default: high-priority latency impact at most 1% at P50 and 5% at P99, low-priority
throughput loss at most 2%, low-priority latency impact at most 5% at P50 and 50% at P99)
and has at most ``max_brakes`` brake events (zero).

"Largest" means the largest ratio such that it *and every smaller ratio swept* pass: a
plan never recommends a deployment beyond one that failed, even if noise lets a larger one
pass. Because each check is a comparison against a limit, loosening any limit can only
keep or extend that passing prefix, so plans are monotone: allowing more violations never
yields fewer servers (a test checks it).

Ratios run in parallel with ``jobs`` worker processes (spawned; the results only depend on
the inputs, not on the number of workers).

With a ``feed_failure`` (``polca.sim.failover``: a Flex row sized against both of its
feeds), every point also replays the loss of one feed, and a point passes only if, besides
the SLOs, the row's power stays under the surviving feed's rating after the failover
window; each variant's result also says what the plan would have been without that check.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from typing import Any

from pydantic import ValidationError

from polca.errors import SimCollapsedError
from polca.policy import Policy
from polca.sim import failover
from polca.sim.model import ControlConfig, SimConfigError
from polca.sim.scenario import Scenario, row_config, run_once, summarize
from polca.workload.trace import Trace


@dataclass(frozen=True, slots=True)
class Slo:
    """Limits a deployment must meet (impacts and losses in %, against uncapped)."""

    hp_p50_pct: float = 1.0
    hp_p99_pct: float = 5.0
    lp_loss_pct: float = 2.0
    lp_p50_pct: float = 5.0
    lp_p99_pct: float = 50.0
    max_brakes: int = 0

    def violations(self, point: dict[str, Any]) -> list[str]:
        """Why ``point`` (a ``plan_point``) misses the SLOs; empty when it meets them."""
        checks = (
            ("hp_p50_impact_pct", self.hp_p50_pct, "high P50 impact"),
            ("hp_p99_impact_pct", self.hp_p99_pct, "high P99 impact"),
            ("lp_throughput_loss_pct", self.lp_loss_pct, "low throughput loss"),
            ("lp_p50_impact_pct", self.lp_p50_pct, "low P50 impact"),
            ("lp_p99_impact_pct", self.lp_p99_pct, "low P99 impact"),
            ("brake_events", float(self.max_brakes), "brake events"),
        )
        out = []
        for key, limit, label in checks:
            value = point[key]
            if value is None or not value <= limit:  # NaN fails too
                out.append(f"{label} {value if value is None else round(value, 2)} > {limit:g}")
        return out


@dataclass(frozen=True, slots=True)
class Variant:
    """One policy and control timing to plan for."""

    name: str
    policy: Policy
    control: ControlConfig
    policy_file: str | None = None


def plan_point(summary: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one simulation that SLOs are checked on."""
    m = summary["metrics"]
    hp, lp = m["classes"]["high"], m["classes"]["low"]
    return {
        "oversubscription_pct": summary["row"]["oversubscription_pct"],
        "servers": summary["row"]["servers"],
        "hp_p50_impact_pct": hp["p50_impact_pct"],
        "hp_p99_impact_pct": hp["p99_impact_pct"],
        "hp_throughput_loss_pct": hp["throughput_loss_pct"],
        "lp_p50_impact_pct": lp["p50_impact_pct"],
        "lp_p99_impact_pct": lp["p99_impact_pct"],
        "lp_throughput_loss_pct": lp["throughput_loss_pct"],
        "brake_events": float(m["brake_events"]),
        "peak_pct": m["power"]["peak_pct"],
        "uncapped_peak_pct": m["power"]["uncapped_peak_pct"],
        "capped_time_pct": 100.0 - m["levels"]["time_at_level_pct"].get("nominal", 100.0),
        "capping_events": m["levels"]["capping_events"],
    }


def variant_result(variant: Variant, points: list[dict[str, Any]], slo: Slo) -> dict[str, Any]:
    """One variant's part of a plan: its points and its recommendation."""
    best = best_point(points, slo)
    out = {
        "name": variant.name,
        "policy": variant.policy.name,
        "policy_file": variant.policy_file,
        "control": asdict(variant.control),
        "points": points,
        "best": best,
        "best_servers": best["servers"] if best else None,
    }
    if any("feed_failure" in p for p in points):
        normal = best_point(points, slo, feed_failure=False)
        out["best_servers_without_feed_failure"] = normal["servers"] if normal else None
    return out


def best_point(
    points: Sequence[dict[str, Any]], slo: Slo, *, feed_failure: bool = True
) -> dict[str, Any] | None:
    """The largest-ratio point such that it and every smaller one meet ``slo`` (and, unless
    ``feed_failure`` is false, survive a replayed feed's loss); or None."""
    best = None
    for point in sorted(points, key=lambda p: p["oversubscription_pct"]):
        if point_violations(point, slo, feed_failure=feed_failure):
            break
        best = point
    return best


def point_violations(point: dict[str, Any], slo: Slo, *, feed_failure: bool = True) -> list[str]:
    """Why a point misses ``slo``: a collapse, or any seed's miss (labelled by seed when
    there are several), including power over the surviving feed after a replayed feed's
    loss unless ``feed_failure`` is false; empty when it meets it."""
    seeds = point.get("seeds") or [None]
    if point.get("collapsed"):
        return [f"collapsed ({point['collapsed']})"]
    by_seed = point.get("by_seed") or [point]
    out: list[str] = []
    for seed, values in zip(seeds, by_seed, strict=True):
        label = f"seed {seed}: " if len(seeds) > 1 else ""
        out.extend(label + v for v in slo.violations(values))
        if feed_failure:
            out.extend(label + v for v in failover.violations(values.get("feed_failure")))
    return out


def threshold_variants(
    variant: Variant, *, t1_pcts: Sequence[float], t2_pcts: Sequence[float]
) -> tuple[list[Variant], list[str]]:
    """``variant`` with every (T1, T2) combination as its first two thresholds.

    Combinations the policy rules reject (T2 not above T1 by the release margin, ...) are
    skipped and named in the returned notes.
    """
    policy = variant.policy
    if len(policy.levels) < 2:
        msg = f"policy {policy.name!r} has fewer than two levels: no T1/T2 to sweep"
        raise SimConfigError(msg)
    out: list[Variant] = []
    notes: list[str] = []
    t1s = t1_pcts or [policy.levels[0].threshold_pct]
    t2s = t2_pcts or [policy.levels[1].threshold_pct]
    for t1 in t1s:
        for t2 in t2s:
            data = policy.model_dump()
            data["levels"][0]["threshold_pct"] = float(t1)
            data["levels"][1]["threshold_pct"] = float(t2)
            try:
                changed = Policy.model_validate(data, strict=False)
            except ValidationError as exc:
                why = "; ".join(_rule_messages(exc))
                notes.append(f"{variant.name} T1={t1:g} T2={t2:g} skipped: {why}")
                continue
            out.append(replace(variant, name=f"{variant.name} T1={t1:g} T2={t2:g}", policy=changed))
    return out, notes


def _rule_messages(exc: ValidationError) -> list[str]:
    """The policy rules' own messages (they travel in the error context)."""
    out: list[str] = []
    for error in exc.errors():
        problems = (error.get("ctx") or {}).get("problems")
        if problems:
            out.extend(str(message) for _, message in problems)
        else:
            out.append(str(error["msg"]))
    return out


_METRICS: tuple[str, ...] = (
    "hp_p50_impact_pct",
    "hp_p99_impact_pct",
    "hp_throughput_loss_pct",
    "lp_p50_impact_pct",
    "lp_p99_impact_pct",
    "lp_throughput_loss_pct",
    "brake_events",
    "peak_pct",
    "uncapped_peak_pct",
    "capped_time_pct",
    "capping_events",
)
"""The numbers of a point that vary between seeds (``plan_point``'s, less the sizes)."""


def _collapsed_point(scenario: Scenario, reason: str) -> dict[str, Any]:
    """A point whose run collapsed: no metrics, the reason."""
    return {
        "oversubscription_pct": 100.0 * (scenario.servers / scenario.base_servers - 1.0),
        "servers": scenario.servers,
        **dict.fromkeys(_METRICS),
        "collapsed": reason,
    }


def _seed_points(
    scenario: Scenario,
    trace: Trace,
    variants: Sequence[Variant],
    feed_failure: failover.FeedFailure | None = None,
) -> list[dict[str, Any]]:
    """Every variant at one ratio and seed, against one shared uncapped run (and, with a
    ``feed_failure``, that failure replayed on each variant's capped run)."""
    if feed_failure is not None:  # a window's throughput needs the work per step
        scenario = replace(scenario, record_work=True)
    try:
        base = run_once(scenario, trace, None)
    except SimCollapsedError as exc:
        return [_collapsed_point(scenario, f"uncapped reference {exc}") for _ in variants]
    out = []
    for v in variants:
        s = replace(scenario, control=v.control)
        try:
            capped = run_once(s, trace, v.policy)
        except SimCollapsedError as exc:
            out.append(_collapsed_point(s, str(exc)))
            continue
        point = plan_point(summarize(s, trace, capped, base, policy_file=v.policy_file))
        if feed_failure is not None:
            point["feed_failure"] = failover.replay(
                feed_failure, s, trace, v.policy, normal=capped, base=base
            )
        out.append(point)
    return out


def _ratio_task(
    scenario: Scenario,
    trace: Trace,
    variants: Sequence[Variant],
    seeds: Sequence[int],
    feed_failure: failover.FeedFailure | None = None,
) -> list[list[dict[str, Any]]]:
    """Every variant at one ratio, for each seed: ``[seed][variant]`` points."""
    return [
        _seed_points(replace(scenario, seed=seed), trace, variants, feed_failure) for seed in seeds
    ]


def merge_seeds(
    ratio: float, per_seed: Sequence[dict[str, Any]], seeds: Sequence[int], slo: Slo
) -> dict[str, Any]:
    """One variant's point at one ratio over its seeds: the mean of each metric, its spread
    (min, max), and the violations of every seed (a pass needs every seed to pass)."""
    first = per_seed[0]
    point: dict[str, Any] = {
        "ratio": ratio,
        "oversubscription_pct": first["oversubscription_pct"],
        "servers": first["servers"],
        "seeds": list(seeds),
    }
    collapsed = [
        (seed, p["collapsed"])
        for seed, p in zip(seeds, per_seed, strict=True)
        if p.get("collapsed")
    ]
    if collapsed:
        point.update(dict.fromkeys(_METRICS))
        seed, why = collapsed[0]
        point["collapsed"] = f"seed {seed}: {why}" if len(seeds) > 1 else why
        point["violations"] = point_violations(point, slo)
        return point
    spread: dict[str, list[float]] = {}
    for key in _METRICS:
        values = [float(p[key]) for p in per_seed if p[key] is not None]
        point[key] = sum(values) / len(values) if values else None
        if values:
            spread[key] = [min(values), max(values)]
    point["spread"] = spread
    failures = [p["feed_failure"] for p in per_seed if "feed_failure" in p]
    if failures:
        point["feed_failure"] = failover.merge_seeds(failures, list(seeds))
    if len(seeds) > 1:
        point["by_seed"] = [
            {key: p[key] for key in (*_METRICS, "feed_failure") if key in p} for p in per_seed
        ]
    point["violations"] = point_violations(point, slo)
    return point


ProgressFn = Callable[[int, int, float, float], None]
"""``(done, total, ratio, seconds)`` after each ratio finished."""
PointFn = Callable[[float, list[tuple[str, dict[str, Any]]]], None]
"""``(ratio, [(variant name, point), ...])`` as soon as points finished (partial results)."""


def _check_inputs(variants: Sequence[Variant], ratios: Sequence[float], seeds: int) -> None:
    if not variants:
        msg = "a plan needs at least one policy"
        raise SimConfigError(msg)
    if not ratios:
        msg = "a plan needs at least one oversubscription ratio"
        raise SimConfigError(msg)
    if seeds < 1:
        msg = f"seeds must be at least 1, got {seeds}"
        raise SimConfigError(msg)


Task = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]
"""A call to make in a worker: (function, positional arguments, keyword arguments)."""


def _run_tasks(
    tasks: dict[Any, Task],
    *,
    jobs: int,
    finished: Callable[[Any, Any], None],
) -> None:
    """Run each ``key: (fn, args, kwargs)`` in ``jobs`` spawned processes (inline when one),
    handing every result to ``finished(key, result)`` as it completes. An interrupt (^C)
    cancels what has not started; what finished has been handed over."""
    if jobs > 1 and len(tasks) > 1:
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"))
        try:
            futures = {pool.submit(fn, *a, **kw): key for key, (fn, a, kw) in tasks.items()}
            for future in as_completed(futures):
                finished(futures[future], future.result())
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    else:
        for key, (fn, a, kw) in tasks.items():
            finished(key, fn(*a, **kw))


def run_plan(
    scenario: Scenario,
    trace: Trace,
    variants: Sequence[Variant],
    *,
    ratios: Sequence[float],
    slo: Slo,
    jobs: int = 1,
    seeds: int = 1,
    progress: ProgressFn | None = None,
    on_point: PointFn | None = None,
    feed_failure: failover.FeedFailure | None = None,
) -> dict[str, Any]:
    """Sweep ``ratios`` for every variant; JSON-able result with each variant's best point.

    With ``seeds`` > 1 every point runs that many workload seeds (from the scenario's):
    the metrics are their means with the spread, and a point passes only when every seed
    does. A run that collapses (``SimCollapsedError``) is a failing point that says why.
    """
    _check_inputs(variants, ratios, seeds)
    ratios = sorted(set(ratios))
    seed_list = [scenario.seed + i for i in range(seeds)]
    merged: dict[float, list[dict[str, Any]]] = {}
    started_s = time.monotonic()

    def finished(ratio: float, raw: list[list[dict[str, Any]]]) -> None:
        merged[ratio] = [
            merge_seeds(ratio, [raw[s][i] for s in range(seeds)], seed_list, slo)
            for i in range(len(variants))
        ]
        if on_point is not None:
            on_point(ratio, [(v.name, p) for v, p in zip(variants, merged[ratio], strict=True)])
        if progress is not None:
            progress(len(merged), len(ratios), ratio, time.monotonic() - started_s)

    tasks: dict[Any, Task] = {
        r: (
            _ratio_task,
            (scenario.with_oversubscription(r), trace, variants, seed_list, feed_failure),
            {},
        )
        for r in ratios
    }
    _run_tasks(tasks, jobs=jobs, finished=finished)
    result_variants = [
        variant_result(v, [merged[r][i] for r in ratios], slo) for i, v in enumerate(variants)
    ]
    return {
        "slo": asdict(slo),
        "base_servers": scenario.base_servers,
        "ratios": list(ratios),
        "seeds": seed_list,
        **_failure_inputs(scenario, feed_failure),
        "scenarios": result_variants,
    }


def _failure_inputs(
    scenario: Scenario, feed_failure: failover.FeedFailure | None
) -> dict[str, Any]:
    """The plan's ``feed_failure`` key: the replay's inputs (nothing without one)."""
    if feed_failure is None:
        return {}
    budget_w = row_config(scenario.with_oversubscription(0.0)).budget_w
    return {"feed_failure": feed_failure.inputs(budget_w)}


def _bisect_variant(
    scenario: Scenario,
    trace: Trace,
    variant: Variant,
    ratios: Sequence[float],
    *,
    seeds: Sequence[int],
    slo: Slo,
    feed_failure: failover.FeedFailure | None = None,
) -> list[dict[str, Any]]:
    """The points one variant's bisection evaluates over the sorted grid ``ratios``:
    both ends, then the middle of the passing/failing bracket until it closes."""
    evaluated: dict[int, dict[str, Any]] = {}

    def passes(i: int) -> bool:
        task = scenario.with_oversubscription(ratios[i])
        raw = _ratio_task(task, trace, [variant], seeds, feed_failure)
        evaluated[i] = merge_seeds(ratios[i], [raw[s][0] for s in range(len(seeds))], seeds, slo)
        return not evaluated[i]["violations"]

    last = len(ratios) - 1
    if passes(0) and last > 0 and not passes(last):
        low, high = 0, last  # low passes, high fails
        while high - low > 1:
            mid = (low + high) // 2
            if passes(mid):
                low = mid
            else:
                high = mid
    return [evaluated[i] for i in sorted(evaluated)]


def bisect_plan(
    scenario: Scenario,
    trace: Trace,
    variants: Sequence[Variant],
    *,
    ratios: Sequence[float],
    slo: Slo,
    jobs: int = 1,
    seeds: int = 1,
    progress: ProgressFn | None = None,
    on_point: PointFn | None = None,
    feed_failure: failover.FeedFailure | None = None,
) -> dict[str, Any]:
    """``run_plan``'s answer from O(log n) of the grid's points per variant.

    It assumes what the grid's prefix rule also trusts: meeting the SLOs is monotone in
    the ratio (more servers never make things better). It evaluates the lowest and the
    highest ratio, then halves the bracket between the last pass and the first failure
    until they are neighbours on the grid; the answer is the grid's, with fewer runs (each
    variant against its own uncapped references). Variants run in ``jobs`` processes.
    """
    _check_inputs(variants, ratios, seeds)
    grid = sorted(set(ratios))
    seed_list = [scenario.seed + i for i in range(seeds)]
    started_s = time.monotonic()
    results: dict[int, list[dict[str, Any]]] = {}

    def finished(i: int, points: list[dict[str, Any]]) -> None:
        results[i] = points
        if on_point is not None:
            for point in points:
                on_point(point["ratio"], [(variants[i].name, point)])
        if progress is not None:
            progress(len(results), len(variants), points[-1]["ratio"], time.monotonic() - started_s)

    tasks: dict[Any, Task] = {
        i: (
            _bisect_variant,
            (scenario, trace, v, grid),
            {"seeds": seed_list, "slo": slo, "feed_failure": feed_failure},
        )
        for i, v in enumerate(variants)
    }
    _run_tasks(tasks, jobs=jobs, finished=finished)
    result_variants = [variant_result(v, results[i], slo) for i, v in enumerate(variants)]
    return {
        "slo": asdict(slo),
        "base_servers": scenario.base_servers,
        "ratios": grid,
        "search": "bisect",
        "seeds": seed_list,
        **_failure_inputs(scenario, feed_failure),
        "scenarios": result_variants,
    }


def render_text(plan: dict[str, Any]) -> str:
    """A table per variant and its recommendation."""
    lines = []
    for v in plan["scenarios"]:
        lines.append(f"{v['name']} (actuation {v['control']['actuation_delay_s']:g} s):")
        lines.append(
            "  over%  servers  hpP50%  hpP99%  lpP50%  lpP99%  lpLoss%  brakes  peak%  capped%"
        )
        for p in v["points"]:
            mark = "ok" if not p["violations"] else "; ".join(p["violations"])
            lines.append(
                f"  {p['oversubscription_pct']:5.1f}  {p['servers']:7d}  "
                f"{_fmt(p['hp_p50_impact_pct'])}  {_fmt(p['hp_p99_impact_pct'])}  "
                f"{_fmt(p['lp_p50_impact_pct'])}  {_fmt(p['lp_p99_impact_pct'])}  "
                f"{_fmt(p['lp_throughput_loss_pct'], 7)}  {_fmt(p['brake_events'], 6, 0)}  "
                f"{_fmt(p['peak_pct'], 5, 1)}  {_fmt(p['capped_time_pct'], 7, 1)}  {mark}"
            )
        if "feed_failure" in plan:
            lines.extend(failover.render_lines(v, plan["feed_failure"]))
        lines.extend(_verdict(v, plan))
    return "\n".join(lines) + "\n"


def _verdict(variant: dict[str, Any], plan: dict[str, Any]) -> list[str]:
    """The recommendation, and what to sweep next when the grid's edge decided it."""
    best, points = variant["best"], variant["points"]
    seeds = len(plan.get("seeds", [0]))
    over = f" in every one of {seeds} seeds" if seeds > 1 else ""
    if best is None:
        low = points[0]
        lines = [
            f"  -> no swept deployment meets the SLOs{over}: the lowest swept, "
            f"{low['oversubscription_pct']:+.1f}% ({low['servers']} servers), already misses "
            f"({'; '.join(low['violations'])}); sweep lower ratios"
        ]
        if "feed_failure" in plan:
            lines.append(
                f"     (without the feed check: "
                f"{variant['best_servers_without_feed_failure']} servers)"
            )
        return lines
    lines = [
        f"  -> {best['servers']} servers ({best['oversubscription_pct']:+.1f}% over "
        f"{plan['base_servers']}) meet the SLOs{over} with "
        f"{best['brake_events']:.0f} brake events"
    ]
    if "feed_failure" in plan:
        ff = plan["feed_failure"]
        lines.append(
            f"     and stay under the surviving {ff['survivor_w'] / 1000:.1f} kW after a feed's "
            f"loss with zero reserved power (without the feed check: "
            f"{variant['best_servers_without_feed_failure']} servers)"
        )
    if best is points[-1]:
        lines.append("     (the highest swept ratio: the frontier may lie beyond; sweep higher)")
    return lines


def _fmt(value: float | None, width: int = 6, digits: int = 2) -> str:
    if value is None or math.isnan(value):
        return f"{'-':>{width}}"
    return f"{value:{width}.{digits}f}"


__all__ = [
    "Slo",
    "Variant",
    "best_point",
    "bisect_plan",
    "merge_seeds",
    "plan_point",
    "point_violations",
    "render_text",
    "run_plan",
    "threshold_variants",
    "variant_result",
]
