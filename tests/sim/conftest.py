"""Shared pieces of the simulator tests: tiny rows and hand-written workloads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polca.policy import Policy, load_policy, parse_policy
from polca.sim.model import ControlConfig, RowConfig, SimConfig, sim_gpu
from polca.sim.scenario import Scenario
from polca.sim.workload import LP, Workload

REPO = Path(__file__).resolve().parents[2]
A100_POLICY = REPO / "policies" / "polca-a100.yaml"

# A policy whose first level is reached at any load: every GPU capped after one tick.
ALWAYS_CAPPED_YAML = """
schema_version: 1
name: always-capped
classes: [high, low]
default_class: low
levels:
  - name: T1
    threshold_pct: 1
    caps:
      low: {sm_clock_max_mhz: 705}
      high: {sm_clock_max_mhz: 705}
release: {margin_pct: 0.5, dwell_s: 1000}
fail_safe:
  caps:
    low: {sm_clock_max_mhz: 705}
"""


def row(
    *, servers: int = 1, gpus: int = 2, budget_w: float = 1e6, other_w: float = 1000.0
) -> RowConfig:
    """A small A100 row without overhead, so that power is easy to predict."""
    return RowConfig(
        servers=servers,
        gpus_per_server=gpus,
        gpu=sim_gpu("A100-SXM4"),
        budget_w=budget_w,
        server_other_w=other_w,
    )


def config(r: RowConfig, **control: float) -> SimConfig:
    """A config with immediate, every-step control unless overridden."""
    values = {"telemetry_period_s": 0.1, "telemetry_delay_s": 0.0, "actuation_delay_s": 0.0}
    values.update(control)
    return SimConfig(row=r, control=ControlConfig(**values))


def workload(
    requests: Sequence[tuple[float, float, float]], *, duration_s: float, cls: int = LP
) -> Workload:
    """Requests ``(arrival_s, context tokens, generated tokens)``, all of one class."""
    arr = np.array([r[0] for r in requests], dtype=np.float64)
    order = np.argsort(arr, kind="stable")
    return Workload(
        source="test",
        duration_s=duration_s,
        arrival_s=arr[order],
        row=np.zeros(len(arr), dtype=np.intp),
        cls=np.full(len(arr), cls, dtype=np.intp),
        ctx_tokens=np.array([r[1] for r in requests], dtype=np.float64)[order],
        gen_tokens=np.array([r[2] for r in requests], dtype=np.float64)[order],
    )


def tiny_scenario(**changes: Any) -> Scenario:
    """Four 4-GPU A100 servers for five minutes: a whole pipeline in well under a second."""
    base = Scenario(base_servers=4, gpus_per_server=4, duration_s=300.0, warmup_s=30.0, tenants=4)
    return replace(base, **changes)


@pytest.fixture(scope="session")
def a100_policy() -> Policy:
    """policies/polca-a100.yaml, POLCA as published."""
    return load_policy(A100_POLICY).policy


@pytest.fixture(scope="session")
def always_capped() -> Policy:
    """Every GPU locked at 705 MHz (half of 1410) from the first controller tick on."""
    return parse_policy(ALWAYS_CAPPED_YAML, source="always-capped.yaml").policy
