"""What the cooling supervision knows of one loop at one instant.

Why this module exists: the alarm conditions (``alarms``), the derating (``budgets``) and
the heat balance (``heat``) read the same few parts of a CDU message. ``Reading`` parses
them once per message (pump and leak-detector states into counts, names and ranks);
``Evidence`` adds what the supervisor derives at each step (staleness, flow fraction,
supply-return difference, the filtered heat-balance error), and is all an alarm condition
may look at. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from polca.telemetry.schema import CduTelemetry

__all__ = ["Evidence", "Reading"]

_STATUS_RANK: Final = {"ok": 0, "warning": 1, "critical": 2}


# Not frozen: built for every CDU message, and a frozen dataclass's __init__ costs several
# times more; nothing mutates it after ``of``.
@dataclass(slots=True)
class Reading:
    """The parts of a CDU message the supervisor uses."""

    supply_c: float | None
    return_c: float | None
    flow_lpm: float | None
    heat_removed_kw: float | None
    pumps_available: int | None  # None: the CDU reports no pumps
    pumps_down: tuple[str, ...]  # failed or off
    pumps_failed: tuple[str, ...]
    leaks: tuple[str, ...]  # detectors not ok, critical ones first
    leak_rank: int  # 0 all ok, 1 a warning, 3 a critical
    status_rank: int  # 0 ok, 1 warning, 2 critical

    @classmethod
    def of(cls, cdu: CduTelemetry) -> Reading:
        """The reading of one CDU message."""
        sec = cdu.secondary
        available = 0
        down: list[str] = []
        failed: list[str] = []
        for pump in cdu.pumps:
            if pump.state in ("running", "standby"):
                available += 1
            else:
                down.append(pump.name)
                if pump.state == "failed":
                    failed.append(pump.name)
        warning: list[str] = []
        critical: list[str] = []
        for detector in cdu.leak_detectors:
            if detector.state == "critical":
                critical.append(detector.name)
            elif detector.state == "warning":
                warning.append(detector.name)
        return cls(
            sec.supply_temp_c,
            sec.return_temp_c,
            sec.flow_lpm,
            sec.heat_removed_kw,
            available if cdu.pumps else None,
            tuple(down),
            tuple(failed),
            (*critical, *warning),
            3 if critical else 1 if warning else 0,
            _STATUS_RANK[cdu.status],
        )


@dataclass(frozen=True, slots=True)
class Evidence:
    """One loop at one step, as the alarm conditions see it.

    ``reading`` is None while the CDU is stale or before it was first heard from; the
    derived values are None where their inputs are not reported (or not judged, for the
    heat balance).
    """

    reading: Reading | None
    stale: bool
    age_s: float  # since the last message (since the first step if none came)
    flow_fraction: float | None  # measured / design flow
    delta_t_c: float | None  # return - supply
    balance_pct: float | None  # filtered heat-balance error, signed
