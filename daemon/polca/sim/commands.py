"""What ``polca simulate`` and ``polca plan`` do once their arguments are parsed.

Kept apart from ``polca.sim.cli`` because it imports numpy (through the simulator): the
CLI module must import without the ``polca[sim]`` extra. Input problems (a malformed
trace row, an invalid policy, an impossible row) are printed with the file and line or
the option at fault, and give exit code 2.
"""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from polca.errors import ConfigError, PolicyError, SimCollapsedError
from polca.exits import EX_USAGE
from polca.policy import Policy, load_policy
from polca.sim import failover, report
from polca.sim import plan as plan_mod
from polca.sim.durations import duration_s
from polca.sim.model import ControlConfig, SimConfigError
from polca.sim.scenario import (
    Scenario,
    calibrate_load_scale,
    gpu_and_server,
    row_config,
    simulate,
)
from polca.sim.workload import Envelope, load_trace


def scenario_from_args(
    args: argparse.Namespace, *, actuation_delay_s: float, oversubscription: float = 0.0
) -> Scenario:
    """The scenario the command-line options describe."""
    control = ControlConfig(
        telemetry_period_s=args.telemetry_period_s,
        telemetry_delay_s=args.telemetry_delay_s,
        actuation_delay_s=actuation_delay_s,
        actuation_jitter=args.actuation_jitter,
        trend_window_s=args.trend_window_s,
        brake_tolerance_s=args.brake_tolerance_s,
        brake_hold_s=args.brake_hold_s,
    )
    period = args.diurnal_period
    peak = args.diurnal_peak if args.diurnal_peak is not None else period / 2.0
    return Scenario(
        gpu=args.model,
        profile=args.profile,
        base_servers=args.servers,
        gpus_per_server=args.gpus_per_server,
        oversubscription=oversubscription,
        budget_w=args.budget_w,
        server_provisioned_w=args.server_provisioned_w,
        server_other_w=args.server_other_w,
        server_overhead_frac=args.server_overhead,
        rows=args.rows,
        hp_share=args.hp_share,
        assignment=args.assignment,
        control=control,
        load_scale=args.load_scale,
        tenants=args.tenants,
        jitter_s=args.jitter_s,
        offset_s=args.trace_offset,
        duration_s=args.duration,
        envelope=Envelope(period_s=period, trough=args.diurnal_trough, peak_s=peak),
        step_s=args.step_s,
        max_wait_s=args.max_wait_s,
        warmup_s=args.warmup,
        seed=args.seed,
        max_in_flight_per_gpu=args.max_in_flight_per_gpu,
        time_limit_s=args.time_limit_s,
        max_decode_batch=args.max_decode_batch,
    )


def _policy(path: Path) -> Policy:
    return load_policy(path).policy


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    """Run the parsed command; input errors become messages and exit code 2."""
    try:
        if args.command == "simulate":
            return _simulate(args, out=out, err=err)
        return _plan(args, out=out, err=err)
    except PolicyError as exc:
        err.write(f"{exc}\n")
        for problem in exc.problems:
            err.write(f"{problem}\n")
        return EX_USAGE
    except ConfigError as exc:  # SimConfigError and TraceError (FILE:LINE: message)
        err.write(f"{exc}\n")
        return EX_USAGE
    except SimCollapsedError as exc:  # simulate only: a plan reports it per point
        err.write(f"the simulated row {exc}\n")
        return 1


def _calibrated(scenario: Scenario, args: argparse.Namespace, trace: Any, err: TextIO) -> Scenario:
    """The scenario with ``--peak-pct`` turned into a load scale."""
    if args.peak_pct is None:
        return scenario
    scale = calibrate_load_scale(scenario, trace, target_pct=args.peak_pct)
    err.write(
        f"calibrated: load scale {scale:.4f} trace copies per server peaks the base "
        f"row at ~{args.peak_pct:g}% of budget\n"
    )
    return replace(scenario, load_scale=scale)


def _simulate(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    policy = _policy(args.policy)
    label, delay_s = args.actuation
    scenario = scenario_from_args(
        args, actuation_delay_s=delay_s, oversubscription=args.oversubscription
    )
    trace = load_trace(args.trace, seed=args.seed)
    scenario = _calibrated(scenario, args, trace, err)
    capped, base, summary = simulate(scenario, trace, policy, policy_file=str(args.policy))
    summary["control"]["actuation"] = label
    if args.out is not None:
        for note in report.write_outputs(
            args.out, capped=capped, base=base, summary=summary, plots=not args.no_plots
        ):
            err.write(note + "\n")
    if args.json:
        out.write(json.dumps(report._jsonable(summary), indent=2) + "\n")
    else:
        out.write(report.render_text(summary))
        if args.out is not None:
            out.write(
                f"wrote {args.out}/summary.json, series.csv"
                f"{'' if args.no_plots else ', power.png, latency.png'}\n"
            )
    return 0


def _plan(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    actuations = args.actuation or [("out-of-band", 40.0)]
    scenario = scenario_from_args(args, actuation_delay_s=actuations[0][1])
    feed_failure = _feed_failure(args, scenario)  # checked before anything runs
    trace = load_trace(args.trace, seed=args.seed)
    scenario = _calibrated(scenario, args, trace, err)
    variants: list[plan_mod.Variant] = []
    for path in args.policy:
        policy = _policy(path)
        for label, delay_s in actuations:
            control = replace(scenario.control, actuation_delay_s=delay_s)
            base = plan_mod.Variant(
                name=f"{policy.name} {label}", policy=policy, control=control, policy_file=str(path)
            )
            if args.t1_pct or args.t2_pct:
                swept, notes = plan_mod.threshold_variants(
                    base, t1_pcts=args.t1_pct, t2_pcts=args.t2_pct
                )
                for note in notes:
                    err.write(note + "\n")
                variants.extend(swept)
            else:
                variants.append(base)
    if args.jobs < 1:
        msg = f"--jobs must be at least 1, got {args.jobs}"
        raise SimConfigError(msg)
    slo = plan_mod.Slo(
        hp_p50_pct=args.slo_hp_p50_pct,
        hp_p99_pct=args.slo_hp_p99_pct,
        lp_loss_pct=args.slo_lp_loss_pct,
        lp_p50_pct=args.slo_lp_p50_pct,
        lp_p99_pct=args.slo_lp_p99_pct,
        max_brakes=args.max_brakes,
    )
    on_point = None
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        partial = args.out / "plan.points.jsonl"
        partial.write_text("", encoding="utf-8")

        def on_point(ratio: float, points: list[tuple[str, dict[str, Any]]]) -> None:
            with partial.open("a", encoding="utf-8") as f:  # kept if the plan is interrupted
                for name, point in points:
                    record = {"scenario": name, **point}
                    f.write(json.dumps(report._jsonable(record)) + "\n")

    def progress(done: int, total: int, ratio: float, seconds: float) -> None:
        bar = "#" * round(20 * done / total)
        err.write(f"plan [{bar:<20}] {done}/{total} points, {ratio:+.0%} done, {seconds:.0f} s\n")

    if args.history is not None:
        if feed_failure is not None:
            msg = "--feed-failure replays a request trace; it does not apply to --history"
            raise SimConfigError(msg)
        ignored = [
            flag
            for flag, used in (
                ("--seeds", args.seeds > 1),
                ("--search bisect", args.search == "bisect"),
                ("--jobs", args.jobs > 1),
                ("--trace", args.trace != "azure-code"),
            )
            if used
        ]
        if ignored:  # a history has one shape and no seeds: say so rather than pretend
            err.write(f"{', '.join(ignored)} do not apply to --history: ignored\n")
        result = _history_plan(args, scenario, variants, slo, err)
    else:
        result = _trace_plan(args, scenario, trace, variants, slo, on_point, progress, feed_failure)
    _write_plan(args, result, err)
    if args.json:
        out.write(json.dumps(report._jsonable(result), indent=2) + "\n")
    else:
        out.write(plan_mod.render_text(result))
    return 0


def _history_plan(
    args: argparse.Namespace,
    scenario: Scenario,
    variants: list[plan_mod.Variant],
    slo: plan_mod.Slo,
    err: TextIO,
) -> dict[str, Any]:
    """The plan from a recorded row power history (read by ``polca.sim.power_history``,
    planned by ``polca.sim.history``)."""
    from polca.sim import history as history_mod  # noqa: PLC0415
    from polca.sim import power_history  # noqa: PLC0415

    if args.history.startswith(("http://", "https://")):
        if not args.history_row:
            msg = "--history from InfluxDB needs --history-row (the row's name)"
            raise SimConfigError(msg)
        recorded = power_history.load_history_influx(
            args.history,
            row=args.history_row,
            site=args.history_site,
            step_s=args.history_step_s,
            since=args.history_since,
        )
    else:
        recorded = power_history.load_history_csv(Path(args.history), step_s=args.history_step_s)
    err.write(
        f"history: {recorded.source}, {recorded.duration_s / 3600:.1f} h at "
        f"{recorded.step_s:g} s, peak {recorded.power_w.max() / 1000:.1f} kW\n"
    )
    gpu, server = gpu_and_server(scenario)
    if args.history_gpu_physics is not None:
        from polca.physics.presets import get_model  # noqa: PLC0415
        from polca.sim.agreement import daemons_gpu  # noqa: PLC0415

        try:
            gpu = daemons_gpu(get_model(args.history_gpu_physics))
        except ValueError as exc:
            msg = f"--history-gpu-physics: {exc}"
            raise SimConfigError(msg) from exc
    row = row_config(scenario.with_oversubscription(0.0))
    # The server as the options give it (--server-other-w, --server-overhead), as for a trace.
    server = replace(server, other_w=row.server_other_w, overhead_frac=row.server_overhead_frac)
    budget_w = row.budget_w
    return history_mod.plan_history(
        recorded,
        variants,
        ratios=args.oversubscription,
        slo=slo,
        gpu=gpu,
        server=server,
        base_servers=scenario.base_servers,
        gpus_per_server=scenario.gpus_per_server,
        budget_w=budget_w,
        hp_share=scenario.hp_share,
        assignment=scenario.assignment,
        decode_share=args.decode_share,
        warmup_s=scenario.warmup_s,
    )


def _feed_failure(args: argparse.Namespace, scenario: Scenario) -> failover.FeedFailure | None:
    """The feed failure ``--feed-failure`` and its options describe, checked; or None."""
    given = [
        flag
        for flag, value in (
            ("--feed-w", args.feed_w),
            ("--feeds", args.feeds),
            ("--failover-s", args.failover_s),
            ("--failure-at", args.failure_at),
            ("--outage-s", args.outage_s),
        )
        if value is not None
    ]
    if not args.feed_failure:
        if given:
            msg = f"{', '.join(given)}: only with --feed-failure (they describe a feed's loss)"
            raise SimConfigError(msg)
        return None
    if args.feed_w is None:
        msg = "--feed-failure needs --feed-w, each feed's rating in W"
        raise SimConfigError(msg)
    spec = failover.FeedFailure(
        feed_w=args.feed_w,
        feeds=2 if args.feeds is None else args.feeds,
        failover_s=2.0 if args.failover_s is None else args.failover_s,
        at_s=_failure_at(args.failure_at),
        outage_s=None if args.outage_s is None else _duration("--outage-s", args.outage_s),
    )
    failover.check(
        spec,
        budget_w=row_config(scenario.with_oversubscription(0.0)).budget_w,
        duration_s=scenario.duration_s,
        warmup_s=scenario.warmup_s,
    )
    return spec


def _failure_at(text: str | None) -> float | None:
    """``--failure-at``: None for the worst moment, else seconds into the run."""
    if text is None or text.strip().lower() == "worst":
        return None
    return _duration("--failure-at", text, what="'worst' or a time into the run")


def _duration(flag: str, text: str, *, what: str = "a duration") -> float:
    try:
        return duration_s(text)
    except argparse.ArgumentTypeError as exc:
        msg = f"{flag} must be {what} (seconds, or a number with s, m, h or d), got {text!r}"
        raise SimConfigError(msg) from exc


def _trace_plan(  # noqa: PLR0917 - one call site
    args: argparse.Namespace,
    scenario: Scenario,
    trace: Any,
    variants: list[plan_mod.Variant],
    slo: plan_mod.Slo,
    on_point: Any,
    progress: Any,
    feed_failure: failover.FeedFailure | None,
) -> dict[str, Any]:
    search = plan_mod.bisect_plan if args.search == "bisect" else plan_mod.run_plan
    return search(
        scenario,
        trace,
        variants,
        ratios=args.oversubscription,
        slo=slo,
        jobs=args.jobs,
        seeds=args.seeds,
        progress=progress,
        on_point=on_point,
        feed_failure=feed_failure,
    )


def _write_plan(args: argparse.Namespace, result: dict[str, Any], err: TextIO) -> None:
    if args.out is not None:
        report.write_json(args.out / "plan.json", result)
        _write_plan_csv(args.out / "plan.csv", result)
        if not args.no_plots:
            try:
                from polca.sim import plots  # noqa: PLC0415 - matplotlib is optional
            except ImportError:
                err.write(
                    "PNG plots skipped: matplotlib is not installed (pip install 'polca[sim]')\n"
                )
            else:
                plots.frontier_plot(args.out / "frontier.png", result)


def _write_plan_csv(path: Path, plan: dict[str, Any]) -> None:
    keys = [
        "oversubscription_pct",
        "servers",
        "hp_p50_impact_pct",
        "hp_p99_impact_pct",
        "lp_p50_impact_pct",
        "lp_p99_impact_pct",
        "lp_throughput_loss_pct",
        "brake_events",
        "peak_pct",
        "capped_time_pct",
    ]
    # With a feed's loss replayed: when, and how far over the survivor in the window and after.
    failure_keys = (
        [
            ("failure_at_s", ("at_s",)),
            ("window_s", ("window_s",)),
            ("window_peak_pct_of_survivor", ("window", "peak_pct_of_survivor")),
            ("window_over_survivor_s", ("window", "over_survivor_s")),
            ("after_peak_pct_of_survivor", ("after", "peak_pct_of_survivor")),
            ("after_over_survivor_s", ("after", "over_survivor_s")),
        ]
        if "feed_failure" in plan
        else []
    )
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scenario", *keys, *(name for name, _ in failure_keys), "meets_slo"])
        for v in plan["scenarios"]:
            for p in v["points"]:
                block = p.get("feed_failure") or {}
                failure = [_dig(block, path) for _, path in failure_keys]
                w.writerow([v["name"], *(p[k] for k in keys), *failure, not p["violations"]])


def _dig(block: dict[str, Any], path: tuple[str, ...]) -> Any:
    """``block[a][b]...``, or None where a key is missing (a collapsed replay)."""
    value: Any = block
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value
