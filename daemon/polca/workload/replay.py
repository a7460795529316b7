"""LLM-inference load replayed from a request trace, for a whole row of simulated GPUs.

``polca demo`` runs dozens of simulated 8-GPU nodes in one process. Their power has to follow
real traffic, with its quiet minutes and bursts, or the row controller has nothing to show.
This module turns a ``Trace`` (``polca.workload.trace``) into one ``LoadProfile`` per GPU of
the row:

- ``TraceReplay`` routes every request to the least-loaded GPU of the row and serves it as a
  prefill phase (compute-bound, near-full utilization, serialized per GPU) followed by a
  decode phase (memory-bound; several decodes batch together and utilization grows with the
  batch: ``min(1, base + per_request * active)``). Between requests a GPU holding a model
  sits at a small resident utilization. How fast each phase runs and how busy it looks is
  a ``ServingModel`` (``polca.workload.serving``). ``scale`` replays each request several
  times (with a seeded jitter) or thins the trace, ``speedup`` compresses arrival times
  (not service times), and the trace repeats when it ends.
- ``TraceReplay.profile(i)`` / ``trace_loads(...)`` give the per-GPU profiles that
  ``SimulatedBackend.set_load`` takes. Utilization is answered from a precomputed per-GPU
  piecewise-constant timeline, computed window by window (``window_s``) as simulated time
  advances; only the last ``keep_windows`` windows stay in memory, so a long run stays
  bounded. Asking for a window older than those restarts the simulation from the beginning
  (deterministic, but slow); the demo only moves forward.

The clock's effect on power is the simulated backend's business; this module only provides
utilization, so capping a GPU does not slow its requests down here. Pure and deterministic:
the same trace, parameters and seed give the same timelines, whatever the order of queries.
No I/O; a lock makes one replay safe to share between the worker threads of several
simulated nodes.
"""

from __future__ import annotations

import bisect
import heapq
import math
import threading
from typing import NamedTuple

from polca.seeds import MASK64, mix64
from polca.workload.profiles import LoadProfile
from polca.workload.serving import ServingModel, serving_model
from polca.workload.trace import Trace


class WorkDone(NamedTuple):
    """Requests a GPU has completed (prefill and decode finished) and their tokens."""

    requests: int
    context_tokens: int
    generated_tokens: int


class _Request(NamedTuple):
    prefill_start_s: float  # replay time; the prefill may wait for the GPU's previous one
    prefill_end_s: float
    decode_end_s: float
    context_tokens: int
    generated_tokens: int


class _GpuWindow(NamedTuple):
    """One GPU's timeline over ``[start_s, end_s)``: ``utils[i]`` from ``times_s[i]`` on."""

    start_s: float
    end_s: float
    times_s: list[float]
    utils: list[float]
    done_s: list[float]  # completion times within the window, sorted
    done: list[WorkDone]  # cumulative work done at each completion
    done_before: WorkDone  # cumulative work done at ``start_s``


class TraceReplay:
    """A row of ``gpus`` GPUs serving ``trace`` (see the module docstring for the model).

    ``speedup`` divides arrival times (service times stay physical), ``offset_s`` starts the
    replay that many trace seconds in, ``scale`` multiplies the arrivals (copies after the
    first arrive up to ``jitter_s`` trace seconds later; a fraction keeps each copy with
    that probability), ``seed`` drives the copies and the routing tie-break. The default
    jitter of a minute makes the copies look like other users of the same service: the
    trace's minute-scale shape stays, its same-second coincidences are smoothed. A request
    whose prefill would wait more than ``max_wait_s`` is dropped and counted (``dropped``),
    as a client timeout would: an overloaded row stays saturated instead of queueing forever.
    """

    def __init__(
        self,
        trace: Trace,
        *,
        gpus: int,
        speedup: float = 1.0,
        offset_s: float = 0.0,
        scale: float = 1.0,
        seed: int = 0,
        serving: str | ServingModel = "H100-SXM",
        jitter_s: float = 60.0,
        window_s: float = 10.0,
        keep_windows: int = 8,
        max_wait_s: float = 30.0,
    ) -> None:
        """Check the parameters; the simulation runs lazily, window by window."""
        if gpus < 1:
            msg = f"gpus must be at least 1, got {gpus}"
            raise ValueError(msg)
        if not (speedup > 0 and window_s > 0 and math.isfinite(speedup)):
            msg = f"speedup and window_s must be positive, got {speedup} and {window_s}"
            raise ValueError(msg)
        if not (scale >= 0 and offset_s >= 0 and jitter_s >= 0 and math.isfinite(scale)):
            msg = (
                f"scale, offset_s and jitter_s must not be negative, got {scale}, "
                f"{offset_s} and {jitter_s}"
            )
            raise ValueError(msg)
        if not max_wait_s >= 0:
            msg = f"max_wait_s must not be negative, got {max_wait_s}"
            raise ValueError(msg)
        if keep_windows < 2:
            msg = f"keep_windows must be at least 2, got {keep_windows}"
            raise ValueError(msg)
        self.trace = trace
        self.gpus = gpus
        self.speedup = speedup
        self.offset_s = offset_s
        self.scale = scale
        self.seed = seed
        self.serving = serving_model(serving)
        self.jitter_s = jitter_s
        self.window_s = window_s
        self.keep_windows = keep_windows
        self.max_wait_s = max_wait_s
        # One lap of the trace ends a mean inter-arrival time after its last request.
        n = len(trace)
        self.period_s = trace.duration_s * n / (n - 1) if trace.duration_s > 0 else 1.0
        self._lock = threading.Lock()
        self._reset()

    @property
    def lap_s(self) -> float:
        """Replay seconds per pass over the trace."""
        return self.period_s / self.speedup

    @property
    def arrival_rate_per_s(self) -> float:
        """Mean requests per replay second that reach the row."""
        return len(self.trace) * self.scale / self.lap_s

    @property
    def dropped(self) -> int:
        """Requests dropped because their prefill would wait over ``max_wait_s``.

        Counted up to the end of the latest simulated window (at most ``window_s`` ahead of
        the latest query).
        """
        return self._dropped

    def profile(self, gpu_index: int) -> TraceLoad:
        """The load profile of GPU ``gpu_index`` of the row, for ``SimulatedBackend.set_load``."""
        self._check_gpu(gpu_index)
        return TraceLoad(self, gpu_index)

    def utilization(self, gpu_index: int, t_s: float) -> float:
        """Utilization of GPU ``gpu_index`` at replay time ``t_s``."""
        self._check_gpu(gpu_index)
        t_s = max(0.0, t_s)
        w = self._gpu_window(gpu_index, t_s)
        return w.utils[bisect.bisect_right(w.times_s, t_s) - 1]

    def row_utilization(self, t_s: float) -> float:
        """Summed utilization of every GPU of the row at ``t_s`` (in GPUs)."""
        return sum(self.utilization(i, t_s) for i in range(self.gpus))

    def work_done(self, gpu_index: int, t_s: float) -> WorkDone:
        """Requests (and their tokens) GPU ``gpu_index`` completed by replay time ``t_s``."""
        self._check_gpu(gpu_index)
        t_s = max(0.0, t_s)
        w = self._gpu_window(gpu_index, t_s)
        i = bisect.bisect_right(w.done_s, t_s)
        return w.done[i - 1] if i else w.done_before

    # --- simulation ----------------------------------------------------------------------

    def _check_gpu(self, gpu_index: int) -> None:
        if not 0 <= gpu_index < self.gpus:
            msg = f"no GPU {gpu_index} in a replay of {self.gpus} GPUs"
            raise ValueError(msg)

    def _reset(self) -> None:
        """Back to replay time 0 with idle GPUs."""
        g = self.gpus
        self._windows: dict[int, list[_GpuWindow]] = {}
        self._next_window = 0
        self._outstanding = [0] * g  # requests routed and not finished, per GPU
        self._prefill_free_s = [0.0] * g  # when each GPU's last queued prefill ends
        self._finishing: list[tuple[float, int]] = []  # heap of (decode end, GPU)
        self._open: list[list[_Request]] = [[] for _ in range(g)]
        self._served = [WorkDone(0, 0, 0)] * g
        self._next_gpu = mix64(self.seed & MASK64) % g  # where the tie-break scan starts
        self._dropped = 0

    def _gpu_window(self, gpu_index: int, t_s: float) -> _GpuWindow:
        """The window of GPU ``gpu_index`` holding ``t_s`` (clamped to 0 or later)."""
        k = max(0, math.floor(t_s / self.window_s))
        window = self._windows.get(k)  # built windows never change: no lock needed to read
        if window is None:
            with self._lock:
                window = self._windows.get(k)
                if window is None:
                    if k < self._next_window:  # evicted: replay again from the start
                        self._reset()
                    while self._next_window <= k:
                        self._simulate_window(
                            self._next_window, keep=k - self._next_window < self.keep_windows
                        )
                    window = self._windows[k]
        return window[gpu_index]

    def _simulate_window(self, k: int, *, keep: bool) -> None:
        start_s, end_s = k * self.window_s, (k + 1) * self.window_s
        for t_s, i in self._arrivals(k):
            self._route(t_s, self.trace.context_tokens[i], self.trace.generated_tokens[i])
        built = [self._build(g, start_s, end_s) for g in range(self.gpus)]
        self._next_window = k + 1
        if keep:
            self._windows[k] = built
            while len(self._windows) > self.keep_windows:
                del self._windows[min(self._windows)]

    def _position(self, t_s: float) -> float:
        """Unwrapped trace time at replay time ``t_s``."""
        return self.offset_s + t_s * self.speedup

    def _arrivals(self, k: int) -> list[tuple[float, int]]:
        """(replay time, trace index) of every request arriving in window ``k``, in order."""
        lo_u = self._position(k * self.window_s)
        hi_u = self._position((k + 1) * self.window_s)
        copies = math.ceil(self.scale)
        jitter_s = self.jitter_s if copies > 1 else 0.0
        arrivals_s, n, period_s = self.trace.arrivals_s, len(self.trace), self.period_s
        seed = mix64(self.seed & MASK64)
        out: list[tuple[float, int]] = []
        first_lap = max(0, math.floor((lo_u - jitter_s) / period_s))
        for lap in range(first_lap, math.floor(hi_u / period_s) + 1):
            base_u = lap * period_s
            first = bisect.bisect_left(arrivals_s, lo_u - jitter_s - base_u)
            last = bisect.bisect_left(arrivals_s, hi_u - base_u)
            for i in range(first, last):
                for copy in range(copies):
                    h = mix64(seed ^ mix64(((lap * n + i) * 64 + copy) & MASK64))
                    if self.scale - copy < 1.0 and (h >> 32) / 2.0**32 >= self.scale - copy:
                        continue  # thinned
                    u = base_u + arrivals_s[i]
                    if copy:
                        u += jitter_s * (h & 0xFFFFFFFF) / 2.0**32
                    if lo_u <= u < hi_u:
                        out.append(((u - self.offset_s) / self.speedup, i))
        out.sort()
        return out

    def _route(self, t_s: float, context_tokens: int, generated_tokens: int) -> None:
        """Send one request to the GPU with the fewest outstanding requests."""
        finishing, outstanding = self._finishing, self._outstanding
        while finishing and finishing[0][0] <= t_s:
            outstanding[heapq.heappop(finishing)[1]] -= 1
        fewest = min(outstanding)
        try:  # rotate among the least loaded GPUs, so none is everybody's favourite
            g = outstanding.index(fewest, self._next_gpu)
        except ValueError:
            g = outstanding.index(fewest)
        self._next_gpu = g + 1
        m = self.serving
        start_s = max(t_s, self._prefill_free_s[g])
        if start_s - t_s > self.max_wait_s:
            self._dropped += 1  # the client gave up; this also bounds an overloaded queue
            return
        prefill_end_s = start_s + context_tokens / m.prefill_tokens_per_s
        decode_end_s = prefill_end_s + generated_tokens * m.decode_s_per_token
        self._prefill_free_s[g] = prefill_end_s
        outstanding[g] += 1
        heapq.heappush(finishing, (decode_end_s, g))
        self._open[g].append(
            _Request(start_s, prefill_end_s, decode_end_s, context_tokens, generated_tokens)
        )

    def _build(self, g: int, start_s: float, end_s: float) -> _GpuWindow:
        """GPU ``g``'s timeline over one window; forget the requests that end in it."""
        events: list[tuple[float, int, int]] = []  # (time, prefill delta, decode delta)
        done_reqs: list[_Request] = []
        still_open: list[_Request] = []
        for r in self._open[g]:
            events.append((r.prefill_start_s, 1, 0))
            events.append((r.prefill_end_s, -1, 1))
            events.append((r.decode_end_s, 0, -1))
            (done_reqs if r.decode_end_s < end_s else still_open).append(r)
        self._open[g] = still_open
        events.sort()
        utilization = self.serving.utilization
        prefills = decodes = 0
        i = 0
        while i < len(events) and events[i][0] <= start_s:
            prefills += events[i][1]
            decodes += events[i][2]
            i += 1
        times_s, utils = [start_s], [utilization(prefills, decodes)]
        while i < len(events) and events[i][0] < end_s:
            t_s = events[i][0]
            while i < len(events) and events[i][0] == t_s:
                prefills += events[i][1]
                decodes += events[i][2]
                i += 1
            util = utilization(prefills, decodes)
            if util != utils[-1]:
                times_s.append(t_s)
                utils.append(util)
        done_before = self._served[g]
        done_reqs.sort(key=lambda r: r.decode_end_s)
        done_s, done = [], []
        requests, context, generated = done_before
        for r in done_reqs:
            requests, context = requests + 1, context + r.context_tokens
            generated += r.generated_tokens
            done_s.append(max(start_s, r.decode_end_s))
            done.append(WorkDone(requests, context, generated))
        self._served[g] = WorkDone(requests, context, generated)
        return _GpuWindow(start_s, end_s, times_s, utils, done_s, done, done_before)


class TraceLoad:
    """``LoadProfile`` of one GPU of a ``TraceReplay``; ``stream`` is not needed.

    Remembers its current window, so most calls are one bisection in a short list.
    """

    __slots__ = ("_current", "gpu_index", "replay")

    def __init__(self, replay: TraceReplay, gpu_index: int) -> None:
        """Bind GPU ``gpu_index`` of ``replay``; use ``TraceReplay.profile`` instead."""
        self.replay = replay
        self.gpu_index = gpu_index
        self._current: _GpuWindow | None = None

    def __repr__(self) -> str:
        """Name the GPU and the replay parameters."""
        r = self.replay
        return (
            f"TraceLoad(gpu={self.gpu_index}/{r.gpus}, trace={r.trace.source!r}, "
            f"speedup={r.speedup}, scale={r.scale}, seed={r.seed})"
        )

    def utilization(self, t_s: float, stream: int) -> float:
        """Return the utilization at replay time ``t_s`` (seconds since the replay began)."""
        w = self._current
        if w is None or not w.start_s <= t_s < w.end_s:
            t_s = max(0.0, t_s)  # nothing happens before the replay starts
            w = self._current = self.replay._gpu_window(self.gpu_index, t_s)
        return w.utils[bisect.bisect_right(w.times_s, t_s) - 1]


def trace_loads(count_gpus: int, *, node_offset: int, replay: TraceReplay) -> list[LoadProfile]:
    """Profiles for node ``node_offset`` of a row of ``count_gpus``-GPU nodes.

    GPU ``j`` of node ``n`` is GPU ``n * count_gpus + j`` of ``replay``, so that every node
    of the row shares one replay and the row's power follows the trace's arrivals.
    """
    first = node_offset * count_gpus
    if count_gpus < 1 or node_offset < 0 or first + count_gpus > replay.gpus:
        msg = f"node {node_offset} of {count_gpus} GPUs does not fit a replay of {replay.gpus} GPUs"
        raise ValueError(msg)
    return [replay.profile(first + j) for j in range(count_gpus)]


__all__ = ["TraceLoad", "TraceReplay", "WorkDone", "trace_loads"]
