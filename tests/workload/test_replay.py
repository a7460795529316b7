"""Trace replay: the serving model, calibration, determinism, wrap-around, backend."""

from __future__ import annotations

import math
from statistics import fmean, pstdev

import pytest

from polca.gpu.simulated import SimulatedBackend
from polca.workload.replay import TraceLoad, TraceReplay, WorkDone, trace_loads
from polca.workload.serving import ServingModel, serving_model
from polca.workload.trace import Trace
from tests.workload.conftest import make_trace

# Round numbers for exact timelines: 1,000 prompt tokens take 1 s, an output token 0.1 s.
SLOW = ServingModel("slow", prefill_tokens_per_s=1000.0, decode_s_per_token=0.1)


def offered_util_s(trace: Trace, m: ServingModel) -> float:
    """GPU-seconds of utilization above resident that one pass over ``trace`` asks for,
    counting every request alone on its GPU (no batching)."""
    prefill_s = sum(c / m.prefill_tokens_per_s for c in trace.context_tokens)
    decode_s = sum(g * m.decode_s_per_token for g in trace.generated_tokens)
    decode_util = m.decode_util_base + m.decode_util_per_request
    return prefill_s * (m.prefill_util - m.resident_util) + decode_s * (
        decode_util - m.resident_util
    )


def test_one_gpu_timeline_follows_prefill_then_batched_decode() -> None:
    """Prefill at 100 %, decode at 0.45 + 0.08 per request, resident in between."""
    # Request A: arrives 0, prefill 0-1 s, decode 1-3 s. B: arrives 1.5, prefill 1.5-2 s,
    # decode 2-2.5 s. C arrives at 10 s (a lap ends 5 s after it: period 10 x 3/2 = 15 s).
    trace = make_trace((0.0, 1000, 20), (1.5, 500, 5), (10.0, 2000, 0))
    replay = TraceReplay(trace, gpus=1, serving=SLOW)
    expected = {
        0.5: 1.0,
        1.2: 0.53,
        1.7: 1.0,  # B's prefill beats A's decode
        2.2: 0.61,  # both decode
        2.7: 0.53,
        3.5: 0.07,
        11.0: 1.0,
        12.5: 0.07,  # C generates nothing
        15.5: 1.0,  # A again: the trace wrapped
    }
    for t_s, util in expected.items():
        assert replay.utilization(0, t_s) == pytest.approx(util), t_s
    assert replay.utilization(0, -1.0) == replay.profile(0).utilization(-1.0, 0) == 1.0
    assert replay.work_done(0, 2.4) == WorkDone(0, 0, 0)
    assert replay.work_done(0, 2.6) == WorkDone(1, 500, 5)
    assert replay.work_done(0, 14.0) == WorkDone(3, 3500, 25)


def test_prefills_queue_and_requests_spread_over_gpus() -> None:
    """Simultaneous requests go to different GPUs; past the GPU count, prefills queue."""
    trace = make_trace(*[(0.0, 1000, 10) for _ in range(3)], (30.0, 1, 1))
    two = TraceReplay(trace, gpus=2, serving=SLOW)
    assert [two.utilization(g, 0.5) for g in (0, 1)] == [1.0, 1.0]
    # One GPU got two requests: its second prefill runs 1-2 s, then both decode.
    busy = max((0, 1), key=lambda g: two.work_done(g, 10.0).requests)
    assert two.utilization(busy, 1.5) == 1.0
    assert two.utilization(busy, 2.5) == pytest.approx(0.53)  # the first finished at 2 s
    assert two.utilization(1 - busy, 1.5) == pytest.approx(0.53)
    assert sum(two.work_done(g, 10.0).requests for g in (0, 1)) == 3


def test_overload_drops_requests_that_wait_too_long() -> None:
    """A request whose prefill would wait over max_wait_s is dropped and counted."""
    trace = make_trace(*[(0.0, 10_000, 1) for _ in range(10)], (100.0, 1, 1))
    replay = TraceReplay(trace, gpus=1, serving=SLOW, max_wait_s=25.0)
    assert replay.utilization(0, 29.0) == 1.0  # prefills at 0, 10 and 20 s
    assert replay.utilization(0, 30.05) == pytest.approx(0.53)  # the last decode
    assert replay.dropped == 7
    assert replay.work_done(0, 99.0).requests == 3


@pytest.mark.parametrize(("scale", "low", "high"), [(3.0, 3.0, 3.0), (0.5, 0.45, 0.55)])
def test_scale_multiplies_or_thins_requests(scale: float, low: float, high: float) -> None:
    """Integer scales replay every request that many times; fractions keep about that share."""
    # 999 requests in 500 s, then a quiet spell until the last one at 1000 s.
    trace = make_trace(*[(i * 0.5, 100, 10) for i in range(999)], (1000.0, 100, 10))
    replay = TraceReplay(trace, gpus=8, scale=scale, jitter_s=5.0, serving=SLOW, seed=3)
    done = [replay.work_done(g, 600.0) for g in range(8)]
    requests = sum(w.requests for w in done)
    assert low * 999 <= requests <= high * 999
    assert sum(w.generated_tokens for w in done) == 10 * requests


def test_bundled_replay_matches_offered_work_and_is_bursty(bundled: Trace) -> None:
    """On 16 GPUs at 4x, the row mean matches arrivals x per-request work and bursts."""
    linear = ServingModel(
        "linear", 13_000.0, 0.012, decode_util_base=0.0, resident_util=0.0
    )  # utilization linear in the batch: only prefills overlapping decodes are lost
    for model, low in ((linear, 0.93), (serving_model("H100-SXM"), 0.80)):
        replay = TraceReplay(bundled, gpus=16, speedup=4.0, serving=model)
        samples = [replay.row_utilization(i * 0.05) for i in range(math.floor(replay.lap_s / 0.05))]
        expected = offered_util_s(bundled, model) / replay.lap_s + 16 * model.resident_util
        # Batched decodes share their base utilization, so the row may only use less.
        assert low <= fmean(samples) / expected <= 1.01, model.name
    bins = [fmean(samples[i : i + 200]) for i in range(0, len(samples) - 199, 200)]  # 10 s
    mean = fmean(bins)
    assert 0.15 < mean / 16 < 0.5  # moderate
    assert pstdev(bins) / mean > 0.4  # not flat
    assert max(bins) > 2.0 * mean  # bursts
    assert min(bins) < 1.1 * 16 * 0.07  # and quiet spells at the resident floor


def test_replay_is_deterministic_and_seeded(bundled: Trace) -> None:
    """Same seed, same values in any query order; another seed moves the copies."""
    times_s = [i * 0.37 for i in range(400)]

    def values(replay: TraceReplay) -> list[float]:
        return [replay.utilization(g, t) for t in times_s for g in (0, 5, 47)]

    first = TraceReplay(bundled, gpus=48, speedup=10.0, scale=2.5, seed=7)
    again = TraceReplay(bundled, gpus=48, speedup=10.0, scale=2.5, seed=7)
    again.utilization(3, 400.0)  # far ahead first: the early windows are computed again
    assert values(again) == values(first)
    other = TraceReplay(bundled, gpus=48, speedup=10.0, scale=2.5, seed=8)
    assert values(other) != values(first)
    # Not only the routing: the copies' jitter and thinning follow the seed too.
    row = [round(first.row_utilization(t), 9) for t in times_s[:100]]
    assert [round(other.row_utilization(t), 9) for t in times_s[:100]] != row


def test_replay_wraps_around_the_end_of_the_trace(bundled: Trace) -> None:
    """After the last request the trace starts again: the second lap looks like the first."""
    replay = TraceReplay(bundled, gpus=32, speedup=20.0, offset_s=100.0)
    lap_s = replay.lap_s
    assert lap_s == pytest.approx(bundled.duration_s * 8819 / 8818 / 20.0)

    def lap_bins(lap: int) -> list[float]:  # 3 s means
        return [
            fmean(replay.row_utilization(lap * lap_s + m * 3.0 + i * 0.1) for i in range(30))
            for m in range(math.floor(lap_s / 3.0))
        ]

    first, second = lap_bins(0), lap_bins(1)
    assert max(second) > 3 * min(second)  # still bursty after the wrap
    assert fmean(second) == pytest.approx(fmean(first), rel=0.05)
    assert sum(abs(a - b) for a, b in zip(first, second, strict=True)) < 0.05 * sum(first)
    served = [sum(replay.work_done(g, t).requests for g in range(32)) for t in (lap_s, 3 * lap_s)]
    assert served[1] - served[0] == pytest.approx(2 * 8819, rel=0.01)


def test_trace_loads_give_each_node_its_slice_of_the_row(bundled: Trace) -> None:
    """GPU j of node n is GPU n*8+j of the row replay; a node past the row is an error."""
    replay = TraceReplay(bundled, gpus=24, speedup=10.0, scale=3.0)
    loads = trace_loads(8, node_offset=1, replay=replay)
    assert len(loads) == 8
    assert all(isinstance(p, TraceLoad) for p in loads)
    for t_s in (0.0, 17.3, 61.0, 400.0):
        assert [p.utilization(t_s, 0) for p in loads] == [
            replay.utilization(8 + j, t_s) for j in range(8)
        ]
    assert "gpu=8/24" in repr(loads[0])
    with pytest.raises(ValueError, match="does not fit"):
        trace_loads(8, node_offset=3, replay=replay)
    with pytest.raises(ValueError, match="no GPU 24"):
        replay.profile(24)


def test_simulated_backend_reports_the_replayed_utilization(bundled: Trace) -> None:
    """A SimulatedBackend node on trace loads samples exactly the replay's utilization."""
    clock_s = [100.0]
    backend = SimulatedBackend(count=8, clock=lambda: clock_s[0])
    replay = TraceReplay(bundled, gpus=16, speedup=10.0, scale=4.0, offset_s=180.0)
    for j, profile in enumerate(trace_loads(8, node_offset=1, replay=replay)):
        backend.set_load(j, profile)
    seen: set[float] = set()
    for step in range(1, 301):
        clock_s[0] = 100.0 + step * 0.2
        for j in range(8):
            sample = backend.sample(j)
            util = replay.utilization(8 + j, step * 0.2)
            assert sample.gpu_util_pct == round(util * 100)
            seen.add(util)
    assert {0.07, 1.0} <= seen  # resident and prefill both happen within a minute


def test_many_profiles_answer_cheaply(bundled: Trace) -> None:
    """192 GPU profiles x 100 calls at 10 Hz all answer within 0..1 (no timing asserted)."""
    replay = TraceReplay(bundled, gpus=192, speedup=2.0, scale=16.0, offset_s=180.0)
    profiles = [replay.profile(i) for i in range(192)]
    values = [p.utilization(k * 0.1, 0) for k in range(100) for p in profiles]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert len(set(values)) >= 3


def test_invalid_parameters_are_rejected(bundled: Trace) -> None:
    """Bad replay parameters and serving models raise ValueError naming the problem."""
    for kwargs, fragment in (
        ({"gpus": 0}, "gpus"),
        ({"gpus": 1, "speedup": 0.0}, "speedup"),
        ({"gpus": 1, "scale": -1.0}, "scale"),
        ({"gpus": 1, "keep_windows": 1}, "keep_windows"),
        ({"gpus": 1, "serving": "V100"}, "no serving preset"),
    ):
        with pytest.raises(ValueError, match=fragment):
            TraceReplay(bundled, **kwargs)
    with pytest.raises(ValueError, match="positive"):
        ServingModel("x", prefill_tokens_per_s=0.0, decode_s_per_token=0.01)
    with pytest.raises(ValueError, match="decode_util_base"):
        ServingModel("x", 1.0, 0.01, decode_util_base=1.5)
    assert serving_model("a100-sxm4").decode_s_per_token == 0.020
