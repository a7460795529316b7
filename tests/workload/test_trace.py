"""Request traces: parsing, bounds on a hostile file, fuzzed rows, the bundled trace."""

from __future__ import annotations

import math
from importlib import resources
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.errors import ConfigError
from polca.workload.trace import (
    BUNDLED_TRACE,
    MAX_SPAN_S,
    MAX_TOKENS,
    MAX_TRACE_BYTES,
    Trace,
    TraceError,
)
from tests.fuzzing import FUZZ, mutated
from tests.workload.conftest import HEADER


def test_bundled_trace_is_the_whole_azure_code_trace(bundled: Trace) -> None:
    """The bundled CSV parses into all 8,819 requests of the 57-minute trace, in order."""
    assert len(bundled) == 8819
    assert bundled.duration_s == pytest.approx(3435.948056, abs=1e-6)
    assert bundled.mean_rate_per_s == pytest.approx(2.567, abs=1e-3)
    assert bundled.arrivals_s[0] == 0.0
    assert all(a <= b for a, b in pairwise(bundled.arrivals_s))
    assert sum(bundled.context_tokens) == 18_059_974
    assert sum(bundled.generated_tokens) == 245_896


def test_bundled_trace_ships_with_its_attribution() -> None:
    """ATTRIBUTION.md sits beside the trace, naming the licence, source and citation."""
    data = resources.files("polca").joinpath("data")
    assert data.joinpath(BUNDLED_TRACE).is_file()
    text = data.joinpath("ATTRIBUTION.md").read_text(encoding="utf-8")
    for needle in (BUNDLED_TRACE, "CC BY 4.0", "AzurePublicDataset", "Splitwise", "ISCA 2024"):
        assert needle in text


def test_timestamps_and_columns_are_parsed_robustly() -> None:
    """Columns in any order and case, T or space, 0-9+ fraction digits, blanks, unsorted."""
    lines = [
        "\ufeffgeneratedtokens, TIMESTAMP ,contexttokens",
        "5,2023-11-16 18:15:47.5000000,10",
        "",
        "6,2023-11-16T18:15:46,20",
        "7,2023-11-16 18:15:46.25,30",
        "8,2023-11-16 18:16:46.1234567891,40",
    ]
    trace = Trace.parse(lines)
    assert list(trace.arrivals_s) == pytest.approx([0.0, 0.25, 1.5, 60.1234567891 - 0.0], abs=1e-9)
    assert list(trace.context_tokens) == [20, 30, 10, 40]
    assert list(trace.generated_tokens) == [6, 7, 5, 8]


@pytest.mark.parametrize(
    ("content", "line", "fragment"),
    [
        (f"{HEADER}\n2023-11-16 18:00:00,1,2\n2023-11-16 18:00:0x,1,2\n", 3, "bad timestamp"),
        (f"{HEADER}\n2023-02-30 18:00:00,1,2\n", 2, "bad date"),
        (f"{HEADER}\n2023-11-16 25:00:00,1,2\n", 2, "bad time of day"),
        (f"{HEADER}\n\n2023-11-16 18:00:00,-1,2\n", 3, "must not be negative"),
        (f"{HEADER}\n2023-11-16 18:00:00,1,2.5\n", 2, "whole number"),
        (f"{HEADER}\n2023-11-16 18:00:00,1\n", 2, "expected 3 fields"),
        ("TIMESTAMP,Prompt,GeneratedTokens\n2023-11-16 18:00:00,1,2\n", 1, "lacks one of"),
        (f"{HEADER}\n", 1, "no requests"),
        ("\n\n", 1, "empty trace"),
    ],
)
def test_malformed_trace_names_file_and_line(
    tmp_path: Path, content: str, line: int, fragment: str
) -> None:
    """Each malformed input raises TraceError (a ConfigError) starting with FILE:LINE:."""
    path = tmp_path / "bad.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(TraceError, match=fragment) as info:
        Trace.load(path)
    assert str(info.value).startswith(f"{path}:{line}: ")
    assert isinstance(info.value, ConfigError)


def test_unreadable_trace_is_a_trace_error(tmp_path: Path) -> None:
    """A missing file and a binary file are TraceErrors naming the path."""
    with pytest.raises(TraceError, match="cannot read"):
        Trace.load(tmp_path / "missing.csv")
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="not UTF-8"):
        Trace.load(binary)


BUNDLED_HEAD = (
    resources.files("polca")
    .joinpath("data", BUNDLED_TRACE)
    .read_text(encoding="utf-8")
    .splitlines(keepends=True)[:40]
)
"""The header and first 39 requests of the bundled trace: the fuzz seed."""

TRACE_VALUES: tuple[str, ...] = (
    "",
    " ",
    '"',
    '"4808"',
    '"48,08"',
    "-1",
    "+5",
    "1_000",
    "1e3",
    "\u0663",  # ARABIC-INDIC DIGIT THREE: int() takes it, a trace must not
    "99999999999999999999",
    "9" * 5000,
    "NaN",
    "inf",
    "2023-02-30 18:17:03",
    "2023-11-16 24:00:00",
    "2023-11-16 18:17:03.",
    "2023-11-16 18:17:03.\u0663",
    "0001-01-01 00:00:00",
    "9999-12-31 23:59:59.999999999",
    "2023-11-16T18:17:03Z",
    "\x00",
    "x" * 5000,
)


@st.composite
def mutated_trace(draw: st.DrawFn) -> list[str]:
    """The bundled rows after one to four row-level or character-level mutations."""
    lines = list(BUNDLED_HEAD)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(("field", "field", "split", "join", "drop", "dup", "chars")))
        fields = lines[i].rstrip("\r\n").split(",")
        if op == "field":
            fields[draw(st.integers(0, len(fields) - 1))] = draw(st.sampled_from(TRACE_VALUES))
            lines[i] = ",".join(fields) + "\n"
        elif op == "split":
            lines[i] = ",".join(fields[:-1]) + "\n"
        elif op == "join":
            lines[i] = ",".join([*fields, draw(st.sampled_from(TRACE_VALUES))]) + "\n"
        elif op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        else:
            lines[i] = draw(mutated(lines[i], tokens=TRACE_VALUES, values=TRACE_VALUES))
        if not lines:
            break
    return lines


@FUZZ
@given(lines=mutated_trace())
def test_fuzz_mutated_trace_rows_only_raise_trace_error(
    lines: list[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Mutated rows give a valid trace or a TraceError naming FILE:LINE, nothing else."""
    path = tmp_path_factory.getbasetemp() / "fuzz.csv"
    path.write_bytes("".join(lines).encode("utf-8", "surrogatepass"))
    try:
        trace = Trace.load(path)
    except TraceError as exc:
        error = str(exc)
    else:
        assert all(a <= b for a, b in pairwise(trace.arrivals_s))
        assert trace.arrivals_s[0] == 0.0
        assert all(math.isfinite(a) and 0 <= a <= MAX_SPAN_S for a in trace.arrivals_s)
        assert all(0 <= t <= MAX_TOKENS for t in trace.context_tokens)
        assert all(0 <= t <= MAX_TOKENS for t in trace.generated_tokens)
        assert len(trace) <= len(lines)
        return
    assert error.startswith(f"{path}:")
    assert error.split(":")[1].strip().isdigit() or "cannot read" in error


def test_fuzz_seed_parses_as_the_bundled_prefix(bundled: Trace) -> None:
    """The unmutated seed decodes to the first 39 requests of the bundled trace."""
    head = Trace.parse(BUNDLED_HEAD, source="head.csv")
    assert list(head.arrivals_s) == list(bundled.arrivals_s[:39])
    assert list(head.context_tokens) == list(bundled.context_tokens[:39])


@pytest.mark.parametrize(
    ("content", "line", "fragment"),
    [
        (f"{HEADER}\n2023-11-16 18:00:00,1,{'1' * 3000}\n", 2, "whole number"),
        (f"{HEADER}\n2023-11-16 18:00:00,\u0663,1\n", 2, "whole number"),
        (f"{HEADER}\n2023-11-16 18:00:00,1_000,1\n", 2, "whole number"),
        (f"{HEADER}\n2023-11-16 18:00:00,20000000,1\n", 2, "more than 10000000 tokens"),
        (f"{HEADER}\n\u0662\u0660\u0662\u0663-11-16 18:00:00,1,1\n", 2, "bad timestamp"),
        (f"{HEADER}\n2023-11-16 18:00:00,1,1\n2025-11-16 18:00:00,1,1\n", 3, "366 days"),
        (f"{HEADER}\n2023-11-16 18:00:00,1,{'x' * 5000}\n", 2, "longer than 4096 bytes"),
        (f'{HEADER}\n"2023-11-16 18:00:00,1,1\n2023-11-16 18:00:01,1,1\n', 2, "malformed CSV"),
        (f"{HEADER}\n2023-11-16 18:00:00,1\x00,1\n", 2, "whole number"),
        (f"{HEADER}\n0001-01-01 00:00:00,1,1\n9999-12-31 23:59:59,1,1\n", 3, "366 days"),
    ],
)
def test_hostile_trace_rows_are_bounded(
    tmp_path: Path, content: str, line: int, fragment: str
) -> None:
    """Huge or non-ASCII numbers, long lines, open quotes and absurd spans name their line."""
    path = tmp_path / "hostile.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(TraceError, match=fragment) as info:
        Trace.load(path)
    assert str(info.value).startswith(f"{path}:{line}: ")


def test_trace_size_and_request_count_are_bounded(tmp_path: Path) -> None:
    """A file over MAX_TRACE_BYTES is refused unread; a row count over the bound names it."""
    big = tmp_path / "big.csv"
    with big.open("wb") as f:
        f.truncate(MAX_TRACE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(TraceError, match=f"at most {MAX_TRACE_BYTES} are read"):
        Trace.load(big)
    rows = [HEADER, *(f"2023-11-16 18:00:0{i},1,1" for i in range(4))]
    with pytest.raises(TraceError, match=r"^many\.csv:5: more than 3 requests"):
        Trace.parse(rows, source="many.csv", max_requests=3)


def test_undecodable_bytes_name_their_line(tmp_path: Path) -> None:
    """A byte that is not UTF-8 on line 3 is reported at line 3."""
    path = tmp_path / "latin1.csv"
    path.write_bytes(
        f"{HEADER}\n2023-11-16 18:00:00,1,1\n2023-11-16 18:00:01,\xe9,1\n".encode("latin-1")
    )
    with pytest.raises(TraceError, match=r":3: the request trace is not UTF-8"):
        Trace.load(path)
