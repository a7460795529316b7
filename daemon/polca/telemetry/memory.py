"""An in-process broker and bus: a whole row (aggregator, agents, CDUs) in one process.

``MemoryBroker`` keeps subscriptions and retained messages and delivers every publish at
once, in order, to every matching subscriber; ``MemoryBroker.bus`` makes a ``MemoryBus``
with the signature of ``MqttBus`` (a ``BusFactory``), so a daemon runs on it unchanged.
What MQTT guarantees and polca relies on holds here too:

- a retained message is delivered to a new subscription with ``retain`` set, and to an
  established one without (MQTT 3.1.1 §3.3.1.3); an empty retained payload clears it;
- the Last Will is published when a bus goes away without a clean ``close()``
  (``MemoryBus.drop()`` stands for a lost connection), never after a clean one;
- each subscriber's inbox is bounded and drops its oldest message when full, counted.

Delivery is synchronous inside ``publish_nowait`` (no task, no network), so a test that
drives the daemons' loop bodies by hand is deterministic. Receipt times come from the
receiving bus's injected clocks. What it must not do: parse payloads or build topics.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence

from polca.settings import MqttSettings
from polca.telemetry.messages import BusStats, InMessage, OutMessage, topic_matches

__all__ = ["MemoryBroker", "MemoryBus"]


class MemoryBroker:
    """Subscriptions, retained messages and delivery for ``MemoryBus`` clients."""

    def __init__(self) -> None:
        """An empty broker."""
        self.retained: dict[str, OutMessage] = {}
        self._clients: list[MemoryBus] = []
        self.published: list[OutMessage] = []  # everything, in order (for tests to read)

    def bus(
        self,
        settings: MqttSettings,
        *,
        client_id: str,
        will: OutMessage | None = None,
        subscriptions: Sequence[tuple[str, int]] = (),
        birth: Callable[[], Sequence[OutMessage]] | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        mono_ns: Callable[[], int] = time.monotonic_ns,
        retain_as_published: bool = False,
    ) -> MemoryBus:
        """A bus for one client on this broker (a ``BusFactory``); ``retain_as_published``
        as ``MqttBus`` has it (MQTT 5 only)."""
        bus = MemoryBus(
            self,
            client_id=client_id,
            will=will,
            subscriptions=subscriptions,
            birth=birth,
            inbox_size=settings.inbox_size,
            clock_ns=clock_ns,
            mono_ns=mono_ns,
        )
        bus.retain_as_published = retain_as_published and settings.protocol == "5"
        return bus

    def publish(self, msg: OutMessage) -> None:
        """Keep ``msg`` if retained, and deliver it to every matching connected client."""
        self.published.append(msg)
        if msg.retain:
            if msg.payload:
                self.retained[msg.topic] = msg
            else:
                self.retained.pop(msg.topic, None)
        for client in self._clients:
            if client.subscribed_to(msg.topic):
                client.deliver(msg, retain=msg.retain and client.retain_as_published)

    def connect(self, client: MemoryBus) -> None:
        """Connect ``client``: birth messages, then the retained messages it subscribes to."""
        if client in self._clients:
            return
        self._clients.append(client)
        for msg in client.birth_messages():
            self.publish(msg)
        self.subscribed(client, client.filters)

    def subscribed(self, client: MemoryBus, filters: Sequence[str]) -> None:
        """``client`` subscribed to ``filters`` while connected: their retained messages."""
        for topic, msg in list(self.retained.items()):
            if any(topic_matches(f, topic) for f in filters):
                client.deliver(msg, retain=True)

    def disconnect(self, client: MemoryBus, *, clean: bool) -> None:
        """Disconnect ``client``; an unclean end publishes its Last Will."""
        if client not in self._clients:
            return
        self._clients.remove(client)
        if not clean and client.will is not None:
            self.publish(client.will)


class MemoryBus:
    """One client of a ``MemoryBroker``: the ``Bus`` protocol without a network."""

    def __init__(
        self,
        broker: MemoryBroker,
        *,
        client_id: str,
        will: OutMessage | None = None,
        subscriptions: Sequence[tuple[str, int]] = (),
        birth: Callable[[], Sequence[OutMessage]] | None = None,
        inbox_size: int = 1000,
        clock_ns: Callable[[], int] = time.time_ns,
        mono_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        """A client of ``broker``; nothing happens until ``connect()`` or ``run()``."""
        self.broker = broker
        self.client_id = client_id
        self.will = will
        self.filters = tuple(topic for topic, _ in subscriptions)
        self.retain_as_published = False
        """MQTT 5's subscription option: a live message keeps its publisher's retain flag."""
        self._birth = birth
        self._clock_ns = clock_ns
        self._mono_ns = mono_ns
        self.inbox: deque[InMessage] = deque()
        self._handler: Callable[[InMessage], None] | None = None
        self._inbox_size = inbox_size
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self.connected = asyncio.Event()
        self.subscribed = self.connected  # one broker in memory: subscribed on connecting
        self._published = 0
        self._inbox_dropped = 0
        self._connects = 0

    # -- the Bus protocol -----------------------------------------------------------------

    @property
    def stats(self) -> BusStats:
        """A snapshot of the counters."""
        return BusStats(
            connects=self._connects,
            published=self._published,
            inbox_dropped=self._inbox_dropped,
        )

    async def run(self) -> None:
        """Connect and stay connected until ``close()`` (or ``drop()``)."""
        self.connect()
        await self._stop.wait()

    def set_handler(self, handler: Callable[[InMessage], None] | None) -> None:
        """Hand each received message to ``handler`` on arrival instead of the inbox."""
        self._handler = handler

    async def get(self) -> InMessage:
        """The next received message (waits for one)."""
        while not self.inbox:
            self._ready.clear()
            await self._ready.wait()
        return self.inbox.popleft()

    def publish_nowait(self, msg: OutMessage) -> None:
        """Deliver ``msg`` through the broker now; dropped while disconnected, as a lost
        connection's outbox would be after it overflowed."""
        if not self.connected.is_set():
            return
        self._published += 1
        self.broker.publish(msg)

    async def close(self, *, final: Sequence[OutMessage] = (), timeout_s: float = 5.0) -> bool:
        """Publish ``final``, disconnect cleanly (no Last Will), end ``run()``."""
        for msg in final:
            self.publish_nowait(msg)
        self.broker.disconnect(self, clean=True)
        self.connected.clear()
        self._stop.set()
        return True

    # -- driving it by hand -----------------------------------------------------------------

    def connect(self) -> None:
        """Connect now (what ``run()`` does first); for tests that drive loop bodies."""
        if self.connected.is_set():
            return
        self._connects += 1
        self.connected.set()
        self.broker.connect(self)

    def drop(self) -> None:
        """Lose the connection without a goodbye: the broker publishes the Last Will."""
        self.broker.disconnect(self, clean=False)
        self.connected.clear()
        self._stop.set()

    @property
    def endpoint_count(self) -> int:
        """One broker."""
        return 1

    def move_on(self, reason: str) -> None:
        """One broker: nowhere to move."""

    def resubscribe(self, subscriptions: Sequence[tuple[str, int]]) -> None:
        """Replace the subscriptions; a new filter gets its retained messages at once."""
        added = [topic for topic, _ in subscriptions if topic not in self.filters]
        self.filters = tuple(topic for topic, _ in subscriptions)
        if self.connected.is_set():
            self.broker.subscribed(self, added)

    def drain(self) -> list[InMessage]:
        """Every message received so far, oldest first, taken out of the inbox."""
        messages = list(self.inbox)
        self.inbox.clear()
        return messages

    # -- called by the broker -----------------------------------------------------------------

    def birth_messages(self) -> Sequence[OutMessage]:
        """What this client publishes on every connection."""
        return self._birth() if self._birth is not None else ()

    def subscribed_to(self, topic: str) -> bool:
        """Whether a subscription of this client matches ``topic``."""
        return any(topic_matches(f, topic) for f in self.filters)

    def deliver(self, msg: OutMessage, *, retain: bool) -> None:
        """Put one message into the bounded inbox (or to the handler), stamped by this
        client's clocks."""
        message = InMessage(msg.topic, msg.payload, retain, self._clock_ns(), self._mono_ns())
        if self._handler is not None:
            self._handler(message)
            return
        if len(self.inbox) >= self._inbox_size:
            self.inbox.popleft()
            self._inbox_dropped += 1
        self.inbox.append(message)
        self._ready.set()
