"""Publish CDU telemetry to MQTT: from the simulated plant or from the Modbus poller.

Two small eternal loops, meant to run under ``aiokit.guard`` in a supervisor's TaskGroup:
``run_plant`` (a ``SimulatedCdu``, its heat input taken from the racks' power each tick)
and ``run_poller`` (a ``ModbusCduPoller``). Both publish one ``CduTelemetry`` per
``interval_s`` to ``Topics.cdu(site, cdu)`` at QoS 0, not retained, as a CDU publishing
to MQTT itself would; ticks are scheduled on ``loop.time()`` and a late tick is skipped,
not bunched. While the plant's telemetry-loss fault is on, or the poller cannot reach the
CDU, nothing is published: the aggregator sees the CDU go silent, as it would.

``RackPowerTracker`` turns the agents' node telemetry into rack power, the plant's heat
input when it runs next to a live row (``polca cdu simulate --rack``).

What this module must not do: model physics, decode registers, or own the MQTT connection
(it is handed a bus).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, Protocol

import structlog

from polca.errors import TransportError
from polca.telemetry.bus import InMessage, OutMessage
from polca.telemetry.schema import SchemaError, Telemetry, decode, encode
from polca.telemetry.topics import Topics

if TYPE_CHECKING:
    from polca.cooling.modbus import ModbusCduPoller
    from polca.cooling.plant import SimulatedCdu
    from polca.telemetry.schema import CduTelemetry

__all__ = [
    "Publisher",
    "RackPowerTracker",
    "publish_plant_once",
    "publish_poll_once",
    "run_plant",
    "run_poller",
    "track_rack_power",
]

log = structlog.get_logger(__name__)


class Publisher(Protocol):
    """Where CDU telemetry goes: ``MqttBus`` or any object with ``publish_nowait``."""

    def publish_nowait(self, msg: OutMessage) -> None:
        """Queue ``msg`` for the broker without waiting."""


class Subscriber(Protocol):
    """Where node telemetry comes from: ``MqttBus`` subscribed to the node channels."""

    async def get(self) -> InMessage:
        """The next received message."""
        ...


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
    poller: ModbusCduPoller,
    *,
    site: str,
    topics: Topics | None = None,
) -> CduTelemetry | None:
    """One Modbus poll, published; None when the CDU is unreachable (the poller logs it).

    ``ConfigError`` (the device rejects the map) propagates: retrying cannot fix it.
    """
    try:
        telemetry = await poller.poll()
    except TransportError:
        return None
    bus.publish_nowait(_cdu_message(topics or Topics(), site, telemetry))
    return telemetry


async def _every(interval_s: float, tick: Callable[[], object]) -> NoReturn:
    """Call ``tick`` (awaiting it if it returns an awaitable) every ``interval_s``."""
    if interval_s <= 0:
        msg = f"interval_s must be > 0, got {interval_s}"
        raise ValueError(msg)
    loop = asyncio.get_running_loop()
    next_t = loop.time()
    while True:
        result = tick()
        if asyncio.iscoroutine(result):
            await result
        next_t += interval_s
        now = loop.time()
        next_t = max(next_t, now)  # after a slow tick, skip the missed ones: no bunching
        await asyncio.sleep(next_t - now)


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
    await _every(
        interval_s,
        lambda: publish_plant_once(bus, plant, site=site, topics=topics, rack_power_w=rack_power_w),
    )


async def run_poller(
    bus: Publisher,
    poller: ModbusCduPoller,
    *,
    site: str,
    interval_s: float,
    topics: Topics | None = None,
) -> NoReturn:
    """Poll the CDU and publish its telemetry every ``interval_s``, forever.

    An unreachable CDU publishes nothing (the poller retries with backoff and logs the
    outage once); ``ConfigError`` ends the loop.
    """
    config = poller.config
    log.info(
        "cdu_poller_started",
        cdu=config.cdu,
        host=config.host,
        port=config.port,
        requests_per_poll=len(poller.blocks),
        interval_s=interval_s,
    )
    try:
        await _every(interval_s, lambda: publish_poll_once(bus, poller, site=site, topics=topics))
    finally:
        poller.close()


@dataclass(slots=True)
class _NodePower:
    power_w: float
    seen_s: float


class RackPowerTracker:
    """Rack power from the agents' node telemetry: the latest GPU power of each node.

    Keys are ``row/rack``. A node silent for ``stale_after_s`` no longer counts.
    """

    def __init__(
        self,
        *,
        topics: Topics | None = None,
        racks: Collection[str] | None = None,
        stale_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Track ``racks`` (``row/rack`` keys; default: every rack heard of)."""
        self._topics = topics or Topics()
        self._racks = frozenset(racks) if racks is not None else None
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._nodes: dict[tuple[str, str], _NodePower] = {}  # (row/rack, node) -> power

    def feed(self, message: InMessage) -> bool:
        """Take one message; True when it was node telemetry of a tracked rack."""
        parsed = self._topics.parse_node(message.topic)
        if parsed is None or parsed[1] != "telemetry":
            return False
        addr = parsed[0]
        rack = f"{addr.row}/{addr.rack}"
        if self._racks is not None and rack not in self._racks:
            return False
        try:
            telemetry = decode(message.payload, Telemetry)
        except SchemaError:
            return False
        assert isinstance(telemetry, Telemetry)  # noqa: S101 - decode(expected=Telemetry)
        self._nodes[(rack, addr.node)] = _NodePower(telemetry.node_gpu_power_w, self._clock())
        return True

    def power_w(self) -> dict[str, float]:
        """Power of each rack (W): the sum of its fresh nodes' GPU power."""
        now = self._clock()
        racks: dict[str, float] = dict.fromkeys(self._racks or (), 0.0)
        for (rack, _node), node in self._nodes.items():
            if now - node.seen_s <= self._stale_after_s:
                racks[rack] = racks.get(rack, 0.0) + node.power_w
        return racks


async def track_rack_power(source: Subscriber, tracker: RackPowerTracker) -> NoReturn:
    """Feed every received message to ``tracker``, forever."""
    while True:
        tracker.feed(await source.get())
