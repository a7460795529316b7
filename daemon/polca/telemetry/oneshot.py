"""One connection of a one-shot command (``polca status``, ``polca budget``): connect once,
read what is retained, publish, see it back, close.

``one_shot_bus`` is the connection: an ``MqttBus`` with one attempt and every operation
bounded by ``timeout_s``; its own failure (credentials refused, broker unreachable) and the
command's are raised as themselves, the first one, never as a group. ``next_message`` and
``gather`` read what arrives within a time, on the event loop's clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from polca import aiokit
from polca.errors import PolcaError, TransportError
from polca.settings import MqttSettings
from polca.telemetry.bus import MqttBus
from polca.telemetry.messages import InMessage

__all__ = ["gather", "next_message", "one_shot_bus"]


@asynccontextmanager
async def one_shot_bus(
    settings: MqttSettings,
    *,
    client_id: str,
    subscriptions: Sequence[tuple[str, int]],
    timeout_s: float,
) -> AsyncIterator[MqttBus]:
    """A connected bus, closed on the way out; ``TransportError`` when the broker does not
    answer within ``timeout_s`` (``TransportAuthError`` when it refuses the credentials)."""
    bus = MqttBus(
        settings.one_shot(timeout_s),
        client_id=f"{client_id}-{time.time_ns() % 10**9}",
        subscriptions=subscriptions,
        attempts=1,
    )
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(bus.run())  # its error (refused, unreachable) ends the group
            try:
                if not await aiokit.wait_first(bus.connected, timeout_s):
                    where = settings.where()
                    msg = f"no answer from the MQTT broker {where} within {timeout_s:g} s"
                    raise TransportError(msg)
                yield bus
            finally:
                await bus.close(timeout_s=2.0)
    except* PolcaError as failed:  # the bus's own error or the command's, not a group
        raise failed.exceptions[0]  # noqa: B904 - the first failure is the command's


async def next_message(bus: MqttBus, until: float) -> InMessage | None:
    """The next message, or None when none came before ``until`` (the loop's time)."""
    left = until - asyncio.get_running_loop().time()
    if left <= 0:
        return None
    try:
        async with asyncio.timeout(left):
            return await bus.get()
    except TimeoutError:
        return None


async def gather(bus: MqttBus, wait_s: float) -> list[InMessage]:
    """Every message that arrives within ``wait_s`` (retained ones at subscription first)."""
    until = asyncio.get_running_loop().time() + wait_s
    out: list[InMessage] = []
    while (message := await next_message(bus, until)) is not None:
        out.append(message)
    return out
