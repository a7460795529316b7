"""Trace to requests: scaling, tenants, repetition, envelope, classes; trace errors."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from polca.sim.model import SimConfigError
from polca.sim.workload import (
    HP,
    LP,
    Envelope,
    Workload,
    WorkloadSpec,
    build_workload,
    load_trace,
    synthetic_chat_trace,
)
from polca.workload.trace import Trace, TraceError


@pytest.fixture(scope="module")
def code() -> Trace:
    """The bundled Azure code trace."""
    return load_trace("azure-code")


def test_load_scales_with_servers_and_wraps_the_trace(code: Trace) -> None:
    """2 copies per server x 3 servers over 2 laps: 12 laps' worth, sorted, in range."""
    lap_s = code.duration_s * len(code) / (len(code) - 1)
    spec = WorkloadSpec(duration_s=2 * lap_s, load_scale=2.0, tenants=3)
    w = build_workload(code, spec, servers=3)
    assert len(w) == pytest.approx(12 * len(code), rel=0.01)
    assert np.all(np.diff(w.arrival_s) >= 0)
    assert w.arrival_s[0] >= 0.0
    assert w.arrival_s[-1] < spec.duration_s
    assert set(np.unique(w.ctx_tokens)) <= set(np.asarray(code.context_tokens, dtype=float))


def test_fractional_scale_thins_and_envelope_shapes(code: Trace) -> None:
    """Half the copies keep half; a raised cosine with trough 0.5 over a period keeps 75%."""

    def make(scale: float, envelope: Envelope | None = None) -> Workload:
        spec = WorkloadSpec(
            duration_s=3000, load_scale=scale, tenants=20, envelope=envelope or Envelope()
        )
        return build_workload(code, spec, servers=1)

    flat, half = make(20.0), make(10.0)
    shaped = make(20.0, Envelope(period_s=3000, trough=0.5, peak_s=1500))
    assert len(half) == pytest.approx(0.5 * len(flat), rel=0.05)
    assert len(shaped) == pytest.approx(0.75 * len(flat), rel=0.05)
    # More arrivals near the peak than near the trough.
    middle = np.count_nonzero(np.abs(shaped.arrival_s - 1500) < 300)
    edge = np.count_nonzero(shaped.arrival_s < 600)
    assert middle > 1.3 * edge


def test_same_seed_same_requests_other_seed_other_requests(code: Trace) -> None:
    """Workloads are a pure function of their inputs and seed."""
    spec = WorkloadSpec(duration_s=600, load_scale=3.0, seed=7)
    a = build_workload(code, spec, servers=2, rows=2)
    b = build_workload(code, spec, servers=2, rows=2)
    c = build_workload(
        code, WorkloadSpec(duration_s=600, load_scale=3.0, seed=8), servers=2, rows=2
    )
    for field in ("arrival_s", "row", "cls", "ctx_tokens", "gen_tokens"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.arrival_s[:100], c.arrival_s[:100])
    assert set(np.unique(a.row)) == {0, 1}


@pytest.mark.parametrize("share", [0.0, 0.25, 1.0])
def test_high_priority_share(code: Trace, share: float) -> None:
    """Each request is high priority with probability hp_share."""
    w = build_workload(
        code, WorkloadSpec(duration_s=900, load_scale=2.0, hp_share=share), servers=2
    )
    assert np.count_nonzero(w.cls == HP) / len(w) == pytest.approx(share, abs=0.02)
    assert set(np.unique(w.cls)) <= {HP, LP}


def test_synthetic_chat_trace_is_decode_heavy_and_bursty() -> None:
    """Prompts ~1,000 tokens, answers ~130, and bursts above the mean rate."""
    trace = synthetic_chat_trace(duration_s=3600, seed=3)
    again = synthetic_chat_trace(duration_s=3600, seed=3)
    assert list(again.arrivals_s) == list(trace.arrivals_s)
    ctx = np.asarray(trace.context_tokens)
    gen = np.asarray(trace.generated_tokens)
    assert 800 < np.median(ctx) < 1250
    assert 100 < np.median(gen) < 170
    per_10s = np.bincount((np.asarray(trace.arrivals_s) // 10).astype(int))
    assert per_10s.max() > 2 * per_10s.mean()


def test_malformed_trace_row_names_file_and_line(tmp_path: Path) -> None:
    """A bad row in a CSV trace is reported as FILE:LINE: with what is wrong."""
    bad = tmp_path / "bad.csv"
    bad.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319600,lots,8\n",
        encoding="utf-8",
    )
    with pytest.raises(TraceError, match=rf"^{re.escape(str(bad))}:3: ContextTokens must be"):
        load_trace(bad)


def test_missing_trace_and_one_request_trace(tmp_path: Path) -> None:
    """A missing file names the built-in traces; a trace needs two requests to replay."""
    with pytest.raises(SimConfigError, match=r"no such trace file.*azure-code, synthetic-chat"):
        load_trace(tmp_path / "nope.csv")
    one = tmp_path / "one.csv"
    one.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,10,10\n")
    with pytest.raises(SimConfigError, match=r"one\.csv: a trace needs at least two requests"):
        build_workload(load_trace(one), WorkloadSpec(duration_s=60, load_scale=1.0), servers=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"duration_s": 0.0}, "duration must be a positive"),
        ({"load_scale": 0.0}, "load_scale must be positive"),
        ({"tenants": 0}, "tenants must be at least 1"),
        ({"hp_share": 1.5}, "high-priority share"),
    ],
)
def test_bad_workload_inputs(kwargs: dict[str, float], message: str) -> None:
    """Workload inputs are checked with messages naming them."""
    values: dict[str, float] = {"duration_s": 60.0, "load_scale": 1.0}
    values.update(kwargs)
    with pytest.raises(SimConfigError, match=message):
        WorkloadSpec(**values)  # type: ignore[arg-type]
    with pytest.raises(SimConfigError, match="trough"):
        Envelope(trough=0.0)
