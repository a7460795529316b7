"""The supervised cooling loops, as the aggregator's ``cooling:`` settings describe them.

Why this module exists: the loops' ratings and limits are configuration, validated once
at start, and change for other reasons than the supervision that reads them. One loop
per coolant distribution unit (CDU). A loop serves a set of racks (a rack is served by at
most one loop) and carries the CDU's ratings (heat capacity, design flow, pump
redundancy), its supply-temperature setpoint and limits, the share of rack power its cold
plates capture, and how the supervision (``polca.cooling.supervisor``, ``.alarms``,
``.budgets``) debounces, escalates and derates. Every option has a documented default
except the two ratings no default could guess (``heat_capacity_kw`` and
``design_flow_lpm``). Pure pydantic: no I/O, and no supervision logic.

Named ``loops`` rather than ``settings`` or ``config``: ``polca.settings`` is every
process's base settings, and ``polca.cdu.config`` the settings of a ``polca cdu``
process (a CDU source); this module is neither, it is the model of the loops supervised.

Rack names refer to racks of the aggregator's rows (``AggregatorSettings.rows``);
``CoolingSettings.check_racks`` checks them against that topology.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

Severity = Literal["warning", "degraded", "critical"]
"""Alarm severities, in escalation order."""

SEVERITIES: tuple[Severity, ...] = ("warning", "degraded", "critical")

_RANK: dict[Severity, int] = {"warning": 1, "degraded": 2, "critical": 3}

_NAME = r"^[A-Za-z0-9_.:-]{1,128}$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AlarmTiming(_Model):
    """Debounce, clearing and escalation of a loop's alarms (the CDU lessons: no flapping)."""

    raise_after_s: float = Field(
        10.0,
        ge=0,
        description="A warning or degraded condition must hold this long before it raises "
        "(or escalates) an alarm.",
    )
    critical_raise_after_s: float = Field(
        2.0,
        ge=0,
        description="A critical condition (leak, loss of flow, supply above its critical "
        "limit, too few pumps) must hold this long: emergencies act (nearly) at once.",
    )
    heat_balance_raise_after_s: float = Field(
        120.0,
        ge=0,
        description="The heat balance must disagree this long before sensor_disagreement "
        "raises (load swings and the loop's thermal lag cause brief disagreements).",
    )
    clear_after_s: float = Field(
        30.0,
        ge=0,
        description="A condition must stay gone (past its hysteresis) this long before its "
        "alarm clears or steps down; also the dwell of each step down of a forced level.",
    )
    escalate_after_s: float = Field(
        300.0,
        gt=0,
        description="An alarm whose condition persists escalates one severity after this "
        "long (warning -> degraded -> critical), up to escalation_ceiling.",
    )
    escalation_ceiling: Severity = Field(
        "degraded",
        description="Highest severity reached by persistence alone; critical otherwise "
        "needs a critical condition.",
    )


class Hysteresis(_Model):
    """How far past its threshold a reading must go back before an alarm stands down."""

    temp_c: float = Field(1.0, ge=0, description="Supply temperature (vendor CDUs use 1 C).")
    delta_t_c: float = Field(0.5, ge=0, description="Supply-return temperature difference.")
    flow_fraction: float = Field(
        0.05, ge=0, le=0.5, description="Flow, as a fraction of the design flow."
    )
    heat_balance_pct: float = Field(
        5.0, ge=0, description="Heat-balance error, in percentage points."
    )


class Derating(_Model):
    """The thermal budget's derating curve (see ``polca.cooling.budgets.derate``).

    capacity = heat_capacity_kw x max(floor_fraction, min(flow, pumps) x supply_temp x stale)
    """

    supply_derate_start_c: float | None = Field(
        None,
        description="Supply temperature where derating starts (factor 1 at or below); none "
        "means supply_warning_c.",
    )
    supply_floor_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Supply-temperature factor at supply_critical_c and above (linear from 1 "
        "at supply_derate_start_c).",
    )
    redundancy_lost_fraction: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Pump factor while only the required pumps are left (N of N+1): one more "
        "failure stops the loop, so keep a reserve.",
    )
    stale_fraction: float = Field(
        0.75,
        gt=0,
        le=1,
        description="While the CDU is silent: the last fresh capacity (the rated one if it "
        "never reported) times this.",
    )
    floor_fraction: float = Field(
        0.05,
        gt=0,
        le=1,
        description="The capacity never derates below this fraction of the rating, so every "
        "budget stays positive; emergencies act through forced levels instead.",
    )


class LoopSpec(_Model):
    """One liquid-cooling loop: the CDU that drives it, its ratings and the racks it serves."""

    name: str = Field(pattern=_NAME, description="Loop name (topic segment, dashboards).")
    cdu: str = Field(pattern=_NAME, description="The CDU's id, as in its telemetry (cdu).")
    racks: tuple[str, ...] = Field(min_length=1, description="Racks this loop cools.")
    rack_weights: dict[str, float] = Field(
        default_factory=dict,
        description="Share of the loop's thermal budget per rack (relative weights, e.g. the "
        "racks' cold-plate counts); a rack not listed weighs 1.",
    )
    heat_capacity_kw: float = Field(gt=0, description="Rated heat removal of the CDU.")
    design_flow_lpm: float = Field(
        gt=0, description="Secondary flow the loop runs at when healthy (the flow setpoint)."
    )
    supply_setpoint_c: float = Field(30.0, description="Secondary supply temperature setpoint.")
    supply_warning_c: float = Field(35.0, description="Supply temperature: warning at or above.")
    supply_critical_c: float = Field(
        40.0, description="Supply temperature: critical at or above (the IT equipment's limit)."
    )
    max_delta_t_c: float = Field(
        12.0, gt=0, description="Supply-return difference: warning at or above (starved flow)."
    )
    delta_t_degraded_margin_c: float = Field(
        3.0, gt=0, description="Supply-return difference: degraded at max_delta_t_c plus this."
    )
    pump_count: int = Field(2, ge=1, le=16, description="Pumps installed (N+1: N + 1).")
    pumps_required: int = Field(
        1, ge=1, le=16, description="Pumps needed for the design flow (N of N+1)."
    )
    capture_fraction: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Share of rack electrical power the cold plates put into this loop (the "
        "rest goes to room air).",
    )
    min_flow_warning_fraction: float = Field(
        0.85, gt=0, le=1, description="Flow below this fraction of design flow: warning."
    )
    min_flow_degraded_fraction: float = Field(
        0.7, gt=0, le=1, description="Flow below this fraction of design flow: degraded."
    )
    min_flow_critical_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Flow below this fraction of design flow: critical (loss of flow).",
    )
    heat_balance_tolerance_pct: float = Field(
        20.0,
        gt=0,
        description="Measured heat removed may differ from the racks' captured heat by this "
        "much (% of the latter) before sensor_disagreement.",
    )
    heat_balance_min_load_kw: float | None = Field(
        None,
        ge=0,
        description="Below this captured heat the heat balance is not judged; none means "
        "10% of heat_capacity_kw.",
    )
    heat_balance_window_s: float = Field(
        60.0, gt=0, description="Time constant of the filter on both sides of the heat balance."
    )
    heat_balance_lag_s: float = Field(
        30.0,
        ge=0,
        description="Thermal lag of the loop: the racks' heat reaches the CDU's sensors "
        "about this much later (a first-order lag applied to the electrical side).",
    )
    coolant_cp_kj_per_kg_k: float = Field(
        4.18, gt=0, description="Coolant specific heat (water 4.18; 25% propylene glycol 3.9)."
    )
    coolant_density_kg_per_l: float = Field(
        0.996, gt=0, description="Coolant density (water at 30 C 0.996; 25% propylene glycol 1.02)."
    )
    timing: AlarmTiming = Field(
        default_factory=AlarmTiming, description="Debounce, clearing and escalation."
    )
    hysteresis: Hysteresis = Field(
        default_factory=Hysteresis, description="How far back past a limit an alarm clears."
    )
    derating: Derating = Field(
        default_factory=Derating, description="The thermal budget's derating curve."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if len(set(self.racks)) != len(self.racks):
            msg = f"loop {self.name}: racks listed twice: {_twice(self.racks)}"
            raise ValueError(msg)
        unknown = sorted(set(self.rack_weights) - set(self.racks))
        if unknown:
            msg = f"loop {self.name}: rack_weights names racks it does not serve: {unknown}"
            raise ValueError(msg)
        if any(w <= 0 for w in self.rack_weights.values()):
            msg = f"loop {self.name}: rack_weights must be positive, got {self.rack_weights}"
            raise ValueError(msg)
        if not self.supply_setpoint_c < self.supply_warning_c < self.supply_critical_c:
            msg = (
                f"loop {self.name}: need supply_setpoint_c ({self.supply_setpoint_c:g}) < "
                f"supply_warning_c ({self.supply_warning_c:g}) < supply_critical_c "
                f"({self.supply_critical_c:g})"
            )
            raise ValueError(msg)
        start_c = self.derating.supply_derate_start_c
        if start_c is not None and not (self.supply_setpoint_c <= start_c < self.supply_critical_c):
            msg = (
                f"loop {self.name}: derating.supply_derate_start_c ({start_c:g}) must be in "
                f"[supply_setpoint_c, supply_critical_c)"
            )
            raise ValueError(msg)
        if not (
            self.min_flow_critical_fraction
            < self.min_flow_degraded_fraction
            < self.min_flow_warning_fraction
        ):
            msg = (
                f"loop {self.name}: need min_flow_critical_fraction < "
                f"min_flow_degraded_fraction < min_flow_warning_fraction, got "
                f"{self.min_flow_critical_fraction:g}, {self.min_flow_degraded_fraction:g}, "
                f"{self.min_flow_warning_fraction:g}"
            )
            raise ValueError(msg)
        if self.pumps_required > self.pump_count:
            msg = (
                f"loop {self.name}: pumps_required ({self.pumps_required}) exceeds "
                f"pump_count ({self.pump_count})"
            )
            raise ValueError(msg)
        return self

    @property
    def derate_start_c(self) -> float:
        """Supply temperature where the supply-temperature derating starts."""
        start_c = self.derating.supply_derate_start_c
        return self.supply_warning_c if start_c is None else start_c

    @property
    def min_load_kw(self) -> float:
        """Captured heat below which the heat balance is not judged."""
        if self.heat_balance_min_load_kw is not None:
            return self.heat_balance_min_load_kw
        return 0.1 * self.heat_capacity_kw

    @property
    def redundant(self) -> bool:
        """Whether the loop has more pumps than it needs (N+1 or better)."""
        return self.pump_count > self.pumps_required


class ForcedLevels(_Model):
    """The control level forced on a loop's racks by the loop's worst alarm severity.

    Levels are those of the node policy (1 = its first level, e.g. T1); a level above the
    policy's top level means the top level (the brake).
    """

    warning_level: int = Field(0, ge=0, le=64, description="While the worst alarm is a warning.")
    degraded_level: int = Field(
        2, ge=0, le=64, description="While the worst alarm is degraded (T2 in POLCA policies)."
    )
    critical_level: int | None = Field(
        None,
        ge=0,
        le=64,
        description="While an alarm is critical (an emergency); none means the policy's top "
        "level (the brake).",
    )

    @model_validator(mode="after")
    def _ascending(self) -> Self:
        critical = 64 if self.critical_level is None else self.critical_level
        if not self.warning_level <= self.degraded_level <= critical:
            msg = (
                f"forced levels must not descend with severity: warning {self.warning_level}, "
                f"degraded {self.degraded_level}, critical {self.critical_level}"
            )
            raise ValueError(msg)
        return self


class CoolingSettings(_Model):
    """The liquid-cooling loops this aggregator supervises (none: no cooling supervision)."""

    loops: tuple[LoopSpec, ...] = Field((), description="One entry per CDU.")
    stale_after_s: float = Field(
        5.0,
        gt=0,
        description="A CDU silent for this long is stale: its loop's budget is reduced "
        "(derating.stale_fraction) and telemetry_stale raises.",
    )
    forced: ForcedLevels = Field(
        default_factory=ForcedLevels,
        description="Control levels forced on a loop's racks by its worst alarm severity.",
    )

    @model_validator(mode="after")
    def _unique(self) -> Self:
        names = [loop.name for loop in self.loops]
        if len(set(names)) != len(names):
            msg = f"loop names must be unique, got twice: {_twice(names)}"
            raise ValueError(msg)
        cdus = [loop.cdu for loop in self.loops]
        if len(set(cdus)) != len(cdus):
            msg = f"each CDU drives one loop, got twice: {_twice(cdus)}"
            raise ValueError(msg)
        seen: dict[str, str] = {}
        for loop in self.loops:
            for rack in loop.racks:
                if rack in seen:
                    msg = f"rack {rack} is served by two loops: {seen[rack]} and {loop.name}"
                    raise ValueError(msg)
                seen[rack] = loop.name
        return self

    def loop_of(self, rack: str) -> str | None:
        """The loop serving ``rack``, or None for a rack on no loop (air-cooled)."""
        for loop in self.loops:
            if rack in loop.racks:
                return loop.name
        return None

    def check_racks(self, racks_by_row: Mapping[str, Iterable[str]]) -> None:
        """Check every loop's racks against the rows' topology (row name -> its racks).

        Raises:
            ValueError: a loop names a rack in no row, or a rack name used by two rows
                (a loop could not tell which one it cools).
        """
        rows_of: dict[str, list[str]] = {}
        for row, racks in racks_by_row.items():
            for rack in racks:
                rows_of.setdefault(rack, []).append(row)
        for loop in self.loops:
            for rack in loop.racks:
                rows = rows_of.get(rack, [])
                if not rows:
                    msg = f"loop {loop.name} serves rack {rack}, which is in no row"
                    raise ValueError(msg)
                if len(rows) > 1:
                    msg = (
                        f"loop {loop.name} serves rack {rack}, a name used in rows {rows}: "
                        "rack names on cooling loops must be unique across rows"
                    )
                    raise ValueError(msg)


def severity_rank(severity: Severity | None) -> int:
    """0 for none, 1 warning, 2 degraded, 3 critical."""
    return 0 if severity is None else _RANK[severity]


def _twice(names: Iterable[str]) -> list[str]:
    return sorted(name for name, count in Counter(names).items() if count > 1)
