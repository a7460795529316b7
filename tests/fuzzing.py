"""Shared pieces of the decoder fuzz tests: a fixed CI budget and structured mutations.

Every decoder at an edge (YAML, policies, settings, Modbus registers, trace CSV) is fuzzed
with hypothesis under ``FUZZ``: a fixed number of examples, no deadline (CI machines are
slow and shared), derandomised so that a run is reproducible and CI time is stable. The
mutations start from valid inputs, so most examples get deep into a decoder instead of
failing at its first byte: delete, duplicate or swap slices and lines, and insert tokens
that are known to upset parsers (brackets, anchors, tags, huge numbers, odd characters).
"""

from __future__ import annotations

import re

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
"""The budget of every fuzz test: 300 examples, reproducible."""

HOSTILE_TOKENS: tuple[str, ...] = (
    "[",
    "]",
    "{",
    "}",
    ":",
    ": ",
    ",",
    "- ",
    "? ",
    "&a ",
    "*a",
    "&b [*a, *a, *a]",
    "<<: *a",
    "!!int ",
    "!!float ",
    "!!binary ",
    "!!timestamp ",
    "!!set ",
    "!!python/object ",
    "!<tag:yaml.org,2002:str> ",
    "'",
    '"',
    "#",
    "\n",
    "\t",
    "\r",
    "\x00",
    "\x85",
    "\u2028",
    "\ufeff",
    "\ud800",
    "---\n",
    "...\n",
    "%YAML 1.1\n",
    "9" * 50,
    "-" + "9" * 5000,
    "1.0e+999",
    ".nan",
    ".inf",
    "0x",
    "0b",
    "2023-02-30",
    "2023-11-16T25:00:00",
    "1:2:3",
    "null",
    "~",
    "true",
    "NO",
    "\\",
    "[" * 300,
    "{a: " * 80,
    "x" * 70_000,
)
"""Fragments inserted by ``mutated``: YAML and CSV syntax, tags, numbers, characters."""

HOSTILE_VALUES: tuple[str, ...] = (
    "2023-02-30",
    "2023-11-16 25:61:00",
    "!!timestamp 2023-11-16T25:00:00",
    "!!int ''",
    "!!int '-'",
    "!!int 0x",
    "!!int 0b2",
    "!!float ''",
    "!!float x",
    "!!binary '%%%'",
    "!!set {[1]: null}",
    "{[1]: 2}",
    "[[[[[[[[[[]]]]]]]]]]",
    "1" * 41,
    "-" + "9" * 5000,
    "1_000",
    "0o17",
    "1:30:00",
    ".inf",
    "-.Inf",
    ".NaN",
    "1.0e+999",
    "'1883'",
    '"80"',
    "true",
    "yes",
    "off",
    "null",
    "-1",
    "0",
    "1e3",
    "1.5",
    "*a",
    "&a [*a]",
    "&a {<<: *a}",
    "{<<: [1]}",
    "? [a]",
    "x" * 300,
    "'\\ud800'",
    '"\\ud800"',
    '"\\x00"',
)
"""Values put in place of a value by ``mutated``: what YAML turns into odd Python objects."""

# Where a value starts: after "key: ", "- ", "[" or ", " (and up to where it ends).
_VALUE = re.compile(r"(?<=: )|(?<=- )|(?<=\[)|(?<=, )")
_VALUE_END = re.compile(r"[,\]}\n]|$")


@st.composite
def mutated(
    draw: st.DrawFn,
    text: str,
    *,
    tokens: tuple[str, ...] = HOSTILE_TOKENS,
    values: tuple[str, ...] = HOSTILE_VALUES,
) -> str:
    """``text`` after one to four structured mutations: a value replaced by a hostile one,
    a slice deleted or duplicated, a token or a character put in, two lines swapped."""
    for _ in range(draw(st.integers(1, 4))):
        op = draw(
            st.sampled_from(("value", "value", "delete", "insert", "duplicate", "swap", "char"))
        )
        n = len(text)
        i = draw(st.integers(0, n))
        j = draw(st.integers(i, min(n, i + 64)))
        starts = [m.start() for m in _VALUE.finditer(text)] if op == "value" else []
        if starts:
            i = draw(st.sampled_from(starts))
            end = _VALUE_END.search(text, i)
            j = end.start() if end is not None else len(text)
            text = text[:i] + draw(st.sampled_from(values)) + text[j:]
        elif op == "delete":
            text = text[:i] + text[j:]
        elif op == "insert":
            text = text[:i] + draw(st.sampled_from(tokens)) + text[i:]
        elif op == "duplicate":
            text = text[:j] + text[i:j] * draw(st.integers(1, 8)) + text[j:]
        elif op == "char":
            char = draw(st.characters(codec="utf-8", exclude_categories=["Cs"]))
            text = text[:i] + char + text[i + 1 :]
        else:
            lines = text.splitlines(keepends=True)
            if len(lines) > 1:
                a = draw(st.integers(0, len(lines) - 1))
                b = draw(st.integers(0, len(lines) - 1))
                lines[a], lines[b] = lines[b], lines[a]
                text = "".join(lines)
    return text
