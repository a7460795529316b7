"""Fold the 10 Hz samples of one publish interval into one telemetry record per GPU.

Power is published as min/mean/max over the interval plus the last reading, energy as the
counter and its delta, clock event reasons OR-ed over the interval (a brief power-brake
event between two messages still shows). Units convert here, at the edge: mW -> W,
mJ -> J.

NVML's answers are hostile input too: a reading outside what the wire schema allows (a
power of 20 MW, a temperature of 500 C) is published as null, counted in
``invalid_readings`` and logged once per GPU and field (through the logger ``drain`` is
given: the agent core's log book), instead of failing the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from pydantic import ValidationError

from polca.gpu.backend import GpuInfo, GpuSample, clock_event_names
from polca.telemetry.schema import GpuHealthReport, GpuTelemetry

_log = structlog.get_logger()
# Fields that identify the GPU: never nulled (they come from discovery, not readings).
_IDENTITY = frozenset({"index", "uuid", "name", "priority_class", "state"})


@dataclass(slots=True)
class _GpuWindow:
    count: int = 0
    power_sum_mw: float = 0.0
    power_min_mw: int | None = None
    power_max_mw: int | None = None
    temp_max_c: float | None = None
    reasons: int | None = None
    first_energy_mj: int | None = None
    last: GpuSample | None = None

    def add(self, s: GpuSample) -> None:
        self.count += 1
        if s.power_mw is not None:
            self.power_sum_mw += s.power_mw
            self.power_min_mw = (
                s.power_mw if self.power_min_mw is None else min(self.power_min_mw, s.power_mw)
            )
            self.power_max_mw = (
                s.power_mw if self.power_max_mw is None else max(self.power_max_mw, s.power_mw)
            )
        if s.gpu_temp_c is not None:
            self.temp_max_c = (
                s.gpu_temp_c if self.temp_max_c is None else max(self.temp_max_c, s.gpu_temp_c)
            )
        if s.clock_event_reasons is not None:
            self.reasons = (self.reasons or 0) | s.clock_event_reasons
        if self.first_energy_mj is None:
            self.first_energy_mj = s.energy_mj
        self.last = s


def _w(mw: float | None) -> float | None:
    return None if mw is None else round(mw / 1000.0, 3)


@dataclass(slots=True)
class TelemetryWindow:
    """Accumulates samples between two telemetry messages."""

    infos: dict[int, GpuInfo]
    invalid_readings: int = 0
    _windows: dict[int, _GpuWindow] = field(default_factory=dict)
    _prev_energy_mj: dict[int, int] = field(default_factory=dict)
    _logged: set[tuple[int, str]] = field(default_factory=set)  # bounded: GPUs x fields

    def _record(self, log: Any, **fields: Any) -> GpuTelemetry:
        """A telemetry record; readings the schema refuses become null (counted, logged)."""
        for _ in range(len(fields)):
            try:
                return GpuTelemetry(**fields)
            except ValidationError as exc:
                bad = {str(e["loc"][0]) for e in exc.errors() if e["loc"]} - _IDENTITY
                if not bad:
                    raise
                for name in sorted(bad):
                    self.invalid_readings += 1
                    key = (int(fields["index"]), name)
                    if key not in self._logged:
                        self._logged.add(key)
                        log.warning(
                            "gpu_reading_invalid",
                            gpu=fields["index"],
                            field=name,
                            value=repr(fields.get(name))[:64],
                        )
                    fields[name] = () if name == "clock_events" else None
        return GpuTelemetry(**fields)

    def add(self, sample: GpuSample) -> None:
        """Add one sample."""
        self._windows.setdefault(sample.index, _GpuWindow()).add(sample)

    def drain(
        self,
        *,
        classes: dict[int, str],
        lost: set[int],
        locks: dict[int, int | None],
        health: Mapping[int, GpuHealthReport] | None = None,
        log: Any = None,
    ) -> tuple[list[GpuTelemetry], float, float]:
        """Records for every GPU, the node's summed mean GPU power (W) and energy delta (J);
        ``health`` are the GPUs' health counters due in this message. A reading nulled is
        logged through ``log`` (structlog's when None)."""
        health = health or {}
        log = log if log is not None else _log
        records: list[GpuTelemetry] = []
        total_w = 0.0
        total_j = 0.0
        for index, info in sorted(self.infos.items()):
            win = self._windows.pop(index, None)
            state = "lost" if index in lost else "ok"
            if win is None or win.last is None:
                records.append(
                    self._record(
                        log,
                        index=index,
                        uuid=info.uuid,
                        name=info.name,
                        priority_class=classes.get(index),
                        state=state,
                        power_limit_max_w=_w(info.power_limit_max_mw),
                        health=health.get(index),
                    )
                )
                continue
            s = win.last
            mean_mw = win.power_sum_mw / win.count if win.power_min_mw is not None else None
            delta_j = None
            if s.energy_mj is not None:
                prev = self._prev_energy_mj.get(index, win.first_energy_mj)
                if prev is not None and s.energy_mj >= prev:
                    delta_j = (s.energy_mj - prev) / 1000.0
                self._prev_energy_mj[index] = s.energy_mj
            record = self._record(
                log,
                index=index,
                uuid=info.uuid,
                name=info.name,
                priority_class=classes.get(index),
                state=state,
                samples=win.count,
                power_w=_w(s.power_mw),
                power_min_w=_w(win.power_min_mw),
                power_mean_w=_w(mean_mw),
                power_max_w=_w(win.power_max_mw),
                power_avg_w=_w(s.power_avg_mw),
                energy_j=None if s.energy_mj is None else s.energy_mj / 1000.0,
                energy_delta_j=delta_j,
                gpu_temp_c=s.gpu_temp_c,
                gpu_temp_max_c=win.temp_max_c,
                mem_temp_c=s.mem_temp_c,
                sm_clock_mhz=s.sm_clock_mhz,
                mem_clock_mhz=s.mem_clock_mhz,
                gpu_util_pct=s.gpu_util_pct,
                mem_util_pct=s.mem_util_pct,
                power_limit_w=_w(s.power_limit_mw),
                enforced_power_limit_w=_w(s.enforced_power_limit_mw),
                power_limit_max_w=_w(info.power_limit_max_mw),
                clock_event_reasons=win.reasons,
                clock_events=clock_event_names(win.reasons or 0),
                locked_sm_clock_max_mhz=locks.get(index),
                health=health.get(index),
            )
            records.append(record)
            if record.power_mean_w is not None:
                total_w += record.power_mean_w
            if record.energy_delta_j is not None:
                total_j += record.energy_delta_j
        return records, round(total_w, 3), round(total_j, 3)
