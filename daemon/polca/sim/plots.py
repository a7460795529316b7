"""PNG plots of simulations and plans (matplotlib, the optional ``polca[sim]`` extra).

Importing this module imports matplotlib (with the non-interactive Agg backend), so
callers import it lazily and carry on without plots when it is missing. Figures are
small on purpose (they go into docs/img/ when they are under 300 KB).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib as mpl

mpl.use("Agg")

import matplotlib.pyplot as plt  # the backend is chosen first
import numpy as np
from matplotlib.figure import Figure

from polca.sim import published
from polca.sim.model import SimGpu
from polca.sim.runner import RunResult
from polca.sim.workload import HP, LP

_DPI = 90
_CLASS_STYLE = {HP: ("high", "tab:red"), LP: ("low", "tab:blue")}


def power_plot(path: Path, capped: RunResult, base: RunResult, *, row: int = 0) -> None:
    """Row power (capped, uncapped) against the thresholds, over the level timeline."""
    cfg = capped.config
    per = max(1, round(1.0 / cfg.step_s))  # 1 s averages
    whole = (len(capped.row_power_w) // per) * per
    budget = cfg.row.budget_w
    t_min = (np.arange(whole // per) + 1) * per * cfg.step_s / 60.0
    pct = 100.0 * capped.row_power_w[:whole, row].reshape(-1, per).mean(axis=1) / budget
    pct_b = 100.0 * base.row_power_w[:whole, row].reshape(-1, per).mean(axis=1) / budget
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 4.8), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    top.plot(t_min, pct_b, color="0.7", linewidth=0.7, label="uncapped")
    top.plot(t_min, pct, color="tab:blue", linewidth=0.8, label=f"capped ({capped.policy_name})")
    for name, threshold in zip(capped.level_names[1:], capped.threshold_pcts, strict=True):
        top.axhline(threshold, color="tab:orange", linestyle="--", linewidth=0.7)
        top.text(t_min[-1], threshold, f" {name}", va="center", fontsize=7, color="tab:orange")
    top.axhline(100.0, color="tab:red", linewidth=0.9)
    for brake in capped.brakes:
        if brake.row == row:
            top.axvline(brake.fired_s / 60.0, color="tab:red", linestyle=":", linewidth=0.8)
    top.set_ylabel("row power, % of budget")
    top.legend(loc="lower left", fontsize=7)
    top.set_title(
        f"{cfg.row.servers} x {cfg.row.gpu.name} servers, budget {budget / 1000:.0f} kW, "
        f"actuation {cfg.control.actuation_delay_s:g} s, {len(capped.brakes)} brake events",
        fontsize=9,
    )
    if len(capped.tick_s):
        bottom.step(capped.tick_s / 60.0, capped.level[:, row], where="post", color="tab:purple")
    bottom.set_yticks(range(len(capped.level_names)), capped.level_names, fontsize=7)
    bottom.set_xlabel("time, minutes")
    bottom.set_ylabel("level", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)


def latency_plot(path: Path, capped: RunResult, base: RunResult, *, warmup_s: float) -> None:
    """``latency_figure`` as a PNG."""
    fig = latency_figure(capped, base, warmup_s=warmup_s)
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)


def latency_figure(capped: RunResult, base: RunResult, *, warmup_s: float) -> Figure:
    """Left: latency CDFs per class, capped (solid) against uncapped (dashed), log scale.
    Right: the impact per percentile (capped over uncapped, %), on a linear scale, where
    the few percent the SLOs are about show (the SLO percentiles marked)."""
    fig, (ax, impact) = plt.subplots(1, 2, figsize=(10, 4))
    percentiles = np.linspace(1.0, 99.9, 200)
    for cls in (HP, LP):
        name, color = _CLASS_STYLE[cls]
        sorted_lat = {}
        for result, style, label in ((capped, "-", "capped"), (base, "--", "uncapped")):
            mask = (result.req_cls == cls) & (result.req_arrival_s >= warmup_s)
            lat = np.sort(result.req_latency_s[mask])
            if not len(lat):
                continue
            sorted_lat[label] = lat
            # At most ~2,000 points per curve keeps the PNG small.
            take = np.unique(np.linspace(0, len(lat) - 1, min(len(lat), 2000)).astype(int))
            cdf = (take + 1) / len(lat)
            ax.plot(lat[take], cdf, style, color=color, linewidth=1, label=f"{name} {label}")
        if len(sorted_lat) == 2:
            capped_p = np.percentile(sorted_lat["capped"], percentiles)
            base_p = np.percentile(sorted_lat["uncapped"], percentiles)
            with np.errstate(divide="ignore", invalid="ignore"):
                pct = np.where(base_p > 0, 100.0 * (capped_p / base_p - 1.0), np.nan)
            impact.plot(percentiles, pct, color=color, linewidth=1, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("request latency, s (arrival to last token)")
    ax.set_ylabel("fraction of requests")
    ax.axhline(0.5, color="0.8", linewidth=0.6)
    ax.axhline(0.99, color="0.8", linewidth=0.6)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"latency by class, {capped.policy_name}", fontsize=9)
    for q in (50, 99):
        impact.axvline(q, color="0.8", linewidth=0.6)
    impact.axhline(0.0, color="0.5", linewidth=0.6)
    impact.set_xlabel("percentile of request latency")
    impact.set_ylabel("latency impact, % (capped vs uncapped)")
    impact.set_title("impact per percentile (linear)", fontsize=9)
    impact.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def frontier_plot(path: Path, plan: dict[str, Any]) -> None:
    """``frontier_figure`` as a PNG."""
    fig = frontier_figure(plan)
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)


def frontier_figure(plan: dict[str, Any]) -> Figure:
    """Per variant: every SLO metric and brake events against oversubscription.

    Each panel's scale stops at 4x its limit; points beyond are drawn on the top edge
    (with a caret), so a collapse at high oversubscription does not flatten the region
    where the limits bind.
    """
    slo = plan["slo"]
    panels = (
        ("hp_p50_impact_pct", "high-priority P50 impact, %", slo["hp_p50_pct"]),
        ("hp_p99_impact_pct", "high-priority P99 impact, %", slo["hp_p99_pct"]),
        ("lp_throughput_loss_pct", "low-priority throughput loss, %", slo["lp_loss_pct"]),
        ("lp_p50_impact_pct", "low-priority P50 impact, %", slo["lp_p50_pct"]),
        ("lp_p99_impact_pct", "low-priority P99 impact, %", slo["lp_p99_pct"]),
        ("brake_events", "brake events", float(slo["max_brakes"])),
    )
    fig, axes = plt.subplots(2, 3, figsize=(11, 6))
    for ax, (key, label, limit) in zip(axes.ravel(), panels, strict=True):
        top = max(4.0 * limit, 4.0)
        for variant in plan["scenarios"]:
            points = variant["points"]
            xs = np.array([p["oversubscription_pct"] for p in points])
            ys = np.array([np.nan if p[key] is None else p[key] for p in points], dtype=float)
            shown = np.minimum(ys, top)
            (line,) = ax.plot(
                xs, shown, marker="o", markersize=3, linewidth=1, label=variant["name"]
            )
            over = ys > top
            if over.any():
                ax.plot(xs[over], shown[over], "^", color=line.get_color(), markersize=6)
            collapsed = np.array([bool(p.get("collapsed")) for p in points])
            if collapsed.any():
                ax.plot(
                    xs[collapsed],
                    np.full(int(collapsed.sum()), top),
                    "x",
                    color=line.get_color(),
                    markersize=7,
                )
            best = variant["best"]
            if best is not None:
                ax.axvline(
                    best["oversubscription_pct"],
                    color=line.get_color(),
                    linestyle=":",
                    linewidth=0.9,
                )
        ax.axhline(limit, color="tab:red", linewidth=0.8)
        ax.set_ylim(-0.05 * top, top * 1.05)
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=8)
    for ax in axes[1]:
        ax.set_xlabel("oversubscription, % more servers", fontsize=8)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    # The legend goes under the panels, never over the data.
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=7)
    fig.suptitle(
        "capacity frontier: red = SLO limit, dotted = largest deployment meeting every SLO, "
        "^ = off scale, x = collapsed",
        fontsize=9,
    )
    rows_of_legend = -(-len(labels) // 4)
    fig.tight_layout(rect=(0.0, 0.04 * rows_of_legend + 0.02, 1.0, 1.0))
    return fig


def agreement_plot(
    path: Path,
    daemons: tuple[list[float], list[float], list[int]],
    simulator: dict[str, Any],
    *,
    budget_w: float,
    level_names: list[str],
    title: str,
) -> None:
    """Row power and level of the daemons' run (``daemons``: seconds, W, level) against
    the simulator's replay of the same uncapped load (``agreement``'s series)."""
    t0 = simulator["t0"]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 4.8), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    t_sim = np.asarray(simulator["t_s"]) / 60.0
    t_run = (np.asarray(daemons[0]) - t0) / 60.0
    top.plot(t_sim, 100.0 * np.asarray(simulator["uncapped_w"]) / budget_w, color="0.7",
             linewidth=0.7, label="uncapped (the same load)")  # fmt: skip
    top.plot(t_run, 100.0 * np.asarray(daemons[1]) / budget_w, color="tab:blue",
             linewidth=0.9, label="daemons (aggregator, agents, Mosquitto)")  # fmt: skip
    top.plot(t_sim, 100.0 * np.asarray(simulator["row_w"]) / budget_w, color="tab:orange",
             linewidth=0.9, linestyle="--", label="simulator (history replay)")  # fmt: skip
    top.axhline(100.0, color="tab:red", linewidth=0.9)
    top.set_ylabel("row power, % of budget")
    top.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    bottom.step(t_run, daemons[2], where="post", color="tab:blue", linewidth=0.9)
    bottom.step(t_sim, simulator["level"], where="post", color="tab:orange", linestyle="--",
                linewidth=0.9)  # fmt: skip
    bottom.set_yticks(range(len(level_names)), level_names, fontsize=7)
    bottom.set_xlabel("time, minutes")
    bottom.set_ylabel("level", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)


def published_plot(
    path: Path, fits: list[tuple[SimGpu, SimGpu, tuple[published.Point, ...]]]
) -> None:
    """The shipped and the re-fitted model of each GPU against the published points that
    name it (``polca.sim.published``): time against the SM clock, decode time against a
    power limit, decode power against the batch. ``fits``: (shipped, fitted, points)."""
    kinds = ("clock_latency", "decode_limit_latency", "decode_power")
    present = [k for k in kinds if any(p.kind == k for _, _, pts in fits for p in pts)]
    fig, axes = plt.subplots(1, len(present), figsize=(4.0 * len(present), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], present, strict=True):
        for index, (shipped, fitted, points) in enumerate(fits):
            mine = [p for p in points if p.kind == kind]
            if not mine:
                continue
            colour = f"C{index}"
            for gpu, style, label in ((shipped, "--", "shipped"), (fitted, "-", "re-fitted")):
                x, y = _published_curve(gpu, mine[0])
                ax.plot(x, y, linestyle=style, color=colour, linewidth=1.0,
                        label=f"{shipped.name} {label}")  # fmt: skip
            for p in mine:
                _published_mark(ax, p, colour)
        ax.set_title(_PUBLISHED_TITLES[kind], fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)


_PUBLISHED_TITLES = {
    "clock_latency": "time at a locked SM clock / at max (half decode)",
    "decode_limit_latency": "decode time per token under a power limit / uncapped",
    "decode_power": "decode power at max clock (W) against the batch",
}


def _published_curve(gpu: SimGpu, point: published.Point) -> tuple[Any, Any]:
    if isinstance(point, published.ClockLatency):
        mhz = np.linspace(0.5 * gpu.sm_clock_max_mhz, gpu.sm_clock_max_mhz, 60)
        slow = published.clock_slowdown(
            gpu, mhz / gpu.sm_clock_max_mhz, decode_share=point.decode_share
        )
        return mhz, slow
    if isinstance(point, published.DecodeLimitLatency):
        limits = np.linspace(0.3 * gpu.tdp_w, gpu.tdp_w, 60)
        per_token = [
            published.decode_slowdown_at_limit(gpu, batch=point.batch, limit_w=float(w))
            for w in limits
        ]
        return limits, np.asarray(per_token)
    batches = np.arange(1.0, 129.0)
    return batches, gpu.decode_frac(batches) * gpu.tdp_w


def _published_mark(ax: Any, point: published.Point, colour: str) -> None:
    if isinstance(point, published.ClockLatency):
        x, lo, hi = point.sm_clock_mhz, point.low, point.high
    elif isinstance(point, published.DecodeLimitLatency):
        x, lo, hi = point.power_limit_w, point.low, point.high
    elif isinstance(point, published.DecodePower):
        ax.fill_between([point.batch_low, point.batch_high], point.low_w, point.high_w,
                        color=colour, alpha=0.15, label=point.id)  # fmt: skip
        return
    else:
        return
    ax.errorbar([x], [(lo + hi) / 2], yerr=[[(hi - lo) / 2], [(hi - lo) / 2]], fmt="o",
                color=colour, markersize=3, capsize=3, label=point.id)  # fmt: skip


__all__ = [
    "agreement_plot",
    "frontier_figure",
    "frontier_plot",
    "latency_figure",
    "latency_plot",
    "power_plot",
    "published_plot",
]
