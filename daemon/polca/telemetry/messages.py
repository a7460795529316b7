"""What every bus carries and offers: the message types, the ``Bus`` protocol, topic filters.

``telemetry/bus.py`` ``MqttBus`` (the MQTT client) and ``telemetry/memory.py`` ``MemoryBus``
(in-process, for tests and the simulator) both implement ``Bus``; the daemons, the sources and
the tools only know this module's types, so none of them depends on the MQTT client library.

What it must not do: any I/O, or import an MQTT library.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from polca.settings import MqttSettings

__all__ = ["Bus", "BusFactory", "BusStats", "InMessage", "OutMessage", "topic_matches"]


@dataclasses.dataclass(frozen=True, slots=True)
class OutMessage:
    """A message to publish."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False

    def __post_init__(self) -> None:
        """Reject QoS values MQTT does not have and topics with wildcards."""
        if self.qos not in (0, 1, 2):
            msg = f"MQTT QoS must be 0, 1 or 2, not {self.qos} (topic {self.topic!r})"
            raise ValueError(msg)
        if not self.topic or "+" in self.topic or "#" in self.topic:
            msg = f"cannot publish to {self.topic!r}: empty or contains a wildcard"
            raise ValueError(msg)


@dataclasses.dataclass(frozen=True, slots=True)
class InMessage:
    """A received message, stamped on arrival by the receiver's clocks.

    ``received_ns`` is the wall clock (Unix ns, for ordering and display), and
    ``received_mono_ns`` the monotonic clock (for leases and durations). ``retain`` is set
    for a retained message delivered because of a new subscription (MQTT clears it on
    delivery to an established one), so it marks messages of unknown age; on a bus made
    with ``retain_as_published`` under MQTT 5, also for every message its publisher sent
    retained.
    """

    topic: str
    payload: bytes
    retain: bool
    received_ns: int
    received_mono_ns: int = 0
    qos: int = 0
    """The QoS it was delivered at: the lower of the publisher's and the subscription's."""


@dataclasses.dataclass(frozen=True, slots=True)
class BusStats:
    """Counters since the bus was created (a snapshot; the bus keeps counting)."""

    connects: int = 0
    disconnects: int = 0
    published: int = 0
    outbox_dropped: int = 0
    inbox_dropped: int = 0
    last_error: str | None = None
    endpoint: str | None = None
    """The broker endpoint (``host:port``) while connected; None between connections."""
    failovers: int = 0
    """Connections made to another endpoint than the one before."""


class Bus(Protocol):
    """What a daemon needs of its message bus; ``MqttBus`` and ``telemetry.memory.MemoryBus``.

    ``run()`` keeps the connection up until ``close()``; ``connected`` is set while it is,
    ``subscribed`` once the broker has also granted its subscriptions (from then on, what
    is published flows in again), both until it breaks; ``publish_nowait`` never blocks
    the caller; ``get`` waits for the next received message; ``close`` sends the last
    words and ends ``run()``.
    """

    connected: asyncio.Event
    subscribed: asyncio.Event

    @property
    def stats(self) -> BusStats:
        """A snapshot of the counters."""
        ...

    async def run(self) -> None:
        """Stay connected until ``close()``."""
        ...

    async def get(self) -> InMessage:
        """The next received message."""
        ...

    def set_handler(self, handler: Callable[[InMessage], None] | None) -> None:
        """Hand each received message to ``handler`` on arrival instead of the inbox.

        For a consumer that handles one message at a time and never raises (the
        aggregator's intake): no queue, no task switch per message. None: the inbox again.
        """
        ...

    def publish_nowait(self, msg: OutMessage) -> None:
        """Queue ``msg`` without waiting."""
        ...

    def resubscribe(self, subscriptions: Sequence[tuple[str, int]]) -> None:
        """Replace the subscriptions (applied now when connected, and on every reconnect);
        never blocks the caller."""
        ...

    @property
    def endpoint_count(self) -> int:
        """How many broker endpoints it may connect to."""
        ...

    def move_on(self, reason: str) -> None:
        """Leave the broker endpoint in use for the next one (none: nothing happens)."""
        ...

    async def close(self, *, final: Sequence[OutMessage] = (), timeout_s: float = 5.0) -> bool:
        """Publish ``final``, flush, disconnect, let ``run()`` return; whether all was sent."""
        ...


class BusFactory(Protocol):
    """Makes a daemon's bus; ``MqttBus`` itself, or ``MemoryBroker.bus``."""

    def __call__(
        self,
        settings: MqttSettings,
        *,
        client_id: str,
        will: OutMessage | None = None,
        subscriptions: Sequence[tuple[str, int]] = (),
        birth: Callable[[], Sequence[OutMessage]] | None = None,
        clock_ns: Callable[[], int] = ...,
        mono_ns: Callable[[], int] = ...,
        retain_as_published: bool = False,
    ) -> Bus:
        """A bus for one client (no I/O until ``run()``)."""
        ...


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Whether ``topic`` matches the subscription filter ``topic_filter`` (``+`` and ``#``).

    Follows MQTT 3.1.1 §4.7: ``a/#`` also matches ``a``; a filter starting with a wildcard
    does not match topics starting with ``$`` (``$SYS/...``).
    """
    filter_levels = topic_filter.split("/")
    topic_levels = topic.split("/")
    if topic.startswith("$") and filter_levels[0] in ("+", "#"):
        return False
    for index, level in enumerate(filter_levels):
        if level == "#":
            return True
        if index >= len(topic_levels):
            return False
        if level not in ("+", topic_levels[index]):
            return False
    return len(filter_levels) == len(topic_levels)
