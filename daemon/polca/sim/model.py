"""The simulator's physics and configuration: GPUs serving LLM requests, servers, a row.

``polca simulate`` and ``polca plan`` answer "how many servers can this row hold" before
caps are enabled on a live row, so the model has to be honest about three things and
nothing more: how an inference GPU's power moves with what it is doing (prefill, decode,
idle) and with its SM clock, how a clock cap slows each phase down, and what the rest of
a server draws. Everything here is data and vectorised arithmetic (numpy over every GPU
of the row at once); the time loop lives in ``polca.sim.runner``.

The model per GPU (constants per GPU type in ``SIM_GPUS``; where each number comes from
is in ``docs/simulator.md``):

- **prefill** is compute-bound: at the maximum SM clock it draws ``prefill_frac(ctx)``
  of TDP, from ``prefill_power_min_frac`` for short prompts up to
  ``prefill_power_max_frac`` for prompts of ``prefill_power_ctx_tokens`` or more (longer
  inputs spike higher, POLCA §2.4); its duration is ``ctx / prefill_tokens_per_s`` at the
  maximum clock and scales with ``(f_max / f) ** prefill_clock_exponent``;
- **decode** is memory-bound: ``decode_power_base_frac + decode_power_per_request_frac x
  (batch - 1)`` of TDP (at most ``decode_power_max_frac``); a token takes
  ``decode_s_per_token x (1 + decode_batch_penalty x (batch - 1))`` at the maximum clock,
  scaled by ``(f_max / f) ** decode_clock_exponent`` (weakly clock-sensitive);
- **idle with a resident model** draws ``resident_power_w``;
- the dynamic part of power (above resident) splits into a memory share, which a clock
  lock does not touch, and an SM share scaling as ``(f / f_max) ** clock_power_exponent``
  (f x V^2 with V rising with f); the memory share is small for prefill and large for
  decode. That curve, and the clock a power limit leaves, are ``polca.physics.power``,
  which the simulated backend uses too; the per-phase powers, speeds and their clock
  sensitivity are this simulator's own;
- the GPU's **power limit** (TDP by default, or a cap from the policy) is met by lowering
  the clock until the phase's power fits, as the GPU's own power controller does; a
  prefill spike, shorter than the controller's averaging window, may exceed it by
  ``prefill_overshoot_frac`` (so at the default limit the longest prompts reach 1.1 x TDP,
  as POLCA measured GPUs briefly drawing above TDP).

A server adds ``server_other_w`` (CPUs, memory, NICs, NVSwitches, fans) to its GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from polca.errors import SimConfigError
from polca.physics import power
from polca.sim.profile import SimProfile, shipped_profile, shipped_profile_names

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]

ACTUATION_PRESETS_S: dict[str, float] = {
    # In-band NVML clock lock: ~10 ms (Perseus, arXiv 2312.06902) plus polca's own control
    # path, ~2 ms (docs/performance.md); the simulator applies it at the next step.
    "in-band": 0.012,
    # Out-of-band through the BMC (SMBPBI): up to 40 s per server (POLCA Table 1).
    "out-of-band": 40.0,
}


@dataclass(frozen=True, slots=True)
class SimGpu:
    """Everything the simulator needs to know about one GPU type serving one model replica."""

    name: str
    tdp_w: float  # thermal design power = default power limit
    power_limit_min_w: float
    power_limit_max_w: float
    sm_clock_max_mhz: int
    sm_clock_min_mhz: int
    resident_power_w: float  # a model is loaded, nothing runs
    prefill_power_min_frac: float  # of TDP at max clock, shortest prompts
    prefill_power_max_frac: float  # of TDP at max clock, prompts >= prefill_power_ctx_tokens
    prefill_power_ctx_tokens: float
    decode_power_base_frac: float  # of TDP at max clock, one request decoding
    decode_power_per_request_frac: float  # ... plus this per extra request in the batch
    decode_power_max_frac: float
    prefill_mem_share: float  # share of the dynamic power a clock lock does not reduce
    decode_mem_share: float
    clock_power_exponent: float  # SM dynamic power ~ (f / f_max) ** this
    prefill_tokens_per_s: float  # at max clock, one prefill at a time
    prefill_clock_exponent: float  # prefill time ~ (f_max / f) ** this
    decode_s_per_token: float  # at max clock, batch of one
    decode_batch_penalty: float  # per extra request in the batch
    decode_clock_exponent: float  # decode time ~ (f_max / f) ** this
    brake_sm_clock_mhz: int  # where the hardware power brake holds the SM clock
    # A prefill spike is shorter than the power controller's averaging window, so it may
    # exceed the power limit by this share; steady (decode) power obeys the limit.
    prefill_overshoot_frac: float = 0.10

    @property
    def min_clock_frac(self) -> float:
        """The lowest lockable SM clock as a fraction of the maximum."""
        return self.sm_clock_min_mhz / self.sm_clock_max_mhz

    def prefill_frac(self, ctx_tokens: FloatArray) -> FloatArray:
        """Prefill power at max clock, as a fraction of TDP, for prompts of ``ctx_tokens``."""
        fill = np.minimum(1.0, ctx_tokens / self.prefill_power_ctx_tokens)
        lo, hi = self.prefill_power_min_frac, self.prefill_power_max_frac
        return lo + (hi - lo) * fill

    def decode_frac(self, batch: FloatArray) -> FloatArray:
        """Decode power at max clock, as a fraction of TDP, with ``batch`` requests (>= 1)."""
        frac = self.decode_power_base_frac + self.decode_power_per_request_frac * (batch - 1.0)
        return np.minimum(self.decode_power_max_frac, frac)

    def power_w(self, full_w: FloatArray, clock_frac: FloatArray, mem_share: float) -> FloatArray:
        """Power of a phase that draws ``full_w`` at max clock, run at ``clock_frac``."""
        return power.power_w(
            self.resident_power_w,
            np.maximum(full_w - self.resident_power_w, 0.0),
            clock_frac=clock_frac,
            mem_share=mem_share,
            clock_power_exponent=self.clock_power_exponent,
        )

    def clock_for_limit(
        self, full_w: FloatArray, limit_w: FloatArray, mem_share: float
    ) -> FloatArray:
        """The highest clock fraction at which a phase drawing ``full_w`` fits ``limit_w``.

        1.0 where it fits at max clock; never below the lowest lockable clock (a GPU cannot
        go lower, so it runs over the limit there, as a real one would).
        """
        dynamic_w = np.maximum(full_w - self.resident_power_w, 1e-9)
        sm_scale = power.sm_scale_for_limit(
            self.resident_power_w, dynamic_w, limit_w=limit_w, mem_share=mem_share
        )
        clock_frac = power.clock_frac_for_sm_scale(
            np.clip(sm_scale, 0.0, 1.0), clock_power_exponent=self.clock_power_exponent
        )
        return np.clip(clock_frac, self.min_clock_frac, 1.0)


@dataclass(frozen=True, slots=True)
class ServerPreset:
    """Defaults for a server of 8 GPUs of one type (what the CLI fills in)."""

    gpu: str
    provisioned_w: float  # row budget share per server at 0% oversubscription
    other_w: float  # non-GPU power that does not follow the GPUs
    overhead_frac: float  # share of GPU power the rest of the server adds
    load_scale: float  # trace copies per server that make a row peak near 79%


def _from_profile(profile: SimProfile) -> tuple[SimGpu, ServerPreset]:
    """The simulator's GPU and server of one profile (``polca.sim.profile``)."""
    gpu, server = profile.values()
    typed = {k: int(v) if k.endswith("_mhz") else float(v) for k, v in gpu.items()}  # clocks
    return (
        SimGpu(name=profile.name, **typed),  # type: ignore[arg-type]
        ServerPreset(gpu=profile.name, **{k: float(v) for k, v in server.items()}),
    )


def _shipped() -> tuple[dict[str, SimGpu], dict[str, ServerPreset]]:
    gpus: dict[str, SimGpu] = {}
    servers: dict[str, ServerPreset] = {}
    for name in shipped_profile_names():
        gpu, server = _from_profile(shipped_profile(name))
        gpus[gpu.name.lower()] = gpu
        servers[gpu.name.lower()] = server
    return gpus, servers


# Every constant lives in the shipped profiles (polca/data/profiles/*.yaml), with its source;
# docs/simulator.md tabulates them.
SIM_GPUS, SERVER_PRESETS = _shipped()

GPU_NAMES: tuple[str, ...] = tuple(g.name for g in SIM_GPUS.values())


def profile_gpu_and_server(profile: SimProfile) -> tuple[SimGpu, ServerPreset]:
    """The GPU and server a profile describes (``--profile``)."""
    return _from_profile(profile)


def sim_gpu(name: str) -> SimGpu:
    """The simulator preset of GPU type ``name`` (case-insensitive)."""
    try:
        return SIM_GPUS[name.strip().lower()]
    except KeyError as exc:
        msg = f"unknown GPU model {name!r}; known models: {', '.join(GPU_NAMES)}"
        raise SimConfigError(msg) from exc


def server_preset(name: str) -> ServerPreset:
    """The server defaults for GPU type ``name``."""
    sim_gpu(name)  # the same error for an unknown name
    return SERVER_PRESETS[name.strip().lower()]


@dataclass(frozen=True, slots=True)
class RowConfig:
    """One row: its servers, their GPUs, and the row's provisioned power budget.

    ``servers`` is what is deployed (base servers x (1 + oversubscription)); the budget is
    the same whatever is deployed.
    """

    servers: int
    gpus_per_server: int
    gpu: SimGpu
    budget_w: float
    server_other_w: float  # non-GPU power that does not follow the GPUs
    # Share of GPU power drawn again by the rest of the server while the GPUs work: PSU
    # conversion losses, fans ramping with heat, NVSwitch and NIC traffic.
    server_overhead_frac: float = 0.0

    def __post_init__(self) -> None:
        if self.servers < 1:
            msg = f"a row needs at least one server, got servers={self.servers}"
            raise SimConfigError(msg)
        if self.gpus_per_server < 1:
            msg = f"a server needs at least one GPU, got gpus_per_server={self.gpus_per_server}"
            raise SimConfigError(msg)
        if not (math.isfinite(self.budget_w) and self.budget_w > 0):
            msg = f"the row budget must be a positive number of watts, got {self.budget_w}"
            raise SimConfigError(msg)
        if not (math.isfinite(self.server_other_w) and self.server_other_w >= 0):
            msg = f"non-GPU server power must be >= 0 W, got {self.server_other_w}"
            raise SimConfigError(msg)
        if not 0.0 <= self.server_overhead_frac <= 1.0:
            msg = f"server_overhead_frac must be within 0..1, got {self.server_overhead_frac}"
            raise SimConfigError(msg)
        if self.idle_power_w >= self.budget_w:
            msg = (
                f"impossible row: {self.servers} servers idle at {self.idle_power_w:.0f} W "
                f"({self.server_other_w:.0f} W non-GPU + {self.gpus_per_server} x "
                f"{self.gpu.resident_power_w:.0f} W per server), at or above the row budget "
                f"of {self.budget_w:.0f} W; no policy can keep this row under budget"
            )
            raise SimConfigError(msg)

    @property
    def gpus(self) -> int:
        """GPUs in the row."""
        return self.servers * self.gpus_per_server

    @property
    def idle_power_w(self) -> float:
        """Row power with every model resident and no request running."""
        gpus_w = self.gpus_per_server * self.gpu.resident_power_w
        return self.servers * (self.server_other_w + (1.0 + self.server_overhead_frac) * gpus_w)

    def server_power_w(self, gpus_w: float) -> float:
        """Power of one server whose GPUs draw ``gpus_w`` in all."""
        return self.server_other_w + (1.0 + self.server_overhead_frac) * gpus_w


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """Telemetry, actuation and brake timing of the simulated control loop."""

    telemetry_period_s: float = 2.0  # row meter averaging period = controller interval
    telemetry_delay_s: float = 2.0  # age of the newest reading (POLCA Table 1: 2 s)
    actuation_delay_s: float = ACTUATION_PRESETS_S["out-of-band"]
    actuation_jitter: float = 0.0  # per-server delay drawn from [1 - jitter, 1] x delay
    trend_window_s: float = 10.0  # least-squares trend, as the aggregator's default
    brake_tolerance_s: float = 5.0  # row above budget this long -> the hardware brake fires
    brake_hold_s: float = 10.0  # the brake holds the row's GPUs at the brake clock this long

    def __post_init__(self) -> None:
        checks = (
            ("telemetry_period_s", self.telemetry_period_s, 0.0, False),
            ("telemetry_delay_s", self.telemetry_delay_s, 0.0, True),
            ("actuation_delay_s", self.actuation_delay_s, 0.0, True),
            ("trend_window_s", self.trend_window_s, 0.0, False),
            ("brake_tolerance_s", self.brake_tolerance_s, 0.0, True),
            ("brake_hold_s", self.brake_hold_s, 0.0, True),
        )
        for name, value, low, inclusive in checks:
            ok = math.isfinite(value) and (value >= low if inclusive else value > low)
            if not ok:
                bound = ">= 0" if inclusive else "> 0"
                msg = f"{name} must be {bound} seconds, got {value}"
                raise SimConfigError(msg)
        if not 0.0 <= self.actuation_jitter <= 1.0:
            msg = f"actuation_jitter must be within 0..1, got {self.actuation_jitter}"
            raise SimConfigError(msg)


@dataclass(frozen=True, slots=True)
class BudgetCut:
    """The row's budget cut to ``budget_w`` from ``at_s`` until ``until_s``: a feed lost.

    The electrical limit (what the brake guards) falls at ``at_s``; the controller runs on
    the cut budget from ``at_s + known_after_s`` (the meter's poll and the aggregator's
    step that sees the feed down), with one control step then, as the aggregator's fast
    path takes it at its next step. At ``until_s`` (the feed back) both return to the
    row's budget. Times are seconds of the run; every row of the run is cut alike.
    """

    at_s: float
    budget_w: float
    known_after_s: float = 2.0
    until_s: float = math.inf

    def __post_init__(self) -> None:
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            msg = f"a budget cut starts at a time >= 0 s, got {self.at_s}"
            raise SimConfigError(msg)
        if not (math.isfinite(self.budget_w) and self.budget_w > 0):
            msg = f"a budget cut leaves a positive number of watts, got {self.budget_w}"
            raise SimConfigError(msg)
        if not (math.isfinite(self.known_after_s) and self.known_after_s >= 0):
            msg = f"known_after_s must be >= 0 seconds, got {self.known_after_s}"
            raise SimConfigError(msg)
        if not self.until_s > self.at_s:  # NaN fails too
            msg = f"a budget cut ends after it starts ({self.at_s} s), got {self.until_s}"
            raise SimConfigError(msg)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation: a row (or several alike), its control loop and the step size."""

    row: RowConfig
    control: ControlConfig = field(default_factory=ControlConfig)
    rows: int = 1  # identical rows, each with its own load, budget and controller
    step_s: float = 0.1
    max_wait_s: float = 30.0  # a prefill queued longer is dropped (client timeout)
    # The row fills up from idle at the start; like the aggregator's warm-up, the trend
    # history starts after it (the ramp is not a trend) and metrics leave it out.
    warmup_s: float = 0.0
    # Bounds on a run that has collapsed (the load outruns the row: decodes pile up without
    # bound): past this many requests in flight per GPU, or this much wall time, the run
    # stops with SimCollapsedError. A run that ends is never changed by them.
    max_in_flight_per_gpu: int = 1024
    time_limit_s: float | None = None
    # A GPU decodes at most this many requests at once (vLLM's max_num_seqs, 256 by
    # default); while its batch is full it starts no prefill, so prompts queue and age out
    # by max_wait_s instead of piling up in decode.
    max_decode_batch: int = 256
    # A feed's loss replayed (``polca plan --feed-failure``): the budget falls at a time.
    budget_cut: BudgetCut | None = None
    # Keep each class's cumulative busy and work GPU-seconds per step (``RunResult.work_log``),
    # so that a window's throughput loss can be computed after the run.
    record_work: bool = False

    def __post_init__(self) -> None:
        if self.budget_cut is not None and self.budget_cut.budget_w > self.row.budget_w:
            msg = (
                f"a budget cut to {self.budget_cut.budget_w:.0f} W is above the row's budget "
                f"of {self.row.budget_w:.0f} W: a feed's loss never raises a budget"
            )
            raise SimConfigError(msg)
        if self.max_decode_batch < 1:
            msg = f"max_decode_batch must be at least 1, got {self.max_decode_batch}"
            raise SimConfigError(msg)
        if self.max_in_flight_per_gpu < 1:
            msg = f"max_in_flight_per_gpu must be at least 1, got {self.max_in_flight_per_gpu}"
            raise SimConfigError(msg)
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            msg = f"time_limit_s must be positive, got {self.time_limit_s}"
            raise SimConfigError(msg)
        if self.rows < 1:
            msg = f"rows must be at least 1, got {self.rows}"
            raise SimConfigError(msg)
        if not (math.isfinite(self.step_s) and 0 < self.step_s <= 1.0):
            msg = f"step_s must be within (0, 1] seconds, got {self.step_s}"
            raise SimConfigError(msg)
        if self.control.telemetry_period_s < self.step_s:
            msg = (
                f"telemetry_period_s ({self.control.telemetry_period_s} s) must be at least "
                f"one step ({self.step_s} s)"
            )
            raise SimConfigError(msg)
        if not (math.isfinite(self.warmup_s) and self.warmup_s >= 0):
            msg = f"warmup_s must be >= 0 seconds, got {self.warmup_s}"
            raise SimConfigError(msg)
        if not self.max_wait_s > 0:
            msg = f"max_wait_s must be positive, got {self.max_wait_s}"
            raise SimConfigError(msg)


__all__ = [
    "ACTUATION_PRESETS_S",
    "GPU_NAMES",
    "SERVER_PRESETS",
    "SIM_GPUS",
    "BudgetCut",
    "ControlConfig",
    "FloatArray",
    "IntArray",
    "RowConfig",
    "ServerPreset",
    "SimConfig",
    "SimConfigError",
    "SimGpu",
    "server_preset",
    "sim_gpu",
]
