"""How fast the simulator runs: one hour of trace on a 52-server row at 100 ms steps.

The issue's target: at most 30 s on one core, and linear in rows. This script times

- the headline: one hour of the bundled Azure code trace on a row of 52 DGX-A100 servers
  (40 provisioned, +30%), 100 ms steps, capped by ``policies/polca-a100.yaml`` with in-band
  actuation (so the controller, the engine and the actuator all run), split into building
  the requests and running the time loop;
- the floor: the same number of steps doing only the numpy work every vectorised step
  must do (advance each GPU's prefill, count and advance the decodes, sum the power) on
  arrays of the same sizes, without routing, bookkeeping or control: what the simulator
  would cost if everything but the arithmetic were free;
- scaling: ten minutes of 1, 2 and 4 rows (of 52 servers each) in one run, per row-hour.

Usage (from the repository root, with the ``polca[sim]`` extra installed)::

    .venv/bin/python bench/bench_sim.py            # about a minute and a half
    .venv/bin/python bench/bench_sim.py --strict   # exit 1 if the headline is over 30 s

It prints a table and writes ``bench/results/sim.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from polca.policy import load_policy
from polca.sim.model import ACTUATION_PRESETS_S
from polca.sim.scenario import Scenario, row_config, run_once, workload
from polca.sim.workload import load_trace
from polca.workload.trace import Trace

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 30.0


def timed_run(scenario: Scenario, trace: Trace, policy_path: Path) -> dict[str, float]:
    """Build the requests, then the whole capped run; seconds for each and sizes."""
    policy = load_policy(policy_path).policy
    t0 = time.perf_counter()
    requests = workload(scenario, trace)
    t1 = time.perf_counter()
    result = run_once(scenario, trace, policy)  # builds the same requests again, then runs
    t2 = time.perf_counter()
    loop_s = (t2 - t1) - (t1 - t0)
    steps = len(result.row_power_w)
    return {
        "build_s": t1 - t0,
        "run_s": loop_s,
        "total_s": t2 - t1,
        "steps": float(steps),
        "gpus": float(row_config(scenario).gpus * scenario.rows),
        "requests": float(len(requests)),
        "us_per_step": 1e6 * loop_s / steps,
        "ticks": float(len(result.tick_s)),
        "brakes": float(len(result.brakes)),
    }


def floor_s(*, steps: int, gpus: int, in_flight: int, seed: int = 0) -> float:
    """The numpy arithmetic of ``steps`` steps alone (see the module docstring)."""
    rng = np.random.default_rng(seed)
    backlog = rng.uniform(0.0, 1.0, gpus)
    done = np.zeros(gpus)
    speed = np.ones(gpus)
    gpu_of = rng.integers(0, gpus, in_flight)
    remaining = rng.uniform(1.0, 50.0, in_flight)
    token_s = np.full(gpus, 0.02)
    dt = 0.1
    total = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        busy = np.minimum(dt, (backlog - done) / speed)  # prefill progress per GPU
        done = done + busy * speed
        n_dec = np.bincount(gpu_of, minlength=gpus)  # decodes per GPU
        rate = (dt - busy) / token_s
        remaining -= rate[gpu_of]  # decode progress per request
        power = busy * 400.0 + (dt - busy) * (n_dec > 0) * 200.0  # power per GPU
        total += float(power.sum())
    elapsed = time.perf_counter() - t0
    assert total > 0  # the work is used, so nothing is optimised away
    return elapsed


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 1 under --strict when the target is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=3600.0, help="simulated seconds")
    parser.add_argument("--strict", action="store_true", help="exit 1 above the 30 s target")
    parser.add_argument("--no-scaling", action="store_true", help="skip the rows scaling runs")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sim.json")
    args = parser.parse_args(argv)

    trace = load_trace("azure-code")
    policy = REPO / "policies" / "polca-a100.yaml"
    base = Scenario(duration_s=args.duration, oversubscription=0.3)
    base = replace(
        base, control=replace(base.control, actuation_delay_s=ACTUATION_PRESETS_S["in-band"])
    )
    headline = timed_run(base, trace, policy)
    in_flight = int(headline["requests"] / args.duration * 1.5)  # ~1.5 s in the system each
    floor = floor_s(steps=int(headline["steps"]), gpus=int(headline["gpus"]), in_flight=in_flight)

    scaling: list[dict[str, float]] = []
    if not args.no_scaling:
        for rows in (1, 2, 4):
            s = replace(base, rows=rows, duration_s=600.0)
            r = timed_run(s, trace, policy)
            r["rows"] = float(rows)
            r["s_per_row_hour"] = r["total_s"] / rows * 3600.0 / 600.0
            scaling.append(r)

    print(f"{'measure':<58} {'value':>10}")
    print(f"{'one hour, 52 servers, 100 ms steps: total (s)':<58} {headline['total_s']:>10.2f}")
    print(f"{'  building the requests (s)':<58} {headline['build_s']:>10.2f}")
    print(f"{'  the time loop (s)':<58} {headline['run_s']:>10.2f}")
    print(f"{'  per step (us)':<58} {headline['us_per_step']:>10.1f}")
    print(f"{'floor: the numpy arithmetic alone, same steps (s)':<58} {floor:>10.2f}")
    print(f"{'time loop / floor':<58} {headline['run_s'] / floor:>10.1f}")
    for r in scaling:
        label = f"scaling: {r['rows']:.0f} row(s) x 52 servers, s per row-hour"
        print(f"{label:<58} {r['s_per_row_hour']:>10.2f}")
    print(
        f"requests {headline['requests']:.0f}, GPUs {headline['gpus']:.0f}, "
        f"controller ticks {headline['ticks']:.0f}, brake events {headline['brakes']:.0f}"
    )
    met = headline["total_s"] <= TARGET_S
    print(f"target: <= {TARGET_S:.0f} s on one core: {'met' if met else 'MISSED'}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "python": platform.python_version(),
                "numpy": np.__version__,
                "machine": platform.machine(),
                "headline": headline,
                "floor_s": floor,
                "scaling": scaling,
                "target_s": TARGET_S,
                "met": met,
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
