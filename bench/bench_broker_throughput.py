"""Broker throughput: a 3-node NATS cluster against one Mosquitto, on the same stream.

The stream of ``bench/bench_aggregator.py``: a row of 128 nodes (4 racks x 32) whose
8-GPU telemetry (about 4.6 kB a message) comes at QoS 0 from ``--publishers`` publisher
processes (``benchkit publish``). Measured in one run, each consumer in its own process:

- **Mosquitto floor**: a bare subscriber (``benchkit floor``) on one Mosquitto with
  unbounded queues (``benchkit.BROKER_CONFIG``), the publishers on the same broker;
- **NATS floor**: the same subscriber on node 2 of a 3-node NATS cluster (its MQTT
  gateway, JetStream R3, ``tests/nats_cluster.py``), the publishers on nodes 0 and 1, so
  every message crosses a cluster route;
- **NATS intake**: the real aggregator (``benchkit aggregator``: ``bench_aggregator``'s
  configuration with ``mqtt.endpoints`` starting at node 2 and
  ``mqtt.subscription_qos_max: 0``, its InfluxDB sink on a VictoriaMetrics) in place of the
  bare subscriber.

Method: **pacing**, because draining (``bench_aggregator``: the consumer stopped, SIGSTOP,
while the publishers fill the broker's queue for it, then resumed) does not work on NATS:
the server keeps at most 64 MiB (``max_pending``) for a client that does not read, then
disconnects it as a *slow consumer*. Each run shows it first: both floors drained with
``--messages`` (30,000, as ``bench_aggregator``; Mosquitto delivers all of them, NATS only
the thousand or so that sat in the socket buffers: its pending 64 MiB are discarded),
then ``--drain-trials`` drains of ``--drain-messages`` (10,000: 46 MB, under the limit),
whose median is a secondary figure (the subscriber's top speed from each broker, nothing
else on the CPUs).

The main figures come from a ladder of paced steps: the publishers send at a fixed total
rate for ``--step-s`` seconds while the consumer runs; the rate goes up by ``--rate-step``
from ``--start-rate`` (the intake: ``--intake-*``) until a step fails twice in a row (down
by halves instead if the first rate fails), and one more step halfway between the last
rate passed and the first failed refines the figure. A step passes when the consumer got
every message published and its last one came at most ``1 - KEEP_PACE`` (5 %) of the
publishing window after the publishers' last: it kept their pace (Mosquitto's unbounded
queue would otherwise hide a consumer falling behind; NATS drops one that falls about
64 MiB behind). A step where the publishers themselves could not hold the rate (the
machine's CPUs) ends the ladder without passing (``limited_by_publishers``). The figure
is the highest rate passed: what the broker sustains to one consumer with publishers,
broker and consumer sharing this machine's CPUs, so a broker's own CPU use counts against
it. The broker processes' CPU seconds (``/proc/PID/stat``; the three NATS nodes together)
are given per 1,000 messages at that step, and net of their idle use.

    .venv/bin/python bench/bench_broker_throughput.py [--step-s 6] [--start-rate 4000]

Writes ``bench/results/broker_throughput.json``: ``mosquitto_floor_msgs_per_s``,
``nats_floor_msgs_per_s``, ``nats_intake_msgs_per_s`` (sustainable paced rates, msg/s;
null with ``nats_intake_null_reason`` when none passed), ``ratio_nats_to_mosquitto``, the
drain figures, the broker CPU per 1,000 messages, ``dropped`` (messages published and not
received over the whole run: the drain probe and failed steps, where the limits show) and
every step.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

if TYPE_CHECKING:
    from tests.mqtt_broker import MosquittoProcess
    from tests.nats_cluster import NatsCluster

from bench.benchkit import (  # noqa: E402
    BROKER_CONFIG,
    Child,
    median,
    proc_cpu_s,
    write_result,
)

SITE, ROW = "bench", "row1"
RACKS, NODES_PER_RACK = 4, 32
TOPIC = f"polca/v1/{SITE}/{ROW}/+/+/telemetry"
KEEP_PACE = 0.95
"""A step passes only if the consumer's last message came at most ``1 - KEEP_PACE`` of the
publishing window after the publishers' last (the consumer kept this share of their pace,
so it did not fall behind)."""
GRACE_S = 6.0
"""How long a consumer waits for messages beyond the step (publishers start, stragglers)."""

Endpoint = tuple[str, int]


@dataclass
class Target:
    """One thing measured: a consumer on a broker, and where the publishers connect."""

    name: str
    role: str  # benchkit role: floor or aggregator
    consumer: Endpoint
    publish_to: Sequence[Endpoint]
    broker_pids: Callable[[], list[int]]
    start_rate: float
    rate_step: float
    slow_consumers: Callable[[], int] | None = None  # NATS: /varz slow_consumers, all nodes
    extra: Sequence[str] = ()
    idle_cpu: float = 0.0  # the broker processes' CPU seconds per second, idle
    steps: list[dict[str, Any]] = field(default_factory=list)

    def consumer_args(self, count: int, timeout_s: float) -> list[str]:
        """The consumer role's command line."""
        host, port = self.consumer
        args = [f"--host={host}", f"--port={port}", f"--count={count}"]
        args.append(f"--timeout-s={timeout_s}")
        if self.role == "floor":
            args += [f"--topic={TOPIC}", "--until-disconnect"]
        return [*args, *self.extra]


def _child(role: str, args: Sequence[str], log: Path) -> Child:
    """``python -m bench.benchkit ROLE ARGS``, its stderr (tracebacks) to ``log``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "daemon"), env.get("PYTHONPATH", "")]
    )
    with log.open("a", encoding="utf-8") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.benchkit", role, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            cwd=REPO,
        )
    return Child(process)


def _publishers(target: Target, *, count: int, parts: int, rate: float, log: Path) -> list[Child]:
    """``parts`` publisher processes, turn about on the target's publish endpoints."""
    return [
        _child(
            "publish",
            [
                f"--host={target.publish_to[i % len(target.publish_to)][0]}",
                f"--port={target.publish_to[i % len(target.publish_to)][1]}",
                f"--count={count // parts}",
                "--qos=0",
                f"--part={i}",
                f"--parts={parts}",
                f"--rate={rate / parts}",
                f"--racks={RACKS}",
                f"--nodes-per-rack={NODES_PER_RACK}",
            ],
            log,
        )
        for i in range(parts)
    ]


def _broker_cpu_s(target: Target) -> float:
    return sum(proc_cpu_s(pid) for pid in target.broker_pids())


def _consumer_result(consumer: Child, timeout_s: float, log: Path) -> dict[str, Any]:
    """The consumer's JSON line; ``failed`` with its last error line if it gave none."""
    try:
        result = consumer.line(timeout_s=timeout_s)
    except RuntimeError:
        consumer.stop()
        lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        return {"received": 0, "rate": 0.0, "failed": lines[-1] if lines else "no output"}
    consumer.stop()
    return result


def _drain(target: Target, *, count: int, parts: int, log: Path) -> dict[str, Any]:
    """``bench_aggregator``'s method: the consumer stopped while ``count`` messages are
    published, then resumed."""
    consumer = _child(target.role, target.consumer_args(count, 60.0), log)
    assert consumer.line(timeout_s=60).get("ready")
    slow_before = target.slow_consumers() if target.slow_consumers else 0
    cpu_before = _broker_cpu_s(target)
    consumer.pause()
    pubs = _publishers(target, count=count, parts=parts, rate=0.0, log=log)
    sent = sum(p.line(timeout_s=120)["sent"] for p in pubs)
    for p in pubs:
        p.process.wait()
    time.sleep(1.0)  # what the broker does with the stopped consumer's backlog
    consumer.resume()
    result = _consumer_result(consumer, 90.0, log)
    result.update(
        sent=sent,
        dropped=sent - result["received"],
        broker_cpu_s=round(_broker_cpu_s(target) - cpu_before, 3),
    )
    if target.slow_consumers:
        result["slow_consumers"] = target.slow_consumers() - slow_before
    return result


def _published(pubs: Sequence[Child], timeout_s: float) -> tuple[int, float]:
    """Messages the publishers sent, and their window: the first one's start to the last
    one's end (each publisher's end noted as its line arrives, its start from its
    ``elapsed_s``; the publishers start a few tenths of a second apart)."""

    def read(pub: Child) -> tuple[dict[str, Any], float]:
        line = pub.line(timeout_s=timeout_s)
        return line, time.monotonic()

    with ThreadPoolExecutor(len(pubs)) as pool:
        done = list(pool.map(read, pubs))
    for pub in pubs:
        pub.process.wait()
    start = min(at - line["elapsed_s"] for line, at in done)
    return sum(line["sent"] for line, _ in done), max(at for _, at in done) - start


def _step(
    target: Target, *, rate: float, seconds: float, parts: int, idle_cpu: float, log: Path
) -> dict[str, Any]:
    """Publishers at ``rate`` msg/s for ``seconds`` while the consumer runs."""
    count = int(rate * seconds) // parts * parts
    began = time.monotonic()
    consumer = _child(target.role, target.consumer_args(count, seconds + GRACE_S), log)
    assert consumer.line(timeout_s=90).get("ready")
    slow_before = target.slow_consumers() if target.slow_consumers else 0
    cpu_before, cpu_at = _broker_cpu_s(target), time.monotonic()
    pubs = _publishers(target, count=count, parts=parts, rate=rate, log=log)
    sent, window_s = _published(pubs, seconds + 120)
    result = _consumer_result(consumer, seconds + GRACE_S + 60, log)
    broker_cpu = _broker_cpu_s(target) - cpu_before
    broker_net = broker_cpu - idle_cpu * (time.monotonic() - cpu_at)
    publish_rate = sent / window_s
    lag_s = result.get("span_s", 0.0) - window_s
    out: dict[str, Any] = {
        "rate": rate,
        "sent": sent,
        "received": result["received"],
        "dropped": sent - result["received"],
        "publish_rate": round(publish_rate),
        "receive_rate": round(result["rate"]),
        "publish_window_s": round(window_s, 3),
        "lag_s": round(lag_s, 3),
        "broker_cpu_s": round(broker_cpu, 3),
        "broker_cpu_s_per_1000": round(broker_cpu / sent * 1000, 4),
        "broker_cpu_s_per_1000_net_of_idle": round(broker_net / sent * 1000, 4),
        "wall_s": round(time.monotonic() - began, 1),
    }
    for key in ("disconnected", "failed", "intake_dropped", "inbox_dropped"):
        if result.get(key):
            out[key] = result[key]
    if target.slow_consumers:
        out["slow_consumers"] = target.slow_consumers() - slow_before
    kept_up = out["dropped"] == 0 and lag_s <= (1 - KEEP_PACE) * window_s
    # Publishers that could not keep the rate (the machine's CPUs): the rate was not tried.
    short = publish_rate < KEEP_PACE * rate
    out["status"] = "failed" if not kept_up else "publishers_short" if short else "passed"
    return out


def _ladder(
    target: Target, *, step_s: float, max_rate: float, parts: int, log: Path
) -> dict[str, Any]:
    """Rates up from the target's start until a step fails (twice); then one step between.

    Down by halves instead while the first rates fail (at most twice).
    """

    def step(rate: float) -> str:
        result = _step(
            target, rate=rate, seconds=step_s, parts=parts, idle_cpu=target.idle_cpu, log=log
        )
        target.steps.append(result)
        extra = " (the broker disconnected it)" if result.get("disconnected") else ""
        print(
            f"  {target.name}: {rate:>6.0f} msg/s -> {result['received']}/{result['sent']} "
            f"received, {result['lag_s']:+.2f} s behind the publishers: "
            f"{result['status']}{extra}",
            flush=True,
        )
        return str(result["status"])

    def attempt(rate: float) -> str:
        status = step(rate)
        # Once more after a failure: other work on the machine, a slow start.
        return status if status == "passed" else step(rate)

    best: float | None = None
    failed: float | None = None
    limited_by_publishers = False
    rate, halved = target.start_rate, 0
    while rate <= max_rate and (failed is None or rate < failed):
        status = attempt(rate)
        if status == "passed":
            best = rate
            rate += target.rate_step
            continue
        if status == "publishers_short":
            limited_by_publishers = True  # the load generators' limit on this machine
            break
        failed = rate
        if best is not None or halved == 2:
            break
        rate, halved = rate / 2, halved + 1
    if (
        best is not None
        and failed is not None
        and failed - best > target.rate_step / 4
        and step((best + failed) / 2) == "passed"
    ):
        best = (best + failed) / 2
    at_best = [s for s in target.steps if s["rate"] == best and s["status"] == "passed"]
    return {
        "sustainable_msgs_per_s": round(best) if best is not None else None,
        "first_failed_msgs_per_s": round(failed) if failed is not None else None,
        "limited_by_publishers": limited_by_publishers,
        "broker_cpu_s_per_1000": at_best[-1]["broker_cpu_s_per_1000"] if at_best else None,
        "broker_cpu_s_per_1000_net_of_idle": at_best[-1]["broker_cpu_s_per_1000_net_of_idle"]
        if at_best
        else None,
        "broker_idle_cpu_s_per_s": round(target.idle_cpu, 4),
        "steps": target.steps,
    }


def _aggregator_config(workdir: Path, *, endpoints: Sequence[Endpoint], influx_url: str) -> Path:
    """``bench_aggregator``'s configuration, on the cluster from node 2 on, QoS 0."""
    from bench.bench_aggregator import aggregator_config

    ordered = [*endpoints[2:], *endpoints[:2]]
    mqtt = {"endpoints": [f"{host}:{port}" for host, port in ordered], "subscription_qos_max": 0}
    return aggregator_config(workdir, mqtt=mqtt, influx_url=influx_url)


def _drains(
    targets: dict[str, Target], args: argparse.Namespace, log: Path
) -> dict[str, dict[str, Any]]:
    """Both floors drained: once with ``--messages`` (over NATS's 64 MiB pending limit at
    the default), then ``--drain-trials`` times with ``--drain-messages`` (under it)."""
    out: dict[str, dict[str, Any]] = {}
    for key in ("mosquitto_floor", "nats_floor"):
        target = targets[key]
        probe = _drain(target, count=args.messages, parts=args.publishers, log=log)
        small = [
            _drain(target, count=args.drain_messages, parts=args.publishers, log=log)
            for _ in range(args.drain_trials)
        ]
        whole = [r["rate"] for r in small if r["dropped"] == 0]
        out[key] = {
            "probe": probe,
            "small_msgs_per_s": round(median(whole)) if len(whole) == len(small) else None,
            "small_runs": small,
        }
        gone = " (the broker disconnected it)" if probe.get("disconnected") else ""
        print(
            f"drain {target.name}: {probe['received']}/{probe['sent']} received{gone}; "
            f"{args.drain_messages} drained at {out[key]['small_msgs_per_s']} msg/s",
            flush=True,
        )
    return out


def _targets(
    args: argparse.Namespace,
    workdir: Path,
    mosquitto: MosquittoProcess,
    cluster: NatsCluster,
    influx_url: str | None,
) -> dict[str, Target]:
    """What is measured: both floors, and the intake when ``influx_url`` is given."""
    nats = cluster.mqtt_endpoints

    def slow_consumers() -> int:
        total = 0
        for node in cluster.nodes:
            varz = node.monitor("/varz")
            assert isinstance(varz, dict)
            total += int(varz.get("slow_consumers") or 0)
        return total

    def nats_pids() -> list[int]:
        return [pid for node in cluster.nodes if (pid := node.pid) is not None]

    def mosquitto_pids() -> list[int]:
        return [mosquitto.pid] if mosquitto.pid is not None else []

    mosquitto_at = (mosquitto.host, mosquitto.port)
    floor = (args.start_rate, args.rate_step)
    targets = {
        "mosquitto_floor": Target(
            "mosquitto floor", "floor", mosquitto_at, [mosquitto_at], mosquitto_pids, *floor
        ),
        "nats_floor": Target(
            "nats floor", "floor", nats[2], nats[:2], nats_pids, *floor, slow_consumers
        ),
    }
    if influx_url is not None:
        config = _aggregator_config(workdir, endpoints=nats, influx_url=influx_url)
        targets["nats_intake"] = Target(
            "nats intake",
            "aggregator",
            nats[2],
            nats[:2],
            nats_pids,
            args.intake_start_rate,
            args.intake_rate_step,
            slow_consumers,
            extra=(f"--config={config}",),
        )
    return targets


def _measure_idle(targets: Sequence[Target], seconds: float = 3.0) -> None:
    """Each target's ``idle_cpu``: its brokers' CPU seconds per second with no load (NATS:
    JetStream's and the routes' own work)."""
    before = [_broker_cpu_s(t) for t in targets]
    began = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - began
    for target, cpu in zip(targets, before, strict=True):
        target.idle_cpu = (_broker_cpu_s(target) - cpu) / elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both brokers, the drain probe and the ladders."""
    from tests.mqtt_broker import MosquittoProcess
    from tests.nats_cluster import NatsCluster
    from tests.tsdb import VictoriaMetricsProcess

    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="polca-bench-brokers-") as tmp:
        workdir = Path(tmp)
        log = workdir / "children.log"
        mosquitto = MosquittoProcess(workdir / "mosquitto", extra_config=BROKER_CONFIG)
        cluster = NatsCluster(workdir / "nats")
        vm = VictoriaMetricsProcess(workdir / "vm") if args.intake else None
        try:
            mosquitto.start()
            cluster.start_all()
            if vm is not None:
                vm.start()
            targets = _targets(args, workdir, mosquitto, cluster, vm.url if vm else None)
            _measure_idle(list(targets.values()))
            drains = _drains(targets, args, log)
            ladders = {
                key: _ladder(
                    target,
                    step_s=args.step_s,
                    max_rate=args.max_rate,
                    parts=args.publishers,
                    log=log,
                )
                for key, target in targets.items()
            }
        finally:
            mosquitto.kill()
            cluster.kill_all()
            if vm is not None:
                vm.kill()
    return _figures(args, drains, ladders, time.monotonic() - began)


def _figures(
    args: argparse.Namespace,
    drains: dict[str, dict[str, Any]],
    ladders: dict[str, dict[str, Any]],
    duration_s: float,
) -> dict[str, Any]:
    mosq = ladders["mosquitto_floor"]["sustainable_msgs_per_s"]
    nats_floor = ladders["nats_floor"]["sustainable_msgs_per_s"]
    intake = ladders["nats_intake"]["sustainable_msgs_per_s"] if args.intake else None
    reason = None
    if not args.intake:
        reason = "not measured (--no-intake)"
    elif intake is None:
        reason = "no paced step passed (see ladders.nats_intake.steps)"
    runs = [
        *(d["probe"] for d in drains.values()),
        *(r for d in drains.values() for r in d["small_runs"]),
        *(s for ladder in ladders.values() for s in ladder["steps"]),
    ]
    drained = {key: d["small_msgs_per_s"] for key, d in drains.items()}
    drain_m, drain_n = drained.get("mosquitto_floor"), drained.get("nats_floor")
    return {
        "benchmark": "broker_throughput",
        "method": (
            f"paced: {args.publishers} publisher processes at a fixed total rate for "
            f"{args.step_s:g} s a step, rates up by a step until one fails (tried twice), "
            "then one halfway; a step passes when every message arrived and the consumer's "
            f"last came within {1 - KEEP_PACE:.0%} of the publishing window after the "
            "publishers' last. Not drained: NATS server disconnects a stopped consumer "
            "once 64 MiB are pending for it (drains.nats_floor.probe); *_drain_msgs_per_s: "
            f"drains of {args.drain_messages} messages, under that limit"
        ),
        "mosquitto_floor_msgs_per_s": mosq,
        "nats_floor_msgs_per_s": nats_floor,
        "nats_intake_msgs_per_s": intake,
        "nats_intake_null_reason": reason,
        "ratio_nats_to_mosquitto": round(nats_floor / mosq, 3) if mosq and nats_floor else None,
        "ratio_nats_intake_to_floor": round(intake / nats_floor, 3)
        if intake and nats_floor
        else None,
        "mosquitto_drain_msgs_per_s": drain_m,
        "nats_drain_msgs_per_s": drain_n,
        "ratio_nats_to_mosquitto_drain": round(drain_n / drain_m, 3)
        if drain_m and drain_n
        else None,
        "limited_by_publishers": [k for k, v in ladders.items() if v["limited_by_publishers"]],
        "mosquitto_cpu_s_per_1000_msgs": ladders["mosquitto_floor"]["broker_cpu_s_per_1000"],
        "nats_cpu_s_per_1000_msgs": ladders["nats_floor"]["broker_cpu_s_per_1000"],
        "messages": sum(r["sent"] for r in runs),
        "dropped": sum(r["dropped"] for r in runs),
        "slow_consumer_disconnects": sum(r.get("slow_consumers", 0) for r in runs),
        "nodes": RACKS * NODES_PER_RACK,
        "gpus_per_message": 8,
        "qos": 0,
        "publishers": args.publishers,
        "step_s": args.step_s,
        "drain_messages": args.drain_messages,
        "drains": drains,
        "ladders": ladders,
        "brokers": {
            "mosquitto": "one mosquitto, unbounded queues",
            "nats": "nats-server 3-node cluster (MQTT gateway, JetStream R3); publishers on "
            "nodes 0 and 1, consumer on node 2",
        },
        "duration_s": round(duration_s, 1),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def main() -> int:
    """Run, print, write JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--step-s", type=float, default=6.0, help="seconds per paced step")
    parser.add_argument("--start-rate", type=float, default=4000.0, help="msg/s, floors")
    parser.add_argument("--rate-step", type=float, default=2000.0, help="msg/s, floors")
    parser.add_argument("--intake-start-rate", type=float, default=2000.0, help="msg/s")
    parser.add_argument("--intake-rate-step", type=float, default=1000.0, help="msg/s")
    parser.add_argument("--max-rate", type=float, default=40_000.0, help="msg/s, last step")
    parser.add_argument("--publishers", type=int, default=2)
    parser.add_argument("--messages", type=int, default=30_000, help="the drain probe, per broker")
    parser.add_argument(
        "--drain-messages", type=int, default=10_000, help="a drain under NATS's 64 MiB"
    )
    parser.add_argument("--drain-trials", type=int, default=3)
    parser.add_argument(
        "--no-intake", dest="intake", action="store_false", help="skip the aggregator"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "broker_throughput.json"
    )
    args = parser.parse_args()
    figures = run(args)
    write_result(args.out, figures)
    f = figures
    at_least = {key: ">=" if key in f["limited_by_publishers"] else "" for key in f["ladders"]}
    print(
        f"msg/s, paced (QoS 0, 4.6 kB): mosquitto floor {at_least['mosquitto_floor']}"
        f"{f['mosquitto_floor_msgs_per_s']} | nats floor {at_least['nats_floor']}"
        f"{f['nats_floor_msgs_per_s']} (x{f['ratio_nats_to_mosquitto']}) | nats intake "
        f"{at_least.get('nats_intake', '')}{f['nats_intake_msgs_per_s']}; drained "
        f"{f['drain_messages']}: mosquitto {f['mosquitto_drain_msgs_per_s']} | nats "
        f"{f['nats_drain_msgs_per_s']} (x{f['ratio_nats_to_mosquitto_drain']}); broker CPU s "
        f"per 1000 msgs: mosquitto {f['mosquitto_cpu_s_per_1000_msgs']} | nats "
        f"{f['nats_cpu_s_per_1000_msgs']}; dropped {f['dropped']} of {f['messages']} (drain "
        f"probe, failed steps), {f['slow_consumer_disconnects']} slow-consumer disconnects"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
