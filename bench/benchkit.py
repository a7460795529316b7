"""Shared pieces of the benchmarks: node telemetry, load generators and floors in processes.

Every load generator and every floor runs in **its own process** (``python -m
bench.benchkit publish|floor ...``), never in the process or event loop of what is
measured, so a figure is the daemon's and not its load generator's. The parent starts
them, hands them their work on the command line and reads one JSON line each from
stdout. The broker is a real Mosquitto with unbounded queues (``BROKER_CONFIG``): a
consumer that falls behind is queued for, not dropped, and every message a consumer did
not get is counted (published minus received).

Two ways to load a consumer:

- **drain**: the consumer is stopped (SIGSTOP) while the publishers fill the broker's
  queue for it, then resumed (SIGCONT): it drains at its own top speed with nothing else
  running, which is its capacity;
- **paced**: publishers send at a fixed total rate while the consumer runs: whether it
  keeps up (nothing dropped, no growing lag), publishers and consumer sharing the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

BROKER_CONFIG = ("max_queued_messages 0", "max_queued_bytes 0", "max_inflight_messages 0")
"""Unbounded per-client queues, so a consumer that falls behind is queued for, not dropped."""


def node_name(rack: int, node: int) -> str:
    """The name of node ``node`` of rack ``rack`` in the benchmark topology."""
    return f"n{rack}-{node}"


def site_node(row: str, rack: int, node: int) -> str:
    """The name of a node in the site benchmark: unique across rows."""
    return f"{row}-{node_name(rack, node)}"


def telemetry_payloads(
    *,
    site: str,
    row: str,
    racks: int,
    nodes_per_rack: int,
    gpus: int = 8,
    rows: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> list[tuple[str, bytes]]:
    """One 8-GPU telemetry message per node of the row (about 4.3 kB each).

    ``rows``: the nodes of all these rows instead (named by ``site_node``), less
    ``exclude`` (nodes that real agents publish for).
    """
    from polca.telemetry.schema import GpuTelemetry, Telemetry, encode

    out = []
    skip = set(exclude)
    for row_name, r, n in (
        (row_name, r, n)
        for row_name in (rows or [row])
        for r in range(racks)
        for n in range(nodes_per_rack)
    ):
        node = site_node(row_name, r, n) if rows else node_name(r, n)
        if node in skip:
            continue
        message = Telemetry(
            ts_ns=time.time_ns(),
            seq=1,
            node=node,
            interval_s=1.0,
            node_gpu_power_w=480.0 * gpus,
            node_energy_delta_j=480.0 * gpus,
            gpus=tuple(
                GpuTelemetry(
                    index=i,
                    uuid=f"GPU-{node}-{i}",
                    name="NVIDIA H100 80GB HBM3",
                    samples=10,
                    power_w=500.0,
                    power_mean_w=480.0,
                    power_min_w=300.0,
                    power_max_w=690.0,
                    power_avg_w=490.0,
                    energy_j=1e6,
                    energy_delta_j=480.0,
                    gpu_temp_c=61.0,
                    gpu_temp_max_c=63.0,
                    mem_temp_c=70.0,
                    sm_clock_mhz=1980,
                    mem_clock_mhz=2619,
                    gpu_util_pct=80.0,
                    mem_util_pct=40.0,
                    power_limit_w=700.0,
                    enforced_power_limit_w=700.0,
                    clock_event_reasons=0,
                )
                for i in range(gpus)
            ),
        )
        out.append((f"polca/v1/{site}/{row_name}/r{r}/{node}/telemetry", encode(message)))
    return out


# --- the child processes -------------------------------------------------------------------


def _publish(args: argparse.Namespace) -> dict[str, Any]:
    """Publish ``count`` messages of this part's nodes, paced at ``rate`` msg/s (0: flat out)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    payloads = [
        (topic, _stampable(payload))
        for topic, payload in telemetry_payloads(
            site=args.site,
            row=args.row,
            racks=args.racks,
            nodes_per_rack=args.nodes_per_rack,
            rows=args.rows.split(",") if args.rows else (),
            exclude=args.exclude.split(",") if args.exclude else (),
        )[args.part :: args.parts]
    ]
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"load-{os.getpid()}")
    client.max_queued_messages_set(0)
    if args.username:  # a broker with users (the deploy configuration); anonymous otherwise
        password = Path(args.password_file).read_text(encoding="utf-8").strip()
        client.username_pw_set(args.username, password)
    client.connect(args.host, args.port)
    client.loop_start()
    interval_s = 1.0 / args.rate if args.rate > 0 else 0.0
    start = time.perf_counter()
    info = None
    for i in range(args.count):
        if interval_s:
            delay = start + i * interval_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        topic, (head, tail) = payloads[i % len(payloads)]
        # Stamped now, as an agent would: a stale stamp would be counted as clock skew.
        info = client.publish(topic, head + str(time.time_ns()).encode() + tail, qos=args.qos)
    if info is not None:
        info.wait_for_publish(timeout=60)
    elapsed = time.perf_counter() - start
    client.loop_stop()
    client.disconnect()
    return {"sent": args.count, "elapsed_s": elapsed, "rate": args.count / elapsed}


def _stampable(payload: bytes) -> tuple[bytes, bytes]:
    """``payload`` split around the digits of its ``ts_ns``."""
    key = b'"ts_ns":'
    start = payload.index(key) + len(key)
    end = start
    while payload[end : end + 1].isdigit():
        end += 1
    return payload[:start], payload[end:]


def _floor(args: argparse.Namespace) -> dict[str, Any]:
    """A bare aiomqtt subscriber that only counts, until ``count`` or ``timeout_s``.

    ``--until-disconnect``: the broker closing the connection (NATS server drops a slow
    consumer) ends the count, reported as ``disconnected``, instead of failing the role.
    """
    import asyncio

    import aiomqtt

    async def run() -> dict[str, Any]:
        times: list[float] = []
        ready, disconnected = False, False
        try:
            async with aiomqtt.Client(args.host, args.port, identifier=f"floor-{os.getpid()}") as c:
                for topic in args.topic or ["polca/v1/#"]:
                    await c.subscribe(topic, qos=args.qos)
                print(json.dumps({"ready": True}), flush=True)
                ready = True

                async def count() -> None:
                    async for _ in c.messages:
                        times.append(time.perf_counter())
                        if len(times) >= args.count:
                            return

                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(count(), args.timeout_s)
        except aiomqtt.MqttError:
            if not (args.until_disconnect and ready):
                raise
            disconnected = True
        result = _rate(times)
        if args.until_disconnect:
            result["disconnected"] = disconnected
        return result

    return asyncio.run(run())


def _aggregator(args: argparse.Namespace) -> dict[str, Any]:
    """The real aggregator (configuration file, sinks), its intake timed; exits after
    ``count`` messages or ``timeout_s``."""
    import asyncio

    from polca import logs
    from polca.aggregator.config import AggregatorSettings
    from polca.aggregator.runtime import Aggregator
    from polca.export.influx import make_sink
    from polca.settings import load_settings_as
    from polca.telemetry.messages import InMessage

    logs.configure(level="error", fmt="json", stream=sys.stderr)
    settings = load_settings_as(AggregatorSettings, Path(args.config))
    sink = make_sink(settings.influx, state_dir=settings.state_dir)
    aggregator = Aggregator(settings, sinks=[sink] if sink is not None else [])
    times: list[float] = []
    handle = aggregator.handle_message

    def timed(message: InMessage) -> None:
        handle(message)
        if message.topic.endswith("/telemetry"):  # the load, not the aggregator's own echoes
            times.append(time.perf_counter())

    aggregator.handle_message = timed  # type: ignore[method-assign]

    async def run() -> dict[str, Any]:
        task = asyncio.create_task(aggregator.run())
        while aggregator.bus is None or not aggregator.bus.connected.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # subscriptions and retained messages
        warm_until = time.monotonic() + 15
        # Steady state: the sink has sent once (its client is imported and connected).
        while aggregator.sinks.stats.points_written == 0 and time.monotonic() < warm_until:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        before = len(times)
        print(json.dumps({"ready": True}), flush=True)
        deadline = time.monotonic() + args.timeout_s
        while len(times) - before < args.count and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        figures = _rate(times[before:])
        figures["intake_dropped"] = dict(aggregator.intake.dropped)
        bus = aggregator.bus
        figures["inbox_dropped"] = bus.stats.inbox_dropped
        figures["points_written"] = aggregator.sinks.stats.points_written
        aggregator.stop_requested.set()
        await asyncio.wait_for(task, 30)
        return figures

    return _profiled(lambda: asyncio.run(run()), "aggregator")


def _profiled(run: Callable[[], dict[str, Any]], name: str) -> dict[str, Any]:
    """``run()``, under cProfile when ``POLCA_BENCH_PROFILE`` names a directory.

    Where the time goes: ``python -m pstats DIR/NAME.prof``.
    """
    directory = os.environ.get("POLCA_BENCH_PROFILE")
    if not directory:
        return run()
    import cProfile

    with cProfile.Profile() as profiler:
        result = run()
    profiler.dump_stats(Path(directory) / f"{name}.prof")
    return result


async def _commands(handle: Callable[[str], dict[str, Any]]) -> None:
    """Answer command lines from the parent (stdin) until ``stop``: one JSON line each."""
    import asyncio

    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if not line or line == "stop":
            return
        print(json.dumps(handle(line)), flush=True)


def _agents(args: argparse.Namespace) -> dict[str, Any]:
    """Real agents on simulated GPUs, several in this process, their cap writes timed.

    Every SM clock lock a backend applies is recorded (monotonic ns, after the write).
    Commands: ``locks T0_NS`` -> per agent, the writes at or after T0 and the time of the
    last one; ``stop`` -> stop the agents cleanly and exit.
    """
    import asyncio

    from polca import logs
    from polca.agent.config import Settings
    from polca.agent.runtime import Agent
    from polca.gpu.simulated import SimulatedBackend
    from polca.policy import PolicyStore

    logs.configure(level="error", fmt="json", stream=sys.stderr)
    if args.switch_interval_s:
        sys.setswitchinterval(args.switch_interval_s)
    writes: dict[str, list[int]] = {}

    class TimedBackend(SimulatedBackend):
        """Simulated GPUs that note each clock lock; their physics held still.

        The simulator integrates its power and thermal model up to "now" on every call,
        and a write after a quiet second does a second's worth of it: the simulator's
        cost, not polca's, and on the reaction path. Here the readings stay as they were
        made at the start (constant load), so a benchmark times polca's work only.
        """

        node = ""

        def _advance(self, g: Any, now_s: float) -> None:
            g.t_s = max(g.t_s, now_s)

        def lock_sm_clocks_mhz(self, index: int, min_mhz: int, max_mhz: int) -> None:
            super().lock_sm_clocks_mhz(index, min_mhz, max_mhz)
            writes[self.node].append(time.monotonic_ns())

    agents = []
    endpoints = [e for e in args.endpoints.split(",") if e]
    for i, spec in enumerate(args.nodes.split(",")):
        rack, node = spec.split("/")
        backend = TimedBackend(count=args.gpus, model="H100-SXM", load="constant:0.5", seed=i)
        backend.node = node
        writes[node] = []
        settings = Settings(
            topics={"site": args.site, "row": args.row, "rack": rack, "node": node},
            mqtt={
                "host": args.host,
                "port": args.port,
                "client_id": f"agent-{node}",
                # A cluster: each agent starts on another node (the list turned by one).
                "endpoints": endpoints[i % len(endpoints) :] + endpoints[: i % len(endpoints)]
                if endpoints
                else [],
                "subscription_qos_max": args.subscription_qos_max,
                "connect_timeout_s": args.connect_timeout_s,
                "connack_timeout_s": args.connack_timeout_s,
            },
            gpu={"backend": "simulated"},
            agent={
                "policy_file": args.policy,
                "state_dir": str(Path(args.state_dir) / node),
                "control_issuers": args.issuer or ["bench"],
                "sample_interval_s": args.sample_interval_s,
            },
        )
        store = PolicyStore(Path(args.policy))
        agents.append(Agent(settings, backend=backend, policy_store=store))

    def locks(line: str) -> dict[str, Any]:
        t0 = int(line.split()[1])
        out = {}
        for node, times in writes.items():
            after = sorted(t for t in times if t >= t0)
            # The caps are in force when every GPU has had its write: the n-th one.
            done = after[args.gpus - 1] if len(after) >= args.gpus else None
            out[node] = {
                "writes": len(after),
                "capped_ns": done,
                "first_ns": after[0] if after else None,
            }
            times[:] = after  # bounded: only what a later trial can still ask for
        return out

    async def run() -> dict[str, Any]:
        tasks = [asyncio.create_task(agent.run()) for agent in agents]
        while not all(a.bus is not None and a.bus.connected.is_set() for a in agents):
            for task in tasks:
                if task.done():
                    task.result()  # an agent that could not start: its error, now
            await asyncio.sleep(0.05)
        print(json.dumps({"ready": True, "agents": len(agents)}), flush=True)
        await _commands(locks)
        for agent in agents:
            agent.stop_requested.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        return {"stopped": len(agents)}

    return _profiled(lambda: asyncio.run(run()), f"agents-{os.getpid()}")


def _listen(args: argparse.Namespace) -> dict[str, Any]:
    """A bare subscriber noting when each message arrives (the broker's latency floor).

    Commands: ``arrivals`` -> [monotonic ns, topic, payload text] of each message since
    the last ask; ``stop``.
    """
    import asyncio

    import aiomqtt

    arrivals: list[tuple[int, str, str]] = []

    def take(_line: str) -> dict[str, Any]:
        out = list(arrivals)
        arrivals.clear()
        return {"arrivals": out}

    async def run() -> dict[str, Any]:
        async with aiomqtt.Client(args.host, args.port, identifier=f"listen-{os.getpid()}") as c:
            for topic in args.topic:
                await c.subscribe(topic, qos=args.qos)

            async def receive() -> None:
                async for message in c.messages:
                    payload = bytes(message.payload).decode()
                    arrivals.append((time.monotonic_ns(), message.topic.value, payload))

            task = asyncio.create_task(receive())
            print(json.dumps({"ready": True}), flush=True)
            await _commands(take)
            task.cancel()
        return {"stopped": True}

    return asyncio.run(run())


def _serve(args: argparse.Namespace) -> dict[str, Any]:
    """The real aggregator from its configuration file, with counters the parent reads.

    Commands: ``stats`` -> telemetry messages handled from the load generator (not from
    ``--agent-nodes``), the intake's counters, the sink's, and the monotonic times of the
    control steps since the last ask; ``stop``.
    """
    import asyncio

    from polca import logs
    from polca.aggregator.config import AggregatorSettings
    from polca.aggregator.runtime import Aggregator
    from polca.export.influx import make_sink
    from polca.settings import load_settings_as
    from polca.telemetry.messages import InMessage

    logs.configure(level="warning", fmt="json", stream=sys.stderr)
    settings = load_settings_as(AggregatorSettings, Path(args.config))
    sink = make_sink(settings.influx, state_dir=settings.state_dir)
    aggregator = Aggregator(settings, sinks=[sink] if sink is not None else [])
    agent_nodes = {f"/{node}/telemetry" for node in args.agent_nodes.split(",") if node}
    counts = {"telemetry": 0}
    steps: list[float] = []
    handle, step = aggregator.handle_message, aggregator.control_step

    def counted(message: InMessage) -> None:
        handle(message)
        topic = message.topic
        if topic.endswith("/telemetry") and topic[topic.rindex("/", 0, -10) :] not in agent_nodes:
            counts["telemetry"] += 1

    def timed(now_s: float) -> Any:
        steps.append(time.monotonic())
        return step(now_s)

    aggregator.handle_message = counted  # type: ignore[method-assign]
    aggregator.control_step = timed  # type: ignore[method-assign]

    def stats(_line: str) -> dict[str, Any]:
        sink_stats = aggregator.sinks.stats
        out = {
            "telemetry": counts["telemetry"],
            "messages_in": aggregator.intake.messages_in,
            "dropped": dict(aggregator.intake.dropped),
            "skewed": dict(aggregator.intake.skewed.counts),
            "points_written": sink_stats.points_written,
            "points_dropped": sink_stats.points_dropped,
            "inbox_dropped": aggregator.bus.stats.inbox_dropped if aggregator.bus else 0,
            "steps": list(steps),
        }
        steps.clear()
        return out

    async def run() -> dict[str, Any]:
        task = asyncio.create_task(aggregator.run())
        while aggregator.bus is None or not aggregator.bus.connected.is_set():
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
        print(json.dumps({"ready": True}), flush=True)
        await _commands(stats)
        aggregator.stop_requested.set()
        await asyncio.wait_for(task, 30)
        return {"stopped": True}

    return _profiled(lambda: asyncio.run(run()), f"serve-{os.getpid()}")


def _rate(times: Sequence[float]) -> dict[str, Any]:
    received = len(times)
    span = times[-1] - times[0] if received > 1 else 0.0
    return {"received": received, "span_s": span, "rate": (received - 1) / span if span else 0.0}


def _parser() -> argparse.ArgumentParser:
    """Every role's arguments."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="role", required=True)
    for role in ("publish", "floor", "aggregator"):
        p = sub.add_parser(role)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--count", type=int, required=True)
        p.add_argument("--qos", type=int, default=0)
    pub = sub.choices["publish"]
    pub.add_argument("--site", default="bench")
    pub.add_argument("--row", default="row1")
    pub.add_argument("--racks", type=int, default=4)
    pub.add_argument("--nodes-per-rack", type=int, default=32)
    pub.add_argument("--part", type=int, default=0)
    pub.add_argument("--parts", type=int, default=1)
    pub.add_argument("--rate", type=float, default=0.0)
    pub.add_argument("--rows", default="", help="row,row,...: the site's nodes instead")
    pub.add_argument("--exclude", default="", help="node,node,...: left to real agents")
    pub.add_argument("--username", default="", help="log in as this user (default: anonymous)")
    pub.add_argument("--password-file", default="", help="the user's password (first line)")
    floor = sub.choices["floor"]
    floor.add_argument("--topic", action="append", help="repeatable; default polca/v1/#")
    floor.add_argument("--timeout-s", type=float, default=120.0)
    floor.add_argument(
        "--until-disconnect",
        action="store_true",
        help="a disconnection ends the count (reported) instead of failing",
    )
    agg = sub.choices["aggregator"]
    agg.add_argument("--config", required=True)
    agg.add_argument("--timeout-s", type=float, default=120.0)
    agents = sub.add_parser("agents")
    agents.add_argument("--host", default="127.0.0.1")
    agents.add_argument("--port", type=int, required=True)
    agents.add_argument("--endpoints", default="", help="host:port,...: a broker cluster")
    agents.add_argument("--subscription-qos-max", type=int, default=None)  # None: default
    for timeout in ("--connect-timeout-s", "--connack-timeout-s"):
        agents.add_argument(timeout, type=float, default=10.0)
    agents.add_argument("--site", default="bench")
    agents.add_argument("--row", default="row1")
    agents.add_argument("--nodes", required=True, help="rack/node,rack/node,...")
    agents.add_argument("--gpus", type=int, default=8)
    agents.add_argument("--policy", required=True)
    agents.add_argument("--state-dir", required=True)
    agents.add_argument(
        "--issuer", action="append", help="repeatable: the instances followed; default bench"
    )
    agents.add_argument("--sample-interval-s", type=float, default=0.1)
    agents.add_argument("--switch-interval-s", type=float, default=0.0)
    serve = sub.add_parser("serve")
    serve.add_argument("--config", required=True)
    serve.add_argument("--agent-nodes", default="")
    listen = sub.add_parser("listen")
    listen.add_argument("--host", default="127.0.0.1")
    listen.add_argument("--port", type=int, required=True)
    listen.add_argument("--topic", required=True, action="append")
    listen.add_argument("--qos", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one role (``publish``, ``floor``, ``aggregator``, ``agents``, ``listen``)."""
    args = _parser().parse_args(argv)
    roles = {
        "publish": _publish,
        "floor": _floor,
        "aggregator": _aggregator,
        "agents": _agents,
        "listen": _listen,
        "serve": _serve,
    }
    result = roles[args.role](args)
    print(json.dumps(result), flush=True)
    return 0


# --- the parent's side -------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Child:
    """A benchmark child process and the JSON lines it printed."""

    process: subprocess.Popen[str]

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        output: Path | None = None,
    ) -> Child:
        """Start ``argv`` with the repository on ``PYTHONPATH``; ``output``: its stdout file."""
        environ = dict(os.environ if env is None else env)
        environ["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), str(REPO / "daemon"), environ.get("PYTHONPATH", "")]
        )
        with contextlib.ExitStack() as stack:
            stdout: Any = subprocess.PIPE
            if output is not None:
                stdout = stack.enter_context(output.open("w", encoding="utf-8"))
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=stdout,
                stderr=subprocess.STDOUT if output is not None else None,
                text=True,
                env=environ,
                cwd=REPO,
            )
        return cls(process)

    def ask(self, command: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Send one command line to a role that reads them; its JSON answer."""
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.line(timeout_s)

    @classmethod
    def role(cls, role: str, *args: str) -> Child:
        """``python -m bench.benchkit ROLE ARGS``."""
        return cls.start([sys.executable, "-m", "bench.benchkit", role, *args])

    def line(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """The next JSON line it prints."""
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.process.stdout.readline()
            if text:
                stripped = text.strip()
                if stripped.startswith("{"):
                    parsed: dict[str, Any] = json.loads(stripped)
                    return parsed
                continue
            if self.process.poll() is not None:
                break
        msg = f"no JSON line from {self.process.args!r}"
        raise RuntimeError(msg)

    def pause(self) -> None:
        """SIGSTOP: it stops reading; the broker queues for it."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT."""
        self.process.send_signal(signal.SIGCONT)

    def cpu_s(self) -> float:
        """User + system CPU seconds used so far (from /proc)."""
        return proc_cpu_s(self.process.pid)

    def rss_mb(self) -> float:
        """Resident memory in MiB (from /proc)."""
        return proc_rss_mb(self.process.pid)

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM and wait (SIGKILL after ``timeout_s``)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def publishers(
    *, port: int, count: int, parts: int, qos: int, rate: float = 0.0, **topology: int
) -> list[Child]:
    """``parts`` publisher processes sharing ``count`` messages (and ``rate``) evenly."""
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in topology.items()]
    return [
        Child.role(
            "publish",
            f"--port={port}",
            f"--count={count // parts}",
            f"--qos={qos}",
            f"--part={i}",
            f"--parts={parts}",
            f"--rate={rate / parts}",
            *extra,
        )
        for i in range(parts)
    ]


def release_policy(workdir: Path) -> Path:
    """polca-h100 with a 1 s release dwell, all levels at once, no trend brake.

    For reaction trials: a row uncaps within about two control steps of its power
    falling, and a step in the meter never brakes on the trend.
    """
    import yaml

    policy = yaml.safe_load((REPO / "policies" / "polca-h100.yaml").read_text(encoding="utf-8"))
    policy["name"] = "polca-h100-bench"
    policy["release"] = {"margin_pct": 5, "dwell_s": 1, "one_level_at_a_time": False}
    policy.pop("trend", None)
    path = workdir / "policy.yaml"
    path.write_text(yaml.safe_dump(policy), encoding="utf-8")
    return path


class RowDriver:
    """Row meters and the rows' control levels, on one paho client (its own thread).

    Publishes every row's meter (``meters_w``, W; change a value at any time) every
    ``period_s`` and follows the level of the watched rows' control messages.
    """

    def __init__(
        self,
        port: int,
        *,
        site: str,
        meters_w: dict[str, float],
        watch: Sequence[str],
        period_s: float = 0.2,
    ) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.site = site
        self.meters_w = meters_w
        self.levels: dict[str, tuple[int, float]] = {}  # row -> (level, monotonic s since)
        self._period_s = period_s
        self._stop = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-driver")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        for row in watch:
            self.client.subscribe(f"polca/v1/{site}/{row}/control", qos=1)
        self.client.loop_start()
        self._thread = threading.Thread(target=self._meter_loop, daemon=True)
        self._thread.start()

    def _on_message(self, _client: Any, _userdata: Any, message: Any) -> None:
        control = json.loads(message.payload)
        row, level = control["row"], control["level"]
        if self.levels.get(row, (None, 0.0))[0] != level:
            self.levels[row] = (level, time.monotonic())

    def publish_meter(self, row: str, power_w: float) -> None:
        """One meter reading of ``row``, now."""
        from polca.telemetry.schema import Meter, encode

        payload = encode(Meter(ts_ns=time.time_ns(), power_w=power_w))
        self.client.publish(f"polca/v1/{self.site}/{row}/meter", payload, qos=0)

    def _meter_loop(self) -> None:
        while not self._stop.wait(self._period_s):
            for row, power_w in list(self.meters_w.items()):
                self.publish_meter(row, power_w)

    def wait_level(self, row: str, level: int, *, settle_s: float, timeout_s: float = 30) -> None:
        """Until ``row`` has been at ``level`` for ``settle_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            seen, since = self.levels.get(row, (None, 0.0))
            if seen == level and time.monotonic() - since >= settle_s:
                return
            if time.monotonic() > deadline:
                msg = f"{row} not at level {level} within {timeout_s} s (at {seen})"
                raise RuntimeError(msg)
            time.sleep(0.02)

    def close(self) -> None:
        """Stop publishing and disconnect."""
        self._stop.set()
        self._thread.join()
        self.client.loop_stop()
        self.client.disconnect()


def react_once(
    driver: RowDriver,
    agents: Sequence[Child],
    listen: Child,
    *,
    row: str,
    high_w: float,
    count: int,
) -> dict[str, Any]:
    """One reaction trial: ``row``'s meter over T2 -> every one of ``count`` agents capped.

    From an uncapped row, publishes one reading of ``high_w`` (made unique by the caller)
    and asks the agents' processes, after the fact, when each had written its last GPU's
    clock lock; the listener says when the meter and the control message reached it.
    The meter goes back to its previous value at the end (the row then uncaps).
    """
    driver.wait_level(row, 0, settle_s=0.5)  # uncapped, and the agents have reset
    listen.ask("arrivals")  # forget the readings before this trial
    base_w = driver.meters_w[row]
    t0 = time.monotonic_ns()
    driver.publish_meter(row, high_w)
    driver.meters_w[row] = high_w
    deadline = time.monotonic() + 10
    capped: dict[str, int] = {}
    while len(capped) < count:
        if time.monotonic() > deadline:
            msg = f"{count - len(capped)} agents of {row} not capped within 10 s"
            raise RuntimeError(msg)
        time.sleep(0.3)  # asked after the fact: asking while they react would load the CPU
        for child in agents:
            for node, seen in child.ask(f"locks {t0}").items():
                if seen["capped_ns"] is not None:
                    capped.setdefault(node, seen["capped_ns"])
    driver.meters_w[row] = base_w
    arrivals = listen.ask("arrivals")["arrivals"]
    meter = [
        t
        for t, topic, text in arrivals
        if topic.endswith(f"/{row}/meter") and json.loads(text)["power_w"] == high_w
    ]
    control = [
        t
        for t, topic, text in arrivals
        if topic.endswith(f"/{row}/control") and json.loads(text)["level"] >= 2 and t >= t0
    ]
    return {
        "reaction_ms": (max(capped.values()) - t0) / 1e6,
        "first_agent_ms": (min(capped.values()) - t0) / 1e6,
        "control_ms": (min(control) - t0) / 1e6 if control else float("nan"),
        "floor_ms": (meter[0] - t0) / 1e6 if meter else float("nan"),
        "offsets_ms": {node: round((t - t0) / 1e6, 2) for node, t in sorted(capped.items())},
    }


def stop_all(children: Sequence[Child], timeout_s: float = 30.0) -> None:
    """``stop`` to every role that reads commands, a clean exit awaited, then SIGTERM."""
    for child in children:
        if child.process.stdin is not None and child.process.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                child.process.stdin.write("stop\n")
                child.process.stdin.flush()
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=timeout_s)
        child.stop(timeout_s=timeout_s)


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until true; RuntimeError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    msg = f"timed out after {timeout_s} s waiting for {what}"
    raise RuntimeError(msg)


def write_result(path: Path, result: dict[str, Any]) -> None:
    """A benchmark's figures as JSON at ``path`` (under ``bench/results/`` by default)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def median(values: Sequence[float]) -> float:
    """The median (the mean of the middle two for an even count)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


if __name__ == "__main__":
    raise SystemExit(main())
