"""Fitting a profile to a clock sweep: the fits recover known constants from points the
model itself draws (with sensor noise), and the written profile loads and runs."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from polca.errors import SimConfigError
from polca.physics import power
from polca.sim.calibrate import (
    SweepPoint,
    calibrated_profile,
    fit_power_curve,
    fit_time_exponent,
)
from polca.sim.profile import parse_profile, resolve_profile, shipped_profile

REPO = Path(__file__).resolve().parents[2]

MAX_MHZ = 1980.0
RESIDENT_W = 120.0


def _sweep(
    *, mem_share: float, exponent: float, time_exponent: float, full_w: float, seed: int = 1
) -> list[SweepPoint]:
    """A kernel swept over clocks as the model says it behaves, with 1% noise."""
    rng = np.random.default_rng(seed)
    out = []
    for mhz in (1980, 1800, 1600, 1400, 1200, 1000):
        f = mhz / MAX_MHZ
        scale = power.dynamic_scale(f, mem_share=mem_share, clock_power_exponent=exponent)
        watts = RESIDENT_W + (full_w - RESIDENT_W) * scale
        seconds = 0.010 * f**-time_exponent
        out.append(
            SweepPoint(
                mhz,
                watts * (1 + 0.01 * rng.standard_normal()),
                seconds * (1 + 0.01 * rng.standard_normal()),
            )
        )
    return out


def test_fits_recover_the_constants_that_drew_the_points() -> None:
    """Time exponent within 0.05, memory share within 0.05, power exponent within 0.3."""
    compute = _sweep(mem_share=0.15, exponent=2.5, time_exponent=0.95, full_w=690.0)
    memory = _sweep(mem_share=0.7, exponent=2.5, time_exponent=0.15, full_w=450.0)
    e_p, rms = fit_time_exponent(compute, max_mhz=MAX_MHZ)
    assert e_p == pytest.approx(0.95, abs=0.05)
    assert rms < 0.03
    assert fit_time_exponent(memory, max_mhz=MAX_MHZ)[0] == pytest.approx(0.15, abs=0.05)
    m_p, a, err = fit_power_curve(compute, max_mhz=MAX_MHZ, resident_w=RESIDENT_W)
    assert m_p == pytest.approx(0.15, abs=0.05)
    assert a == pytest.approx(2.5, abs=0.3)
    assert err < 10.0
    m_d, a_d, _ = fit_power_curve(memory, max_mhz=MAX_MHZ, resident_w=RESIDENT_W, exponent=a)
    assert a_d == a
    assert m_d == pytest.approx(0.7, abs=0.07)


def test_a_calibrated_profile_loads_and_names_its_sources() -> None:
    """The written profile keeps the base's other fields and says where each fit came from."""
    base = shipped_profile("h100-sxm")
    compute = _sweep(mem_share=0.2, exponent=2.2, time_exponent=0.6, full_w=690.0)
    memory = _sweep(mem_share=0.75, exponent=2.2, time_exponent=0.1, full_w=420.0)
    text = calibrated_profile(
        base,
        name="H100-site",
        where="GPU-1234 (NVIDIA H100 80GB HBM3) on 2026-12-01",
        prefill=compute,
        decode=memory,
        resident_w=118.0,
    )
    profile = parse_profile(text, source="calibrated")
    assert profile.name == "H100-site"
    assert profile.gpu.prefill_clock_exponent.value == pytest.approx(0.6, abs=0.05)
    assert profile.gpu.decode_clock_exponent.value == pytest.approx(0.1, abs=0.05)
    assert profile.gpu.resident_power_w.value == 118.0
    assert "GPU-1234" in profile.gpu.decode_mem_share.source
    assert profile.gpu.tdp_w == base.gpu.tdp_w  # untouched fields keep value and source
    assert profile.server == base.server


def test_too_few_or_bad_points_are_refused() -> None:
    """Two clocks, a zero reading, or a clock above the maximum: SimConfigError."""
    good = _sweep(mem_share=0.15, exponent=2.5, time_exponent=1.0, full_w=690.0)
    with pytest.raises(SimConfigError, match="at least 3"):
        fit_time_exponent(good[:2], max_mhz=MAX_MHZ)
    with pytest.raises(SimConfigError, match="positive readings"):
        fit_time_exponent([*good[:3], SweepPoint(1500, 0.0, 0.01)], max_mhz=MAX_MHZ)
    with pytest.raises(SimConfigError, match="positive readings"):
        fit_power_curve([*good, SweepPoint(2500, 500.0, 0.01)], max_mhz=MAX_MHZ, resident_w=100)
    with pytest.raises(SimConfigError, match="no more than the resident"):
        fit_power_curve(good, max_mhz=MAX_MHZ, resident_w=5000.0)


def test_gpu_check_writes_a_profile_from_its_sweep(tmp_path: Path) -> None:
    """bench/gpu_check.py's writer: the sweep of a report becomes a loadable profile built
    on the closest shipped one, each fitted field naming the GPU."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    assert spec is not None
    assert spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    compute = _sweep(mem_share=0.2, exponent=2.3, time_exponent=0.8, full_w=690.0)
    memory = _sweep(mem_share=0.7, exponent=2.3, time_exponent=0.2, full_w=420.0)
    report = {
        "started_at": "2026-12-01T10:00:00Z",
        "gpu": {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-abcd"},
        "sweep": {
            "max_mhz": 1980,
            "idle_w": 121.0,
            "matmul": [dataclasses.asdict(p) for p in compute],
            "stream": [dataclasses.asdict(p) for p in memory],
        },
    }
    path = gpu_check.write_profile(report, tmp_path / "site.yaml")
    profile = resolve_profile(path)
    assert profile.name == "H100-SXM-measured"
    assert profile.gpu.prefill_clock_exponent.value == pytest.approx(0.8, abs=0.05)
    assert (
        "GPU-abcd (NVIDIA H100 80GB HBM3) on 2026-12-01" in profile.gpu.clock_power_exponent.source
    )
    assert gpu_check.base_profile_name("NVIDIA A100-SXM4-40GB") == "a100-sxm4-40gb"
    assert gpu_check.base_profile_name("NVIDIA A100-SXM4-80GB") == "a100-sxm4"
    assert gpu_check.base_profile_name("Tesla T4") == "h100-sxm"
