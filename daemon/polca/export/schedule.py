"""How often each measurement is written: per-measurement write intervals (pure).

Why: a large site chooses its database load. Per-GPU series are most of the points (8 per
node message); written every 10 s instead of every second they cost a tenth, while the
node, rack and row series that dashboards and alerts watch stay at 1 s. Intervals run on
the local monotonic clock, passed in. A series is due when its interval has elapsed since
it was last written, less a slack of a tenth of the interval (telemetry arriving every
1.0 s ± jitter keeps a 10 s series at 10 s, not 11 s). A thinned series keeps the readings
of the moment it is written (a sample, not a mean over the interval): counters such as
``energy_j`` stay exact, while ``energy_delta_j`` then covers only its own interval.

Only state-like measurements can be thinned (``THINNABLE``); control decisions, events and
cooling alarms are always written.

``Thinning`` is that schedule applied to what the aggregator writes: a node's telemetry
(its ``gpu`` points per node, its ``gpu_health`` points with ``HealthBacklog`` holding the
counters that came early) and a control step's points (one decision per measurement).
"""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence
from typing import Final, Protocol, TypeVar

from polca.export import gpus
from polca.export.points import AnyPoint
from polca.settings import Thinnable
from polca.telemetry.schema import Telemetry

THINNABLE: Final[tuple[str, ...]] = typing.get_args(Thinnable)
ALWAYS_THINNED_S: Final[Mapping[str, float]] = {"gpu_health": 1.0}
"""Intervals that hold even when the configuration names none: a node may send health
counters with every message (they are cumulative: thinning loses no count)."""
SLACK_FRACTION: Final = 0.1
"""A series is due this fraction of its interval early (arrival jitter)."""


class WriteSchedule:
    """Which series are due, per measurement interval; bounded in series remembered."""

    def __init__(
        self, every_s: Mapping[Thinnable, float] | Mapping[str, float], *, max_series: int = 1 << 16
    ) -> None:
        unknown = set(every_s) - set(THINNABLE)
        if unknown:
            msg = f"write intervals for {sorted(unknown)}: only {THINNABLE} can be thinned"
            raise ValueError(msg)
        bad = {name: s for name, s in every_s.items() if not 0 < s < float("inf")}
        if bad:
            msg = f"write intervals must be positive and finite: {bad}"
            raise ValueError(msg)
        intervals: dict[str, float] = dict(ALWAYS_THINNED_S)
        intervals.update(every_s.items())
        self._due_after_s = {name: s * (1 - SLACK_FRACTION) for name, s in intervals.items()}
        self._max_series = max_series
        self._written_s: dict[tuple[str, str], float] = {}

    def due(self, measurement: str, series: str, now_s: float) -> bool:
        """True (and the series marked written now) when ``series`` is to be written now.

        ``series`` names what is written together: a node for its GPUs' points, "" for
        all the points of a measurement that one control step writes.
        """
        after_s = self._due_after_s.get(measurement)
        if after_s is None:
            return True
        key = (measurement, series)
        last = self._written_s.get(key)
        if last is not None and now_s - last < after_s:
            return False
        if last is None and len(self._written_s) >= self._max_series:
            self._written_s.clear()  # bounded; forgetting only writes a point early
        self._written_s[key] = now_s
        return True


class _Measured(Protocol):
    @property
    def measurement(self) -> str: ...


_P = TypeVar("_P", bound=_Measured)


class Thinning:
    """The aggregator's write intervals, applied to a node's telemetry and a step's points."""

    def __init__(
        self,
        every_s: Mapping[Thinnable, float] | Mapping[str, float],
        *,
        workload_series: bool = False,
    ) -> None:
        """Intervals as in ``WriteSchedule`` (``influx.write_every_s``); nothing written
        yet. ``workload_series`` adds the ``gpu_workload`` points to the ``gpu`` batch."""
        self.schedule = WriteSchedule(every_s)
        self.health_backlog = gpus.HealthBacklog()
        self.workload_series = workload_series

    def telemetry_batches(
        self, telemetry: Telemetry, *, node: str, site: str, row: str, rack: str, now_s: float
    ) -> list[list[AnyPoint]]:
        """The batches of points one node's telemetry message writes now (each a write).

        Its ``gpu_health`` points when the node's health interval has passed (with the
        counters that waited for it; counters that came sooner wait in the backlog, never
        lost), then its ``gpu`` points when the node's ``gpu`` interval has passed.
        """
        batches: list[list[AnyPoint]] = []
        if self.health_backlog.add(telemetry) and self.schedule.due("gpu_health", node, now_s):
            health = self.health_backlog.take(node)
            batches.append(
                list(
                    gpus.gpu_health_points(telemetry, site=site, row=row, rack=rack, health=health)
                )
            )
        if self.schedule.due("gpu", node, now_s):
            batch: list[AnyPoint] = list(gpus.gpu_points(telemetry, site=site, row=row, rack=rack))
            if self.workload_series:
                batch.extend(gpus.gpu_workload_points(telemetry, site=site, row=row, rack=rack))
            batches.append(batch)
        return batches

    def step_points(self, points: Sequence[_P], now_s: float) -> list[_P]:
        """The points of one control step that are due: one decision per measurement, so a
        step writes all its series of a measurement or none."""
        due = {m: self.schedule.due(m, "", now_s) for m in {p.measurement for p in points}}
        return [p for p in points if due[p.measurement]]
