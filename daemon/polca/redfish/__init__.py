"""Redfish: the one HTTP client polca speaks it with, and pure readers of its resources."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from polca.redfish.api import RedfishEndpoint, RedfishSession

__all__ = ["open_session"]


async def open_session(endpoint: RedfishEndpoint, *, password: str | None = None) -> RedfishSession:
    """``polca.redfish.client.connect``, imported on first use: aiohttp is loaded only by
    a process that talks to a Redfish service (a ``SessionFactory``)."""
    from polca.redfish import client  # noqa: PLC0415

    return await client.connect(endpoint, password=password)
