"""A simulated coolant distribution unit (CDU): the cooling plant of the demo and the tests.

``SimulatedCdu`` models one liquid-cooling loop: a CDU whose pumps push coolant through the
racks' cold plates (the secondary or technology cooling system loop) and whose heat
exchanger hands the heat to the facility water (the primary loop). It is the CDU as the
outside sees it, assembled from parts that each have a module:

- the physics of the loop, the truth (``model.PlantModel``: heat input, rack-side
  thermal mass, heat exchanger, pumps and failover; the model is described there);
- the instruments, what the CDU reports (``sensors.Sensors``: seeded, bounded noise on
  every reading, stuck and drifting sensors; ``sensors.LeakDetectors``). The CDU's own
  heat-removed figure is computed, as a real CDU does, from its (possibly faulty) flow and
  temperature sensors, so sensor faults show up as a heat-balance mismatch;
- its ratings (``ratings.CduRatings``) and readings (``sample.CduSample``, whose
  ``to_telemetry`` is the wire message).

This module owns the clock, the names and the public API: the inputs, the faults and the
readings. Faults, each with a counterpart that clears it: ``fail_pump``/``restore_pump``,
``block_flow``/``clear_blockage``, ``foul``/``clear_fouling``,
``raise_facility_water``/``restore_facility_water``, ``leak``/``clear_leak``,
``stick_sensor``/``unstick_sensor``, ``drift_sensor``/``clear_drift``,
``lose_telemetry``/``restore_telemetry``; ``inject(kind)``/``clear(kind)`` name them for
parametrised tests, ``clear_faults()`` clears all.

The model advances lazily, in sub-steps of at most ``model.STEP_S``, to the injected
clock's time (or an explicit ``now_s``) whenever it is read, so it runs no thread and costs
nothing between reads. Given the same seed and the same sequence of calls it produces the
same readings. It must stay free of I/O and threads; ``traces.py`` drives it through long
runs (``healthy_day()``, ``run_trace()``) for the alarm tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from polca.plant.coolant import heat_flow_kw
from polca.plant.faults import FAULT_KINDS, FaultKind
from polca.plant.model import PlantModel
from polca.plant.ratings import CduRatings
from polca.plant.sample import CduSample, Health, LeakState
from polca.plant.sensors import SENSORS, LeakDetectors, Sensors, check_sensor
from polca.telemetry.schema import CduTelemetry

__all__ = ["SimulatedCdu"]


class SimulatedCdu:
    """One simulated CDU and its loop; see the module docstring."""

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
        self._sensors = Sensors(design_flow_lpm=r.design_flow_lpm, seed=seed)
        self._clock: Callable[[], float] = clock if clock is not None else time.monotonic
        if time_ns is not None:
            self._time_ns: Callable[[], int] | None = time_ns
        elif clock is None:
            self._time_ns = time.time_ns
        else:
            self._time_ns = None
        self._epoch_ns = epoch_ns
        self._model = PlantModel(
            r, t_s=self._clock(), heat_kw=heat_kw, facility_supply_c=facility_supply_c
        )
        self._pump_names = tuple(f"pump{i + 1}" for i in range(r.pump_count))
        self._leaks = LeakDetectors(r.leak_detectors)
        self._telemetry_lost = False

    # -- inputs ---------------------------------------------------------------------------

    @property
    def heat_input_kw(self) -> float:
        """The heat going into the loop now (kW)."""
        return self._model.heat_kw

    def set_heat_input_kw(self, heat_kw: float, *, now_s: float | None = None) -> None:
        """Set the heat the racks put into the loop, from now on."""
        self._advance(now_s)
        self._model.heat_kw = max(0.0, heat_kw)

    def set_rack_power_w(
        self, power_w: Mapping[str, float], *, now_s: float | None = None
    ) -> float:
        """Set the heat input from the served racks' power; returns the heat in kW."""
        heat_kw = sum(power_w.values()) * self.ratings.capture_fraction / 1000.0
        self.set_heat_input_kw(heat_kw, now_s=now_s)
        return self._model.heat_kw

    def set_facility_supply_c(self, temp_c: float, *, now_s: float | None = None) -> None:
        """Set the facility water supply temperature (before any injected rise)."""
        self._advance(now_s)
        self._model.facility_c = temp_c

    # -- faults ---------------------------------------------------------------------------

    def fail_pump(self, index: int | None = None, *, now_s: float | None = None) -> None:
        """Fail one pump (default: the first running one); a standby takes over."""
        self._advance(now_s)
        if index is None:
            running = [i for i, s in enumerate(self._model.pump_states) if s == "running"]
            index = running[0] if running else 0
        self._model.fail_pump(self._check_pump(index))

    def fail_all_pumps(self, *, now_s: float | None = None) -> None:
        """Fail every pump: the flow collapses."""
        self._advance(now_s)
        self._model.fail_all_pumps()

    def restore_pump(self, index: int | None = None, *, now_s: float | None = None) -> None:
        """Repair one pump (default: all failed ones); it returns as standby (or running)."""
        self._advance(now_s)
        count = len(self._model.pump_states)
        self._model.restore_pumps(range(count) if index is None else [self._check_pump(index)])

    def block_flow(self, fraction: float = 1.0, *, now_s: float | None = None) -> None:
        """Block the loop (a closed valve, a clogged strainer): the flow drops by fraction."""
        self._advance(now_s)
        self._model.block(fraction)

    def clear_blockage(self, *, now_s: float | None = None) -> None:
        """Open the loop again."""
        self.block_flow(0.0, now_s=now_s)

    def foul(self, fraction: float, *, ramp_s: float = 0.0, now_s: float | None = None) -> None:
        """Foul the heat exchanger: its UA drops by ``fraction``, linearly over ``ramp_s``."""
        self._advance(now_s)
        self._model.foul(fraction, ramp_s=ramp_s)

    def clear_fouling(self, *, now_s: float | None = None) -> None:
        """Clean the exchanger (at once)."""
        self.foul(0.0, now_s=now_s)

    def raise_facility_water(
        self, delta_c: float, *, ramp_s: float = 0.0, now_s: float | None = None
    ) -> None:
        """Warm the facility water supply by ``delta_c``, linearly over ``ramp_s``."""
        self._advance(now_s)
        self._model.warm_facility_water(delta_c, ramp_s=ramp_s)

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
        count = len(self._leaks.names)
        if not 0 <= detector < count:
            msg = f"{self.name} has no leak detector {detector} (it has {count})"
            raise ValueError(msg)
        self._leaks.wet(detector, since_s=t, escalate_after_s=escalate_after_s)
        self._model.lose_coolant(flow_loss_fraction)

    def clear_leak(self, detector: int | None = None, *, now_s: float | None = None) -> None:
        """Dry one detector (default: all); the flow loss ends with the last leak."""
        self._advance(now_s)
        self._leaks.dry(detector)
        if not self._leaks:
            self._model.lose_coolant(0.0)

    def stick_sensor(
        self, sensor: str, value: float | None = None, *, now_s: float | None = None
    ) -> None:
        """Freeze a reading at ``value`` (default: its last reported value)."""
        t = self._advance(now_s)
        check_sensor(sensor)
        if value is None:
            value = self._sensors.last(sensor)
        if value is None:
            value = self._model.readings(t)[SENSORS.index(sensor)]
        self._sensors.stick(sensor, value)

    def unstick_sensor(self, sensor: str | None = None, *, now_s: float | None = None) -> None:
        """Let a frozen reading (default: all) follow the process again."""
        self._advance(now_s)
        self._sensors.unstick(sensor)

    def drift_sensor(self, sensor: str, rate_per_s: float, *, now_s: float | None = None) -> None:
        """Make a reading drift linearly away from the truth by ``rate_per_s`` units/s."""
        t = self._advance(now_s)
        self._sensors.drift(sensor, rate_per_s, since_s=t)

    def clear_drift(self, sensor: str | None = None, *, now_s: float | None = None) -> None:
        """Recalibrate a drifting sensor (default: all)."""
        self._advance(now_s)
        self._sensors.clear_drift(sensor)

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
        model = self._model
        values = self._sensors.read(model.readings(t), t)
        sup, ret, flow, dp, p_sup, p_ret, p_flw, valve_pct = values
        leaks = self._leaks.states(t)
        pumps = tuple(
            (name, state, speed * 100.0 if state == "running" else 0.0)
            for name, state, speed in zip(
                self._pump_names, model.pump_states, model.pump_speeds, strict=True
            )
        )
        return CduSample(
            t_s=t,
            ts_ns=self._stamp_ns(t),
            cdu=self.name,
            loop=self.loop,
            heat_input_kw=model.heat_kw,
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
        return dict(zip(SENSORS, self._model.readings(self._model.t_s), strict=True))

    # -- helpers --------------------------------------------------------------------------

    def _advance(self, now_s: float | None) -> float:
        """Integrate the model to ``now_s`` (default: the clock); never goes back."""
        return self._model.advance(self._clock() if now_s is None else now_s)

    def _stamp_ns(self, t_s: float) -> int:
        if self._time_ns is not None:
            return self._time_ns()
        return self._epoch_ns + round(t_s * 1e9)

    def _status(self, leaks: tuple[tuple[str, LeakState], ...]) -> Health:
        """The CDU's own summary: critical on a critical leak or no pump left to run."""
        model = self._model
        no_pump = model.running_count() == 0 and model.failover_at_s is None
        if no_pump or (self._leaks and any(state == "critical" for _, state in leaks)):
            return "critical"
        if (
            self._leaks
            or "failed" in model.pump_states
            or model.supply_c > self.ratings.supply_max_c
        ):
            return "warning"
        return "ok"

    def _check_pump(self, index: int) -> int:
        count = len(self._model.pump_states)
        if not 0 <= index < count:
            msg = f"{self.name} has no pump {index} (it has {count})"
            raise ValueError(msg)
        return index
