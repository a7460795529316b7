"""A feed's loss replayed on a Flex row: how many servers with zero reserved power.

A Flex row (Microsoft's Flex, ISCA 2021) is fed by two feeds (A and B), each rated below
the row's budget: the half of a 2N design that is normally held in reserve is given to
servers, and when one feed fails the row is capped to what the survivor carries. polca's
aggregator does that on its fast path (``aggregator/budgets.py``): the row runs on the
least of its budget and the ratings of its feeds that are up, from its next step after
the meter's reading shows the feed down. ``polca plan --feed-failure`` asks how many
servers such a row holds: sized against both feeds together, relying on that cut when
one fails.

The loss is nothing but a budget that changes at a time (``model.BudgetCut``), replayed
by the same runner, engine and brake as every other run (``runner.run``): at the loss the
electrical limit (what the brake guards, and what the breaker of the surviving feed
carries) falls to the survivors' rating; ``failover_s`` later (the meter's poll plus one
control step) the controller runs on it, with one control step at that moment, and its
caps reach the servers after the actuation delay, as always. Until the loss the replay is
the point's own capped run, step for step (the same requests, seed and engine).

The failover window runs from the loss to the first step that a cap decided at
``failover_s`` can act on (the runner applies a command at the next step; with no
actuation delay, that same step). In it the row keeps its full budget, and its power over
the survivor is what the surviving feed's breaker must tolerate for those seconds (its
trip curve, which polca does not model: the peak and the time over are reported). After
it, until the feed is back (``outage_s``) or the run ends, any power over the survivor is
the trip the cut exists to avoid: a point with any fails.

"The worst moment" (``at_s=None``) is where the row draws the most: the start of the
failover-long interval with the highest mean row power of the point's own capped run
after warm-up (the same run the replay follows up to the loss). That is when the most
power runs over the survivor while nothing can cap yet, and when the cut has the most to
shed; the moment that costs the most latency would need a replay per candidate moment,
and is not guaranteed to be the one that trips (a given ``at_s`` checks any other).

What it must not do: run anything but ``scenario.run_once``: no second simulator.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from polca.errors import SimCollapsedError
from polca.policy import Policy
from polca.sim import report
from polca.sim.model import BudgetCut, SimConfigError
from polca.sim.runner import RunResult
from polca.sim.scenario import Scenario, run_once
from polca.workload.trace import Trace

MAX_FEED_W = 1e10  # 10 GW, the site file's bound on a rating
MAX_FEEDS = 64
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class FeedFailure:
    """What to replay: one of ``feeds`` feeds of ``feed_w`` each lost at ``at_s``."""

    feed_w: float  # each feed's rating
    feeds: int = 2
    # From the loss until the controller runs on the cut budget: the meter's poll (1 s)
    # plus the aggregator's step (1 s) when the breaker reports the trip.
    failover_s: float = 2.0
    at_s: float | None = None  # None: the worst moment (the highest row power)
    outage_s: float | None = None  # None: the feed stays down to the end of the run

    def survivor_w(self, budget_w: float) -> float:
        """What the row runs on with one feed down: the survivors' rating, at most its budget."""
        return min(budget_w, (self.feeds - 1) * self.feed_w)

    def inputs(self, budget_w: float) -> dict[str, Any]:
        """The replay's inputs as a plan reports them."""
        return {
            "feed_w": self.feed_w,
            "feeds": self.feeds,
            "budget_w": budget_w,
            "survivor_w": self.survivor_w(budget_w),
            "failover_s": self.failover_s,
            "failure_at": "worst" if self.at_s is None else self.at_s,
            "outage_s": self.outage_s,
        }


def check(spec: FeedFailure, *, budget_w: float, duration_s: float, warmup_s: float) -> None:
    """Refuse a replay that cannot mean anything (``SimConfigError``, one line each)."""
    f = spec.feed_w
    if not (math.isfinite(f) and 0 < f <= MAX_FEED_W):
        msg = f"--feed-w must be a rating above 0 W and at most 10 GW, got {f}"
        raise SimConfigError(msg)
    if not 2 <= spec.feeds <= MAX_FEEDS:
        msg = f"--feeds must be 2 to {MAX_FEEDS} (one feed leaves no survivor), got {spec.feeds}"
        raise SimConfigError(msg)
    if f > budget_w:
        msg = (
            f"--feed-w {f:g} W is above the row's budget of {budget_w:g} W: one feed carries "
            "the whole row, nothing to cut (a Flex row's feeds are each rated below its budget)"
        )
        raise SimConfigError(msg)
    survivors_w = (spec.feeds - 1) * f
    if survivors_w >= budget_w * (1 - _EPS):
        msg = (
            f"the {spec.feeds - 1} surviving feeds of {f:g} W carry {survivors_w:g} W, the "
            f"row's whole budget of {budget_w:g} W: a feed's loss cuts nothing"
        )
        raise SimConfigError(msg)
    if spec.feeds * f < budget_w * (1 - _EPS):
        msg = (
            f"the row's budget of {budget_w:g} W is above what its {spec.feeds} feeds of "
            f"{f:g} W carry together ({spec.feeds * f:g} W): give --budget-w {spec.feeds * f:g} "
            "or less"
        )
        raise SimConfigError(msg)
    span_s = duration_s - warmup_s
    if not (math.isfinite(spec.failover_s) and 0 <= spec.failover_s < span_s):
        msg = (
            f"--failover-s must be >= 0 s and shorter than the run after warm-up "
            f"({span_s:g} s), got {spec.failover_s}"
        )
        raise SimConfigError(msg)
    if spec.at_s is not None and not (
        math.isfinite(spec.at_s) and warmup_s <= spec.at_s < duration_s
    ):
        msg = (
            f"--failure-at must be 'worst' or a time within the run after warm-up "
            f"([{warmup_s:g}, {duration_s:g}) s), got {spec.at_s}"
        )
        raise SimConfigError(msg)
    if spec.outage_s is not None and not (math.isfinite(spec.outage_s) and spec.outage_s > 0):
        msg = f"--outage-s must be a duration above 0 s, got {spec.outage_s}"
        raise SimConfigError(msg)


def worst_moment_s(
    run: RunResult, *, window_s: float, warmup_s: float, latest_s: float | None = None
) -> float:
    """The start of the ``window_s``-long interval (at least a step) with the highest mean
    power of any row of ``run`` after ``warmup_s`` (and starting by ``latest_s``, when that
    leaves any); the earliest on a tie."""
    dt = run.config.step_s
    power = run.row_power_w
    steps = max(1, round(window_s / dt))
    sums = np.cumsum(np.vstack((np.zeros((1, power.shape[1])), power)), axis=0)
    means = (sums[steps:] - sums[:-steps]).max(axis=1)  # index i: steps [i, i + steps)
    first = min(math.ceil(warmup_s / dt - _EPS), len(means) - 1)
    last = len(means) if latest_s is None else math.floor(latest_s / dt + _EPS) + 1
    if last <= first:  # the outage is longer than the run after warm-up: as late as it can
        last = len(means)
    return float(first + int(np.argmax(means[first:last]))) * dt


def replay(
    spec: FeedFailure,
    scenario: Scenario,
    trace: Trace,
    policy: Policy,
    *,
    normal: RunResult,
    base: RunResult,
) -> dict[str, Any]:
    """The feed's loss replayed on ``scenario`` (whose capped run is ``normal`` and
    uncapped reference ``base``, both run with ``record_work``): what it cost, and how far
    over the survivor the row went, in the window and after."""
    budget_w = normal.config.row.budget_w
    if spec.at_s is None:  # an outage of a given length is kept inside the run if it fits
        at_s = worst_moment_s(
            normal,
            window_s=spec.failover_s,
            warmup_s=scenario.warmup_s,
            latest_s=None if spec.outage_s is None else normal.duration_s - spec.outage_s,
        )
    else:
        at_s = spec.at_s
    cut = BudgetCut(
        at_s=at_s,
        budget_w=spec.survivor_w(budget_w),
        known_after_s=spec.failover_s,
        until_s=math.inf if spec.outage_s is None else at_s + spec.outage_s,
    )
    s = replace(scenario, budget_cut=cut, record_work=True)
    try:
        run = run_once(s, trace, policy)
    except SimCollapsedError as exc:
        return {"at_s": at_s, "collapsed": str(exc)}
    return measure(run, base, cut=cut)


def _step(t_s: float, dt: float, n: int) -> int:
    """The first step starting at or after ``t_s``, at most ``n``."""
    if not math.isfinite(t_s):
        return n
    return min(n, math.ceil(t_s / dt - _EPS))


def _runs_s(over: npt.NDArray[np.bool_], dt: float) -> float:
    """The longest run of consecutive True steps of any row, in seconds."""
    longest = 0
    for r in range(over.shape[1]):
        edges = np.diff(np.r_[0, over[:, r].astype(np.int8), 0])
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if len(starts):
            longest = max(longest, int((ends - starts).max()))
    return longest * dt


def _over(power: npt.NDArray[np.float64], survivor_w: float, dt: float) -> dict[str, Any]:
    """Peak and time over ``survivor_w`` of a stretch of steps (the worst row)."""
    if power.size == 0:
        return {
            "peak_w": None,
            "peak_pct_of_survivor": None,
            "over_survivor_s": 0.0,
            "longest_over_survivor_s": 0.0,
        }
    over = power > survivor_w
    peak_w = float(power.max())
    return {
        "peak_w": peak_w,
        "peak_pct_of_survivor": 100.0 * peak_w / survivor_w,
        "over_survivor_s": float(over.sum(axis=0).max()) * dt,
        "longest_over_survivor_s": _runs_s(over, dt),
    }


def _cost(run: RunResult, base: RunResult, k0: int, k1: int) -> dict[str, Any]:
    """What the requests arriving in steps ``[k0, k1)`` paid, per class, against the
    uncapped reference; the throughput loss over those steps."""
    dt = run.config.step_s
    start_s, end_s = k0 * dt - _EPS, k1 * dt - _EPS
    out: dict[str, Any] = {}
    for cls, name in report.CLASS_NAMES.items():

        def latencies(r: RunResult, c: int = cls) -> npt.NDArray[np.float64]:
            """Finished requests' latencies, and the time so far of those still in flight
            at the end (a lower bound: a replay cut short does not flatter the cut)."""
            mask = (r.req_cls == c) & (r.req_arrival_s >= start_s) & (r.req_arrival_s < end_s)
            arrival = r.unfinished_arrival_s
            open_ = (r.unfinished_cls == c) & (arrival >= start_s) & (arrival < end_s)
            so_far = r.duration_s - arrival[open_]
            return np.concatenate((r.req_latency_s[mask], so_far)).astype(np.float64)

        def unfinished(r: RunResult, c: int = cls) -> int:
            arrival = r.unfinished_arrival_s
            mask = (r.unfinished_cls == c) & (arrival >= start_s) & (arrival < end_s)
            return int(np.count_nonzero(mask))

        def drops(r: RunResult, c: int = cls) -> int:
            mask = (r.drop_cls == c) & (r.drop_arrival_s >= start_s) & (r.drop_arrival_s < end_s)
            return int(np.count_nonzero(mask))

        mine, ref = latencies(run), latencies(base)
        p50, p99 = report.percentile(mine, 50), report.percentile(mine, 99)
        b50, b99 = report.percentile(ref, 50), report.percentile(ref, 99)
        out[name] = {
            "requests": len(mine),
            "p50_s": p50,
            "p99_s": p99,
            "uncapped_p50_s": b50,
            "uncapped_p99_s": b99,
            "p50_impact_pct": report.impact_pct(p50, b50),
            "p99_impact_pct": report.impact_pct(p99, b99),
            "throughput_loss_pct": _loss_pct(run, base, cls, k0, k1),
            "dropped": drops(run),
            "uncapped_dropped": drops(base),
            "unfinished": unfinished(run),
            "uncapped_unfinished": unfinished(base),
        }
    return out


def _loss_pct(run: RunResult, base: RunResult, cls: int, k0: int, k1: int) -> float:
    """1 - (work per busy GPU-second, this run) / (the same, uncapped) over ``[k0, k1)``."""
    if len(run.work_log) == 0 or len(base.work_log) == 0 or k1 <= k0:
        return math.nan

    def speed(log: npt.NDArray[np.float64]) -> float:
        busy, work = log[k1, cls] - log[k0, cls]
        return float(work / busy) if busy > _EPS else 1.0

    mine, ref = speed(run.work_log), speed(base.work_log)
    return 100.0 * (1.0 - mine / ref) if ref > 0 else 0.0


def measure(run: RunResult, base: RunResult, *, cut: BudgetCut) -> dict[str, Any]:
    """The failure replay ``run`` (with ``cut``) against its uncapped reference ``base``."""
    cfg = run.config
    dt, n = cfg.step_s, len(run.row_power_w)
    k_at = _step(cut.at_s, dt, n)
    k_known = _step(cut.at_s + cut.known_after_s, dt, n)
    lag = 1 if cfg.control.actuation_delay_s > _EPS else 0  # a command acts at the next step
    k_win = min(n, k_known + lag)
    k_end = max(k_win, _step(cut.until_s, dt, n))
    at_s, win_s, end_s = (round(k * dt, 9) for k in (k_at, k_win, k_end))  # on the step grid
    survivor_w = cut.budget_w
    power = run.row_power_w
    after = _over(power[k_win:k_end], survivor_w, dt)
    over_after = power[k_win:k_end] > survivor_w
    first_over = np.flatnonzero(over_after.any(axis=1)) if over_after.size else np.zeros(0)
    after["first_over_survivor_after_loss_s"] = (
        float(k_win - k_at + int(first_over[0])) * dt if len(first_over) else None
    )
    ticks_after = run.tick_s >= at_s
    levels = run.level[ticks_after]
    top = int(levels.max()) if levels.size else 0
    brakes = [b for b in run.brakes if b.fired_s >= at_s]
    return {
        "at_s": at_s,
        "known_at_s": round(k_known * dt, 9),
        "window_end_s": win_s,
        "window_s": round(win_s - at_s, 9),
        "outage_end_s": end_s,
        "outage_to_end_of_run": k_end >= n,
        "survivor_w": survivor_w,
        "power_at_loss_w": float(power[k_at].max()) if k_at < n else None,
        "window": {
            "start_s": at_s,
            "end_s": win_s,
            **_over(power[k_at:k_win], survivor_w, dt),
            "cost": _cost(run, base, k_at, k_win),
        },
        "after": {
            "start_s": win_s,
            "end_s": end_s,
            "duration_s": round(end_s - win_s, 9),
            **after,
            "cost": _cost(run, base, k_win, k_end),
        },
        # From the loss on, as a breaker's trip curve would be read: the longest time over.
        "longest_over_survivor_s": _runs_s(power[k_at:k_end] > survivor_w, dt),
        "top_level": run.level_names[min(top, len(run.level_names) - 1)],
        "brake_events": len(brakes),
        "brakes": [asdict(b) for b in brakes],
    }


def violations(block: dict[str, Any] | None) -> list[str]:
    """Why a point's replay fails: power over the survivor after the failover window."""
    if block is None:
        return []
    if block.get("collapsed"):
        return [f"feed failure: collapsed ({block['collapsed']})"]
    after = block["after"]
    if after["over_survivor_s"] > 0:
        return [
            f"feed failure: over the surviving {block['survivor_w'] / 1000:.1f} kW for "
            f"{after['over_survivor_s']:.1f} s after the failover (peak "
            f"{after['peak_pct_of_survivor']:.1f}%)"
        ]
    return []


def _severity(block: dict[str, Any]) -> tuple[int, float, float]:
    if block.get("collapsed"):
        return (1, math.inf, math.inf)
    return (0, block["after"]["over_survivor_s"], block["window"]["peak_w"] or 0.0)


def merge_seeds(blocks: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """One point's replay over its seeds: the worst seed's (collapsed, then the most time
    over the survivor after the failover, then the highest peak in the window), with the
    seed named and every seed's in ``by_seed``."""
    if len(blocks) == 1:
        return blocks[0]
    worst = max(range(len(blocks)), key=lambda i: _severity(blocks[i]))
    return {**blocks[worst], "worst_seed": seeds[worst], "by_seed": blocks}


def render_lines(variant: dict[str, Any], inputs: dict[str, Any]) -> list[str]:
    """The replay's table for one variant of a plan."""
    when = (
        "the worst moment (the highest row power)"
        if inputs["failure_at"] == "worst"
        else f"t={inputs['failure_at']:g} s"
    )
    outage = (
        "to the end of the run" if inputs["outage_s"] is None else f"for {inputs['outage_s']:g} s"
    )
    lines = [
        f"  feed failure: 1 of {inputs['feeds']} feeds of {inputs['feed_w'] / 1000:.1f} kW "
        f"lost at {when}, {outage}; the row runs on the survivor's "
        f"{inputs['survivor_w'] / 1000:.1f} kW (budget {inputs['budget_w'] / 1000:.1f} kW) "
        f"{inputs['failover_s']:g} s after the loss",
        "  servers  loss s | window s  peak%  over s | after s  over s  peak% "
        "| hpP99% win/after  lpLoss% win/after  brakes  top",
    ]
    for p in variant["points"]:
        block = p.get("feed_failure")
        if block is None:
            lines.append(f"  {p['servers']:7d}  (no replay: {p.get('collapsed') or 'none'})")
            continue
        if block.get("collapsed"):
            lines.append(
                f"  {p['servers']:7d}  {block['at_s']:6.0f} | collapsed: {block['collapsed']}"
            )
            continue
        w, a = block["window"], block["after"]
        mark = "; ".join(violations(block)) or "ok"
        lines.append(
            f"  {p['servers']:7d}  {block['at_s']:6.0f} | {block['window_s']:8.1f}  "
            f"{_f(w['peak_pct_of_survivor'], 5, 1)}  {w['over_survivor_s']:6.1f} | "
            f"{a['duration_s']:7.0f}  {a['over_survivor_s']:6.1f}  "
            f"{_f(a['peak_pct_of_survivor'], 5, 1)} | "
            f"{_f(w['cost']['high']['p99_impact_pct'], 6)} / "
            f"{_f(a['cost']['high']['p99_impact_pct'], 7)}  "
            f"{_f(w['cost']['low']['throughput_loss_pct'], 6)} / "
            f"{_f(a['cost']['low']['throughput_loss_pct'], 6)}  "
            f"{block['brake_events']:6d}  {block['top_level']}  {mark}"
        )
    return lines


def _f(value: float | None, width: int, digits: int = 2) -> str:
    if value is None or not math.isfinite(value):
        return f"{'-':>{width}}"
    return f"{value:{width}.{digits}f}"


__all__ = [
    "FeedFailure",
    "check",
    "measure",
    "merge_seeds",
    "render_lines",
    "replay",
    "violations",
    "worst_moment_s",
]
