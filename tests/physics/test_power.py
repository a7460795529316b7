"""The shared power/clock curve: one formula for floats and arrays, its inverse, its users."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.gpu.clocks import snap_down_to_grid_mhz
from polca.gpu.simulated import SimulatedBackend
from polca.physics import power
from polca.physics.presets import MODEL_NAMES, get_model
from polca.sim.model import sim_gpu
from polca.workload.profiles import ConstantLoad

fractions = st.floats(0.05, 1.0)
shares = st.floats(0.0, 0.9)
exponents = st.floats(1.0, 3.0)


@given(x=fractions, mem_share=shares, exponent=exponents, base_w=st.floats(0.0, 200.0))
def test_floats_and_arrays_follow_the_same_curve(
    x: float, mem_share: float, exponent: float, base_w: float
) -> None:
    """A float and a one-element array give the same power (the backend's and the sim's)."""
    kwargs = {"mem_share": mem_share, "clock_power_exponent": exponent}
    scalar = power.power_w(base_w, 300.0, clock_frac=x, **kwargs)
    vector = power.power_w(base_w, np.array([300.0]), clock_frac=np.array([x]), **kwargs)
    assert vector[0] == pytest.approx(scalar, rel=1e-12)
    assert scalar == pytest.approx(base_w + 300.0 * power.dynamic_scale(x, **kwargs))


def test_full_clock_draws_everything_and_a_stopped_clock_the_memory_share() -> None:
    """dynamic_scale is 1 at the maximum clock and tends to the memory share at zero."""
    assert power.dynamic_scale(1.0, mem_share=0.2, clock_power_exponent=2.5) == 1.0
    assert power.dynamic_scale(0.0, mem_share=0.2, clock_power_exponent=2.5) == 0.2
    assert power.dynamic_scale(0.5, mem_share=0.0, clock_power_exponent=2.0) == 0.25


@given(x=fractions, mem_share=shares, exponent=exponents)
def test_the_clock_for_a_limit_inverts_the_curve(
    x: float, mem_share: float, exponent: float
) -> None:
    """The clock a limit leaves is the clock at which power equals that limit."""
    limit_w = power.power_w(
        60.0, 400.0, clock_frac=x, mem_share=mem_share, clock_power_exponent=exponent
    )
    sm_scale = power.sm_scale_for_limit(60.0, 400.0, limit_w=limit_w, mem_share=mem_share)
    assert sm_scale == pytest.approx(x**exponent, abs=1e-9)
    back = power.clock_frac_for_sm_scale(max(sm_scale, 0.0), clock_power_exponent=exponent)
    assert back == pytest.approx(x, rel=1e-6)


def test_limits_outside_the_clock_range_leave_the_scale_outside_zero_to_one() -> None:
    """Below the power at any clock the scale is negative; above full power it exceeds 1."""
    kwargs = {"mem_share": 0.15}
    assert power.sm_scale_for_limit(60.0, 400.0, limit_w=100.0, **kwargs) < 0.0
    assert power.sm_scale_for_limit(60.0, 400.0, limit_w=500.0, **kwargs) > 1.0


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_the_simulator_and_the_backend_share_each_gpus_curve(name: str) -> None:
    """Both simulations take a GPU's clock range, exponent and prefill share from one preset."""
    model, gpu = get_model(name), sim_gpu(name)
    assert gpu.clock_power_exponent == model.clock_power_exponent
    assert gpu.prefill_mem_share == model.mem_power_share
    assert (gpu.sm_clock_min_mhz, gpu.sm_clock_max_mhz, gpu.tdp_w) == (
        model.sm_clock_min_mhz,
        model.sm_clock_max_mhz,
        model.tdp_w,
    )


@pytest.mark.parametrize("limit_w", [150.0, 250.0, 330.0])
def test_a_capped_simulated_gpu_runs_the_highest_grid_clock_under_its_limit(
    limit_w: float,
) -> None:
    """The backend's clock under a power cap is the curve's clock, snapped down to its grid."""
    model = get_model("A100-SXM4")
    t_s = [0.0]
    backend = SimulatedBackend(count=1, model=model, load=ConstantLoad(1.0), clock=lambda: t_s[0])
    backend.set_power_limit_mw(0, round(limit_w * 1000))
    t_s[0] += 1.0
    kwargs = {"mem_share": model.mem_power_share}
    demand_w = model.max_demand_power_w - model.idle_power_w
    sm_scale = power.sm_scale_for_limit(model.idle_power_w, demand_w, limit_w=limit_w, **kwargs)
    frac = power.clock_frac_for_sm_scale(
        max(sm_scale, 0.0), clock_power_exponent=model.clock_power_exponent
    )
    expected_mhz = snap_down_to_grid_mhz(
        frac * model.sm_clock_max_mhz,
        min_mhz=model.sm_clock_min_mhz,
        max_mhz=model.sm_clock_max_mhz,
        step_mhz=model.sm_clock_step_mhz,
    )
    sample = backend.sample(0)
    assert sample.sm_clock_mhz == expected_mhz < model.sm_clock_max_mhz
    at_clock_w = power.power_w(
        model.idle_power_w,
        demand_w,
        clock_frac=expected_mhz / model.sm_clock_max_mhz,
        clock_power_exponent=model.clock_power_exponent,
        **kwargs,
    )
    assert at_clock_w <= limit_w or math.isclose(expected_mhz, model.sm_clock_min_mhz)


def test_the_simulated_backend_runs_without_numpy() -> None:
    """The daemon installs without numpy: the shared physics must not import it."""
    code = (
        "import sys; import polca.gpu.simulated, polca.physics.power; "
        "sys.exit('numpy' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    assert result.returncode == 0


def test_work_slowdown_mixes_prefill_and_decode_by_the_decode_share() -> None:
    """1 at the maximum clock; compute-bound prefill slows as f^-e_p, memory-bound decode
    as f^-e_d, mixed by the share of busy time spent decoding; floats and arrays alike."""
    kw = {"prefill_clock_exponent": 1.0, "decode_clock_exponent": 0.2}
    assert power.work_slowdown(1.0, decode_share=0.5, **kw) == 1.0
    assert power.work_slowdown(0.5, decode_share=0.0, **kw) == pytest.approx(2.0)
    assert power.work_slowdown(0.5, decode_share=1.0, **kw) == pytest.approx(0.5**-0.2)
    mixed = power.work_slowdown(0.5, decode_share=0.5, **kw)
    assert mixed == pytest.approx(0.5 * 2.0 + 0.5 * 0.5**-0.2)
    clocks = np.array([1.0, 0.9, 0.79, 0.5])
    slowdowns = power.work_slowdown(clocks, decode_share=0.5, **kw)
    assert np.all(np.diff(slowdowns) > 0)  # a lower clock is always slower
