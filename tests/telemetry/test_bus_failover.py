"""MqttBus with several endpoints, against real Mosquitto processes: it connects to one that
answers, moves to the next one when its broker dies (subscribing again, reading the new
broker's retained messages, publishing its birth and its queued messages there), passes
over an endpoint that failed lately, and gives up naming them all when none answers.

Two unrelated Mosquittos stand in for two nodes of a cluster here: what the bus does is the
same; what a real cluster adds (retained messages and wills shared between nodes) is
tested against NATS in ``test_broker_contract.py`` and end to end in
``tests/integration/test_cluster_e2e.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from polca.agent.config import Settings
from polca.errors import TransportError
from polca.settings import MqttSettings
from polca.telemetry.bus import MqttBus
from polca.telemetry.messages import OutMessage
from tests.mqtt_broker import MosquittoFactory, MosquittoProcess, free_port
from tests.telemetry.test_bus import inbox_get, next_message, observer, running, wait_until


def cluster_settings(*ports: int, **overrides: Any) -> MqttSettings:
    """Settings naming ``ports`` as the endpoints, reconnecting quickly."""
    values: dict[str, Any] = {
        "endpoints": [f"127.0.0.1:{port}" for port in ports],
        "reconnect_min_s": 0.05,
        "reconnect_max_s": 0.2,
        "keepalive_s": 5,
        "connect_timeout_s": 2.0,
        "connack_timeout_s": 2.0,
    }
    values.update(overrides)
    return MqttSettings(**values)


async def test_connects_past_a_dead_endpoint(mosquitto_factory: MosquittoFactory) -> None:
    live = mosquitto_factory()
    dead_port = free_port()
    bus = MqttBus(cluster_settings(dead_port, live.port), client_id="t-skip")
    with capture_logs() as logs:
        async with running(bus):
            assert bus.stats.endpoint == f"127.0.0.1:{live.port}"
            assert bus.stats.failovers == 0  # the first connection is not a move
    failed = [e for e in logs if e["event"] == "mqtt_disconnected"]
    assert failed[0]["endpoint"] == f"127.0.0.1:{dead_port}"
    assert failed[0]["next_endpoint"] == f"127.0.0.1:{live.port}"
    assert bus.stats.endpoint is None  # not connected any more


async def test_moves_to_the_next_broker_and_reads_its_state_again(
    mosquitto_factory: MosquittoFactory,
) -> None:
    first, second = mosquitto_factory(), mosquitto_factory()
    async with observer(second.port) as client:  # the retained state on the second node
        await client.publish("polca/v1/s/r1/control", b"second", qos=1, retain=True)
    birth = OutMessage("polca/v1/s/r1/k1/n1/status", b"online", qos=1, retain=True)
    bus = MqttBus(
        cluster_settings(first.port, second.port),
        client_id="t-move",
        subscriptions=[("polca/v1/s/r1/control", 1)],
        birth=lambda: [birth],
    )
    async with running(bus):
        assert bus.stats.endpoint == f"127.0.0.1:{first.port}"
        await asyncio.to_thread(first.kill)
        await wait_until(lambda: bus.stats.failovers == 1, "connected again")
        assert bus.stats.endpoint == f"127.0.0.1:{second.port}"
        assert bus.stats.failovers == 1
        received = await inbox_get(bus)  # subscribed again: the second node's retained
        assert (received.topic, received.payload, received.retain) == (
            "polca/v1/s/r1/control",
            b"second",
            True,
        )
        async with observer(second.port, "polca/v1/s/r1/k1/n1/status", "polca/v1/x") as client:
            status = await next_message(client, "polca/v1/s/r1/k1/n1/status")
            assert status.payload == b"online"  # the birth, published on the new node
            bus.publish_nowait(OutMessage("polca/v1/x", b"after", qos=1))
            assert (await next_message(client, "polca/v1/x")).payload == b"after"


async def test_messages_queued_during_the_move_reach_the_new_broker(
    mosquitto_factory: MosquittoFactory,
) -> None:
    first, second = mosquitto_factory(), mosquitto_factory()
    bus = MqttBus(
        cluster_settings(first.port, second.port, reconnect_min_s=0.5, reconnect_max_s=0.5),
        client_id="t-queue",
    )
    async with running(bus), observer(second.port, "polca/v1/q/#") as client:
        await asyncio.to_thread(first.kill)
        await wait_until(lambda: not bus.connected.is_set(), "disconnected")
        for n in range(3):  # while it is between brokers
            bus.publish_nowait(OutMessage(f"polca/v1/q/{n}", str(n).encode(), qos=1))
        got = [(await next_message(client, f"polca/v1/q/{n}")).payload for n in range(3)]
        assert got == [b"0", b"1", b"2"]
        assert bus.stats.outbox_dropped == 0


async def test_an_endpoint_that_failed_lately_is_passed_over(
    mosquitto_factory: MosquittoFactory,
) -> None:
    a, b, c = mosquitto_factory(), mosquitto_factory(), mosquitto_factory()
    bus = MqttBus(cluster_settings(a.port, b.port, c.port), client_id="t-hold")
    async with running(bus):
        await asyncio.to_thread(a.kill)
        await wait_until(lambda: bus.stats.endpoint == f"127.0.0.1:{b.port}", "on b")
        await asyncio.to_thread(a.start)  # a is back, but failed a moment ago
        await asyncio.to_thread(b.kill)
        await wait_until(lambda: bus.stats.failovers == 2, "moved again")
        assert bus.stats.endpoint == f"127.0.0.1:{c.port}"  # c, not the recently failed a
        await asyncio.to_thread(c.kill)  # now a and b failed lately, b more recently
        await wait_until(lambda: bus.stats.failovers == 3, "moved again")
        assert bus.stats.endpoint == f"127.0.0.1:{a.port}"
        assert bus.stats.failovers == 3


async def test_one_shot_gives_up_after_trying_every_endpoint_once() -> None:
    ports = [free_port(), free_port(), free_port()]
    bus = MqttBus(cluster_settings(*ports), client_id="t-none", attempts=1)
    with capture_logs() as logs, pytest.raises(TransportError) as raised:
        await asyncio.wait_for(bus.run(), timeout=10)
    tried = [e["endpoint"] for e in logs if e["event"] == "mqtt_disconnected"]
    assert tried == [f"127.0.0.1:{port}" for port in ports[:2]]  # the third one raised
    for port in ports:
        assert f"127.0.0.1:{port}" in str(raised.value)


def test_endpoints_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLCA_MQTT__ENDPOINTS", "mq1:8883, mq2 ,[fd00::3]:8884")
    monkeypatch.setenv("POLCA_MQTT__PORT", "8883")
    endpoints = Settings().mqtt.broker_endpoints()
    assert [str(e) for e in endpoints] == ["mq1:8883", "mq2:8883", "[fd00::3]:8884"]


def test_host_and_port_are_the_single_endpoint() -> None:
    endpoints = MqttSettings(host="broker", port=1884).broker_endpoints()
    assert [str(e) for e in endpoints] == ["broker:1884"]


@pytest.mark.parametrize(
    "endpoints",
    [
        ["mq1:0"],
        ["mq1:99999"],
        ["mq 1:1883"],
        ["mq1:1883", "mq1:1883"],
        ["[fd00::1"],
        ["mq1:port"],
        [f"mq{n}" for n in range(17)],
    ],
)
def test_bad_endpoints_are_refused(endpoints: list[str]) -> None:
    with pytest.raises(ValidationError):
        MqttSettings(endpoints=endpoints)


@pytest.mark.parametrize(
    ("cap", "endpoints", "granted"),
    [
        (1, 1, [1, 0, 1]),
        (0, 1, [0, 0, 0]),
        (None, 1, [1, 0, 1]),  # the default on one broker
        (None, 2, [0, 0, 0]),  # the default on a cluster
        (1, 2, [1, 0, 1]),
    ],
)
async def test_subscriptions_are_capped_at_the_configured_qos(
    mosquitto_factory: MosquittoFactory, cap: int | None, endpoints: int, granted: list[int]
) -> None:
    broker = mosquitto_factory()
    topics = [("polca/v1/a", 1), ("polca/v1/b", 0), ("polca/v1/c", 2)]
    others = [free_port() for _ in range(endpoints - 1)]  # never reached: the first answers
    bus = MqttBus(
        cluster_settings(broker.port, *others, subscription_qos_max=cap),
        client_id="t-qos",
        subscriptions=topics,
    )
    async with running(bus), observer(broker.port) as client:
        for topic, _ in topics:  # QoS 1 each: delivered at the QoS the bus subscribed with
            await client.publish(topic, b"x", qos=1)
        got = {}
        for _ in topics:
            message = await inbox_get(bus)
            got[message.topic] = message.qos
    assert [got[topic] for topic, _ in topics] == granted


async def test_move_on_leaves_a_connected_endpoint_for_the_next(
    mosquitto_factory: MosquittoFactory,
) -> None:
    first, second = mosquitto_factory(), mosquitto_factory()
    bus = MqttBus(cluster_settings(first.port, second.port), client_id="t-move-on")
    with capture_logs() as logs:
        async with running(bus):
            bus.move_on("silent")
            await wait_until(lambda: bus.stats.failovers == 1, "moved")
            assert bus.stats.endpoint == f"127.0.0.1:{second.port}"
    (left,) = [e for e in logs if e["event"] == "mqtt_disconnected"]
    assert "moving on: silent" in left["error"]


async def test_move_on_with_one_endpoint_does_nothing(mosquitto: MosquittoProcess) -> None:
    bus = MqttBus(cluster_settings(mosquitto.port), client_id="t-stay")
    async with running(bus):
        bus.move_on("silent")
        await asyncio.sleep(0.3)
        assert bus.stats.connects == 1
        assert bus.stats.endpoint == f"127.0.0.1:{mosquitto.port}"


@contextlib.asynccontextmanager
async def loopback_server(
    handle: Callable[
        [asyncio.StreamReader, asyncio.StreamWriter, list[asyncio.StreamWriter]], Awaitable[None]
    ],
) -> AsyncIterator[int]:
    """A TCP server on loopback running ``handle(reader, writer, opened)`` per connection
    (``opened``: where a handler lists the streams it opens); its port. Every stream
    listed is closed on the way out, its handler done or not."""
    opened: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opened.append(writer)
        await handle(reader, writer, opened)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in opened:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def suback_held(broker_port: int, release: asyncio.Event) -> AsyncIterator[int]:
    """A relay to the broker on ``broker_port`` that holds each SUBACK until ``release``
    (as a cluster electing new leaders holds a moved client's subscriptions); its port."""

    async def relay(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        opened: list[asyncio.StreamWriter],
    ) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", broker_port)
        opened.append(up_writer)

        async def upstream() -> None:
            while data := await reader.read(65536):
                up_writer.write(data)
                await up_writer.drain()

        async def downstream() -> None:
            while header := await up_reader.read(1):
                length, shift, raw = 0, 0, b""
                while True:  # the remaining length: a variable byte integer
                    byte = await up_reader.readexactly(1)
                    raw += byte
                    length |= (byte[0] & 0x7F) << shift
                    shift += 7
                    if not byte[0] & 0x80:
                        break
                body = await up_reader.readexactly(length)
                if header[0] >> 4 == 9:  # SUBACK
                    await release.wait()
                writer.write(header + raw + body)
                await writer.drain()

        pumps = [asyncio.create_task(upstream()), asyncio.create_task(downstream())]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)  # either side gone
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for w in (writer, up_writer):
            w.close()

    async with loopback_server(relay) as port:
        yield port


async def test_subscribed_only_once_the_broker_grants_the_subscriptions(
    mosquitto_factory: MosquittoFactory,
) -> None:
    """``connected`` at the CONNACK, ``subscribed`` at the SUBACK (what the aggregator's
    intake hold waits for); both cleared when the connection breaks."""
    mosquitto, release = mosquitto_factory(), asyncio.Event()
    async with suback_held(mosquitto.port, release) as port:
        bus = MqttBus(
            cluster_settings(port), client_id="t-suback", subscriptions=[("polca/v1/a", 1)]
        )
        async with running(bus):
            await asyncio.sleep(0.3)
            assert bus.connected.is_set()
            assert not bus.subscribed.is_set()  # the SUBACK is held back
            release.set()
            await asyncio.wait_for(bus.subscribed.wait(), 5)
            await asyncio.to_thread(mosquitto.kill)
            await wait_until(lambda: not bus.connected.is_set(), "disconnected")
            assert not bus.subscribed.is_set()


@contextlib.asynccontextmanager
async def silent_broker() -> AsyncIterator[int]:
    """A TCP listener that accepts connections and never answers (a cluster node whose
    CONNECT waits on an election); its port."""

    async def hold(
        _reader: asyncio.StreamReader,
        _writer: asyncio.StreamWriter,
        _opened: list[asyncio.StreamWriter],
    ) -> None:
        """Keep the connection (listed by the server) and say nothing."""

    async with loopback_server(hold) as port:
        yield port


async def test_an_unanswered_connect_moves_on_after_the_connack_timeout(
    mosquitto_factory: MosquittoFactory,
) -> None:
    """A CONNECT left unanswered is given up after ``connack_timeout_s`` (here 0.5 s), not
    the operations' ``connect_timeout_s`` (30 s), and the next endpoint is tried."""
    live = mosquitto_factory()
    async with silent_broker() as silent:
        settings = cluster_settings(silent, live.port, connack_timeout_s=0.5, connect_timeout_s=30)
        bus = MqttBus(settings, client_id="t-connack")
        with capture_logs() as logs:
            async with running(bus):
                assert bus.stats.endpoint == f"127.0.0.1:{live.port}"
    (gave_up,) = [e for e in logs if e["event"] == "mqtt_disconnected"]
    assert gave_up["endpoint"] == f"127.0.0.1:{silent}"
    assert gave_up["was_connected"] is False


async def test_operations_once_connected_wait_the_connect_timeout(
    mosquitto_factory: MosquittoFactory,
) -> None:
    """A SUBACK that takes longer than ``connack_timeout_s`` (but not ``connect_timeout_s``)
    is waited for on the same connection."""
    mosquitto, release = mosquitto_factory(), asyncio.Event()
    async with suback_held(mosquitto.port, release) as port:
        settings = cluster_settings(port, connack_timeout_s=0.3, connect_timeout_s=30)
        bus = MqttBus(settings, client_id="t-op-timeout", subscriptions=[("polca/v1/a", 1)])
        async with running(bus):
            await asyncio.sleep(1.0)  # over three times the CONNACK timeout
            release.set()
            await asyncio.wait_for(bus.subscribed.wait(), 5)
            assert bus.stats.connects == 1
