"""A simulated coolant distribution unit (CDU): the cooling plant of the demo and the tests.

``SimulatedCdu`` models one liquid-cooling loop: a CDU whose pumps push coolant through the
racks' cold plates (the secondary or technology cooling system loop) and whose heat
exchanger hands the heat to the facility water (the primary loop). It is a small lumped
model, physical enough that every CDU alarm of ``docs/cooling.md`` can be provoked for the
right reason, and cheap enough to run a day at 1 s steps in about a second:

- Heat input: the racks' electrical power times the liquid capture fraction (the caller
  supplies it, e.g. from the agents' GPU telemetry), held until it changes.
- Rack side: one thermal mass ``C = loop_volume_l x rho x cp`` at the return temperature,
  ``C dT_r/dt = Q_in - m cp (T_r - T_s)``, so at steady state ``T_r = T_s + Q / (m cp)``;
  integrated exactly (exponential), so it is stable at any step and with no flow at all.
- Heat exchanger: the valve holds the supply at its setpoint while the exchanger can; it
  cannot cool below ``T_fw + Q / UA`` (the approach), so when fouling lowers UA or the
  facility water warms, the supply settles above the setpoint, through a first-order lag
  of ``HX_TAU_S``. The primary side carries the same heat back to the facility.
- Pumps: N + redundancy pumps, N running at a speed that holds the design flow, the rest
  on standby. A failed running pump spins down; a standby starts after
  ``failover_delay_s`` and spins up (so the flow dips, then recovers); with no standby
  left the flow collapses. Differential pressure follows the pump head (``~ flow^2``).
- Sensors: seeded, bounded Gaussian noise on every reading; the CDU's own heat-removed
  figure is computed, as a real CDU does, from its (possibly faulty) flow and temperature
  sensors, so sensor faults show up as a heat-balance mismatch.

Faults, each with a counterpart that clears it: ``fail_pump``/``restore_pump``,
``block_flow``/``clear_blockage``, ``foul``/``clear_fouling``,
``raise_facility_water``/``restore_facility_water``, ``leak``/``clear_leak``,
``stick_sensor``/``unstick_sensor``, ``drift_sensor``/``clear_drift``,
``lose_telemetry``/``restore_telemetry``; ``inject(kind)``/``clear(kind)`` name them for
parametrised tests, ``clear_faults()`` clears all.

The model advances lazily, in sub-steps of at most ``STEP_S``, to the injected clock's time
(or an explicit ``now_s``) whenever it is read, so it runs no thread and costs nothing
between reads. Given the same seed and the same sequence of calls it produces the same
readings. It must stay free of I/O and threads; ``healthy_day()`` and ``run_trace()``
generate long traces for the alarm tests.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

from polca.cooling.faults import FAULT_KINDS, FaultKind
from polca.seeds import MASK64, mix64
from polca.telemetry.schema import CduTelemetry

__all__ = [
    "COOLANT_CP_KJ_PER_KG_K",
    "COOLANT_DENSITY_KG_PER_L",
    "FAULT_KINDS",
    "SENSORS",
    "CduRatings",
    "CduSample",
    "DiurnalLoad",
    "FaultKind",
    "ManualClock",
    "SimulatedCdu",
    "healthy_day",
    "heat_flow_kw",
    "mass_flow_kg_s",
    "run_trace",
]

PumpState = Literal["running", "standby", "failed", "off"]
LeakState = Literal["ok", "warning", "critical"]
Health = Literal["ok", "warning", "critical"]

# The coolant: water (DI water with inhibitor). PG25 would be cp ~3.8 kJ/(kg K) and rho
# ~1.02 kg/L; the supervisor's heat balance must use the same constants as the CDU.
COOLANT_CP_KJ_PER_KG_K = 4.18
COOLANT_DENSITY_KG_PER_L = 0.996  # water at about 30 C

STEP_S = 1.0  # longest integration sub-step (the updates are exact, this bounds events)
MAX_STEPS = 10_000  # a longer gap is integrated in coarser steps instead
HX_TAU_S = 30.0  # heat exchanger and valve loop: supply temperature lag
PUMP_TAU_S = 1.5  # pump spin-up and spin-down
FLOW_TAU_S = 1.0  # hydraulic lag of the loop
NOMINAL_PUMP_SPEED = 0.7  # N pumps at this speed deliver the design flow
MIN_PUMP_SPEED = 0.15  # controller floor (Vertiv CoolChip CDU 600: 15 %)
MAX_FOULING = 0.95  # fouling removes at most this fraction of UA
RACK_SIDE_MAX_C = 95.0  # without flow the cold plates would trip the GPUs long before this

TEMP_NOISE_C = 0.1  # sensor noise, one standard deviation
FLOW_NOISE_FRACTION = 0.004  # of the design flow
PRESSURE_NOISE_KPA = 0.5
VALVE_NOISE_PCT = 0.3
NOISE_CLIP_SIGMA = 3.0  # noise is bounded: no reading strays beyond 3 sigma (see sample)

SENSORS: tuple[str, ...] = (
    "secondary.supply_temp_c",
    "secondary.return_temp_c",
    "secondary.flow_lpm",
    "secondary.delta_pressure_kpa",
    "primary.supply_temp_c",
    "primary.return_temp_c",
    "primary.flow_lpm",
    "valve_position_pct",
)
"""Readings that ``stick_sensor`` and ``drift_sensor`` accept (CduTelemetry dotted paths)."""


def mass_flow_kg_s(flow_lpm: float) -> float:
    """Coolant mass flow in kg/s for a volume flow in L/min."""
    return flow_lpm * COOLANT_DENSITY_KG_PER_L / 60.0


def heat_flow_kw(flow_lpm: float, delta_t_c: float) -> float:
    """Heat carried by ``flow_lpm`` of coolant warmed by ``delta_t_c``: m x cp x dT, in kW."""
    return mass_flow_kg_s(flow_lpm) * COOLANT_CP_KJ_PER_KG_K * delta_t_c


@dataclass(frozen=True, slots=True)
class CduRatings:
    """What one CDU and its loop are rated for (the defaults: a 100 kW in-row CDU).

    ``heat_capacity_kw`` is the heat it removes at the design flow with the design facility
    water and a clean exchanger, ``hx_approach_c`` the exchanger's approach (secondary
    supply minus facility supply) at that load; together they give its UA.
    """

    heat_capacity_kw: float = 100.0
    design_flow_lpm: float = 150.0  # ~1.5 L/min per kW (OCP guidance at a 10 K rise)
    supply_setpoint_c: float = 30.0
    supply_min_c: float = 20.0
    supply_max_c: float = 35.0
    max_delta_t_c: float = 12.0
    pump_count: int = 2
    pump_redundancy: int = 1  # N+1: one pump on standby
    capture_fraction: float = 0.8  # share of rack power taken by the liquid
    design_delta_pressure_kpa: float = 150.0  # pump head at the design flow
    facility_supply_c: float = 22.0  # design facility water supply (ASHRAE W27 class)
    hx_approach_c: float = 4.0
    failover_delay_s: float = 2.0
    loop_volume_l: float = 60.0  # coolant on the rack side: the loop's thermal mass
    leak_detectors: int = 2

    def __post_init__(self) -> None:
        """Reject ratings the model cannot run with, naming the field."""
        positive = (
            "heat_capacity_kw",
            "design_flow_lpm",
            "max_delta_t_c",
            "design_delta_pressure_kpa",
            "hx_approach_c",
            "loop_volume_l",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                msg = f"CDU rating {name} must be > 0, got {getattr(self, name)}"
                raise ValueError(msg)
        if not self.supply_min_c < self.supply_setpoint_c < self.supply_max_c:
            msg = (
                f"CDU supply limits must bracket the setpoint: {self.supply_min_c} < "
                f"{self.supply_setpoint_c} < {self.supply_max_c} does not hold"
            )
            raise ValueError(msg)
        if not 1 <= self.pump_count <= 16 or not 0 <= self.pump_redundancy < self.pump_count:
            msg = (
                f"CDU needs 1-16 pumps and fewer standby than pumps: pump_count "
                f"{self.pump_count}, pump_redundancy {self.pump_redundancy}"
            )
            raise ValueError(msg)
        if not 0 < self.capture_fraction <= 1:
            msg = f"capture_fraction must be in (0, 1], got {self.capture_fraction}"
            raise ValueError(msg)
        if self.failover_delay_s < 0 or not 0 <= self.leak_detectors <= 64:
            msg = (
                f"failover_delay_s must be >= 0 and leak_detectors 0-64: "
                f"{self.failover_delay_s}, {self.leak_detectors}"
            )
            raise ValueError(msg)

    @property
    def pumps_required(self) -> int:
        """Pumps that must run to deliver the design flow (N of N + redundancy)."""
        return self.pump_count - self.pump_redundancy

    @property
    def ua_kw_per_k(self) -> float:
        """The clean exchanger's UA: rated heat over the rated approach."""
        return self.heat_capacity_kw / self.hx_approach_c

    @property
    def loop_heat_capacity_kj_per_k(self) -> float:
        """Thermal mass of the rack-side coolant."""
        return self.loop_volume_l * COOLANT_DENSITY_KG_PER_L * COOLANT_CP_KJ_PER_KG_K


class CduSample(NamedTuple):
    """One reading of every sensor, as the CDU would report it (noise and faults included).

    ``heat_input_kw`` is the true heat put into the loop (not a sensor). ``pumps`` holds
    ``(name, state, speed_pct)``, ``leak_detectors`` ``(name, state)``.
    ``telemetry_lost`` says that the CDU is not publishing this reading.

    A named tuple rather than a frozen dataclass: a day-long trace builds 86,400 of them
    and a tuple is built four times faster.
    """

    t_s: float
    ts_ns: int
    cdu: str
    loop: str
    heat_input_kw: float
    supply_temp_c: float
    return_temp_c: float
    flow_lpm: float
    delta_pressure_kpa: float
    heat_removed_kw: float
    primary_supply_temp_c: float
    primary_return_temp_c: float
    primary_flow_lpm: float
    primary_heat_removed_kw: float
    valve_position_pct: float
    pumps: tuple[tuple[str, PumpState, float], ...]
    leak_detectors: tuple[tuple[str, LeakState], ...]
    status: Health
    telemetry_lost: bool = False

    def to_telemetry(self) -> CduTelemetry:
        """The wire message of this reading (validated), rounded to sensor resolution.

        Temperatures, flows and pressures to 0.01, heat to 0.001 kW, percentages to 0.1.
        """
        # One nested dict validated at once is twice as fast as nested model constructors.
        return CduTelemetry.model_validate(
            {
                "ts_ns": self.ts_ns,
                "cdu": self.cdu,
                "loop": self.loop,
                "secondary": {
                    "supply_temp_c": round(self.supply_temp_c, 2),
                    "return_temp_c": round(self.return_temp_c, 2),
                    "flow_lpm": round(self.flow_lpm, 2),
                    "delta_pressure_kpa": round(self.delta_pressure_kpa, 2),
                    "heat_removed_kw": round(self.heat_removed_kw, 3),
                },
                "primary": {
                    "supply_temp_c": round(self.primary_supply_temp_c, 2),
                    "return_temp_c": round(self.primary_return_temp_c, 2),
                    "flow_lpm": round(self.primary_flow_lpm, 2),
                    "heat_removed_kw": round(self.primary_heat_removed_kw, 3),
                },
                "pumps": [
                    {"name": name, "state": state, "speed_pct": round(speed, 1)}
                    for name, state, speed in self.pumps
                ],
                "leak_detectors": [
                    {"name": name, "state": state} for name, state in self.leak_detectors
                ],
                "valve_position_pct": round(self.valve_position_pct, 1),
                "status": self.status,
            }
        )


class ManualClock:
    """A clock that only moves when told: inject it for reproducible runs."""

    def __init__(self, start_s: float = 0.0) -> None:
        """Start at ``start_s`` seconds."""
        self.now_s = start_s

    def __call__(self) -> float:
        """The current time in seconds."""
        return self.now_s

    def advance(self, delta_s: float) -> float:
        """Move forward by ``delta_s`` seconds; returns the new time."""
        self.now_s += delta_s
        return self.now_s


@dataclass(slots=True)
class _Ramp:
    """A value moving linearly from ``start`` to ``end`` over ``[t0_s, t0_s + ramp_s]``."""

    start: float = 0.0
    end: float = 0.0
    t0_s: float = 0.0
    ramp_s: float = 0.0

    def at(self, t_s: float) -> float:
        if self.ramp_s <= 0 or t_s >= self.t0_s + self.ramp_s:
            return self.end
        if t_s <= self.t0_s:
            return self.start
        return self.start + (self.end - self.start) * (t_s - self.t0_s) / self.ramp_s


class SimulatedCdu:
    """One simulated CDU and its loop; see the module docstring for the model."""

    def __init__(
        self,
        name: str = "cdu1",
        *,
        loop: str = "loop1",
        ratings: CduRatings | None = None,
        seed: int = 0,
        clock: Callable[[], float] | None = None,
        time_ns: Callable[[], int] | None = None,
        epoch_ns: int = 0,
        heat_kw: float = 0.0,
        facility_supply_c: float | None = None,
    ) -> None:
        """Build the CDU at steady state for ``heat_kw``.

        ``clock`` gives monotonic seconds (default ``time.monotonic``); every reading and
        fault method advances the model to it unless given ``now_s``. Message timestamps
        come from ``time_ns`` when given; else ``time.time_ns`` with the default clock, or
        ``epoch_ns`` plus the simulated time with an injected one (reproducible runs).
        """
        self.name = name
        self.loop = loop
        self.ratings = r = ratings if ratings is not None else CduRatings()
        self._rng = random.Random(seed)  # noqa: S311 - simulation noise, not cryptography
        self._clock: Callable[[], float] = clock if clock is not None else time.monotonic
        if time_ns is not None:
            self._time_ns: Callable[[], int] | None = time_ns
        elif clock is None:
            self._time_ns = time.time_ns
        else:
            self._time_ns = None
        self._epoch_ns = epoch_ns
        self._t_s = self._clock()

        self._heat_kw = max(0.0, heat_kw)
        self._facility_c = r.facility_supply_c if facility_supply_c is None else facility_supply_c
        self._pump_max_lpm = r.design_flow_lpm / (r.pumps_required * NOMINAL_PUMP_SPEED)
        self._c_loop = r.loop_heat_capacity_kj_per_k
        self._pump_names = tuple(f"pump{i + 1}" for i in range(r.pump_count))
        self._pump_states: list[PumpState] = [
            "running" if i < r.pumps_required else "standby" for i in range(r.pump_count)
        ]
        self._pump_speeds = [
            NOMINAL_PUMP_SPEED if i < r.pumps_required else 0.0 for i in range(r.pump_count)
        ]
        self._failover_at_s: float | None = None
        self._flow_lpm = r.design_flow_lpm
        supply_c = max(r.supply_setpoint_c, self._facility_c + self._heat_kw / r.ua_kw_per_k)
        self._supply_c = supply_c
        self._return_c = supply_c + self._heat_kw / self._mcp(self._flow_lpm)

        # Faults.
        self._blockage = 0.0
        self._fouling = _Ramp()
        self._facility_offset = _Ramp()
        self._leak_names = tuple(f"leak{i + 1}" for i in range(r.leak_detectors))
        self._leaks: dict[int, tuple[float, float | None]] = {}  # index -> (since, escalate)
        self._leak_flow_loss = 0.0
        self._stuck: dict[str, float] = {}
        self._drift: dict[str, tuple[float, float]] = {}  # sensor -> (rate per s, since)
        self._telemetry_lost = False
        self._last: list[float] = []  # the last reported value of each of SENSORS
        flow_sigma = FLOW_NOISE_FRACTION * r.design_flow_lpm
        self._two_sigmas = tuple(
            2.0 * sigma
            for sigma in (
                TEMP_NOISE_C,
                TEMP_NOISE_C,
                flow_sigma,
                PRESSURE_NOISE_KPA,
                TEMP_NOISE_C,
                TEMP_NOISE_C,
                flow_sigma,
                VALVE_NOISE_PCT,
            )
        )
        self._no_leaks: tuple[tuple[str, LeakState], ...] = tuple(
            (name, "ok") for name in self._leak_names
        )

        self._alpha_cache: dict[float, tuple[float, float, float]] = {}

    # -- inputs ---------------------------------------------------------------------------

    @property
    def heat_input_kw(self) -> float:
        """The heat going into the loop now (kW)."""
        return self._heat_kw

    def set_heat_input_kw(self, heat_kw: float, *, now_s: float | None = None) -> None:
        """Set the heat the racks put into the loop, from now on."""
        self._advance(now_s)
        self._heat_kw = max(0.0, heat_kw)

    def set_rack_power_w(
        self, power_w: Mapping[str, float], *, now_s: float | None = None
    ) -> float:
        """Set the heat input from the served racks' power; returns the heat in kW."""
        heat_kw = sum(power_w.values()) * self.ratings.capture_fraction / 1000.0
        self.set_heat_input_kw(heat_kw, now_s=now_s)
        return self._heat_kw

    def set_facility_supply_c(self, temp_c: float, *, now_s: float | None = None) -> None:
        """Set the facility water supply temperature (before any injected rise)."""
        self._advance(now_s)
        self._facility_c = temp_c

    # -- faults ---------------------------------------------------------------------------

    def fail_pump(self, index: int | None = None, *, now_s: float | None = None) -> None:
        """Fail one pump (default: the first running one); a standby takes over."""
        t = self._advance(now_s)
        if index is None:
            running = [i for i, s in enumerate(self._pump_states) if s == "running"]
            index = running[0] if running else 0
        self._check_pump(index)
        was_running = self._pump_states[index] == "running"
        self._pump_states[index] = "failed"
        if was_running and self._failover_at_s is None and "standby" in self._pump_states:
            self._failover_at_s = t + self.ratings.failover_delay_s

    def fail_all_pumps(self, *, now_s: float | None = None) -> None:
        """Fail every pump: the flow collapses."""
        self._advance(now_s)
        self._pump_states = ["failed"] * len(self._pump_states)
        self._failover_at_s = None

    def restore_pump(self, index: int | None = None, *, now_s: float | None = None) -> None:
        """Repair one pump (default: all failed ones); it returns as standby (or running)."""
        self._advance(now_s)
        indices = range(len(self._pump_states)) if index is None else [self._check_pump(index)]
        for i in indices:
            if self._pump_states[i] == "failed":
                self._pump_states[i] = "standby"
        if self._running_count() < self.ratings.pumps_required:
            # A repaired pump with nobody running: the controller starts it at once.
            self._failover_at_s = self._t_s

    def block_flow(self, fraction: float = 1.0, *, now_s: float | None = None) -> None:
        """Block the loop (a closed valve, a clogged strainer): the flow drops by fraction."""
        self._advance(now_s)
        self._blockage = min(max(fraction, 0.0), 1.0)

    def clear_blockage(self, *, now_s: float | None = None) -> None:
        """Open the loop again."""
        self.block_flow(0.0, now_s=now_s)

    def foul(self, fraction: float, *, ramp_s: float = 0.0, now_s: float | None = None) -> None:
        """Foul the heat exchanger: its UA drops by ``fraction``, linearly over ``ramp_s``."""
        t = self._advance(now_s)
        end = min(max(fraction, 0.0), MAX_FOULING)
        self._fouling = _Ramp(self._fouling.at(t), end, t, ramp_s)

    def clear_fouling(self, *, now_s: float | None = None) -> None:
        """Clean the exchanger (at once)."""
        self.foul(0.0, now_s=now_s)

    def raise_facility_water(
        self, delta_c: float, *, ramp_s: float = 0.0, now_s: float | None = None
    ) -> None:
        """Warm the facility water supply by ``delta_c``, linearly over ``ramp_s``."""
        t = self._advance(now_s)
        self._facility_offset = _Ramp(self._facility_offset.at(t), delta_c, t, ramp_s)

    def restore_facility_water(self, *, now_s: float | None = None) -> None:
        """Return the facility water to its set temperature (at once)."""
        self.raise_facility_water(0.0, now_s=now_s)

    def leak(
        self,
        detector: int = 0,
        *,
        escalate_after_s: float | None = 30.0,
        flow_loss_fraction: float = 0.0,
        now_s: float | None = None,
    ) -> None:
        """A leak at ``detector``: warning now, critical after ``escalate_after_s``.

        ``escalate_after_s=None`` keeps it at warning, ``0`` makes it critical at once.
        ``flow_loss_fraction`` models the coolant lost: flow and pressure drop by it.
        """
        t = self._advance(now_s)
        if not 0 <= detector < len(self._leak_names):
            msg = f"{self.name} has no leak detector {detector} (it has {len(self._leak_names)})"
            raise ValueError(msg)
        self._leaks[detector] = (t, escalate_after_s)
        self._leak_flow_loss = min(max(flow_loss_fraction, 0.0), 1.0)

    def clear_leak(self, detector: int | None = None, *, now_s: float | None = None) -> None:
        """Dry one detector (default: all); the flow loss ends with the last leak."""
        self._advance(now_s)
        if detector is None:
            self._leaks.clear()
        else:
            self._leaks.pop(detector, None)
        if not self._leaks:
            self._leak_flow_loss = 0.0

    def stick_sensor(
        self, sensor: str, value: float | None = None, *, now_s: float | None = None
    ) -> None:
        """Freeze a reading at ``value`` (default: its last reported value)."""
        self._advance(now_s)
        self._check_sensor(sensor)
        if value is None and self._last:
            value = self._last[SENSORS.index(sensor)]
        if value is None:
            value = self._true_values()[sensor]
        self._stuck[sensor] = value

    def unstick_sensor(self, sensor: str | None = None, *, now_s: float | None = None) -> None:
        """Let a frozen reading (default: all) follow the process again."""
        self._advance(now_s)
        if sensor is None:
            self._stuck.clear()
        else:
            self._stuck.pop(sensor, None)

    def drift_sensor(self, sensor: str, rate_per_s: float, *, now_s: float | None = None) -> None:
        """Make a reading drift linearly away from the truth by ``rate_per_s`` units/s."""
        t = self._advance(now_s)
        self._check_sensor(sensor)
        self._drift[sensor] = (rate_per_s, t)

    def clear_drift(self, sensor: str | None = None, *, now_s: float | None = None) -> None:
        """Recalibrate a drifting sensor (default: all)."""
        self._advance(now_s)
        if sensor is None:
            self._drift.clear()
        else:
            self._drift.pop(sensor, None)

    def lose_telemetry(self, *, now_s: float | None = None) -> None:
        """The CDU stops publishing: ``reading()`` returns None; the plant keeps running."""
        self._advance(now_s)
        self._telemetry_lost = True

    def restore_telemetry(self, *, now_s: float | None = None) -> None:
        """The CDU publishes again."""
        self._advance(now_s)
        self._telemetry_lost = False

    @property
    def telemetry_lost(self) -> bool:
        """Whether the telemetry-loss fault is active."""
        return self._telemetry_lost

    def inject(self, kind: FaultKind, *, now_s: float | None = None) -> None:
        """Inject a fault by name, with representative parameters (for parametrised tests).

        ``pump_failure`` fails the first running pump; ``loss_of_flow`` blocks the loop
        fully; ``fouling`` removes 80 % of UA; ``facility_water_rise`` adds 10 K;
        ``leak`` makes detector 0 warn and go critical after 30 s; ``stuck_sensor``
        freezes the supply temperature; ``drifting_sensor`` drifts it by +0.01 K/s.
        """
        match kind:
            case "pump_failure":
                self.fail_pump(now_s=now_s)
            case "all_pumps_failure":
                self.fail_all_pumps(now_s=now_s)
            case "loss_of_flow":
                self.block_flow(1.0, now_s=now_s)
            case "fouling":
                self.foul(0.8, now_s=now_s)
            case "facility_water_rise":
                self.raise_facility_water(10.0, now_s=now_s)
            case "leak":
                self.leak(0, now_s=now_s)
            case "stuck_sensor":
                self.stick_sensor("secondary.supply_temp_c", now_s=now_s)
            case "drifting_sensor":
                self.drift_sensor("secondary.supply_temp_c", 0.01, now_s=now_s)
            case "telemetry_loss":
                self.lose_telemetry(now_s=now_s)
            case _:
                msg = f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}"
                raise ValueError(msg)

    def clear(self, kind: FaultKind, *, now_s: float | None = None) -> None:
        """Clear a fault injected with ``inject(kind)``."""
        match kind:
            case "pump_failure" | "all_pumps_failure":
                self.restore_pump(now_s=now_s)
            case "loss_of_flow":
                self.clear_blockage(now_s=now_s)
            case "fouling":
                self.clear_fouling(now_s=now_s)
            case "facility_water_rise":
                self.restore_facility_water(now_s=now_s)
            case "leak":
                self.clear_leak(now_s=now_s)
            case "stuck_sensor":
                self.unstick_sensor(now_s=now_s)
            case "drifting_sensor":
                self.clear_drift(now_s=now_s)
            case "telemetry_loss":
                self.restore_telemetry(now_s=now_s)
            case _:
                msg = f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}"
                raise ValueError(msg)

    def clear_faults(self, *, now_s: float | None = None) -> None:
        """Clear every fault: repaired pumps, open loop, clean exchanger, good sensors."""
        for kind in FAULT_KINDS:
            self.clear(kind, now_s=now_s)

    # -- readings -------------------------------------------------------------------------

    def advance(self, now_s: float | None = None) -> float:
        """Integrate the model up to ``now_s`` (default: the clock); returns the time."""
        return self._advance(now_s)

    def sample(self, now_s: float | None = None) -> CduSample:
        """Advance to ``now_s`` (default: the clock) and read every sensor."""
        t = self._advance(now_s)
        fw_c, p_ret_c, p_flow, valve = self._primary(t)
        values = [
            self._supply_c,
            self._return_c,
            self._flow_lpm,
            self._delta_p_kpa(),
            fw_c,
            p_ret_c,
            p_flow,
            valve,
        ]
        # Bounded noise: the sum of three uniforms (Irwin-Hall), scaled to one sigma, is
        # bell-shaped, cheap and never beyond NOISE_CLIP_SIGMA = 3 sigma. It is drawn for
        # every sensor, faulty or not, so a fault does not shift the others' noise.
        rand = self._rng.random
        values = [
            v + (rand() + rand() + rand() - 1.5) * two_sigma
            for v, two_sigma in zip(values, self._two_sigmas, strict=True)
        ]
        if self._drift or self._stuck:
            for i, sensor in enumerate(SENSORS):
                drift = self._drift.get(sensor)
                if drift is not None:
                    values[i] += drift[0] * (t - drift[1])
                stuck = self._stuck.get(sensor)
                if stuck is not None:
                    values[i] = stuck
        values[2] = max(0.0, values[2])  # flows
        values[6] = max(0.0, values[6])
        values[7] = min(100.0, max(0.0, values[7]))  # valve
        self._last = values
        sup, ret, flow, dp, p_sup, p_ret, p_flw, valve_pct = values
        leaks = self._leak_states(t)
        pumps = tuple(
            (name, state, speed * 100.0 if state == "running" else 0.0)
            for name, state, speed in zip(
                self._pump_names, self._pump_states, self._pump_speeds, strict=True
            )
        )
        return CduSample(
            t_s=t,
            ts_ns=self._stamp_ns(t),
            cdu=self.name,
            loop=self.loop,
            heat_input_kw=self._heat_kw,
            supply_temp_c=sup,
            return_temp_c=ret,
            flow_lpm=flow,
            delta_pressure_kpa=dp,
            # A CDU computes its heat figure from its own sensors, faulty or not.
            heat_removed_kw=heat_flow_kw(flow, ret - sup),
            primary_supply_temp_c=p_sup,
            primary_return_temp_c=p_ret,
            primary_flow_lpm=p_flw,
            primary_heat_removed_kw=heat_flow_kw(p_flw, p_ret - p_sup),
            valve_position_pct=valve_pct,
            pumps=pumps,
            leak_detectors=leaks,
            status=self._status(leaks),
            telemetry_lost=self._telemetry_lost,
        )

    def reading(self, now_s: float | None = None) -> CduTelemetry | None:
        """The CDU's telemetry message now, or None while telemetry is lost."""
        if self._telemetry_lost:
            self._advance(now_s)
            return None
        return self.sample(now_s).to_telemetry()

    def true_state(self) -> dict[str, float]:
        """Noise- and fault-free values of every sensor in ``SENSORS`` (for tests)."""
        return self._true_values()

    # -- the model ------------------------------------------------------------------------

    def _now(self, now_s: float | None) -> float:
        return self._clock() if now_s is None else now_s

    def _stamp_ns(self, t_s: float) -> int:
        if self._time_ns is not None:
            return self._time_ns()
        return self._epoch_ns + round(t_s * 1e9)

    def _advance(self, now_s: float | None) -> float:
        """Integrate to ``now_s`` in sub-steps of at most STEP_S; never goes back."""
        target = self._now(now_s)
        gap = target - self._t_s
        if gap <= 0:
            return self._t_s
        steps = min(MAX_STEPS, max(1, math.ceil(gap / STEP_S - 1e-9)))
        h = gap / steps
        t = self._t_s
        for k in range(1, steps + 1):
            self._step(t, h)
            t = self._t_s + k * h
        self._t_s = target
        return target

    def _alphas(self, h: float) -> tuple[float, float, float]:
        """Lag factors 1 - exp(-h / tau) of the pumps, the flow and the exchanger."""
        cached = self._alpha_cache.get(h)
        if cached is None:
            cached = (
                -math.expm1(-h / PUMP_TAU_S),
                -math.expm1(-h / FLOW_TAU_S),
                -math.expm1(-h / HX_TAU_S),
            )
            if len(self._alpha_cache) < 64:
                self._alpha_cache[h] = cached
        return cached

    def _step(self, t: float, h: float) -> None:
        """One sub-step from ``t`` to ``t + h``."""
        r = self.ratings
        a_pump, a_flow, a_hx = self._alphas(h)
        t_end = t + h
        states = self._pump_states
        speeds = self._pump_speeds

        # Failover: start standby pumps once the delay has passed.
        running = self._running_count()
        if "standby" not in states:
            self._failover_at_s = None
        elif running < r.pumps_required:
            if self._failover_at_s is None:
                self._failover_at_s = t + r.failover_delay_s
            if t_end >= self._failover_at_s:
                for i, state in enumerate(states):
                    if running >= r.pumps_required:
                        break
                    if state == "standby":
                        states[i] = "running"
                        running += 1
                self._failover_at_s = None

        # Pumps: running ones chase the speed that holds the design flow through a blocked
        # loop, others spin down. Coolant lost to a leak they cannot make up for.
        open_fraction = 1.0 - self._blockage
        if running and open_fraction > 0.01:
            target_speed = r.design_flow_lpm / (running * self._pump_max_lpm * open_fraction)
            target_speed = min(1.0, max(MIN_PUMP_SPEED, target_speed))
        else:
            target_speed = 1.0
        capacity_lpm = 0.0
        for i, state in enumerate(states):
            goal = target_speed if state == "running" else 0.0
            speeds[i] += (goal - speeds[i]) * a_pump
            capacity_lpm += speeds[i] * self._pump_max_lpm
        delivered_lpm = capacity_lpm * open_fraction * (1.0 - self._leak_flow_loss)
        self._flow_lpm += (delivered_lpm - self._flow_lpm) * a_flow

        # Heat exchanger: hold the setpoint if the approach allows, with a lag.
        mcp = self._mcp(self._flow_lpm)
        ua = r.ua_kw_per_k * (1.0 - self._fouling.at(t_end))
        fw_c = self._facility_c + self._facility_offset.at(t_end)
        carried_kw = max(0.0, mcp * (self._return_c - self._supply_c))
        goal_c = max(r.supply_setpoint_c, fw_c + carried_kw / ua)
        goal_c = min(goal_c, max(self._return_c, fw_c))
        self._supply_c += (goal_c - self._supply_c) * a_hx

        # Rack side: C dT_r/dt = Q - mcp (T_r - T_s), solved exactly over the step.
        k = mcp / self._c_loop
        if k * h > 1e-9:
            decay = -math.expm1(-k * h)
            self._return_c += (self._supply_c - self._return_c) * decay + (
                self._heat_kw / self._c_loop
            ) * (decay / k)
        else:
            self._return_c += self._heat_kw * h / self._c_loop
        self._return_c = min(self._return_c, RACK_SIDE_MAX_C)

    def _mcp(self, flow_lpm: float) -> float:
        """Heat capacity rate m x cp of ``flow_lpm`` of coolant, in kW/K."""
        return mass_flow_kg_s(flow_lpm) * COOLANT_CP_KJ_PER_KG_K

    def _delta_p_kpa(self) -> float:
        """Pump head: the design pressure scaled by (pumped flow / design flow)^2."""
        pumped = sum(self._pump_speeds) * self._pump_max_lpm
        ratio = pumped / self.ratings.design_flow_lpm
        return self.ratings.design_delta_pressure_kpa * ratio * ratio * (1 - self._leak_flow_loss)

    def _primary(self, t: float) -> tuple[float, float, float, float]:
        """Facility supply and return (C), primary flow (L/min) and valve position (%).

        The exchanger's hot-end approach equals its cold-end one (balanced counterflow),
        which fixes the primary return; the valve passes the flow that carries the heat.
        """
        r = self.ratings
        fw_c = self._facility_c + self._facility_offset.at(t)
        ua = r.ua_kw_per_k * (1.0 - self._fouling.at(t))
        duty_kw = max(0.0, self._mcp(self._flow_lpm) * (self._return_c - self._supply_c))
        if duty_kw <= 0:
            return fw_c, fw_c, 0.0, 0.0
        ret_c = max(self._return_c - duty_kw / ua, fw_c + 0.5)
        flow = duty_kw / (mass_flow_kg_s(1.0) * COOLANT_CP_KJ_PER_KG_K * (ret_c - fw_c))
        if flow > r.design_flow_lpm:
            flow = r.design_flow_lpm
            ret_c = fw_c + duty_kw / self._mcp(flow)
        return fw_c, ret_c, flow, 100.0 * flow / r.design_flow_lpm

    def _true_values(self) -> dict[str, float]:
        fw_c, p_ret_c, p_flow, valve = self._primary(self._t_s)
        return {
            "secondary.supply_temp_c": self._supply_c,
            "secondary.return_temp_c": self._return_c,
            "secondary.flow_lpm": self._flow_lpm,
            "secondary.delta_pressure_kpa": self._delta_p_kpa(),
            "primary.supply_temp_c": fw_c,
            "primary.return_temp_c": p_ret_c,
            "primary.flow_lpm": p_flow,
            "valve_position_pct": valve,
        }

    def _leak_states(self, t: float) -> tuple[tuple[str, LeakState], ...]:
        if not self._leaks:
            return self._no_leaks
        states: list[tuple[str, LeakState]] = []
        for i, name in enumerate(self._leak_names):
            leak = self._leaks.get(i)
            if leak is None:
                states.append((name, "ok"))
                continue
            since, escalate = leak
            critical = escalate is not None and t - since >= escalate
            states.append((name, "critical" if critical else "warning"))
        return tuple(states)

    def _status(self, leaks: tuple[tuple[str, LeakState], ...]) -> Health:
        """The CDU's own summary: critical on a critical leak or no pump left to run."""
        no_pump = self._running_count() == 0 and self._failover_at_s is None
        if no_pump or (self._leaks and any(state == "critical" for _, state in leaks)):
            return "critical"
        if (
            self._leaks
            or "failed" in self._pump_states
            or self._supply_c > self.ratings.supply_max_c
        ):
            return "warning"
        return "ok"

    def _running_count(self) -> int:
        return sum(1 for s in self._pump_states if s == "running")

    def _check_pump(self, index: int) -> int:
        if not 0 <= index < len(self._pump_states):
            msg = f"{self.name} has no pump {index} (it has {len(self._pump_states)})"
            raise ValueError(msg)
        return index

    def _check_sensor(self, sensor: str) -> None:
        if sensor not in SENSORS:
            msg = f"unknown sensor {sensor!r}; known: {', '.join(SENSORS)}"
            raise ValueError(msg)


@functools.lru_cache(maxsize=64)
def _jitter(seed: int, slot: int) -> float:
    """A uniform value in [-1, 1] for one time slot (a hash, so it needs no state)."""
    return mix64((seed << 32) ^ slot) / MASK64 * 2.0 - 1.0


@dataclass(frozen=True, slots=True)
class DiurnalLoad:
    """A day of IT load on one loop, as heat (kW): a diurnal swing plus 5-minute steps.

    Between ``low_fraction`` and ``high_fraction`` of the CDU's capacity: lowest at 04:00,
    highest at 16:00, with a seeded level change every ``step_s`` of up to
    ``jitter_fraction`` of capacity. Deterministic for a seed.
    """

    capacity_kw: float
    seed: int = 0
    low_fraction: float = 0.45
    high_fraction: float = 0.85
    jitter_fraction: float = 0.04
    step_s: float = 300.0

    def __call__(self, t_s: float) -> float:
        """The heat input at ``t_s`` seconds after midnight."""
        phase = 2.0 * math.pi * ((t_s / 86_400.0) - 4.0 / 24.0)
        swing = 0.5 - 0.5 * math.cos(phase)  # 0 at 04:00, 1 at 16:00
        mid = self.low_fraction + (self.high_fraction - self.low_fraction) * swing
        jitter = _jitter(self.seed, int(t_s // self.step_s))
        fraction = mid + self.jitter_fraction * jitter
        lo, hi = self.low_fraction - self.jitter_fraction, self.high_fraction
        return self.capacity_kw * min(hi, max(lo, fraction))


def run_trace(
    plant: SimulatedCdu,
    *,
    heat_kw: Callable[[float], float],
    duration_s: float,
    step_s: float = 1.0,
    start_s: float = 0.0,
    facility_supply_c: Callable[[float], float] | None = None,
) -> Iterator[CduSample]:
    """Drive ``plant`` with ``heat_kw(t)`` and yield one sample per ``step_s``.

    Times are explicit (``now_s``), so the plant's clock does not matter; faults can be
    injected on ``plant`` between two samples. Samples are yielded also while telemetry is
    lost (``telemetry_lost`` is set): skip those to get what a subscriber would see.
    """
    steps = round(duration_s / step_s)
    for k in range(1, steps + 1):
        t_prev = start_s + (k - 1) * step_s
        plant.set_heat_input_kw(heat_kw(t_prev), now_s=t_prev)
        if facility_supply_c is not None:
            plant.set_facility_supply_c(facility_supply_c(t_prev), now_s=t_prev)
        yield plant.sample(now_s=start_s + k * step_s)


def healthy_day(
    *,
    ratings: CduRatings | None = None,
    seed: int = 0,
    cdu: str = "cdu1",
    loop: str = "loop1",
    duration_s: float = 86_400.0,
    step_s: float = 1.0,
    epoch_ns: int = 0,
) -> Iterator[CduSample]:
    """A healthy CDU through a day of diurnal load (``DiurnalLoad``), one sample per step.

    No fault is injected: every reading stays within its normal band (supply at the
    setpoint within the noise, flow at design, return below setpoint + max delta-T). The
    alarm tests use it to check that a healthy day raises nothing.
    """
    rated = ratings if ratings is not None else CduRatings()
    load = DiurnalLoad(rated.heat_capacity_kw, seed=seed)
    clock = ManualClock()
    plant = SimulatedCdu(
        cdu, loop=loop, ratings=rated, seed=seed, clock=clock, epoch_ns=epoch_ns, heat_kw=load(0)
    )
    return run_trace(plant, heat_kw=load, duration_s=duration_s, step_s=step_s)
