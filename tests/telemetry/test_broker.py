"""EmbeddedBroker (amqtt): what the README demo relies on, checked with real MQTT clients."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import textwrap
from collections.abc import AsyncIterator

import aiomqtt
import pytest

from polca.errors import ConfigError, FatalError
from polca.settings import MqttSettings
from polca.telemetry.broker import EmbeddedBroker
from polca.telemetry.bus import MqttBus, _reap
from polca.telemetry.messages import OutMessage
from tests.mqtt_broker import free_port

WAIT_S = 5.0


@contextlib.asynccontextmanager
async def client(port: int, *topics: str) -> AsyncIterator[aiomqtt.Client]:
    """An MQTT 3.1.1 client subscribed to ``topics``."""
    mqtt = aiomqtt.Client("127.0.0.1", port, timeout=WAIT_S)
    try:
        async with mqtt:
            for topic in topics:
                await mqtt.subscribe(topic, qos=1)
            yield mqtt
    finally:
        await _reap(mqtt)


async def next_message(mqtt: aiomqtt.Client, topic: str) -> aiomqtt.Message:
    """The next message on ``topic``; amqtt may also replay unrelated retained ones."""
    async with asyncio.timeout(WAIT_S):
        async for message in mqtt.messages:
            if message.topic.value == topic:
                return message
    pytest.fail(f"no message on {topic}")


def accepts_tcp(port: int) -> bool:
    """Whether something listens on the loopback port (only for a stopped broker: amqtt
    0.12 leaks the transport of a connection that closes before CONNECT)."""
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def test_pub_sub_round_trip() -> None:
    """Messages published through the embedded broker reach a subscriber."""
    async with EmbeddedBroker() as broker:
        assert broker.port > 0
        assert broker.url == f"mqtt://127.0.0.1:{broker.port}"
        async with client(broker.port, "polca/demo/#") as sub, client(broker.port) as pub:
            await pub.publish("polca/demo/telemetry", b"sample", qos=1)
            message = await next_message(sub, "polca/demo/telemetry")
    assert (message.payload, message.retain) == (b"sample", False)
    assert not accepts_tcp(broker.port)


async def test_retained_reaches_late_subscriber() -> None:
    """The last retained message on a topic is delivered to a later subscriber."""
    async with EmbeddedBroker() as broker:
        async with client(broker.port) as pub:
            await pub.publish("polca/demo/status", b"first", qos=1, retain=True)
            await pub.publish("polca/demo/status", b"online", qos=1, retain=True)
        async with client(broker.port, "polca/demo/status") as sub:
            message = await next_message(sub, "polca/demo/status")
    assert (message.payload, message.retain) == (b"online", True)


_DYING_CLIENT = textwrap.dedent(
    """
    import asyncio, sys
    import aiomqtt

    async def main() -> None:
        will = aiomqtt.Will("polca/demo/node-9/status", b"offline", qos=1, retain=True)
        async with aiomqtt.Client("127.0.0.1", int(sys.argv[1]), will=will):
            print("ready", flush=True)
            await asyncio.sleep(60)

    asyncio.run(main())
    """
)


async def test_last_will_on_abrupt_disconnect() -> None:
    """A client that dies without DISCONNECT gets its retained will published."""
    status = "polca/demo/node-9/status"
    async with EmbeddedBroker() as broker, client(broker.port, status) as sub:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _DYING_CLIENT,
            str(broker.port),
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert child.stdout is not None
            async with asyncio.timeout(WAIT_S):
                assert await child.stdout.readline() == b"ready\n"
        finally:
            child.kill()
            await asyncio.wait_for(child.wait(), WAIT_S)
        offline = await next_message(sub, status)
        async with client(broker.port, status) as late:
            retained = await next_message(late, status)
    assert offline.payload == b"offline"
    assert (retained.payload, retained.retain) == (b"offline", True)


async def test_mqtt_bus_demo_path() -> None:
    """MqttBus speaking 3.1.1 works against the embedded broker: birth, subscribe, publish."""
    async with EmbeddedBroker() as broker:
        settings = MqttSettings(port=broker.port, protocol="3.1.1", reconnect_min_s=0.05)
        bus = MqttBus(
            settings,
            client_id="demo-node",
            subscriptions=[("polca/demo/cmd", 1)],
            birth=lambda: [OutMessage("polca/demo/status", b"online", qos=1, retain=True)],
        )
        task = asyncio.create_task(bus.run())
        async with client(broker.port, "polca/demo/status", "polca/demo/telemetry") as obs:
            assert (await next_message(obs, "polca/demo/status")).payload == b"online"
            assert await bus.publish(OutMessage("polca/demo/telemetry", b"t", qos=1))
            assert (await next_message(obs, "polca/demo/telemetry")).payload == b"t"
            await obs.publish("polca/demo/cmd", b"cap", qos=1)
            async with asyncio.timeout(WAIT_S):
                command = await bus.get()
            assert command.payload == b"cap"
        assert await bus.close(final=[OutMessage("polca/demo/status", b"offline", retain=True)])
        await asyncio.wait_for(task, WAIT_S)


async def test_mqtt5_is_refused_as_config_error() -> None:
    """amqtt refuses MQTT 5, which MqttBus reports as a fatal ConfigError, not a retry loop."""
    async with EmbeddedBroker() as broker:
        bus = MqttBus(MqttSettings(port=broker.port, protocol="5"), client_id="demo-node")
        with pytest.raises(ConfigError, match=r"does not speak MQTT 5"):
            await asyncio.wait_for(bus.run(), WAIT_S)


async def test_explicit_port_and_port_in_use() -> None:
    """A chosen port is used as given; a second broker on it fails with FatalError."""
    port = free_port()
    async with EmbeddedBroker(port=port) as broker:
        assert broker.port == port
        async with client(port) as mqtt:  # not a bare TCP probe: amqtt leaks those
            await mqtt.publish("polca/demo/x", b"1", qos=1)
        with pytest.raises(FatalError, match=f"127.0.0.1:{port}"):
            async with EmbeddedBroker(port=port):
                pass


async def test_amqtt_logging_is_quiet() -> None:
    """amqtt's per-connection info logging is turned down to warnings."""
    async with EmbeddedBroker():
        assert logging.getLogger("amqtt").getEffectiveLevel() == logging.WARNING
        assert logging.getLogger("amqtt.broker").getEffectiveLevel() >= logging.WARNING


async def test_missing_amqtt_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without amqtt, entering the broker raises FatalError naming the extra to install."""
    monkeypatch.setitem(sys.modules, "amqtt.broker", None)
    with pytest.raises(FatalError, match=r"pip install 'polca\[embedded\]'"):
        async with EmbeddedBroker():
            pass


async def test_no_tasks_left_after_exit() -> None:
    """Leaving the context stops every broker task."""
    async with EmbeddedBroker() as broker, client(broker.port) as pub:
        await pub.publish("polca/demo/x", b"1")
    current = asyncio.current_task()
    assert {task for task in asyncio.all_tasks() if task is not current} == set()
