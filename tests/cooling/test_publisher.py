"""CDU telemetry publishers against a real Mosquitto: the plant, the poller, rack power."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from polca.cooling.modbus import ModbusCduPoller
from polca.cooling.plant import SimulatedCdu
from polca.cooling.publisher import (
    RackPowerTracker,
    publish_plant_once,
    run_plant,
    run_poller,
    track_rack_power,
)
from polca.cooling.registers import load_map
from polca.settings import MqttSettings
from polca.telemetry.bus import InMessage, MqttBus, OutMessage
from polca.telemetry.schema import CduTelemetry, Telemetry, decode, encode
from polca.telemetry.topics import NodeAddress, Topics
from tests.cooling.conftest import ModbusTestServer
from tests.mqtt_broker import MosquittoProcess

WAIT_S = 10.0
SITE = "site"
TOPICS = Topics()


def settings(port: int) -> MqttSettings:
    """Quick-reconnecting settings for tests."""
    return MqttSettings(
        host="127.0.0.1",
        port=port,
        reconnect_min_s=0.05,
        reconnect_max_s=0.2,
        keepalive_s=5,
        connect_timeout_s=2.0,
    )


@contextlib.asynccontextmanager
async def tasks(*coros: Coroutine[Any, Any, object]) -> AsyncIterator[None]:
    """Run ``coros`` as tasks for the block, then cancel them and wait."""
    running = [asyncio.create_task(c) for c in coros]
    try:
        yield
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def connected_bus(
    port: int,
    client_id: str,
    subscriptions: list[tuple[str, int]] = [],  # noqa: B006
) -> tuple[MqttBus, Coroutine[Any, Any, None]]:
    """A bus and its run() coroutine."""
    bus = MqttBus(settings(port), client_id=client_id, subscriptions=subscriptions)
    return bus, bus.run()


async def collect(bus: MqttBus, count: int) -> list[CduTelemetry]:
    """The next ``count`` CDU messages received by ``bus``."""
    out: list[CduTelemetry] = []
    async with asyncio.timeout(WAIT_S):
        while len(out) < count:
            message = await bus.get()
            decoded = decode(message.payload, CduTelemetry)
            assert isinstance(decoded, CduTelemetry)
            out.append(decoded)
    return out


async def wait_for(predicate: Callable[[], bool]) -> None:
    """Poll ``predicate`` until true, or fail after WAIT_S."""
    async with asyncio.timeout(WAIT_S):
        while not predicate():  # noqa: ASYNC110 - watches plain counters
            await asyncio.sleep(0.02)


async def test_plant_publishes_decodable_telemetry(mosquitto: MosquittoProcess) -> None:
    """run_plant publishes CduTelemetry to the CDU topic, heat taken from rack power."""
    plant = SimulatedCdu("cdu7", loop="loopA", seed=2)
    publisher, pub_run = await connected_bus(mosquitto.port, "cdu-pub")
    listener, sub_run = await connected_bus(mosquitto.port, "cdu-sub", [(TOPICS.cdu(SITE, "+"), 0)])
    async with tasks(pub_run, sub_run):
        await listener.connected.wait()
        await asyncio.sleep(0.1)  # let the subscription settle
        power = {"row1/rack1": 50_000.0, "row1/rack2": 25_000.0}
        async with tasks(
            run_plant(publisher, plant, site=SITE, interval_s=0.05, rack_power_w=lambda: power)
        ):
            received = await collect(listener, 5)
    assert all(m.cdu == "cdu7" and m.loop == "loopA" for m in received)
    assert plant.heat_input_kw == pytest.approx(75_000.0 * 0.8 / 1000.0)
    assert [m.ts_ns for m in received] == sorted(m.ts_ns for m in received)
    assert received[0].pumps[0].state == "running"


async def test_telemetry_loss_stops_messages(mosquitto: MosquittoProcess) -> None:
    """While the telemetry-loss fault is on nothing is published; then it resumes."""
    plant = SimulatedCdu("cdu1", seed=3)
    publisher, pub_run = await connected_bus(mosquitto.port, "cdu-pub")
    listener, sub_run = await connected_bus(
        mosquitto.port, "cdu-sub", [(TOPICS.cdu(SITE, "cdu1"), 0)]
    )
    async with tasks(pub_run, sub_run):
        await listener.connected.wait()
        await asyncio.sleep(0.1)
        async with tasks(run_plant(publisher, plant, site=SITE, interval_s=0.05)):
            await collect(listener, 2)
            plant.lose_telemetry()
            assert await publisher.flush(WAIT_S)
            await asyncio.sleep(0.2)  # anything in flight arrives
            while not listener.inbox.empty():
                listener.inbox.get_nowait()
            sent_before = publisher.stats.published
            await asyncio.sleep(0.5)  # ten ticks
            assert listener.inbox.empty()
            assert publisher.stats.published == sent_before
            plant.restore_telemetry()
            resumed = await collect(listener, 2)
    assert resumed[0].cdu == "cdu1"


def test_publish_plant_once_reports_what_it_sent() -> None:
    """One tick returns the message it queued, or None while telemetry is lost."""
    sent: list[OutMessage] = []

    class Recorder:
        def publish_nowait(self, msg: OutMessage) -> None:
            sent.append(msg)

    plant = SimulatedCdu("cdu2", seed=1)
    message = publish_plant_once(Recorder(), plant, site="s1")
    assert message is not None
    assert sent[0].topic == "polca/v1/s1/cooling/cdu2/telemetry"
    assert sent[0].qos == 0
    assert not sent[0].retain
    assert decode(sent[0].payload, CduTelemetry) == message
    plant.lose_telemetry()
    assert publish_plant_once(Recorder(), plant, site="s1") is None
    assert len(sent) == 1


async def test_poller_publishes_and_goes_silent_while_unreachable(
    mosquitto: MosquittoProcess, modbus_server: ModbusTestServer
) -> None:
    """run_poller publishes each poll; nothing while the CDU is down; resumes after."""
    await modbus_server.set("input", 0, [305])
    config = load_map(
        {
            "cdu": "cdu5",
            "loop": "loop5",
            "host": modbus_server.host,
            "port": modbus_server.port,
            "timeout_s": 0.5,
            "reconnect_min_s": 0.05,
            "reconnect_max_s": 0.1,
            "points": [
                {"field": "secondary.supply_temp_c", "address": 0, "table": "input", "scale": 0.1}
            ],
        }
    )
    poller = ModbusCduPoller(config)
    publisher, pub_run = await connected_bus(mosquitto.port, "cdu-modbus")
    listener, sub_run = await connected_bus(
        mosquitto.port, "cdu-sub", [(TOPICS.cdu(SITE, "cdu5"), 0)]
    )
    async with tasks(pub_run, sub_run):
        await listener.connected.wait()
        await asyncio.sleep(0.1)
        async with tasks(run_poller(publisher, poller, site=SITE, interval_s=0.05)):
            first = await collect(listener, 2)
            await modbus_server.stop()
            await wait_for(lambda: poller.in_outage)
            assert await publisher.flush(WAIT_S)
            await asyncio.sleep(0.2)
            while not listener.inbox.empty():
                listener.inbox.get_nowait()
            await asyncio.sleep(0.4)
            assert listener.inbox.empty()
            await modbus_server.set("input", 0, [315])
            await modbus_server.start()
            await wait_for(lambda: not poller.in_outage)
            later = await collect(listener, 2)
    assert first[0].secondary.supply_temp_c == pytest.approx(30.5)
    assert later[-1].secondary.supply_temp_c == pytest.approx(31.5)
    assert not poller.connected  # run_poller closes its poller when cancelled


def node_telemetry(node: str, power_w: float) -> bytes:
    """An agent's telemetry payload with ``power_w`` of GPU power."""
    return encode(
        Telemetry(
            ts_ns=1,
            seq=1,
            node=node,
            interval_s=1.0,
            node_gpu_power_w=power_w,
            node_energy_delta_j=power_w,
            gpus=(),
        )
    )


def test_rack_power_tracker_sums_fresh_nodes() -> None:
    """Node telemetry sums per rack; silent nodes and other racks do not count."""
    now = [0.0]
    tracker = RackPowerTracker(racks=["row1/rack1", "row1/rack2"], clock=lambda: now[0])

    def feed(rack: str, node: str, power_w: float) -> bool:
        topic = TOPICS.node(NodeAddress(SITE, "row1", rack, node), "telemetry")
        return tracker.feed(InMessage(topic, node_telemetry(node, power_w), False, 0))

    assert feed("rack1", "n1", 4000.0)
    assert feed("rack1", "n2", 3000.0)
    assert not feed("rack9", "n3", 9000.0)  # not served by this loop
    assert not tracker.feed(InMessage("polca/v1/site/row1/rack1/n1/status", b"{}", False, 0))
    assert not tracker.feed(InMessage("polca/v1/site/row1/rack1/n1/telemetry", b"junk", False, 0))
    assert tracker.power_w() == {"row1/rack1": 7000.0, "row1/rack2": 0.0}
    now[0] = 8.0
    assert feed("rack1", "n1", 5000.0)
    now[0] = 12.0  # n2 silent for 12 s: stale
    assert tracker.power_w() == {"row1/rack1": 5000.0, "row1/rack2": 0.0}


async def test_plant_heat_follows_agents_telemetry(mosquitto: MosquittoProcess) -> None:
    """Node telemetry over MQTT drives the plant's heat input through the tracker."""
    tracker = RackPowerTracker(racks=["row1/rack1"])
    plant = SimulatedCdu("cdu1", seed=4)
    bus, bus_run = await connected_bus(
        mosquitto.port, "cdu-sim", [(TOPICS.all_nodes(SITE, "row1", "telemetry"), 0)]
    )
    agent, agent_run = await connected_bus(mosquitto.port, "fake-agent")
    async with tasks(bus_run, agent_run, track_rack_power(bus, tracker)):
        await bus.connected.wait()
        await agent.connected.wait()
        await asyncio.sleep(0.1)
        for node in ("n1", "n2"):
            address = NodeAddress(SITE, "row1", "rack1", node)
            agent.publish_nowait(
                OutMessage(TOPICS.node(address, "telemetry"), node_telemetry(node, 20_000.0))
            )
        await wait_for(lambda: tracker.power_w().get("row1/rack1") == 40_000.0)
        publish_plant_once(bus, plant, site=SITE, rack_power_w=tracker.power_w)
    assert plant.heat_input_kw == pytest.approx(40.0 * 0.8)
