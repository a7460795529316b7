"""Does the planner sign `polca demo`'s row? The demo's uncapped load, planned from.

``polca.demo.load.uncapped_load`` computes the demo row's uncapped counterfactual (the same
simulated GPUs and tenant replays as a run, on a simulated clock: no daemons, seconds of
CPU per simulated minute) and writes it as the power history ``polca plan --history``
reads. The planner then replays it with the demo's policy on the simulated backend's
power model (``--history-gpu-physics``), 1 s telemetry and in-band caps, at each budget
asked for, and says whether the demo's servers meet POLCA's SLOs with zero brake events.
Run from the repository root:

    .venv/bin/python bench/demo_plan.py [--duration 1800] [--seed 0 ...]
        [--budget-fraction 0.75 --budget-fraction 0.775 ...] [--tenants 4] [--policy FILE]

It prints one line per budget and seed and writes ``bench/results/demo_plan.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import write_result  # noqa: E402

from polca.demo.load import uncapped_load  # noqa: E402
from polca.demo.options import DemoOptions  # noqa: E402
from polca.policy import load_policy  # noqa: E402
from polca.sim.agreement import plan_demo_row  # noqa: E402

# What each row of the JSON keeps of the plan's point.
POINT_KEYS = (
    "violations",
    "brake_events",
    "peak_pct",
    "uncapped_peak_pct",
    "lp_throughput_loss_pct",
    "hp_p99_impact_pct",
    "time_at_level_pct",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    parser.add_argument("--seed", type=int, action="append", default=None)
    parser.add_argument("--budget-fraction", type=float, action="append", default=None)
    parser.add_argument("--tenants", type=int, default=None)
    parser.add_argument("--policy", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "demo_plan.json")
    args = parser.parse_args()
    base = DemoOptions()
    if args.tenants is not None:
        base = dataclasses.replace(base, tenants=args.tenants)
    if args.policy is not None:
        base = dataclasses.replace(base, policy=args.policy)
    classes = load_policy(base.policy).policy.classes
    rows = []
    with tempfile.TemporaryDirectory(prefix="polca-demo-plan-") as work:
        for seed in args.seed or [0]:
            seeded = dataclasses.replace(base, seed=seed)
            view = uncapped_load(seeded, args.duration)
            history = Path(work) / f"uncapped-{seed}.csv"
            view.write_uncapped(history, classes)
            for fraction in args.budget_fraction or [base.budget_fraction]:
                options = dataclasses.replace(seeded, budget_fraction=fraction)
                point = plan_demo_row(
                    history,
                    policy_file=options.policy,
                    row=options.planner_row(),
                    out=Path(work) / f"plan-{seed}-{fraction}",
                )
                levels = point["time_at_level_pct"]
                row = {
                    "seed": seed,
                    "budget_fraction": fraction,
                    "budget_w": round(options.row_budget_w()),
                    "uncapped_peak_w": round(view.uncapped_peak_w),
                    "passes": not point["violations"] and point["brake_events"] == 0,
                    **{k: point[k] for k in POINT_KEYS},
                }
                rows.append(row)
                verdict = "signed" if row["passes"] else "; ".join(point["violations"])
                print(
                    f"seed {seed} budget {fraction:.3f} of nameplate "
                    f"({row['budget_w'] / 1000:.1f} kW): uncapped peak "
                    f"{point['uncapped_peak_pct']:.1f}%, capped peak "
                    f"{point['peak_pct']:.1f}%, LP loss {point['lp_throughput_loss_pct']:.2f}%, "
                    f"HP P99 {point['hp_p99_impact_pct']:.2f}%, brake level "
                    f"{levels.get('brake', 0.0):.2f}% of the time -> {verdict}"
                )
    write_result(
        args.out,
        {
            "duration_s": args.duration,
            "policy": str(
                base.policy.relative_to(REPO) if base.policy.is_relative_to(REPO) else base.policy
            ),
            "tenants": base.tenants,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
