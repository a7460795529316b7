"""The simulator against the running system: the demo's row through the real daemons,
then the same load through the planner's replay; time per level, capping episodes and
peak row power compared within stated tolerances.

One ``polca demo`` process (aggregator, 12 agents on simulated H100s replaying the bundled
trace, ``--record``) against a real Mosquitto started here, without the cooling incident;
then ``polca.sim.agreement.agreement`` replays the run's uncapped counterfactual with the
same policy, budget and servers on the daemons' GPU model. Run from the repository root:

    .venv/bin/python bench/sim_agreement.py [--duration 600] [--seed 0] [--plot FILE]
        [--keep DIR | --again DIR]

It prints the comparison and writes ``bench/results/agreement.json`` (and the plot).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.* is repository tooling (the Mosquitto runner)

from bench.benchkit import write_result  # noqa: E402


def _demo(args: argparse.Namespace, record: Path) -> str:
    """``polca demo`` through a Mosquitto started here, recorded into ``record``."""
    from tests.mqtt_broker import MosquittoProcess

    broker = MosquittoProcess(record / "mosquitto")
    broker.start()
    try:
        demo = subprocess.run(
            [
                sys.executable,
                "-m",
                "polca",
                "demo",
                "--duration",
                str(args.duration),
                "--seed",
                str(args.seed),
                "--incident-at",
                "-1",
                "--feed-loss-at",
                "-1",
                "--broker",
                f"{broker.host}:{broker.port}",
                "--record",
                str(record),
            ],
            capture_output=True,
            text=True,
            timeout=args.duration + 120,
            check=False,
        )
    finally:
        broker.stop()
    if demo.returncode != 0:
        sys.stderr.write(demo.stdout[-3000:] + demo.stderr[-3000:])
        msg = f"polca demo exited {demo.returncode}"
        raise SystemExit(msg)
    return demo.stdout[demo.stdout.find("== polca demo summary ==") :]


def run(args: argparse.Namespace, record: Path) -> dict[str, Any]:
    """The demo through Mosquitto, recorded; then the replay and the comparison."""
    from polca.demo.options import DEMO_POLICY, DemoOptions
    from polca.policy import load_policy
    from polca.sim.agreement import agreement

    options = DemoOptions(seed=args.seed)
    started = time.monotonic()
    summary = "(a kept record, --again)" if args.again else _demo(args, record)
    policy = load_policy(DEMO_POLICY).policy
    budget_w = options.row_budget_w()
    result = agreement(record, policy=policy, row=options.planner_row(), warmup_s=args.warmup)
    result.update(
        benchmark="agreement",
        duration_s=args.duration,
        seed=args.seed,
        wall_s=round(time.monotonic() - started, 1),
        budget_w=round(budget_w, 1),
        servers=len(options.nodes),
        demo_summary=summary.strip().splitlines(),
    )
    if args.plot is not None:
        from polca.sim.agreement import read_row_record
        from polca.sim.plots import agreement_plot

        agreement_plot(
            args.plot,
            read_row_record(record / "row.csv"),
            result["simulator_series"],
            budget_w=budget_w,
            level_names=[policy.level_name(i) for i in range(policy.top_level + 1)],
            title=(
                f"polca demo, {len(options.nodes)} x 8 {options.model}, budget "
                f"{budget_w / 1000:.1f} kW, seed {args.seed}: daemons against the replay"
            ),
        )
    return result


def main() -> int:
    """Run, print, write bench/results/agreement.json; exit 1 when they disagree."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds left out first")
    parser.add_argument("--plot", type=Path, default=None, help="also draw this PNG")
    parser.add_argument(
        "--keep", type=Path, default=None, help="record into this directory and keep it"
    )
    parser.add_argument(
        "--again", type=Path, default=None, help="compare the record kept in this directory"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "agreement.json")
    args = parser.parse_args()
    if args.again is not None:  # compare a kept record again, without running the demo
        result = run(args, args.again)
    elif args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        result = run(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="polca-agreement-") as tmp:
            result = run(args, Path(tmp))
    series = result.pop("simulator_series")
    write_result(args.out, result)
    print(f"{'metric':<32}{'daemons':>10}{'simulator':>11}{'diff':>8}{'tolerance':>11}")
    for m in result["metrics"]:
        print(
            f"{m['metric']:<32}{m['daemons']:>10.2f}{m['simulator']:>11.2f}"
            f"{m['difference']:>+8.2f}{m['tolerance']:>11.2f}  {'ok' if m['ok'] else 'MISS'}"
        )
    print(
        f"window {result['window_s'][0]:.0f}..{result['window_s'][1]:.0f} s, "
        f"{result['daemons']['summaries']} row summaries, {len(series['t_s'])} replayed steps; "
        f"uncapped peak {result['simulator_uncapped_peak_pct']:.1f}%: "
        + ("agree" if result["agree"] else "DISAGREE")
    )
    print(json.dumps({k: result[k] for k in ("agree", "wall_s")}))
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
