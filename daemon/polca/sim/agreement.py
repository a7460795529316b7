"""The simulator against the running system: one recorded ``polca demo`` run, replayed.

``polca demo --record DIR`` runs the real daemons (aggregator, agents on simulated GPUs,
the MQTT broker) and writes what the row did (``row.csv``: power and level per row
summary) and the same load uncapped (``uncapped.csv``, a power history). ``agreement``
replays ``uncapped.csv`` through the planner's history replay (``polca.sim.history``) with
the same policy, budget and servers, on the daemons' GPU model (the simulated backend's
idle power, memory share, clock exponent and clock range: ``daemons_gpu``) and the
daemons' control timing (1 s telemetry, caps within the step, no hardware brake), and
compares time per level, capping episodes and peak row power with ``row.csv``.

Time per level is compared at the daemons' row summaries, each allowed the control loop's
timing (``Tolerances.level_slack_s``): a summary counts for the replay's level when the
replay had that level within a couple of seconds of it. The loop's hysteresis and trend
rule turn a reading a second early or late into a release or an entry a second or more
apart, and a loaded machine delays the daemons' readings by a second or so, so the raw
shares of a short run swing by several points from run to run; a level the replay did not
have near that time is a disagreement all the same.

What is left out on purpose, so it shows as disagreement if it matters: the replay knows
only the power the load drew at the default limit (not the demand above it), no thermal
guards, and no sub-second timing.
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from polca.errors import SimConfigError
from polca.physics.presets import GpuModel, get_model
from polca.policy import Policy, load_policy
from polca.sim import report
from polca.sim.history import level_summary, plan_history, replay
from polca.sim.model import (
    ACTUATION_PRESETS_S,
    SIM_GPUS,
    ControlConfig,
    ServerPreset,
    SimGpu,
    server_preset,
)
from polca.sim.plan import Slo, Variant
from polca.sim.power_history import load_history_csv

MAX_RECORD_BYTES: Final = 64 * 1024 * 1024

DAEMONS_CONTROL: Final = ControlConfig(
    telemetry_period_s=1.0,  # agent.publish_interval_s; the aggregator evaluates each reading
    telemetry_delay_s=0.0,  # a reading is the mean of the interval just ended
    actuation_delay_s=0.0,  # in-band caps land within milliseconds, inside the step
    trend_window_s=10.0,  # control.trend_window_s
    brake_tolerance_s=1e9,  # simulated GPUs have no row-level hardware brake
    brake_hold_s=0.0,
)
"""The control timing of the daemons as ``polca demo`` runs them."""


@dataclass(frozen=True, slots=True)
class Tolerances:
    """How close the replay must come to the daemons' run."""

    level_time_pts: float = 5.0  # each level's share of the time, percentage points
    # How far apart in time the two may put the same level. A change of load reaches the
    # daemons' level up to 2 s after the replay's (their reading is the agents' mean over
    # their last 1 s, evaluated at the aggregator's next 1 s tick, where the replay acts
    # at its step), and later on a loaded machine, where messages wait for the CPU.
    level_slack_s: float = 2.5
    # Peak row power, percentage points of the budget. A history holds the power drawn at
    # the default limit, not the demand above it, so for GPUs at their limit the replay's
    # capped power is low: with every GPU of the demo's row at its limit under T2's caps,
    # by 37 W a GPU, 5.6 points of its budget. The tolerance is that bound.
    peak_pts: float = 6.0
    capping_events_frac: float = 0.5  # capping episodes, relative (of the larger) ...
    capping_events_abs: int = 2  # ... or absolute, whichever is looser


def daemons_gpu(model: GpuModel) -> SimGpu:
    """The simulator's GPU with the power model of the daemons' simulated GPUs.

    The replay uses a GPU's resident (idle) power, the share of dynamic power a clock lock
    does not reduce, the clock exponent, the clock range and the limits; here they are the
    simulated backend's (``polca.physics.presets``), so both sides run one physics.
    """
    base = next((g for g in SIM_GPUS.values() if g.name.lower() == model.name.lower()), None)
    if base is None:
        msg = f"no simulator profile for the GPU model {model.name!r}"
        raise SimConfigError(msg)
    return dataclasses.replace(
        base,
        tdp_w=model.tdp_w,
        power_limit_min_w=model.power_limit_min_w,
        power_limit_max_w=model.power_limit_max_w,
        sm_clock_max_mhz=model.sm_clock_max_mhz,
        sm_clock_min_mhz=model.sm_clock_min_mhz,
        resident_power_w=model.idle_power_w,
        prefill_mem_share=model.mem_power_share,
        decode_mem_share=model.mem_power_share,
        clock_power_exponent=model.clock_power_exponent,
        brake_sm_clock_mhz=model.sm_clock_min_mhz,
    )


def read_row_record(row_csv: Path) -> tuple[list[float], list[float], list[int]]:
    """``row.csv`` of ``polca demo --record``: (Unix seconds, row power W, level) lists."""
    times: list[float] = []
    powers: list[float] = []
    levels: list[int] = []
    try:
        if row_csv.stat().st_size > MAX_RECORD_BYTES:
            msg = f"{row_csv}: larger than {MAX_RECORD_BYTES} bytes"
            raise SimConfigError(msg)
        with row_csv.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or header[:3] != ["timestamp", "power_w", "level"]:
                msg = f"{row_csv}: expected a header timestamp,power_w,level,..."
                raise SimConfigError(msg)
            for line, row in enumerate(reader, start=2):
                try:
                    t_s, power_w, level = float(row[0]), float(row[1]), int(row[2])
                except (IndexError, ValueError) as exc:
                    msg = f"{row_csv}:{line}: {exc}"
                    raise SimConfigError(msg) from exc
                if not (math.isfinite(t_s) and math.isfinite(power_w)) or not 0 <= level <= 64:
                    msg = f"{row_csv}:{line}: a reading out of range"
                    raise SimConfigError(msg)
                times.append(t_s)
                powers.append(power_w)
                levels.append(level)
    except OSError as exc:
        msg = f"{row_csv}: {exc.strerror or exc}"
        raise SimConfigError(msg) from exc
    except (UnicodeDecodeError, csv.Error) as exc:  # not UTF-8, a NUL, an oversized field
        msg = f"{row_csv}: not a CSV record: {exc}"
        raise SimConfigError(msg) from exc
    return times, powers, levels


def observed(
    row_csv: Path, *, policy: Policy, budget_w: float, start_s: float, end_s: float
) -> dict[str, Any]:
    """Time per level, capping episodes and peak of the daemons' run within the window."""
    return _observed(row_csv, policy=policy, budget_w=budget_w, start_s=start_s, end_s=end_s)[0]


def _observed(
    row_csv: Path, *, policy: Policy, budget_w: float, start_s: float, end_s: float
) -> tuple[dict[str, Any], list[float], list[int]]:
    """``observed``, and the times and levels of the summaries within the window."""
    times, powers, all_levels = read_row_record(row_csv)
    window = [i for i, t in enumerate(times) if start_s <= t <= end_s]
    if not window:
        msg = f"{row_csv}: no row summary within the replayed window"
        raise SimConfigError(msg)
    peak_w = max(powers[i] for i in window)
    levels = [all_levels[i] for i in window]
    summary = {
        **level_summary(levels, policy),
        "peak_pct": 100.0 * peak_w / budget_w,
        "summaries": len(window),
    }
    return summary, [times[i] for i in window], levels


def aligned_levels(
    times_s: Sequence[float],
    levels: Sequence[int],
    replay_t_s: Sequence[float],
    replay_levels: Sequence[int],
    *,
    slack_s: float,
) -> list[int]:
    """The replay's level at each of the daemons' summaries, give or take ``slack_s``.

    ``times_s`` and ``replay_t_s`` (ascending) are on one clock. A summary whose level the
    replay had at a step within ``slack_s`` of it gets that level (the two agree but for
    the loop's timing); any other gets the replay's level at the step nearest to it.
    """
    if not replay_t_s or len(replay_t_s) != len(replay_levels):
        msg = "the replay has no level series to compare with"
        raise SimConfigError(msg)
    aligned: list[int] = []
    for t_s, level in zip(times_s, levels, strict=True):
        lo = bisect.bisect_left(replay_t_s, t_s - slack_s)
        hi = bisect.bisect_right(replay_t_s, t_s + slack_s)
        if level in replay_levels[lo:hi]:
            aligned.append(level)
            continue
        at = bisect.bisect_left(replay_t_s, t_s)
        nearest = min(
            (i for i in (at - 1, at) if 0 <= i < len(replay_t_s)),
            key=lambda i: abs(replay_t_s[i] - t_s),
        )
        aligned.append(replay_levels[nearest])
    return aligned


def compare(
    daemons: dict[str, Any], simulator: dict[str, Any], tolerances: Tolerances
) -> dict[str, Any]:
    """Each metric of both runs, their difference, its tolerance and whether it holds."""
    rows: list[dict[str, Any]] = []
    for name, share in daemons["time_at_level_pct"].items():
        other = simulator["time_at_level_pct"].get(name, 0.0)
        rows.append(_row(f"time at {name} (%)", share, other, tolerances.level_time_pts))
    d_ep, s_ep = daemons["capping_events"], simulator["capping_events"]
    allowed = max(tolerances.capping_events_abs, tolerances.capping_events_frac * max(d_ep, s_ep))
    rows.append(_row("capping episodes", d_ep, s_ep, allowed))
    peak = ("peak row power (% of budget)", daemons["peak_pct"], simulator["peak_pct"])
    rows.append(_row(*peak, tolerances.peak_pts))
    return {"metrics": rows, "agree": all(r["ok"] for r in rows)}


def _row(name: str, daemons: float, simulator: float, tolerance: float) -> dict[str, Any]:
    diff = float(simulator) - float(daemons)
    return {
        "metric": name,
        "daemons": round(float(daemons), 2),
        "simulator": round(float(simulator), 2),
        "difference": round(diff, 2),
        "tolerance": round(float(tolerance), 2),
        "ok": bool(abs(diff) <= tolerance),
    }


@dataclass(frozen=True, slots=True)
class DemoRow:
    """What the simulator needs of a ``polca demo`` row (``DemoOptions.planner_row``)."""

    budget_w: float
    servers: int
    gpus_per_server: int
    model: str  # the simulated backend's GPU model
    non_gpu_w: float  # steady non-GPU power per server


def agreement(
    record_dir: Path,
    *,
    policy: Policy,
    row: DemoRow,
    warmup_s: float = 30.0,
    tolerances: Tolerances | None = None,
) -> dict[str, Any]:
    """Replay a recorded demo run's uncapped load and compare it with what the row did."""
    tolerances = tolerances or Tolerances()
    history = load_history_csv(record_dir / "uncapped.csv", step_s=1.0)
    t0 = history.start_s
    gpu = daemons_gpu(get_model(row.model))
    first = policy.classes[0]
    hp_gpus = sum(
        policy.static_class(index=i, uuid="") == first for i in range(row.gpus_per_server)
    )
    simulated = replay(
        history,
        gpu=gpu,
        server=ServerPreset(
            gpu=gpu.name,
            provisioned_w=row.budget_w / row.servers,
            other_w=row.non_gpu_w,
            overhead_frac=0.0,
            load_scale=1.0,
        ),
        base_servers=row.servers,
        servers=row.servers,
        gpus_per_server=row.gpus_per_server,
        budget_w=row.budget_w,
        policy=policy,
        control=DAEMONS_CONTROL,
        hp_share=hp_gpus / row.gpus_per_server,
        assignment="gpu",
        warmup_s=warmup_s,
        series=True,
    )
    start_s = t0 + warmup_s
    end_s = t0 + history.duration_s
    daemons, times_s, levels = _observed(
        record_dir / "row.csv", policy=policy, budget_w=row.budget_w, start_s=start_s, end_s=end_s
    )
    series = simulated["series"]
    at_summaries = level_summary(
        aligned_levels(
            [t - t0 for t in times_s],
            levels,
            series["t_s"],
            series["level"],
            slack_s=tolerances.level_slack_s,
        ),
        policy,
    )["time_at_level_pct"]
    return {
        "window_s": [round(warmup_s, 1), round(history.duration_s, 1)],
        "daemons": daemons,
        "simulator": {k: simulated[k] for k in ("time_at_level_pct", "capping_events", "peak_pct")},
        # The replay's time per level at the daemons' summaries (``aligned_levels``): what
        # the metrics compare.
        "simulator_at_summaries_pct": at_summaries,
        "simulator_uncapped_peak_pct": simulated["uncapped_peak_pct"],
        "simulator_series": {"t0": t0, **series},
        "control": dataclasses.asdict(DAEMONS_CONTROL),
        "tolerances": dataclasses.asdict(tolerances),
        **compare(daemons, {**simulated, "time_at_level_pct": at_summaries}, tolerances),
    }


def plan_demo_row(
    history: Path, *, policy_file: Path, row: DemoRow, out: Path | None = None
) -> dict[str, Any]:
    """The planner's point for a demo row's uncapped load at the row's own servers.

    ``history`` is ``polca demo --record``'s ``uncapped.csv`` or
    ``polca.demo.load.uncapped_load``'s. The point is what ``polca plan --history HISTORY
    --history-gpu-physics MODEL --actuation in-band --oversubscription 0
    --telemetry-period-s 1 --telemetry-delay-s 1 --warmup 30`` gives with the row's budget,
    servers and non-GPU power (violations, brake events, time per level, peaks), called as
    a function rather than through the command line, which imports this module. With
    ``out``, the plan is also written to ``out/plan.json`` as that command writes it.
    """
    policy = load_policy(policy_file).policy
    recorded = load_history_csv(history, step_s=1.0)
    try:
        gpu = daemons_gpu(get_model(row.model))
    except ValueError as exc:
        msg = f"the demo row's GPU model: {exc}"
        raise SimConfigError(msg) from exc
    # The server as --server-other-w and --server-overhead 0 give it.
    server = dataclasses.replace(server_preset(row.model), other_w=row.non_gpu_w, overhead_frac=0.0)
    control = ControlConfig(
        telemetry_period_s=1.0,
        telemetry_delay_s=1.0,
        actuation_delay_s=ACTUATION_PRESETS_S["in-band"],
    )
    variant = Variant(
        name=f"{policy.name} in-band",
        policy=policy,
        control=control,
        policy_file=str(policy_file),
    )
    plan = plan_history(
        recorded,
        [variant],
        ratios=[0.0],
        slo=Slo(),
        gpu=gpu,
        server=server,
        base_servers=row.servers,
        gpus_per_server=row.gpus_per_server,
        budget_w=row.budget_w,
        warmup_s=30.0,
    )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        report.write_json(out / "plan.json", plan)
    point: dict[str, Any] = plan["scenarios"][0]["points"][0]
    return point


__all__ = [
    "DAEMONS_CONTROL",
    "DemoRow",
    "Tolerances",
    "agreement",
    "aligned_levels",
    "compare",
    "daemons_gpu",
    "observed",
    "plan_demo_row",
    "read_row_record",
]
