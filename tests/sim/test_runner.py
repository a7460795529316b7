"""The time-stepped simulation: request timing, caps, the production engine, brakes, delays."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import polca.policy
from polca.policy import Policy, parse_policy
from polca.sim.model import SimConfigError
from polca.sim.runner import assign_classes, run
from polca.sim.scenario import run_once
from polca.sim.workload import HP, LP, load_trace
from tests.sim.conftest import ALWAYS_CAPPED_YAML, config, row, tiny_scenario, workload

LP_ONLY = np.array([LP, LP])


def test_one_request_alone_is_timed_exactly() -> None:
    """Prefill ctx/5000 s from its arrival (mid-step), then 20 ms per token; no quantisation."""
    w = workload([(0.25, 5000, 10), (0.31, 2500, 0)], duration_s=5.0)
    result = run(config(row()), w, policy=None, gpu_cls=LP_ONLY)
    order = np.argsort(result.req_arrival_s)
    assert result.req_latency_s[order] == pytest.approx([1.2, 0.5], abs=1e-9)
    assert result.req_ttft_s[order] == pytest.approx([1.0, 0.5], abs=1e-9)
    assert result.dropped == (0, 0)
    assert result.unfinished == (0, 0)
    # Idle: 1000 W of server plus 2 x 80 W resident; a long prompt draws 1.1 x 400 W.
    assert result.row_power_w[0, 0] == pytest.approx(1160.0)
    assert result.row_power_w[2, 0] == pytest.approx(1160.0 + 360.0 * 0.5)  # from 0.25 s


def test_clock_cap_slows_prefill_linearly_and_decode_weakly(always_capped: Policy) -> None:
    """At half the clock a prompt takes twice as long, a token 2 ** 0.2 times as long."""
    w = workload([(1.0, 5000, 10)], duration_s=5.0)
    result = run(config(row(budget_w=10_000.0)), w, policy=always_capped, gpu_cls=LP_ONLY)
    assert result.level[0, 0] == 1
    assert result.req_ttft_s[0] == pytest.approx(2.0, abs=1e-9)
    assert result.req_latency_s[0] == pytest.approx(2.0 + 10 * 0.020 * 2**0.2, abs=1e-9)
    assert result.work_s[LP] / result.busy_s[LP] < 0.6  # the capacity lost to the cap


def test_simulator_calls_the_production_engine(
    monkeypatch: pytest.MonkeyPatch, a100_policy: Policy
) -> None:
    """decide and next_level are the functions polca.policy exports, called for real."""
    calls = {"decide": 0, "next_level": 0}

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(polca.policy, "decide", counting("decide", polca.policy.decide))
    monkeypatch.setattr(polca.policy, "next_level", counting("next_level", polca.policy.next_level))
    # 8 servers provisioned for 4: the row must be capped.
    s = tiny_scenario(
        oversubscription=1.0, control=replace(tiny_scenario().control, actuation_delay_s=0.0)
    )
    result = run_once(s, load_trace("azure-code"), a100_policy)
    assert calls["next_level"] == result.ladder_calls > 100
    assert calls["decide"] == result.decide_calls >= 1
    assert result.level.max() >= 1


def test_a_different_policy_file_changes_the_caps(always_capped: Policy) -> None:
    """The same run under a policy capping at 1275 MHz instead of 705 MHz is faster."""
    milder = parse_policy(ALWAYS_CAPPED_YAML.replace("705", "1275"), source="milder.yaml").policy
    w = workload([(1.0, 5000, 10)], duration_s=5.0)
    cfg = config(row(budget_w=10_000.0))
    slow = run(cfg, w, policy=always_capped, gpu_cls=LP_ONLY)
    fast = run(cfg, w, policy=milder, gpu_cls=LP_ONLY)
    assert fast.req_ttft_s[0] == pytest.approx(1410 / 1275, abs=1e-9)
    assert slow.req_ttft_s[0] > fast.req_ttft_s[0]


def test_runs_are_deterministic_for_a_seed(a100_policy: Policy) -> None:
    """Same inputs and seed: identical results; another seed: other requests."""
    trace = load_trace("azure-code")
    s = tiny_scenario(oversubscription=0.5, seed=3)
    a, b = run_once(s, trace, a100_policy), run_once(s, trace, a100_policy)
    for field in ("row_power_w", "level", "req_latency_s", "req_ttft_s", "req_cls", "measured_w"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert a.brakes == b.brakes
    c = run_once(replace(s, seed=4), trace, a100_policy)
    assert not np.array_equal(a.row_power_w, c.row_power_w)


def test_brake_fires_after_the_tolerance_and_holds(a100_policy: Policy) -> None:
    """Over budget for 5 s with caps 40 s away: the brake fires and pins the clocks."""
    w = workload([(0.05 * i, 4000, 30) for i in range(400)], duration_s=30.0)
    cfg = config(
        row(budget_w=1500.0), telemetry_period_s=2.0, telemetry_delay_s=2.0, actuation_delay_s=40.0
    )
    result = run(cfg, w, policy=a100_policy, gpu_cls=LP_ONLY)
    assert result.brakes
    first = result.brakes[0]
    assert first.fired_s - first.over_since_s == pytest.approx(5.0, abs=0.11)
    assert first.peak_pct > 100.0
    step = round(first.fired_s / 0.1)
    held = result.row_power_w[step + 5 : step + 95, 0]
    assert held.max() < result.row_power_w[step - 5 : step, 0].min()  # the brake clock bites
    uncapped = run(cfg, w, policy=None, gpu_cls=LP_ONLY)
    assert uncapped.brakes == ()  # the reference run ignores the budget


def test_telemetry_and_actuation_delays(always_capped: Policy) -> None:
    """The controller first sees power 2 s old at 4 s; caps act 5 s after the decision."""
    w = workload([(0.02 * i, 6000, 5) for i in range(600)], duration_s=12.0)
    cfg = config(
        row(budget_w=10_000.0), telemetry_period_s=2.0, telemetry_delay_s=2.0, actuation_delay_s=5.0
    )
    result = run(cfg, w, policy=always_capped, gpu_cls=LP_ONLY)
    assert result.tick_s[0] == pytest.approx(4.0)
    assert result.level[0, 0] == 1
    p = result.row_power_w[:, 0]
    assert p[85:90].min() > 1700.0  # both GPUs in long prefills, uncapped
    assert p[91:100].max() < 1500.0  # capped at 705 MHz from 9.0 s on
    assert result.decide_calls == 1


def test_long_queues_drop_requests_per_class() -> None:
    """Prompts that would wait over max_wait_s are dropped and counted by class."""
    w = workload([(0.0, 5000, 1)] * 20, duration_s=30.0)
    cfg = replace(config(row(gpus=1)), max_wait_s=3.5)
    result = run(cfg, w, policy=None, gpu_cls=np.array([LP]))
    assert result.dropped == (0, 16)  # 1 + 3 queued behind it fit in 3.5 s of waiting
    assert len(result.req_latency_s) == 4


def test_class_assignment_by_server_and_by_gpu() -> None:
    """Whole servers spread evenly, or the first GPUs of every server."""
    by_server = assign_classes(servers=10, gpus_per_server=2, hp_share=0.3, assignment="server")
    servers = by_server.reshape(10, 2)[:, 0]
    assert np.count_nonzero(servers == HP) == 3
    assert np.all(by_server.reshape(10, 2)[:, 0] == by_server.reshape(10, 2)[:, 1])
    assert np.flatnonzero(servers == HP).tolist() == [3, 6, 9]
    by_gpu = assign_classes(servers=2, gpus_per_server=8, hp_share=0.25, assignment="gpu")
    assert by_gpu.tolist() == [HP, HP] + [LP] * 6 + [HP, HP] + [LP] * 6
    with pytest.raises(SimConfigError, match="assignment must be"):
        assign_classes(servers=2, gpus_per_server=8, hp_share=0.25, assignment="rack")


def test_requests_of_a_class_without_gpus_are_an_error() -> None:
    """High-priority requests on a row without high-priority GPUs cannot be served."""
    w = workload([(0.0, 100, 1)], duration_s=1.0, cls=HP)
    with pytest.raises(SimConfigError, match="high-priority requests but no high-priority GPU"):
        run(config(row()), w, policy=None, gpu_cls=LP_ONLY)


def test_several_rows_each_have_a_controller(a100_policy: Policy) -> None:
    """Two rows: power and levels per row, each against its own budget."""
    trace = load_trace("azure-code")
    result = run_once(tiny_scenario(rows=2, oversubscription=0.5), trace, a100_policy)
    assert result.row_power_w.shape[1] == 2
    assert result.level.shape[1] == 2
    assert result.ladder_calls == 2 * len(result.tick_s)
    assert not np.array_equal(result.row_power_w[:, 0], result.row_power_w[:, 1])
