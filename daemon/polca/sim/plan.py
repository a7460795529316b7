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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from typing import Any

from pydantic import ValidationError

from polca.policy import Policy
from polca.sim.model import ControlConfig, SimConfigError
from polca.sim.scenario import Scenario, run_once, summarize
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


def best_point(points: Sequence[dict[str, Any]], slo: Slo) -> dict[str, Any] | None:
    """The largest-ratio point such that it and every smaller one meet ``slo``; or None."""
    best = None
    for point in sorted(points, key=lambda p: p["oversubscription_pct"]):
        if slo.violations(point):
            break
        best = point
    return best


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


def _ratio_task(
    scenario: Scenario, trace: Trace, variants: Sequence[Variant]
) -> list[dict[str, Any]]:
    """Every variant at one ratio, against one shared uncapped run."""
    base = run_once(scenario, trace, None)
    out = []
    for v in variants:
        s = replace(scenario, control=v.control)
        capped = run_once(s, trace, v.policy)
        out.append(plan_point(summarize(s, trace, capped, base, policy_file=v.policy_file)))
    return out


def run_plan(
    scenario: Scenario,
    trace: Trace,
    variants: Sequence[Variant],
    *,
    ratios: Sequence[float],
    slo: Slo,
    jobs: int = 1,
) -> dict[str, Any]:
    """Sweep ``ratios`` for every variant; JSON-able result with each variant's best point."""
    if not variants:
        msg = "a plan needs at least one policy"
        raise SimConfigError(msg)
    if not ratios:
        msg = "a plan needs at least one oversubscription ratio"
        raise SimConfigError(msg)
    ratios = sorted(set(ratios))
    tasks = [scenario.with_oversubscription(r) for r in ratios]
    if jobs > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            per_ratio = list(
                pool.map(_ratio_task, tasks, [trace] * len(tasks), [variants] * len(tasks))
            )
    else:
        per_ratio = [_ratio_task(t, trace, variants) for t in tasks]
    result_variants = []
    for i, v in enumerate(variants):
        points = []
        for ratio, row in zip(ratios, per_ratio, strict=True):
            point = {"ratio": ratio, **row[i]}
            point["violations"] = slo.violations(point)
            points.append(point)
        best = best_point(points, slo)
        result_variants.append(
            {
                "name": v.name,
                "policy": v.policy.name,
                "policy_file": v.policy_file,
                "control": asdict(v.control),
                "points": points,
                "best": best,
                "best_servers": best["servers"] if best else None,
            }
        )
    return {
        "slo": asdict(slo),
        "base_servers": scenario.base_servers,
        "ratios": list(ratios),
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
                f"{_fmt(p['lp_throughput_loss_pct'], 7)}  {p['brake_events']:6.0f}  "
                f"{p['peak_pct']:5.1f}  {p['capped_time_pct']:7.1f}  {mark}"
            )
        best = v["best"]
        if best is None:
            lines.append("  -> no swept deployment meets the SLOs")
        else:
            lines.append(
                f"  -> {best['servers']} servers (+{best['oversubscription_pct']:.1f}% over "
                f"{plan['base_servers']}) meet the SLOs with "
                f"{best['brake_events']:.0f} brake events"
            )
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, width: int = 6) -> str:
    return f"{'-':>{width}}" if value is None or math.isnan(value) else f"{value:{width}.2f}"


__all__ = [
    "Slo",
    "Variant",
    "best_point",
    "plan_point",
    "render_text",
    "run_plan",
    "threshold_variants",
]
