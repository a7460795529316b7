"""The site controller's step for 200 rows: the allocation of a whole site's power tree.

A site of ``--rows`` rows (each a floor PDU domain on a 2N pair of feeds), ten rows to a
UPS, five UPSes to a switchboard, under one utility; each row with a floor and demand in
two priority classes that change every step, and a random feed down in one step of ten.
It times ``powertree.allocate`` (the pure step the site controller will run every second)
over ``--steps`` steps and reports ``site_step_ms_p99`` and the median.

The floor, measured in the same run in a separate process: one walk over the same tree
that only reads every row's demand and sums the ratings (what any allocator must touch),
so the ratio says what the two passes cost above touching the tree.

Run from the repository root:

    .venv/bin/python bench/bench_power_tree.py [--rows 200] [--steps 2000]

It prints its figures and writes them into ``bench/results/power_tree.json``, where
``bench/bench_feed_failure.py`` puts the end-to-end ones (a feed failure to lowered budgets
and caps at real agents, the site controller's failover).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import median, percentile, write_result  # noqa: E402

from polca.powertree.allocate import RowDemand, allocate  # noqa: E402
from polca.powertree.capacity import FeedState, SiteState  # noqa: E402
from polca.powertree.model import SiteTree, build_tree  # noqa: E402


def site(rows: int) -> SiteTree:
    """The benchmark's tree: utility > switchboards > UPSes > row PDUs (A/B) > rows."""
    row_names = [f"row{i}" for i in range(rows)]
    ups_names = [f"ups{i}" for i in range((rows + 9) // 10)]
    boards = [f"sb{i}" for i in range((len(ups_names) + 4) // 5)]
    domains: dict[str, Any] = {
        "utility": {"kind": "utility", "rating_w": 1e9, "supplies": boards},
    }
    for b, board in enumerate(boards):
        domains[board] = {
            "kind": "switchboard",
            "rating_w": 8e6,
            "supplies": ups_names[b * 5 : b * 5 + 5],
            "oversubscribed": True,
        }
    for u, ups in enumerate(ups_names):
        mine = row_names[u * 10 : u * 10 + 10]
        domains[ups] = {
            "kind": "ups",
            "rating_w": 2e6,
            "battery_w": 1.5e6,
            "supplies": [f"{r}-pdu" for r in mine],
            "oversubscribed": True,
        }
        for r in mine:
            domains[f"{r}-pdu"] = {
                "kind": "floor_pdu",
                "rating_w": 400_000,
                "feeds": [
                    {"name": "A", "rating_w": 200_000, "sources": [f"{r}-a"]},
                    {"name": "B", "rating_w": 200_000, "sources": [f"{r}-b"]},
                ],
                "supplies": [r],
            }
    tree, problems = build_tree(
        {"rows": {r: {"rating_w": 400_000} for r in row_names}, "domains": domains}
    )
    if tree is None:
        msg = f"bench tree invalid: {problems[:3]}"
        raise SystemExit(msg)
    return tree


def _inputs(tree: SiteTree, steps: int, seed: int) -> list[tuple[SiteState, dict[str, RowDemand]]]:
    rng = random.Random(seed)
    feeds = [(d.name, f.name) for d in tree.domains.values() for f in d.feeds]
    out = []
    for step in range(steps):
        down = {rng.choice(feeds): FeedState("down")} if step % 10 == 0 else {}
        demands = {
            row: RowDemand(
                floor_w=rng.uniform(50_000, 100_000),
                demand_w=(rng.uniform(0, 200_000), rng.uniform(0, 200_000)),
            )
            for row in tree.rows
        }
        out.append((SiteState(feeds=down), demands))
    return out


def _time_steps(tree: SiteTree, steps: int, *, floor: bool) -> list[float]:
    inputs = _inputs(tree, steps, seed=7)
    times_ms: list[float] = []
    for state, demands in inputs:
        start = time.perf_counter()
        if floor:
            total = 0.0
            for row in tree.rows:
                d = demands[row]
                total += d.floor_w + sum(d.demand_w) + tree.rating_w(row)
            for name in tree.domains:
                total += tree.rating_w(name)
        else:
            allocate(tree, state, demands)
        times_ms.append((time.perf_counter() - start) * 1000)
    return times_ms


def main() -> int:
    """Run the floor in its own process, then the allocation here; print and write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--floor-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_only:
        print(json.dumps(_time_steps(site(args.rows), args.steps, floor=True)))
        return 0
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--floor-only",
            "--rows",
            str(args.rows),
            "--steps",
            str(args.steps),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    floor_ms = json.loads(done.stdout)
    tree = site(args.rows)
    step_ms = _time_steps(tree, args.steps, floor=False)
    result = {
        "rows": args.rows,
        "domains": len(tree.domains),
        "feeds": sum(len(d.feeds) for d in tree.domains.values()),
        "steps": args.steps,
        "site_step_ms_p99": round(percentile(step_ms, 99), 3),
        "site_step_ms_median": round(median(step_ms), 3),
        "floor_step_ms_p99": round(percentile(floor_ms, 99), 3),
        "floor_step_ms_median": round(median(floor_ms), 3),
        "ratio_median": round(median(step_ms) / max(median(floor_ms), 1e-9), 1),
        "goal_site_step_ms_p99": 20.0,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(
        f"site step, {args.rows} rows ({result['domains']} domains, {result['feeds']} feeds): "
        f"p99 {result['site_step_ms_p99']} ms, median {result['site_step_ms_median']} ms "
        f"(goal p99 <= 20 ms)"
    )
    print(
        f"floor (one walk reading every row, own process): p99 {result['floor_step_ms_p99']} "
        f"ms, median {result['floor_step_ms_median']} ms; ratio {result['ratio_median']}x"
    )
    path = REPO / "bench" / "results" / "power_tree.json"
    merged = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    merged.update(result)  # bench_feed_failure.py's end-to-end figures stay
    write_result(path, merged)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
