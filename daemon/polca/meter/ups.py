"""What a UPS says of its state over SNMP (UPS-MIB, RFC 1628), decoded (pure; no I/O).

A feed behind a UPS is down for what it supplies when the UPS's output is off
(``upsOutputSource`` none), and carried by a battery of limited minutes when it is on
battery: the power tree (``powertree/capacity.py``) then caps the domain at its
``battery_w``. An SNMP source configured ``ups: true`` (``meter/snmp.py``, the pysnmp
importer) GETs the values ``UPS_OIDS`` names in the same request as its power's;
``decode_ups`` turns the answer into a ``UpsState``.

Every value is checked against the MIB's own ranges (``readings.checked_number``): an
enumeration outside its values, a percentage or a minute count out of range, a value of
another type is ``ReadingRejectedError``, never taken. A missing optional value (many
UPSes omit ``upsEstimatedMinutesRemaining`` while on mains) is None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeVar

from polca.errors import ReadingRejectedError
from polca.meter.profiles import MAX_VOLTAGE_V
from polca.readings import EquipmentState, checked_number

__all__ = ["UPS_OIDS", "UpsState", "decode_ups"]

OutputSource = Literal["other", "none", "normal", "bypass", "battery", "booster", "reducer"]
BatteryStatus = Literal["unknown", "normal", "low", "depleted"]
_E = TypeVar("_E")

UPS_OIDS: Final = {
    "output_source": "1.3.6.1.2.1.33.1.4.1.0",
    "battery_status": "1.3.6.1.2.1.33.1.2.1.0",
    "minutes_remaining": "1.3.6.1.2.1.33.1.2.3.0",
    "output_percent_load": "1.3.6.1.2.1.33.1.4.4.1.5.1",
    "input_voltage": "1.3.6.1.2.1.33.1.3.3.1.3.1",
}
"""UPS-MIB values read per poll: scalars, and the load of output line 1 and the voltage of
input line 1 (``upsInputVoltage``, RMS volts: near zero while the UPS is on battery for a
lost input)."""

_OUTPUT_SOURCES: Final[dict[int, OutputSource]] = {
    1: "other",
    2: "none",
    3: "normal",
    4: "bypass",
    5: "battery",
    6: "booster",
    7: "reducer",
}
_BATTERY_STATUSES: Final[dict[int, BatteryStatus]] = {
    1: "unknown",
    2: "normal",
    3: "low",
    4: "depleted",
}
_MAX_MINUTES: Final = 2**31 - 1  # the MIB's PositiveInteger
_MAX_PERCENT_LOAD: Final = 200  # the MIB's upper bound for upsOutputPercentLoad


@dataclass(frozen=True, slots=True)
class UpsState:
    """One UPS's state as its agent reports it."""

    output_source: OutputSource
    battery_status: BatteryStatus | None = None
    minutes_remaining: float | None = None
    percent_load: float | None = None
    input_voltage_v: float | None = None

    @property
    def on_battery(self) -> bool:
        """Its output is carried by its battery (its input is lost)."""
        return self.output_source == "battery"

    @property
    def equipment(self) -> EquipmentState:
        """The state of the feed it gives what it supplies: down when its output is off,
        up on mains, bypass, battery or a voltage correction, unknown when it says other."""
        if self.output_source == "none":
            return "down"
        if self.output_source == "other":
            return "unknown"
        return "up"


def decode_ups(values: Mapping[str, object], *, what: str = "UPS") -> UpsState:
    """A UPS's state from the values of ``UPS_OIDS`` (keyed by their names there).

    ``output_source`` is required; the others may be absent (None).
    """
    source = _enum(values.get("output_source"), _OUTPUT_SOURCES, what=f"{what} upsOutputSource")
    if source is None:
        msg = f"{what} did not report upsOutputSource"
        raise ReadingRejectedError(msg, reason="unsupported")
    battery = _enum(
        values.get("battery_status"), _BATTERY_STATUSES, what=f"{what} upsBatteryStatus"
    )
    minutes = _optional(
        values.get("minutes_remaining"),
        what=f"{what} upsEstimatedMinutesRemaining",
        high=_MAX_MINUTES,
    )
    load = _optional(
        values.get("output_percent_load"),
        what=f"{what} upsOutputPercentLoad",
        high=_MAX_PERCENT_LOAD,
    )
    voltage = _optional(
        values.get("input_voltage"), what=f"{what} upsInputVoltage", high=MAX_VOLTAGE_V
    )
    return UpsState(source, battery, minutes, load, voltage)


def _enum(value: object, table: Mapping[int, _E], *, what: str) -> _E | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{what} is not an integer: {type(value).__name__}"
        raise ReadingRejectedError(msg, reason="type")
    found = table.get(value)
    if found is None:
        msg = f"{what} is {value}, not one of the MIB's values {sorted(table)}"
        raise ReadingRejectedError(msg, reason="absurd")
    return found


def _optional(value: object, *, what: str, high: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, float):  # the MIB's values are integers: a float is another object
        msg = f"{what} is not an integer: {value!r}"
        raise ReadingRejectedError(msg, reason="type")
    return checked_number(value, what=what, low=0.0, high=high)
