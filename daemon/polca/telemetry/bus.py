"""The MQTT transport: one small wrapper around aiomqtt 2.x, the only module importing it.

Why it exists: aiomqtt 2.x has no automatic reconnect, an unbounded receive queue and an
API that aiomqtt 3 breaks (MQTT 5 only, manual acks). Everything else in polca talks to
the ``Bus`` protocol and the value types of ``telemetry/messages.py``, so the move to
another client touches this file only.

What it does:

- ``run()`` is the eternal connect loop. Reconnection lives *outside* the client (the
  pattern of aiomqtt's ``docs/reconnection.md``): a fresh ``aiomqtt.Client`` per attempt,
  ``async with client``, then birth messages, (re)subscription, and two concurrent loops
  (outbox -> broker, broker -> inbox) until the connection breaks; then a jittered
  exponential backoff and the next attempt. A fresh client per attempt matters: a reused
  aiomqtt 2.5 client keeps its completed ``_connected`` future after an abrupt disconnect,
  and paho would re-send its own pending QoS 1 messages on top of our outbox.
- Several endpoints (``mqtt.endpoints``, the nodes of a clustered broker): each attempt
  goes to one; a lost or refused endpoint is marked failed and the next attempt goes to
  the next one that has not failed within ``endpoints.HOLD_DOWN_S`` (or, when all have,
  the one that failed longest ago), after the same jittered backoff. Those decisions
  (and the attempts of a one-shot command, and when ``move_on`` may leave a node) are
  ``endpoints.EndpointRotation``'s, pure; this module asks it and does the I/O. A clean
  session on every connection, so the new node gets the subscriptions again and sends the
  retained messages again; the birth messages are published again. ``stats.endpoint`` and the
  ``mqtt_connected`` log line say where the bus is connected, ``stats.failovers`` how
  often it moved.
- Credentials refused by the broker raise ``TransportAuthError``, a protocol version it does
  not speak raises ``ConfigError``: retrying cannot fix either.
- Publishing never blocks the control loop: ``publish_nowait`` puts into a bounded outbox
  that drops the oldest message (and counts it) when the broker is away. Messages are sent
  in order, one at a time; one that the connection loss interrupted goes back to the head of
  the outbox (at-least-once for QoS 1, so a duplicate is possible after a reconnect).
- Received messages go into a bounded inbox that also drops the oldest and counts.
- A message larger than the wire allows (``MAX_PAYLOAD_BYTES``) is never sent: a broker
  answers one over its packet limit by dropping the connection. It is dropped and counted
  as an outbox drop, and logged (``mqtt_publish_oversized``, once per 10 s).
- ``close(final=...)`` publishes the last words (the retained ``offline`` status), flushes
  and disconnects cleanly, within a bound. A clean disconnect suppresses the broker's Last
  Will, so a cancelled ``run()`` publishes the will itself before disconnecting.

What it must not do: parse payloads or build topics (``schema.py`` and ``topics.py`` do),
create tasks that outlive ``run()``, or swallow ``CancelledError``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ssl
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import aiomqtt
import structlog
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.subscribeoptions import SubscribeOptions

from polca import aiokit
from polca.errors import ConfigError, TransportAuthError, TransportError
from polca.telemetry.checks import DropLog
from polca.telemetry.endpoints import EndpointRotation
from polca.telemetry.messages import BusStats, InMessage, OutMessage
from polca.telemetry.schema import MAX_PAYLOAD_BYTES

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from polca.settings import MqttEndpoint, MqttSettings

__all__ = ["MqttBus"]

# CONNACK refusals that retrying with the same settings cannot fix. MQTT 3.1.1 return codes
# 4 (bad user name or password) and 5 (not authorised); paho 2.x reports them as the MQTT 5
# reason codes 0x86 and 0x87, which MQTT 5 brokers send directly, as well as 0x8A (banned)
# and 0x8C (bad authentication method).
_AUTH_REFUSED_CODES = frozenset({4, 5, 0x86, 0x87, 0x8A, 0x8C})
# 3.1.1 return code 1 (paho reports it as 0x84): the broker does not speak our protocol
# version, e.g. amqtt refusing MQTT 5.
_PROTOCOL_REFUSED_CODES = frozenset({1, 0x84})
# Bound on each step of the goodbye (will publish, DISCONNECT) when ``run()`` is cancelled.
_FAREWELL_TIMEOUT_S = 2.0


@dataclasses.dataclass(slots=True)
class _Outgoing:
    """An outbox entry; ``sent`` resolves True when handed to the broker, False if dropped."""

    msg: OutMessage
    sent: asyncio.Future[bool] | None = None

    def resolve(self, *, sent: bool) -> None:
        if self.sent is not None and not self.sent.done():
            self.sent.set_result(sent)


class MqttBus:
    """One MQTT connection with reconnect, birth and will, a bounded outbox and inbox.

    Construction does no I/O; ``run()`` connects (inside the running loop, as aiomqtt 2.x
    requires) and keeps reconnecting until ``close()``. ``birth()`` is called on every
    connection and its messages (e.g. the retained ``online`` status) are published before
    anything else; ``will`` is registered with the broker as the Last Will.
    """

    def __init__(
        self,
        settings: MqttSettings,
        *,
        client_id: str,
        will: OutMessage | None = None,
        subscriptions: Sequence[tuple[str, int]] = (),
        birth: Callable[[], Sequence[OutMessage]] | None = None,
        logger: FilteringBoundLogger | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        mono_ns: Callable[[], int] = time.monotonic_ns,
        attempts: int | None = None,
        retain_as_published: bool = False,
    ) -> None:
        """``attempts``: connection attempts before ``run()`` gives up with a
        ``TransportError`` (one-shot commands: 1); None, the daemons': forever.

        ``retain_as_published``: under MQTT 5 (``mqtt.protocol: "5"``), subscribe with the
        option of that name, so a message its publisher sent retained arrives with
        ``retain`` set even on an established subscription (a reading published retained
        is then seen as one, live or not). MQTT 3.1.1 has no such option: there the flag
        changes nothing.
        """
        self._settings = settings
        self._retain_as_published = retain_as_published and settings.protocol == "5"
        self._clock_ns = clock_ns
        self._mono_ns = mono_ns
        self._client_id = client_id
        self._will = will
        self._subscriptions = tuple(subscriptions)
        self._subscribed: tuple[tuple[str, int], ...] = ()  # what the broker has, this session
        self._subscriptions_changed = asyncio.Event()
        self._birth = birth
        self._log: FilteringBoundLogger = (
            logger if logger is not None else structlog.get_logger(__name__)
        )
        self.connected = asyncio.Event()
        """Set while connected (after CONNACK, before birth messages are published)."""
        self.subscribed = asyncio.Event()
        """Set once connected and the broker granted the subscriptions (after SUBACK)."""

        self._outbox: collections.deque[_Outgoing] = collections.deque()
        self._outbox_ready = asyncio.Event()  # set while the outbox is not empty
        self._idle = asyncio.Event()  # set while the outbox is empty and nothing is in flight
        self._idle.set()
        self._in_flight = 0
        self._inbox: asyncio.Queue[InMessage] = asyncio.Queue(maxsize=settings.inbox_size)
        self._handler: Callable[[InMessage], None] | None = None
        self._handler_errors = 0
        self._stop = asyncio.Event()  # close() asks run() to disconnect and return
        self._stopped = asyncio.Event()  # run() has returned
        self._running = False

        self._connects = 0
        self._disconnects = 0
        self._published = 0
        self._outbox_dropped = 0
        self._inbox_dropped = 0
        self._last_error: str | None = None
        self._rotation = EndpointRotation(settings.broker_endpoints(), attempts=attempts)
        self._endpoint: MqttEndpoint | None = None  # while connected
        self._move = asyncio.Event()  # move_on() asks the session to end
        self._oversized = DropLog("mqtt_publish_oversized", logger=self._log)

    # -- consumers ------------------------------------------------------------------------

    @property
    def stats(self) -> BusStats:
        """A snapshot of the counters."""
        return BusStats(
            connects=self._connects,
            disconnects=self._disconnects,
            published=self._published,
            outbox_dropped=self._outbox_dropped,
            inbox_dropped=self._inbox_dropped,
            last_error=self._last_error,
            endpoint=str(self._endpoint) if self._endpoint is not None else None,
            failovers=self._rotation.failovers,
        )

    @property
    def inbox(self) -> asyncio.Queue[InMessage]:
        """Received messages, oldest first; bounded by ``inbox_size`` (oldest dropped)."""
        return self._inbox

    @property
    def outbox_len(self) -> int:
        """Messages waiting to be handed to the broker."""
        return len(self._outbox)

    async def get(self) -> InMessage:
        """The next received message (waits for one)."""
        return await self._inbox.get()

    def set_handler(self, handler: Callable[[InMessage], None] | None) -> None:
        """Hand each received message to ``handler`` on arrival instead of the inbox."""
        self._handler = handler

    @property
    def endpoint_count(self) -> int:
        """How many broker endpoints it can move between."""
        return self._rotation.count

    def move_on(self, reason: str) -> None:
        """Leave the endpoint in use for the next one (it is marked failed, as a lost one
        is): for a process that finds its broker node connected but silent, e.g. cut off
        from the rest of a cluster. Nothing happens with a single endpoint."""
        if self._rotation.move_on(reason, connected=self.connected.is_set()):
            self._move.set()

    def resubscribe(self, subscriptions: Sequence[tuple[str, int]]) -> None:
        """Replace the subscriptions: the connection applies the difference (unsubscribe
        what went, subscribe what came) as soon as it can, and every reconnect subscribes
        to the new list."""
        self._subscriptions = tuple(subscriptions)
        self._subscriptions_changed.set()

    def publish_nowait(self, msg: OutMessage) -> None:
        """Queue ``msg`` for the broker; when the outbox is full, drop the oldest (counted).

        Queued messages survive disconnections and are sent, in order, after a reconnect.
        """
        self._enqueue(_Outgoing(msg))

    async def publish(self, msg: OutMessage) -> bool:
        """Queue ``msg`` and wait until it is handed to the broker (True) or dropped (False).

        "Handed" means the client finished its part: written to the socket for QoS 0,
        acknowledged for QoS 1 and 2. Cancelling the wait leaves the message queued.
        """
        sent: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._enqueue(_Outgoing(msg, sent))
        return await sent

    async def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until the outbox is empty and nothing is in flight."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def close(self, *, final: Sequence[OutMessage] = (), timeout_s: float = 5.0) -> bool:
        """Publish ``final``, flush, disconnect cleanly and let ``run()`` return.

        ``final`` carries the last words (e.g. the retained ``offline`` status), so a clean
        stop does not rely on the Last Will, which the broker drops on a clean DISCONNECT.
        Takes at most about ``timeout_s``; returns whether everything queued was sent.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for msg in final:
            self.publish_nowait(msg)
        flushed = await self.flush(timeout_s)
        if not flushed:
            self._log.warning("mqtt_close_unflushed", outbox_len=len(self._outbox))
        self._stop.set()
        if self._running:
            # run() sees the stop event, leaves ``async with client`` (DISCONNECT) and returns.
            try:
                async with asyncio.timeout(max(deadline - loop.time(), 0.1)):
                    await self._stopped.wait()
            except TimeoutError:
                self._log.warning("mqtt_close_timeout", timeout_s=timeout_s)
        return flushed

    # -- the connection loop --------------------------------------------------------------

    async def run(self) -> None:
        """Connect and serve until ``close()``, reconnecting with jittered backoff.

        Returns only after ``close()``. Raises ``TransportAuthError`` when the broker refuses
        the credentials, ``ConfigError`` for unusable settings (TLS files, protocol
        version), and ``TransportError`` once ``attempts`` connection attempts failed;
        ``CancelledError`` propagates after a bounded clean disconnect.
        """
        if self._running:
            msg = "MqttBus.run() is already running"
            raise RuntimeError(msg)
        self._running = True
        self._stopped.clear()
        try:
            tls_context = await asyncio.to_thread(_tls_context, self._settings)
            delays = self._new_backoff()
            rotation = self._rotation
            rotation.begin()
            while not self._stop.is_set():
                connected = False
                index = rotation.current
                endpoint = rotation.endpoints[index]
                client = self._new_client(tls_context, endpoint)
                try:
                    async with client:
                        connected = True
                        await self._session(client, index)
                except aiomqtt.MqttError as exc:
                    # An MqttError raised while cancellation was being handled (a slow
                    # DISCONNECT) must not turn the cancellation into a reconnect.
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise asyncio.CancelledError from exc
                    _raise_if_fatal(exc, self._settings, endpoint)
                    failure = rotation.failed(index, self._mono_ns() / 1e9, connected=connected)
                    if failure.spent:  # every endpoint was tried ``attempts`` times
                        where = self._settings.where()
                        msg = f"cannot reach the MQTT broker {where}: {exc}"
                        raise TransportError(msg) from exc
                    if connected:  # the first reconnect after an outage is quick
                        delays = self._new_backoff()
                    self._last_error = str(exc)
                    delay_s = next(delays)
                    # A one-shot command says why it failed in one line at the end.
                    (self._log.warning if rotation.attempts is None else self._log.debug)(
                        "mqtt_disconnected",
                        error=str(exc),
                        was_connected=connected,
                        retry_in_s=round(delay_s, 3),
                        endpoint=str(endpoint),
                        next_endpoint=str(rotation.endpoints[failure.next_index]),
                    )
                    await self._sleep_unless_stopped(delay_s)
                else:
                    # Clean end of a session: close() asked for it.
                    self._log.info("mqtt_closed", endpoint=str(endpoint))
                finally:
                    await _reap(client)
        finally:
            self.connected.clear()
            self.subscribed.clear()
            self._running = False
            self._stopped.set()

    def _new_backoff(self) -> Iterator[float]:
        return aiokit.backoff_delays(self._settings.reconnect_min_s, self._settings.reconnect_max_s)

    def _new_client(
        self, tls_context: ssl.SSLContext | None, endpoint: MqttEndpoint
    ) -> aiomqtt.Client:
        settings = self._settings
        will = self._will
        return aiomqtt.Client(
            endpoint.host,
            endpoint.port,
            username=settings.username,
            password=(
                settings.password.get_secret_value() if settings.password is not None else None
            ),
            identifier=self._client_id,
            protocol=(
                aiomqtt.ProtocolVersion.V5
                if settings.protocol == "5"
                else aiomqtt.ProtocolVersion.V311
            ),
            will=(
                aiomqtt.Will(will.topic, will.payload, will.qos, will.retain)
                if will is not None
                else None
            ),
            keepalive=settings.keepalive_s,
            # The CONNACK wait; every later operation waits connect_timeout_s (_session).
            timeout=settings.connack_timeout_s,
            tls_context=tls_context,
            queue_type=_forwarding_queue(self._take),
        )

    async def _session(self, client: aiomqtt.Client, index: int) -> None:
        """One connection: birth, subscribe, then pump both ways until it breaks or stops."""
        client.timeout = self._settings.connect_timeout_s  # publish, subscribe, DISCONNECT
        self._connects += 1
        failover = self._rotation.connected(index)
        self._endpoint = self._rotation.endpoints[index]
        self.connected.set()
        self._log.info(
            "mqtt_connected",
            endpoint=str(self._endpoint),
            failover=failover,
            client_id=self._client_id,
            protocol=self._settings.protocol,
        )
        try:
            _raise_if_cancelling()
            await self._pump(client)
        except asyncio.CancelledError:
            await self._farewell(client)
            raise
        finally:
            self.connected.clear()
            self.subscribed.clear()
            self._endpoint = None
            self._disconnects += 1

    async def _pump(self, client: aiomqtt.Client) -> None:
        """Run outbound (birth, subscribe, outbox) and inbound (inbox) side by side.

        Ends when either fails or ``close()`` is called. The inbound loop is the one that
        notices a lost connection at once (aiomqtt fails its message iterator); a pending
        publish or subscribe would only time out, after ``connect_timeout_s``.
        """
        self._move.clear()
        outbound = asyncio.create_task(self._outbound(client), name="mqtt-outbound")
        receive = asyncio.create_task(self._receive(client), name="mqtt-inbound")
        stop = asyncio.create_task(self._stop.wait(), name="mqtt-stop")
        move = asyncio.create_task(self._move.wait(), name="mqtt-move")
        tasks = (outbound, receive, stop, move)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Whatever ended the wait (an error, close(), our own cancellation), the other
            # loops must not outlive this connection.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in (outbound, receive):
            if task in done and not task.cancelled() and (exc := task.exception()) is not None:
                raise exc
        if move in done and not self._stop.is_set():
            msg = f"moving on: {self._rotation.move_reason}"
            raise aiomqtt.MqttError(msg)

    async def _outbound(self, client: aiomqtt.Client) -> None:
        """Birth messages first, then (re)subscribe, then the outbox for good."""
        for msg in self._birth() if self._birth is not None else ():
            await client.publish(msg.topic, msg.payload, qos=msg.qos, retain=msg.retain)
            self._published += 1
            _raise_if_cancelling()
        self._subscribed = ()
        if self._subscriptions:
            subscriptions = self._subscriptions
            self._subscriptions_changed.clear()
            granted = self._granted(subscriptions)
            self._note_refused(granted, await client.subscribe(self._with_options(granted)))
            self._subscribed = subscriptions
            _raise_if_cancelling()
        self.subscribed.set()
        # The outbox, and the subscriptions ``resubscribe`` changes, side by side; either
        # failing ends both (and the session) with its own error, as ``run()`` expects
        # (an ``MqttError`` means reconnect), not wrapped in a group.
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._drain(client), name="mqtt-outbox")
                group.create_task(self._follow_subscriptions(client), name="mqtt-subscriptions")
        except* Exception as failed:
            raise failed.exceptions[0]  # noqa: B904 - the first failure is the session's

    async def _follow_subscriptions(self, client: aiomqtt.Client) -> None:
        """Apply ``resubscribe`` to the live connection: unsubscribe, then subscribe."""
        while True:
            await self._subscriptions_changed.wait()
            self._subscriptions_changed.clear()
            wanted = self._subscriptions
            kept = {topic for topic, _ in wanted}
            gone = [topic for topic, _ in self._subscribed if topic not in kept]
            new = [sub for sub in wanted if sub not in self._subscribed]
            if gone:
                await client.unsubscribe(gone)
            if new:
                granted = self._granted(new)
                self._note_refused(granted, await client.subscribe(self._with_options(granted)))
            self._subscribed = wanted
            _raise_if_cancelling()

    def _note_refused(self, asked: Sequence[tuple[str, int]], result: object) -> None:
        """Log each subscription the broker refused (SUBACK 0x80 or above): its messages
        will never come, e.g. a filter wider than the user's permissions on NATS, which
        refuses it where Mosquitto accepts it and filters each message."""
        codes = list(result) if isinstance(result, (list, tuple)) else []
        for (topic, _), code in zip(asked, codes, strict=False):
            value = code if isinstance(code, int) else getattr(code, "value", 0)
            if isinstance(value, int) and value >= 0x80:
                self._log.warning("mqtt_subscription_refused", topic=topic, code=value)

    def _with_options(
        self, subscriptions: list[tuple[str, int]]
    ) -> list[tuple[str, int]] | list[tuple[str, SubscribeOptions]]:
        """The SUBSCRIBE's filters: with MQTT 5 options where ``retain_as_published``."""
        if not self._retain_as_published:
            return subscriptions
        return [
            (topic, SubscribeOptions(qos=qos, retainAsPublished=True))
            for topic, qos in subscriptions
        ]

    def _granted(self, subscriptions: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """The subscriptions at their QoS, capped by ``mqtt.subscription_qos_max``."""
        cap = self._settings.subscription_qos_cap()
        return [(topic, min(qos, cap)) for topic, qos in subscriptions]

    async def _drain(self, client: aiomqtt.Client) -> None:
        """Send the outbox in order, one message at a time."""
        while True:
            await self._outbox_ready.wait()
            if not self._outbox:
                self._outbox_ready.clear()
                continue
            item = self._outbox.popleft()
            if not self._outbox:
                self._outbox_ready.clear()
            self._in_flight += 1
            try:
                await client.publish(
                    item.msg.topic, item.msg.payload, qos=item.msg.qos, retain=item.msg.retain
                )
            except BaseException:
                # The connection broke (or the session ends) before the broker had it:
                # back to the head of the queue, sent first after the reconnect.
                self._requeue(item)
                raise
            finally:
                self._in_flight -= 1
                self._update_idle()
            self._published += 1
            item.resolve(sent=True)
            _raise_if_cancelling()

    async def _receive(self, client: aiomqtt.Client) -> None:
        """Wait for the connection to end (MqttError); messages arrive by ``_take``.

        The client's queue forwards every message to ``_take`` as paho hands it over (see
        ``_new_client``), so no message waits in a second queue or costs a task of its own;
        the iterator here only waits for the disconnection, which it raises.
        """
        async for _ in client.messages:
            pass  # never: the forwarding queue keeps nothing

    def _take(self, message: aiomqtt.Message) -> None:
        """One message from the client, stamped on arrival, into the bounded inbox."""
        self._deliver(
            InMessage(
                topic=message.topic.value,
                payload=message.payload,  # received payloads are bytes (paho's own)
                retain=bool(message.retain),
                received_ns=self._clock_ns(),
                received_mono_ns=self._mono_ns(),
                qos=int(message.qos),
            )
        )

    async def _farewell(self, client: aiomqtt.Client) -> None:
        """On cancellation: publish the will ourselves, since DISCONNECT suppresses it."""
        # aiomqtt bounds its DISCONNECT wait (in __aexit__) by the client timeout.
        client.timeout = min(client.timeout, _FAREWELL_TIMEOUT_S)
        if self._will is None or self._stop.is_set():
            return
        will = self._will
        try:
            await client.publish(
                will.topic,
                will.payload,
                qos=will.qos,
                retain=will.retain,
                timeout=_FAREWELL_TIMEOUT_S,
            )
            self._published += 1
        except aiomqtt.MqttError as exc:
            self._log.warning("mqtt_farewell_failed", error=str(exc))

    async def _sleep_unless_stopped(self, delay_s: float) -> None:
        try:
            async with asyncio.timeout(delay_s):
                await self._stop.wait()
        except TimeoutError:
            pass

    # -- queues ---------------------------------------------------------------------------

    def _enqueue(self, item: _Outgoing) -> None:
        if len(item.msg.payload) > MAX_PAYLOAD_BYTES:
            # A broker refuses a packet over its limit by dropping the connection (the
            # shipped Mosquitto's max_packet_size fits MAX_PAYLOAD_BYTES): never send one.
            self._oversized.drop(
                "oversized", topic=item.msg.topic, detail=str(len(item.msg.payload))
            )
            self._drop_outgoing(item)
            return
        if len(self._outbox) >= self._settings.outbox_size:
            self._drop_outgoing(self._outbox.popleft())
        self._outbox.append(item)
        self._outbox_ready.set()
        self._idle.clear()

    def _requeue(self, item: _Outgoing) -> None:
        if len(self._outbox) >= self._settings.outbox_size:
            # Filled up while the message was in flight, and it is the oldest of all.
            self._drop_outgoing(item)
        else:
            self._outbox.appendleft(item)
            self._outbox_ready.set()

    def _drop_outgoing(self, item: _Outgoing) -> None:
        self._outbox_dropped += 1
        item.resolve(sent=False)
        self._log.debug(
            "mqtt_outbox_dropped", topic=item.msg.topic, outbox_dropped=self._outbox_dropped
        )

    def _update_idle(self) -> None:
        if not self._outbox and self._in_flight == 0:
            self._idle.set()
        else:
            self._idle.clear()

    def _deliver(self, message: InMessage) -> None:
        handler = self._handler
        if handler is not None:
            try:
                handler(message)
            except Exception:  # the handler must not raise; if it does, the bus stays up
                self._handler_errors += 1
                self._log.exception("mqtt_handler_failed", topic=message.topic[:200])
            return
        if self._inbox.full():
            self._inbox.get_nowait()
            self._inbox_dropped += 1
            self._log.debug(
                "mqtt_inbox_dropped", topic=message.topic, inbox_dropped=self._inbox_dropped
            )
        self._inbox.put_nowait(message)


def _forwarding_queue(
    take: Callable[[aiomqtt.Message], None],
) -> type[asyncio.Queue[aiomqtt.Message]]:
    """A queue class for aiomqtt whose ``put_nowait`` hands each message to ``take``.

    aiomqtt's documented ``queue_type`` seam: received messages go straight into the bus's
    bounded inbox instead of waiting in the client's queue for an iterator that spends a
    task and an ``asyncio.wait`` on each one.
    """

    class _Forward(asyncio.Queue[aiomqtt.Message]):
        def put_nowait(self, item: aiomqtt.Message) -> None:
            take(item)

    return _Forward


def _raise_if_cancelling() -> None:
    """Re-raise a cancellation that ``asyncio.wait_for`` swallowed.

    aiomqtt 2.5 waits for every acknowledgement with ``asyncio.wait_for``; on Python 3.11,
    when the acknowledgement and a ``cancel()`` arrive in the same loop iteration, wait_for
    returns the result and drops the cancellation (CPython gh-86296, fixed in 3.12). The
    task then keeps running with ``cancelling()`` set, and ``run()`` would never end. Called
    after each aiomqtt call on the normal path (never while handling a cancellation).
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def _reap(client: aiomqtt.Client) -> None:
    """Wait (bounded) for the client's keepalive task, so no task outlives the connection.

    aiomqtt 2.5 cancels its ``_misc_task`` with ``call_soon_threadsafe`` when the socket
    closes, so the task is still pending for a loop iteration or two after ``__aexit__``.
    """
    task = getattr(client, "_misc_task", None)
    if isinstance(task, asyncio.Task) and not task.done():
        await asyncio.wait({task}, timeout=_FAREWELL_TIMEOUT_S)


def _raise_if_fatal(exc: aiomqtt.MqttError, settings: MqttSettings, endpoint: MqttEndpoint) -> None:
    """Translate CONNACK refusals that retrying cannot fix into fatal polca errors (every
    node of a cluster shares its users and protocol, so another endpoint cannot fix them
    either)."""
    if not isinstance(exc, MqttConnectError):
        return
    rc = exc.rc
    code = rc if isinstance(rc, int) else getattr(rc, "value", None)
    where = str(endpoint)
    if code in _AUTH_REFUSED_CODES:
        user = settings.username or "(anonymous)"
        msg = (
            f"MQTT broker {where} refused user {user}: {exc}; check mqtt.username and the "
            "password (POLCA_MQTT__PASSWORD, mqtt.password_file or the mqtt_password "
            "credential) and the broker's ACL"
        )
        raise TransportAuthError(msg) from exc
    if code in _PROTOCOL_REFUSED_CODES:
        msg = (
            f"MQTT broker {where} does not speak MQTT {settings.protocol}: {exc}; set "
            "mqtt.protocol to the version it supports (3.1.1 works everywhere)"
        )
        raise ConfigError(msg) from exc


class _ClosingSSLSocket(ssl.SSLSocket):
    """Closes itself when the handshake fails: paho-mqtt 2.2 leaks the socket otherwise."""

    def do_handshake(self, block: bool = False) -> None:
        try:
            super().do_handshake(block)
        except BaseException:
            self.close()
            raise


def _tls_context(settings: MqttSettings) -> ssl.SSLContext | None:
    """The TLS context from the ``tls_*`` settings (reads files: call off the loop)."""
    if not settings.tls:
        return None
    try:
        context = ssl.create_default_context(
            cafile=str(settings.tls_ca_file) if settings.tls_ca_file is not None else None
        )
        if settings.tls_cert_file is not None:
            context.load_cert_chain(
                settings.tls_cert_file,
                settings.tls_key_file,
            )
    except (OSError, ssl.SSLError) as exc:
        msg = (
            f"cannot load MQTT TLS files (ca {settings.tls_ca_file}, cert "
            f"{settings.tls_cert_file}, key {settings.tls_key_file}): {exc}"
        )
        raise ConfigError(msg) from exc
    if settings.tls_insecure:
        context.check_hostname = False
    context.sslsocket_class = _ClosingSSLSocket
    return context
