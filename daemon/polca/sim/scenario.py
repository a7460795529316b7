"""One simulation scenario from plain inputs: build the row and load, run capped and uncapped.

The command line and the planner describe a run by a ``Scenario`` (what an operator
types: base servers, oversubscription, GPU model, budget, class mix, timing, load, seed)
and a policy. ``simulate`` turns it into the model's objects, runs the capped row and its
uncapped reference on the same requests, and returns both with the metrics and a summary
of the inputs. ``calibrate_load_scale`` finds the load at which the base row (no
oversubscription) peaks at a given share of its budget, so that a trace of any shape
can be compared on POLCA's footing (an inference row peaks near 79%).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from polca.policy import Policy
from polca.sim import report
from polca.sim.model import (
    BudgetCut,
    ControlConfig,
    RowConfig,
    ServerPreset,
    SimConfig,
    SimConfigError,
    SimGpu,
    profile_gpu_and_server,
    server_preset,
    sim_gpu,
)
from polca.sim.profile import resolve_profile
from polca.sim.runner import RunResult, assign_classes, run
from polca.sim.workload import Envelope, Workload, WorkloadSpec, build_workload
from polca.workload.trace import Trace

CALIBRATION_TOLERANCE_PCT = 0.5


@dataclass(frozen=True, slots=True)
class Scenario:
    """A row, its load and its control loop; ``None`` fields take the GPU model's preset."""

    gpu: str = "A100-SXM4"
    profile: str | None = None  # a shipped profile's name or a profile file; overrides gpu
    base_servers: int = 40  # what the budget was provisioned for
    gpus_per_server: int = 8
    oversubscription: float = 0.0  # deployed = base x (1 + this)
    budget_w: float | None = None  # None: base servers x server_provisioned_w
    server_provisioned_w: float | None = None
    server_other_w: float | None = None
    server_overhead_frac: float | None = None
    rows: int = 1
    hp_share: float = 0.5
    assignment: str = "server"
    control: ControlConfig = field(default_factory=ControlConfig)
    load_scale: float | None = None  # trace copies per server at the envelope's peak
    tenants: int = 16
    jitter_s: float = 60.0
    offset_s: float = 0.0
    duration_s: float = 3600.0
    envelope: Envelope = field(default_factory=Envelope)
    step_s: float = 0.1
    max_wait_s: float = 30.0
    warmup_s: float = 60.0
    seed: int = 0
    max_in_flight_per_gpu: int = 1024  # past it the run has collapsed (SimCollapsedError)
    time_limit_s: float | None = None  # wall time per run, then collapsed
    max_decode_batch: int = 256  # requests one GPU decodes at once (vLLM's max_num_seqs)
    budget_cut: BudgetCut | None = None  # a feed's loss replayed (polca.sim.failover)
    record_work: bool = False  # keep each class's work per step (RunResult.work_log)

    @property
    def servers(self) -> int:
        """Servers deployed in each row."""
        return max(1, round(self.base_servers * (1.0 + self.oversubscription)))

    def with_oversubscription(self, ratio: float) -> Scenario:
        """The same scenario with another oversubscription ratio."""
        return replace(self, oversubscription=ratio)


def gpu_and_server(s: Scenario) -> tuple[SimGpu, ServerPreset]:
    """The GPU model and server defaults of ``s``: its profile's, or the GPU model's preset."""
    if s.profile is not None:
        return profile_gpu_and_server(resolve_profile(s.profile))
    return sim_gpu(s.gpu), server_preset(s.gpu)


def row_config(s: Scenario) -> RowConfig:
    """The deployed row of ``s`` (checks that it can exist at all)."""
    if s.base_servers < 1:
        msg = f"base_servers must be at least 1, got {s.base_servers}"
        raise SimConfigError(msg)
    if not (math.isfinite(s.oversubscription) and s.oversubscription > -1.0):
        msg = (
            "oversubscription must be a ratio above -1 (e.g. 0.3 for +30%), "
            f"got {s.oversubscription}"
        )
        raise SimConfigError(msg)
    gpu, preset = gpu_and_server(s)
    provisioned_w = s.server_provisioned_w or preset.provisioned_w
    budget_w = s.budget_w if s.budget_w is not None else s.base_servers * provisioned_w
    return RowConfig(
        servers=s.servers,
        gpus_per_server=s.gpus_per_server,
        gpu=gpu,
        budget_w=budget_w,
        server_other_w=preset.other_w if s.server_other_w is None else s.server_other_w,
        server_overhead_frac=(
            preset.overhead_frac if s.server_overhead_frac is None else s.server_overhead_frac
        ),
    )


def load_scale(s: Scenario) -> float:
    """The scenario's load scale, or the GPU model's calibrated default."""
    return s.load_scale if s.load_scale is not None else gpu_and_server(s)[1].load_scale


def workload(s: Scenario, trace: Trace) -> Workload:
    """The requests of every row of ``s``."""
    spec = WorkloadSpec(
        duration_s=s.duration_s,
        load_scale=load_scale(s),
        tenants=s.tenants,
        jitter_s=s.jitter_s,
        offset_s=s.offset_s,
        envelope=s.envelope,
        hp_share=s.hp_share,
        seed=s.seed,
    )
    return build_workload(trace, spec, servers=s.servers, rows=s.rows)


def run_once(s: Scenario, trace: Trace, policy: Policy | None) -> RunResult:
    """One run of ``s``; ``policy=None`` is the uncapped reference."""
    row = row_config(s)
    config = SimConfig(
        row=row,
        control=s.control,
        rows=s.rows,
        step_s=s.step_s,
        max_wait_s=s.max_wait_s,
        warmup_s=s.warmup_s,
        max_in_flight_per_gpu=s.max_in_flight_per_gpu,
        time_limit_s=s.time_limit_s,
        max_decode_batch=s.max_decode_batch,
        budget_cut=s.budget_cut,
        record_work=s.record_work,
    )
    if not 0.0 <= s.warmup_s < s.duration_s:
        msg = f"warmup_s ({s.warmup_s} s) must be within [0, duration_s ({s.duration_s} s))"
        raise SimConfigError(msg)
    classes = assign_classes(
        servers=row.servers,
        gpus_per_server=row.gpus_per_server,
        hp_share=s.hp_share,
        assignment=s.assignment,
    )
    return run(config, workload(s, trace), policy=policy, gpu_cls=classes, seed=s.seed)


def summarize(
    s: Scenario, trace: Trace, capped: RunResult, base: RunResult, *, policy_file: str | None
) -> dict[str, Any]:
    """The JSON summary of one simulation: inputs, then ``report.compare``'s metrics."""
    row = capped.config.row
    return {
        "row": {
            "gpu": row.gpu.name,
            "profile": s.profile or row.gpu.name.lower(),
            "base_servers": s.base_servers,
            "servers": row.servers,
            "gpus_per_server": row.gpus_per_server,
            "rows": s.rows,
            "oversubscription_pct": 100.0 * (row.servers / s.base_servers - 1.0),
            "budget_w": row.budget_w,
            "server_other_w": row.server_other_w,
            "server_overhead_frac": row.server_overhead_frac,
            "hp_share": s.hp_share,
            "assignment": s.assignment,
        },
        "control": asdict(s.control),
        "workload": {
            "trace": trace.source,
            "requests": len(capped.req_latency_s),
            "duration_s": s.duration_s,
            "load_scale": load_scale(s),
            "tenants": s.tenants,
            "jitter_s": s.jitter_s,
            "offset_s": s.offset_s,
            "envelope": asdict(s.envelope),
            "seed": s.seed,
        },
        "step_s": s.step_s,
        "warmup_s": s.warmup_s,
        "policy_file": policy_file,
        "metrics": report.compare(capped, base, warmup_s=s.warmup_s),
    }


def simulate(
    s: Scenario,
    trace: Trace,
    policy: Policy,
    *,
    policy_file: str | None = None,
    base: RunResult | None = None,
) -> tuple[RunResult, RunResult, dict[str, Any]]:
    """Run ``s`` capped by ``policy`` and uncapped (unless ``base`` is given)."""
    capped = run_once(s, trace, policy)
    if base is None:
        base = run_once(s, trace, None)
    return capped, base, summarize(s, trace, capped, base, policy_file=policy_file)


def base_peak_pct(s: Scenario, trace: Trace) -> float:
    """Peak row power (2 s average, % of budget) of ``s`` uncapped without oversubscription."""
    result = run_once(s.with_oversubscription(0.0), trace, None)
    return report.power_stats(result, warmup_s=s.warmup_s)["peak_2s_pct"]


def calibrate_load_scale(s: Scenario, trace: Trace, *, target_pct: float, rounds: int = 6) -> float:
    """The load scale at which the base row peaks at ``target_pct`` of its budget.

    Secant steps on peak power against load (nearly linear above idle), starting from the
    scenario's load scale; stops within ``CALIBRATION_TOLERANCE_PCT`` points.
    """
    row = row_config(s.with_oversubscription(0.0))
    idle_pct = 100.0 * row.idle_power_w / row.budget_w
    if not idle_pct < target_pct < 150.0:
        msg = f"a target peak of {target_pct}% is not reachable (the row idles at {idle_pct:.1f}%)"
        raise SimConfigError(msg)
    x0 = load_scale(s)
    y0 = base_peak_pct(replace(s, load_scale=x0), trace)
    # First step: assume power above idle is proportional to load.
    x1 = x0 * (target_pct - idle_pct) / max(y0 - idle_pct, 1e-6)
    for _ in range(rounds):
        if abs(y0 - target_pct) <= CALIBRATION_TOLERANCE_PCT:
            return x0
        y1 = base_peak_pct(replace(s, load_scale=x1), trace)
        if abs(y1 - target_pct) <= CALIBRATION_TOLERANCE_PCT or y1 == y0:
            return x1
        x0, y0, x1 = x1, y1, max(1e-3, x1 + (target_pct - y1) * (x1 - x0) / (y1 - y0))
    return x1


__all__ = [
    "Scenario",
    "base_peak_pct",
    "calibrate_load_scale",
    "load_scale",
    "row_config",
    "run_once",
    "simulate",
    "summarize",
    "workload",
]
