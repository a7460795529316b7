"""The GPUs' health counters on the agent: the latest reading, and which go on the wire (pure).

The shell reads every GPU's ``GpuHealth`` once per telemetry interval (``ThreadedGpu.
health_all``) and hands the results to the core (``AgentCore.note_health``), which gives
them to ``HealthTracker.note``; a new XID comes back so the core can publish it as an
event at once. ``due`` picks the reports that go with the next
telemetry message: a GPU's counters when any changed since they last went out, and all of
them at least every ``every_s`` (so a late subscriber, or a series gone stale, is filled
in), which keeps the counters from costing every telemetry message on a healthy fleet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from polca.errors import GpuError
from polca.gpu.backend import HEALTH_COUNTERS, GpuHealth
from polca.telemetry.schema import GpuHealthReport


@dataclass(frozen=True, slots=True)
class NewXid:
    """XID events seen on one GPU since the last reading."""

    index: int
    uuid: str
    count: int
    last_xid: int | None


def report(health: GpuHealth) -> GpuHealthReport:
    """The wire form of one reading: the same counters, throttle times in seconds."""
    values: dict[str, int | float | None] = {}
    for name in HEALTH_COUNTERS:
        value = getattr(health, name)
        if name.endswith("_ns"):
            values[name.removesuffix("_ns") + "_s"] = None if value is None else value / 1e9
        else:
            values[name] = value
    return GpuHealthReport(**values)


class HealthTracker:
    """The latest health of each GPU, and when its counters last went out."""

    def __init__(self, *, every_s: float) -> None:
        self.every_s = every_s
        self.latest: dict[int, GpuHealth] = {}
        self.reports: dict[int, GpuHealthReport] = {}
        self.invalid = 0
        """Readings the wire schema refused (a counter out of its bounds): not sent."""
        self._sent: dict[int, tuple[GpuHealthReport, float]] = {}

    def note(self, results: Mapping[int, GpuHealth | GpuError]) -> list[NewXid]:
        """Take one round of readings (a failed GPU keeps its last); the XIDs that are new."""
        new: list[NewXid] = []
        for index, result in results.items():
            if isinstance(result, GpuError):
                continue
            try:
                wire = report(result)
            except ValueError:  # pydantic's ValidationError: a counter out of bounds
                self.invalid += 1
                continue
            before = self.latest.get(index)
            seen = before.xid_errors if before is not None and before.xid_errors else 0
            if result.xid_errors is not None and result.xid_errors > seen:
                new.append(NewXid(index, result.uuid, result.xid_errors - seen, result.last_xid))
            self.latest[index] = result
            self.reports[index] = wire
        return new

    def due(self, now_s: float) -> dict[int, GpuHealthReport]:
        """The reports for the next telemetry message (changed, or not sent for ``every_s``);
        they count as sent."""
        out: dict[int, GpuHealthReport] = {}
        for index, wire in self.reports.items():
            sent = self._sent.get(index)
            if sent is None or sent[0] != wire or now_s - sent[1] >= self.every_s:
                out[index] = wire
                self._sent[index] = (wire, now_s)
        return out
