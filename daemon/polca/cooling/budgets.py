"""A cooling loop's capacity and the thermal power budgets it gives its racks.

Why this module exists: what a loop can still cool, given its readings, is a curve with its
own settings (``Derating``) and its own reasons to change (a new derating factor, another
split between racks), apart from the alarms and from the supervisor that calls it. Pure
functions of a loop's spec and readings: no I/O, no state, no clock.

**Capacity** (``derate``): rated capacity x max(floor, min(flow, pumps) x supply_temp),
where flow = measured / design flow (at most 1); pumps = 1 with redundancy,
``redundancy_lost_fraction`` with only the required pumps left, proportionally less below
that; supply_temp = 1 up to ``derate_start_c``, linear to ``supply_floor_fraction`` at
``supply_critical_c``. Flow and pumps share a min() because a failed pump shows as lost
flow too. An unreported reading derates nothing (but its alarm cannot raise either).

**Stale CDU** (``stale_derate``): the last fresh derating (none: the rating) times
``stale_fraction``.

**Thermal budget**: capacity / capture_fraction (in rack electrical watts), split between
the loop's racks by ``rack_weights`` (equally by default): a static split, not by current
load, so an idle rack keeps room to start and a busy one cannot starve the others. A rack's
effective budget is the lower of its electrical and thermal budgets
(``effective_rack_budgets``); a row whose racks all have a thermal budget works on at most
their sum (``effective_row_budget_w``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from polca.cooling.loops import LoopSpec

__all__ = [
    "Derate",
    "derate",
    "effective_rack_budgets",
    "effective_row_budget_w",
    "flow_factor",
    "pump_factor",
    "rack_shares",
    "split_budget",
    "stale_derate",
    "supply_temp_factor",
    "thermal_budget_w",
]

_W_PER_KW: Final = 1000.0


@dataclass(frozen=True, slots=True)
class Derate:
    """The factors (0..1) applied to the rated capacity, and their product."""

    flow: float = 1.0
    pumps: float = 1.0
    supply_temp: float = 1.0
    stale: float = 1.0
    total: float = 1.0


def flow_factor(flow_fraction: float | None) -> float:
    """Capacity factor of the measured flow (fraction of design): clamped to 0..1."""
    if flow_fraction is None or not math.isfinite(flow_fraction):
        return 1.0
    return min(1.0, max(0.0, flow_fraction))


def pump_factor(spec: LoopSpec, pumps_available: int | None) -> float:
    """Capacity factor of pump redundancy (1 with a spare, less without, less below N)."""
    if pumps_available is None or pumps_available >= min(spec.pumps_required + 1, spec.pump_count):
        return 1.0
    lost = spec.derating.redundancy_lost_fraction if spec.redundant else 1.0
    if pumps_available >= spec.pumps_required:
        return lost
    return lost * max(0, pumps_available) / spec.pumps_required


def supply_temp_factor(spec: LoopSpec, supply_temp_c: float | None) -> float:
    """Capacity factor of the supply temperature: 1 up to the derate start, then linear."""
    if supply_temp_c is None or not math.isfinite(supply_temp_c):
        return 1.0
    start_c = spec.derate_start_c
    if supply_temp_c <= start_c:
        return 1.0
    floor = spec.derating.supply_floor_fraction
    if supply_temp_c >= spec.supply_critical_c:
        return floor
    span = (supply_temp_c - start_c) / (spec.supply_critical_c - start_c)
    return 1.0 - (1.0 - floor) * span


def derate(
    spec: LoopSpec,
    *,
    flow_fraction: float | None,
    pumps_available: int | None,
    supply_temp_c: float | None,
) -> Derate:
    """The capacity derating of fresh readings (see the module docstring); never below floor."""
    flow = flow_factor(flow_fraction)
    pumps = pump_factor(spec, pumps_available)
    temp = supply_temp_factor(spec, supply_temp_c)
    total = max(spec.derating.floor_fraction, min(flow, pumps) * temp)
    return Derate(flow=flow, pumps=pumps, supply_temp=temp, total=total)


def stale_derate(spec: LoopSpec, last_fresh: Derate | None) -> Derate:
    """The derating while the CDU is silent: the last fresh one times ``stale_fraction``."""
    base = last_fresh or Derate()
    stale = spec.derating.stale_fraction
    total = max(spec.derating.floor_fraction, base.total * stale)
    return Derate(
        flow=base.flow, pumps=base.pumps, supply_temp=base.supply_temp, stale=stale, total=total
    )


def thermal_budget_w(spec: LoopSpec, capacity_kw: float) -> float:
    """The rack electrical power a loop of ``capacity_kw`` can cool (capacity / capture)."""
    return capacity_kw * _W_PER_KW / spec.capture_fraction


def rack_shares(spec: LoopSpec) -> dict[str, float]:
    """Each rack's share (0..1, summing to 1) of its loop's budget, by ``rack_weights``."""
    weights = {rack: spec.rack_weights.get(rack, 1.0) for rack in spec.racks}
    return {rack: w / sum(weights.values()) for rack, w in weights.items()}


def split_budget(spec: LoopSpec, budget_w: float) -> dict[str, float]:
    """A loop's thermal budget shared between its racks by ``rack_weights`` (default 1)."""
    weights = {rack: spec.rack_weights.get(rack, 1.0) for rack in spec.racks}
    total = sum(weights.values())
    return {rack: budget_w * weight / total for rack, weight in weights.items()}


def effective_rack_budgets(
    electrical: Mapping[str, float | None], thermal: Mapping[str, float]
) -> dict[str, float]:
    """Each rack's effective budget: the lower of its electrical and thermal budgets.

    A rack with only one of them gets that one; a rack with neither (no electrical budget,
    on no loop) is left out: it has no rack-scope budget at all.
    """
    out: dict[str, float] = {}
    for rack in dict.fromkeys([*electrical, *thermal]):
        budgets = [b for b in (electrical.get(rack), thermal.get(rack)) if b is not None]
        if budgets:
            out[rack] = min(budgets)
    return out


def effective_row_budget_w(
    row_budget_w: float, racks: Iterable[str], thermal: Mapping[str, float]
) -> float:
    """A row's budget lowered to the sum of its racks' thermal budgets when all have one.

    A row with any rack on no loop (air-cooled) keeps its electrical budget: its racks'
    thermal limits are then enforced by the rack-scope controllers alone.
    """
    names = list(racks)
    if not names or any(rack not in thermal for rack in names):
        return row_budget_w
    return min(row_budget_w, sum(thermal[rack] for rack in names))
