"""Cooling fault to caps applied: from a CDU's leak reading to every affected agent capped.

In one process: a local Mosquitto, the aggregator with two cooling loops (one per rack),
and four agents on simulated GPUs (two per rack). Each trial publishes one CDU telemetry
message with a critical leak on loop 1 and times, from just before ``publish()``, until
every GPU of both rack-1 nodes has been clock-locked by its agent; then the leak clears and
the rack is released before the next trial. Rack 2 must stay untouched. As the floor, the
same run measures publish -> receive through the broker for a bare subscriber.

The alarm debounce is set to 0 here (``critical_raise_after_s``) to time the pipeline; the
default (2 s) adds that much on purpose, against sensor glitches.

    .venv/bin/python bench/bench_cooling.py [--trials 30]

Writes ``bench/results/cooling.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SITE, ROW = "bench", "row1"
RACKS = {"rack1": ("n11", "n12"), "rack2": ("n21", "n22")}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(trials: int) -> dict[str, Any]:  # noqa: PLR0915 - one linear measurement
    """Start everything, run the trials, return the figures."""
    import aiomqtt
    from tests.mqtt_broker import MosquittoProcess

    from polca.agent.config import AgentSettings, Settings, TopicSettings
    from polca.agent.runtime import Agent
    from polca.aggregator.config import AggregatorSettings, NodeSpec, RackSpec, RowSpec
    from polca.aggregator.runtime import Aggregator
    from polca.cooling.loops import CoolingSettings
    from polca.gpu.simulated import SimulatedBackend
    from polca.policy import PolicyStore
    from polca.settings import MqttSettings
    from polca.telemetry.schema import (
        CduTelemetry,
        CoolantConnector,
        LeakDetector,
        Pump,
        encode,
    )

    locks: dict[str, list[int]] = {}

    class TimedBackend(SimulatedBackend):
        node = ""

        def lock_sm_clocks_mhz(self, index: int, min_mhz: int, max_mhz: int) -> None:
            super().lock_sm_clocks_mhz(index, min_mhz, max_mhz)
            locks.setdefault(self.node, []).append(time.perf_counter_ns())

    def cdu_message(cdu: str, loop: str, *, leak: bool) -> bytes:
        return encode(
            CduTelemetry(
                ts_ns=time.time_ns(),
                cdu=cdu,
                loop=loop,
                secondary=CoolantConnector(
                    supply_temp_c=30.0,
                    return_temp_c=38.0,
                    flow_lpm=150.0,
                    delta_pressure_kpa=150.0,
                    heat_removed_kw=83.0,
                ),
                pumps=(
                    Pump(name="pump1", state="running", speed_pct=80.0),
                    Pump(name="pump2", state="standby", speed_pct=0.0),
                ),
                leak_detectors=(LeakDetector(name="leak1", state="critical" if leak else "ok"),),
                status="critical" if leak else "ok",
            )
        )

    policy = REPO / "policies" / "polca-h100.yaml"
    with tempfile.TemporaryDirectory(prefix="polca-bench-cooling-") as tmp:
        work = Path(tmp)
        broker = MosquittoProcess(work / "mosquitto")
        broker.start()
        mqtt = MqttSettings(host=broker.host, port=broker.port, reconnect_min_s=0.05)
        timing = {
            "critical_raise_after_s": 0.0,
            "raise_after_s": 0.0,
            "clear_after_s": 0.3,
            "heat_balance_raise_after_s": 3600,
        }
        aggregator = Aggregator(
            AggregatorSettings(
                mqtt=mqtt,
                site=SITE,
                instance="bench",
                policy_file=policy,
                state_dir=work / "agg",
                rows=(
                    RowSpec(
                        name=ROW,
                        budget_w=1e6,
                        racks=tuple(
                            RackSpec(name=rack, nodes=tuple(NodeSpec(name=n) for n in nodes))
                            for rack, nodes in RACKS.items()
                        ),
                    ),
                ),
                cooling=CoolingSettings.model_validate(
                    {
                        "loops": [
                            {
                                "name": f"loop{i}",
                                "cdu": f"cdu{i}",
                                "racks": [f"rack{i}"],
                                "heat_capacity_kw": 100.0,
                                "design_flow_lpm": 150.0,
                                "timing": timing,
                            }
                            for i in (1, 2)
                        ]
                    }
                ),
            )
        )
        agents = []
        for rack, nodes in RACKS.items():
            for node in nodes:
                backend = TimedBackend(count=8, model="H100-SXM", load="constant:0.6")
                backend.node = node
                settings = Settings(
                    mqtt=mqtt,
                    topics=TopicSettings(site=SITE, row=ROW, rack=rack, node=node),
                    agent=AgentSettings(
                        policy_file=policy,
                        state_dir=work / node,
                        startup_grace_s=3600,
                        accept_remote_policy=False,
                    ),
                )
                agents.append(Agent(settings, backend=backend, policy_store=PolicyStore(policy)))
        latencies: list[float] = []
        floor: list[float] = []
        async with asyncio.TaskGroup() as tg:
            agg_task = tg.create_task(aggregator.run())
            agent_tasks = [tg.create_task(a.run()) for a in agents]
            async with aiomqtt.Client(broker.host, broker.port, identifier="bench-cdu") as cdu:

                async def healthy(rounds: int) -> None:
                    for _ in range(rounds):
                        for i in (1, 2):
                            await cdu.publish(
                                f"polca/v1/{SITE}/cooling/cdu{i}/telemetry",
                                cdu_message(f"cdu{i}", f"loop{i}", leak=False),
                            )
                        await asyncio.sleep(0.1)

                await healthy(60)
                for _ in range(trials):
                    before = {n: len(locks.get(n, [])) for n in RACKS["rack1"]}
                    start = time.perf_counter_ns()
                    await cdu.publish(
                        f"polca/v1/{SITE}/cooling/cdu1/telemetry",
                        cdu_message("cdu1", "loop1", leak=True),
                    )
                    deadline = time.monotonic() + 5
                    # Polls lists the GPU threads append to: there is no event to wait on.
                    while time.monotonic() < deadline and not all(  # noqa: ASYNC110
                        len(locks.get(n, [])) >= before[n] + 8 for n in RACKS["rack1"]
                    ):
                        await asyncio.sleep(0.0005)
                    done = [locks[n][before[n] + 7] for n in RACKS["rack1"]]
                    latencies.append((max(done) - start) / 1e6)
                    await healthy(60)  # clear, then release one level per control interval
                assert not locks.get("n21"), "rack 2 was capped"
                async with aiomqtt.Client(broker.host, broker.port, identifier="bench-sub") as sub:
                    await sub.subscribe("bench/floor", qos=0)
                    it = sub.messages
                    for i in range(trials):
                        t0 = time.perf_counter_ns()
                        await cdu.publish("bench/floor", str(i).encode())
                        await anext(it)
                        floor.append((time.perf_counter_ns() - t0) / 1e6)
            aggregator.stop_requested.set()
            await agg_task
            for agent in agents:
                agent.stop_requested.set()
            await asyncio.gather(*agent_tasks)
        broker.kill()
    return {
        "benchmark": "cooling_fault_to_caps",
        "trials": trials,
        "affected_gpus": 16,
        "fault_to_caps_ms": {
            "median": round(statistics.median(latencies), 2),
            "p90": round(_pct(latencies, 0.9), 2),
            "p99": round(_pct(latencies, 0.99), 2),
            "max": round(max(latencies), 2),
        },
        "broker_floor_ms": {
            "median": round(statistics.median(floor), 3),
            "p99": round(_pct(floor, 0.99), 3),
        },
        "debounce_note": "alarm debounce set to 0 s; the default critical debounce is 2 s",
    }


def main() -> int:
    """Run, print, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cooling.json")
    args = parser.parse_args()
    from polca import logs

    logs.configure(level="error", fmt="json")
    figures = asyncio.run(run(args.trials))
    f, b = figures["fault_to_caps_ms"], figures["broker_floor_ms"]
    print(
        f"leak in CDU telemetry -> 16 GPUs of the affected rack capped: median {f['median']} ms,"
        f" p90 {f['p90']} ms, p99 {f['p99']} ms ({figures['trials']} trials)"
    )
    print(f"broker floor, publish -> receive: median {b['median']} ms, p99 {b['p99']} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
