"""Publish CDU telemetry to MQTT: from the simulated plant or from a Modbus/Redfish poller.

Two small eternal loops, meant to run under ``aiokit.guard`` in a supervisor's TaskGroup:
``run_plant`` (a ``SimulatedCdu``, its heat input taken from the racks' power each tick)
and ``run_poller`` (any ``CduPoller``: ``ModbusCduPoller``, ``RedfishCduPoller``). Both
publish one ``CduTelemetry`` per ``interval_s`` to ``Topics.cdu(site, cdu)`` at QoS 0,
not retained, as a CDU publishing to MQTT itself would; ticks are scheduled on
``loop.time()`` and a late tick is skipped, not bunched. While the plant's telemetry-loss
fault is on, or the poller cannot reach the CDU, nothing is published: the aggregator
sees the CDU go silent, as it would.

``RackPowerTracker`` turns the agents' node telemetry into rack power, the plant's heat
input when it runs next to a live row (``polca cdu simulate --rack``). Every received
message is hostile until validated: ``feed`` takes one message at a time inside its own
guard, and a message it cannot use (not node telemetry, retained, malformed, naming
another node than its topic, one node too many) is counted by reason, logged at most once
per ``DropLog.every_s`` per reason, and dropped; an unexpected exception is counted as
``internal`` and logged with its traceback. Nothing but cancellation ends the listener,
and a failing poll other than a ``FatalError`` (``ConfigError``, rejected credentials)
does not end the poller either.

What this module must not do: model physics, decode registers, or own the MQTT connection
(it is handed a bus).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, Protocol

import structlog

from polca import aiokit
from polca.errors import FatalError, TransportError
from polca.telemetry.checks import DropLog
from polca.telemetry.messages import InMessage, OutMessage
from polca.telemetry.schema import SchemaError, Telemetry, decode, encode
from polca.telemetry.topics import Topics

if TYPE_CHECKING:
    from polca.plant.cdu import SimulatedCdu
    from polca.service import Publisher
    from polca.telemetry.schema import CduTelemetry

__all__ = [
    "CduPoller",
    "RackPowerTracker",
    "publish_plant_once",
    "publish_poll_once",
    "run_plant",
    "run_poller",
    "track_rack_power",
]

log = structlog.get_logger(__name__)


class Subscriber(Protocol):
    """Where node telemetry comes from: ``MqttBus`` subscribed to the node channels."""

    async def get(self) -> InMessage:
        """The next received message."""
        ...


class CduPollerConfig(Protocol):
    """What ``run_poller`` needs of a poller's configuration: the CDU's name."""

    @property
    def cdu(self) -> str:
        """The CDU's name (topic segment)."""
        ...


class CduPoller(Protocol):
    """A CDU read on demand over some protocol (``ModbusCduPoller``, ``RedfishCduPoller``).

    ``poll`` raises ``TransportError`` while the CDU cannot be read (the poller backs off
    and logs the outage once) and a ``FatalError`` when retrying cannot help; ``close``
    may be a coroutine function (``run_poller`` awaits it then).
    """

    @property
    def config(self) -> CduPollerConfig:
        """The poller's configuration (``cdu``; Modbus adds ``host`` and ``port``)."""
        ...

    async def poll(self) -> CduTelemetry:
        """Read the CDU once."""
        ...

    def close(self) -> Awaitable[None] | None:
        """Close the connection (idempotent); the next poll reconnects."""
        ...


async def close_poller(poller: CduPoller, *, timeout_s: float = 5.0) -> None:
    """Close ``poller``, awaiting (for at most ``timeout_s``) when its ``close`` is async."""
    closing = poller.close()
    if inspect.isawaitable(closing):
        try:
            async with asyncio.timeout(timeout_s):
                await closing
        except TimeoutError:
            log.warning("cdu_poller_close_timed_out", cdu=poller.config.cdu, timeout_s=timeout_s)


def _poller_fields(poller: CduPoller) -> dict[str, object]:
    """Where the poller reads from, for its start line: Modbus host/port, or ``where``."""
    config = poller.config
    fields: dict[str, object] = {"cdu": config.cdu}
    for key in ("host", "port"):
        value = getattr(config, key, None)
        if value is not None:
            fields[key] = value
    blocks = getattr(poller, "blocks", None)
    if isinstance(blocks, tuple):
        fields["requests_per_poll"] = len(blocks)
    where = getattr(poller, "where", None)
    if isinstance(where, str):
        fields["where"] = where
    return fields


def _cdu_message(topics: Topics, site: str, telemetry: CduTelemetry) -> OutMessage:
    return OutMessage(topics.cdu(site, telemetry.cdu), encode(telemetry), qos=0)


def publish_plant_once(
    bus: Publisher,
    plant: SimulatedCdu,
    *,
    site: str,
    topics: Topics | None = None,
    rack_power_w: Callable[[], Mapping[str, float]] | None = None,
) -> CduTelemetry | None:
    """One plant tick: update the heat input, read the CDU, publish; the message or None.

    None while the telemetry-loss fault is on (the plant still advances).
    """
    if rack_power_w is not None:
        plant.set_rack_power_w(rack_power_w())
    telemetry = plant.reading()
    if telemetry is not None:
        bus.publish_nowait(_cdu_message(topics or Topics(), site, telemetry))
    return telemetry


async def publish_poll_once(
    bus: Publisher,
    poller: CduPoller,
    *,
    site: str,
    topics: Topics | None = None,
    failures: DropLog | None = None,
) -> CduTelemetry | None:
    """One poll, published; None when the CDU is unreachable (the poller logs it).

    A ``FatalError`` (``ConfigError``: the device rejects the map or has no such CDU;
    rejected credentials) propagates: retrying cannot fix it. Any other exception (a bug:
    decoding is total) is counted and logged through ``failures`` as ``internal``, and
    the poll yields nothing.
    """
    try:
        telemetry = await poller.poll()
    except FatalError:  # before TransportError: TransportAuthError is both
        raise
    except TransportError:
        return None
    except Exception as exc:  # one bad poll must not end the poller
        drops = failures if failures is not None else DropLog("cdu_poll_failed")
        drops.drop("internal", exc=exc, cdu=poller.config.cdu)
        return None
    bus.publish_nowait(_cdu_message(topics or Topics(), site, telemetry))
    return telemetry


async def run_plant(
    bus: Publisher,
    plant: SimulatedCdu,
    *,
    site: str,
    interval_s: float,
    rack_power_w: Callable[[], Mapping[str, float]] | None = None,
    topics: Topics | None = None,
) -> NoReturn:
    """Publish the plant's telemetry every ``interval_s``, forever (cancel to stop).

    ``rack_power_w`` gives the served racks' power (W by rack) each tick; the plant's heat
    input is its sum times the capture fraction. Without it the heat input stays as set.
    """
    log.info("cdu_plant_started", cdu=plant.name, loop=plant.loop, site=site, interval_s=interval_s)
    await aiokit.every(
        interval_s,
        lambda: publish_plant_once(bus, plant, site=site, topics=topics, rack_power_w=rack_power_w),
    )


async def run_poller(
    bus: Publisher,
    poller: CduPoller,
    *,
    site: str,
    interval_s: float,
    topics: Topics | None = None,
) -> NoReturn:
    """Poll the CDU and publish its telemetry every ``interval_s``, forever.

    An unreachable CDU publishes nothing (the poller retries with backoff and logs the
    outage once); a ``FatalError`` ends the loop. The poller is closed when the loop ends.
    """
    log.info("cdu_poller_started", **_poller_fields(poller), interval_s=interval_s)
    failures = DropLog("cdu_poll_failed")
    try:
        await aiokit.every(
            interval_s,
            lambda: publish_poll_once(bus, poller, site=site, topics=topics, failures=failures),
        )
    finally:
        await close_poller(poller)


@dataclass(slots=True)
class _NodePower:
    power_w: float
    seen_s: float


class RackPowerTracker:
    """Rack power from the agents' node telemetry: the latest GPU power of each node.

    Keys are ``row/rack``. A node silent for ``stale_after_s`` no longer counts. At most
    ``max_nodes`` nodes are tracked (stale ones are forgotten first), so a flood of node
    names cannot grow memory.
    """

    def __init__(
        self,
        *,
        topics: Topics | None = None,
        racks: Collection[str] | None = None,
        stale_after_s: float = 10.0,
        max_nodes: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        drops: DropLog | None = None,
    ) -> None:
        """Track ``racks`` (``row/rack`` keys; default: every rack heard of)."""
        self._topics = topics or Topics()
        self._racks = frozenset(racks) if racks is not None else None
        self._stale_after_s = stale_after_s
        self._max_nodes = max_nodes
        self._clock = clock
        self._drops = drops if drops is not None else DropLog("node_telemetry_dropped", clock=clock)
        self._nodes: dict[tuple[str, str], _NodePower] = {}  # (row/rack, node) -> power
        self.accepted = 0
        """Messages taken."""
        self.ignored = 0
        """Node telemetry of racks this tracker does not serve (normal on a shared row)."""

    @property
    def dropped(self) -> dict[str, int]:
        """Messages dropped, by reason: ``topic``, ``retained``, the ``SchemaError``'s
        reason, ``identity``, ``capacity``, ``internal``."""
        return self._drops.counts

    def feed(self, message: InMessage) -> bool:
        """Take one message; True when it was node telemetry of a tracked rack.

        Total: a message that cannot be used is counted by reason, logged (rate-limited)
        and dropped; only ``BaseException`` (cancellation) passes through.
        """
        try:
            return self._feed(message)
        except SchemaError as exc:
            reason = getattr(exc, "reason", "schema")
            self._drops.drop(str(reason), topic=message.topic, error=str(exc))
        except Exception as exc:  # a bug must cost one message, not the listener
            self._drops.drop("internal", exc=exc, topic=message.topic)
        return False

    def _feed(self, message: InMessage) -> bool:
        parsed = self._topics.parse_node(message.topic)
        if parsed is None or parsed[1] != "telemetry":
            self._drops.drop("topic", topic=message.topic)
            return False
        addr = parsed[0]
        rack = f"{addr.row}/{addr.rack}"
        if self._racks is not None and rack not in self._racks:
            self.ignored += 1
            return False
        if message.retain:  # agents never retain telemetry: this reading is old
            self._drops.drop("retained", topic=message.topic)
            return False
        telemetry = decode(message.payload, Telemetry)
        if not isinstance(telemetry, Telemetry):  # pragma: no cover - decode(expected=...)
            self._drops.drop("schema", topic=message.topic, error="not node telemetry")
            return False
        if telemetry.node != addr.node:
            self._drops.drop(
                "identity", topic=message.topic, error=f"payload names node {telemetry.node}"
            )
            return False
        key = (rack, addr.node)
        now = self._clock()
        if key not in self._nodes and len(self._nodes) >= self._max_nodes:
            self._forget_stale(now)
            if len(self._nodes) >= self._max_nodes:
                self._drops.drop("capacity", topic=message.topic)
                return False
        self._nodes[key] = _NodePower(telemetry.node_gpu_power_w, now)
        self.accepted += 1
        return True

    def _forget_stale(self, now: float) -> None:
        stale = [k for k, n in self._nodes.items() if now - n.seen_s > self._stale_after_s]
        for key in stale:
            del self._nodes[key]

    def power_w(self) -> dict[str, float]:
        """Power of each rack (W): the sum of its fresh nodes' GPU power."""
        now = self._clock()
        racks: dict[str, float] = dict.fromkeys(self._racks or (), 0.0)
        for (rack, _node), node in self._nodes.items():
            if now - node.seen_s <= self._stale_after_s:
                racks[rack] = racks.get(rack, 0.0) + node.power_w
        return racks


async def track_rack_power(source: Subscriber, tracker: RackPowerTracker) -> NoReturn:
    """Feed every received message to ``tracker``, one at a time, forever.

    ``tracker.feed`` is total, so no message ends the loop; only cancellation does.
    """
    while True:
        message = await source.get()
        tracker.feed(message)
