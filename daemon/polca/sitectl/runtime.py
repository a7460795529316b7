"""The site controller's shell: the bus, the election, the clock and the step loop.

``SiteController`` hands every received message to ``SiteCore.receive`` on arrival (a
feed that changed wakes the step), runs ``SiteCore.step`` every ``interval_s`` (and at
once when woken) and publishes the budgets it returns; with ``ha.etcd_endpoints`` it
campaigns on etcd (``coord/etcd.py``) for the key ``{ha.key_prefix}/{site}/site`` and
only the leader publishes. It logs each row's budget when it changes by more than 1% or
its limiting domain changes (``row_budget_changed``), each feed going down or up
(``feed_changed``), and each change of leadership. After each step it hands the step's
points (``points.py``: none from a standby) to its sinks (InfluxDB, ``/metrics``: made by
the command, ``cli.py``), which run beside the loop and close, bounded, on the way out. A
clean stop resigns the lead so a standby takes over at its next campaign; the rows hold
their leased budgets meanwhile.

What it must not do: decide anything (the core does) or outlive its tasks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from polca import aiokit, service
from polca.coord.etcd import elector_for
from polca.coord.leadership import Leadership
from polca.export.sink import FanOut, Sink
from polca.powertree.model import SiteTree
from polca.sitectl import points
from polca.sitectl.config import SiteSettings
from polca.sitectl.core import SiteCore, SiteStep
from polca.telemetry.bus import MqttBus
from polca.telemetry.messages import InMessage

__all__ = ["SiteController"]

log = structlog.get_logger(__name__)


class SiteController:
    """One site controller process: see the module docstring."""

    def __init__(
        self,
        settings: SiteSettings,
        tree: SiteTree,
        *,
        sinks: Sequence[Sink] = (),
        clock_ns: Callable[[], int] = time.time_ns,
        mono_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        """The core, the bus and the elector for ``settings``; nothing connected yet."""
        self.settings = settings
        self.sinks = FanOut(sinks)
        self.clock_ns = clock_ns
        self.mono_ns = mono_ns
        leadership = Leadership.standby() if settings.ha.enabled else Leadership()
        self.core = SiteCore(settings, tree, epoch_ns=clock_ns(), leadership=leadership)
        self.bus = MqttBus(
            settings.mqtt, client_id=settings.client_id, subscriptions=self.core.subscriptions()
        )
        self.bus.set_handler(self.handle_message)
        self.wake = asyncio.Event()
        self.elector = elector_for(
            settings.ha,
            key=f"{settings.ha.key_prefix}/{settings.site}/site",
            instance=settings.instance,
            leadership=leadership,
            on_change=self._leadership_changed,
            mono_ns=mono_ns,
        )
        self.last: SiteStep | None = None
        self._budgets: dict[str, tuple[float, str | None]] = {}
        self._feeds_up: dict[tuple[str, str], bool] = {}

    def handle_message(self, message: InMessage) -> None:
        """Take one received message; a feed that changed steps at once. Never raises."""
        received_s = (message.received_mono_ns or self.mono_ns()) / 1e9
        if self.core.receive(message, received_s):
            self.wake.set()

    def _leadership_changed(self) -> None:
        leadership = self.core.leadership
        log.info(
            "site_leadership_changed",
            role=leadership.role,
            term=leadership.term,
            leader=leadership.leader,
        )
        self.wake.set()

    def step(self) -> SiteStep:
        """One allocation, its budgets published, its points written, what changed logged."""
        now_ns = self.clock_ns()
        stepped = self.core.step(self.mono_ns() / 1e9, now_ns=now_ns, now_mono_ns=self.mono_ns())
        for message in stepped.messages:
            self.bus.publish_nowait(message)
        if self.sinks:
            self.sinks.write(
                points.step_points(
                    stepped,
                    self.core.tree,
                    site=self.settings.site,
                    ts_ns=now_ns,
                    leadership=self.core.leadership,
                )
            )
        self._log_changes(stepped)
        self.last = stepped
        return stepped

    def _log_changes(self, stepped: SiteStep) -> None:
        allocation = stepped.allocation
        for (name, feed), up in stepped.feeds_up.items():
            if self._feeds_up.get((name, feed), True) != up:
                emit = log.info if up else log.warning
                emit("feed_changed", domain=name, feed=feed, up=up)
        self._feeds_up = dict(stepped.feeds_up)
        for row in self.core.tree.rows:
            watts, limited_by = allocation.budget_w[row], allocation.limited_by.get(row)
            before = self._budgets.get(row)
            if (
                before is None
                or abs(before[0] - watts) > 0.01 * max(before[0], 1.0)
                or (before[1] != limited_by)
            ):
                log.info(
                    "row_budget_changed",
                    row=row,
                    budget_w=round(watts, 1),
                    before_w=round(before[0], 1) if before else None,
                    limited_by=limited_by,
                    publishing=bool(stepped.messages),
                )
                self._budgets[row] = (watts, limited_by)

    async def run(self, *, duration_s: float | None = None) -> None:
        """Run until SIGTERM/SIGINT or ``duration_s``; resign the lead on the way out."""
        log.info(
            "site_started",
            rows=len(self.core.tree.rows),
            domains=len(self.core.tree.domains),
            interval_s=self.settings.interval_s,
            ha=self.settings.ha.enabled,
        )
        loops: list[tuple[str, Any]] = [
            ("site", aiokit.every_or_woken(self.settings.interval_s, self.wake, self.step))
        ]
        if self.elector is not None:
            loops.append(("etcd", self.elector.run()))
        if self.sinks:
            loops.append(("sinks", self.sinks.run()))
        try:
            await service.serve_source(self.bus, loops, duration_s=duration_s)
        finally:
            if self.elector is not None:
                bound_s = service.STOP_BOUNDS.session_s
                await service.bounded(self.elector.resign(), bound_s, "site_not_resigned", log)
                await self.elector.client.close()
            if self.sinks:  # cancelled with the loops; ``close`` flushes or spools the rest
                await self.sinks.close(timeout_s=service.STOP_BOUNDS.sinks_s)
            log.info("site_stopped", steps=self.core.seq)
