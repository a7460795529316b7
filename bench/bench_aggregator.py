"""Aggregator intake throughput: node telemetry messages per second, against the broker floor.

A local Mosquitto, an in-process aggregator owning one row of 128 nodes (4 racks x 32), and
a publisher that sends ``--messages`` 8-GPU telemetry messages (QoS 0) round-robin over the
nodes as fast as it can. The figure is the rate at which the aggregator decodes, validates and
rolls them up (its control loop runs meanwhile). As the floor, the same stream is received by
a bare aiomqtt subscriber that only counts messages, in the same run.

    .venv/bin/python bench/bench_aggregator.py [--messages 20000]

Writes ``bench/results/aggregator.json``. For scale: a row of 128 nodes publishing at 1 Hz is
128 messages/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.* is repository tooling (the Mosquitto runner)

SITE, ROW = "bench", "row1"
RACKS, NODES_PER_RACK = 4, 32


def _payloads() -> list[tuple[str, bytes]]:
    from polca.telemetry.schema import GpuTelemetry, Telemetry, encode

    out = []
    for r in range(RACKS):
        for n in range(NODES_PER_RACK):
            node = f"n{r}-{n}"
            gpus = tuple(
                GpuTelemetry(
                    index=i,
                    uuid=f"GPU-{node}-{i}",
                    name="H100",
                    samples=10,
                    power_w=500.0,
                    power_mean_w=480.0,
                    power_min_w=300.0,
                    power_max_w=690.0,
                    energy_j=1e6,
                    energy_delta_j=480.0,
                    gpu_temp_c=61.0,
                    mem_temp_c=70.0,
                    sm_clock_mhz=1980,
                    mem_clock_mhz=2619,
                    gpu_util_pct=80.0,
                    power_limit_w=700.0,
                    enforced_power_limit_w=700.0,
                    clock_event_reasons=0,
                )
                for i in range(8)
            )
            message = Telemetry(
                ts_ns=time.time_ns(),
                seq=1,
                node=node,
                interval_s=1.0,
                node_gpu_power_w=3840.0,
                node_energy_delta_j=3840.0,
                gpus=gpus,
            )
            out.append((f"polca/v1/{SITE}/{ROW}/r{r}/{node}/telemetry", encode(message)))
    return out


async def _publish(host: str, port: int, payloads: list[tuple[str, bytes]], count: int) -> None:
    import aiomqtt

    async with aiomqtt.Client(
        host, port, identifier="bench-publisher", max_queued_outgoing_messages=count + 10
    ) as client:
        for i in range(count):
            topic, payload = payloads[i % len(payloads)]
            await client.publish(topic, payload, qos=0)


async def floor_rate(host: str, port: int, count: int) -> float:
    """Messages/s received by a subscriber that only counts."""
    import aiomqtt

    payloads = _payloads()
    async with aiomqtt.Client(
        host, port, identifier="bench-floor", max_queued_incoming_messages=count + 10
    ) as sub:
        await sub.subscribe(f"polca/v1/{SITE}/{ROW}/+/+/telemetry", qos=0)
        received = 0
        start = time.perf_counter()
        publisher = asyncio.create_task(_publish(host, port, payloads, count))
        async for _ in sub.messages:
            received += 1
            if received == count:
                break
        elapsed = time.perf_counter() - start
        await publisher
    return count / elapsed


async def aggregator_rate(host: str, port: int, count: int, workdir: Path) -> dict[str, Any]:
    """Messages/s the aggregator's intake processes."""
    from polca.aggregator.config import AggregatorSettings, NodeSpec, RackSpec, RowSpec
    from polca.aggregator.runtime import Aggregator
    from polca.settings import MqttSettings

    settings = AggregatorSettings(
        mqtt=MqttSettings(host=host, port=port, inbox_size=count + 10),
        site=SITE,
        instance="bench",
        policy_file=REPO / "policies" / "polca-h100.yaml",
        state_dir=workdir,
        rows=(
            RowSpec(
                name=ROW,
                budget_w=1e6,
                racks=tuple(
                    RackSpec(
                        name=f"r{r}",
                        nodes=tuple(NodeSpec(name=f"n{r}-{n}") for n in range(NODES_PER_RACK)),
                    )
                    for r in range(RACKS)
                ),
            ),
        ),
    )
    aggregator = Aggregator(settings)
    task = asyncio.create_task(aggregator.run())
    while aggregator.bus is None or not aggregator.bus.connected.is_set():  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.5)
    before = aggregator.intake.messages_in
    start = time.perf_counter()
    await _publish(host, port, _payloads(), count)
    while aggregator.intake.messages_in - before < count:
        await asyncio.sleep(0.005)
        if time.perf_counter() - start > 120:
            break
    elapsed = time.perf_counter() - start
    processed = aggregator.intake.messages_in - before
    dropped = aggregator.bus.stats.inbox_dropped
    aggregator.stop_requested.set()
    await task
    return {
        "rate": processed / elapsed,
        "processed": processed,
        "inbox_dropped": dropped,
        "intake_dropped": dict(aggregator.intake.dropped),
    }


async def main_async(count: int) -> dict[str, Any]:
    """Run both measurements against one Mosquitto."""
    from tests.mqtt_broker import MosquittoProcess

    with tempfile.TemporaryDirectory(prefix="polca-bench-agg-") as tmp:
        broker = MosquittoProcess(Path(tmp) / "mosquitto")
        broker.start()
        try:
            floors = [await floor_rate(broker.host, broker.port, count) for _ in range(3)]
            runs = [
                await aggregator_rate(broker.host, broker.port, count, Path(tmp)) for _ in range(3)
            ]
        finally:
            broker.kill()
    floors.sort()
    rates = sorted(r["rate"] for r in runs)
    return {
        "benchmark": "aggregator_intake",
        "nodes": RACKS * NODES_PER_RACK,
        "gpus_per_message": 8,
        "messages": count,
        "aggregator_msgs_per_s_median": round(rates[1]),
        "subscriber_floor_msgs_per_s_median": round(floors[1]),
        "ratio_to_floor": round(rates[1] / floors[1], 3),
        "runs": runs,
    }


def main() -> int:
    """Run, print, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "aggregator.json")
    args = parser.parse_args()
    from polca import logs

    logs.configure(level="error", fmt="json")
    figures = asyncio.run(main_async(args.messages))
    print(
        f"aggregator intake (decode, validate, roll up): "
        f"{figures['aggregator_msgs_per_s_median']:>8} msg/s (median of 3)"
    )
    print(
        f"bare subscriber, same stream (floor):         "
        f"{figures['subscriber_floor_msgs_per_s_median']:>8} msg/s (median of 3)"
    )
    print(
        f"ratio: {figures['ratio_to_floor']}  ({figures['nodes']} nodes of 8 GPUs; "
        "one such node publishes 1 msg/s)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
