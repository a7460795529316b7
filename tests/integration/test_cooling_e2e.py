"""Cooling faults end to end: simulated CDUs, a real aggregator and agents, Mosquitto."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from polca.plant.cdu import SimulatedCdu
from polca.plant.faults import FaultKind
from polca.plant.ratings import CduRatings
from polca.telemetry.schema import Control, CoolingAlarm, CoolingLoopState, Meter, encode
from tests.fake_nvml import FakeNvml
from tests.integration.aggregator_rig import AggregatorProcess
from tests.integration.rig import SITE, AgentProcess, MqttProbe, mqtt_probe, wait_until
from tests.integration.test_aggregator_e2e import BUDGET_W, LOW, RACKS, _test_policy
from tests.mqtt_broker import MosquittoProcess

TOP_LEVEL = 3  # the A100 policy: T1, T2, brake
COOLING = {
    "stale_after_s": 1.5,
    "loops": [
        {
            "name": f"loop{i}",
            "cdu": f"cdu{i}",
            "racks": [f"rack{i}"],
            "heat_capacity_kw": 100.0,
            "design_flow_lpm": 150.0,
            "timing": {
                "raise_after_s": 0.4,
                "critical_raise_after_s": 0.2,
                "clear_after_s": 1.0,
                "escalate_after_s": 600,
                "heat_balance_raise_after_s": 600,
            },
        }
        for i in (1, 2)
    ],
}


class CoolingRig:
    """Two racks on two loops, one agent each, an aggregator, two simulated CDUs."""

    def __init__(self, tmp_path: Path, broker: MosquittoProcess, lib: Path) -> None:
        policy = _test_policy(tmp_path)
        self.nodes: dict[str, FakeNvml] = {}
        self.agents: list[AgentProcess] = []
        for rack, names in RACKS.items():
            for name in names:
                directory = tmp_path / f"nvml-{name}"
                directory.mkdir()
                self.nodes[name] = FakeNvml(
                    directory, gpus=8, model="NVIDIA A100-SXM4-80GB", lib_path=lib
                )
                self.agents.append(
                    AgentProcess(
                        tmp_path / f"agent-{name}",
                        fake=self.nodes[name],
                        broker=broker,
                        policy=policy,
                        startup_grace_s=60,
                        node=name,
                        rack=rack,
                    )
                )
        self.aggregator = AggregatorProcess(
            tmp_path / "aggregator",
            broker=broker,
            policy=policy,
            racks=RACKS,
            budget_w=BUDGET_W,
            extra={"cooling": COOLING},
        )
        self.cdus = {
            name: SimulatedCdu(name, loop=f"loop{i}", ratings=CduRatings(), seed=i, heat_kw=20.0)
            for i, name in ((1, "cdu1"), (2, "cdu2"))
        }

    def locked_max(self, node: str, gpu: int) -> int:
        """The fake's locked SM clock ceiling (0 = unlocked)."""
        value = self.nodes[node].get(gpu)["locked_max_mhz"]
        assert isinstance(value, int)
        return value

    def unlocked(self, node: str) -> bool:
        """No GPU of ``node`` has a clock lock."""
        return all(self.locked_max(node, g) == 0 for g in range(8))

    def kill(self) -> None:
        """Stop every process."""
        for agent in self.agents:
            agent.kill()
        self.aggregator.kill()


@pytest.fixture
def rig(tmp_path: Path, mosquitto: MosquittoProcess, fake_nvml_lib: Path) -> Iterator[CoolingRig]:
    """The cooling rig, killed after the test."""
    made = CoolingRig(tmp_path, mosquitto, fake_nvml_lib)
    yield made
    made.kill()


@pytest.fixture
async def feeding(rig: CoolingRig, mosquitto: MosquittoProcess) -> AsyncIterator[MqttProbe]:
    """Everything started; CDU telemetry and a 70% row meter published at 5 Hz."""
    async with mqtt_probe(mosquitto) as probe:
        for agent in rig.agents:
            agent.start()
        rig.aggregator.start()

        async def feed() -> None:
            while True:
                meter = Meter(ts_ns=time.time_ns(), power_w=0.7 * BUDGET_W)
                await probe.publish_raw(rig.aggregator.meter_topic, encode(meter))
                for name, cdu in rig.cdus.items():
                    reading = cdu.reading()
                    if reading is not None:
                        await probe.publish_raw(
                            f"polca/v1/{SITE}/cooling/{name}/telemetry", encode(reading)
                        )
                await asyncio.sleep(0.2)

        task = asyncio.create_task(feed())
        try:
            await rig.aggregator.wait_log("aggregator_warm", timeout_s=20)
            yield probe
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


def _alarms(probe: MqttProbe, action: str) -> list[CoolingAlarm]:
    return [m for m in probe.of("alarms") if isinstance(m, CoolingAlarm) and m.action == action]


def _rack_level(probe: MqttProbe, rack: str) -> int | None:
    controls = [
        m
        for m in probe.of("control")
        if isinstance(m, Control) and m.scope == "rack" and m.rack == rack
    ]
    return controls[-1].level if controls else None


@pytest.mark.parametrize(
    ("fault", "alarm", "forced"),
    [
        ("leak", "leak", TOP_LEVEL),
        ("all_pumps_failure", "pump_failure", TOP_LEVEL),
        ("loss_of_flow", "flow_low", TOP_LEVEL),
        ("pump_failure", "pump_failure", 2),
        ("telemetry_loss", "telemetry_stale", None),
        ("facility_water_rise", "supply_temp_high", None),
    ],
)
async def test_fault_raises_alarm_caps_only_its_racks_and_clears(
    rig: CoolingRig, feeding: MqttProbe, fault: FaultKind, alarm: str, forced: int | None
) -> None:
    """A CDU fault raises its alarm, forces its rack's level, spares the other loop, clears."""
    probe = feeding
    await wait_until(lambda: _rack_level(probe, "rack1") == 0, timeout_s=10, what="rack1 nominal")
    if fault == "leak":
        rig.cdus["cdu1"].leak(0, escalate_after_s=0)  # a critical leak at once
    elif fault == "facility_water_rise":
        rig.cdus["cdu1"].raise_facility_water(20.0)  # warm facility water: supply follows
    else:
        rig.cdus["cdu1"].inject(fault)
    await wait_until(
        lambda: any(a.alarm == alarm and a.loop == "loop1" for a in _alarms(probe, "raised")),
        timeout_s=40,
        what=f"{alarm} raised",
    )
    if forced is not None:
        await wait_until(
            lambda: (_rack_level(probe, "rack1") or 0) >= forced,
            timeout_s=10,
            what=f"rack1 forced to {forced}",
        )
        limit = 1110 if forced == 2 else 288
        await wait_until(
            lambda: all(0 < rig.locked_max("node1", g) <= max(limit, 210) for g in LOW),
            timeout_s=10,
            what="node1 capped",
        )
        assert rig.unlocked("node2")  # the healthy loop's rack is untouched
        assert _rack_level(probe, "rack2") == 0
    else:
        # No forced level: the loop's thermal budget shrinks instead (stale: counted at a
        # fraction of its last capacity; warm supply: derated capacity).
        def derated() -> bool:
            states = [m for m in probe.of("state") if isinstance(m, CoolingLoopState)]
            loop1 = [m for m in states if m.loop == "loop1"]
            loop2 = [m for m in states if m.loop == "loop2"]
            return (
                bool(loop1)
                and bool(loop2)
                and loop1[-1].thermal_budget_w is not None
                and loop2[-1].thermal_budget_w is not None
                and loop1[-1].thermal_budget_w < loop2[-1].thermal_budget_w
                and (loop1[-1].stale or fault != "telemetry_loss")
            )

        await wait_until(derated, timeout_s=15, what="loop1 budget derated")
        assert rig.unlocked("node2")
    rig.cdus["cdu1"].clear(fault)
    await wait_until(
        lambda: any(a.alarm == alarm and a.loop == "loop1" for a in _alarms(probe, "cleared")),
        timeout_s=60,
        what=f"{alarm} cleared",
    )
    await wait_until(
        lambda: _rack_level(probe, "rack1") == 0, timeout_s=20, what="rack1 released after recovery"
    )
    await wait_until(lambda: rig.unlocked("node1"), timeout_s=10, what="node1 uncapped")
    entry = await rig.aggregator.wait_log("cooling_alarm", where=lambda e: e["alarm"] == alarm)
    assert entry["loop"] == "loop1"
