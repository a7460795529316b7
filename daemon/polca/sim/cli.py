"""``polca simulate`` and ``polca plan``: the simulator's command line.

``add_parsers`` adds both subcommands to the main parser; ``main`` runs the one chosen.
Importing this module imports nothing but the standard library, so ``polca --help`` and
every other subcommand work without the ``polca[sim]`` extra (numpy, matplotlib); the
simulator is imported when a simulation runs, and its absence is a clear error.

Exit codes: 0 done (a plan that finds no deployment meeting the SLOs is an answer, not
an error), 2 bad input (a malformed trace or policy, an impossible row; the message names
the file and line or the option at fault), 78 the ``polca[sim]`` extra is missing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from polca.exits import EX_CONFIG
from polca.sim.durations import duration_s

COMMANDS = ("simulate", "plan")
_MISSING_EXTRA = (
    "polca {command} needs the simulator's extra dependencies (numpy; matplotlib for "
    "plots): pip install 'polca[sim]'"
)


def ratio(text: str) -> float:
    """An oversubscription ratio from ``0.3`` or ``30%``."""
    try:
        if text.strip().endswith("%"):
            return float(text.strip()[:-1]) / 100.0
        return float(text)
    except ValueError as exc:
        msg = f"not a ratio: {text!r} (use 0.3 or 30%)"
        raise argparse.ArgumentTypeError(msg) from exc


def ratio_grid(text: str) -> list[float]:
    """Ratios from ``0,0.1,0.3``, ``0%,10%,30%`` or ``START:STOP:STEP`` (STOP included)."""
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3:
            msg = f"a grid is START:STOP:STEP, got {text!r}"
            raise argparse.ArgumentTypeError(msg)
        start, stop, step = (ratio(p) for p in parts)
        if step <= 0 or stop < start:
            msg = f"a grid needs STEP > 0 and STOP >= START, got {text!r}"
            raise argparse.ArgumentTypeError(msg)
        count = int((stop - start) / step + 1e-9) + 1
        return [round(start + i * step, 6) for i in range(count)]
    return [ratio(p) for p in text.split(",") if p.strip()]


def number_list(text: str) -> list[float]:
    """Numbers from ``78,80,82``."""
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError as exc:
        msg = f"not a list of numbers: {text!r}"
        raise argparse.ArgumentTypeError(msg) from exc


def actuation(text: str) -> tuple[str, float]:
    """``in-band``, ``out-of-band`` or a delay in seconds, as (label, seconds)."""
    presets = {"in-band": 0.012, "out-of-band": 40.0}  # polca.sim.model.ACTUATION_PRESETS_S
    if text in presets:
        return text, presets[text]
    try:
        seconds = duration_s(text)
    except argparse.ArgumentTypeError as exc:
        msg = f"actuation must be in-band, out-of-band or a delay in seconds, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from exc
    return f"{seconds:g}s", seconds


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def _common(p: argparse.ArgumentParser) -> None:
    """Options shared by simulate and plan: the row, the load, timing, outputs."""
    from polca.sim.profile import shipped_profile_names  # noqa: PLC0415 - --help stays light

    row = p.add_argument_group("row")
    row.add_argument("--model", default="A100-SXM4", help="GPU model (A100-SXM4, H100-SXM, ...)")
    row.add_argument(
        "--profile",
        default=None,
        metavar="NAME|FILE",
        help="GPU/server profile: every model constant with its source (shipped: "
        f"{', '.join(shipped_profile_names())}; or a YAML file, see docs/simulator.md); "
        "overrides --model",
    )
    row.add_argument(
        "--servers", type=int, default=40, help="servers the budget was provisioned for"
    )
    row.add_argument("--gpus-per-server", type=int, default=8, help="GPUs in each server")
    row.add_argument("--rows", type=int, default=1, help="identical rows, each with its own load")
    row.add_argument(
        "--budget-w", type=float, default=None, help="row budget (default: servers x provisioned)"
    )
    row.add_argument(
        "--server-provisioned-w", type=float, default=None, help="budget per base server (preset)"
    )
    row.add_argument(
        "--server-other-w",
        type=float,
        default=None,
        help="steady non-GPU power per server (preset)",
    )
    row.add_argument(
        "--server-overhead",
        type=float,
        default=None,
        help="share of GPU power the server adds (preset)",
    )
    row.add_argument(
        "--hp-share", type=float, default=0.5, help="high-priority share of GPUs and requests"
    )
    row.add_argument(
        "--assignment",
        choices=["server", "gpu"],
        default="server",
        help="whole servers or GPUs per class",
    )
    ctl = p.add_argument_group("control loop")
    ctl.add_argument(
        "--telemetry-period-s",
        type=float,
        default=2.0,
        help="row power averaging = controller interval",
    )
    ctl.add_argument(
        "--telemetry-delay-s", type=float, default=2.0, help="age of the newest row power reading"
    )
    ctl.add_argument(
        "--actuation-jitter",
        type=float,
        default=0.0,
        help="per-server delay drawn in [1-J, 1] x delay",
    )
    ctl.add_argument(
        "--trend-window-s", type=float, default=10.0, help="row power trend window (brake rule)"
    )
    ctl.add_argument(
        "--brake-tolerance-s", type=float, default=5.0, help="over budget this long fires the brake"
    )
    ctl.add_argument(
        "--brake-hold-s", type=float, default=10.0, help="how long a brake holds the clocks"
    )
    load = p.add_argument_group("load")
    load.add_argument(
        "--trace",
        default="azure-code",
        help="CSV (TIMESTAMP,ContextTokens,GeneratedTokens), azure-code or synthetic-chat",
    )
    scale = load.add_mutually_exclusive_group()
    scale.add_argument(
        "--load-scale", type=float, default=None, help="trace copies per server (preset)"
    )
    scale.add_argument(
        "--peak-pct", type=float, default=None, help="calibrate the load so the base row peaks here"
    )
    load.add_argument(
        "--tenants", type=int, default=16, help="independent services the copies belong to"
    )
    load.add_argument(
        "--jitter-s", type=float, default=60.0, help="random shift of each tenant's trace copy"
    )
    load.add_argument(
        "--trace-offset", type=duration_s, default=0.0, help="start this far into the trace"
    )
    load.add_argument(
        "--duration", type=duration_s, default=3600.0, help="simulated time (e.g. 3600, 90m, 2h)"
    )
    load.add_argument(
        "--diurnal-period", type=duration_s, default=86400.0, help="length of the load's day"
    )
    load.add_argument(
        "--diurnal-trough", type=float, default=1.0, help="load at night / at peak (1 = flat)"
    )
    load.add_argument(
        "--diurnal-peak",
        type=duration_s,
        default=None,
        help="when the load peaks (default: mid-period)",
    )
    run = p.add_argument_group("run")
    run.add_argument("--step-s", type=float, default=0.1, help="simulation step")
    run.add_argument(
        "--max-wait-s", type=float, default=30.0, help="a prompt queued longer is dropped"
    )
    run.add_argument("--warmup", type=duration_s, default=60.0, help="left out of the metrics")
    run.add_argument("--seed", type=int, default=0, help="workload seed (first of --seeds)")
    run.add_argument(
        "--max-in-flight-per-gpu",
        type=int,
        default=1024,
        help="more requests in flight per GPU means the row collapsed: the run stops",
    )
    run.add_argument(
        "--max-decode-batch",
        type=int,
        default=256,
        help="requests one GPU decodes at once (vLLM's max_num_seqs); a full batch starts "
        "no prefill, so prompts queue and time out by --max-wait-s",
    )
    run.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="wall time per run (each point of a plan), then it counts as collapsed",
    )
    run.add_argument("--out", type=Path, default=None, help="write JSON, CSV and PNG files here")
    run.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    run.add_argument("--json", action="store_true", help="print the JSON summary instead of text")


def add_parsers(subparsers: Any) -> None:
    """Add ``simulate`` and ``plan`` to the ``polca`` command's subparsers."""
    sim = subparsers.add_parser(
        "simulate",
        formatter_class=_DefaultsShown,
        help="replay a request trace on a simulated row under a policy, against uncapped",
        description="Simulate an oversubscribed row of GPU servers serving an LLM request "
        "trace, capped by a polca policy through the production engine, and report the "
        "latency, throughput, brake and power figures against an uncapped run.",
    )
    sim.add_argument("--policy", type=Path, required=True, help="policy file")
    sim.add_argument(
        "--oversubscription", type=ratio, default=0.0, help="e.g. 0.3 or 30%% more servers"
    )
    sim.add_argument(
        "--actuation",
        type=actuation,
        default=("out-of-band", 40.0),
        help="in-band, out-of-band or seconds",
    )
    _common(sim)

    plan = subparsers.add_parser(
        "plan",
        formatter_class=_DefaultsShown,
        help="find the largest deployment that meets latency SLOs with zero brake events",
        description="Sweep oversubscription (and optionally T1/T2) for one or more policies "
        "and actuation delays; report the largest deployment meeting the SLOs with at most "
        "--max-brakes brake events, with a frontier plot.",
    )
    plan.add_argument(
        "--policy", type=Path, action="append", required=True, help="policy file (repeatable)"
    )
    plan.add_argument(
        "--actuation",
        type=actuation,
        action="append",
        default=None,
        help="repeatable; default out-of-band",
    )
    plan.add_argument(
        "--oversubscription",
        type=ratio_grid,
        default=ratio_grid("0:0.5:0.05"),
        help="START:STOP:STEP or a list",
    )
    hist = plan.add_argument_group(
        "history (plan from a row's recorded power instead of a request trace)"
    )
    hist.add_argument(
        "--history",
        default=None,
        metavar="CSV|URL",
        help="CSV of timestamp,power_w[,hp_power_w,lp_power_w] for a row of --servers, or "
        "http://HOST:8086/DATABASE (InfluxDB 1.x with polca's row measurement)",
    )
    hist.add_argument("--history-row", default=None, help="the row's name in InfluxDB")
    hist.add_argument("--history-site", default=None, help="the site's name in InfluxDB")
    hist.add_argument(
        "--history-since", default="60d", help="how far back to read InfluxDB (e.g. 42d)"
    )
    hist.add_argument(
        "--history-step-s", type=float, default=2.0, help="readings averaged onto this step"
    )
    hist.add_argument(
        "--history-gpu-physics",
        default=None,
        metavar="MODEL",
        help="replay on the simulated GPU backend's power model (what `polca demo` runs: "
        "H100-SXM, ...) instead of the profile's, as for a `polca demo --record` history",
    )
    hist.add_argument(
        "--decode-share",
        type=float,
        default=0.5,
        help="share of the GPUs' busy time spent decoding (memory-bound)",
    )
    feed = plan.add_argument_group(
        "feed failure (a Flex row sized against both of its feeds: zero reserved power)"
    )
    feed.add_argument(
        "--feed-failure",
        action="store_true",
        help="replay the loss of one of the row's feeds at each point: a point passes only "
        "if the row's power stays under the surviving feeds' rating after the failover",
    )
    feed.add_argument(
        "--feed-w",
        type=float,
        default=None,
        help="each feed's rating in W (the row's budget stays --budget-w, typically the sum)",
    )
    feed.add_argument("--feeds", type=int, default=None, help="the row's feeds (default 2)")
    feed.add_argument(
        "--failover-s",
        type=float,
        default=None,
        help="from the loss until the row runs on the survivors' rating: the meter's poll "
        "plus one control step (default 2; 4 for a feed seen only by its meter going dark)",
    )
    feed.add_argument(
        "--failure-at",
        default=None,
        metavar="worst|T",
        help="when the feed is lost: worst, the start of the failover-long interval of the "
        "highest row power (the default), or a time into the run (e.g. 1800, 30m)",
    )
    feed.add_argument(
        "--outage-s",
        default=None,
        metavar="DURATION",
        help="how long the feed stays down (e.g. 600, 10m; default: to the end of the run)",
    )
    plan.add_argument(
        "--search",
        choices=["grid", "bisect"],
        default="grid",
        help="grid: every ratio of --oversubscription; bisect: the same answer from "
        "log2(n) + 2 of them per policy (assumes more servers never help)",
    )
    plan.add_argument(
        "--t1-pct", type=number_list, default=[], help="sweep the first threshold too"
    )
    plan.add_argument(
        "--t2-pct", type=number_list, default=[], help="sweep the second threshold too"
    )
    slo = plan.add_argument_group("SLOs (% against uncapped; POLCA's by default)")
    slo.add_argument(
        "--slo-hp-p50-pct", type=float, default=1.0, help="high-priority P50 latency impact"
    )
    slo.add_argument(
        "--slo-hp-p99-pct", type=float, default=5.0, help="high-priority P99 latency impact"
    )
    slo.add_argument(
        "--slo-lp-loss-pct", type=float, default=2.0, help="low-priority throughput loss"
    )
    slo.add_argument(
        "--slo-lp-p50-pct", type=float, default=5.0, help="low-priority P50 latency impact"
    )
    slo.add_argument(
        "--slo-lp-p99-pct", type=float, default=50.0, help="low-priority P99 latency impact"
    )
    slo.add_argument("--max-brakes", type=int, default=0, help="brake events allowed")
    plan.add_argument("--jobs", type=int, default=1, help="worker processes")
    plan.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="workload seeds per point (from --seed); a point passes only if every seed does",
    )
    _common(plan)


def main(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``polca simulate`` or ``polca plan``; returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        import numpy  # noqa: F401, PLC0415 - the extra's presence is checked here

        from polca.sim import commands  # noqa: PLC0415
    except ImportError:
        err.write(_MISSING_EXTRA.format(command=args.command) + "\n")
        return EX_CONFIG
    return commands.run(args, out=out, err=err)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``simulate ...`` or ``plan ...`` alone (tests and ``python -m polca.sim``)."""
    parser = argparse.ArgumentParser(prog="polca")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


__all__ = ["COMMANDS", "add_parsers", "duration_s", "main", "parse", "ratio", "ratio_grid"]
