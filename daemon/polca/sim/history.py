"""Plans from a row's own power history: POLCA's question answered the way POLCA did.

POLCA sized its rows from weeks of production row-power history, not from a model of the
requests. ``polca plan --history`` does the same: it reads the recorded power of a row of
``--servers`` servers (a CSV, or polca's own ``row`` measurement in InfluxDB 1.x), replays
that shape with more servers (each added server draws like the average recorded one),
runs the policy's ladder on it with the telemetry, actuation and brake timing of the
request simulator, and applies each level's caps through the profile's clock -> power
and clock -> latency relations. The answer is the same kind of plan as from a trace (the
same SLOs, the largest passing prefix, the same table and plots).

The model of one interval of the history, per GPU of a class (constants from the profile,
``polca.sim.profile``):

- recorded GPU power: what the row drew less each server's steady non-GPU power, less the
  server overhead, shared among its GPUs (or the per-class columns, when recorded), never
  below the resident idle power;
- a cap: the clock the policy allows (the brake clock while the brake holds), lowered
  further where a power limit binds; the GPU's dynamic power (above resident) scales by
  the profile's ``dynamic_scale`` at that clock with a memory share mixing prefill's and
  decode's by ``decode_share`` (the share of busy time spent decoding);
- the slowdown of the work running then: ``(1 - d) f^-e_prefill + d f^-e_decode``.

Metrics, after the warm-up: the latency impact at P50 and P99 per class is that
percentile of the slowdown over the work done (each interval weighted by the class's
dynamic power, a proxy for requests served then); the throughput loss is the work-weighted
mean of ``1 - 1/slowdown`` (conservative: it assumes the GPUs are saturated while capped);
brake events, peak and uncapped peak, time capped and capping episodes as in the request
simulator. What a power history cannot tell (queueing, which requests were long) is out of
this model; the request simulator keeps it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

import polca.policy as policy_api
from polca.errors import SimConfigError
from polca.physics import power
from polca.policy import LadderState, Policy
from polca.policy.trend import trend_w_per_s
from polca.sim.model import (
    ControlConfig,
    FloatArray,
    RowConfig,
    ServerPreset,
    SimConfig,
    SimGpu,
)
from polca.sim.plan import Slo, Variant, point_violations, variant_result
from polca.sim.power_history import PowerHistory
from polca.sim.runner import EngineCaps, assign_classes
from polca.sim.workload import HP, LP


def level_summary(levels: npt.ArrayLike, policy: Policy | None) -> dict[str, Any]:
    """Time at each level (% of the steps, by level name) and capping episodes (entries
    from nominal into any level) of one row's level per step."""
    series = np.asarray(levels, dtype=np.int64)
    top = policy.top_level if policy is not None else 0
    counts = np.bincount(np.minimum(series, top), minlength=top + 1)
    return {
        "time_at_level_pct": {
            (policy.level_name(i) if policy is not None else "nominal"): (
                100.0 * float(c) / len(series)
            )
            for i, c in enumerate(counts)
        },
        "capping_events": int(np.count_nonzero((series[1:] > 0) & (series[:-1] == 0))),
    }


def _weighted_quantile(values: FloatArray, weights: FloatArray, q: float) -> float:
    """The ``q`` quantile of ``values`` weighted by ``weights`` (0 without weight)."""
    total = float(weights.sum())
    if total <= 0:
        return 0.0
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    at = int(np.searchsorted(cum, q * total, side="left"))
    return float(values[order][min(at, len(order) - 1)])


@dataclass(frozen=True, slots=True)
class _Class:
    """One priority class's share of the row and its caps per level."""

    gpus: int
    gpu_w: FloatArray  # recorded per-GPU power over the history
    clock: tuple[float, ...]  # clock cap fraction per level
    limit_w: tuple[float, ...]  # power limit per level


def replay(  # noqa: PLR0915 - the replay loop keeps its state in locals, as the runner's
    history: PowerHistory,
    *,
    gpu: SimGpu,
    server: ServerPreset,
    base_servers: int,
    servers: int,
    gpus_per_server: int,
    budget_w: float,
    policy: Policy | None,
    control: ControlConfig,
    hp_share: float = 0.5,
    assignment: str = "server",
    decode_share: float = 0.5,
    warmup_s: float = 60.0,
    series: bool = False,
) -> dict[str, Any]:
    """One deployment replayed over the history: the numbers ``plan_point`` has (and with
    ``series``, the row's power and applied level per step, under ``"series"``)."""
    if not 0.0 <= decode_share <= 1.0:
        msg = f"decode_share must be within 0..1, got {decode_share}"
        raise SimConfigError(msg)
    if base_servers < 1 or servers < 1:
        msg = f"servers must be at least 1, got base {base_servers}, deployed {servers}"
        raise SimConfigError(msg)
    dt = history.step_s
    n_steps = len(history.power_w)
    row = RowConfig(
        servers=servers,
        gpus_per_server=gpus_per_server,
        gpu=gpu,
        budget_w=budget_w,
        server_other_w=server.other_w,
        server_overhead_frac=server.overhead_frac,
    )
    config = SimConfig(row=row, control=control, step_s=min(1.0, dt))
    cls = assign_classes(
        servers=servers, gpus_per_server=gpus_per_server, hp_share=hp_share, assignment=assignment
    )
    resident = gpu.resident_power_w
    scale = 1.0 + server.overhead_frac
    base_gpus = {
        c: max(1, round(base_servers * gpus_per_server * (hp_share if c == HP else 1 - hp_share)))
        for c in (HP, LP)
    }
    if history.hp_power_w is not None and history.lp_power_w is not None:
        per_gpu = {HP: history.hp_power_w / base_gpus[HP], LP: history.lp_power_w / base_gpus[LP]}
    else:
        gpu_w = (history.power_w / base_servers - server.other_w) / (scale * gpus_per_server)
        per_gpu = {HP: gpu_w, LP: gpu_w}
    levels = 1 + (policy.top_level if policy is not None else 0)
    engine = EngineCaps(policy, config, cls) if policy is not None else None
    classes: dict[int, _Class] = {}
    for key in (HP, LP):
        first = int(np.flatnonzero(cls == key)[0]) if np.any(cls == key) else None
        clocks, limits = [], []
        for level in range(levels):
            if engine is None or first is None:
                clocks.append(1.0)
                limits.append(gpu.tdp_w)
                continue
            clock, limit = engine.caps(level)
            clocks.append(float(clock[first]))
            limits.append(float(limit[first]))
        classes[key] = _Class(
            gpus=int(np.count_nonzero(cls == key)),
            gpu_w=np.maximum(per_gpu[key], resident),
            clock=tuple(clocks),
            limit_w=tuple(limits),
        )
    m_mix = decode_share * gpu.decode_mem_share + (1 - decode_share) * gpu.prefill_mem_share
    alpha, e_p, e_d = (
        gpu.clock_power_exponent,
        gpu.prefill_clock_exponent,
        gpu.decode_clock_exponent,
    )
    brake_frac = gpu.brake_sm_clock_mhz / gpu.sm_clock_max_mhz
    min_frac = gpu.min_clock_frac
    other_w = servers * server.other_w

    def at(c: _Class, k: int, level: int, braking: bool) -> tuple[float, float]:
        """(per-GPU power, slowdown) of class ``c`` at step ``k`` under ``level``."""
        g = float(c.gpu_w[k])
        f = c.clock[level]
        if braking:
            f = min(f, brake_frac)
        dyn = g - resident
        limit = c.limit_w[level]
        if dyn > 0 and limit < resident + dyn * power.dynamic_scale(
            f, mem_share=m_mix, clock_power_exponent=alpha
        ):
            sm = power.sm_scale_for_limit(resident, dyn, limit_w=limit, mem_share=m_mix)
            f = min(
                f, power.clock_frac_for_sm_scale(min(1.0, max(0.0, sm)), clock_power_exponent=alpha)
            )
        f = max(f, min_frac)
        p = resident + dyn * power.dynamic_scale(f, mem_share=m_mix, clock_power_exponent=alpha)
        slow = power.work_slowdown(
            f, decode_share=decode_share, prefill_clock_exponent=e_p, decode_clock_exponent=e_d
        )
        return p, slow

    period = max(1, round(control.telemetry_period_s / dt))
    delay = max(0, round(control.telemetry_delay_s / dt))
    row_w = np.empty(n_steps)
    uncapped_w: FloatArray = other_w + scale * (
        classes[HP].gpus * classes[HP].gpu_w + classes[LP].gpus * classes[LP].gpu_w
    )
    slow = {HP: np.ones(n_steps), LP: np.ones(n_steps)}
    level_of = np.zeros(n_steps, dtype=np.int64)
    ladder = LadderState()
    applied, pending = 0, []  # pending: (apply at s, level)
    hist: list[tuple[float, float]] = []
    brakes = 0
    over_since: float | None = None
    brake_until = -1.0
    for k in range(n_steps):
        t = k * dt
        if policy is not None and k % period == 0 and k - delay >= period:
            seen = float(row_w[k - delay - period : k - delay].mean())
            if t >= warmup_s:
                hist.append((t, seen))
            while hist and t - hist[0][0] > control.trend_window_s:
                hist.pop(0)
            before = ladder.level
            ladder = policy_api.next_level(
                power_w=seen,
                budget_w=budget_w,
                policy=policy,
                state=ladder,
                now_s=t,
                trend_w_per_s=trend_w_per_s(hist, t, window_s=control.trend_window_s),
            )
            if ladder.level != before:
                pending.append((t + control.actuation_delay_s, ladder.level))
        while pending and pending[0][0] <= t + 1e-9:
            applied = pending.pop(0)[1]
        braking = t < brake_until
        total = other_w
        for c_id, klass in classes.items():
            p_w, slowdown = at(klass, k, applied, braking)
            total += scale * klass.gpus * p_w
            slow[c_id][k] = slowdown
        row_w[k] = total
        level_of[k] = applied
        if policy is not None:
            if total <= budget_w:
                over_since = None
            elif over_since is None:
                over_since = t
            elif not braking and t + dt - over_since >= control.brake_tolerance_s - 1e-9:
                brakes += 1
                brake_until = t + dt + control.brake_hold_s
                over_since = None
    keep = np.arange(n_steps) * dt >= warmup_s
    if not keep.any():
        msg = f"the history ({history.duration_s:.0f} s) is shorter than the warm-up"
        raise SimConfigError(msg)
    out: dict[str, Any] = {
        "oversubscription_pct": 100.0 * (servers / base_servers - 1.0),
        "servers": servers,
    }
    for c_id, name in ((HP, "hp"), (LP, "lp")):
        klass = classes[c_id]
        work = (klass.gpu_w - resident)[keep] * klass.gpus
        slowed = slow[c_id][keep]
        out[f"{name}_p50_impact_pct"] = 100.0 * (_weighted_quantile(slowed, work, 0.50) - 1.0)
        out[f"{name}_p99_impact_pct"] = 100.0 * (_weighted_quantile(slowed, work, 0.99) - 1.0)
        total_work = float(work.sum())
        lost = float((work * (1.0 - 1.0 / slowed)).sum())
        loss = lost / total_work if total_work > 0 else 0.0
        out[f"{name}_throughput_loss_pct"] = 100.0 * loss
    levels_kept = level_of[keep]
    summary = level_summary(levels_kept, policy)
    out["time_at_level_pct"] = summary["time_at_level_pct"]
    out.update(
        brake_events=float(brakes),
        peak_pct=100.0 * float(row_w[keep].max()) / budget_w,
        uncapped_peak_pct=100.0 * float(uncapped_w[keep].max()) / budget_w,
        capped_time_pct=100.0 * float(np.mean(levels_kept > 0)),
        capping_events=summary["capping_events"],
    )
    if series:
        out["series"] = {
            "t_s": (np.arange(n_steps) * dt).tolist(),
            "row_w": row_w.tolist(),
            "uncapped_w": uncapped_w.tolist(),
            "level": level_of.tolist(),
        }
    return out


def plan_history(
    history: PowerHistory,
    variants: list[Variant],
    *,
    ratios: list[float],
    slo: Slo,
    gpu: SimGpu,
    server: ServerPreset,
    base_servers: int,
    gpus_per_server: int,
    budget_w: float,
    hp_share: float = 0.5,
    assignment: str = "server",
    decode_share: float = 0.5,
    warmup_s: float = 60.0,
) -> dict[str, Any]:
    """``run_plan``'s answer from a power history instead of a request trace."""
    if not variants or not ratios:
        msg = "a plan needs at least one policy and one ratio"
        raise SimConfigError(msg)
    grid = sorted(set(ratios))
    result_variants = []
    for v in variants:
        points = []
        for ratio in grid:
            servers = max(1, round(base_servers * (1.0 + ratio)))
            values = replay(
                history,
                gpu=gpu,
                server=server,
                base_servers=base_servers,
                servers=servers,
                gpus_per_server=gpus_per_server,
                budget_w=budget_w,
                policy=v.policy,
                control=v.control,
                hp_share=hp_share,
                assignment=assignment,
                decode_share=decode_share,
                warmup_s=warmup_s,
            )
            point = {"ratio": ratio, **values}
            point["violations"] = point_violations(point, slo)
            points.append(point)
        result_variants.append(variant_result(v, points, slo))
    return {
        "slo": asdict(slo),
        "base_servers": base_servers,
        "ratios": grid,
        "history": {
            "source": history.source,
            "step_s": history.step_s,
            "duration_s": history.duration_s,
            "decode_share": decode_share,
        },
        "seeds": [0],
        "scenarios": result_variants,
    }


__all__ = ["level_summary", "plan_history", "replay"]
