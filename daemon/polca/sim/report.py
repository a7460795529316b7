"""What a capped run cost, against the uncapped run of the same requests: metrics and files.

``compare`` reduces a capped ``RunResult`` and its uncapped reference (same trace, row and
seed, no policy) to the numbers an operator decides on:

- per class, the latency impact at P50 and P99: how much slower the capped run's
  percentile is than the uncapped run's, in % (also for the time to first token);
- per class, the throughput loss: how much less work a busy GPU of that class got done
  per second (work at the maximum clock over GPU-seconds spent serving, capped against
  uncapped), which is what a saturated, throughput-bound low-priority service loses;
- time at each level, and capping episodes (a run of controller evaluations at level 1
  or above): count, mean and longest duration;
- brake events (the hardware brake fired), peak row power as % of budget (per step and
  as the controller saw it), the largest 2 s swing, and energy.

Requests arriving during ``warmup_s`` (the row filling up from idle) and power before it
are left out. ``write_outputs`` writes ``summary.json``, ``series.csv`` and, when
matplotlib is installed, the PNG plots (``polca.sim.plots``).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from polca.sim.model import FloatArray
from polca.sim.runner import RunResult
from polca.sim.workload import HP, LP

CLASS_NAMES = {HP: "high", LP: "low"}
SWING_WINDOW_S = 2.0  # POLCA's largest swing is over 2 s


def percentile(values: FloatArray, q: float) -> float:
    """The ``q``-th percentile, NaN for no values."""
    return float(np.percentile(values, q)) if len(values) else math.nan


def impact_pct(capped: float, base: float) -> float:
    """How much larger ``capped`` is than ``base``, in % (0 when both are 0)."""
    if not (math.isfinite(capped) and math.isfinite(base)):
        return math.nan
    if base <= 0:
        return 0.0 if capped <= 0 else math.inf
    return 100.0 * (capped / base - 1.0)


def power_stats(run: RunResult, *, warmup_s: float) -> dict[str, float]:
    """Peak, mean and swing of row power (the worst row), % of budget, after warm-up."""
    cfg = run.config
    first = min(len(run.row_power_w) - 1, round(warmup_s / cfg.step_s))
    power = run.row_power_w[first:]
    budget = cfg.row.budget_w
    per = max(1, round(SWING_WINDOW_S / cfg.step_s))
    whole = (len(power) // per) * per
    two_s = power[:whole].reshape(-1, per, power.shape[1]).mean(axis=1) if whole else power
    swing = float(np.abs(np.diff(two_s, axis=0)).max()) if len(two_s) > 1 else 0.0
    return {
        "peak_pct": 100.0 * float(power.max()) / budget,
        "peak_2s_pct": 100.0 * float(two_s.max()) / budget,
        "mean_pct": 100.0 * float(power.mean()) / budget,
        "max_swing_2s_pct": 100.0 * swing / budget,
        "energy_kwh": run.energy_j / 3.6e6,
    }


def latency_stats(run: RunResult, cls: int, *, warmup_s: float) -> dict[str, float]:
    """P50/P99 of latency and time to first token of one class's requests after warm-up."""
    mask = (run.req_cls == cls) & (run.req_arrival_s >= warmup_s)
    lat, ttft = run.req_latency_s[mask], run.req_ttft_s[mask]
    return {
        "requests": float(np.count_nonzero(mask)),
        "p50_s": percentile(lat, 50),
        "p99_s": percentile(lat, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
    }


def level_stats(run: RunResult) -> dict[str, Any]:
    """Time at each level and capping episodes, from the controller's evaluations."""
    period = run.config.control.telemetry_period_s
    names = run.level_names
    if run.level.size == 0:
        return {
            "time_at_level_s": dict.fromkeys(names, 0.0),
            "time_at_level_pct": dict.fromkeys(names, 0.0),
            "capping_events": 0,
            "capping_mean_s": 0.0,
            "capping_max_s": 0.0,
            "capping_total_s": 0.0,
            "level_changes": 0,
        }
    counts = np.bincount(run.level.ravel().astype(np.intp), minlength=len(names))
    total_ticks = run.level.size
    durations: list[float] = []
    changes = 0
    for r in range(run.level.shape[1]):
        series = run.level[:, r]
        changes += int(np.count_nonzero(np.diff(series)))
        on = np.r_[False, series > 0, False]
        starts = np.flatnonzero(on[1:] & ~on[:-1])
        ends = np.flatnonzero(~on[1:] & on[:-1])
        durations.extend(((ends - starts) * period).tolist())
    return {
        "time_at_level_s": {
            name: float(counts[i]) * period / run.level.shape[1] for i, name in enumerate(names)
        },
        "time_at_level_pct": {
            name: 100.0 * float(counts[i]) / total_ticks for i, name in enumerate(names)
        },
        "capping_events": len(durations),
        "capping_mean_s": float(np.mean(durations)) if durations else 0.0,
        "capping_max_s": float(max(durations)) if durations else 0.0,
        "capping_total_s": float(sum(durations)) / run.level.shape[1],
        "level_changes": changes,
    }


def compare(capped: RunResult, base: RunResult, *, warmup_s: float = 60.0) -> dict[str, Any]:
    """Every metric of ``capped`` against its uncapped reference ``base`` (a JSON-able dict)."""
    classes: dict[str, Any] = {}
    for cls, name in CLASS_NAMES.items():
        c = latency_stats(capped, cls, warmup_s=warmup_s)
        b = latency_stats(base, cls, warmup_s=warmup_s)
        speed_c = capped.work_s[cls] / capped.busy_s[cls] if capped.busy_s[cls] > 0 else 1.0
        speed_b = base.work_s[cls] / base.busy_s[cls] if base.busy_s[cls] > 0 else 1.0
        classes[name] = {
            "gpus": capped.gpus[cls],
            "requests": int(c["requests"]),
            "p50_s": c["p50_s"],
            "p99_s": c["p99_s"],
            "uncapped_p50_s": b["p50_s"],
            "uncapped_p99_s": b["p99_s"],
            "p50_impact_pct": impact_pct(c["p50_s"], b["p50_s"]),
            "p99_impact_pct": impact_pct(c["p99_s"], b["p99_s"]),
            "ttft_p50_impact_pct": impact_pct(c["ttft_p50_s"], b["ttft_p50_s"]),
            "ttft_p99_impact_pct": impact_pct(c["ttft_p99_s"], b["ttft_p99_s"]),
            "throughput_loss_pct": 100.0 * (1.0 - speed_c / speed_b) if speed_b > 0 else 0.0,
            "dropped": capped.dropped[cls],
            "uncapped_dropped": base.dropped[cls],
            "unfinished": capped.unfinished[cls],
        }
    power = power_stats(capped, warmup_s=warmup_s)
    power_base = power_stats(base, warmup_s=warmup_s)
    first_tick = np.searchsorted(capped.tick_s, warmup_s)
    seen = capped.measured_w[first_tick:]
    budget = capped.config.row.budget_w
    brakes = [b for b in capped.brakes if b.fired_s >= warmup_s]
    return {
        "policy": capped.policy_name,
        "classes": classes,
        "brake_events": len(brakes),
        "brakes": [asdict(b) for b in brakes],
        "brake_events_in_warmup": len(capped.brakes) - len(brakes),
        "power": {
            **power,
            "measured_peak_pct": 100.0 * float(seen.max()) / budget if seen.size else math.nan,
            "uncapped_peak_pct": power_base["peak_pct"],
            "uncapped_peak_2s_pct": power_base["peak_2s_pct"],
            "uncapped_mean_pct": power_base["mean_pct"],
            "uncapped_energy_kwh": power_base["energy_kwh"],
            "energy_saving_pct": impact_pct(power_base["energy_kwh"], power["energy_kwh"])
            if power["energy_kwh"] > 0
            else 0.0,
        },
        "levels": level_stats(capped),
        "engine": {"decide_calls": capped.decide_calls, "next_level_calls": capped.ladder_calls},
    }


def _jsonable(value: Any) -> Any:
    """Non-finite floats become null: JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON (NaN and infinities as null)."""
    path.write_text(json.dumps(_jsonable(data), indent=2, sort_keys=False) + "\n", encoding="utf-8")


def write_series(path: Path, capped: RunResult, base: RunResult, *, period_s: float = 1.0) -> None:
    """Row power (capped and uncapped), the controller's reading and level, per period."""
    cfg = capped.config
    per = max(1, round(period_s / cfg.step_s))
    whole = (len(capped.row_power_w) // per) * per
    shape = (-1, per, cfg.rows)
    power = capped.row_power_w[:whole].reshape(shape).mean(axis=1)
    power_b = base.row_power_w[:whole].reshape(shape).mean(axis=1)
    budget = cfg.row.budget_w
    with path.open("w", encoding="utf-8", newline="") as f:
        out = csv.writer(f)
        out.writerow(
            [
                "t_s",
                "row",
                "power_w",
                "power_pct",
                "uncapped_power_w",
                "measured_w",
                "level",
                "level_name",
            ]
        )
        for i in range(len(power)):
            t_s = (i + 1) * per * cfg.step_s
            tick = int(np.searchsorted(capped.tick_s, t_s, side="right")) - 1
            for r in range(cfg.rows):
                level = int(capped.level[tick, r]) if tick >= 0 else 0
                seen = f"{capped.measured_w[tick, r]:.1f}" if tick >= 0 else ""
                out.writerow(
                    [
                        f"{t_s:.1f}",
                        r,
                        f"{power[i, r]:.1f}",
                        f"{100.0 * power[i, r] / budget:.2f}",
                        f"{power_b[i, r]:.1f}",
                        seen,
                        level,
                        capped.level_names[level],
                    ]
                )


def write_outputs(
    out_dir: Path,
    *,
    capped: RunResult,
    base: RunResult,
    summary: dict[str, Any],
    plots: bool = True,
) -> list[str]:
    """Write summary.json, series.csv and (optionally) the PNGs; returns notes to print."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "summary.json", summary)
    write_series(out_dir / "series.csv", capped, base)
    notes: list[str] = []
    if plots:
        try:
            from polca.sim import plots as plot_mod  # noqa: PLC0415 - matplotlib is optional
        except ImportError:
            notes.append(
                "PNG plots skipped: matplotlib is not installed (pip install 'polca[sim]')"
            )
        else:
            plot_mod.power_plot(out_dir / "power.png", capped, base)
            plot_mod.latency_plot(
                out_dir / "latency.png", capped, base, warmup_s=summary["warmup_s"]
            )
    return notes


def render_text(summary: dict[str, Any]) -> str:
    """A short human summary of ``compare``'s result (plus the run's inputs)."""
    m = summary["metrics"]
    p = m["power"]
    lines = [
        f"row: {summary['row']['servers']} servers x {summary['row']['gpus_per_server']} "
        f"{summary['row']['gpu']} ({summary['row']['oversubscription_pct']:+.0f}% over "
        f"{summary['row']['base_servers']}), budget {summary['row']['budget_w'] / 1000:.1f} kW, "
        f"policy {m['policy']}, actuation {summary['control']['actuation_delay_s']:g} s",
        f"requests: {summary['workload']['requests']} over "
        f"{summary['workload']['duration_s']:.0f} s ({summary['workload']['trace']})",
        f"power: peak {p['peak_pct']:.1f}% of budget (uncapped {p['uncapped_peak_pct']:.1f}%), "
        f"controller saw {p['measured_peak_pct']:.1f}%, largest 2 s swing "
        f"{p['max_swing_2s_pct']:.1f}%, energy {p['energy_kwh']:.1f} kWh "
        f"({p['energy_saving_pct']:.1f}% saved)",
        f"brake events: {m['brake_events']}",
    ]
    lv = m["levels"]
    at = ", ".join(f"{k} {v:.1f}%" for k, v in lv["time_at_level_pct"].items())
    lines.append(
        f"levels: {at}; {lv['capping_events']} capping episodes, mean "
        f"{lv['capping_mean_s']:.0f} s, longest {lv['capping_max_s']:.0f} s"
    )
    for name, c in m["classes"].items():
        lines.append(
            f"{name:>4}: P50 {c['p50_s']:.3f} s ({c['p50_impact_pct']:+.2f}%), P99 "
            f"{c['p99_s']:.3f} s ({c['p99_impact_pct']:+.2f}%), throughput loss "
            f"{c['throughput_loss_pct']:.2f}%, dropped {c['dropped']} "
            f"(uncapped {c['uncapped_dropped']})"
        )
    return "\n".join(lines) + "\n"


__all__ = [
    "CLASS_NAMES",
    "compare",
    "impact_pct",
    "latency_stats",
    "level_stats",
    "power_stats",
    "render_text",
    "write_json",
    "write_outputs",
    "write_series",
]
