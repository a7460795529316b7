"""The simulated GPU backend: physics sanity, determinism, faults, write validation."""

from __future__ import annotations

import math
from itertools import pairwise
from statistics import fmean

import pytest

from polca.errors import (
    GpuInvalidArgumentError,
    GpuLibraryError,
    GpuLostError,
    GpuPermissionError,
)
from polca.gpu.backend import (
    CLOCK_EVENT_GPU_IDLE,
    CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN,
    CLOCK_EVENT_SW_POWER_CAP,
    CLOCK_EVENT_SW_THERMAL_SLOWDOWN,
    GpuBackend,
    GpuSample,
)
from polca.gpu.simulated import SimulatedBackend
from polca.physics.presets import MODEL_NAMES, get_model
from polca.workload.profiles import ConstantLoad, ScriptedLoad


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self, t_s: float = 1000.0) -> None:
        self.t_s = t_s

    def __call__(self) -> float:
        return self.t_s

    def advance(self, dt_s: float) -> None:
        self.t_s += dt_s


def make(
    clock: FakeClock,
    *,
    load: str | ConstantLoad = "idle",
    count: int = 8,
    model: str = "H100-SXM",
    coolant_inlet_c: float = 30.0,
    privileged: bool = True,
) -> SimulatedBackend:
    """A backend on ``clock``."""
    return SimulatedBackend(
        count=count,
        model=model,
        load=load,
        coolant_inlet_c=coolant_inlet_c,
        clock=clock,
        privileged=privileged,
    )


def run(
    backend: SimulatedBackend,
    clock: FakeClock,
    duration_s: float,
    *,
    index: int = 0,
    interval_s: float = 0.1,
) -> list[GpuSample]:
    """Sample GPU ``index`` every ``interval_s`` for ``duration_s``."""
    samples = []
    for _ in range(round(duration_s / interval_s)):
        clock.advance(interval_s)
        samples.append(backend.sample(index))
    return samples


def watts(samples: list[GpuSample]) -> list[float]:
    """Instantaneous power readings in W."""
    return [s.power_mw / 1000 for s in samples if s.power_mw is not None]


# --- models ------------------------------------------------------------------------------


def test_model_lookup_is_case_insensitive_and_has_the_documented_envelopes() -> None:
    """The presets carry the A100/H100/H200 numbers the simulator is calibrated on."""
    a100, h100, h200 = get_model("a100-sxm4"), get_model("H100-SXM"), get_model(" H200-SXM ")
    assert (a100.tdp_w, a100.power_limit_min_w, a100.sm_clock_max_mhz) == (400, 100, 1410)
    assert (a100.mem_clock_mhz, a100.memory_gb) == (1593, 80)
    assert get_model("A100-SXM4-40GB").memory_gb == 40
    assert (h100.tdp_w, h100.power_limit_min_w, h100.sm_clock_max_mhz) == (700, 200, 1980)
    assert h100.mem_clock_mhz == 2619
    assert (h200.tdp_w, h200.sm_clock_max_mhz, h200.mem_clock_mhz) == (700, 1980, 3201)
    assert h200.mem_power_share > h100.mem_power_share
    assert h200.idle_power_w > h100.idle_power_w


def test_supported_clocks_are_15_mhz_steps_highest_first() -> None:
    """Supported SM clocks span min..max in 15 MHz steps and include POLCA's A100 points."""
    a100 = get_model("A100-SXM4").supported_sm_clocks_mhz
    assert (a100[0], a100[-1], len(a100)) == (1410, 210, 81)
    assert {1305, 1275, 1110} <= set(a100)
    h100 = get_model("H100-SXM").supported_sm_clocks_mhz
    assert (h100[0], h100[-1]) == (1980, 345)
    assert all(a - b == 15 for a, b in pairwise(h100))


def test_unknown_model_error_lists_the_known_names() -> None:
    """A typo in the model name says which names exist."""
    with pytest.raises(ValueError, match="unknown GPU model 'B200'") as info:
        get_model("B200")
    for name in MODEL_NAMES:
        assert name in str(info.value)


# --- discovery -----------------------------------------------------------------------------


def test_discover_reports_constraints_of_the_model() -> None:
    """discover() lists count GPUs with the model's limits and full capabilities."""
    backend = SimulatedBackend(count=4, model="A100-SXM4", clock=FakeClock())
    infos = backend.discover()
    assert [i.index for i in infos] == [0, 1, 2, 3]
    assert len({i.uuid for i in infos}) == 4
    assert all(i.uuid.startswith("GPU-") for i in infos)
    info = infos[0]
    assert info.name == "NVIDIA A100-SXM4-80GB"
    assert (info.power_limit_min_mw, info.power_limit_max_mw) == (100_000, 400_000)
    assert info.power_limit_default_mw == 400_000
    assert info.sm_clock_max_mhz == 1410
    assert info.supported_sm_clocks_mhz[0] == 1410
    assert info.capabilities.power_limit_write
    assert info.capabilities.sm_clock_lock
    assert isinstance(backend, GpuBackend)


def test_uuids_depend_on_the_seed_only() -> None:
    """The same seed gives the same GPU identities; another seed gives others."""
    first = [i.uuid for i in SimulatedBackend(seed=7, clock=FakeClock()).discover()]
    again = [i.uuid for i in SimulatedBackend(seed=7, clock=FakeClock(5.0)).discover()]
    other = [i.uuid for i in SimulatedBackend(seed=8, clock=FakeClock()).discover()]
    assert first == again
    assert not set(first) & set(other)


# --- physics -----------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["A100-SXM4", "H100-SXM", "H200-SXM"])
def test_power_rises_with_utilization(model: str) -> None:
    """Mean power grows strictly with utilization and stays above idle."""
    means = []
    for util in (0.0, 0.2, 0.5, 0.8):
        clock = FakeClock()
        backend = make(clock, model=model, load=ConstantLoad(util))
        means.append(fmean(watts(run(backend, clock, 5.0))))
    assert means == sorted(means)
    assert all(b - a > 10 for a, b in pairwise(means))
    assert means[0] == pytest.approx(get_model(model).idle_power_w, abs=2)


def test_lower_clock_lock_lowers_power() -> None:
    """Locking the SM clock lower cuts power roughly as f**2.5 on the compute share."""
    clock = FakeClock()
    backend = make(clock, load=ConstantLoad(0.8))
    free = fmean(watts(run(backend, clock, 3.0)))
    backend.lock_sm_clocks_mhz(0, 345, 1305)
    capped = run(backend, clock, 3.0)
    assert capped[-1].sm_clock_mhz == 1305
    assert capped[-1].locked_sm_clocks_mhz == (345, 1305)
    assert fmean(watts(capped)) < 0.7 * free
    backend.lock_sm_clocks_mhz(0, 345, 990)
    assert fmean(watts(run(backend, clock, 3.0))) < fmean(watts(capped)) - 50


def test_power_never_exceeds_the_limit_beyond_noise() -> None:
    """Full load under a 300 W limit runs at the limit with SW_POWER_CAP and a lower clock."""
    clock = FakeClock()
    backend = make(clock, load=ConstantLoad(1.0))
    backend.set_power_limit_mw(0, 300_000)
    samples = run(backend, clock, 30.0)
    assert max(watts(samples)) <= 300 * 1.015
    assert fmean(watts(samples)) > 300 * 0.95  # the limiter does not waste the budget
    last = samples[-1]
    assert last.clock_event_reasons is not None
    assert last.clock_event_reasons & CLOCK_EVENT_SW_POWER_CAP
    assert last.sm_clock_mhz is not None
    assert last.sm_clock_mhz < 1980
    assert last.enforced_power_limit_mw == last.power_limit_mw == 300_000


def test_inference_load_stays_under_the_default_limit() -> None:
    """Prefill bursts hit the TDP limit but never exceed it; decode sits well below."""
    clock = FakeClock()
    backend = make(clock, load="inference")
    power_w = watts(run(backend, clock, 120.0))
    assert max(power_w) <= 700 * 1.015
    assert max(power_w) > 650  # prefill bursts reach the limit
    assert 400 < fmean(power_w) < 620


def test_temperature_settles_at_coolant_plus_r_times_power() -> None:
    """After ten time constants the die sits at T_coolant + R * P (within sensor rounding)."""
    clock = FakeClock()
    backend = make(clock, load=ConstantLoad(0.6), coolant_inlet_c=25.0)
    model = backend.model
    samples = run(backend, clock, 10 * model.thermal_time_constant_s, interval_s=0.5)
    tail = samples[-20:]
    power_w = fmean(s.power_avg_mw / 1000 for s in tail if s.power_avg_mw is not None)
    expected_c = 25.0 + model.thermal_resistance_c_per_w * power_w
    assert fmean(s.gpu_temp_c for s in tail if s.gpu_temp_c is not None) == pytest.approx(
        expected_c, abs=0.8
    )
    mem_c, gpu_c = tail[-1].mem_temp_c, tail[-1].gpu_temp_c
    assert mem_c is not None
    assert gpu_c is not None
    assert mem_c - gpu_c == pytest.approx(model.mem_temp_offset_c * 0.6, abs=1.5)


def test_temperature_follows_a_first_order_response() -> None:
    """One time constant after a step, about 63 % of the rise has happened."""
    clock = FakeClock()
    backend = make(clock, load="idle", coolant_inlet_c=30.0)
    model = backend.model
    start_c = backend.sample(0).gpu_temp_c
    assert start_c is not None
    backend.set_utilization(0, 1.0)
    at_tau = run(backend, clock, model.thermal_time_constant_s)[-1]
    settled = run(backend, clock, 10 * model.thermal_time_constant_s)[-1]
    assert at_tau.gpu_temp_c is not None
    assert settled.gpu_temp_c is not None
    fraction = (at_tau.gpu_temp_c - start_c) / (settled.gpu_temp_c - start_c)
    assert fraction == pytest.approx(1 - math.exp(-1), abs=0.06)


def test_energy_is_monotonic_and_integrates_power() -> None:
    """The energy counter never decreases and matches the integral of power within 0.2 %."""
    clock = FakeClock()
    backend = make(clock, load="inference")
    first = backend.sample(0)
    samples = run(backend, clock, 60.0, interval_s=0.05)
    energies = [s.energy_mj for s in [first, *samples] if s.energy_mj is not None]
    assert all(b >= a for a, b in pairwise([float(e) for e in energies]))
    measured_j = (energies[-1] - energies[0]) / 1000
    integral_j = sum(watts(samples)) * 0.05
    assert measured_j == pytest.approx(integral_j, rel=0.002)


def test_long_gap_is_integrated_in_coarse_steps() -> None:
    """An hour without reads costs one sample and still accounts the hour's energy."""
    clock = FakeClock()
    backend = make(clock, load=ConstantLoad(0.5))
    before = backend.sample(0)
    clock.advance(3600.0)
    after = backend.sample(0)
    assert before.energy_mj is not None
    assert after.energy_mj is not None
    assert after.power_avg_mw is not None
    energy_j = (after.energy_mj - before.energy_mj) / 1000
    assert energy_j == pytest.approx(after.power_avg_mw / 1000 * 3600, rel=0.02)


def test_idle_gpu_reports_idle_reason_and_lowest_clock() -> None:
    """An idle GPU draws idle power at the lowest clock with reason GPU_IDLE."""
    clock = FakeClock()
    backend = make(clock, model="A100-SXM4", load="idle")
    last = run(backend, clock, 2.0)[-1]
    assert last.clock_event_reasons == CLOCK_EVENT_GPU_IDLE
    assert last.sm_clock_mhz == 210
    assert last.gpu_util_pct == 0.0
    assert last.power_mw == pytest.approx(55_000, abs=2_000)


def test_hot_coolant_triggers_thermal_slowdown() -> None:
    """With 65 °C coolant a full GPU reaches the slowdown threshold and is held near it."""
    clock = FakeClock()
    backend = make(clock, load=ConstantLoad(1.0), coolant_inlet_c=65.0)
    model = backend.model
    samples = run(backend, clock, 15 * model.thermal_time_constant_s, interval_s=0.5)
    last = samples[-1]
    assert last.clock_event_reasons is not None
    assert last.clock_event_reasons & CLOCK_EVENT_SW_THERMAL_SLOWDOWN
    assert last.sm_clock_mhz is not None
    assert last.sm_clock_mhz < model.sm_clock_max_mhz
    assert max(s.gpu_temp_c or 0 for s in samples) <= model.slowdown_temp_c + 2


def test_power_brake_nearly_halts_the_gpu() -> None:
    """An engaged power brake drops the clock to a near halt with reason 0x80."""
    clock = FakeClock()
    backend = make(clock, load=ConstantLoad(1.0))
    backend.set_power_brake(0, engaged=True)
    last = run(backend, clock, 1.0)[-1]
    assert last.clock_event_reasons is not None
    assert last.clock_event_reasons & CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN
    assert last.sm_clock_mhz is not None
    assert last.sm_clock_mhz <= 345
    backend.set_power_brake(0, engaged=False)
    assert run(backend, clock, 1.0)[-1].sm_clock_mhz == 1905


# --- determinism -------------------------------------------------------------------------


def _trace(seed: int) -> list[GpuSample]:
    clock = FakeClock()
    backend = SimulatedBackend(count=3, seed=seed, clock=clock, load="inference")
    samples: list[GpuSample] = []
    for step in range(200):
        clock.advance(0.1)
        if step == 50:
            backend.set_power_limit_mw(1, 400_000)
        samples.extend(backend.sample(i) for i in range(3))
    return samples


def test_same_seed_and_clock_give_the_same_samples() -> None:
    """Two runs with one seed and one clock sequence are identical, timestamps included."""
    assert _trace(3) == _trace(3)


def test_other_seed_gives_other_samples() -> None:
    """Another seed changes the load and the noise."""
    assert [s.power_mw for s in _trace(3)] != [s.power_mw for s in _trace(4)]


def test_gpus_of_one_node_do_not_move_in_lockstep() -> None:
    """Each GPU has its own inference stream, so their utilizations differ."""
    clock = FakeClock()
    backend = SimulatedBackend(count=2, clock=clock, load="inference")
    differ = 0
    for _ in range(50):
        clock.advance(0.5)
        differ += backend.sample(0).gpu_util_pct != backend.sample(1).gpu_util_pct
    assert differ > 25


# --- faults ------------------------------------------------------------------------------


def test_lost_gpu_raises_on_every_call_and_others_go_on() -> None:
    """lose_gpu(i) makes every call on i raise GpuLostError(index=i); restore brings it back."""
    clock = FakeClock()
    backend = make(clock, count=3)
    backend.set_power_limit_mw(1, 500_000)
    backend.lose_gpu(1)
    for call in (
        lambda: backend.sample(1),
        lambda: backend.set_power_limit_mw(1, 400_000),
        lambda: backend.lock_sm_clocks_mhz(1, 345, 1500),
        lambda: backend.reset_sm_clocks(1),
    ):
        with pytest.raises(GpuLostError) as info:
            call()
        assert info.value.index == 1
    assert backend.sample(0).index == 0
    assert backend.sample(2).index == 2
    backend.restore_gpu(1)
    assert backend.sample(1).power_limit_mw == 700_000  # a reset GPU is back at default


def test_denied_writes_say_how_to_fix_and_reads_go_on() -> None:
    """deny_writes() makes writes fail with a message naming every fix."""
    clock = FakeClock()
    backend = make(clock)
    backend.deny_writes()
    with pytest.raises(GpuPermissionError) as info:
        backend.check_write_access()
    message = str(info.value)
    for hint in (
        "root",
        "CAP_SYS_ADMIN",
        "CapabilityBoundingSet=CAP_SYS_ADMIN",
        "--cap-add SYS_ADMIN",
        "observe_only",
    ):
        assert hint in message
    with pytest.raises(GpuPermissionError):
        backend.set_power_limit_mw(0, 500_000)
    with pytest.raises(GpuPermissionError):
        backend.lock_sm_clocks_mhz(0, 345, 1500)
    with pytest.raises(GpuPermissionError):
        backend.reset_sm_clocks(0)
    assert backend.sample(0).power_limit_mw == 700_000
    backend.allow_writes()
    backend.check_write_access()
    backend.set_power_limit_mw(0, 500_000)
    assert backend.sample(0).power_limit_mw == 500_000


def test_unprivileged_backend_denies_writes_from_the_start() -> None:
    """privileged=False behaves as deny_writes() from construction."""
    backend = make(FakeClock(), privileged=False)
    with pytest.raises(GpuPermissionError):
        backend.check_write_access()


def test_stuck_sensor_freezes_one_reading() -> None:
    """stick_sensor freezes gpu_temp_c while the die heats; unstick lets it follow again."""
    clock = FakeClock()
    backend = make(clock)
    frozen_c = backend.sample(0).gpu_temp_c
    backend.stick_sensor(0, "gpu_temp_c")
    backend.set_utilization(0, 1.0)
    samples = run(backend, clock, 60.0)
    assert {s.gpu_temp_c for s in samples} == {frozen_c}
    assert samples[-1].mem_temp_c is not None
    assert frozen_c is not None
    assert samples[-1].mem_temp_c > frozen_c + 15  # the other sensors still move
    backend.unstick_sensor(0)
    later_c = backend.sample(0).gpu_temp_c
    assert later_c is not None
    assert later_c > frozen_c + 15
    with pytest.raises(ValueError, match="cannot stick 'uuid'"):
        backend.stick_sensor(0, "uuid")


def test_coolant_temperature_moves_the_die_temperature() -> None:
    """Raising the coolant inlet by 20 °C raises the settled die temperature by 20 °C."""
    clock = FakeClock()
    backend = make(clock, load=ConstantLoad(0.3), count=2)
    tau_s = backend.model.thermal_time_constant_s
    cool = run(backend, clock, 10 * tau_s, interval_s=1.0)[-1].gpu_temp_c
    backend.set_coolant_inlet_c(50.0, index=0)
    hot = run(backend, clock, 10 * tau_s, interval_s=1.0)[-1].gpu_temp_c
    assert cool is not None
    assert hot is not None
    assert hot - cool == pytest.approx(20.0, abs=1.5)
    assert backend.sample(1).gpu_temp_c == pytest.approx(cool, abs=1.5)


def test_external_tool_can_change_the_limit_even_when_polca_cannot() -> None:
    """external_set_power_limit_mw simulates nvidia-smi -pl; samples show the new limit."""
    backend = make(FakeClock(), privileged=False)
    backend.external_set_power_limit_mw(0, 450_000)
    sample = backend.sample(0)
    assert sample.power_limit_mw == sample.enforced_power_limit_mw == 450_000
    with pytest.raises(GpuInvalidArgumentError):
        backend.external_set_power_limit_mw(0, 900_000)


def test_out_of_band_limit_lowers_the_enforced_limit_only() -> None:
    """An OOB limit shows as the enforced limit and binds power; the requested one stays."""
    clock = FakeClock()
    backend = make(clock, load=ConstantLoad(1.0))
    backend.set_oob_limit_mw(0, 350_000)
    samples = run(backend, clock, 5.0)
    assert samples[-1].power_limit_mw == 700_000
    assert samples[-1].enforced_power_limit_mw == 350_000
    assert max(watts(samples)) <= 350 * 1.015
    backend.set_oob_limit_mw(0, None)
    assert backend.sample(0).enforced_power_limit_mw == 700_000


def test_per_gpu_load_override() -> None:
    """set_load and set_utilization change one GPU and leave the others alone."""
    clock = FakeClock()
    backend = make(clock, count=3, load="idle")
    backend.set_load(1, "constant:0.9")
    backend.set_utilization(2, 0.4)
    clock.advance(1.0)
    assert [backend.sample(i).gpu_util_pct for i in range(3)] == [0.0, 90.0, 40.0]


def test_closed_backend_refuses_calls_until_rediscovered() -> None:
    """After close() calls raise GpuLibraryError; discover() opens the library again."""
    backend = make(FakeClock())
    backend.close()
    backend.close()
    with pytest.raises(GpuLibraryError):
        backend.sample(0)
    backend.discover()
    assert backend.sample(0).index == 0


# --- write validation --------------------------------------------------------------------


@pytest.mark.parametrize("limit_mw", [199_999, 700_001, 0, -1])
def test_power_limit_outside_constraints_is_rejected(limit_mw: int) -> None:
    """A limit outside [min, max] raises GpuInvalidArgumentError and changes nothing."""
    backend = make(FakeClock())
    with pytest.raises(GpuInvalidArgumentError, match="outside") as info:
        backend.set_power_limit_mw(3, limit_mw)
    assert info.value.index == 3
    assert backend.sample(3).power_limit_mw == 700_000


def test_power_limit_bounds_are_accepted() -> None:
    """Exactly min and exactly max are valid limits; the enforced limit follows."""
    backend = make(FakeClock())
    backend.set_power_limit_mw(0, 200_000)
    assert backend.sample(0).enforced_power_limit_mw == 200_000
    backend.set_power_limit_mw(0, 700_000)
    assert backend.sample(0).enforced_power_limit_mw == 700_000


@pytest.mark.parametrize(
    ("min_mhz", "max_mhz"), [(345, 1000), (345, 1995), (330, 1500), (1500, 1395)]
)
def test_unsupported_clock_lock_is_rejected(min_mhz: int, max_mhz: int) -> None:
    """Off-grid, out-of-range and inverted clock locks raise GpuInvalidArgumentError."""
    backend = make(FakeClock())
    with pytest.raises(GpuInvalidArgumentError, match="cannot lock"):
        backend.lock_sm_clocks_mhz(0, min_mhz, max_mhz)
    assert backend.sample(0).locked_sm_clocks_mhz is None


def test_reset_removes_the_lock() -> None:
    """reset_sm_clocks clears the reported lock and the GPU boosts again."""
    clock = FakeClock()
    backend = make(clock, load=ConstantLoad(0.5))
    backend.lock_sm_clocks_mhz(0, 1500, 1500)
    assert run(backend, clock, 0.5)[-1].sm_clock_mhz == 1500
    backend.reset_sm_clocks(0)
    last = run(backend, clock, 0.5)[-1]
    assert last.locked_sm_clocks_mhz is None
    assert last.sm_clock_mhz == 1980


def test_unknown_index_is_an_invalid_argument() -> None:
    """Index 8 on an 8-GPU node raises GpuInvalidArgumentError."""
    backend = make(FakeClock())
    with pytest.raises(GpuInvalidArgumentError, match="no GPU 8"):
        backend.sample(8)


# --- load profiles -------------------------------------------------------------------------


def test_scripted_profile_drives_the_backend() -> None:
    """A scripted load set on a GPU is what its utilization reading follows."""
    clock = FakeClock()
    backend = make(clock)
    backend.set_load(0, ScriptedLoad(((0.0, 0.0), (10.0, 1.0))))
    clock.advance(5.0)
    assert backend.sample(0).gpu_util_pct == 50.0
