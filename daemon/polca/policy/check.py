"""``polca policy check FILE...`` and ``polca policy schema``, written against text streams.

The CLI wires these in; taking ``out``/``err`` streams keeps them testable without a
subprocess.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from polca.errors import PolicyError
from polca.policy.loader import load_policy
from polca.policy.schema import schema_text


def run_check(paths: Sequence[Path], *, out: TextIO, err: TextIO) -> int:
    """Validate each policy file: ``FILE: ok (...)`` to ``out``, problems to ``err``.

    Returns 0 when every file is valid, 1 otherwise (2 when no file was given).
    """
    if not paths:
        err.write("policy check: no policy file given\n")
        return 2
    failed = False
    for path in paths:
        try:
            loaded = load_policy(path)
        except PolicyError as exc:
            failed = True
            for problem in exc.problems or (f"{path}:1:1: {exc}",):
                err.write(f"{problem}\n")
            continue
        policy = loaded.policy
        levels = ", ".join(f"{lvl.name}@{lvl.threshold_pct:g}%" for lvl in policy.levels)
        out.write(
            f"{path}: ok (revision {loaded.revision}, policy {policy.name}, levels {levels})\n"
        )
    return 1 if failed else 0


def run_schema(out: TextIO) -> int:
    """Print the policy JSON Schema; returns 0."""
    out.write(schema_text())
    return 0
