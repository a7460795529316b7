"""The time-stepped simulation of a row under polca's production policy engine.

``run`` advances every GPU of the row (or rows) in steps of ``step_s``, vectorised with
numpy over GPUs and in-flight requests. Each step:

1. **control**: every ``telemetry_period_s`` the row controller reads the row power
   averaged over one period and ``telemetry_delay_s`` old, computes the least-squares
   trend over ``trend_window_s`` (``polca.policy.trend``, as the aggregator does), and calls
   ``polca.policy.next_level``, the aggregator's ladder; a level change is sent to every
   server of the row. Like the aggregator after its warm-up, the trend history starts
   only after ``warmup_s``: the row filling up from idle is not a trend;
2. **actuation**: each server applies a command ``actuation_delay_s`` after it was sent
   (less up to ``actuation_jitter`` of it, per server); the caps of a level come from
   ``polca.policy.decide``, the function every node agent calls;
3. **routing**: the step's arrivals go, per row and class, to the GPUs with the fewest
   outstanding requests (ties rotate); a request whose prefill would wait more than
   ``max_wait_s`` is dropped, as a client timeout would;
4. **prefill**: each GPU works through its FIFO of prompts at a speed set by its SM clock
   (a lock, the power limit, or the brake); prefill runs first in the step and stalls the
   GPU's decodes meanwhile (iteration-level scheduling without chunked prefill); an idle
   GPU starts a prompt when it arrives, not at the step's start;
5. **decode**: every request past its prefill advances by the step's remaining time over
   its per-token time (batch- and weakly clock-dependent); finish times are interpolated
   within the step, so latencies are not quantised to ``step_s``;
6. **power**: each GPU's energy in the step is its prefill power x prefill time (the
   power of the prompts it processed, by length) plus decode (or resident idle) power x
   the rest; row power adds the servers' non-GPU power;
7. **brake**: row power above the budget for ``brake_tolerance_s`` fires the hardware
   power brake, which holds every GPU of the row at the brake clock for ``brake_hold_s``
   (a brake event: POLCA's goal is zero of them).

A ``BudgetCut`` (a feed lost, ``polca plan --feed-failure``) changes the budget at a time:
the brake guards the cut budget from the cut on, the controller runs on it from
``known_after_s`` later, with one control step at that moment (the aggregator takes a
feed's loss at its next step), and both return to the row's budget when the cut ends.

Both engine functions are looked up on ``polca.policy`` at call time, never copied, so
the simulator runs exactly what the agent and aggregator run (a test patches them).
The engine's answer for a level depends only on the level, the GPU's class and its
hardware limits here (the simulator has no temperatures, so no thermal guard can latch),
so it is computed when a level is first entered and reused.

Without a policy the run is the uncapped reference: no controller and no brake.
Deterministic: the same inputs and seed give the same result.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

import polca.policy as policy_api
from polca.errors import SimCollapsedError
from polca.physics import power
from polca.policy import ControlInput, EngineState, GpuView, LadderState, Policy
from polca.policy.trend import trend_w_per_s
from polca.sim.model import FloatArray, IntArray, SimConfig, SimConfigError
from polca.sim.workload import HP, LP, Workload

# Rows of the two in-flight tables (2-D float arrays, so that appending and compacting
# are one numpy call): prompts waiting or in prefill, and requests decoding.
P_GPU, P_START, P_MARK, P_DYN, P_IDX = range(5)
D_GPU, D_REM, D_TPE, D_IDX = range(4)
_EPS = 1e-9
_LEASE_NS = 2**62  # the simulated controller never goes silent
_MAX_KEY_OUT = 63  # routing sorts on min(outstanding, 63): a 16-bit radix sort
MAX_ROWS = 256  # pools (2 per row) x 64 must fit the 16-bit routing key
_MAX_ROTATIONS = 512  # tie-break rotations precomputed (each a permutation of the GPUs)
_BATCH_TABLE = 4096  # decode batch sizes tabulated; larger batches use the last entry


@dataclass(frozen=True, slots=True)
class BrakeEvent:
    """One firing of the hardware power brake."""

    row: int
    over_since_s: float  # row power went above the budget here ...
    fired_s: float  # ... and stayed above it until the brake fired here
    peak_pct: float  # highest row power, % of budget, before the brake fired


@dataclass(frozen=True, slots=True, eq=False)
class RunResult:
    """What one run produced; ``polca.sim.report`` turns two of them into metrics."""

    config: SimConfig
    policy_name: str | None  # None: the uncapped reference
    level_names: tuple[str, ...]  # "nominal" then the policy's levels
    threshold_pcts: tuple[float, ...]  # the policy's level thresholds
    duration_s: float
    row_power_w: FloatArray  # (steps, rows): mean row power in each step
    tick_s: FloatArray  # controller evaluation times
    measured_w: FloatArray  # (ticks, rows): row power the controller saw
    tick_budget_w: FloatArray  # (ticks,): the budget the controller ran on at each tick
    level: npt.NDArray[np.int8]  # (ticks, rows): the level after each evaluation
    brakes: tuple[BrakeEvent, ...]
    req_cls: IntArray  # per finished request: HP or LP
    req_arrival_s: FloatArray
    req_latency_s: FloatArray  # arrival to last token
    req_ttft_s: FloatArray  # arrival to end of prefill (first token)
    req_tokens: FloatArray  # prompt + output tokens
    dropped: tuple[int, int]  # per class: prefill would have waited over max_wait_s
    unfinished: tuple[int, int]  # per class: still in flight at the end
    busy_s: tuple[float, float]  # per class: GPU-seconds spent serving
    work_s: tuple[float, float]  # per class: the same work at the maximum clock, seconds
    gpus: tuple[int, int]  # per class, all rows
    decide_calls: int  # how often polca.policy.decide ran (once per level entered)
    ladder_calls: int  # how often polca.policy.next_level ran
    drop_cls: IntArray  # per dropped request: HP or LP
    drop_arrival_s: FloatArray  # per dropped request: when it arrived
    unfinished_cls: IntArray  # per request still in flight at the end: HP or LP
    unfinished_arrival_s: FloatArray  # ... and when it arrived
    # With ``config.record_work``: (steps + 1, 2 classes, [busy, work]) GPU-seconds served
    # and the same work at the maximum clock, cumulative at the start of each step (and at
    # the end); otherwise empty.
    work_log: FloatArray

    @property
    def energy_j(self) -> float:
        """Energy of every row over the run."""
        return float(self.row_power_w.sum() * self.config.step_s)


def assign_classes(
    *, servers: int, gpus_per_server: int, hp_share: float, assignment: str
) -> IntArray:
    """Class (HP or LP) of every GPU of a row, server-major.

    ``server``: whole servers are high priority, spread evenly over the row (VMs with
    passed-through GPUs, as in POLCA); ``gpu``: the first GPUs of every server are.
    """
    if assignment == "server":
        hp_servers = round(hp_share * servers)
        s = np.arange(servers)
        crosses = np.floor((s + 1) * hp_servers / servers) - np.floor(s * hp_servers / servers)
        return np.repeat(np.where(crosses > 0, HP, LP), gpus_per_server).astype(np.intp)
    if assignment == "gpu":
        hp_gpus = round(hp_share * gpus_per_server)
        one = np.where(np.arange(gpus_per_server) < hp_gpus, HP, LP)
        return np.tile(one, servers).astype(np.intp)
    msg = f"assignment must be 'server' or 'gpu', got {assignment!r}"
    raise SimConfigError(msg)


class EngineCaps:
    """The production engine's caps per level for one row's GPUs, computed on first use."""

    def __init__(self, policy: Policy, config: SimConfig, gpu_cls: IntArray) -> None:
        gpu = config.row.gpu
        names = (policy.classes[0], policy.classes[-1])
        per = config.row.gpus_per_server
        self.views = [
            GpuView(
                index=u % per,
                uuid=f"SIM-s{u // per}-g{u % per}",
                priority_class=names[int(gpu_cls[u])],
                gpu_temp_c=None,
                mem_temp_c=None,
                sm_clock_max_mhz=gpu.sm_clock_max_mhz,
                sm_clock_min_mhz=gpu.sm_clock_min_mhz,
                power_limit_min_mw=round(gpu.power_limit_min_w * 1000),
                power_limit_max_mw=round(gpu.power_limit_max_w * 1000),
                power_limit_default_mw=round(gpu.tdp_w * 1000),
            )
            for u in range(len(gpu_cls))
        ]
        self.policy = policy
        self.gpu = gpu
        self.cache: dict[int, tuple[FloatArray, FloatArray]] = {}
        self.calls = 0

    def caps(self, level: int) -> tuple[FloatArray, FloatArray]:
        """(clock cap as a fraction of max, power limit in W) per GPU of a row at ``level``."""
        cached = self.cache.get(level)
        if cached is not None:
            return cached
        decision = policy_api.decide(
            self.views,
            policy=self.policy,
            control=ControlInput(level=level, lease_expires_ns=_LEASE_NS, source="sim"),
            state=EngineState(),
            now_ns=0,
        )
        self.calls += 1
        g = self.gpu
        clock = np.array(
            [
                1.0 if t.sm_clock_max_mhz is None else t.sm_clock_max_mhz / g.sm_clock_max_mhz
                for t in decision.targets
            ]
        )
        limit = np.array(
            [
                g.tdp_w if t.power_limit_mw is None else t.power_limit_mw / 1000
                for t in decision.targets
            ]
        )
        self.cache[level] = (np.minimum(clock, 1.0), limit)
        return self.cache[level]


@dataclass(slots=True)
class _Command:
    """A level sent to every server of a row, applied per server after its delay."""

    row: int
    level: int
    apply_s: FloatArray  # per server of the row
    applied: npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True, eq=False)
class _Routing:
    """Per-arrival routing slots, precomputed once for the whole run."""

    slot: IntArray  # index into the step's ranking of GPUs (pool start + rank mod size)
    multi: npt.NDArray[np.bool_]  # per step: some GPU gets two arrivals of one pool
    pool_key: npt.NDArray[np.int64]  # per GPU: pool x 64


def _routing(
    workload: Workload, pool_of_gpu: IntArray, n_pools: int, n_steps: int, step_s: float
) -> _Routing:
    """Rank every arrival among those of its (step, pool), and map the rank to a GPU slot.

    The k-th arrival of a step for a pool goes to the pool's k-th least-loaded GPU (mod
    the pool's size), which is least-outstanding routing with the step's arrivals batched.
    """
    pool_size = np.bincount(pool_of_gpu, minlength=n_pools)
    pool_start = np.cumsum(pool_size) - pool_size
    arr_pool = workload.row * 2 + workload.cls
    step = np.minimum((workload.arrival_s / step_s).astype(np.int64), n_steps - 1)
    group = step * n_pools + arr_pool
    order = np.argsort(group, kind="stable")
    sorted_group = group[order]
    first = np.r_[True, sorted_group[1:] != sorted_group[:-1]]
    first_pos = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order)) - first_pos
    size = np.maximum(pool_size[arr_pool], 1)
    slot = pool_start[arr_pool] + rank % size
    multi = np.zeros(n_steps, dtype=bool)
    multi[step[rank >= size]] = True
    return _Routing(
        slot=slot.astype(np.intp),
        multi=multi,
        pool_key=pool_of_gpu.astype(np.int64) * (_MAX_KEY_OUT + 1),
    )


_GUARD_STEPS = 50
"""Steps between the collapse checks (requests in flight, wall time)."""


def _guard(in_flight: int, cap: int, deadline: float | None, t_s: float, config: SimConfig) -> None:
    """Raise ``SimCollapsedError`` when the run has collapsed or is out of time."""
    if in_flight > cap:
        msg = (
            f"collapsed at t={t_s:.0f} s: {in_flight} requests in flight, over "
            f"{config.max_in_flight_per_gpu} per GPU (the row cannot serve this load)"
        )
        raise SimCollapsedError(msg, at_s=t_s, in_flight=in_flight)
    if deadline is not None and time.monotonic() > deadline:
        msg = (
            f"collapsed at t={t_s:.0f} s: over the time limit of {config.time_limit_s:g} s "
            f"({in_flight} requests in flight)"
        )
        raise SimCollapsedError(msg, at_s=t_s, in_flight=in_flight)


def run(  # noqa: PLR0915 - the hot loop keeps its state in locals, for speed
    config: SimConfig,
    workload: Workload,
    *,
    policy: Policy | None,
    gpu_cls: IntArray,
    seed: int = 0,
) -> RunResult:
    """Simulate ``workload`` on the row(s) of ``config``; ``policy=None`` runs uncapped.

    ``gpu_cls`` gives the class of each GPU of one row (``assign_classes``); every row has
    the same assignment.
    """
    row_cfg, ctl, gpu = config.row, config.control, config.row.gpu
    rows, dt = config.rows, config.step_s
    per_row, per_server = row_cfg.gpus, row_cfg.gpus_per_server
    n_gpus = rows * per_row
    if rows > MAX_ROWS:
        msg = f"at most {MAX_ROWS} rows per run, got {rows}"
        raise SimConfigError(msg)
    if len(gpu_cls) != per_row:
        msg = f"gpu_cls has {len(gpu_cls)} entries for a row of {per_row} GPUs"
        raise SimConfigError(msg)
    if len(workload) and int(workload.row.max()) >= rows:
        msg = f"the workload has requests for {int(workload.row.max()) + 1} rows, not {rows}"
        raise SimConfigError(msg)
    cls_of_gpu = np.tile(gpu_cls, rows)
    row_of_gpu = np.repeat(np.arange(rows), per_row)
    gpus_by_class = tuple(int(np.count_nonzero(cls_of_gpu == c)) for c in (HP, LP))
    for c, name in ((HP, "high"), (LP, "low")):
        if gpus_by_class[c] == 0 and np.any(workload.cls == c):
            msg = (
                f"{name}-priority requests but no {name}-priority GPU: change the "
                "high-priority share, or assign classes by GPU instead of by server"
            )
            raise SimConfigError(msg)

    n_steps = max(1, math.ceil(workload.duration_s / dt - _EPS))
    pool_of_gpu = row_of_gpu * 2 + cls_of_gpu
    routing = _routing(workload, pool_of_gpu, rows * 2, n_steps, dt)
    pool_gpus = np.argsort(pool_of_gpu, kind="stable")
    pool_key = routing.pool_key[pool_gpus].astype(np.int16)  # per position, grouped by pool
    pool_size = np.bincount(pool_of_gpu, minlength=rows * 2)
    pool_first = (np.cumsum(pool_size) - pool_size)[pool_of_gpu[pool_gpus]]
    pool_len = np.maximum(pool_size[pool_of_gpu[pool_gpus]], 1)
    pos_in_pool = np.arange(n_gpus) - pool_first
    n_rot = int(min(pool_len.max(), _MAX_ROTATIONS))
    rotations = pool_gpus[pool_first + (pos_in_pool + np.arange(n_rot)[:, None]) % pool_len]
    bounds = np.searchsorted(workload.arrival_s, np.arange(n_steps + 1) * dt, side="left")
    arr_t, arr_gen = workload.arrival_s, workload.gen_tokens
    arr_work = workload.ctx_tokens / gpu.prefill_tokens_per_s
    arr_dyn = gpu.tdp_w * gpu.prefill_frac(workload.ctx_tokens) - gpu.resident_power_w
    arr_slot = routing.slot
    multi = routing.multi

    # GPU state.
    resident_w = gpu.resident_power_w
    backlog = np.zeros(n_gpus)  # cumulative prefill work queued, seconds at max clock
    done = np.zeros(n_gpus)  # ... and processed
    n_out = np.zeros(n_gpus, dtype=np.int16)  # outstanding requests (routing)
    lock = np.ones(n_gpus)  # SM clock cap from the policy, fraction of max
    limit = np.full(n_gpus, gpu.tdp_w)  # power limit from the policy
    pre_dyn_prev = np.full(n_gpus, float(arr_dyn.mean()) if len(arr_dyn) else 0.0)
    pre_busy_acc = np.zeros(n_gpus)  # GPU-seconds in prefill
    busy_acc = np.zeros(n_gpus)  # GPU-seconds decoding
    slow_acc = np.zeros(n_gpus)  # decode GPU-seconds lost to clock caps
    zeros = np.zeros(n_gpus)
    # Row power = non-GPU + (1 + overhead) x GPU power; the resident part is constant.
    gpu_scale = 1.0 + row_cfg.server_overhead_frac
    gpu_base_w = (
        row_cfg.servers * row_cfg.server_other_w + gpu_scale * per_row * gpu.resident_power_w
    )
    gpu_factor = gpu_scale / dt
    m_p, m_d, alpha = gpu.prefill_mem_share, gpu.decode_mem_share, gpu.clock_power_exponent
    e_p, e_d = gpu.prefill_clock_exponent, gpu.decode_clock_exponent
    brake_frac = gpu.brake_sm_clock_mhz / gpu.sm_clock_max_mhz
    over_limit = 1.0 + gpu.prefill_overshoot_frac
    tdp_w, tbt_s = gpu.tdp_w, gpu.decode_s_per_token
    # Per decode batch size (clipped at the table's end): power share of TDP, dynamic
    # power above resident, and the per-token time multiplier.
    batch = np.arange(_BATCH_TABLE, dtype=np.float64)
    dec_frac_tab = gpu.decode_frac(np.maximum(batch, 1.0))
    dec_dyn_tab = np.where(batch > 0, tdp_w * dec_frac_tab - resident_w, 0.0)
    dec_on_tab = (batch > 0).astype(np.float64)
    dec_pen_tab = 1.0 + gpu.decode_batch_penalty * np.maximum(batch - 1.0, 0.0)
    max_wait_s = config.max_wait_s

    prefill = np.empty((5, 0))
    decode = np.empty((4, 0))
    fin_idx: list[IntArray] = []
    fin_lat: list[FloatArray] = []
    fin_ttft: list[FloatArray] = []
    dropped = [0, 0]
    row_power = np.zeros((n_steps, rows))

    # Control state.
    capped = policy is not None
    engine = EngineCaps(policy, config, gpu_cls) if policy is not None else None
    period_steps = max(1, round(ctl.telemetry_period_s / dt))
    delay_steps = max(0, round(ctl.telemetry_delay_s / dt))
    ladders = [LadderState() for _ in range(rows)]
    histories: list[list[tuple[float, float]]] = [[] for _ in range(rows)]
    tick_s: list[float] = []
    measured: list[list[float]] = []
    levels: list[list[int]] = []
    commands: list[_Command] = []
    rng = np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, 0xAC7]))
    over_since: list[float | None] = [None] * rows
    over_peak = [0.0] * rows
    brake_until = [-1.0] * rows
    braking = np.zeros(rows, dtype=bool)
    brakes: list[BrakeEvent] = []
    ladder_calls = 0
    budget = row_cfg.budget_w
    warmup_s = config.warmup_s
    # A feed's loss: the steps from which the brake and the controller see the cut budget,
    # and the step it ends (past the run: never).
    cut = config.budget_cut
    cut_w = cut.budget_w if cut is not None else budget
    cut_k = _first_step(cut.at_s, dt) if cut is not None else n_steps + 1
    known_k = _first_step(cut.at_s + cut.known_after_s, dt) if cut is not None else n_steps + 1
    end_k = _first_step(cut.until_s, dt) if cut is not None else n_steps + 1
    tick_budget: list[float] = []
    drop_idx: list[IntArray] = []
    work_log = np.zeros((n_steps + 1 if config.record_work else 0, 2, 2))
    class_of = np.array([cls_of_gpu == HP, cls_of_gpu == LP], dtype=np.float64)

    # Clock-dependent factors, refreshed only when caps change (each step if limits bind).
    dirty = True
    limits_bind = slowed = False
    lock_eff = speed_pre = scale_pre = scale_dec = dec_speed = sos = q_lim = tbt_slow = lock
    q_lim_min = 0.0

    in_flight_cap = config.max_in_flight_per_gpu * n_gpus
    batch_cap = config.max_decode_batch
    batch_full: npt.NDArray[np.bool_] | None = None  # GPUs whose decode batch is full
    deadline = None if config.time_limit_s is None else time.monotonic() + config.time_limit_s
    for k in range(n_steps):
        t0 = k * dt
        if k % _GUARD_STEPS == 0:
            _guard(prefill.shape[1] + decode.shape[1], in_flight_cap, deadline, t0, config)
        if config.record_work:
            work_log[k, :, 0] = class_of @ (busy_acc + pre_busy_acc)
            work_log[k, :, 1] = class_of @ (done + busy_acc - slow_acc)
        brake_budget = cut_w if cut_k <= k < end_k else budget

        # --- 1. control ------------------------------------------------------------------
        tick_now = k % period_steps == 0 or k == known_k  # a feed's loss wakes the controller
        if engine is not None and tick_now and k - delay_steps >= period_steps:
            seen = row_power[k - delay_steps - period_steps : k - delay_steps].mean(axis=0)
            ctl_budget = cut_w if known_k <= k < end_k else budget
            tick_s.append(t0)
            tick_budget.append(ctl_budget)
            measured.append(seen.tolist())
            row_levels: list[int] = []
            for r in range(rows):
                power_w = float(seen[r])
                hist = histories[r]
                if t0 >= warmup_s:  # the ramp from idle is not a trend
                    hist.append((t0, power_w))
                while hist and t0 - hist[0][0] > ctl.trend_window_s:
                    hist.pop(0)
                before = ladders[r].level
                ladders[r] = policy_api.next_level(
                    power_w=power_w,
                    budget_w=ctl_budget,
                    policy=engine.policy,
                    state=ladders[r],
                    now_s=t0,
                    trend_w_per_s=trend_w_per_s(hist, t0, window_s=ctl.trend_window_s),
                )
                ladder_calls += 1
                if ladders[r].level != before:
                    engine.caps(ladders[r].level)  # the agents' engine, on every level change
                    shrink = 1.0 - ctl.actuation_jitter * rng.random(row_cfg.servers)
                    commands.append(
                        _Command(
                            row=r,
                            level=ladders[r].level,
                            apply_s=t0 + ctl.actuation_delay_s * shrink,
                            applied=np.zeros(row_cfg.servers, dtype=bool),
                        )
                    )
                row_levels.append(ladders[r].level)
            levels.append(row_levels)

        # --- 2. actuation ----------------------------------------------------------------
        if engine is not None and commands:
            for cmd in commands:
                due = ~cmd.applied & (cmd.apply_s <= t0 + _EPS)
                if not due.any():
                    continue
                cmd.applied |= due
                servers = np.flatnonzero(due)
                clock_caps, limits = engine.caps(cmd.level)
                local = (servers[:, None] * per_server + np.arange(per_server)).ravel()
                lock[cmd.row * per_row + local] = clock_caps[local]
                limit[cmd.row * per_row + local] = limits[local]
                dirty = True
            commands = [cmd for cmd in commands if not cmd.applied.all()]
        if dirty:
            lock_eff = np.where(braking[row_of_gpu], np.minimum(lock, brake_frac), lock)
            limits_bind = bool(np.any(limit < tdp_w))
            slowed = limits_bind or bool(np.any(lock_eff < 1.0))
            scale_pre = power.dynamic_scale(lock_eff, mem_share=m_p, clock_power_exponent=alpha)
            scale_dec = power.dynamic_scale(lock_eff, mem_share=m_d, clock_power_exponent=alpha)
            speed_pre = lock_eff**e_p
            sos = scale_pre / speed_pre
            dec_speed = lock_eff**e_d
            tbt_slow = tbt_s / dec_speed
            q_lim = max_wait_s * speed_pre
            q_lim_min = float(q_lim.min())
            dirty = False
        if limits_bind:  # the GPUs' power controllers hold the limit: clocks move each step
            x = gpu.clock_for_limit(pre_dyn_prev + resident_w, limit * over_limit, m_p)
            np.minimum(x, lock_eff, out=x)
            scale_pre = power.dynamic_scale(x, mem_share=m_p, clock_power_exponent=alpha)
            speed_pre = x**e_p
            sos = scale_pre / speed_pre
            q_lim = max_wait_s * speed_pre
            q_lim_min = float(q_lim.min())

        # --- 3. routing ------------------------------------------------------------------
        a0, a1 = bounds[k], bounds[k + 1]
        offset = zeros
        offset_dt: float | FloatArray = dt
        if a1 > a0:
            # Least outstanding first; ties go round-robin (each pool's GPUs are listed
            # from a rotating start); the pool's k-th arrival takes its k-th GPU.
            perm = rotations[k % n_rot]
            key = np.minimum(n_out[perm], _MAX_KEY_OUT)
            key += pool_key
            g = perm[np.argsort(key, kind="stable")][arr_slot[a0:a1]]
            idx = np.arange(a0, a1)
            work = arr_work[a0:a1]
            queued = backlog[g] - done[g]
            cum = _cum_before(g, work) if multi[k] else None
            if cum is not None or float(queued.max()) > q_lim_min:
                wait = queued if cum is None else queued + cum
                drop = wait > q_lim[g]
                if drop.any():
                    for c in (HP, LP):
                        dropped[c] += int(np.count_nonzero(drop & (workload.cls[a0:a1] == c)))
                    drop_idx.append(idx[drop])
                    keep = ~drop
                    g, idx, work, queued = g[keep], idx[keep], work[keep], queued[keep]
                    cum = _cum_before(g, work) if cum is not None else None
            if len(g):
                # An idle GPU cannot start a prompt before it arrives.
                idle = queued <= _EPS
                if cum is not None:
                    idle &= cum <= 0.0
                if idle.any():
                    offset = zeros.copy()
                    offset[g[idle]] = arr_t[idx[idle]] - t0
                    offset_dt = dt - offset
                start = backlog[g] if cum is None else backlog[g] + cum
                new = np.array((g, start, start + work, arr_dyn[idx], idx))
                prefill = np.concatenate((prefill, new), axis=1)
                if cum is None:  # one arrival per GPU: plain fancy-index updates
                    backlog[g] += work
                    n_out[g] += 1
                else:
                    backlog += np.bincount(g, weights=work, minlength=n_gpus)
                    n_out += np.bincount(g, minlength=n_gpus).astype(np.int16)

        # --- 4. prefill ------------------------------------------------------------------
        busy_p = np.minimum(offset_dt, (backlog - done) / speed_pre)
        if batch_full is not None:  # a full decode batch admits no new request
            busy_p = np.where(batch_full, 0.0, busy_p)
        done_old = done
        done = np.minimum(done + busy_p * speed_pre, backlog)
        pre_dyn_w = zeros
        if prefill.shape[1]:
            gi = prefill[P_GPU].astype(np.intp)
            d_new = done[gi]
            overlap = np.minimum(prefill[P_MARK], d_new)
            overlap -= np.maximum(prefill[P_START], done_old[gi])
            np.maximum(overlap, 0.0, out=overlap)
            # Dynamic prefill energy at max clock, per GPU: longer prompts spike higher.
            overlap *= prefill[P_DYN]
            pre_dyn_w = cast(FloatArray, np.bincount(gi, weights=overlap, minlength=n_gpus))
            if limits_bind:
                work_done = done - done_old
                has = work_done > 0
                pre_dyn_prev = np.where(
                    has, pre_dyn_w / np.where(has, work_done, 1.0), pre_dyn_prev
                )
            d_new += _EPS
            ended = prefill[P_MARK] <= d_new
            e = np.flatnonzero(ended)
            if len(e):
                ge = gi[e]
                idx_e = prefill[P_IDX, e]
                tpe = (prefill[P_MARK, e] - done_old[ge]) / speed_pre[ge]
                tpe += offset[ge]
                tpe += t0
                gen = arr_gen[idx_e.astype(np.intp)]
                decode = np.concatenate((decode, np.array((ge, gen, tpe, idx_e))), axis=1)
                prefill = prefill.compress(~ended, axis=1)

        # --- 5. decode -------------------------------------------------------------------
        window_s = dt - busy_p
        if decode.shape[1]:
            gd = decode[D_GPU].astype(np.intp)
            n_dec = np.bincount(gd, minlength=n_gpus)
            if limits_bind:
                x = gpu.clock_for_limit(tdp_w * dec_frac_tab.take(n_dec, mode="clip"), limit, m_d)
                np.minimum(x, lock_eff, out=x)
                scale_dec = power.dynamic_scale(x, mem_share=m_d, clock_power_exponent=alpha)
                dec_speed = x**e_d
                tbt_slow = tbt_s / dec_speed
            token_s = tbt_slow * dec_pen_tab.take(n_dec, mode="clip")
            rate = window_s / token_s
            serve_s = dec_on_tab.take(n_dec, mode="clip") * window_s
            busy_acc += serve_s
            if slowed:
                slow_acc += serve_s * (1.0 - dec_speed)
            dec_dyn_w = dec_dyn_tab.take(n_dec, mode="clip") * scale_dec
            rem = decode[D_REM]
            rem -= rate[gd]
            e = np.flatnonzero(rem <= _EPS)
            if len(e):
                ge = gd[e]
                rem_before = rem[e] + rate[ge]
                tpe = decode[D_TPE, e]
                t_end = np.maximum(t0 + dt - window_s[ge], tpe) + rem_before * token_s[ge]
                t_end = np.where(rem_before <= _EPS, tpe, t_end)
                idx_e = decode[D_IDX, e].astype(np.intp)
                arrival = arr_t[idx_e]
                fin_idx.append(idx_e)
                fin_lat.append(t_end - arrival)
                fin_ttft.append(tpe - arrival)
                np.subtract.at(n_out, ge, 1)
                keep_d = np.ones(decode.shape[1], dtype=bool)
                keep_d[e] = False
                decode = decode.compress(keep_d, axis=1)
                np.subtract.at(n_dec, ge, 1)
            full = n_dec >= batch_cap
            batch_full = full if full.any() else None
            dyn_dec = float(dec_dyn_w @ window_s) if rows == 1 else 0.0
        else:
            dec_dyn_w = zeros
            dyn_dec = 0.0
            batch_full = None

        # --- 6. power --------------------------------------------------------------------
        pre_busy_acc += busy_p
        if rows == 1:
            row_power[k, 0] = gpu_base_w + (float(pre_dyn_w @ sos) + dyn_dec) * gpu_factor
        else:
            gpu_dyn_w = pre_dyn_w * sos + dec_dyn_w * window_s
            row_power[k] = gpu_base_w + gpu_dyn_w.reshape(rows, per_row).sum(axis=1) * gpu_factor

        # --- 7. brake --------------------------------------------------------------------
        if capped:
            t1 = t0 + dt
            for r in range(rows):
                if braking[r] and t1 >= brake_until[r] - _EPS:
                    braking[r] = False
                    dirty = True
                p_r = float(row_power[k, r])
                if p_r <= brake_budget:
                    over_since[r] = None
                    continue
                since = over_since[r]
                if since is None:
                    over_since[r], over_peak[r] = t0, p_r
                    since = t0
                over_peak[r] = max(over_peak[r], p_r)
                if not braking[r] and t1 - since >= ctl.brake_tolerance_s - _EPS:
                    brakes.append(BrakeEvent(r, since, t1, 100.0 * over_peak[r] / brake_budget))
                    braking[r] = True
                    brake_until[r] = t1 + ctl.brake_hold_s
                    over_since[r] = None
                    dirty = True

    # Work at the maximum clock: prefill's is the cumulative counter itself; decode's is
    # its serving time less what the caps cost.
    work_acc = done + busy_acc - slow_acc
    busy_acc += pre_busy_acc
    if config.record_work:
        work_log[n_steps, :, 0] = class_of @ busy_acc
        work_log[n_steps, :, 1] = class_of @ work_acc
    drops = np.concatenate(drop_idx) if drop_idx else np.zeros(0, dtype=np.intp)
    idx_all = np.concatenate(fin_idx) if fin_idx else np.zeros(0, dtype=np.intp)
    in_flight = np.concatenate((prefill[P_IDX], decode[D_IDX])).astype(np.intp)
    in_flight_cls = workload.cls[in_flight]
    return RunResult(
        config=config,
        policy_name=policy.name if policy is not None else None,
        level_names=("nominal", *(lvl.name for lvl in policy.levels)) if policy else ("nominal",),
        threshold_pcts=tuple(lvl.threshold_pct for lvl in policy.levels) if policy else (),
        duration_s=n_steps * dt,
        row_power_w=row_power,
        tick_s=np.array(tick_s),
        measured_w=np.array(measured).reshape(len(tick_s), rows),
        tick_budget_w=np.array(tick_budget),
        level=np.array(levels, dtype=np.int8).reshape(len(tick_s), rows),
        brakes=tuple(brakes),
        req_cls=workload.cls[idx_all],
        req_arrival_s=arr_t[idx_all],
        req_latency_s=np.concatenate(fin_lat) if fin_lat else np.zeros(0),
        req_ttft_s=np.concatenate(fin_ttft) if fin_ttft else np.zeros(0),
        req_tokens=workload.ctx_tokens[idx_all] + workload.gen_tokens[idx_all],
        dropped=(dropped[HP], dropped[LP]),
        unfinished=(
            int(np.count_nonzero(in_flight_cls == HP)),
            int(np.count_nonzero(in_flight_cls == LP)),
        ),
        busy_s=(float(busy_acc[cls_of_gpu == HP].sum()), float(busy_acc[cls_of_gpu == LP].sum())),
        work_s=(float(work_acc[cls_of_gpu == HP].sum()), float(work_acc[cls_of_gpu == LP].sum())),
        gpus=(gpus_by_class[HP], gpus_by_class[LP]),
        decide_calls=engine.calls if engine is not None else 0,
        ladder_calls=ladder_calls,
        drop_cls=workload.cls[drops],
        drop_arrival_s=arr_t[drops],
        unfinished_cls=in_flight_cls,
        unfinished_arrival_s=arr_t[in_flight],
        work_log=work_log,
    )


def _first_step(t_s: float, dt: float) -> int:
    """The first step that starts at or after ``t_s`` (a huge index for infinity)."""
    if not math.isfinite(t_s):
        return 2**62
    return math.ceil(t_s / dt - _EPS)


def _cum_before(g: IntArray, work: FloatArray) -> FloatArray:
    """Work queued ahead of each arrival by earlier arrivals of the same step on its GPU."""
    order = np.argsort(g, kind="stable")
    gs, ws = g[order], work[order]
    total = np.cumsum(ws)
    group_start = np.r_[True, gs[1:] != gs[:-1]]
    base = np.maximum.accumulate(np.where(group_start, total - ws, 0.0))
    out = np.empty(len(g))
    out[order] = total - ws - base
    return out


__all__ = ["MAX_ROWS", "BrakeEvent", "RunResult", "assign_classes", "run"]
