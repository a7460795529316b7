"""LLM inference request traces: the hostile CSV file turned into arrivals and token counts.

``polca demo`` and ``polca simulate`` drive their GPUs with real traffic, with its quiet
minutes and bursts; this module reads it. ``Trace.load()`` parses a request trace (arrival
time, prompt tokens, output tokens; by default the bundled Azure LLM inference trace, see
``polca/data/ATTRIBUTION.md``) into arrival offsets and token counts (stdlib arrays).

The file is hostile until parsed: its size (``MAX_TRACE_BYTES``), each line's length
(``MAX_LINE_CHARS``, quoted fields may not span lines), the number of requests
(``MAX_REQUESTS``), each token count (ASCII digits, at most ``MAX_TOKENS``) and the trace's
span (``MAX_SPAN_S``) are bounded, and timestamps must be real dates and times. Every
problem is a ``TraceError`` starting ``FILE:LINE:`` (or ``FILE:`` for the file as a whole);
nothing else escapes.

What a trace does to GPUs is elsewhere: ``polca.workload.replay`` serves it on a row of
simulated GPUs, ``polca.sim.workload`` turns it into the simulator's requests. Reading the
file is the only I/O here.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import re
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import date
from importlib import resources
from pathlib import Path
from typing import BinaryIO

from polca.errors import TraceError

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


def _read_lines(
    f: BinaryIO, source: str, *, what: str = "request trace", max_bytes: int = MAX_TRACE_BYTES
) -> Iterator[str]:
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
        if total > max_bytes:  # a file that grows while read, or lies about its size
            msg = f"{source}:{line_no}: the {what} is larger than {max_bytes} bytes"
            raise TraceError(msg)
        if len(raw) > MAX_LINE_CHARS:
            msg = f"{source}:{line_no}: line longer than {MAX_LINE_CHARS} bytes"
            raise TraceError(msg)
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            msg = f"{source}:{line_no}: the {what} is not UTF-8 text: {exc.reason}"
            raise TraceError(msg) from exc


def csv_rows(path: Path, *, what: str, max_bytes: int) -> Iterator[tuple[list[str], int]]:
    """Each line's CSV fields and 1-based number, of the file at ``path`` read bounded
    (``max_bytes``, ``MAX_LINE_CHARS`` a line, UTF-8 line by line): the trace's reader, for
    other CSV inputs (a row's power history). Every problem is a ``TraceError`` naming
    ``FILE:LINE``; a file that cannot be opened is ``OSError``."""
    with path.open("rb") as f:
        yield from _bounded(_read_lines(f, str(path), what=what, max_bytes=max_bytes), str(path))


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


__all__ = [
    "BUNDLED_TRACE",
    "COLUMNS",
    "MAX_LINE_CHARS",
    "MAX_REQUESTS",
    "MAX_SPAN_S",
    "MAX_TOKENS",
    "MAX_TRACE_BYTES",
    "Trace",
    "TraceError",
]
