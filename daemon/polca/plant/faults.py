"""The faults a simulated CDU can be given, by name, and the ``KIND@START[:END]`` syntax.

Kept apart from the plant model, with only the standard library, so that the ``polca``
command line can offer the fault kinds without importing the model.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Literal, cast, get_args

__all__ = ["FAULT_KINDS", "FaultEvent", "FaultKind", "parse_fault"]

FaultKind = Literal[
    "pump_failure",
    "all_pumps_failure",
    "loss_of_flow",
    "fouling",
    "facility_water_rise",
    "leak",
    "stuck_sensor",
    "drifting_sensor",
    "telemetry_loss",
]
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """A scripted fault: injected ``start_s`` after start, cleared at ``end_s`` if set."""

    kind: FaultKind
    start_s: float
    end_s: float | None = None


def parse_fault(text: str) -> FaultEvent:
    """Parse ``KIND@START[:END]`` (seconds), e.g. ``pump_failure@60:180``.

    Raises ``argparse.ArgumentTypeError`` (a usage error) naming the known kinds.
    """
    match = re.fullmatch(r"([a-z_]+)@([0-9.]+)(?::([0-9.]+))?", text.strip())
    if match is None or match.group(1) not in FAULT_KINDS:
        msg = f"bad fault {text!r}: use KIND@START[:END] with KIND one of {', '.join(FAULT_KINDS)}"
        raise argparse.ArgumentTypeError(msg)
    try:
        start_s = float(match.group(2))
        end_s = float(match.group(3)) if match.group(3) else None
    except ValueError as exc:
        msg = f"bad fault {text!r}: START and END are seconds"
        raise argparse.ArgumentTypeError(msg) from exc
    if end_s is not None and end_s <= start_s:
        msg = f"bad fault {text!r}: END must be after START"
        raise argparse.ArgumentTypeError(msg)
    return FaultEvent(cast("FaultKind", match.group(1)), start_s, end_s)
