"""The requests a simulated row serves: a trace, scaled, repeated, shaped and classified.

A recorded trace (the bundled Azure code-completion sample has 8,819 requests in 57
minutes, about 2.6 per second) is far too little for a row of hundreds of GPUs and far
too short for a day, so ``build_workload`` turns it into a row's load:

- **scaling**: ``load_scale`` copies of the trace per deployed server (a fraction thins the
  last copy), so an oversubscribed row, with more servers, also carries more load;
- **tenants**: the copies belong to ``tenants`` independent services; each tenant replays
  the trace at its own random phase and each copy of a tenant jitters its requests by up
  to ``jitter_s``. One tenant makes the whole row follow the trace's minute-scale bursts;
  many make the row smooth. This is the knob that sets how much the row swings in 2 s;
- **repetition**: the trace wraps around for as long as the run lasts (``offset_s``
  starts it later, for a time-shifted replay);
- **diurnal envelope**: the rate is multiplied by a raised cosine between ``trough`` and
  1 with period ``period_s`` (1.0 = flat), by thinning;
- **classes**: each request is high priority with probability ``hp_share``.

Everything is drawn from numpy generators seeded by ``(seed, row)``: the same inputs give
the same requests, byte for byte.

``synthetic_chat_trace`` makes a second, differently shaped trace (chat-like: shorter
prompts, long answers, Markov-modulated bursts) for sensitivity studies on a trace the
policies were not tuned on; ``load_trace`` resolves a ``--trace`` argument.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from polca.sim.model import FloatArray, SimConfigError
from polca.workload.trace import Trace

BUILTIN_TRACES = ("azure-code", "synthetic-chat")
HP, LP = 0, 1  # class indices: high priority first, as policies list them


@dataclass(frozen=True, slots=True)
class Envelope:
    """A raised-cosine rate multiplier: 1 at ``peak_s``, ``trough`` half a period away."""

    period_s: float = 86_400.0
    trough: float = 1.0  # 1.0: flat
    peak_s: float = 43_200.0

    def __post_init__(self) -> None:
        if not 0.0 < self.trough <= 1.0:
            msg = f"the diurnal trough must be within (0, 1] of the peak, got {self.trough}"
            raise SimConfigError(msg)
        if not self.period_s > 0:
            msg = f"the diurnal period must be positive, got {self.period_s} s"
            raise SimConfigError(msg)

    def factor(self, t_s: FloatArray) -> FloatArray:
        """The rate multiplier at ``t_s`` (within [trough, 1])."""
        if self.trough >= 1.0:
            return np.ones_like(t_s)
        wave = 0.5 * (1.0 + np.cos(2.0 * np.pi * (t_s - self.peak_s) / self.period_s))
        return self.trough + (1.0 - self.trough) * wave


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """How to turn a trace into a row's requests (see the module docstring)."""

    duration_s: float
    load_scale: float  # trace copies per deployed server at the envelope's peak
    tenants: int = 8
    jitter_s: float = 60.0
    offset_s: float = 0.0
    envelope: Envelope = field(default_factory=Envelope)
    hp_share: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            msg = f"the duration must be a positive number of seconds, got {self.duration_s}"
            raise SimConfigError(msg)
        if not (math.isfinite(self.load_scale) and self.load_scale > 0):
            msg = f"load_scale must be positive (trace copies per server), got {self.load_scale}"
            raise SimConfigError(msg)
        if self.tenants < 1:
            msg = f"tenants must be at least 1, got {self.tenants}"
            raise SimConfigError(msg)
        if not (self.jitter_s >= 0 and self.offset_s >= 0):
            msg = f"jitter_s and offset_s must be >= 0, got {self.jitter_s}, {self.offset_s}"
            raise SimConfigError(msg)
        if not 0.0 <= self.hp_share <= 1.0:
            msg = f"the high-priority share must be within 0..1, got {self.hp_share}"
            raise SimConfigError(msg)


@dataclass(frozen=True, slots=True, eq=False)
class Workload:
    """Every request of a run, sorted by arrival."""

    source: str
    duration_s: float
    arrival_s: FloatArray
    row: npt.NDArray[np.intp]
    cls: npt.NDArray[np.intp]  # HP or LP
    ctx_tokens: FloatArray
    gen_tokens: FloatArray

    def __len__(self) -> int:
        """Return the number of requests."""
        return len(self.arrival_s)


def build_workload(trace: Trace, spec: WorkloadSpec, *, servers: int, rows: int = 1) -> Workload:
    """The requests of ``rows`` rows of ``servers`` servers each, from ``trace``."""
    if len(trace) < 2 or trace.duration_s <= 0:
        msg = f"{trace.source}: a trace needs at least two requests at different times"
        raise SimConfigError(msg)
    arrivals = np.asarray(trace.arrivals_s, dtype=np.float64)
    ctx = np.asarray(trace.context_tokens, dtype=np.float64)
    gen = np.asarray(trace.generated_tokens, dtype=np.float64)
    n = len(arrivals)
    period_s = trace.duration_s * n / (n - 1)  # a lap ends one mean gap after the last
    parts: list[tuple[FloatArray, npt.NDArray[np.intp]]] = []
    for r in range(rows):
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed & 0xFFFFFFFF, 0x5143, r]))
        mean_copies = spec.load_scale * servers
        copies = max(1, math.ceil(mean_copies))
        shifts = rng.uniform(0.0, period_s, spec.tenants)
        shifts[0] = 0.0 if r == 0 else shifts[0]  # row 0's first tenant replays as recorded
        times: list[FloatArray] = []
        index: list[npt.NDArray[np.intp]] = []
        for copy in range(copies):
            base = arrivals + shifts[copy % spec.tenants] - spec.offset_s
            first_lap = math.floor(-(base[-1] + spec.jitter_s) / period_s)
            last_lap = math.ceil((spec.duration_s - base[0]) / period_s)
            for lap in range(first_lap, last_lap + 1):
                u = base + lap * period_s
                if spec.jitter_s > 0:
                    u = u + rng.uniform(0.0, spec.jitter_s, n)
                inside = np.flatnonzero((u >= 0.0) & (u < spec.duration_s))
                times.append(u[inside])
                index.append(inside)
        t = np.concatenate(times)
        i = np.concatenate(index)
        keep_p = mean_copies * spec.envelope.factor(t) / copies
        keep = rng.random(len(t)) < keep_p
        parts.append((t[keep], i[keep]))
    t_all = np.concatenate([p[0] for p in parts])
    i_all = np.concatenate([p[1] for p in parts])
    row_all = np.concatenate([np.full(len(p[0]), r, dtype=np.intp) for r, p in enumerate(parts)])
    order = np.argsort(t_all, kind="stable")
    cls_rng = np.random.default_rng(np.random.SeedSequence([spec.seed & 0xFFFFFFFF, 0xC1A5]))
    cls = np.where(cls_rng.random(len(order)) < spec.hp_share, HP, LP).astype(np.intp)
    return Workload(
        source=trace.source,
        duration_s=spec.duration_s,
        arrival_s=t_all[order],
        row=row_all[order],
        cls=cls,
        ctx_tokens=ctx[i_all[order]],
        gen_tokens=gen[i_all[order]],
    )


def synthetic_chat_trace(*, duration_s: float = 3600.0, seed: int = 0) -> Trace:
    """A chat-like trace unlike the bundled one: a policy tuned on code never saw it.

    Shapes [U, loosely after the public Azure conversation trace of 2023]: prompts
    log-normal around 1,000 tokens, answers log-normal around 130 tokens (decode-heavy,
    where code completion is prefill-heavy); arrivals are Poisson at 2.5 requests per
    second modulated by a two-state burst process (x3 for ~20 s, every ~4 minutes), so
    the row sees sharper surges than in the code trace.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, 0xC4A7]))
    base_rate, burst_factor = 2.5, 3.0
    mean_calm_s, mean_burst_s = 240.0, 20.0
    times: list[FloatArray] = []
    t, burst = 0.0, False
    while t < duration_s:
        length = rng.exponential(mean_burst_s if burst else mean_calm_s)
        end = min(duration_s, t + length)
        rate = base_rate * (burst_factor if burst else 1.0)
        count = rng.poisson(rate * (end - t))
        times.append(np.sort(rng.uniform(t, end, count)))
        t, burst = end, not burst
    arrivals = np.concatenate(times)
    if len(arrivals) < 2:
        msg = f"synthetic-chat: {duration_s} s is too short for a trace"
        raise SimConfigError(msg)
    ctx = np.clip(np.round(rng.lognormal(math.log(1000.0), 0.9, len(arrivals))), 16, 8192)
    gen = np.clip(np.round(rng.lognormal(math.log(130.0), 0.9, len(arrivals))), 1, 2000)
    arrivals -= arrivals[0]
    return Trace(
        source=f"synthetic-chat(seed={seed})",
        arrivals_s=array("d", arrivals.tolist()),
        context_tokens=array("q", ctx.astype(np.int64).tolist()),
        generated_tokens=array("q", gen.astype(np.int64).tolist()),
    )


def load_trace(spec: str | Path, *, seed: int = 0) -> Trace:
    """``azure-code`` (the bundled trace), ``synthetic-chat``, or a CSV file path.

    A malformed CSV raises ``polca.workload.trace.TraceError`` whose message starts with
    ``FILE:LINE:``.
    """
    text = str(spec)
    if text == "azure-code":
        return Trace.load()
    if text == "synthetic-chat":
        return synthetic_chat_trace(seed=seed)
    path = Path(text)
    if not path.exists():
        msg = f"{text}: no such trace file (give a CSV path or one of: {', '.join(BUILTIN_TRACES)})"
        raise SimConfigError(msg)
    return Trace.load(path)


__all__ = [
    "BUILTIN_TRACES",
    "HP",
    "LP",
    "Envelope",
    "Workload",
    "WorkloadSpec",
    "build_workload",
    "load_trace",
    "synthetic_chat_trace",
]
