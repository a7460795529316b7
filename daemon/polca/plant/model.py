"""The physics of one simulated CDU loop: its true state and the exact integration of it.

A small lumped model, physical enough that every CDU alarm of ``docs/cooling.md`` can be
provoked for the right reason, and cheap enough to run a day at 1 s steps in about a
second:

- Heat input: the racks' electrical power times the liquid capture fraction (the caller
  supplies it), held until it changes.
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

``PlantModel`` holds only the process: what the sensors would read if they were perfect,
and the process faults (failed pumps, a blocked loop, a fouled exchanger, warmer facility
water, coolant lost to a leak). What the CDU *reports* (noise, stuck and drifting sensors,
leak detectors) is ``sensors.py``'s; the clock, the names and the fault API are
``SimulatedCdu``'s (``cdu.py``). Time is an input (``advance(target_s)``); no clock, no
randomness, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from polca.plant.coolant import COOLANT_CP_KJ_PER_KG_K, mass_flow_kg_s
from polca.plant.ratings import CduRatings
from polca.plant.sample import PumpState

__all__ = ["MAX_STEPS", "STEP_S", "PlantModel", "Ramp"]

STEP_S = 1.0  # longest integration sub-step (the updates are exact, this bounds events)
MAX_STEPS = 10_000  # a longer gap is integrated in coarser steps instead
HX_TAU_S = 30.0  # heat exchanger and valve loop: supply temperature lag
PUMP_TAU_S = 1.5  # pump spin-up and spin-down
FLOW_TAU_S = 1.0  # hydraulic lag of the loop
NOMINAL_PUMP_SPEED = 0.7  # N pumps at this speed deliver the design flow
MIN_PUMP_SPEED = 0.15  # controller floor (Vertiv CoolChip CDU 600: 15 %)
MAX_FOULING = 0.95  # fouling removes at most this fraction of UA
RACK_SIDE_MAX_C = 95.0  # without flow the cold plates would trip the GPUs long before this


@dataclass(slots=True)
class Ramp:
    """A value moving linearly from ``start`` to ``end`` over ``[t0_s, t0_s + ramp_s]``."""

    start: float = 0.0
    end: float = 0.0
    t0_s: float = 0.0
    ramp_s: float = 0.0

    def at(self, t_s: float) -> float:
        """The value at ``t_s``: ``start`` before the ramp, ``end`` after it."""
        if self.ramp_s <= 0 or t_s >= self.t0_s + self.ramp_s:
            return self.end
        if t_s <= self.t0_s:
            return self.start
        return self.start + (self.end - self.start) * (t_s - self.t0_s) / self.ramp_s


class PlantModel:
    """The true state of one CDU loop, from ``t_s`` on; see the module docstring.

    Built at steady state for ``heat_kw``. The inputs (``heat_kw``, ``facility_c``) are
    plain attributes; a caller sets them after ``advance``-ing to the time they change,
    as it calls the fault methods, which act at ``t_s``.
    """

    def __init__(
        self,
        ratings: CduRatings,
        *,
        t_s: float,
        heat_kw: float,
        facility_supply_c: float | None,
    ) -> None:
        """The loop at ``t_s``, settled at ``heat_kw`` (facility water default: rated)."""
        r = self.ratings = ratings
        self.t_s = t_s
        self.heat_kw = max(0.0, heat_kw)
        self.facility_c = r.facility_supply_c if facility_supply_c is None else facility_supply_c
        self._pump_max_lpm = r.design_flow_lpm / (r.pumps_required * NOMINAL_PUMP_SPEED)
        self._c_loop = r.loop_heat_capacity_kj_per_k
        self.pump_states: list[PumpState] = [
            "running" if i < r.pumps_required else "standby" for i in range(r.pump_count)
        ]
        self.pump_speeds = [
            NOMINAL_PUMP_SPEED if i < r.pumps_required else 0.0 for i in range(r.pump_count)
        ]
        self.failover_at_s: float | None = None
        self.flow_lpm = r.design_flow_lpm
        supply_c = max(r.supply_setpoint_c, self.facility_c + self.heat_kw / r.ua_kw_per_k)
        self.supply_c = supply_c
        self.return_c = supply_c + self.heat_kw / self.mcp(self.flow_lpm)

        # Process faults.
        self.blockage = 0.0
        self.fouling = Ramp()
        self.facility_offset = Ramp()
        self.leak_flow_loss = 0.0

        self._alpha_cache: dict[float, tuple[float, float, float]] = {}

    # -- process faults (each acts at t_s: advance first) --------------------------------

    def fail_pump(self, index: int) -> None:
        """Pump ``index`` fails; if it was running, a standby starts after the delay."""
        was_running = self.pump_states[index] == "running"
        self.pump_states[index] = "failed"
        if was_running and self.failover_at_s is None and "standby" in self.pump_states:
            self.failover_at_s = self.t_s + self.ratings.failover_delay_s

    def fail_all_pumps(self) -> None:
        """Every pump fails: the flow collapses."""
        self.pump_states = ["failed"] * len(self.pump_states)
        self.failover_at_s = None

    def restore_pumps(self, indices: range | list[int]) -> None:
        """Repair the failed pumps among ``indices``; they return as standby (or running)."""
        for i in indices:
            if self.pump_states[i] == "failed":
                self.pump_states[i] = "standby"
        if self.running_count() < self.ratings.pumps_required:
            # A repaired pump with nobody running: the controller starts it at once.
            self.failover_at_s = self.t_s

    def block(self, fraction: float) -> None:
        """Block ``fraction`` of the loop (clamped to 0..1); 0 opens it again."""
        self.blockage = min(max(fraction, 0.0), 1.0)

    def foul(self, fraction: float, *, ramp_s: float) -> None:
        """Foul the exchanger: UA drops by ``fraction`` (at most MAX_FOULING) over ``ramp_s``."""
        t = self.t_s
        end = min(max(fraction, 0.0), MAX_FOULING)
        self.fouling = Ramp(self.fouling.at(t), end, t, ramp_s)

    def warm_facility_water(self, delta_c: float, *, ramp_s: float) -> None:
        """Facility water ``delta_c`` above its set temperature, reached over ``ramp_s``."""
        t = self.t_s
        self.facility_offset = Ramp(self.facility_offset.at(t), delta_c, t, ramp_s)

    def lose_coolant(self, fraction: float) -> None:
        """A leak loses ``fraction`` of the flow (clamped to 0..1); 0 ends the loss."""
        self.leak_flow_loss = min(max(fraction, 0.0), 1.0)

    # -- state ----------------------------------------------------------------------------

    def running_count(self) -> int:
        """Pumps running now."""
        return sum(1 for s in self.pump_states if s == "running")

    def readings(self, t: float) -> list[float]:
        """Perfect readings at ``t`` (the current state), in ``sensors.SENSORS`` order.

        Secondary supply, return (C), flow (L/min), differential pressure (kPa); primary
        supply, return (C), flow (L/min); valve position (%).
        """
        fw_c, p_ret_c, p_flow, valve = self.primary(t)
        return [
            self.supply_c,
            self.return_c,
            self.flow_lpm,
            self.delta_p_kpa(),
            fw_c,
            p_ret_c,
            p_flow,
            valve,
        ]

    def mcp(self, flow_lpm: float) -> float:
        """Heat capacity rate m x cp of ``flow_lpm`` of coolant, in kW/K."""
        return mass_flow_kg_s(flow_lpm) * COOLANT_CP_KJ_PER_KG_K

    def delta_p_kpa(self) -> float:
        """Pump head: the design pressure scaled by (pumped flow / design flow)^2."""
        pumped = sum(self.pump_speeds) * self._pump_max_lpm
        ratio = pumped / self.ratings.design_flow_lpm
        return self.ratings.design_delta_pressure_kpa * ratio * ratio * (1 - self.leak_flow_loss)

    def primary(self, t: float) -> tuple[float, float, float, float]:
        """Facility supply and return (C), primary flow (L/min) and valve position (%).

        The exchanger's hot-end approach equals its cold-end one (balanced counterflow),
        which fixes the primary return; the valve passes the flow that carries the heat.
        """
        r = self.ratings
        fw_c = self.facility_c + self.facility_offset.at(t)
        ua = r.ua_kw_per_k * (1.0 - self.fouling.at(t))
        duty_kw = max(0.0, self.mcp(self.flow_lpm) * (self.return_c - self.supply_c))
        if duty_kw <= 0:
            return fw_c, fw_c, 0.0, 0.0
        ret_c = max(self.return_c - duty_kw / ua, fw_c + 0.5)
        flow = duty_kw / (mass_flow_kg_s(1.0) * COOLANT_CP_KJ_PER_KG_K * (ret_c - fw_c))
        if flow > r.design_flow_lpm:
            flow = r.design_flow_lpm
            ret_c = fw_c + duty_kw / self.mcp(flow)
        return fw_c, ret_c, flow, 100.0 * flow / r.design_flow_lpm

    # -- integration ----------------------------------------------------------------------

    def advance(self, target_s: float) -> float:
        """Integrate to ``target_s`` in sub-steps of at most STEP_S; never goes back.

        Returns the model's time afterwards (``target_s``, or ``t_s`` if that is later).
        """
        gap = target_s - self.t_s
        if gap <= 0:
            return self.t_s
        steps = min(MAX_STEPS, max(1, math.ceil(gap / STEP_S - 1e-9)))
        h = gap / steps
        t = self.t_s
        for k in range(1, steps + 1):
            self._step(t, h)
            t = self.t_s + k * h
        self.t_s = target_s
        return target_s

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
        states = self.pump_states
        speeds = self.pump_speeds

        # Failover: start standby pumps once the delay has passed.
        running = self.running_count()
        if "standby" not in states:
            self.failover_at_s = None
        elif running < r.pumps_required:
            if self.failover_at_s is None:
                self.failover_at_s = t + r.failover_delay_s
            if t_end >= self.failover_at_s:
                for i, state in enumerate(states):
                    if running >= r.pumps_required:
                        break
                    if state == "standby":
                        states[i] = "running"
                        running += 1
                self.failover_at_s = None

        # Pumps: running ones chase the speed that holds the design flow through a blocked
        # loop, others spin down. Coolant lost to a leak they cannot make up for.
        open_fraction = 1.0 - self.blockage
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
        delivered_lpm = capacity_lpm * open_fraction * (1.0 - self.leak_flow_loss)
        self.flow_lpm += (delivered_lpm - self.flow_lpm) * a_flow

        # Heat exchanger: hold the setpoint if the approach allows, with a lag.
        mcp = self.mcp(self.flow_lpm)
        ua = r.ua_kw_per_k * (1.0 - self.fouling.at(t_end))
        fw_c = self.facility_c + self.facility_offset.at(t_end)
        carried_kw = max(0.0, mcp * (self.return_c - self.supply_c))
        goal_c = max(r.supply_setpoint_c, fw_c + carried_kw / ua)
        goal_c = min(goal_c, max(self.return_c, fw_c))
        self.supply_c += (goal_c - self.supply_c) * a_hx

        # Rack side: C dT_r/dt = Q - mcp (T_r - T_s), solved exactly over the step.
        k = mcp / self._c_loop
        if k * h > 1e-9:
            decay = -math.expm1(-k * h)
            self.return_c += (self.supply_c - self.return_c) * decay + (
                self.heat_kw / self._c_loop
            ) * (decay / k)
        else:
            self.return_c += self.heat_kw * h / self._c_loop
        self.return_c = min(self.return_c, RACK_SIDE_MAX_C)
