"""CPU-time bounds for the few tests that guard against a catastrophic slowdown (an alias
bomb expanded before it is refused, a simulated day stepped too finely).

Speed itself is shown by the benchmarks in ``bench/``; these bounds only tell "bounded" from
"runaway". They are measured on this process's CPU time (``time.process_time``), which other
load on the machine does not change, and widened when a tracer slows every Python line
(coverage.py, under which ``scripts/test.sh`` runs the suite).
"""

from __future__ import annotations

import sys

TRACED_FACTOR = 3.0
"""How much slower a traced line runs, at most (coverage.py's C tracer, branch mode)."""


def cpu_budget_s(seconds: float) -> float:
    """``seconds`` of CPU time, or ``TRACED_FACTOR`` times that under a tracer."""
    return seconds * (TRACED_FACTOR if sys.gettrace() is not None else 1.0)
