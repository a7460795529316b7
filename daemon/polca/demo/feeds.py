"""The demo row's two feeds: a simulated rack PDU per feed, and feed B lost for a while.

The row is a Flex row: two feeds (A and B), each carrying ``feed_fraction`` of the row's
budget, so both together carry more than the budget and one alone less. Once a second
``run_feeds`` publishes the row's meter reading as its two PDUs would (``pdu-a`` on feed
A, ``pdu-b`` on feed B; each source's power and its equipment's word on its feed), the
row's power taken from the nodes' own (the racks of the latest row summary, so the meter
never feeds back on itself). ``feed_loss_at_s`` after the start feed B's breaker trips
(``pdu-b`` says down and reads 0 W, the load moves to A) and ``feed_loss_s`` later it is
back. The aggregator's own fast path (``aggregator/budgets.py``) takes the row to feed A's
rating at its next step: the demo shows what that costs.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from polca.demo.options import ROW, SITE, DemoOptions
from polca.demo.view import DemoView
from polca.telemetry.messages import OutMessage
from polca.telemetry.schema import Meter, SourceState, encode
from polca.telemetry.topics import Topics

if TYPE_CHECKING:
    from polca.service import Publisher

__all__ = ["FEED_SOURCES", "run_feeds"]

FEED_SOURCES = {"A": "pdu-a", "B": "pdu-b"}
"""Each feed of the demo row and the PDU (meter source) on it."""


def feed_lost(options: DemoOptions, since_start_s: float) -> bool:
    """Whether feed B is down ``since_start_s`` into the run."""
    at = options.feed_loss_at_s
    return at is not None and at <= since_start_s < at + options.feed_loss_s


def meter_reading(view: DemoView, *, lost: bool, now_ns: int) -> Meter | None:
    """The row's meter reading now, from the nodes' power in the latest summary."""
    summary = view.summary
    if summary is None:
        return None
    power_w = sum(rack.power_w for rack in summary.racks)
    up, down = SourceState(equipment="up"), SourceState(equipment="down")
    return Meter(
        ts_ns=now_ns,
        power_w=power_w,
        sources=2,
        states={"pdu-a": up, "pdu-b": down if lost else up},
    )


async def run_feeds(bus: Publisher, view: DemoView, options: DemoOptions, topics: Topics) -> None:
    """Publish the row's meter reading once a second, feed B lost as scheduled; forever."""
    topic = topics.meter(SITE, ROW)
    started = time.monotonic()
    while True:
        await asyncio.sleep(1.0)
        lost = feed_lost(options, time.monotonic() - started)
        view.feed_b_lost = lost
        meter = meter_reading(view, lost=lost, now_ns=time.time_ns())
        if meter is not None:
            bus.publish_nowait(OutMessage(topic, encode(meter), qos=0))
