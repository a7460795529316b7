"""The GPUs' health counters on the agent: the latest reading, and which go on the wire (pure).

The shell reads every GPU's ``GpuHealth`` once per telemetry interval (``ThreadedGpu.
health_all``) and hands the results to ``HealthTracker.note``; a new XID comes back so the
core can publish it as an event at once. ``due`` picks the reports that go with the next
telemetry message: a GPU's counters when any changed since they last went out, and all of
them at least every ``every_s`` (so a late subscriber, or a series gone stale, is filled
in), which keeps the counters from costing every telemetry message on a healthy fleet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from polca.errors import GpuError
from polca.gpu.backend import GpuHealth
from polca.telemetry.schema import GpuHealthReport


@dataclass(frozen=True, slots=True)
class NewXid:
    """XID events seen on one GPU since the last reading."""

    index: int
    uuid: str
    count: int
    last_xid: int | None


def report(health: GpuHealth) -> GpuHealthReport:
    """The wire form of one reading (throttle times in seconds)."""

    def seconds(ns: int | None) -> float | None:
        return None if ns is None else ns / 1e9

    return GpuHealthReport(
        xid_errors=health.xid_errors,
        last_xid=health.last_xid,
        ecc_corrected_volatile=health.ecc_corrected_volatile,
        ecc_uncorrected_volatile=health.ecc_uncorrected_volatile,
        ecc_corrected_aggregate=health.ecc_corrected_aggregate,
        ecc_uncorrected_aggregate=health.ecc_uncorrected_aggregate,
        retired_pages_sbe=health.retired_pages_sbe,
        retired_pages_dbe=health.retired_pages_dbe,
        retired_pages_pending=health.retired_pages_pending,
        remapped_rows_correctable=health.remapped_rows_correctable,
        remapped_rows_uncorrectable=health.remapped_rows_uncorrectable,
        row_remap_pending=health.row_remap_pending,
        row_remap_failure=health.row_remap_failure,
        pcie_replays=health.pcie_replays,
        power_brake_s=seconds(health.power_brake_ns),
        hw_thermal_slowdown_s=seconds(health.hw_thermal_slowdown_ns),
        sw_thermal_slowdown_s=seconds(health.sw_thermal_slowdown_ns),
    )


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
