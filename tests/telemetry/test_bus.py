"""MqttBus against a real Mosquitto: round trips, retained and will, outages, bounds, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from pydantic import SecretStr
from structlog.testing import capture_logs

from polca import aiokit
from polca.errors import ConfigError, TransportAuthError
from polca.settings import MqttSettings
from polca.telemetry.bus import MqttBus, _reap
from polca.telemetry.messages import InMessage, OutMessage, topic_matches
from tests.mqtt_broker import MosquittoFactory, MosquittoProcess, free_port

WAIT_S = 5.0


def fast_settings(port: int, **overrides: Any) -> MqttSettings:
    """Settings that reconnect quickly, for tests."""
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": port,
        "reconnect_min_s": 0.05,
        "reconnect_max_s": 0.2,
        "keepalive_s": 5,
        "connect_timeout_s": 2.0,
        "connack_timeout_s": 2.0,
    }
    values.update(overrides)
    return MqttSettings(**values)


@contextlib.asynccontextmanager
async def running(bus: MqttBus, *, connect: bool = True) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``bus`` in a task (waiting for the connection), cancel it afterwards."""
    task = asyncio.create_task(bus.run(), name="bus-under-test")
    try:
        if connect:
            await wait_for_event(bus.connected, task)
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_for_event(event: asyncio.Event, task: asyncio.Task[None] | None = None) -> None:
    """Wait for ``event``; fail early with the task's error if the task ends first."""
    waiter = asyncio.create_task(event.wait())
    waited: set[asyncio.Future[Any]] = {waiter}
    if task is not None:
        waited.add(task)
    done, _ = await asyncio.wait(waited, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiter
    if task is not None and task in done:
        task.result()
        pytest.fail("bus.run() returned unexpectedly")
    assert waiter in done, "event not set in time"


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` until true, or fail after WAIT_S."""
    async with asyncio.timeout(WAIT_S):
        while not predicate():  # noqa: ASYNC110 - polls counters that have no event
            await asyncio.sleep(0.01)
    assert predicate(), what


@contextlib.asynccontextmanager
async def observer(port: int, *topics: str) -> AsyncIterator[aiomqtt.Client]:
    """An independent MQTT client subscribed to ``topics``."""
    client = aiomqtt.Client("127.0.0.1", port, timeout=WAIT_S)
    try:
        async with client:
            for topic in topics:
                await client.subscribe(topic, qos=1)
            yield client
    finally:
        await _reap(client)  # its keepalive task ends a loop iteration after the socket


async def next_message(client: aiomqtt.Client, topic: str) -> aiomqtt.Message:
    """The next message on ``topic`` (others are skipped)."""
    async with asyncio.timeout(WAIT_S):
        async for message in client.messages:
            if message.topic.value == topic:
                return message
    pytest.fail(f"no message on {topic}")


async def inbox_get(bus: MqttBus) -> InMessage:
    """The next received message, within WAIT_S."""
    async with asyncio.timeout(WAIT_S):
        return await bus.get()


def no_other_tasks() -> set[asyncio.Task[Any]]:
    """Tasks still pending besides the test's own."""
    return {task for task in asyncio.all_tasks() if task is not asyncio.current_task()}


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/b", "a/c", False),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/+/c", "a/b/c", True),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("#", "a/b", True),
        ("+/+", "a/b", True),
        ("+", "a/b", False),
        ("a/b/c", "a/b", False),
        ("#", "$SYS/broker/uptime", False),
        ("+/broker", "$SYS/broker", False),
        ("$SYS/#", "$SYS/broker", True),
        ("a//b", "a//b", True),
        ("a/+/b", "a//b", True),
    ],
)
def test_topic_matches(topic_filter: str, topic: str, expected: bool) -> None:
    """MQTT wildcard matching follows the spec, including '#' matching the parent level."""
    assert topic_matches(topic_filter, topic) is expected


@pytest.mark.parametrize(("topic", "qos"), [("a/b", 3), ("a/+", 0), ("a/#", 1), ("", 0)])
def test_out_message_rejects_invalid(topic: str, qos: int) -> None:
    """An OutMessage with a wildcard topic or an unknown QoS cannot be built."""
    with pytest.raises(ValueError, match=r"QoS|wildcard"):
        OutMessage(topic, b"x", qos=qos)


def test_backoff_is_jittered_doubling_and_capped() -> None:
    """The n-th reconnect delay lies in [min / 2, min(max, min * 2**n)], spread across it."""
    for n in (0, 1, 3, 10, 1000):
        ceiling_s = min(5.0, 0.5 * 2 ** min(n, 32))
        delays = []
        for seed in range(200):
            schedule = aiokit.backoff_delays(0.5, 5.0, rng=random.Random(seed))  # noqa: S311
            delays.append(next(itertools.islice(schedule, n, None)))
        assert all(0.25 <= d <= ceiling_s for d in delays)
        assert max(delays) - min(delays) > (ceiling_s - 0.25) / 2  # jittered, not fixed


def test_constructor_does_no_io() -> None:
    """A bus can be built outside a running loop and without a broker."""
    bus = MqttBus(fast_settings(1), client_id="idle")
    assert not bus.connected.is_set()
    assert bus.stats.connects == 0


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
async def test_round_trip(mosquitto: MosquittoProcess, protocol: str) -> None:
    """The bus publishes birth on connect, sends messages and receives its subscriptions."""
    bus = MqttBus(
        fast_settings(mosquitto.port, protocol=protocol),
        client_id="node-1",
        subscriptions=[("polca/test/cmd/#", 1)],
        birth=lambda: [OutMessage("polca/test/status", b"online", qos=1, retain=True)],
    )
    async with (
        observer(mosquitto.port, "polca/test/out", "polca/test/status") as obs,
        running(bus),
    ):
        status = await next_message(obs, "polca/test/status")
        assert status.payload == b"online"

        assert await bus.publish(OutMessage("polca/test/out", b"hello", qos=1))
        received = await next_message(obs, "polca/test/out")
        assert received.payload == b"hello"

        await obs.publish("polca/test/cmd/cap", b"300", qos=1)
        command = await inbox_get(bus)
        assert (command.topic, command.payload, command.retain) == (
            "polca/test/cmd/cap",
            b"300",
            False,
        )
        assert command.received_ns > 0
    assert bus.stats.connects == 1
    assert bus.stats.published == 2  # birth and hello


async def test_a_message_over_the_wire_bound_is_never_sent(mosquitto: MosquittoProcess) -> None:
    """A payload over MAX_PAYLOAD_BYTES is dropped and counted, and the connection (which a
    broker would drop for it) carries on: the next message arrives."""
    from polca.telemetry.schema import MAX_PAYLOAD_BYTES

    bus = MqttBus(fast_settings(mosquitto.port), client_id="node-1")
    async with observer(mosquitto.port, "polca/test/out") as obs, running(bus):
        big = OutMessage("polca/test/out", b"x" * (MAX_PAYLOAD_BYTES + 1), qos=1)
        assert not await bus.publish(big)
        assert await bus.publish(OutMessage("polca/test/out", b"after", qos=1))
        received = await next_message(obs, "polca/test/out")
        assert received.payload == b"after"
    assert bus.stats.outbox_dropped == 1
    assert bus.stats.connects == 1


async def test_resubscribe_moves_the_live_subscriptions_and_survives_a_reconnect(
    mosquitto: MosquittoProcess,
) -> None:
    """After resubscribe, the dropped filter's messages stop, the new filter's retained and
    live messages arrive; a reconnect subscribes to the new list."""
    bus = MqttBus(fast_settings(mosquitto.port), client_id="agg", subscriptions=[("t/a", 0)])
    async with running(bus) as task:
        async with observer(mosquitto.port) as pub:
            await pub.publish("t/b", b"kept", qos=1, retain=True)
            await pub.publish("t/a", b"a1", qos=1)
            assert (await inbox_get(bus)).payload == b"a1"
            bus.resubscribe([("t/b", 0)])
            retained = await inbox_get(bus)
            assert (retained.topic, retained.payload, retained.retain) == ("t/b", b"kept", True)
            await pub.publish("t/a", b"a2", qos=1)  # no longer subscribed
            await pub.publish("t/b", b"b1", qos=1)
            assert (await inbox_get(bus)).payload == b"b1"
        mosquitto.kill()
        await wait_until(lambda: not bus.connected.is_set(), "bus noticed the broker crash")
        mosquitto.start()
        await wait_for_event(bus.connected, task)
        async with observer(mosquitto.port) as pub:
            await wait_until(lambda: bus.stats.connects == 2, "reconnected")
            # Retained: it arrives whether the new session subscribed before or after it.
            await pub.publish("t/b", b"b2", qos=1, retain=True)
            assert (await inbox_get(bus)).payload == b"b2"
            await pub.publish("t/a", b"a3", qos=1)
            await pub.publish("t/b", b"b3", qos=1)
            assert (await inbox_get(bus)).payload == b"b3"


async def test_retained_reaches_late_subscriber(mosquitto: MosquittoProcess) -> None:
    """A retained message published by the bus is delivered to a subscriber that comes later."""
    bus = MqttBus(fast_settings(mosquitto.port), client_id="node-1")
    async with running(bus):
        assert await bus.publish(OutMessage("polca/test/state", b"v1", qos=1, retain=True))
        assert await bus.publish(OutMessage("polca/test/state", b"v2", qos=1, retain=True))
    async with observer(mosquitto.port, "polca/test/state") as obs:
        message = await next_message(obs, "polca/test/state")
    assert (message.payload, message.retain) == (b"v2", True)


async def test_bus_receives_retained_on_subscribe(mosquitto: MosquittoProcess) -> None:
    """Retained messages already on the broker arrive in the inbox flagged as retained."""
    async with observer(mosquitto.port) as obs:
        await obs.publish("polca/test/policy", b"bundle", qos=1, retain=True)
    bus = MqttBus(
        fast_settings(mosquitto.port), client_id="node-1", subscriptions=[("polca/test/#", 1)]
    )
    async with running(bus):
        message = await inbox_get(bus)
    assert (message.topic, message.payload, message.retain) == (
        "polca/test/policy",
        b"bundle",
        True,
    )


@pytest.mark.parametrize(
    ("protocol", "retain_as_published", "seen_retained"),
    [("5", True, True), ("5", False, False), ("3.1.1", True, False)],
)
async def test_a_live_message_keeps_its_retain_flag_only_as_mqtt5_asks(
    mosquitto: MosquittoProcess, protocol: str, retain_as_published: bool, seen_retained: bool
) -> None:
    """A message published retained to an established subscription: under MQTT 5 with
    ``retain_as_published`` it arrives flagged (so a reading sent retained is seen as one
    live too); without the option, or under 3.1.1, which has none, the broker clears the
    flag. A message published plainly is never flagged."""
    bus = MqttBus(
        fast_settings(mosquitto.port, protocol=protocol),
        client_id="sources",
        subscriptions=[("polca/test/meter/#", 1)],
        retain_as_published=retain_as_published,
    )
    async with running(bus):
        await wait_for_event(bus.subscribed)
        async with observer(mosquitto.port) as meter:
            await meter.publish("polca/test/meter/row1", b"retained", qos=1, retain=True)
            await meter.publish("polca/test/meter/row1", b"plain", qos=1)
            first, second = await inbox_get(bus), await inbox_get(bus)
            await meter.publish("polca/test/meter/row1", b"", qos=1, retain=True)  # cleared
    assert (first.payload, first.retain) == (b"retained", seen_retained)
    assert (second.payload, second.retain) == (b"plain", False)


_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from polca.settings import MqttSettings
    from polca.telemetry.bus import MqttBus
    from polca.telemetry.messages import OutMessage

    async def main() -> None:
        status = "polca/test/node-9/status"
        bus = MqttBus(
            MqttSettings(host="127.0.0.1", port=int(sys.argv[1]), keepalive_s=5),
            client_id="node-9",
            will=OutMessage(status, b"offline", qos=1, retain=True),
            birth=lambda: [OutMessage(status, b"online", qos=1, retain=True)],
        )
        await bus.run()

    asyncio.run(main())
    """
)


async def test_will_published_when_process_dies(mosquitto: MosquittoProcess) -> None:
    """SIGKILL of a process running the bus makes the broker publish its retained will."""
    status = "polca/test/node-9/status"
    async with observer(mosquitto.port, status) as obs:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CHILD, str(mosquitto.port), stdout=asyncio.subprocess.DEVNULL
        )
        try:
            online = await next_message(obs, status)
            assert online.payload == b"online"
        finally:
            child.kill()
            await asyncio.wait_for(child.wait(), WAIT_S)
        offline = await next_message(obs, status)
        assert offline.payload == b"offline"
    async with observer(mosquitto.port, status) as late:
        retained = await next_message(late, status)
    assert (retained.payload, retained.retain) == (b"offline", True)


async def test_reconnects_after_broker_restart(mosquitto: MosquittoProcess) -> None:
    """After a broker crash the bus reconnects, re-sends birth, re-subscribes and sends the
    messages queued during the outage, in order."""
    births: list[int] = []

    def birth() -> Sequence[OutMessage]:
        births.append(len(births) + 1)
        return [OutMessage("polca/test/status", b"online-%d" % len(births), qos=1, retain=True)]

    bus = MqttBus(
        fast_settings(mosquitto.port),
        client_id="node-1",
        subscriptions=[("polca/test/echo/#", 1)],
        birth=birth,
    )
    async with running(bus) as task:
        mosquitto.kill()
        await wait_until(lambda: not bus.connected.is_set(), "bus noticed the broker crash")

        # Queued while the broker is down: a retained state and echoes of our own messages.
        bus.publish_nowait(OutMessage("polca/test/state", b"during-outage", qos=1, retain=True))
        for index in range(3):
            bus.publish_nowait(OutMessage(f"polca/test/echo/{index}", b"%d" % index, qos=1))
        acked = asyncio.create_task(bus.publish(OutMessage("polca/test/echo/3", b"3", qos=0)))
        await asyncio.sleep(0.3)  # a few failed reconnect attempts
        assert not acked.done()
        assert bus.outbox_len == 5

        mosquitto.start()
        await wait_for_event(bus.connected, task)
        assert await asyncio.wait_for(acked, WAIT_S)
        # Our own subscription was restored before the outbox drained, so the echoes come back.
        echoes = [await inbox_get(bus) for _ in range(4)]
        assert [m.payload for m in echoes] == [b"0", b"1", b"2", b"3"]

        async with observer(mosquitto.port, "polca/test/status", "polca/test/state") as obs:
            status = await next_message(obs, "polca/test/status")
            state = await next_message(obs, "polca/test/state")
    assert status.payload == b"online-2"  # persistence is off: only a new birth explains it
    assert state.payload == b"during-outage"
    assert births == [1, 2]
    assert bus.stats.connects == 2
    assert bus.stats.disconnects == 2  # the crash, then the cancellation at the end
    assert bus.stats.last_error is not None


async def test_reconnect_is_logged(mosquitto: MosquittoProcess) -> None:
    """A lost connection is logged as mqtt_disconnected with the error and the retry delay."""
    bus = MqttBus(fast_settings(mosquitto.port), client_id="node-1")
    with capture_logs() as logs:
        async with running(bus):
            mosquitto.kill()
            await wait_until(
                lambda: any(e["event"] == "mqtt_disconnected" for e in logs), "disconnect logged"
            )
    event = next(e for e in logs if e["event"] == "mqtt_disconnected")
    assert event["log_level"] == "warning"
    assert event["error"]
    assert 0.0 <= event["retry_in_s"] <= 0.2


async def test_outbox_overflow_drops_oldest(mosquitto: MosquittoProcess) -> None:
    """A full outbox drops its oldest messages, counts them and sends the rest in order."""
    bus = MqttBus(
        fast_settings(mosquitto.port, outbox_size=3),
        client_id="node-1",
        subscriptions=[("polca/test/echo/#", 1)],
    )
    first = asyncio.create_task(bus.publish(OutMessage("polca/test/echo/0", b"0", qos=1)))
    await asyncio.sleep(0)
    for index in range(1, 5):
        bus.publish_nowait(OutMessage(f"polca/test/echo/{index}", b"%d" % index, qos=1))
    assert await asyncio.wait_for(first, WAIT_S) is False
    assert bus.stats.outbox_dropped == 2
    assert bus.outbox_len == 3

    async with running(bus):
        received = [await inbox_get(bus) for _ in range(3)]
        assert await bus.flush(WAIT_S)
    assert [m.payload for m in received] == [b"2", b"3", b"4"]
    assert bus.stats.published == 3


async def test_inbox_overflow_drops_oldest(mosquitto: MosquittoProcess) -> None:
    """A full inbox drops its oldest messages and counts them."""
    bus = MqttBus(
        fast_settings(mosquitto.port, inbox_size=2),
        client_id="node-1",
        subscriptions=[("polca/test/cmd/#", 1)],
    )
    async with running(bus), observer(mosquitto.port) as obs:
        for index in range(5):
            await obs.publish(f"polca/test/cmd/{index}", b"%d" % index, qos=1)
        await wait_until(lambda: bus.stats.inbox_dropped == 3, "three messages dropped")
        kept = [await inbox_get(bus), await inbox_get(bus)]
    assert [m.payload for m in kept] == [b"3", b"4"]
    assert bus.inbox.empty()


async def test_wrong_password_is_fatal(mosquitto_factory: MosquittoFactory) -> None:
    """A refused password raises TransportAuthError instead of retrying forever."""
    broker = mosquitto_factory(users={"node-1": "right"})
    settings = fast_settings(broker.port, username="node-1", password=SecretStr("wrong"))
    bus = MqttBus(settings, client_id="node-1")
    with pytest.raises(TransportAuthError, match="refused user node-1"):
        await asyncio.wait_for(bus.run(), WAIT_S)
    assert bus.stats.connects == 0

    good = MqttBus(settings.model_copy(update={"password": SecretStr("right")}), client_id="n")
    async with running(good):
        assert good.stats.connects == 1


async def test_anonymous_refused_is_fatal(mosquitto_factory: MosquittoFactory) -> None:
    """A broker without anonymous access refuses a bus without credentials, fatally."""
    broker = mosquitto_factory(users={"node-1": "right"})
    bus = MqttBus(fast_settings(broker.port), client_id="node-1")
    with pytest.raises(TransportAuthError, match=r"\(anonymous\)"):
        await asyncio.wait_for(bus.run(), WAIT_S)


async def test_unreadable_tls_files_are_fatal(tmp_path: Path) -> None:
    """TLS settings naming a missing CA file raise ConfigError before any connection."""
    settings = fast_settings(free_port(), tls=True, tls_ca_file=tmp_path / "missing.pem")
    bus = MqttBus(settings, client_id="node-1")
    with pytest.raises(ConfigError, match=r"missing\.pem"):
        await asyncio.wait_for(bus.run(), WAIT_S)


async def test_close_sends_final_messages_not_the_will(mosquitto: MosquittoProcess) -> None:
    """close() publishes the final messages, disconnects cleanly and lets run() return."""
    status = "polca/test/status"
    bus = MqttBus(
        fast_settings(mosquitto.port),
        client_id="node-1",
        will=OutMessage(status, b"died", qos=1, retain=True),
        birth=lambda: [OutMessage(status, b"online", qos=1, retain=True)],
    )
    async with observer(mosquitto.port, status) as obs:
        task = asyncio.create_task(bus.run())
        assert (await next_message(obs, status)).payload == b"online"
        bus.publish_nowait(OutMessage("polca/test/telemetry", b"last sample"))
        assert await bus.close(final=[OutMessage(status, b"offline", qos=1, retain=True)])
        await asyncio.wait_for(task, WAIT_S)  # run() returns after close()
        assert (await next_message(obs, status)).payload == b"offline"
        with pytest.raises(TimeoutError):  # no will after a clean disconnect
            async with asyncio.timeout(0.3):
                await next_message(obs, status)
    assert not bus.connected.is_set()
    assert bus.stats.published == 3  # birth, the sample, offline
    assert bus.stats.disconnects == 1
    assert not no_other_tasks()


async def test_close_is_bounded_when_broker_is_down() -> None:
    """close() gives up after its timeout when the broker cannot be reached."""
    bus = MqttBus(fast_settings(free_port()), client_id="node-1")
    task = asyncio.create_task(bus.run())
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert not await bus.close(final=[OutMessage("polca/test/status", b"offline")], timeout_s=0.3)
    assert loop.time() - started < 1.0
    await asyncio.wait_for(task, WAIT_S)  # run() returns after close()
    assert bus.outbox_len == 1


async def test_flush_waits_for_the_outbox(mosquitto: MosquittoProcess) -> None:
    """flush() returns True once everything queued was handed to the broker."""
    bus = MqttBus(fast_settings(mosquitto.port), client_id="node-1")
    assert await bus.flush(0.1)  # nothing queued
    for index in range(20):
        bus.publish_nowait(OutMessage("polca/test/telemetry", b"%d" % index, qos=1))
    assert not await bus.flush(0.1)  # not running yet
    async with running(bus):
        assert await bus.flush(WAIT_S)
        assert bus.outbox_len == 0
    assert bus.stats.published == 20


async def test_cancellation_propagates_and_publishes_will(mosquitto: MosquittoProcess) -> None:
    """Cancelling run() raises CancelledError, sends the will itself and leaves no tasks."""
    status = "polca/test/status"
    bus = MqttBus(
        fast_settings(mosquitto.port),
        client_id="node-1",
        will=OutMessage(status, b"offline", qos=1, retain=True),
        subscriptions=[("polca/test/cmd", 0)],
    )
    async with observer(mosquitto.port, status) as obs:
        task = asyncio.create_task(bus.run())
        await wait_for_event(bus.connected, task)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await next_message(obs, status)).payload == b"offline"
    assert not bus.connected.is_set()
    assert not no_other_tasks()


async def test_cancellation_while_broker_is_down() -> None:
    """Cancelling run() during reconnect backoff raises CancelledError at once."""
    bus = MqttBus(fast_settings(free_port()), client_id="node-1")
    task = asyncio.create_task(bus.run())
    await wait_until(lambda: bus.stats.last_error is not None, "a failed connection attempt")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, WAIT_S)
    assert bus.stats.connects == 0
    assert not no_other_tasks()


async def test_run_twice_is_refused(mosquitto: MosquittoProcess) -> None:
    """A second concurrent run() of the same bus is a programming error."""
    bus = MqttBus(fast_settings(mosquitto.port), client_id="node-1")
    async with running(bus):
        with pytest.raises(RuntimeError, match="already running"):
            await bus.run()
