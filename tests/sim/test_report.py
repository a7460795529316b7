"""Metrics against the uncapped run, and the JSON, CSV and PNG outputs."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polca.policy import Policy
from polca.sim import report
from polca.sim.runner import RunResult
from polca.sim.scenario import simulate
from polca.sim.workload import load_trace
from tests.sim.conftest import tiny_scenario


@pytest.fixture(scope="module")
def pair(a100_policy: Policy) -> tuple[RunResult, RunResult, dict[str, Any]]:
    """A tiny row at +50% under polca-a100 with in-band actuation, and its reference."""
    s = tiny_scenario(oversubscription=0.5)
    s = replace(s, control=replace(s.control, actuation_delay_s=0.012))
    return simulate(s, load_trace("azure-code"), a100_policy, policy_file="polca-a100.yaml")


def test_impact_pct() -> None:
    """Relative change in %, 0 for 0/0, inf for x/0, NaN through."""
    assert report.impact_pct(1.1, 1.0) == pytest.approx(10.0)
    assert report.impact_pct(0.0, 0.0) == 0.0
    assert report.impact_pct(1.0, 0.0) == math.inf
    assert math.isnan(report.impact_pct(math.nan, 1.0))


def test_reference_against_itself_costs_nothing(
    pair: tuple[RunResult, RunResult, dict[str, Any]],
) -> None:
    """Comparing the uncapped run with itself gives zero impact and zero loss."""
    _, base, _ = pair
    m = report.compare(base, base)
    for c in m["classes"].values():
        assert c["p50_impact_pct"] == 0.0
        assert c["p99_impact_pct"] == 0.0
        assert c["throughput_loss_pct"] == 0.0
    assert m["brake_events"] == 0


def test_capped_run_reports_every_metric(pair: tuple[RunResult, RunResult, dict[str, Any]]) -> None:
    """Classes, power, levels, brakes and engine calls; capping costs the low class more."""
    summary = pair[2]
    m = summary["metrics"]
    assert set(m["classes"]) == {"high", "low"}
    low, high = m["classes"]["low"], m["classes"]["high"]
    assert low["throughput_loss_pct"] > high["throughput_loss_pct"] >= 0.0
    assert low["requests"] > 100
    assert m["levels"]["capping_events"] >= 1
    assert sum(m["levels"]["time_at_level_pct"].values()) == pytest.approx(100.0)
    assert m["power"]["peak_pct"] < m["power"]["uncapped_peak_pct"]
    assert m["power"]["energy_kwh"] < m["power"]["uncapped_energy_kwh"]
    assert m["engine"]["decide_calls"] >= 1
    assert summary["row"]["servers"] == 6
    assert summary["row"]["oversubscription_pct"] == pytest.approx(50.0)


def test_level_episodes_are_counted_from_the_controller_series(
    pair: tuple[RunResult, RunResult, dict[str, Any]],
) -> None:
    """Episodes are runs of level >= 1; durations are whole controller periods."""
    capped, _, _ = pair
    stats = report.level_stats(capped)
    series = capped.level[:, 0]
    starts = np.count_nonzero((series[1:] > 0) & (series[:-1] == 0)) + int(series[0] > 0)
    assert stats["capping_events"] == starts
    period = capped.config.control.telemetry_period_s
    assert stats["capping_total_s"] == pytest.approx(np.count_nonzero(series > 0) * period)


def test_outputs_are_written(
    pair: tuple[RunResult, RunResult, dict[str, Any]], tmp_path: Path
) -> None:
    """summary.json (no NaN), series.csv (1 s rows) and two small PNGs."""
    capped, base, summary = pair
    notes = report.write_outputs(tmp_path, capped=capped, base=base, summary=summary)
    assert notes == []
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["metrics"]["classes"]["low"]["p99_s"] > 0
    with (tmp_path / "series.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 300
    assert {"t_s", "power_w", "uncapped_power_w", "level", "level_name"} <= set(rows[0])
    for name in ("power.png", "latency.png"):
        size = (tmp_path / name).stat().st_size
        assert 5_000 < size < 300_000
    assert "brake events: 0" in report.render_text(summary)
