"""Aggregator intake throughput against a bare subscriber, each in its own process.

One Mosquitto (unbounded queues), a VictoriaMetrics for the aggregator's sink, and a row of
128 nodes (4 racks x 32) whose 8-GPU telemetry (about 4.6 kB a message) comes from
``--publishers`` publisher processes (``bench/benchkit.py``). Measured, each in its own
process, on the same stream in the same run:

- **floor**: a bare aiomqtt subscriber that only counts messages;
- **intake**: the real aggregator (``polca.aggregator.runtime.Aggregator`` from a
  configuration file, its rollups, controllers and InfluxDB sink running), timing each
  message its intake handled.

Each is measured by *draining*: it is stopped (SIGSTOP) while the publishers fill the
broker's queue for it with ``--messages`` messages, then resumed, so it runs at its own top
speed with nothing else on the CPU; the rate is messages over the span from its first to
its last. Then a *paced* run: publishers at ``--paced-rate`` msg/s for ``--paced-s``
seconds while the aggregator runs: did it keep up (received == published)? QoS 0 and QoS 1.

    .venv/bin/python bench/bench_aggregator.py [--messages 30000] [--trials 3]

Writes ``bench/results/aggregator.json``: ``intake_msgs_per_s``, ``floor_msgs_per_s``
(medians, QoS 0), ``dropped`` (messages published but not handled, over all runs), and
the details per QoS.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import BROKER_CONFIG, Child, median, publishers, write_result  # noqa: E402

SITE, ROW = "bench", "row1"
RACKS, NODES_PER_RACK = 4, 32
TOPIC = f"polca/v1/{SITE}/{ROW}/+/+/telemetry"


def aggregator_config(workdir: Path, *, mqtt: dict[str, Any], influx_url: str) -> Path:
    """The aggregator of the benchmark's row (128 nodes), admission out of the way."""
    from bench.benchkit import node_name

    config = {
        "site": SITE,
        "instance": "bench",
        "policy_file": str(REPO / "policies" / "polca-h100.yaml"),
        "state_dir": str(workdir / "state"),
        "mqtt": {**mqtt, "inbox_size": 200_000},
        "influx": {"url": influx_url, "api": "v2"},
        "rows": [
            {
                "name": ROW,
                "budget_w": 1e6,
                "racks": [
                    {
                        "name": f"r{r}",
                        "nodes": [{"name": node_name(r, n)} for n in range(NODES_PER_RACK)],
                    }
                    for r in range(RACKS)
                ],
            }
        ],
        # The capacity of decoding and rollup: each simulated node here sends far faster
        # than an agent does, so admission is out of the way (bench_flood.py measures it).
        "intake": {
            "telemetry_per_s": 10_000,
            "telemetry_burst": 100_000,
            "bytes_per_s": 1e12,
            "bytes_burst": 2**40,
        },
        "logging": {"level": "error", "format": "json"},
    }
    path = workdir / "aggregator.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _drain(consumer: Child, *, port: int, count: int, parts: int, qos: int) -> dict[str, Any]:
    """Stop ``consumer``, publish ``count`` messages, resume it: its figures."""
    assert consumer.line().get("ready")
    consumer.pause()
    pubs = publishers(
        port=port, count=count, parts=parts, qos=qos, racks=RACKS, nodes_per_rack=NODES_PER_RACK
    )
    sent = sum(p.line()["sent"] for p in pubs)
    for p in pubs:
        p.process.wait()
    cpu_before = consumer.cpu_s()
    consumer.resume()
    result = consumer.line(timeout_s=300)
    result["cpu_s"] = (
        round(consumer.cpu_s() - cpu_before, 3) if consumer.process.poll() is None else None
    )
    result["sent"] = sent
    result["dropped"] = sent - result["received"]
    consumer.stop()
    return result


def _paced(
    consumer: Child, *, port: int, rate: float, seconds: float, parts: int
) -> dict[str, Any]:
    """Publishers at ``rate`` msg/s for ``seconds`` while ``consumer`` runs."""
    assert consumer.line().get("ready")
    count = int(rate * seconds)
    pubs = publishers(
        port=port,
        count=count,
        parts=parts,
        qos=0,
        rate=rate,
        racks=RACKS,
        nodes_per_rack=NODES_PER_RACK,
    )
    sent = [p.line() for p in pubs]
    result = consumer.line(timeout_s=seconds + 60)
    result["sent"] = sum(s["sent"] for s in sent)
    result["publish_rate"] = sum(s["rate"] for s in sent)
    result["dropped"] = result["sent"] - result["received"]
    consumer.stop()
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement against one broker and one VictoriaMetrics."""
    from tests.mqtt_broker import MosquittoProcess
    from tests.tsdb import VictoriaMetricsProcess

    with tempfile.TemporaryDirectory(prefix="polca-bench-agg-") as tmp:
        workdir = Path(tmp)
        broker = MosquittoProcess(workdir / "mosquitto", extra_config=BROKER_CONFIG)
        vm = VictoriaMetricsProcess(workdir / "vm")
        broker.start()
        vm.start()
        try:
            config = aggregator_config(
                workdir, mqtt={"host": "127.0.0.1", "port": broker.port}, influx_url=vm.url
            )
            per_qos: dict[str, Any] = {}
            for qos in (0, 1):
                floors: list[dict[str, Any]] = []
                intakes: list[dict[str, Any]] = []
                common = (f"--port={broker.port}", f"--count={args.messages}")
                for _ in range(args.trials):
                    for runs, role, extra in (
                        (floors, "floor", (f"--qos={qos}", f"--topic={TOPIC}")),
                        (intakes, "aggregator", (f"--config={config}",)),
                    ):
                        consumer = Child.role(role, *common, *extra)
                        runs.append(
                            _drain(
                                consumer,
                                port=broker.port,
                                count=args.messages,
                                parts=args.publishers,
                                qos=qos,
                            )
                        )
                per_qos[f"qos{qos}"] = {
                    "floor_msgs_per_s": round(median([f["rate"] for f in floors])),
                    "intake_msgs_per_s": round(median([i["rate"] for i in intakes])),
                    "floor_runs": floors,
                    "intake_runs": intakes,
                }
            aggregator = Child.role(
                "aggregator",
                f"--port={broker.port}",
                f"--count={int(args.paced_rate * args.paced_s)}",
                f"--config={config}",
                f"--timeout-s={args.paced_s + 30}",
            )
            paced = _paced(
                aggregator,
                port=broker.port,
                rate=args.paced_rate,
                seconds=args.paced_s,
                parts=args.publishers,
            )
        finally:
            broker.kill()
            vm.kill()
    q0 = per_qos["qos0"]
    dropped = sum(r["dropped"] for q in per_qos.values() for r in q["intake_runs"])
    return {
        "benchmark": "aggregator_intake",
        "nodes": RACKS * NODES_PER_RACK,
        "gpus_per_message": 8,
        "messages": args.messages,
        "publishers": args.publishers,
        "intake_msgs_per_s": q0["intake_msgs_per_s"],
        "floor_msgs_per_s": q0["floor_msgs_per_s"],
        "ratio_to_floor": round(q0["intake_msgs_per_s"] / q0["floor_msgs_per_s"], 3),
        "dropped": dropped + paced["dropped"],
        "qos": per_qos,
        "paced": paced,
    }


def main() -> int:
    """Run, print, write JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--messages", type=int, default=30_000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--publishers", type=int, default=2)
    parser.add_argument("--paced-rate", type=float, default=5000.0)
    parser.add_argument("--paced-s", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "aggregator.json")
    args = parser.parse_args()
    figures = run(args)
    print(f"{'(msg/s, median of ' + str(args.trials) + ')':<28}{'QoS 0':>10}{'QoS 1':>10}")
    for key, label in (
        ("floor_msgs_per_s", "bare subscriber (floor)"),
        ("intake_msgs_per_s", "aggregator intake"),
    ):
        print(f"{label:<28}{figures['qos']['qos0'][key]:>10}{figures['qos']['qos1'][key]:>10}")
    print(
        f"ratio to the floor (QoS 0): {figures['ratio_to_floor']}; dropped: {figures['dropped']}; "
        f"{figures['nodes']} nodes of 8 GPUs, {args.publishers} publisher processes"
    )
    paced = figures["paced"]
    print(
        f"paced: {paced['sent']} messages at {paced['publish_rate']:.0f} msg/s, aggregator handled "
        f"{paced['received']} ({paced['dropped']} missing)"
    )
    write_result(args.out, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
