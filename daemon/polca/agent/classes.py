"""The priority classes a scheduler assigns to a node's GPUs, and the dwell between changes.

The scheduler's retained ``assign`` message (GPU UUID or index -> class) can change at
message rate, and each change of a GPU's class can mean a cap write on it; ``ClassDwell``
keeps what is asked for apart from what is in force and lets each GPU's class change at
most once per ``agent.class_dwell_s``. Pure: time comes in as arguments (the agent's
monotonic clock); the core's ``MessageIntake`` (``intake.py``) feeds it assignments and
``AgentCore`` asks it for the classes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from polca.assign.model import Origin, Workload
from polca.gpu.backend import GpuInfo


class ClassDwell:
    """The runtime priority classes: those the scheduler asks for, and those in force.

    The scheduler's retained assignment (``requested``: GPU UUID or index -> class) can
    change at message rate, and each change of a GPU's class can mean a cap write on it.
    So a GPU's class in force changes at most once per ``dwell_ns`` (``agent.class_dwell_s``):
    a change applies at once unless the GPU's previous change is less than a dwell old; then
    it waits until the dwell has passed and the latest request applies (flips in between
    are coalesced, none is lost, only delayed). Changes held back are counted
    (``deferred``, per GPU and message).

    Every change waits, including one that would cap the GPU harder (no fail-safe bypass):
    which class is "harder" depends on the level and policy in force (a class may be capped
    tighter at one level and looser at another) and on the thermal guards; the class kept
    during the wait is the one the GPU was running under a moment before, at the level the
    controller sets, and the level, not the classes, holds the row under its budget (the
    controller sees the GPU's power and raises the level if need be). A bypass would also
    let a sender alternate "harder" changes at once with "softer" ones after the dwell,
    doubling the writes. So one rule, the simplest: every change within a dwell of the
    last waits.
    """

    def __init__(self, dwell_ns: int, *, source: str = "mqtt") -> None:
        """Classes of GPUs changing at most once per ``dwell_ns`` (0: at once)."""
        self.dwell_ns = dwell_ns
        self.source = source
        """Where assignments come from: ``mqtt``, ``kubernetes`` or ``file``."""
        self.healthy = True
        """Whether the source could be read at its last update."""
        self.reason = ""
        """Why it could not."""
        self.origins: dict[str, Origin] = {}  # uuid or index -> where its class came from
        self.workloads: dict[str, Workload] = {}  # uuid or index -> who holds the GPU
        self.requested: dict[str, str] = {}  # uuid or index -> class (the MQTT assignment)
        self.in_force: dict[int, str] = {}  # index -> class (absent: none assigned)
        self.changed_ns: dict[int, int] = {}  # index -> monotonic ns of its last change
        self.deferred = 0

    def origin(self, info: GpuInfo) -> Origin | None:
        """Where the class requested for one GPU came from (by UUID, else by index)."""
        return self.origins.get(info.uuid) or self.origins.get(str(info.index))

    def workload(self, info: GpuInfo) -> Workload | None:
        """Who holds one GPU, when the source knows."""
        return self.workloads.get(info.uuid) or self.workloads.get(str(info.index))

    def wanted(self, info: GpuInfo) -> str | None:
        """The class requested for one GPU (by UUID, else by index), None if none is."""
        return self.requested.get(info.uuid) or self.requested.get(str(info.index))

    def _waits(self, index: int, now_ns: int) -> bool:
        changed = self.changed_ns.get(index)
        return changed is not None and now_ns - changed < self.dwell_ns

    def request(
        self, classes: Mapping[str, str], infos: Iterable[GpuInfo], now_ns: int
    ) -> list[int]:
        """Take a new assignment at ``now_ns``; the GPUs whose change it holds back."""
        self.requested = dict(classes)
        held = [
            info.index
            for info in infos
            if self.wanted(info) != self.in_force.get(info.index)
            and self._waits(info.index, now_ns)
        ]
        self.deferred += len(held)
        return held

    def settle(self, infos: Iterable[GpuInfo], now_ns: int) -> dict[int, str | None]:
        """Put in force every requested change whose dwell has passed; those applied."""
        applied: dict[int, str | None] = {}
        for info in infos:
            wanted = self.wanted(info)
            if wanted == self.in_force.get(info.index) or self._waits(info.index, now_ns):
                continue
            if wanted is None:
                self.in_force.pop(info.index, None)
            else:
                self.in_force[info.index] = wanted
            self.changed_ns[info.index] = now_ns
            applied[info.index] = wanted
        return applied

    def of(self, index: int) -> str | None:
        """GPU ``index``'s runtime class in force (None: the policy's static map decides)."""
        return self.in_force.get(index)

    def key(self) -> tuple[tuple[int, str], ...]:
        """The classes in force, as a comparable value."""
        return tuple(sorted(self.in_force.items()))
