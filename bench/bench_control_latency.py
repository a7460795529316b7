"""Control message to caps applied, on 8 GPUs, through a real broker and the real binding.

An agent runs in this process on the ``nvml`` backend over the fake ``libnvidia-ml.so.1``
and a local Mosquitto. The benchmark publishes row control messages that alternate between
T2 (every GPU gets a new clock lock) and nominal (every lock is released) and measures, per
message, the time from just before ``publish()`` to the end of the eighth GPU write. Next
to it, in the same run and against the same broker, it measures the raw floor: the
publish-to-receive latency of a bare MQTT subscriber. What polca adds is the difference.

Target: p99 at most 5 ms. Run from the repository root (needs gcc and mosquitto):

    .venv/bin/python bench/bench_control_latency.py [--messages 300]

It prints a table and writes ``bench/results/control_latency.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.* is repository tooling (fake NVML, Mosquitto runner)

TARGET_P99_MS = 5.0
SITE, ROW, RACK, NODE = "bench", "row1", "rack1", "node1"


def percentile(values: list[float], fraction: float) -> float:
    """The ``fraction`` quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))]


def summary(values_ms: list[float]) -> dict[str, float]:
    """Median, p90, p99 and max of a list of milliseconds."""
    return {
        "median_ms": round(statistics.median(values_ms), 3),
        "p90_ms": round(percentile(values_ms, 0.90), 3),
        "p99_ms": round(percentile(values_ms, 0.99), 3),
        "max_ms": round(max(values_ms), 3),
        "n": len(values_ms),
    }


async def broker_floor_ms(host: str, port: int, count: int) -> list[float]:
    """Publish-to-receive latency of a bare aiomqtt subscriber on the same broker."""
    import aiomqtt

    topic = f"polca/v1/{SITE}/floor"
    latencies: list[float] = []
    async with (
        aiomqtt.Client(host, port, identifier="bench-floor-sub") as sub,
        aiomqtt.Client(host, port, identifier="bench-floor-pub") as pub,
    ):
        await sub.subscribe(topic, qos=1)
        messages = sub.messages
        for i in range(count):
            start = time.perf_counter_ns()
            await pub.publish(topic, str(i).encode(), qos=1)
            await anext(messages)
            latencies.append((time.perf_counter_ns() - start) / 1e6)
            await asyncio.sleep(0.005)
    return latencies


async def control_latency_ms(  # noqa: PLR0915 - one linear measurement script
    host: str, port: int, count: int, workdir: Path
) -> dict[str, Any]:
    """Run an agent in-process and time control messages until all 8 GPUs are written."""
    import aiomqtt

    from polca.agent.config import load_settings
    from polca.agent.runtime import Agent
    from polca.gpu.nvml import NvmlBackend
    from polca.policy import PolicyStore
    from polca.telemetry.messages import InMessage
    from polca.telemetry.schema import Control, encode

    writes: list[int] = []
    driver_ns: list[int] = []

    class TimedBackend(NvmlBackend):
        """Records the end time and the duration of every clock write."""

        def lock_sm_clocks_mhz(self, index: int, min_mhz: int, max_mhz: int) -> None:
            start = time.perf_counter_ns()
            super().lock_sm_clocks_mhz(index, min_mhz, max_mhz)
            end = time.perf_counter_ns()
            driver_ns.append(end - start)
            writes.append(end)

        def reset_sm_clocks(self, index: int) -> None:
            start = time.perf_counter_ns()
            super().reset_sm_clocks(index)
            end = time.perf_counter_ns()
            driver_ns.append(end - start)
            writes.append(end)

    policy = workdir / "policy.yaml"
    policy.write_text(
        (REPO / "policies" / "polca-a100.yaml")
        .read_text(encoding="utf-8")
        .replace("by_index: {}", "by_index: {0: high, 1: high, 2: high, 3: high}", 1),
        encoding="utf-8",
    )
    settings = load_settings(
        None,
        mqtt={"host": host, "port": port, "reconnect_min_s": 0.05},
        topics={"site": SITE, "row": ROW, "rack": RACK, "node": NODE},
        gpu={"backend": "nvml"},
        agent={"policy_file": policy, "state_dir": workdir / "state", "startup_grace_s": 3600},
        logging={"level": "warning", "format": "json"},
    )
    agent = Agent(settings, backend=TimedBackend(), policy_store=PolicyStore(policy))
    received: list[int] = []  # perf_counter_ns when the agent's listener got each message
    handle = agent.handle_message

    def timed_handle(message: InMessage) -> None:
        received.append(time.perf_counter_ns())
        handle(message)

    agent.handle_message = timed_handle  # type: ignore[method-assign]
    task = asyncio.create_task(agent.run())
    latencies: list[float] = []
    in_driver: list[float] = []
    from_receipt: list[float] = []
    try:
        async with aiomqtt.Client(host, port, identifier="bench-controller") as client:
            while agent.bus is None or not agent.bus.connected.is_set():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            epoch = time.time_ns()
            for seq in range(1, count + 1):
                level = 2 if seq % 2 else 0
                now = time.time_ns()
                control = Control(
                    ts_ns=now,
                    scope="row",
                    row=ROW,
                    issuer="bench",
                    epoch_ns=epoch,
                    seq=seq,
                    level=level,
                    issued_ns=now,
                    lease_expires_ns=now + 60 * 10**9,
                )
                payload = encode(control)
                before = len(writes)
                start = time.perf_counter_ns()
                await client.publish(f"polca/v1/{SITE}/{ROW}/control", payload, qos=1)
                deadline = time.monotonic() + 2.0
                # Polls a list the GPU thread appends to: no event to wait on.
                while len(writes) < before + 8 and time.monotonic() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.0002)
                if len(writes) < before + 8:
                    msg = f"message {seq}: only {len(writes) - before} of 8 GPUs written in 2 s"
                    raise RuntimeError(msg)
                latencies.append((writes[before + 7] - start) / 1e6)
                from_receipt.append((writes[before + 7] - received[-1]) / 1e6)
                in_driver.append(sum(driver_ns[before : before + 8]) / 1e6)
                await asyncio.sleep(0.01)
    finally:
        agent.stop_requested.set()
        await asyncio.wait_for(task, 15)
    return {
        "latencies_ms": latencies,
        "driver_ms": in_driver,
        "receipt_ms": from_receipt,
        "ticks": agent.telemetry.ticks,
    }


async def main_async(count: int) -> dict[str, Any]:
    """Start Mosquitto and the fake NVML, run both measurements, return the figures."""
    from tests.fake_nvml import FakeNvml
    from tests.mqtt_broker import MosquittoProcess

    with tempfile.TemporaryDirectory(prefix="polca-bench-") as tmp:
        workdir = Path(tmp)
        (workdir / "nvml").mkdir()
        fake = FakeNvml(workdir / "nvml", gpus=8, model="NVIDIA A100-SXM4-80GB")
        fake.load_in_process()
        broker = MosquittoProcess(workdir / "mosquitto")
        broker.start()
        try:
            floor = await broker_floor_ms(broker.host, broker.port, count)
            result = await control_latency_ms(broker.host, broker.port, count, workdir)
        finally:
            broker.kill()
    latencies = result["latencies_ms"]
    control = summary(latencies)
    floor_s = summary(floor)
    driver = summary(result["driver_ms"])
    # What polca itself adds per message: end to end, less the broker hop and the time
    # spent inside the (fake) library's eight write calls.
    own = [
        total - d - floor_s["median_ms"]
        for total, d in zip(latencies, result["driver_ms"], strict=True)
    ]
    polca = summary(own)
    receipt = summary(result["receipt_ms"])
    receipt_own = summary(
        [r - d for r, d in zip(result["receipt_ms"], result["driver_ms"], strict=True)]
    )
    return {
        "benchmark": "control_to_caps_applied",
        "gpus": 8,
        "messages": count,
        "control_end_to_end": control,
        "broker_floor": floor_s,
        "driver_writes": driver,
        "polca_own": polca,
        "received_to_applied": receipt,
        "received_to_applied_less_library": receipt_own,
        "ratio_median_to_floor": round(control["median_ms"] / floor_s["median_ms"], 2),
        "target_p99_ms": TARGET_P99_MS,
        "meets_target": receipt_own["p99_ms"] <= TARGET_P99_MS,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def main() -> int:
    """Run the benchmark, print a table, write the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "control_latency.json"
    )
    args = parser.parse_args()
    from polca import logs

    logs.configure(level="warning", fmt="json")
    figures = asyncio.run(main_async(args.messages))
    rows = [
        ("control publish -> 8 GPUs written", figures["control_end_to_end"]),
        ("  broker floor: publish -> receive", figures["broker_floor"]),
        ("  inside the library: 8 write calls", figures["driver_writes"]),
        ("  polca itself (the rest)", figures["polca_own"]),
        ("control received -> 8 GPUs written", figures["received_to_applied"]),
        ("  the same, less the 8 library calls", figures["received_to_applied_less_library"]),
    ]
    print(f"{'measure':40} {'median':>8} {'p90':>8} {'p99':>8} {'max':>8}  (ms)")
    for name, row in rows:
        print(
            f"{name:40} {row['median_ms']:8.3f} {row['p90_ms']:8.3f} {row['p99_ms']:8.3f} "
            f"{row['max_ms']:8.3f}"
        )
    print(
        f"end to end is {figures['ratio_median_to_floor']}x the broker floor at the median; "
        f"target (received -> applied, polca's share) p99 <= {TARGET_P99_MS} ms: "
        f"{'met' if figures['meets_target'] else 'MISSED'}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
