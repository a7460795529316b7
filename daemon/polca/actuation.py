"""The one shape of an actuator: a desired target, the write, the read-back, the retry, the outcome.

polca writes to hardware in two places: the agent's GPUs through NVML (``agent/actuator.py``
plans and records, ``agent/driver.py`` carries the writes out on the GPU thread) and a
node's BMC through Redfish (``bmc/actuator.py``). Both follow the same steps, and this
module holds what they share (pure):

1. **desired target**: what should be in force, kept by the actuator (the agent's
   ``Setting`` per GPU, the BMC's latest ``OobTarget`` per node); a newer target replaces
   an older one that is not in force yet;
2. **write**: only what differs from what the actuator knows is in force (nothing to write
   is an outcome too: ``unchanged``);
3. **read back**: every limit written is read again and compared with ``read_back_ok``;
   a device that accepts a write and keeps another value is a failure, not a success;
4. **retry**: a failed write leaves the known state as it was, so the actuator writes
   again (the agent at its next control step, the BMC at its write pace) until the target
   is in force or replaced; nothing but a new target ends the retries, and a failure never
   turns into an uncap;
5. **outcome**: every attempt ends in one value that satisfies ``Outcome`` (the agent's
   ``GpuOutcome``, the BMC's ``OobOutcome``), with the error as ``error_text`` words.

What it must not do: any I/O, read a clock, or know either actuator's types.
"""

from __future__ import annotations

from typing import Final, Protocol, runtime_checkable

from polca.errors import PolcaError

__all__ = ["ERROR_CHARS", "Outcome", "error_text", "read_back_ok"]

ERROR_CHARS: Final = 300
"""The longest error text an outcome carries (a device's answer may be long)."""


@runtime_checkable
class Outcome(Protocol):
    """One attempt to put a target in force, as it ended."""

    @property
    def ok(self) -> bool:
        """The target is in force: written (or nothing to write) and read back as written."""
        ...

    @property
    def error(self) -> str | None:
        """Why not, in ``error_text`` words; None when ``ok``."""
        ...


def error_text(exc: BaseException) -> str:
    """An exception as an outcome's error: polca's own errors by their message, anything
    else (a bug, a library's surprise) by its type too; at most ``ERROR_CHARS``."""
    text = str(exc) if isinstance(exc, PolcaError) else f"unexpected {type(exc).__name__}: {exc}"
    return text[:ERROR_CHARS]


def read_back_ok(written: float, read: float | None, *, tolerance: float = 0.0) -> bool:
    """Whether a limit read back after writing ``written`` is the one written.

    ``read`` None (the device no longer reports one) is not; ``tolerance`` is the device's
    own rounding (a BMC that keeps whole watts), in the same unit, never negative.
    """
    if tolerance < 0:
        msg = f"read-back tolerance must not be negative, not {tolerance}"
        raise ValueError(msg)
    return read is not None and abs(read - written) <= tolerance
