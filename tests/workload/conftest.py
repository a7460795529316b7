"""Fixtures of the workload tests: the bundled trace and small synthetic traces."""

from __future__ import annotations

import pytest

from polca.workload.trace import Trace

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


@pytest.fixture(scope="module")
def bundled() -> Trace:
    """The bundled Azure trace, parsed once for the module."""
    return Trace.load()


def make_trace(*rows: tuple[float, int, int]) -> Trace:
    """A trace of ``(arrival_s, context, generated)`` rows starting 2023-11-16 18:00:00."""
    lines = [HEADER]
    for arrival_s, context, generated in rows:
        minutes, seconds = divmod(arrival_s, 60.0)
        lines.append(f"2023-11-16 18:{int(minutes):02d}:{seconds:010.7f},{context},{generated}")
    return Trace.parse(lines, source="synthetic.csv")
