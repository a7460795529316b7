"""The GPU, server and row physics, and the checks that reject impossible rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.sim.model import (
    SERVER_PRESETS,
    ControlConfig,
    RowConfig,
    SimConfig,
    SimConfigError,
    server_preset,
    sim_gpu,
)
from tests.sim.conftest import row

A100 = sim_gpu("A100-SXM4")


def test_power_falls_with_the_clock_and_keeps_the_memory_share() -> None:
    """Full clock draws the full phase power; lower clocks only cut the SM share."""
    full = np.array([400.0])
    assert A100.power_w(full, np.array([1.0]), 0.15)[0] == pytest.approx(400.0)
    low = A100.power_w(full, np.array([0.5]), 0.15)[0]
    dynamic = 400.0 - A100.resident_power_w
    expected = A100.resident_power_w + dynamic * (0.15 + 0.85 * 0.5**2.5)
    assert low == pytest.approx(expected)
    # Decode keeps more of its power under the same lock: it is memory-bound.
    assert A100.power_w(full, np.array([0.5]), A100.decode_mem_share)[0] > low


@given(
    full_w=st.floats(100.0, 500.0),
    limit_w=st.floats(100.0, 450.0),
    mem_share=st.sampled_from([0.15, 0.6]),
)
def test_clock_for_limit_meets_the_limit_or_bottoms_out(
    full_w: float, limit_w: float, mem_share: float
) -> None:
    """The power controller's clock fits the limit, is max when it fits, min when it can't."""
    x = A100.clock_for_limit(np.array([full_w]), np.array([limit_w]), mem_share)[0]
    power = A100.power_w(np.array([full_w]), np.array([x]), mem_share)[0]
    assert A100.min_clock_frac <= x <= 1.0
    if full_w <= limit_w:
        assert x == 1.0
    elif x > A100.min_clock_frac + 1e-9:
        assert power == pytest.approx(limit_w, rel=1e-6)
    else:
        assert power >= limit_w - 1e-6


def test_prefill_spikes_higher_for_longer_prompts_and_decode_with_batch() -> None:
    """Prefill power rises with the prompt to 1.1 x TDP; decode with the batch to a cap."""
    pre = A100.prefill_frac(np.array([0.0, 2048.0, 4096.0, 8000.0]))
    assert list(pre) == pytest.approx([0.8, 0.95, 1.1, 1.1])
    dec = A100.decode_frac(np.array([1.0, 2.0, 100.0]))
    assert list(dec) == pytest.approx([0.45, 0.48, 0.65])


def test_dgx_a100_preset_matches_polca_server_figures() -> None:
    """At full load a DGX-A100 draws ~5.7 kW, GPUs ~60% of it (POLCA §2.2)."""
    preset = server_preset("A100-SXM4")
    r = RowConfig(
        servers=1,
        gpus_per_server=8,
        gpu=A100,
        budget_w=preset.provisioned_w,
        server_other_w=preset.other_w,
        server_overhead_frac=preset.overhead_frac,
    )
    gpus_w = 8 * A100.tdp_w * 1.1  # every GPU in a long prefill, above TDP
    server_w = r.server_power_w(gpus_w)
    assert server_w == pytest.approx(preset.provisioned_w, rel=0.05)
    assert 0.55 <= gpus_w / server_w <= 0.65
    assert set(SERVER_PRESETS) == {
        g.lower() for g in ("A100-SXM4", "A100-SXM4-40GB", "H100-SXM", "H200-SXM")
    }


def test_impossible_row_is_rejected_with_its_numbers() -> None:
    """A budget below the row's idle power cannot be met by any policy: say so."""
    with pytest.raises(SimConfigError, match=r"impossible row: 10 servers idle at 11600 W"):
        row(servers=10, gpus=2, budget_w=10_000.0, other_w=1000.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"servers": 0}, "at least one server"),
        ({"gpus": 0}, "at least one GPU"),
        ({"budget_w": -5.0}, "positive number of watts"),
        ({"other_w": -1.0}, "non-GPU server power"),
    ],
)
def test_bad_row_numbers_name_the_field(kwargs: dict[str, float], message: str) -> None:
    """Each bad row input raises SimConfigError naming what is wrong."""
    with pytest.raises(SimConfigError, match=message):
        row(**kwargs)  # type: ignore[arg-type]


def test_control_and_step_checks() -> None:
    """Negative delays, a telemetry period shorter than a step and bad jitter are errors."""
    with pytest.raises(SimConfigError, match="actuation_delay_s must be >= 0"):
        ControlConfig(actuation_delay_s=-1.0)
    with pytest.raises(SimConfigError, match="actuation_jitter"):
        ControlConfig(actuation_jitter=1.5)
    with pytest.raises(SimConfigError, match="at least one step"):
        SimConfig(row=row(), control=ControlConfig(telemetry_period_s=0.05), step_s=0.1)
    with pytest.raises(SimConfigError, match="step_s"):
        SimConfig(row=row(), step_s=0.0)


def test_unknown_gpu_lists_the_known_ones() -> None:
    """A typo in the model name lists the presets."""
    with pytest.raises(SimConfigError, match="known models: A100-SXM4, A100-SXM4-40GB"):
        sim_gpu("A10")
