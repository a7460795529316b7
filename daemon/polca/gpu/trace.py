"""LLM-inference load replayed from a real request trace, for a whole row of simulated GPUs.

``polca demo`` runs dozens of simulated 8-GPU nodes in one process. Their power has to follow
real traffic, with its quiet minutes and bursts, or the row controller has nothing to show.
This module turns a request trace (arrival time, prompt tokens, output tokens; by default the
bundled Azure LLM inference trace, see ``polca/data/ATTRIBUTION.md``) into one
``LoadProfile`` per GPU of the row:

- ``Trace.load()`` parses the CSV into arrival offsets and token counts (stdlib arrays).
  The file is hostile until parsed: its size (``MAX_TRACE_BYTES``), each line's length
  (``MAX_LINE_CHARS``, quoted fields may not span lines), the number of requests
  (``MAX_REQUESTS``), each token count (ASCII digits, at most ``MAX_TOKENS``) and the
  trace's span (``MAX_SPAN_S``) are bounded, and timestamps must be real dates and times.
  Every problem is a ``TraceError`` starting ``FILE:LINE:`` (or ``FILE:`` for the file as a
  whole); nothing else escapes.
- ``TraceReplay`` routes every request to the least-loaded GPU of the row and serves it as a
  prefill phase (compute-bound, near-full utilization, serialized per GPU) followed by a
  decode phase (memory-bound; several decodes batch together and utilization grows with the
  batch: ``min(1, base + per_request * active)``). Between requests a GPU holding a model
  sits at a small resident utilization. ``scale`` replays each request several times (with a
  seeded jitter) or thins the trace, ``speedup`` compresses arrival times (not service
  times), and the trace repeats when it ends.
- ``TraceReplay.profile(i)`` / ``trace_loads(...)`` give the per-GPU profiles that
  ``SimulatedBackend.set_load`` takes. Utilization is answered from a precomputed per-GPU
  piecewise-constant timeline, computed window by window (``window_s``) as simulated time
  advances; only the last ``keep_windows`` windows stay in memory, so a long run stays
  bounded. Asking for a window older than those restarts the simulation from the beginning
  (deterministic, but slow); the demo only moves forward.

Serving constants (``SERVING_MODELS``) are assumptions [U], derived from datasheet figures
for one replica of a 13B-parameter FP16 model per GPU (26 GB of weights):

- decode is memory-bound: one pass over the weights per token, 26 GB / 3.35 TB/s (H100 SXM)
  ~ 8 ms, 26 GB / 2.04 TB/s (A100 80GB SXM) ~ 13 ms, 26 GB / 4.8 TB/s (H200) ~ 5.5 ms, plus
  scheduling and attention overheads: 12, 20 and 9 ms per token;
- prefill is compute-bound: 2 x 13e9 FLOP per token; at ~35-40 % of the dense BF16 peak
  (989 TFLOP/s H100/H200, 312 TFLOP/s A100) that is ~13,000 and ~5,000 tokens/s;
- decode utilization ``0.45 + 0.08 x active decodes`` and a prefill at 100 % follow the
  simulator recipe in ``polca-paper.md`` §4.2 (decode ~0.45-0.65 x TDP, prefill ~1 x TDP);
- a resident model idles at 7 % utilization, which the simulated backend turns into ~118 W
  on H100 and ~81 W on A100 (measured 121.7 W and 80 W, ``polca-paper.md`` §4.1).

The clock's effect on power is the simulated backend's business; this module only provides
utilization, so capping a GPU does not slow its requests down here. Pure and deterministic:
the same trace, parameters and seed give the same timelines, whatever the order of queries.
Apart from ``Trace.load`` reading its file, no I/O; a lock makes one replay safe to share
between the worker threads of several simulated nodes.
"""

from __future__ import annotations

import bisect
import csv
import heapq
import io
import itertools
import math
import re
import threading
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import date
from importlib import resources
from pathlib import Path
from typing import BinaryIO, NamedTuple

from polca.errors import ConfigError
from polca.gpu.loads import MASK64, LoadProfile, mix64

BUNDLED_TRACE = "azure_llm_inference_code_2023.csv"  # in polca/data/, with ATTRIBUTION.md
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

# 2023-11-16 18:15:46.6805900: date, space or T, time, optional fraction (ns precision kept).
_TIMESTAMP = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[ T]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:[.,]([0-9]+))?"
)
_TOKENS = re.compile(r"-?[0-9]{1,12}")

MAX_TRACE_BYTES = 256 * 1024 * 1024
"""Largest trace file read (the bundled one is 0.3 MB; a week of Azure traffic fits)."""
MAX_LINE_CHARS = 4096
"""Longest line, its line ending included (a request row is about 40)."""
MAX_REQUESTS = 5_000_000
"""Most requests in one trace (three 8-byte numbers each in memory)."""
MAX_TOKENS = 10_000_000
"""Most prompt or output tokens of one request (well above any model's context window)."""
MAX_SPAN_S = 366 * 86_400.0
"""Longest time from a trace's first request to its last: a year."""


class TraceError(ConfigError):
    """A trace file cannot be used; the message starts with ``FILE:LINE:``."""


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    """Requests of an inference service: arrival offsets and token counts, by arrival."""

    source: str  # file name, for messages
    arrivals_s: array[float]  # seconds since the first request, non-decreasing
    context_tokens: array[int]  # prompt length of each request
    generated_tokens: array[int]  # output length of each request

    def __len__(self) -> int:
        """Return the number of requests."""
        return len(self.arrivals_s)

    @property
    def duration_s(self) -> float:
        """Seconds from the first to the last arrival."""
        return self.arrivals_s[-1]

    @property
    def mean_rate_per_s(self) -> float:
        """Mean arrival rate over the trace, requests per second."""
        return len(self) / self.duration_s if self.duration_s > 0 else math.inf

    @classmethod
    def load(cls, path: str | Path | None = None) -> Trace:
        """Read a trace CSV; ``None`` reads the bundled Azure code-completion trace."""
        if path is None:
            resource = resources.files("polca").joinpath("data", BUNDLED_TRACE)
            text = resource.read_text(encoding="utf-8")
            return cls.parse(io.StringIO(text), source=f"polca/data/{BUNDLED_TRACE}")
        try:
            with Path(path).open("rb") as f:
                size = Path(path).stat().st_size
                if size > MAX_TRACE_BYTES:
                    msg = f"{path}: the trace is {size} bytes; at most {MAX_TRACE_BYTES} are read"
                    raise TraceError(msg)
                return cls.parse(_read_lines(f, str(path)), source=str(path))
        except OSError as exc:
            msg = f"{path}: cannot read the request trace: {exc}"
            raise TraceError(msg) from exc

    @classmethod
    def parse(
        cls, lines: Iterable[str], *, source: str = "<trace>", max_requests: int = MAX_REQUESTS
    ) -> Trace:
        """Parse CSV lines with a header naming ``COLUMNS`` (any order and case).

        Blank lines are skipped and rows are sorted by arrival (stable), so merged traces
        work. A malformed or out-of-bounds row raises ``TraceError`` naming ``source:line``;
        so does anything beyond the module's bounds (line length, request count, span).
        """
        numbered = _bounded(lines, source)
        header, line = next(((r, n) for r, n in numbered if any(c.strip() for c in r)), ([], 0))
        if not header:
            msg = f"{source}:{max(line, 1)}: empty trace; expected a header {','.join(COLUMNS)}"
            raise TraceError(msg)
        names = [cell.strip().lstrip("\ufeff").lower() for cell in header]
        try:
            cols = [names.index(name.lower()) for name in COLUMNS]
        except ValueError as exc:
            msg = f"{source}:{line}: header {header[:8]} lacks one of {list(COLUMNS)}"
            raise TraceError(msg) from exc
        # Offsets from the first row's timestamp (ns since year 1 overflow 64 bits; the
        # span bound keeps the offsets within them).
        stamps_ns: array[int] = array("q")
        context_tokens: array[int] = array("q")
        generated_tokens: array[int] = array("q")
        base_ns = first_ns = last_ns = None
        for row, line in numbered:
            if not any(cell.strip() for cell in row):
                continue
            where = f"{source}:{line}"
            if len(row) != len(header):
                msg = f"{where}: expected {len(header)} fields, got {len(row)}: {row[:8]}"
                raise TraceError(msg)
            if len(stamps_ns) >= max_requests:
                msg = f"{where}: more than {max_requests} requests"
                raise TraceError(msg)
            stamp, context, generated = (row[i].strip() for i in cols)
            stamp_ns = _parse_timestamp_ns(stamp, where)
            base_ns = stamp_ns if base_ns is None else base_ns
            first_ns = stamp_ns if first_ns is None else min(first_ns, stamp_ns)
            last_ns = stamp_ns if last_ns is None else max(last_ns, stamp_ns)
            if (last_ns - first_ns) / 1e9 > MAX_SPAN_S:
                msg = (
                    f"{where}: timestamp {stamp} is more than {MAX_SPAN_S / 86_400:g} days "
                    "from the trace's other requests"
                )
                raise TraceError(msg)
            stamps_ns.append(stamp_ns - base_ns)
            context_tokens.append(_parse_tokens(context, where, COLUMNS[1]))
            generated_tokens.append(_parse_tokens(generated, where, COLUMNS[2]))
        if base_ns is None or first_ns is None:
            msg = f"{source}:{line}: the trace has a header but no requests"
            raise TraceError(msg)
        start_ns = first_ns - base_ns
        if any(a > b for a, b in itertools.pairwise(stamps_ns)):
            order = sorted(range(len(stamps_ns)), key=stamps_ns.__getitem__)  # stable
            stamps_ns = array("q", (stamps_ns[i] for i in order))
            context_tokens = array("q", (context_tokens[i] for i in order))
            generated_tokens = array("q", (generated_tokens[i] for i in order))
        return cls(
            source=source,
            arrivals_s=array("d", ((t - start_ns) / 1e9 for t in stamps_ns)),
            context_tokens=context_tokens,
            generated_tokens=generated_tokens,
        )


def _read_lines(f: BinaryIO, source: str) -> Iterator[str]:
    """The lines of a file, each read bounded and decoded alone, so that a byte that is not
    UTF-8 names its line (a text-mode file decodes whole chunks ahead)."""
    line_no = 0
    total = 0
    while True:
        line_no += 1
        raw = f.readline(MAX_LINE_CHARS + 1)
        if not raw:
            return
        total += len(raw)
        if total > MAX_TRACE_BYTES:  # a file that grows while read, or lies about its size
            msg = f"{source}:{line_no}: the trace is larger than {MAX_TRACE_BYTES} bytes"
            raise TraceError(msg)
        if len(raw) > MAX_LINE_CHARS:
            msg = f"{source}:{line_no}: line longer than {MAX_LINE_CHARS} bytes"
            raise TraceError(msg)
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            msg = f"{source}:{line_no}: the request trace is not UTF-8 text: {exc.reason}"
            raise TraceError(msg) from exc


def _bounded(lines: Iterable[str], source: str) -> Iterator[tuple[list[str], int]]:
    """Each line's CSV fields and 1-based number; too long a line is a ``TraceError``.

    One physical line is one record: a quote left open does not swallow the lines after it.
    """
    for line_no, line in enumerate(lines, start=1):
        if len(line) > MAX_LINE_CHARS:
            msg = f"{source}:{line_no}: line longer than {MAX_LINE_CHARS} characters"
            raise TraceError(msg)
        text = line.rstrip("\r\n")
        if '"' not in text:
            yield text.split(","), line_no
            continue
        try:
            rows = list(csv.reader([text], strict=True))
        except csv.Error as exc:
            msg = f"{source}:{line_no}: malformed CSV: {exc}"
            raise TraceError(msg) from exc
        yield (rows[0] if rows else []), line_no


def _parse_timestamp_ns(text: str, where: str) -> int:
    """Nanoseconds since 0001-01-01 of a ``YYYY-MM-DD HH:MM:SS[.fraction]`` timestamp."""
    match = _TIMESTAMP.fullmatch(text)
    if match is None:
        msg = f"{where}: bad timestamp {text[:40]!r}; expected YYYY-MM-DD HH:MM:SS[.fraction]"
        raise TraceError(msg)
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    try:
        days = date(year, month, day).toordinal()
    except ValueError as exc:
        msg = f"{where}: bad date in timestamp {text[:40]!r}: {exc}"
        raise TraceError(msg) from exc
    if hour > 23 or minute > 59 or second > 60:
        msg = f"{where}: bad time of day in timestamp {text[:40]!r}"
        raise TraceError(msg)
    fraction_ns = int((match.group(7) or "0")[:9].ljust(9, "0"))
    return ((days * 24 + hour) * 60 + minute) * 60_000_000_000 + second * 10**9 + fraction_ns


def _parse_tokens(text: str, where: str, column: str) -> int:
    if not _TOKENS.fullmatch(text):
        msg = f"{where}: {column} must be a whole number of tokens, got {text[:40]!r}"
        raise TraceError(msg)
    tokens = int(text)
    if tokens < 0:
        msg = f"{where}: {column} must not be negative, got {tokens}"
        raise TraceError(msg)
    if tokens > MAX_TOKENS:
        msg = f"{where}: {column} of {tokens} is more than {MAX_TOKENS} tokens"
        raise TraceError(msg)
    return tokens


@dataclass(frozen=True, slots=True)
class ServingModel:
    """How fast one GPU serves requests and how busy it looks meanwhile (module docstring)."""

    name: str
    prefill_tokens_per_s: float  # prompt tokens per second, one prefill at a time
    decode_s_per_token: float  # time between output tokens, independent of the batch
    prefill_util: float = 1.0  # during a prefill (compute-bound)
    decode_util_base: float = 0.45  # decoding one request ...
    decode_util_per_request: float = 0.08  # ... plus this per request in the batch
    resident_util: float = 0.07  # model loaded, nothing to do

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.decode_s_per_token > 0):
            msg = f"{self.name}: prefill and decode speeds must be positive"
            raise ValueError(msg)
        for name in ("prefill_util", "decode_util_base", "decode_util_per_request"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                msg = f"{self.name}: {name} must be within 0..1"
                raise ValueError(msg)
        if not 0.0 <= self.resident_util <= 1.0:
            msg = f"{self.name}: resident_util must be within 0..1"
            raise ValueError(msg)

    def utilization(self, prefills: int, decodes: int) -> float:
        """Utilization with ``prefills`` prefills running and ``decodes`` requests decoding."""
        if prefills > 0:
            return self.prefill_util
        if decodes > 0:
            return min(1.0, self.decode_util_base + self.decode_util_per_request * decodes)
        return self.resident_util


SERVING_MODELS: dict[str, ServingModel] = {
    m.name.lower(): m
    for m in (
        ServingModel("H100-SXM", prefill_tokens_per_s=13_000.0, decode_s_per_token=0.012),
        ServingModel("H200-SXM", prefill_tokens_per_s=13_000.0, decode_s_per_token=0.009),
        ServingModel("A100-SXM4", prefill_tokens_per_s=5_000.0, decode_s_per_token=0.020),
        ServingModel("A100-SXM4-40GB", prefill_tokens_per_s=5_000.0, decode_s_per_token=0.020),
    )
}


def serving_model(name: str | ServingModel) -> ServingModel:
    """Look up a serving preset by GPU model name (as in ``polca.gpu.models``)."""
    if isinstance(name, ServingModel):
        return name
    try:
        return SERVING_MODELS[name.lower()]
    except KeyError as exc:
        known = ", ".join(m.name for m in SERVING_MODELS.values())
        msg = f"no serving preset for GPU model {name!r}; known: {known}"
        raise ValueError(msg) from exc


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


__all__ = [
    "BUNDLED_TRACE",
    "MAX_LINE_CHARS",
    "MAX_REQUESTS",
    "MAX_SPAN_S",
    "MAX_TOKENS",
    "MAX_TRACE_BYTES",
    "SERVING_MODELS",
    "ServingModel",
    "Trace",
    "TraceError",
    "TraceLoad",
    "TraceReplay",
    "WorkDone",
    "serving_model",
    "trace_loads",
]
