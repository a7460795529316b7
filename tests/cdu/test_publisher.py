"""CDU telemetry publishers against a real Mosquitto: the plant, the poller, rack power."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from structlog.testing import capture_logs

from polca.cdu import publisher
from polca.cdu.modbus import ModbusCduPoller
from polca.cdu.publisher import (
    RackPowerTracker,
    publish_plant_once,
    run_plant,
    run_poller,
    track_rack_power,
)
from polca.cdu.registers import load_map
from polca.plant.cdu import SimulatedCdu
from polca.settings import MqttSettings
from polca.telemetry.bus import MqttBus
from polca.telemetry.checks import DropLog
from polca.telemetry.messages import InMessage, OutMessage
from polca.telemetry.schema import CduTelemetry, Telemetry, decode, encode
from polca.telemetry.topics import NodeAddress, Topics
from tests.modbus.conftest import ModbusTestServer
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


N1_TOPIC = TOPICS.node(NodeAddress(SITE, "row1", "rack1", "n1"), "telemetry")


def message(payload: bytes, *, topic: str = N1_TOPIC, retain: bool = False) -> InMessage:
    """A received message."""
    return InMessage(topic, payload, retain, 0)


def huge_int_telemetry() -> bytes:
    """n1's telemetry with a 5,000-digit sequence number (json.loads alone raises on it)."""
    return node_telemetry("n1", 1000.0).replace(b'"seq":1', b'"seq":' + b"9" * 5000)


HOSTILE: list[tuple[str, InMessage]] = [
    ("bad-json", message(b"{not json")),
    ("not-utf8", message(b"\xff\xfe\xfd")),
    ("deep-nesting", message(b"[" * 100_000)),
    ("deep-object", message(b'{"a":' * 50_000)),
    ("huge-int", message(huge_int_telemetry())),
    ("oversized", message(b" " * (2 * 1024 * 1024))),
    ("wrong-kind", message(b'{"schema_version": 1, "kind": "status", "ts_ns": 1}')),
    ("nan", message(node_telemetry("n1", 1000.0).replace(b"1000.0", b"NaN", 1))),
    ("empty", message(b"")),
]


@pytest.mark.parametrize(("name", "hostile"), HOSTILE, ids=[name for name, _ in HOSTILE])
def test_hostile_payloads_are_counted_and_dropped(name: str, hostile: InMessage) -> None:
    """Each hostile payload is dropped and counted; the next good message is taken."""
    tracker = RackPowerTracker(racks=["row1/rack1"])
    with capture_logs() as logs:
        assert not tracker.feed(hostile), name
    assert sum(tracker.dropped.values()) == 1
    assert "internal" not in tracker.dropped  # decode refused it with a SchemaError
    assert [e["event"] for e in logs] == ["node_telemetry_dropped"]
    assert len(logs[0]["error"]) <= 256
    assert tracker.feed(message(node_telemetry("n1", 1000.0)))
    assert tracker.power_w() == {"row1/rack1": 1000.0}


@pytest.mark.parametrize(
    ("hostile", "reason"),
    [
        (message(node_telemetry("n2", 9000.0)), "identity"),  # n2's reading on n1's topic
        (message(node_telemetry("n1", 9000.0), retain=True), "retained"),
        (message(b"{}", topic="polca/v1/site/row1/rack1/n1/status"), "topic"),
        (message(b"{}", topic="polca/v1/site/row1/rack1/n 1/telemetry"), "topic"),
        (message(b"{}", topic="x" * 70_000), "topic"),
    ],
)
def test_readings_that_parse_but_cannot_be_trusted_are_dropped(
    hostile: InMessage, reason: str
) -> None:
    """Another node's name, a retained (old) reading and a foreign topic are refused."""
    tracker = RackPowerTracker(racks=["row1/rack1"])
    with capture_logs() as logs:
        assert not tracker.feed(hostile)
    assert tracker.dropped == {reason: 1}
    assert tracker.power_w() == {"row1/rack1": 0.0}
    assert logs[0]["reason"] == reason
    assert len(logs[0]["topic"]) <= 256


def test_an_unexpected_exception_costs_one_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug while handling a message is counted as internal, logged with it, and survived."""

    def broken(_payload: bytes, _expected: object = None) -> object:
        msg = "decoder bug"
        raise RuntimeError(msg)

    tracker = RackPowerTracker(racks=["row1/rack1"])
    monkeypatch.setattr(publisher, "decode", broken)
    with capture_logs() as logs:
        assert not tracker.feed(message(node_telemetry("n1", 1000.0)))
    monkeypatch.undo()
    assert tracker.dropped == {"internal": 1}
    assert logs[0]["log_level"] == "error"
    assert isinstance(logs[0]["exc_info"], RuntimeError)
    assert tracker.feed(message(node_telemetry("n1", 1000.0)))


def test_cancellation_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """CancelledError (a BaseException) passes through the per-message guard."""

    def cancelled(_payload: bytes, _expected: object = None) -> object:
        raise asyncio.CancelledError

    tracker = RackPowerTracker(racks=["row1/rack1"])
    monkeypatch.setattr(publisher, "decode", cancelled)
    with pytest.raises(asyncio.CancelledError):
        tracker.feed(message(node_telemetry("n1", 1000.0)))


def test_drop_logs_are_rate_limited_per_reason() -> None:
    """One line per reason per 10 s, saying how many were dropped since the last line."""
    now = [0.0]
    drops = DropLog("node_telemetry_dropped", clock=lambda: now[0])
    tracker = RackPowerTracker(racks=["row1/rack1"], clock=lambda: now[0], drops=drops)
    with capture_logs() as logs:
        for _ in range(1000):
            tracker.feed(message(b"junk"))
        tracker.feed(message(node_telemetry("n2", 1.0)))
        now[0] = 10.0
        tracker.feed(message(b"junk"))
    assert [(e["reason"], e["dropped"], e["total"]) for e in logs] == [
        (logs[0]["reason"], 1, 1),
        ("identity", 1, 1),
        (logs[0]["reason"], 1000, 1001),
    ]
    assert sum(tracker.dropped.values()) == 1002


def test_a_flood_of_node_names_is_bounded() -> None:
    """Past max_nodes, new nodes are dropped (capacity) unless stale ones can be forgotten."""
    now = [0.0]
    tracker = RackPowerTracker(max_nodes=3, clock=lambda: now[0])

    def feed(node: str) -> bool:
        topic = TOPICS.node(NodeAddress(SITE, "row1", "rack1", node), "telemetry")
        return tracker.feed(message(node_telemetry(node, 10.0), topic=topic))

    assert all(feed(f"n{i}") for i in range(3))
    assert not feed("n3")
    assert tracker.dropped == {"capacity": 1}
    now[0] = 5.0
    assert feed("n0")  # a known node is always updated
    now[0] = 11.0
    assert feed("n4")  # n1, n2 are stale now and make room
    assert tracker.power_w() == {"row1/rack1": 20.0}


class ListSource:
    """A Subscriber that hands out ``messages`` and then waits forever."""

    def __init__(self, messages: list[InMessage]) -> None:
        self.queue: asyncio.Queue[InMessage] = asyncio.Queue()
        for m in messages:
            self.queue.put_nowait(m)

    async def get(self) -> InMessage:
        """The next message."""
        return await self.queue.get()


async def test_the_listener_loop_outlives_every_hostile_message() -> None:
    """track_rack_power takes hostile messages one at a time and keeps going."""
    good = message(node_telemetry("n1", 2500.0))
    source = ListSource([m for _, m in HOSTILE] + [good])
    tracker = RackPowerTracker(racks=["row1/rack1"])
    async with tasks(track_rack_power(source, tracker)):
        await wait_for(lambda: tracker.accepted == 1)
    assert sum(tracker.dropped.values()) == len(HOSTILE)
    assert tracker.power_w() == {"row1/rack1": 2500.0}


async def test_retained_hostile_messages_on_the_broker_do_not_end_the_listener(
    mosquitto: MosquittoProcess,
) -> None:
    """Retained junk on the subscribed topics, then live junk: the tracker still works."""
    agent, agent_run = await connected_bus(mosquitto.port, "hostile-agent")
    async with tasks(agent_run):
        await agent.connected.wait()
        for node, payload in (("n1", b"[" * 100_000), ("n2", huge_int_telemetry()), ("n3", b"{")):
            topic = TOPICS.node(NodeAddress(SITE, "row1", "rack1", node), "telemetry")
            agent.publish_nowait(OutMessage(topic, payload, qos=1, retain=True))
        assert await agent.flush(WAIT_S)
        tracker = RackPowerTracker(racks=["row1/rack1"])
        bus, bus_run = await connected_bus(
            mosquitto.port, "cdu-sim", [(TOPICS.all_nodes(SITE, "row1", "telemetry"), 0)]
        )
        async with tasks(bus_run, track_rack_power(bus, tracker)):
            await wait_for(lambda: tracker.dropped.get("retained", 0) == 3)
            agent.publish_nowait(OutMessage(N1_TOPIC, b"[" * 100_000))
            agent.publish_nowait(OutMessage(N1_TOPIC, huge_int_telemetry()))
            agent.publish_nowait(OutMessage(N1_TOPIC, node_telemetry("n1", 7000.0)))
            await wait_for(lambda: tracker.power_w().get("row1/rack1") == 7000.0)
    assert sum(tracker.dropped.values()) == 5
