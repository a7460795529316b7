"""The simulated CDU: heat balance, pumps, faults, sensors, determinism, a healthy day."""

from __future__ import annotations

import statistics
import time

import pytest

from polca.plant.cdu import SimulatedCdu
from polca.plant.coolant import heat_flow_kw
from polca.plant.faults import FAULT_KINDS
from polca.plant.ratings import CduRatings
from polca.plant.sample import CduSample
from polca.plant.sensors import NOISE_CLIP_SIGMA, SENSORS, TEMP_NOISE_C
from polca.plant.traces import DiurnalLoad, ManualClock, healthy_day, run_trace
from polca.telemetry.schema import CduTelemetry, decode, encode
from tests.cpu import cpu_budget_s

HEAT_KW = 80.0
TEMP_BAND_C = NOISE_CLIP_SIGMA * TEMP_NOISE_C


def make_plant(**kwargs: object) -> tuple[SimulatedCdu, ManualClock]:
    """A plant on a manual clock at 80 kW, seed 7, unless told otherwise."""
    clock = ManualClock()
    options: dict[str, object] = {"seed": 7, "heat_kw": HEAT_KW}
    options.update(kwargs)
    return SimulatedCdu("cdu1", loop="loop1", clock=clock, **options), clock  # type: ignore[arg-type]


def samples(plant: SimulatedCdu, start_s: float, end_s: float) -> list[CduSample]:
    """One sample per second in (start_s, end_s]."""
    return [plant.sample(now_s=float(t)) for t in range(int(start_s) + 1, int(end_s) + 1)]


def test_steady_state_heat_balance() -> None:
    """At steady state the heat removed (m cp dT) equals the heat input, within noise."""
    plant, _ = make_plant()
    readings = samples(plant, 0, 600)[60:]
    ratings = plant.ratings
    mean_flow = statistics.fmean(s.flow_lpm for s in readings)
    mean_dt = statistics.fmean(s.return_temp_c - s.supply_temp_c for s in readings)
    assert heat_flow_kw(mean_flow, mean_dt) == pytest.approx(HEAT_KW, rel=0.01)
    assert statistics.fmean(s.heat_removed_kw for s in readings) == pytest.approx(HEAT_KW, rel=0.01)
    assert statistics.fmean(s.primary_heat_removed_kw for s in readings) == pytest.approx(
        HEAT_KW, rel=0.02
    )
    for s in readings:
        assert abs(s.supply_temp_c - ratings.supply_setpoint_c) <= TEMP_BAND_C + 1e-9
        assert s.flow_lpm == pytest.approx(ratings.design_flow_lpm, rel=0.02)
        assert abs(s.heat_removed_kw - HEAT_KW) < 0.06 * HEAT_KW
        assert s.status == "ok"
    # Return = supply + Q / (m cp): 80 kW at 150 L/min of water is about 7.7 K.
    assert mean_dt == pytest.approx(HEAT_KW / heat_flow_kw(ratings.design_flow_lpm, 1.0), abs=0.05)


def test_heat_input_from_rack_power_uses_capture_fraction() -> None:
    """Rack power times the capture fraction becomes the loop's heat input."""
    plant, _ = make_plant(ratings=CduRatings(capture_fraction=0.75))
    heat_kw = plant.set_rack_power_w({"row1/rack1": 40_000.0, "row1/rack2": 60_000.0})
    assert heat_kw == pytest.approx(75.0)
    readings = samples(plant, 0, 900)[-120:]
    assert statistics.fmean(s.heat_removed_kw for s in readings) == pytest.approx(75.0, rel=0.02)
    assert readings[-1].heat_input_kw == pytest.approx(75.0)


def test_pump_failure_fails_over_to_standby() -> None:
    """A failed running pump: the flow dips, the standby starts, the flow recovers."""
    plant, _ = make_plant()
    samples(plant, 0, 60)
    plant.fail_pump(0, now_s=60.0)
    after = samples(plant, 60, 180)
    design = plant.ratings.design_flow_lpm
    assert min(s.flow_lpm for s in after[:5]) < 0.8 * design
    assert after[0].pumps[0][1] == "failed"
    assert [state for _, state, _ in after[-1].pumps] == ["failed", "running"]
    assert after[-1].pumps[1][2] == pytest.approx(70.0)
    assert statistics.fmean(s.flow_lpm for s in after[-30:]) == pytest.approx(design, rel=0.01)
    assert after[-1].status == "warning"  # running, but without redundancy
    plant.restore_pump(0, now_s=180.0)
    back = plant.sample(now_s=181.0)
    assert back.pumps[0][1] == "standby"
    assert back.status == "ok"


def test_pump_failure_without_standby_collapses_flow() -> None:
    """With no standby left, a second failure stops the flow and the loop heats up."""
    plant, _ = make_plant()
    samples(plant, 0, 60)
    plant.fail_pump(0, now_s=60.0)
    samples(plant, 60, 120)
    plant.fail_pump(1, now_s=120.0)
    after = samples(plant, 120, 240)
    assert after[-1].flow_lpm < 0.02 * plant.ratings.design_flow_lpm
    assert after[-1].heat_removed_kw < 5.0
    assert after[-1].return_temp_c > after[0].return_temp_c + 20.0
    assert after[-1].status == "critical"
    plant.restore_pump(now_s=240.0)
    recovered = samples(plant, 240, 600)
    assert recovered[-1].flow_lpm == pytest.approx(plant.ratings.design_flow_lpm, rel=0.02)
    assert recovered[-1].status == "ok"


def test_all_pumps_failure_and_blockage_lose_flow() -> None:
    """Both loss-of-flow faults stop the flow; a blockage keeps the pumps' pressure up."""
    failed, _ = make_plant()
    failed.inject("all_pumps_failure", now_s=10.0)
    no_pumps = samples(failed, 10, 40)[-1]
    blocked, _ = make_plant()
    blocked.block_flow(1.0, now_s=10.0)
    no_path = samples(blocked, 10, 40)[-1]
    design_dp = blocked.ratings.design_delta_pressure_kpa
    assert no_pumps.flow_lpm < 1.0
    assert no_path.flow_lpm < 1.0
    assert no_pumps.delta_pressure_kpa < 0.05 * design_dp
    assert no_path.delta_pressure_kpa > 1.5 * design_dp  # dead-headed pumps at full speed
    blocked.clear_blockage(now_s=40.0)
    assert samples(blocked, 40, 120)[-1].flow_lpm == pytest.approx(150.0, rel=0.02)


def test_partial_blockage_is_compensated_by_pump_speed() -> None:
    """A half-blocked loop keeps its design flow by speeding the pumps up (DP rises)."""
    plant, _ = make_plant()
    plant.block_flow(0.25, now_s=10.0)
    last = samples(plant, 10, 120)[-1]
    assert last.flow_lpm == pytest.approx(150.0, rel=0.02)
    assert last.pumps[0][2] > 90.0
    assert last.delta_pressure_kpa > 1.5 * plant.ratings.design_delta_pressure_kpa


def test_fouling_raises_supply_under_load() -> None:
    """A fouled exchanger cannot hold the setpoint under load: the supply creeps up."""
    plant, _ = make_plant()
    samples(plant, 0, 60)
    plant.foul(0.8, now_s=60.0)
    after = samples(plant, 60, 600)
    setpoint = plant.ratings.supply_setpoint_c
    # Clean UA 25 kW/K -> 5 kW/K: approach 80 / 5 = 16 K over 22 C facility water = 38 C.
    assert after[10].supply_temp_c < after[60].supply_temp_c < after[-1].supply_temp_c
    assert after[-1].supply_temp_c == pytest.approx(38.0, abs=0.5)
    assert after[-1].valve_position_pct > 98.0
    assert after[-1].supply_temp_c > setpoint + 5
    plant.clear_fouling(now_s=600.0)
    assert samples(plant, 600, 900)[-1].supply_temp_c == pytest.approx(setpoint, abs=0.5)


def test_fouling_at_light_load_is_absorbed_by_the_valve() -> None:
    """Fouling that the valve can absorb opens the valve first, supply stays at setpoint."""
    plant, _ = make_plant(heat_kw=20.0)
    samples(plant, 0, 60)
    valve_before = plant.sample(now_s=61.0).valve_position_pct
    plant.foul(0.5, now_s=61.0)
    last = samples(plant, 61, 400)[-1]
    assert last.supply_temp_c == pytest.approx(plant.ratings.supply_setpoint_c, abs=TEMP_BAND_C)
    assert last.valve_position_pct > valve_before + 1.0


def test_fouling_ramp_is_gradual() -> None:
    """Fouling over a ramp raises the supply slowly, not in a step."""
    plant, _ = make_plant()
    plant.foul(0.8, ramp_s=3600.0, now_s=0.0)
    trace = samples(plant, 0, 3600)
    assert trace[599].supply_temp_c < 31.0  # 10 minutes in: still near the setpoint
    assert trace[-1].supply_temp_c > 36.0


def test_facility_water_rise_raises_supply() -> None:
    """Warmer facility water leaves the exchanger less approach: the supply rises."""
    plant, _ = make_plant()
    samples(plant, 0, 60)
    plant.raise_facility_water(10.0, now_s=60.0)
    after = samples(plant, 60, 600)
    # 32 C facility water + 80 kW / 25 kW/K = 35.2 C.
    assert after[-1].primary_supply_temp_c == pytest.approx(32.0, abs=TEMP_BAND_C)
    assert after[-1].supply_temp_c == pytest.approx(35.2, abs=0.4)
    plant.restore_facility_water(now_s=600.0)
    assert samples(plant, 600, 900)[-1].supply_temp_c == pytest.approx(30.0, abs=0.5)


def test_facility_supply_input_follows_the_caller() -> None:
    """The facility water temperature is an input the caller can set each step."""
    plant, _ = make_plant()
    plant.set_facility_supply_c(31.0, now_s=0.0)
    last = samples(plant, 0, 400)[-1]
    assert last.primary_supply_temp_c == pytest.approx(31.0, abs=TEMP_BAND_C)
    assert last.supply_temp_c == pytest.approx(31.0 + 80.0 / 25.0, abs=0.4)


def test_leak_detector_escalates() -> None:
    """A leak warns at once, goes critical after the delay, and clears when dried."""
    plant, _ = make_plant()
    plant.leak(1, escalate_after_s=30.0, flow_loss_fraction=0.3, now_s=100.0)
    first = plant.sample(now_s=101.0)
    assert first.leak_detectors == (("leak1", "ok"), ("leak2", "warning"))
    assert first.status == "warning"
    later = samples(plant, 101, 140)
    assert later[-1].leak_detectors[1] == ("leak2", "critical")
    assert later[-1].status == "critical"
    assert later[-1].delta_pressure_kpa < 0.8 * plant.ratings.design_delta_pressure_kpa
    assert later[-1].flow_lpm == pytest.approx(0.7 * plant.ratings.design_flow_lpm, rel=0.03)
    plant.clear_leak(now_s=140.0)
    dry = samples(plant, 140, 200)[-1]
    assert dry.leak_detectors == (("leak1", "ok"), ("leak2", "ok"))
    assert dry.status == "ok"
    with pytest.raises(ValueError, match="no leak detector 5"):
        plant.leak(5)


def test_stuck_sensor_freezes_and_unsticks() -> None:
    """A stuck sensor repeats its last value while the process moves on."""
    plant, _ = make_plant()
    before = plant.sample(now_s=10.0)
    plant.stick_sensor("secondary.return_temp_c", now_s=10.0)
    plant.set_heat_input_kw(40.0, now_s=10.0)
    stuck = samples(plant, 10, 300)
    assert {s.return_temp_c for s in stuck} == {before.return_temp_c}
    assert plant.true_state()["secondary.return_temp_c"] < before.return_temp_c - 3.0
    # The CDU's own heat figure uses the stuck sensor: it no longer matches the input.
    assert stuck[-1].heat_removed_kw > 60.0
    plant.unstick_sensor(now_s=300.0)
    assert plant.sample(now_s=301.0).return_temp_c < before.return_temp_c - 3.0
    plant.stick_sensor("secondary.flow_lpm", 12.5, now_s=301.0)
    assert plant.sample(now_s=302.0).flow_lpm == 12.5
    with pytest.raises(ValueError, match="unknown sensor"):
        plant.stick_sensor("secondary.colour")


def test_drifting_sensor_drifts_linearly() -> None:
    """A drifting sensor moves away from the truth at its rate; recalibration ends it."""
    plant, _ = make_plant()
    samples(plant, 0, 60)
    plant.drift_sensor("secondary.supply_temp_c", 0.01, now_s=60.0)
    trace = samples(plant, 60, 660)
    offsets = [s.supply_temp_c - 30.0 for s in trace]
    assert statistics.fmean(offsets[:60]) == pytest.approx(0.3, abs=0.05)
    assert statistics.fmean(offsets[-60:]) == pytest.approx(5.7, abs=0.05)
    assert plant.true_state()["secondary.supply_temp_c"] == pytest.approx(30.0, abs=1e-6)
    plant.clear_drift(now_s=660.0)
    assert abs(plant.sample(now_s=661.0).supply_temp_c - 30.0) <= TEMP_BAND_C


def test_telemetry_loss_returns_none_while_the_plant_runs() -> None:
    """While telemetry is lost reading() is None, yet the model keeps advancing."""
    plant, clock = make_plant()
    assert isinstance(plant.reading(now_s=1.0), CduTelemetry)
    plant.lose_telemetry(now_s=1.0)
    plant.fail_all_pumps(now_s=1.0)
    clock.advance(60.0)
    assert plant.reading() is None
    assert plant.telemetry_lost
    plant.restore_telemetry()
    message = plant.reading()
    assert message is not None
    assert message.secondary.flow_lpm is not None
    assert message.secondary.flow_lpm < 1.0
    assert message.ts_ns == 60 * 10**9


def test_reading_is_a_valid_wire_message() -> None:
    """reading() gives a CduTelemetry that survives encode and decode."""
    plant, _ = make_plant()
    message = plant.reading(now_s=5.0)
    assert message is not None
    again = decode(encode(message), CduTelemetry)
    assert again == message
    assert message.cdu == "cdu1"
    assert message.loop == "loop1"
    assert [p.state for p in message.pumps] == ["running", "standby"]
    assert message.primary is not None
    assert message.secondary.supply_temp_c == pytest.approx(30.0, abs=TEMP_BAND_C + 0.01)


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_every_fault_kind_injects_and_clears(kind: str) -> None:
    """inject(kind) changes what the CDU reports and clear(kind) brings it back."""
    plant, _ = make_plant()
    healthy = samples(plant, 0, 120)[-1]
    plant.inject(kind, now_s=120.0)  # type: ignore[arg-type]
    faulty = samples(plant, 120, 720)[-1]
    changed = faulty.telemetry_lost or faulty._replace(t_s=0, ts_ns=0) != healthy._replace(
        t_s=0, ts_ns=0
    )
    assert changed
    plant.clear(kind, now_s=720.0)  # type: ignore[arg-type]
    cleared = samples(plant, 720, 1500)[-1]
    assert not cleared.telemetry_lost
    assert cleared.status == "ok"
    assert cleared.supply_temp_c == pytest.approx(30.0, abs=TEMP_BAND_C)
    assert cleared.flow_lpm == pytest.approx(150.0, rel=0.02)
    assert all(state != "failed" for _, state, _ in cleared.pumps)
    with pytest.raises(ValueError, match="unknown fault kind"):
        plant.inject("meteor")  # type: ignore[arg-type]


def test_clear_faults_clears_everything() -> None:
    """clear_faults() undoes every fault at once."""
    plant, _ = make_plant()
    for kind in FAULT_KINDS:
        plant.inject(kind, now_s=10.0)
    plant.clear_faults(now_s=20.0)
    last = samples(plant, 20, 900)[-1]
    assert last.status == "ok"
    assert last.flow_lpm == pytest.approx(150.0, rel=0.02)
    assert last.supply_temp_c == pytest.approx(30.0, abs=TEMP_BAND_C)


def test_same_seed_same_readings() -> None:
    """The same seed and calls give the same readings; another seed differs."""
    first, _ = make_plant(seed=3)
    second, _ = make_plant(seed=3)
    other, _ = make_plant(seed=4)
    for plant in (first, second, other):
        plant.fail_pump(now_s=30.0)
    a, b, c = (samples(p, 0, 120) for p in (first, second, other))
    assert a == b
    assert a != c


def test_model_is_step_size_independent() -> None:
    """Reading every 0.25 s or every 10 s gives the same state (exact integration)."""
    fine, _ = make_plant(heat_kw=50.0)
    coarse, _ = make_plant(heat_kw=50.0)
    for plant in (fine, coarse):
        plant.set_heat_input_kw(90.0, now_s=0.0)
    for k in range(1, 2401):
        fine.advance(k * 0.25)
    for k in range(1, 61):
        coarse.advance(k * 10.0)
    truth_fine, truth_coarse = fine.true_state(), coarse.true_state()
    for sensor in SENSORS:
        assert truth_fine[sensor] == pytest.approx(truth_coarse[sensor], rel=0.01, abs=0.05)


def test_ratings_are_validated() -> None:
    """Impossible ratings are refused with the field named."""
    with pytest.raises(ValueError, match="heat_capacity_kw"):
        CduRatings(heat_capacity_kw=0)
    with pytest.raises(ValueError, match="bracket the setpoint"):
        CduRatings(supply_setpoint_c=40.0)
    with pytest.raises(ValueError, match="pump_redundancy"):
        CduRatings(pump_count=1, pump_redundancy=1)
    with pytest.raises(ValueError, match="capture_fraction"):
        CduRatings(capture_fraction=1.5)
    three = CduRatings(pump_count=3, pump_redundancy=1)
    assert three.pumps_required == 2
    assert three.ua_kw_per_k == pytest.approx(25.0)


def test_n_plus_one_with_three_pumps() -> None:
    """With 2 + 1 pumps one failure is covered by the standby, two leave one pump."""
    plant, _ = make_plant(ratings=CduRatings(pump_count=3, pump_redundancy=1))
    first = plant.sample(now_s=1.0)
    assert [state for _, state, _ in first.pumps] == ["running", "running", "standby"]
    plant.fail_pump(0, now_s=10.0)
    assert samples(plant, 10, 60)[-1].flow_lpm == pytest.approx(150.0, rel=0.02)
    plant.fail_pump(1, now_s=60.0)
    one_left = samples(plant, 60, 120)[-1]
    assert one_left.pumps[2][2] == pytest.approx(100.0, abs=0.5)  # flat out
    assert one_left.flow_lpm == pytest.approx(150.0 / 0.7 / 2, rel=0.03)


def test_run_trace_follows_the_heat_profile() -> None:
    """run_trace drives the heat input and yields one sample per step."""
    plant = SimulatedCdu(seed=1, clock=ManualClock())
    trace = list(run_trace(plant, heat_kw=lambda t: 40.0 if t < 600 else 90.0, duration_s=1200.0))
    assert len(trace) == 1200
    assert [s.t_s for s in trace[:3]] == [1.0, 2.0, 3.0]
    assert trace[590].heat_removed_kw == pytest.approx(40.0, rel=0.1)
    assert trace[-1].heat_removed_kw == pytest.approx(90.0, rel=0.1)


def test_diurnal_load_is_deterministic_and_bounded() -> None:
    """The day's load swings between its bounds, lowest at night, the same for a seed."""
    load = DiurnalLoad(100.0, seed=5)
    values = [load(float(t)) for t in range(0, 86_400, 60)]
    assert values == [DiurnalLoad(100.0, seed=5)(float(t)) for t in range(0, 86_400, 60)]
    assert values != [DiurnalLoad(100.0, seed=6)(float(t)) for t in range(0, 86_400, 60)]
    assert min(values) >= 41.0
    assert max(values) <= 85.0
    assert load(4 * 3600.0) < load(16 * 3600.0) - 30.0


def test_healthy_day_stays_within_normal_limits() -> None:
    """A whole day at 1 s steps runs in seconds and never leaves the normal bands."""
    ratings = CduRatings()
    started = time.process_time()  # this process's CPU: other load does not count
    count = 0
    worst_supply_c = 0.0
    worst_dt_c = 0.0
    lowest_flow = float("inf")
    for s in healthy_day(ratings=ratings, seed=11):
        count += 1
        worst_supply_c = max(worst_supply_c, abs(s.supply_temp_c - ratings.supply_setpoint_c))
        worst_dt_c = max(worst_dt_c, s.return_temp_c - s.supply_temp_c)
        lowest_flow = min(lowest_flow, s.flow_lpm)
        assert s.status == "ok"
        assert s.leak_detectors == (("leak1", "ok"), ("leak2", "ok"))
        assert not s.telemetry_lost
    elapsed_s = time.process_time() - started
    assert count == 86_400
    assert worst_supply_c <= TEMP_BAND_C + 1e-9
    assert worst_dt_c < ratings.max_delta_t_c
    assert lowest_flow > 0.97 * ratings.design_flow_lpm
    assert elapsed_s < cpu_budget_s(20.0), f"a day took {elapsed_s:.1f} s"
