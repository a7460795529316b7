"""Checks on a number read from a device (PDU, CDU, BMC), shared by every protocol's reader.

A value from SNMP, Redfish or Modbus is untrusted: ``checked_power_w`` turns it into a
power in watts or raises ``polca.errors.ReadingRejectedError`` with the drop reason, so each
protocol's reader refuses the same things the same way. ``EquipmentState`` is what a
device says of a feed it carries (a circuit's breaker, a UPS's output), in every protocol.
"""

from __future__ import annotations

import math
from typing import Literal

from polca.errors import ReadingRejectedError

__all__ = ["MAX_SOURCE_POWER_W", "EquipmentState", "checked_number", "checked_power_w"]

EquipmentState = Literal["up", "down", "unknown"]
"""Whether a feed carries power, by its equipment's own word (unknown: it does not say)."""

MAX_SOURCE_POWER_W = 2_000_000.0
"""The most one source may report (2 MW: a whole row's switchboard, not a rack PDU's
~50 kW); anything above is absurd and rejected (reason ``absurd``)."""


def checked_number(value: object, *, what: str, low: float, high: float) -> float:
    """``value`` as a float within ``[low, high]``, or ``ReadingRejectedError``.

    Accepts ints and floats (not bools); refuses other types (``type``), NaN and
    infinities (``nan``), values below zero when ``low`` is zero (``negative``) and other
    values out of range (``absurd``). ``what`` names the value in the message.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"{what} is not a number: {type(value).__name__}"
        raise ReadingRejectedError(msg, reason="type")
    number = float(value)
    if not math.isfinite(number):
        msg = f"{what} is not finite: {number}"
        raise ReadingRejectedError(msg, reason="nan")
    if number < low:
        reason = "negative" if number < 0 <= low else "absurd"
        msg = f"{what} is below {low:g}: {number:g}"
        raise ReadingRejectedError(msg, reason=reason)
    if number > high:
        msg = f"{what} is absurd: {number:g} (more than {high:g})"
        raise ReadingRejectedError(msg, reason="absurd")
    return number


def checked_power_w(value: object, *, what: str) -> float:
    """``value`` as a power in W within ``[0, MAX_SOURCE_POWER_W]``, or ``ReadingRejectedError``."""
    return checked_number(value, what=what, low=0.0, high=MAX_SOURCE_POWER_W)
