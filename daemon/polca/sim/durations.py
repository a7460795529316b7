"""Durations typed on the command line (``90``, ``90s``, ``15m``, ``2h``, ``1d``).

Apart from ``polca.sim.cli`` so that ``polca.sim.commands`` can read a duration it checks
itself (``--failure-at``, ``--outage-s``: refused in one line) without importing the CLI
module back. Standard library only, like the CLI module.
"""

from __future__ import annotations

import argparse
import re

_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|h|d)?\s*", re.IGNORECASE)
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration_s(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``2h`` or ``1d``."""
    match = _DURATION.fullmatch(text)
    if match is None:
        msg = f"not a duration: {text!r} (use seconds or a number with s, m, h or d)"
        raise argparse.ArgumentTypeError(msg)
    return float(match.group(1)) * _UNIT_S[(match.group(2) or "s").lower()]


__all__ = ["duration_s"]
