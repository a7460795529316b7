"""A 1,000-node site through one Mosquitto: aggregators sharded by row, 10 minutes.

The load generator emulates ``--rows`` x ``--racks`` x ``--nodes-per-rack`` 8-GPU nodes
publishing telemetry at 1 Hz (``--publishers`` processes, paced), less the nodes that real
agents run (``--agents``, in row 0, on simulated GPUs in their own process). The rows are
sharded across ``--aggregators`` real aggregator processes (``Aggregator`` from a
configuration file, each with its InfluxDB sink writing to one VictoriaMetrics, per-GPU
points every 10 s: ``influx.write_every_s``). The driver publishes every row's meter at
1 Hz. Everything runs in its own process on this machine.

Every ``--sample-s`` it reads, per aggregator: CPU, resident memory, telemetry handled, the
control steps' times. Midway it runs ``--trials`` reaction trials on row 0 (meter over T2
-> the real agents capped, as ``bench_reaction.py`` does). At the end: messages dropped
(published minus handled), each aggregator's intake, CPU and control interval jitter, and
memory at the start and end of the run (flat, or it grows).

Run from the repository root (10 minutes and the set-up):

    .venv/bin/python bench/bench_site.py [--seconds 600]

It prints a table and writes ``bench/results/site.json``.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import (  # noqa: E402
    BROKER_CONFIG,
    Child,
    RowDriver,
    median,
    percentile,
    proc_cpu_s,
    proc_rss_mb,
    react_once,
    release_policy,
    site_node,
    stop_all,
    write_result,
)

SITE = "bench"
NODE_GPU_W = 8 * 480.0  # what the load generator's nodes report
BASE_PCT, HIGH_PCT = 60.0, 95.0


def _rows(count: int) -> list[str]:
    return [f"row{i:02d}" for i in range(count)]


def _config(
    workdir: Path,
    *,
    index: int,
    rows: list[str],
    args: argparse.Namespace,
    port: int,
    policy: Path,
    influx_url: str,
) -> Path:
    config = {
        "site": SITE,
        "instance": f"agg{index}",
        "policy_file": str(policy),
        "state_dir": str(workdir / f"agg{index}"),
        "mqtt": {"host": "127.0.0.1", "port": port},
        "influx": {"url": influx_url, "api": "v2", "write_every_s": {"gpu": 10.0}},
        # ... and it repeats one figure while the agents cap: not a hung PDU card.
        "control": {"meter_frozen_readings": 100_000},
        "rows": [
            {
                "name": row,
                # The nodes draw half of it: level 0 until a meter says otherwise.
                "budget_w": args.racks * args.nodes_per_rack * NODE_GPU_W * 2,
                # The driver's meter is a figure, not a device: it may read the budget.
                "meter_max_w": args.racks * args.nodes_per_rack * NODE_GPU_W * 4,
                "racks": [
                    {
                        "name": f"r{r}",
                        "nodes": [
                            {"name": site_node(row, r, n)} for n in range(args.nodes_per_rack)
                        ],
                    }
                    for r in range(args.racks)
                ],
            }
            for row in rows
        ],
        "logging": {"level": "warning", "format": "json"},
    }
    path = workdir / f"agg{index}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _sample(aggregators: list[Child], broker_pid: int) -> dict[str, Any]:
    return {
        "t": time.monotonic(),
        "aggregators": [
            {"cpu_s": a.cpu_s(), "rss_mb": a.rss_mb(), **a.ask("stats")} for a in aggregators
        ],
        "broker": {"cpu_s": proc_cpu_s(broker_pid), "rss_mb": proc_rss_mb(broker_pid)},
    }


def _jitter(steps: list[float], interval_s: float, skip: tuple[float, float]) -> dict[str, float]:
    """Control steps' lateness; gaps touching ``skip`` (the reaction trials) left out."""
    gaps = [
        b - a
        for a, b in itertools.pairwise(steps)
        if not (skip[0] - 2 <= b and a <= skip[1] + 2)  # urgent steps are extra ones
    ]
    late = [abs(g - interval_s) * 1e3 for g in gaps]
    return {
        "steps": len(steps),
        "interval_p50_s": round(median(gaps), 4),
        "jitter_p50_ms": round(median(late), 2),
        "jitter_p99_ms": round(percentile(late, 0.99), 2),
        "jitter_max_ms": round(max(late), 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:  # noqa: PLR0915 - the whole run
    """Start the site, load it, sample it, measure a reaction, stop it."""
    from tests.mqtt_broker import MosquittoProcess
    from tests.tsdb import VictoriaMetricsProcess

    rows = _rows(args.rows)
    shards = [rows[i :: args.aggregators] for i in range(args.aggregators)]
    agent_nodes = [site_node(rows[0], 0, n) for n in range(args.agents)]
    nodes = args.rows * args.racks * args.nodes_per_rack
    load_nodes = nodes - len(agent_nodes)
    budget_w = args.racks * args.nodes_per_rack * NODE_GPU_W * 2
    with tempfile.TemporaryDirectory(prefix="polca-bench-site-") as tmp:
        workdir = Path(tmp)
        broker = MosquittoProcess(workdir / "mosquitto", extra_config=BROKER_CONFIG)
        vm = VictoriaMetricsProcess(workdir / "vm")
        broker.start()
        vm.start()
        assert broker.pid is not None
        children: list[Child] = []
        driver: RowDriver | None = None
        try:
            policy = release_policy(workdir)
            aggregators = []
            for i, shard in enumerate(shards):
                config = _config(
                    workdir,
                    index=i,
                    rows=shard,
                    args=args,
                    port=broker.port,
                    policy=policy,
                    influx_url=vm.url,
                )
                aggregators.append(
                    Child.role(
                        "serve", f"--config={config}", f"--agent-nodes={','.join(agent_nodes)}"
                    )
                )
            children.extend(aggregators)
            listen = Child.role(
                "listen",
                f"--port={broker.port}",
                f"--topic=polca/v1/{SITE}/{rows[0]}/meter",
                f"--topic=polca/v1/{SITE}/{rows[0]}/control",
            )
            children.append(listen)
            agents = Child.role(
                "agents",
                f"--port={broker.port}",
                f"--site={SITE}",
                f"--row={rows[0]}",
                f"--nodes={','.join(f'r0/{n}' for n in agent_nodes)}",
                f"--policy={policy}",
                f"--state-dir={workdir / 'agents'}",
                "--issuer=agg0",
            )
            children.append(agents)
            for child in children:
                assert child.line(timeout_s=120).get("ready")
            driver = RowDriver(
                broker.port,
                site=SITE,
                meters_w=dict.fromkeys(rows, budget_w * BASE_PCT / 100),
                watch=[rows[0]],
                period_s=1.0,
            )
            rate = load_nodes / args.publishers  # each node at 1 Hz
            publishers = [
                Child.role(
                    "publish",
                    f"--port={broker.port}",
                    f"--site={SITE}",
                    f"--rows={','.join(rows)}",
                    f"--racks={args.racks}",
                    f"--nodes-per-rack={args.nodes_per_rack}",
                    f"--exclude={','.join(agent_nodes)}",
                    f"--part={i}",
                    f"--parts={args.publishers}",
                    f"--rate={rate}",
                    f"--count={int(rate * args.seconds)}",
                )
                for i in range(args.publishers)
            ]
            children.extend(publishers)
            start = time.monotonic()
            driver.wait_level(rows[0], 0, settle_s=2.0, timeout_s=120)
            samples = []
            trials: list[dict[str, Any]] = []
            trial_window = (0.0, 0.0)
            trials_at = start + args.seconds / 2
            while time.monotonic() < start + args.seconds:
                samples.append(_sample(aggregators, broker.pid))
                if not trials and time.monotonic() >= trials_at:
                    trial_start = time.monotonic()
                    trials = [
                        react_once(
                            driver,
                            [agents],
                            listen,
                            row=rows[0],
                            high_w=budget_w * HIGH_PCT / 100 + k * 0.001,
                            count=len(agent_nodes),
                        )
                        for k in range(args.trials)
                    ]
                    trial_window = (trial_start, time.monotonic())
                time.sleep(max(0.0, args.sample_s - (time.monotonic() - samples[-1]["t"])))
            sent = [p.line(timeout_s=120) for p in publishers]
            time.sleep(3)  # the last messages reach the aggregators
            samples.append(_sample(aggregators, broker.pid))
        finally:
            if driver is not None:
                driver.close()
            stop_all(children)
            broker.kill()
            vm.kill()
    return _report(args, samples, sent, trials, trial_window, shards=shards, nodes=nodes)


def _report(
    args: argparse.Namespace,
    samples: list[dict[str, Any]],
    sent: list[dict[str, Any]],
    trials: list[dict[str, Any]],
    trial_window: tuple[float, float],
    *,
    shards: list[list[str]],
    nodes: int,
) -> dict[str, Any]:
    warm = next(s for s in samples if s["t"] - samples[0]["t"] >= args.warmup_s)
    end = samples[-2]  # the last sample under load (the very last one is after it)
    span_s = end["t"] - warm["t"]
    per_aggregator = []
    for i, shard in enumerate(shards):
        first, last = warm["aggregators"][i], end["aggregators"][i]
        steps = [
            t
            for s in samples
            if warm["t"] <= s["t"] <= end["t"]
            for t in s["aggregators"][i]["steps"]
        ]
        per_aggregator.append(
            {
                "rows": len(shard),
                "nodes": len(shard) * args.racks * args.nodes_per_rack,
                "cpu_pct": round(100 * (last["cpu_s"] - first["cpu_s"]) / span_s, 1),
                "intake_msgs_per_s": round((last["telemetry"] - first["telemetry"]) / span_s, 1),
                "control": _jitter(steps, 1.0, trial_window),
                "rss_mb_start": round(first["rss_mb"], 1),
                "rss_mb_end": round(last["rss_mb"], 1),
                "rss_mb_max": round(
                    max(s["aggregators"][i]["rss_mb"] for s in samples if s["t"] >= warm["t"]), 1
                ),
                "dropped": samples[-1]["aggregators"][i]["dropped"],
                "points_written": samples[-1]["aggregators"][i]["points_written"],
                "points_dropped": samples[-1]["aggregators"][i]["points_dropped"],
            }
        )
    published = sum(p["sent"] for p in sent)
    handled = sum(a["telemetry"] for a in samples[-1]["aggregators"])
    reaction = [t["reaction_ms"] for t in trials]
    broker_cpu = 100 * (end["broker"]["cpu_s"] - warm["broker"]["cpu_s"]) / span_s
    return {
        "benchmark": "site",
        "nodes": nodes,
        "gpus": nodes * 8,
        "rows": args.rows,
        "aggregators": args.aggregators,
        "publishers": args.publishers,
        "real_agents": args.agents,
        "seconds": args.seconds,
        "published": published,
        "publish_rate_msgs_per_s": round(sum(p["rate"] for p in sent), 1),
        "handled": handled,
        "dropped": published - handled,
        "per_aggregator": per_aggregator,
        "broker_cpu_pct": round(broker_cpu, 1),
        "broker_rss_mb": round(end["broker"]["rss_mb"], 1),
        "reaction": {
            "trials": len(trials),
            "agents": args.agents,
            "p50_ms": round(median(reaction), 1) if reaction else None,
            "p99_ms": round(percentile(reaction, 0.99), 1) if reaction else None,
            "max_ms": round(max(reaction), 1) if reaction else None,
            "control_p50_ms": round(median([t["control_ms"] for t in trials]), 1)
            if trials
            else None,
        },
        "rss_timeline_mb": [
            [round(s["t"] - samples[0]["t"]), [round(a["rss_mb"], 1) for a in s["aggregators"]]]
            for s in samples
        ],
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def main() -> int:
    """Run, print, write bench/results/site.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--racks", type=int, default=5)
    parser.add_argument("--nodes-per-rack", type=int, default=10)
    parser.add_argument("--aggregators", type=int, default=4)
    parser.add_argument("--publishers", type=int, default=3)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--warmup-s", type=float, default=60)
    parser.add_argument("--sample-s", type=float, default=15)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "site.json")
    args = parser.parse_args()
    result = run(args)
    write_result(args.out, result)
    print(
        f"{result['nodes']} nodes ({result['gpus']} GPUs), {result['rows']} rows on "
        f"{result['aggregators']} aggregators, {args.seconds:.0f} s: published "
        f"{result['published']} ({result['publish_rate_msgs_per_s']} msg/s), "
        f"dropped {result['dropped']}"
    )
    print(
        f"{'aggregator':>10} {'nodes':>6} {'msg/s':>7} {'CPU %':>6} {'jitter p99':>11} "
        f"{'RSS start':>10} {'RSS end':>8}"
    )
    for i, a in enumerate(result["per_aggregator"]):
        print(
            f"{i:>10} {a['nodes']:>6} {a['intake_msgs_per_s']:>7} {a['cpu_pct']:>6} "
            f"{a['control']['jitter_p99_ms']:>9} ms {a['rss_mb_start']:>8} MB "
            f"{a['rss_mb_end']:>6} MB"
        )
    r = result["reaction"]
    print(
        f"broker CPU {result['broker_cpu_pct']} %, RSS {result['broker_rss_mb']} MB; "
        f"row reaction ({r['agents']} agents, {r['trials']} trials): p50 {r['p50_ms']} ms, "
        f"p99 {r['p99_ms']} ms, max {r['max_ms']} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
