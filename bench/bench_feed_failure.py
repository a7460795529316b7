"""A feed fails under loaded rows: to lowered budgets, to caps at real agents; the site
controller killed: its standby takes over while the rows hold their leases.

Real processes on this machine, each its own: Mosquitto; a 3-member etcd; the Redfish
stand-in serving one rack PDU per row (mains ``AC1`` and ``AC2``: feeds A and B);
``polca meter run`` reading each main as its own source every second (``feed-a``,
``feed-b``); one ``polca aggregator`` owning every row, each row budgeted over one feed's
rating (a Flex row: ``fallback_budget_w`` and each feed at 60% of the budget, its
``feeds`` listed); two ``polca site run`` (``site-a``, ``site-b``) elected on etcd over a
site file of a UPS per row; ``--nodes`` synthetic nodes per row (``benchkit publish``,
one telemetry message a second each, in their own process); and on each of the first
``--fail-rows`` rows one real agent on simulated GPUs (``benchkit agents``, its cap writes
timed on the system's monotonic clock). The PDUs read the rows' power as the nodes report
it (70% of the budget, split over both mains).

Trials (``--trials``): the breaker of ``AC2`` trips on ``--fail-rows`` rows at once (the
stand-in's ``breakers`` state; their load moves to ``AC1``, now above one feed's rating),
and the driver times, from just before the first trip, per row: the first row summary
whose electrical budget is the surviving feed's rating (``feed_to_budget_s``), the
first budget message of the site controller at that rating (``site_budget_s``), and the
agent's first clock lock (``feed_to_caps_s``). The breakers close again and the rows
settle. The floor, in the same run on the same rows: the PDU's reading steps to 110% of
the budget with both feeds up (the meter -> aggregator -> agent path with no tree), timed
to the first summary at a level above 0 (``floor_to_level_s``) and the agent's first lock
(``floor_to_caps_s``). Then ``--kills`` times the leading site controller is SIGKILLed:
the time to the standby's first budget (``site_takeover_s``) and the rows whose summary
said ``fallback`` meanwhile (``rows_on_fallback_during_takeover``, goal 0). The site
controllers' CPU over the run is their step's cost (``site_cpu_pct``).

The issue's site is 200 rows of 64 nodes; this machine's two cores run ``--rows`` (10) of
``--nodes`` (16) by default, every process sharing them. Run from the repository root:

    .venv/bin/python bench/bench_feed_failure.py [--rows 10] [--nodes 16] [--fail-rows 4]
        [--trials 5] [--kills 5]

It prints its figures and merges them into ``bench/results/power_tree.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import (  # noqa: E402
    Child,
    median,
    percentile,
    proc_cpu_s,
    release_policy,
    site_node,
    wait_for,
    write_result,
)

SITE = "bench"
NODE_W = 480.0 * 8  # what one synthetic node reports (benchkit.telemetry_payloads)
RESULT = REPO / "bench" / "results" / "power_tree.json"
USER, PASSWORD = "polca", "bench-pdu"
SITES = ("site-a", "site-b")


class Watch:
    """Summaries and budgets of every row, on one paho client (its own thread)."""

    def __init__(self, port: int) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.lock = threading.Lock()
        self.summaries: list[tuple[float, str, dict[str, Any]]] = []
        self.budgets: list[tuple[float, str, dict[str, Any]]] = []
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-tree-watch")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.subscribe(f"polca/v1/{SITE}/+/summary", qos=0)
        self.client.subscribe(f"polca/v1/{SITE}/+/budget", qos=0)
        self.client.loop_start()

    def _on_message(self, _client: Any, _userdata: Any, message: Any) -> None:
        now = time.monotonic()
        try:
            data = json.loads(message.payload)
        except ValueError:
            return
        row = message.topic.split("/")[-2]
        with self.lock:
            if message.topic.endswith("/summary"):
                self.summaries.append((now, row, data))
            else:
                self.budgets.append((now, row, data))

    def first(self, kind: str, row: str, since: float, test: Any) -> float | None:
        """The arrival of the first message of ``kind`` for ``row`` after ``since``."""
        with self.lock:
            items = self.summaries if kind == "summary" else self.budgets
            for at, name, data in items:
                if at >= since and name == row and test(data):
                    return at
        return None

    def last(self, row: str) -> dict[str, Any] | None:
        """The row's latest summary."""
        with self.lock:
            for _, name, summary in reversed(self.summaries):
                if name == row:
                    found: dict[str, Any] = summary
                    return found
        return None

    def close(self) -> None:
        """Stop the client."""
        self.client.loop_stop()
        self.client.disconnect()


def _configs(
    args: argparse.Namespace, work: Path, port: int, url: str, etcd: list[str]
) -> dict[str, Path]:
    rows = [f"row{i}" for i in range(args.rows)]
    budget_w: float = args.nodes * NODE_W / 0.7
    feed_w = 0.6 * budget_w
    secret = work / "redfish.pass"
    secret.write_text(PASSWORD + "\n", encoding="utf-8")
    endpoint = {
        "url": url,
        "username": USER,
        "password_file": str(secret),
        "allow_http": True,
        "timeout_s": 0.8,
    }
    mqtt = {"host": "127.0.0.1", "port": port, "reconnect_min_s": 0.05, "reconnect_max_s": 0.5}
    meter = {
        "mqtt": mqtt,
        "site": SITE,
        "interval_s": 1.0,
        "read_timeout_s": 0.8,
        "rows": [
            {
                "row": row,
                "sources": [
                    {
                        "protocol": "redfish",
                        "name": f"feed-{x}",
                        "endpoint": endpoint,
                        "resource": "mains",
                        "pdu": f"pdu-{row}",
                        "circuits": [main],
                    }
                    for x, main in (("a", "AC1"), ("b", "AC2"))
                ],
            }
            for row in rows
        ],
        "logging": {"format": "json", "level": "warning"},
    }
    aggregator = {
        "site": SITE,
        "instance": "agg",
        "policy_file": str(work / "policy.yaml"),
        "state_dir": str(work / "agg-state"),
        "mqtt": mqtt,
        "control": {
            "interval_s": 1.0,
            "warmup_s": 2.0,
            "lease_s": 10.0,
            "meter_frozen_readings": 100_000,
        },
        "site_budget": {"issuers": list(SITES)},
        "rows": [
            {
                "name": row,
                "budget_w": budget_w,
                "fallback_budget_w": feed_w,
                "meter_max_w": 2 * budget_w,
                "feeds": [
                    {"name": "A", "rating_w": feed_w, "sources": ["feed-a"]},
                    {"name": "B", "rating_w": feed_w, "sources": ["feed-b"]},
                ],
                "racks": [
                    {
                        "name": "r0",
                        "nodes": [
                            {"name": site_node(row, 0, n), "gpus": 8} for n in range(args.nodes)
                        ],
                    }
                ],
            }
            for row in rows
        ],
        "logging": {"format": "json", "level": "warning"},
    }
    tree = {
        "rows": {row: {"rating_w": budget_w} for row in rows},
        "domains": {
            f"ups-{row}": {
                "kind": "ups",
                "rating_w": 2 * feed_w,
                "feeds": [
                    {"name": "A", "rating_w": feed_w, "sources": [f"{row}/feed-a"]},
                    {"name": "B", "rating_w": feed_w, "sources": [f"{row}/feed-b"]},
                ],
                "supplies": [row],
            }
            for row in rows
        },
    }
    (work / "site.yaml").write_text(yaml.safe_dump(tree), encoding="utf-8")
    paths = {"meter": work / "meter.yaml", "aggregator": work / "aggregator.yaml"}
    paths["meter"].write_text(yaml.safe_dump(meter), encoding="utf-8")
    paths["aggregator"].write_text(yaml.safe_dump(aggregator), encoding="utf-8")
    for name in SITES:
        site = {
            "mqtt": mqtt,
            "site": SITE,
            "instance": name,
            "tree_file": str(work / "site.yaml"),
            "interval_s": 1.0,
            "lease_s": 30.0,
            "ha": {"etcd_endpoints": etcd},
            "logging": {"format": "json", "level": "info"},
        }
        paths[name] = work / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(site), encoding="utf-8")
    return paths


def _start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "polca", *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )


def _leader(log: Path) -> bool:
    """Whether the site controller logging to ``log`` leads now (its last role line)."""
    role = None
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        if '"site_leadership_changed"' in line:
            role = json.loads(line).get("role")
    return role == "leader"


def run(args: argparse.Namespace) -> dict[str, Any]:  # noqa: PLR0915 - one scenario
    """Start everything, run the trials and the kills, return the figures."""
    from tests.etcd import EtcdCluster
    from tests.mqtt_broker import MosquittoProcess
    from tests.standins.process import RedfishStandIn

    rows = [f"row{i}" for i in range(args.rows)]
    failing = rows[: args.fail_rows]
    budget_w: float = args.nodes * NODE_W / 0.7
    feed_w = 0.6 * budget_w
    with tempfile.TemporaryDirectory(prefix="polca-bench-tree-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        broker = MosquittoProcess(work / "mosquitto")
        etcd = EtcdCluster(work / "etcd")
        standin = RedfishStandIn(
            work / "standin",
            devices=[f"pdu:pdu-{r}" for r in rows],
            username=USER,
            password=PASSWORD,
        )
        broker.start()
        etcd.start()
        standin.start()
        policy = release_policy(work)
        paths = _configs(args, work, broker.port, standin.url, etcd.endpoints)

        def pdu(row: str, **state: Any) -> None:
            standin.set_state(f"pdu-{row}", **state)

        for row in rows:
            pdu(row, mains={"AC1": 0.35 * budget_w, "AC2": 0.35 * budget_w})
        agent_nodes = {row: site_node(row, 0, 0) for row in failing}
        agents = {
            row: Child.role(
                "agents",
                f"--port={broker.port}",
                f"--site={SITE}",
                f"--row={row}",
                f"--nodes=r0/{node}",
                f"--policy={policy}",
                f"--state-dir={work / 'agents'}",
                "--issuer=agg",
                "--sample-interval-s=0.5",
            )
            for row, node in agent_nodes.items()
        }
        for child in agents.values():
            child.line(60)  # ready
        load = Child.role(
            "publish",
            f"--port={broker.port}",
            f"--site={SITE}",
            f"--rows={','.join(rows)}",
            "--racks=1",
            f"--nodes-per-rack={args.nodes}",
            f"--rate={args.rows * args.nodes}",
            f"--count={args.rows * args.nodes * 3600}",
            f"--exclude={','.join(agent_nodes.values())}",
        )
        procs = {
            "meter": _start(["meter", "run", "--config", str(paths["meter"])], work / "meter.log"),
            "aggregator": _start(
                ["aggregator", "--config", str(paths["aggregator"])], work / "aggregator.log"
            ),
        }
        logs = {name: work / f"{name}.log" for name in SITES}
        sites = {n: _start(["site", "run", "--config", str(paths[n])], logs[n]) for n in SITES}
        cpu_start = {n: (time.monotonic(), proc_cpu_s(p.pid)) for n, p in sites.items()}
        watch = Watch(broker.port)
        results: dict[str, list[float]] = {
            k: []
            for k in (
                "feed_to_budget_s",
                "site_budget_s",
                "feed_to_caps_s",
                "floor_to_level_s",
                "floor_to_caps_s",
                "site_takeover_s",
            )
        }
        on_fallback = 0
        try:

            def settled() -> bool:
                return all(
                    (s := watch.last(r)) is not None
                    and s.get("leased_budget_w") is not None
                    and s.get("budget_origin") == "config"
                    and s.get("level") == 0
                    for r in rows
                )

            try:
                wait_for(settled, 120, "every row on its lease, uncapped")
            except RuntimeError:
                print({r: watch.last(r) for r in rows[:2]}, flush=True)
                raise
            time.sleep(3.0)

            def locks(t0: float) -> dict[str, Any]:
                out = {}
                for row, child in agents.items():
                    answer = child.ask(f"locks {int(t0 * 1e9)}")
                    out[row] = answer[agent_nodes[row]]
                return out

            def elapsed(kind: str, row: str, t0: float, test: Any, what: str) -> float:
                wait_for(lambda: watch.first(kind, row, t0, test) is not None, 30, what)
                at = watch.first(kind, row, t0, test)
                assert at is not None
                return at - t0

            def caps(t0: float, key: str) -> None:
                time.sleep(3.0)  # the agents' writes are in by now
                for cap in locks(t0).values():
                    first_ns = cap.get("first_ns") or cap.get("capped_ns")
                    if cap["writes"] and first_ns:
                        results[key].append(first_ns / 1e9 - t0)

            def cut(data: dict[str, Any]) -> bool:
                return float(data.get("electrical_budget_w") or 1e18) <= feed_w + 1.0

            both = {"AC1": 0.35 * budget_w, "AC2": 0.35 * budget_w}
            for trial in range(args.trials):
                t0 = time.monotonic()
                for row in failing:
                    pdu(row, breakers={"AC2": "Tripped"}, mains={"AC1": 0.7 * budget_w, "AC2": 0})
                for row in failing:
                    results["feed_to_budget_s"].append(elapsed("summary", row, t0, cut, "a cut"))
                    results["site_budget_s"].append(
                        elapsed("budget", row, t0, lambda d: d["budget_w"] <= feed_w + 1, "a lease")
                    )
                caps(t0, "feed_to_caps_s")
                for row in failing:
                    pdu(row, breakers={"AC2": "Normal"}, mains=both)
                wait_for(settled, 60, "the rows back on both feeds")
                time.sleep(2.0)
                # The floor: the same rows over their budget with both feeds up.
                t0 = time.monotonic()
                for row in failing:
                    pdu(row, mains={"AC1": 0.55 * budget_w, "AC2": 0.55 * budget_w})
                for row in failing:
                    results["floor_to_level_s"].append(
                        elapsed("summary", row, t0, lambda d: d["level"] > 0, "a level")
                    )
                caps(t0, "floor_to_caps_s")
                for row in failing:
                    pdu(row, mains=both)
                wait_for(settled, 60, "the rows uncapped")
                time.sleep(2.0)
                cut_s = max(results["feed_to_budget_s"][-len(failing) :])
                floor_s = max(results["floor_to_level_s"][-len(failing) :])
                print(f"trial {trial + 1}: cut {cut_s:.2f} s, floor {floor_s:.2f} s", flush=True)
            for kill in range(args.kills):
                wait_for(
                    lambda: any(_leader(logs[n]) for n in SITES), 30, "a leading site controller"
                )
                leader = next(n for n in SITES if _leader(logs[n]))
                (standby,) = [n for n in SITES if n != leader]
                sites[leader].send_signal(signal.SIGKILL)
                sites[leader].wait()
                killed = time.monotonic()
                wait_for(
                    lambda k=killed, s=standby: any(
                        watch.first("budget", r, k, lambda d, s=s: d["issuer"] == s) is not None
                        for r in rows
                    ),
                    30,
                    f"{standby}'s first budget",
                )
                first = min(
                    t
                    for r in rows
                    if (
                        t := watch.first("budget", r, killed, lambda d, s=standby: d["issuer"] == s)
                    )
                    is not None
                )
                results["site_takeover_s"].append(first - killed)
                time.sleep(2.0)
                on_fallback += sum(
                    1
                    for r in rows
                    if watch.first(
                        "summary", r, killed, lambda d: d.get("budget_origin") == "fallback"
                    )
                    is not None
                )
                sites[leader] = _start(
                    ["site", "run", "--config", str(paths[leader])], logs[leader]
                )
                time.sleep(args.settle_s)
                took_s = results["site_takeover_s"][-1]
                print(f"kill {kill + 1}: {leader} -> {standby} in {took_s:.2f} s", flush=True)
            cpu = {
                n: 100.0
                * (proc_cpu_s(p.pid) - cpu_start[n][1])
                / (time.monotonic() - cpu_start[n][0])
                for n, p in sites.items()
                if p.poll() is None
            }
        finally:
            watch.close()
            for proc in (*procs.values(), *sites.values()):
                proc.kill()
                proc.wait()
            load.process.kill()
            for child in agents.values():
                child.process.kill()
            standin.kill()
            etcd.kill()
            broker.kill()

    def p(key: str, q: float) -> float | None:
        values = results[key]
        return round(percentile(values, q), 3) if values else None

    def med(key: str) -> float | None:
        values = results[key]
        return round(median(values), 3) if values else None

    return {
        "e2e_rows": args.rows,
        "e2e_nodes_per_row": args.nodes,
        "fail_rows": args.fail_rows,
        "trials": args.trials,
        "feed_to_budget_p99_s": p("feed_to_budget_s", 0.99),
        "feed_to_budget_median_s": med("feed_to_budget_s"),
        "site_budget_p99_s": p("site_budget_s", 0.99),
        "feed_to_caps_p99_s": p("feed_to_caps_s", 0.99),
        "feed_to_caps_median_s": med("feed_to_caps_s"),
        "floor_to_level_p99_s": p("floor_to_level_s", 0.99),
        "floor_to_level_median_s": med("floor_to_level_s"),
        "floor_to_caps_p99_s": p("floor_to_caps_s", 0.99),
        "floor_to_caps_median_s": med("floor_to_caps_s"),
        "kills": args.kills,
        "site_takeover_p99_s": p("site_takeover_s", 0.99),
        "site_takeover_median_s": med("site_takeover_s"),
        "rows_on_fallback_during_takeover": on_fallback,
        "site_cpu_pct": {n: round(v, 1) for n, v in cpu.items()},
        "goal_feed_p99_s": 2.0,
        "samples": {k: [round(v, 3) for v in vs] for k, vs in results.items()},
        "e2e_python": platform.python_version(),
    }


def main() -> int:
    """Run the benchmark; print and merge its figures into power_tree.json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--fail-rows", type=int, default=4)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--keep", default="", help="keep the processes' logs in this folder")
    args = parser.parse_args()
    result = run(args)
    merged = json.loads(RESULT.read_text(encoding="utf-8")) if RESULT.exists() else {}
    merged.update({k: v for k, v in result.items() if k != "samples"})
    merged["e2e_samples"] = result["samples"]
    write_result(RESULT, merged)
    for key in (
        "feed_to_budget_p99_s",
        "floor_to_level_p99_s",
        "feed_to_caps_p99_s",
        "floor_to_caps_p99_s",
        "site_budget_p99_s",
        "site_takeover_p99_s",
        "rows_on_fallback_during_takeover",
        "site_cpu_pct",
    ):
        print(f"{key}: {result[key]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
