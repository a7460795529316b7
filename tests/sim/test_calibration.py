"""Calibration against POLCA's production measurements of LLM-inference rows.

At 0% oversubscription an inference row peaks near 79% of its provisioned power and
moves at most about 9% of it within 2 s (POLCA, ASPLOS '24, Table 4). The default row
(40 DGX-A100 servers replaying the bundled Azure code trace at the preset load) must
reproduce both; docs/simulator.md says how the constants were chosen.
"""

from __future__ import annotations

import pytest

from polca.sim.report import power_stats
from polca.sim.scenario import Scenario, run_once
from polca.sim.workload import load_trace


@pytest.fixture(scope="module")
def base_row_stats() -> dict[str, float]:
    """Half an hour of the default A100 row, uncapped, without oversubscription."""
    result = run_once(Scenario(duration_s=1800.0, seed=0), load_trace("azure-code"), None)
    return power_stats(result, warmup_s=60.0)


def test_inference_row_peaks_near_79_percent(base_row_stats: dict[str, float]) -> None:
    """The row's peak (2 s averages, as row telemetry reports) is 79% +- 3 points."""
    assert 76.0 <= base_row_stats["peak_2s_pct"] <= 82.0


def test_inference_row_moves_at_most_9_percent_in_2_s(base_row_stats: dict[str, float]) -> None:
    """The largest change between consecutive 2 s averages is within 9% of the budget."""
    assert 2.0 <= base_row_stats["max_swing_2s_pct"] <= 9.0


def test_inference_row_is_well_below_peak_on_average(base_row_stats: dict[str, float]) -> None:
    """Headroom exists because the average sits well below the peak."""
    assert base_row_stats["mean_pct"] < base_row_stats["peak_2s_pct"] - 8.0
