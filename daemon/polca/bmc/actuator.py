"""Carry out out-of-band caps: write a node's limit through its BMC, read it back, report.

``BmcActuator`` takes targets (``OobPlanner``'s ``OobTarget``: a node's limit, or None to
release it) without waiting, and one worker per node with a target writes them: the
latest target wins, writes to one BMC are at least ``min_write_interval_s`` apart, and
each write is read back. A cap first reads the limit in force and keeps it; a release
writes that limit back (or lifts polca's cap to the control's maximum when the original
is not known, e.g. after a restart). Every attempt ends in an ``OobOutcome`` handed to
``on_outcome`` (the aggregator logs it, publishes an event, writes a point and counts it).

How it fails: an unreachable BMC, refused credentials, an answer polca cannot use or a
write the BMC reports back differently (``verified`` False: a BMC that accepts a PATCH and
keeps another value) are outcomes, retried at the write pace until the target is in force
or replaced; the session is dropped after a failure and made again. Nothing but
cancellation ends a worker. Never an uncap: a release is only ever written for a release
target, and a failed cap is retried, not abandoned. This is the actuator shape of
``actuation.py``; ``OobOutcome`` is an ``actuation.Outcome``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import structlog

from polca.actuation import error_text
from polca.bmc.config import BmcNode, BmcSettings
from polca.bmc.plan import OobTarget

__all__ = ["BmcActuator", "Connector", "OobOutcome", "PowerControl"]

log = structlog.get_logger(__name__)


class PowerControl(Protocol):
    """A BMC's power limit (``bmc/redfish.py`` ``BmcPowerControl``)."""

    async def read(self) -> Any:
        """The reading: ``power_w``, ``limit_w``, ``limit_min_w``, ``limit_max_w``."""
        ...

    async def cap(self, watts: float) -> Any:
        """Write ``watts`` and read it back: ``limit_w``, ``verified``."""
        ...

    async def restore(self) -> Any:
        """Lift polca's cap (the control's maximum), read back: ``limit_w``, ``verified``."""
        ...


class _Closable(Protocol):
    async def close(self) -> None: ...


Connector = Callable[[BmcNode], Awaitable[tuple[_Closable, PowerControl]]]
"""Log in to a node's BMC and find its power control: (session, control)."""


async def _redfish(node: BmcNode) -> tuple[_Closable, PowerControl]:
    from polca.bmc.redfish import BmcPowerControl  # noqa: PLC0415
    from polca.redfish import open_session  # noqa: PLC0415

    session = await open_session(node.endpoint)
    return session, BmcPowerControl(session, chassis_id=node.chassis, control=node.control)


@dataclass(frozen=True, slots=True)
class OobOutcome:
    """One out-of-band write, as it ended."""

    node: str
    action: str
    """``cap`` or ``release``."""
    target_w: float | None
    """What was to be written (None: the control's maximum)."""
    limit_w: float | None
    """What the BMC reports after the write (None when the write failed)."""
    verified: bool
    error: str | None
    reason: str
    """Why the target was set (``OobTarget.reason``)."""
    latency_s: float
    """From the target being set to this outcome."""

    @property
    def ok(self) -> bool:
        """Written without error and read back as written (``actuation.Outcome``)."""
        return self.error is None and self.verified

    def log_line(self) -> tuple[str, str, dict[str, object]]:
        """How the aggregator logs it: (level, event, fields). A cap, or any write that
        failed, is a warning (someone should know a BMC holds a node); a verified release
        is info."""
        level = "warning" if self.action == "cap" or not self.ok else "info"
        event = f"oob_{self.action}_{'applied' if self.ok else 'failed'}"
        fields: dict[str, object] = {
            "node": self.node,
            "target_w": self.target_w,
            "limit_w": self.limit_w,
            "verified": self.verified,
            "error": self.error,
            "reason": self.reason,
            "latency_s": self.latency_s,
        }
        return level, event, fields


@dataclass(slots=True)
class _Node:
    config: BmcNode
    target: OobTarget | None = None
    target_s: float = 0.0
    applied: OobTarget | None = None
    original_w: float | None = None
    last_write_s: float = -1e18
    wake: asyncio.Event | None = None
    session: _Closable | None = None
    control: PowerControl | None = None


class BmcActuator:
    """One worker per node with a target; targets in, outcomes out."""

    def __init__(
        self,
        settings: BmcSettings,
        *,
        on_outcome: Callable[[OobOutcome], None],
        connector: Connector | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Write to the BMCs of ``settings.nodes``; report through ``on_outcome``."""
        self.settings = settings
        self._on_outcome = on_outcome
        self._connector: Connector = connector if connector is not None else _redfish
        self._clock = clock
        self._nodes = {name: _Node(cfg) for name, cfg in settings.nodes.items()}
        self._start: asyncio.Queue[str] = asyncio.Queue(maxsize=len(self._nodes) or 1)
        self.writes = 0
        """Writes attempted."""

    def want(self, target: OobTarget) -> None:
        """Set ``target`` for its node (a node without a BMC is ignored); never waits."""
        node = self._nodes.get(target.node)
        if node is None:
            return
        node.target = target
        node.target_s = self._clock()
        if node.wake is None:
            node.wake = asyncio.Event()
            self._start.put_nowait(target.node)
        node.wake.set()

    def pending(self) -> list[str]:
        """Nodes whose target is not in force yet."""
        return sorted(n for n, s in self._nodes.items() if s.target is not s.applied)

    async def run(self) -> NoReturn:
        """Start a worker for each node given a target, forever (cancel to stop)."""
        async with asyncio.TaskGroup() as tg:
            while True:
                name = await self._start.get()
                tg.create_task(self._worker(name), name=f"bmc-{name}")

    async def close(self) -> None:
        """Close every BMC session (idempotent)."""
        for node in self._nodes.values():
            await self._drop(node)

    async def _worker(self, name: str) -> NoReturn:
        node = self._nodes[name]
        assert node.wake is not None  # noqa: S101 - set by want() before the start
        while True:
            await node.wake.wait()
            node.wake.clear()
            while node.target is not None and node.target is not node.applied:
                wait_s = node.last_write_s + self.settings.min_write_interval_s - self._clock()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                    continue  # the target may have changed while waiting
                await self._write(name, node, node.target)

    async def _write(self, name: str, node: _Node, target: OobTarget) -> None:
        node.last_write_s = self._clock()
        self.writes += 1
        action = "cap" if target.watts is not None else "release"
        try:
            if node.control is None:
                node.session, node.control = await self._connector(node.config)
            if target.watts is not None:
                if node.original_w is None and (node.applied is None or node.applied.watts is None):
                    node.original_w = _number(getattr(await node.control.read(), "limit_w", None))
                result = await node.control.cap(target.watts)
            elif node.original_w is not None:
                result = await node.control.cap(node.original_w)
            else:
                result = await node.control.restore()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every failure is an outcome, retried at the write pace
            await self._drop(node)
            error = error_text(exc)
            self._report(name, node, target, action, limit_w=None, verified=False, error=error)
            return
        verified = bool(getattr(result, "verified", False))
        limit_w = _number(getattr(result, "limit_w", None))
        written_w = target.watts if target.watts is not None else node.original_w
        if verified and node.target is target:
            node.applied = target
            if target.watts is None:
                node.original_w = None
        self._report(
            name,
            node,
            target,
            action,
            limit_w=limit_w,
            verified=verified,
            error=None,
            written_w=written_w,
        )

    def _report(
        self,
        name: str,
        node: _Node,
        target: OobTarget,
        action: str,
        *,
        limit_w: float | None,
        verified: bool,
        error: str | None,
        written_w: float | None = None,
    ) -> None:
        if written_w is None:
            written_w = target.watts if target.watts is not None else node.original_w
        outcome = OobOutcome(
            node=name,
            action=action,
            target_w=written_w,
            limit_w=limit_w,
            verified=verified,
            error=error,
            reason=target.reason,
            latency_s=round(self._clock() - node.target_s, 3),
        )
        try:
            self._on_outcome(outcome)
        except Exception as exc:  # reporting must not stop the worker
            log.exception("oob_outcome_not_reported", node=name, error=str(exc))

    async def _drop(self, node: _Node) -> None:
        session, node.session, node.control = node.session, None, None
        if session is not None:
            try:
                async with asyncio.timeout(2.0):
                    await session.close()
            except Exception as exc:  # closing a broken session may fail too
                log.debug("bmc_session_not_closed", error=str(exc))


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
