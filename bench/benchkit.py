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
import os
import signal
import subprocess
import sys
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


def telemetry_payloads(
    *, site: str, row: str, racks: int, nodes_per_rack: int, gpus: int = 8
) -> list[tuple[str, bytes]]:
    """One 8-GPU telemetry message per node of the row (about 4.6 kB each)."""
    from polca.telemetry.schema import GpuTelemetry, Telemetry, encode

    out = []
    for r in range(racks):
        for n in range(nodes_per_rack):
            node = node_name(r, n)
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
            out.append((f"polca/v1/{site}/{row}/r{r}/{node}/telemetry", encode(message)))
    return out


# --- the child processes -------------------------------------------------------------------


def _publish(args: argparse.Namespace) -> dict[str, Any]:
    """Publish ``count`` messages of this part's nodes, paced at ``rate`` msg/s (0: flat out)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    payloads = [
        (topic, _stampable(payload))
        for topic, payload in telemetry_payloads(
            site=args.site, row=args.row, racks=args.racks, nodes_per_rack=args.nodes_per_rack
        )[args.part :: args.parts]
    ]
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"load-{os.getpid()}")
    client.max_queued_messages_set(0)
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
    """A bare aiomqtt subscriber that only counts, until ``count`` or ``timeout_s``."""
    import asyncio

    import aiomqtt

    async def run() -> dict[str, Any]:
        times: list[float] = []
        async with aiomqtt.Client(args.host, args.port, identifier=f"floor-{os.getpid()}") as c:
            await c.subscribe(args.topic, qos=args.qos)
            print(json.dumps({"ready": True}), flush=True)

            async def count() -> None:
                async for _ in c.messages:
                    times.append(time.perf_counter())
                    if len(times) >= args.count:
                        return

            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(count(), args.timeout_s)
        return _rate(times)

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
    from polca.telemetry.bus import InMessage

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

    profile = os.environ.get("POLCA_BENCH_PROFILE")
    if profile:  # where the time goes: python -m pstats FILE
        import cProfile

        with cProfile.Profile() as profiler:
            result = asyncio.run(run())
        profiler.dump_stats(profile)
        return result
    return asyncio.run(run())


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
    from polca.agent.runtime import Agent
    from polca.gpu.simulated import SimulatedBackend
    from polca.policy import PolicyStore
    from polca.settings import Settings

    logs.configure(level="error", fmt="json", stream=sys.stderr)
    writes: dict[str, list[int]] = {}

    class TimedBackend(SimulatedBackend):
        node = ""

        def lock_sm_clocks_mhz(self, index: int, min_mhz: int, max_mhz: int) -> None:
            super().lock_sm_clocks_mhz(index, min_mhz, max_mhz)
            writes[self.node].append(time.monotonic_ns())

    agents = []
    for i, spec in enumerate(args.nodes.split(",")):
        rack, node = spec.split("/")
        backend = TimedBackend(count=args.gpus, model="H100-SXM", load="constant:0.5", seed=i)
        backend.node = node
        writes[node] = []
        settings = Settings(
            topics={"site": args.site, "row": args.row, "rack": rack, "node": node},
            mqtt={"host": args.host, "port": args.port, "client_id": f"agent-{node}"},
            gpu={"backend": "simulated"},
            agent={
                "policy_file": args.policy,
                "state_dir": str(Path(args.state_dir) / node),
                "control_issuers": [args.issuer],
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
            out[node] = {"writes": len(after), "capped_ns": done}
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

    return asyncio.run(run())


def _listen(args: argparse.Namespace) -> dict[str, Any]:
    """A bare subscriber noting when each message arrives (the broker's latency floor).

    Commands: ``arrivals`` -> [monotonic ns, payload text] of each message since the last
    ask; ``stop``.
    """
    import asyncio

    import aiomqtt

    arrivals: list[tuple[int, str]] = []

    def take(_line: str) -> dict[str, Any]:
        out = list(arrivals)
        arrivals.clear()
        return {"arrivals": out}

    async def run() -> dict[str, Any]:
        async with aiomqtt.Client(args.host, args.port, identifier=f"listen-{os.getpid()}") as c:
            await c.subscribe(args.topic, qos=args.qos)

            async def receive() -> None:
                async for message in c.messages:
                    arrivals.append((time.monotonic_ns(), bytes(message.payload).decode()))

            task = asyncio.create_task(receive())
            print(json.dumps({"ready": True}), flush=True)
            await _commands(take)
            task.cancel()
        return {"stopped": True}

    return asyncio.run(run())


def _rate(times: Sequence[float]) -> dict[str, Any]:
    received = len(times)
    span = times[-1] - times[0] if received > 1 else 0.0
    return {"received": received, "span_s": span, "rate": (received - 1) / span if span else 0.0}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one role (``publish``, ``floor``, ``aggregator``, ``agents``, ``listen``)."""
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
    floor = sub.choices["floor"]
    floor.add_argument("--topic", default="polca/v1/#")
    floor.add_argument("--timeout-s", type=float, default=120.0)
    agg = sub.choices["aggregator"]
    agg.add_argument("--config", required=True)
    agg.add_argument("--timeout-s", type=float, default=120.0)
    agents = sub.add_parser("agents")
    agents.add_argument("--host", default="127.0.0.1")
    agents.add_argument("--port", type=int, required=True)
    agents.add_argument("--site", default="bench")
    agents.add_argument("--row", default="row1")
    agents.add_argument("--nodes", required=True, help="rack/node,rack/node,...")
    agents.add_argument("--gpus", type=int, default=8)
    agents.add_argument("--policy", required=True)
    agents.add_argument("--state-dir", required=True)
    agents.add_argument("--issuer", default="bench")
    listen = sub.add_parser("listen")
    listen.add_argument("--host", default="127.0.0.1")
    listen.add_argument("--port", type=int, required=True)
    listen.add_argument("--topic", required=True)
    listen.add_argument("--qos", type=int, default=0)
    args = parser.parse_args(argv)
    roles = {
        "publish": _publish,
        "floor": _floor,
        "aggregator": _aggregator,
        "agents": _agents,
        "listen": _listen,
    }
    result = roles[args.role](args)
    print(json.dumps(result), flush=True)
    return 0


# --- the parent's side -------------------------------------------------------------------------


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
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks

    def rss_mb(self) -> float:
        """Resident memory in MiB (from /proc)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

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


def median(values: Sequence[float]) -> float:
    """The median (the mean of the middle two for an even count)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1), nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


if __name__ == "__main__":
    raise SystemExit(main())
