"""The Kubernetes assignment source: which pod holds each GPU, refreshed, fail safe.

Every ``refresh_s`` it reads the kubelet's pod-resources (``assign/podresources.py``:
which container holds which device) and joins it with the pods' metadata the API watch
keeps current (``assign/kubeapi.py``), through the class rule of ``assign/rules.py``,
into one ``AssignmentUpdate`` the agent takes like any other source's.

Fail safe: when the socket or the API cannot be read, the last map stays in force (marked
unhealthy, with the reason) for ``grace_s``; after that every GPU falls back to the class
the ladder caps first, and says so (the update's origins are ``fallback``; the agent logs
``assignment_source_failed`` and its status carries the reason). Before the first good
read the same grace runs from the start. ``Freshness`` is that rule, pure, time passed in;
``KubernetesSource`` is the thin loop around it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import structlog

from polca import aiokit
from polca.assign.config import KubernetesAssignment
from polca.assign.model import AssignmentUpdate, PodDevices, PodMeta
from polca.assign.rules import Classes, Rules, fallback, node_update
from polca.errors import ConfigError, ReadingRejectedError, TransportError
from polca.outages import OutageBook

__all__ = ["DeviceLister", "Freshness", "KubernetesSource", "PodSource", "node_name_of"]

log = structlog.get_logger(__name__)


class DeviceLister(Protocol):
    """The kubelet's pod-resources (``PodResourcesClient``)."""

    async def list_devices(self) -> tuple[PodDevices, ...]:
        """Every container's devices now."""
        ...

    async def close(self) -> None:
        """Close the channel."""
        ...


class PodSource(Protocol):
    """The pods on this node, kept current (``PodWatcher``)."""

    @property
    def healthy(self) -> bool:
        """Whether the watch is connected."""
        ...

    @property
    def error(self) -> str | None:
        """Why it is not."""
        ...

    def pods(self) -> Mapping[str, PodMeta]:
        """The pods by uid."""
        ...

    async def run(self) -> NoReturn:
        """List and watch, forever."""
        ...


def node_name_of(settings: KubernetesAssignment) -> str:
    """This node's Kubernetes name: the setting, else ``$NODE_NAME`` (downward API)."""
    name = settings.node_name or os.environ.get("NODE_NAME", "")
    if not name:
        msg = (
            "assignment.source kubernetes needs this node's name: set NODE_NAME from the "
            "downward API (fieldRef spec.nodeName) or assignment.kubernetes.node_name"
        )
        raise ConfigError(msg)
    return name


@dataclass(slots=True)
class Freshness:
    """When the last good read of each input was, and whether the map may still stand
    (pure): one ``outages.OutageBook`` per input (pod-resources, the Kubernetes API)."""

    grace_s: float
    started_s: float
    devices: OutageBook = field(default_factory=OutageBook)
    pods: OutageBook = field(default_factory=OutageBook)

    def stale(self, now_s: float) -> str | None:
        """Why the map may no longer stand (beyond the grace), or None while it may."""
        for what, book in (("pod-resources", self.devices), ("the Kubernetes API", self.pods)):
            if book.unread_s(now_s, started_s=self.started_s) > self.grace_s:
                # No elapsed time in it: the reason is compared to report a change once.
                never = " (never read)" if book.ok_s is None else ""
                return f"{what} unreadable for more than {self.grace_s:g} s{never}"
        return None


class KubernetesSource:
    """Reads pod-resources every ``refresh_s`` and hands the node's map to ``on_update``."""

    def __init__(
        self,
        settings: KubernetesAssignment,
        *,
        devices: DeviceLister,
        pods: PodSource,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Join ``devices`` (the kubelet) and ``pods`` (the API) under ``settings``' rules."""
        self.settings = settings
        self._devices = devices
        self._pods = pods
        self._clock = clock
        self.freshness = Freshness(settings.grace_s, clock())
        self._last: Sequence[PodDevices] | None = None
        self._problem: str | None = None
        self.refreshes = 0
        """Reads of pod-resources that succeeded."""
        self.failures = 0
        """Reads that failed."""

    def update(
        self, *, gpus: Mapping[str, str], classes: Classes, now_s: float
    ) -> AssignmentUpdate:
        """The node's map now from what was read last (pure of I/O)."""
        f = self.freshness
        if self._pods.healthy:
            f.pods.ok(now_s)
        else:
            f.pods.failed("unhealthy", now_s)
        stale = f.stale(now_s)
        if stale is not None:
            return fallback(gpus, classes, reason=f"{stale}: every GPU at the class capped first")
        rules = Rules(self.settings, classes)
        mapped = node_update(self._last or (), self._pods.pods(), gpus=gpus, rules=rules)
        problems = [
            p for p in (self._problem, None if self._pods.healthy else self._pods.error) if p
        ]
        if self._last is None and not problems:
            problems.append("pod-resources not read yet")
        if not problems:
            return mapped.update
        reason = "; ".join(problems)[:200] + ": last map kept"
        u = mapped.update
        return AssignmentUpdate(
            source=u.source,
            classes=u.classes,
            origins=u.origins,
            workloads=u.workloads,
            healthy=False,
            reason=reason,
        )

    async def refresh_once(self, *, gpus: Mapping[str, str], classes: Classes) -> AssignmentUpdate:
        """Read pod-resources once (bounded by the client's deadline); the node's map."""
        try:
            self._last = await self._devices.list_devices()
        except (TransportError, ReadingRejectedError) as exc:
            self.failures += 1
            self.freshness.devices.failed(type(exc).__name__, self._clock())
            # The outage's first error names it until a read succeeds: the kubelet killed
            # mid-stream fails first with one message, then with another while it is down,
            # and a status (and warning) per message text would report one outage twice.
            if self._problem is None:
                self._problem = f"pod-resources: {exc}"
        else:
            self.refreshes += 1
            self._problem = None
            self.freshness.devices.ok(self._clock())
        return self.update(gpus=gpus, classes=classes, now_s=self._clock())

    async def run(
        self,
        on_update: Callable[[AssignmentUpdate], Any],
        *,
        gpus: Callable[[], Mapping[str, str]],
        classes: Callable[[], Classes],
    ) -> NoReturn:
        """Watch the pods and refresh the map every ``refresh_s``, forever."""
        log.info("assignment_kubernetes_started", refresh_s=self.settings.refresh_s)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(aiokit.guard("pod-watch", self._pods.run()), name="pod-watch")

            async def tick() -> None:
                on_update(await self.refresh_once(gpus=gpus(), classes=classes()))

            try:
                await aiokit.every(self.settings.refresh_s, tick)
            finally:
                await self._devices.close()
        msg = "the refresh loop ended"  # pragma: no cover - every() never returns
        raise AssertionError(msg)  # pragma: no cover
