"""A broker node killed under load: how long every client takes to come back, and what broke.

A real 3-node NATS cluster (its MQTT gateway, JetStream R3; ``tests/nats_cluster.py``), a
real 3-member etcd cluster, two ``polca aggregator`` processes of one row (``ha``) and
``--agents`` real agents on simulated GPUs (one process). Every process gets the three
endpoints (``mqtt.endpoints``), each starting on another node (the list turned), and
otherwise polca's defaults on a cluster (QoS 0 subscriptions, a 30 s control lease). The
driver holds the row at T2 by publishing its meter every 0.2 s and watches, through one
observer on each broker node:

- every process's retained ``status``: a process publishes it (with ``mqtt_endpoint``) on
  each new connection, right after CONNACK and before it subscribes again (the
  subscriptions follow within a round trip);
- every control message (level) and every agent's ``state`` (``fail_safe``).

A trial SIGKILLs one broker node (rotating 0, 1, 2, ...), then waits until every process
that was connected to it has published its status through another node; a client's
*reconnect time* is from the kill to that status. Then the node is started again and the
cluster settles (``--settle-s``) before the next kill. Counted over the run: agents that
published a fail-safe state (``fail_safe_nodes``) and control messages below T2
(``controls_below_t2``).

Goal: no agent at fail-safe, no control below T2, reconnect p99 <= 3 s. The floor printed
beside it, measured in the same run in a separate process: a bare MQTT client connecting
to a surviving node right after the kill (the broker's own recovery, without polca).

``--stop lame-duck`` stops the node as ``deploy/nats/nats-server.service`` does, a
planned restart: SIGUSR2, after which the node hands its JetStream leadership over and
closes its clients spread over 20 s. Each client is then timed from the close of its own
connection (when the node's ``/connz`` last listed it) to its status through another
node; results in ``bench/results/broker_restart.json``.

    .venv/bin/python bench/bench_broker_failover.py [--kills 12] [--agents 8]
    .venv/bin/python bench/bench_broker_failover.py --kills 6 --stop lame-duck \
        --out bench/results/broker_restart.json

It prints one line per kill and writes ``bench/results/broker_failover.json``.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_ha import (  # noqa: E402
    BUDGET_W,
    INSTANCES,
    ROW,
    SITE,
    T2_PCT,
    TARGET_S,
    aggregator_config,
    start_aggregator,
)
from bench.benchkit import (  # noqa: E402
    Child,
    median,
    percentile,
    release_policy,
    wait_for,
    write_result,
)

from polca.aggregator.config import CLUSTER_LEASE_S  # noqa: E402
from polca.settings import MqttSettings  # noqa: E402


class Watch:
    """One paho observer per broker node (each reconnects to its own node); every message
    counted once, at its first arrival."""

    def __init__(self, endpoints: list[tuple[str, int]]) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.lock = threading.Lock()
        self.controls: list[tuple[float, str, int]] = []  # (mono s, issuer, level)
        self.births: list[tuple[float, str, str]] = []  # (mono s, process, endpoint)
        self.endpoint: dict[str, str] = {}  # process -> the endpoint it last named
        self.fell: set[str] = set()
        self._seen: dict[bytes, float] = {}
        self.clients = []
        for index, (host, port) in enumerate(endpoints):
            client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-watch-{index}")
            client.on_message = self._on_message
            client.on_connect = self._on_connect
            client.reconnect_delay_set(1, 1)
            client.connect_async(host, port, keepalive=5)
            client.loop_start()
            self.clients.append(client)
        self._stop = threading.Event()
        self._meter = threading.Thread(target=self._meter_loop, daemon=True)
        self._meter.start()

    @staticmethod
    def _on_connect(client: Any, _userdata: Any, _flags: Any, _rc: Any, _props: Any) -> None:
        client.subscribe(f"polca/v1/{SITE}/{ROW}/control", qos=0)
        client.subscribe(f"polca/v1/{SITE}/{ROW}/+/+/state", qos=0)
        client.subscribe(f"polca/v1/{SITE}/{ROW}/+/+/status", qos=0)
        client.subscribe(f"polca/v1/{SITE}/aggregator/+/status", qos=0)

    def _on_message(self, _client: Any, _userdata: Any, message: Any) -> None:
        now = time.monotonic()
        key = message.topic.encode() + b"\0" + message.payload
        with self.lock:
            if key in self._seen:
                return
            self._seen[key] = now
            if len(self._seen) > 100_000:
                self._seen.clear()
        try:
            data = json.loads(message.payload)
        except ValueError:
            return
        with self.lock:
            if message.topic.endswith("/control"):
                self.controls.append((now, data["issuer"], data["level"]))
            elif message.topic.endswith("/state"):
                if data.get("fail_safe") and not message.retain:
                    self.fell.add(message.topic.split("/")[-2])
            elif message.topic.endswith("/status") and data.get("state") == "online":
                name = message.topic.split("/")[-2]
                endpoint = data.get("mqtt_endpoint") or ""
                if not message.retain or name not in self.endpoint:
                    self.births.append((now, name, endpoint))
                self.endpoint[name] = endpoint

    def _meter_loop(self) -> None:
        from polca.telemetry.schema import Meter, encode

        while not self._stop.wait(0.2):
            meter = Meter(ts_ns=time.time_ns(), power_w=BUDGET_W * T2_PCT / 100.0)
            for client in self.clients:  # through the first connected observer
                if client.is_connected():
                    client.publish(f"polca/v1/{SITE}/{ROW}/meter", encode(meter), qos=0)
                    break

    def on(self, endpoint: str) -> set[str]:
        """The processes whose last status names ``endpoint``."""
        with self.lock:
            return {name for name, at in self.endpoint.items() if at == endpoint}

    def births_since(self, start_s: float) -> list[tuple[float, str, str]]:
        with self.lock:
            return [b for b in self.births if b[0] >= start_s]

    def controls_since(self, start_s: float) -> list[tuple[float, str, int]]:
        with self.lock:
            return [c for c in self.controls if c[0] >= start_s]

    def close(self) -> None:
        self._stop.set()
        for client in self.clients:
            client.loop_stop()
            client.disconnect()


class ConnectionsSeen:
    """Polls a stopping node's ``/connz`` (every 0.1 s, until it exits): when each MQTT
    client was last seen connected there, so a lame-duck stop, which closes its clients
    spread over 20 s, is timed per client from the close of its own connection."""

    def __init__(self, node: Any) -> None:
        self.last_s: dict[str, float] = {}
        self._node = node
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while True:
            try:
                connz = self._node.monitor("/connz?limit=100000")
            except (OSError, AssertionError, ValueError):
                if not self._node.running:
                    return
                time.sleep(0.1)
                continue
            now = time.monotonic()
            for connection in connz.get("connections") or []:
                if connection.get("mqtt_client"):
                    self.last_s[connection["mqtt_client"]] = now
            time.sleep(0.1)

    def join(self) -> None:
        self._thread.join(timeout=30)

    def closed(self, process: str) -> float | None:
        """When ``process``'s connection (its status's: ``agent-<node>`` for an agent,
        ``polca-aggregator-<name>`` for an aggregator) was last seen; None if never."""
        for client_id in (f"agent-{process}", f"polca-aggregator-{process}"):
            if client_id in self.last_s:
                return self.last_s[client_id]
        return None


def _floor_connect(host: str, port: int, timeout_s: float) -> float | None:
    """Seconds a bare client (its own process) takes to connect and subscribe to a node."""
    code = (
        "import sys,time,paho.mqtt.client as m\n"
        "from paho.mqtt.enums import CallbackAPIVersion as V\n"
        "t=time.monotonic();deadline=t+float(sys.argv[3])\n"
        "while time.monotonic()<deadline:\n"
        " c=m.Client(V.VERSION2,client_id='bench-floor')\n"
        " try:\n"
        "  c.connect(sys.argv[1],int(sys.argv[2]),keepalive=5);c.loop_start()\n"
        "  r,mid=c.subscribe('polca/v1/floor/#',qos=1)\n"
        "  end=time.monotonic()+5\n"
        "  while time.monotonic()<end and not c.is_connected(): time.sleep(0.005)\n"
        "  if c.is_connected():\n"
        "   print(time.monotonic()-t);c.loop_stop();c.disconnect();break\n"
        " except OSError: pass\n"
        " c.loop_stop();time.sleep(0.1)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, host, str(port), str(timeout_s)],
        capture_output=True,
        text=True,
        timeout=timeout_s + 10,
        check=False,
    )
    text = done.stdout.strip()
    return float(text) if text else None


def run(args: argparse.Namespace) -> dict[str, Any]:  # noqa: PLR0915 - one scenario
    """Start everything, kill broker nodes ``args.kills`` times, return the figures."""
    from tests.etcd import EtcdCluster
    from tests.nats_cluster import NatsCluster

    with tempfile.TemporaryDirectory(prefix="polca-bench-failover-") as tmp:
        workdir = Path(tmp)
        cluster = NatsCluster(workdir / "nats")
        etcd = EtcdCluster(workdir / "etcd")
        cluster.start_all()
        etcd.start()
        endpoints = [f"{h}:{p}" for h, p in cluster.mqtt_endpoints]
        policy = release_policy(workdir)
        nodes = [f"n{i}" for i in range(args.agents)]
        agents = Child.role(
            "agents",
            f"--port={cluster.mqtt_endpoints[0][1]}",
            "--endpoints=" + ",".join(endpoints),
            f"--site={SITE}",
            f"--row={ROW}",
            "--nodes=" + ",".join(f"r0/{n}" for n in nodes),
            f"--policy={policy}",
            f"--state-dir={workdir / 'agents'}",
            *(f"--issuer={name}" for name in INSTANCES),
            "--sample-interval-s=1.0",
            *(
                [f"--subscription-qos-max={args.subscription_qos_max}"]
                if args.subscription_qos_max is not None
                else []
            ),
            f"--connect-timeout-s={args.connect_timeout_s}",
            f"--connack-timeout-s={args.connack_timeout_s}",
        )
        configs = {
            name: aggregator_config(
                workdir,
                name=name,
                mqtt={
                    "endpoints": endpoints[i:] + endpoints[:i],
                    "connect_timeout_s": args.connect_timeout_s,
                    "connack_timeout_s": args.connack_timeout_s,
                    **(
                        {"subscription_qos_max": args.subscription_qos_max}
                        if args.subscription_qos_max is not None
                        else {}
                    ),
                },
                policy=policy,
                etcd=etcd.endpoints,
                nodes=nodes,
                lease_s=args.lease_s,
            )
            for i, name in enumerate(INSTANCES)
        }
        logs = {name: workdir / f"{name}.log" for name in INSTANCES}
        procs = {name: start_aggregator(configs[name], logs[name]) for name in INSTANCES}
        watch = Watch(cluster.mqtt_endpoints)
        reconnects: list[float] = []
        floors: list[float] = []
        per_kill: list[dict[str, Any]] = []
        below_t2 = 0
        processes = {*nodes, *INSTANCES}
        try:
            wait_for(lambda: any(c[2] == 2 for c in watch.controls_since(0)), 90, "the row at T2")
            wait_for(lambda: set(watch.endpoint) >= processes, 60, "every process's status")
            time.sleep(3.0)
            with watch.lock:
                watch.fell.clear()  # from here on, any agent at fail-safe counts
            start = time.monotonic()
            for kill in range(args.kills):
                index = kill % len(cluster.nodes)
                endpoint = endpoints[index]
                moved = watch.on(endpoint)
                killed = time.monotonic()
                seen = None
                if args.stop == "kill":
                    cluster.kill(index)
                else:  # returns once the node has closed its clients and exited
                    seen = ConnectionsSeen(cluster.nodes[index])
                    cluster.lame_duck(index)
                    seen.join()
                survivor = cluster.mqtt_endpoints[(index + 1) % len(cluster.nodes)]
                floor = _floor_connect(survivor[0], survivor[1], 30.0)
                if floor is not None:
                    floors.append(floor)

                def back(moved: set[str] = moved, killed: float = killed) -> bool:
                    named = {n for _, n, e in watch.births_since(killed) if e != endpoint}  # noqa: B023 - bound per kill
                    return moved <= named

                wait_for(back, 60, f"every client of {endpoint} on another node")
                times = {}
                for at, name, where in watch.births_since(killed):
                    if name in moved and where != endpoint and name not in times:
                        # Killed: from the kill. Lame duck: from the close of its own
                        # connection (last seen in /connz), the closes being spread out.
                        left = seen.closed(name) if seen is not None else None
                        times[name] = at - (left if left is not None else killed)
                reconnects.extend(times.values())
                cluster.start(index)
                time.sleep(args.settle_s)
                below_t2 += sum(1 for c in watch.controls_since(killed) if c[2] < 2)
                worst = max(times.values(), default=0.0)
                per_kill.append({"node": index, "clients": len(times), "max_s": round(worst, 3)})
                print(
                    f"kill {kill + 1}: node {index}, {len(times)} clients back in "
                    f"{worst:.2f} s max (bare client {floor if floor is None else round(floor, 2)}"
                    f" s); fail-safe so far {len(watch.fell)}",
                    flush=True,
                )
            duration_s = time.monotonic() - start
        finally:
            watch.close()
            for proc in procs.values():
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            agents.stop()
            etcd.kill()
            cluster.kill_all()
            fell = sorted(watch.fell)
    p99 = percentile(reconnects, 0.99) if reconnects else None
    return {
        "benchmark": "broker_failover",
        "broker": "nats-server 3-node cluster (MQTT gateway, JetStream R3)",
        "kills": len(per_kill),
        "agents": args.agents,
        "clients_moved": len(reconnects),
        "reconnect_p50_s": round(median(reconnects), 3) if reconnects else None,
        "reconnect_p99_s": round(p99, 3) if p99 is not None else None,
        "reconnect_max_s": round(max(reconnects), 3) if reconnects else None,
        "floor_connect_p50_s": round(median(floors), 3) if floors else None,
        "floor_connect_max_s": round(max(floors), 3) if floors else None,
        "fail_safe_nodes": len(fell),
        "fail_safe_node_names": fell,
        "controls_below_t2": below_t2,
        "per_kill": per_kill,
        "duration_s": round(duration_s, 1),
        "lease_s": args.lease_s if args.lease_s is not None else CLUSTER_LEASE_S,
        "subscription_qos_max": MqttSettings(
            endpoints=endpoints, subscription_qos_max=args.subscription_qos_max
        ).subscription_qos_cap(),
        "defaults": args.lease_s is None and args.subscription_qos_max is None,
        "connect_timeout_s": args.connect_timeout_s,
        "connack_timeout_s": args.connack_timeout_s,
        "stop": args.stop,
        "target_s": TARGET_S,
        "meets_target": bool(reconnects) and (p99 or 0) <= TARGET_S and not fell and below_t2 == 0,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def main() -> int:
    """Run, print, write JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=8.0)
    parser.add_argument(
        "--subscription-qos-max",
        type=int,
        default=None,
        help="mqtt.subscription_qos_max of every process (default: polca's, 0 on a cluster)",
    )
    parser.add_argument(
        "--lease-s", type=float, default=None, help="control.lease_s (default: 30 s, a cluster's)"
    )
    parser.add_argument(
        "--connect-timeout-s", type=float, default=10.0, help="mqtt.connect_timeout_s"
    )
    parser.add_argument(
        "--connack-timeout-s", type=float, default=10.0, help="mqtt.connack_timeout_s"
    )
    parser.add_argument(
        "--stop",
        choices=("kill", "lame-duck"),
        default="kill",
        help="kill: SIGKILL (a crash); lame-duck: SIGUSR2, what nats-server.service's stop "
        "sends (a planned restart; each client timed from the close of its connection)",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "broker_failover.json"
    )
    args = parser.parse_args()
    result = run(args)
    write_result(args.out, result)
    print(
        f"{result['kills']} kills, {result['clients_moved']} client moves: reconnect p50 "
        f"{result['reconnect_p50_s']} s, p99 {result['reconnect_p99_s']} s (target <= "
        f"{TARGET_S} s; bare client p50 {result['floor_connect_p50_s']} s); agents at "
        f"fail-safe: {result['fail_safe_nodes']}; controls below T2: "
        f"{result['controls_below_t2']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
