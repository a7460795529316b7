"""Read active power from Redfish PDU and chassis resources: pure, no I/O.

Why it exists: a rack PDU that speaks Redfish is a ``PowerDistribution``
(``/redfish/v1/PowerEquipment/RackPDUs/{id}``) whose ``Mains`` (inlets) and ``Branches``
are ``Circuit`` resources; other gear reports power on its ``Chassis``: a ``Sensor`` with
``ReadingType: "Power"``, ``EnvironmentMetrics.PowerWatts``, the power supplies of its
``PowerSubsystem`` (``PowerSupplyMetrics.InputPowerWatts``) or, on older firmware, the
deprecated ``Power`` resource (``PowerControl[0].PowerConsumedWatts``). Each reader here
takes one document and returns a ``PowerReading`` that says which value it used
(``detail``) and which better values it skipped and why (``fallbacks``); the meter source
(``polca.meter.redfish``) turns it into a ``SourceReading``.

A circuit's power, in order of preference: ``PowerWatts.Reading``; the sum of its
``PolyPhasePowerWatts`` lines (line-to-neutral when it has any, else line-to-line, never
both); ``CurrentAmps`` x ``Voltage`` x the configured power factor (none configured: not
used). ``EnergykWh.Reading`` is returned as joules when it is a sane counter.

How it fails: every value is checked (``polca.readings.checked_power_w``). A document of
the wrong type raises ``ReadingRejectedError`` (``malformed``/``identity``); when no candidate
value is usable, ``ReadingRejectedError`` with the reason of the most telling failure (a
present but bad value beats "absent": ``unsupported``). Nothing else is raised.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from polca.errors import ReadingRejectedError
from polca.readings import MAX_SOURCE_POWER_W, EquipmentState, checked_number, checked_power_w
from polca.redfish.documents import check_type, excerpt_reading

__all__ = [
    "PowerReading",
    "circuit_power",
    "circuit_state",
    "environment_power",
    "legacy_power",
    "power_supply_power",
    "sensor_power",
    "sum_readings",
]

_J_PER_KWH = 3.6e6
_MAX_ENERGY_KWH = 1e12  # far beyond any PDU's lifetime counter
_WYE = ("Line1ToNeutral", "Line2ToNeutral", "Line3ToNeutral")
_DELTA = ("Line1ToLine2", "Line2ToLine3", "Line3ToLine1")


@dataclass(frozen=True, slots=True)
class PowerReading:
    """Active power read from one or more Redfish resources, and how it was found."""

    power_w: float
    detail: str
    energy_j: float | None = None
    fallbacks: tuple[str, ...] = field(default=())


def _excerpt_w(doc: Mapping[str, Any], key: str) -> float | None:
    return excerpt_reading(doc, key, low=0.0, high=MAX_SOURCE_POWER_W)


def _energy_j(doc: Mapping[str, Any], fallbacks: list[str]) -> float | None:
    try:
        kwh = excerpt_reading(doc, "EnergykWh", low=0.0, high=_MAX_ENERGY_KWH)
    except ReadingRejectedError as exc:
        fallbacks.append(f"EnergykWh: {exc} ({exc.reason})")
        return None
    return None if kwh is None else kwh * _J_PER_KWH


def _first(
    candidates: Sequence[tuple[str, Any]], fallbacks: list[str], *, what: str
) -> tuple[float, str]:
    """The first candidate that yields a power: (power_w, detail); else ReadingRejectedError.

    Each candidate is (detail, thunk): the thunk returns W, None when the device does not
    report it, or raises ReadingRejectedError.
    """
    reason = "unsupported"
    for detail, thunk in candidates:
        try:
            value = thunk()
        except ReadingRejectedError as exc:
            fallbacks.append(f"{detail}: {exc}")
            if reason == "unsupported":  # the first bad value says most
                reason = exc.reason
            continue
        if value is None:
            fallbacks.append(f"{detail}: not reported")
            continue
        return value, detail
    msg = f"{what} reports no usable power ({'; '.join(fallbacks)})"
    raise ReadingRejectedError(msg, reason=reason)


def _polyphase_w(doc: Mapping[str, Any]) -> float | None:
    lines = doc.get("PolyPhasePowerWatts")
    if lines is None:
        return None
    if not isinstance(lines, Mapping):
        msg = "PolyPhasePowerWatts is not an object"
        raise ReadingRejectedError(msg, reason="malformed")
    keys = [k for k in _WYE if k in lines] or [k for k in _DELTA if k in lines]
    if not keys:
        return None
    total = sum(_excerpt_w(lines, k) or 0.0 for k in keys)
    return checked_power_w(total, what="PolyPhasePowerWatts (sum)")


def _current_voltage_w(doc: Mapping[str, Any], power_factor: float | None) -> float | None:
    if "CurrentAmps" not in doc or "Voltage" not in doc:
        return None
    if power_factor is None:
        msg = "no power_factor configured"
        raise ReadingRejectedError(msg, reason="unsupported")
    amps = excerpt_reading(doc, "CurrentAmps", low=0.0, high=100_000.0) or 0.0
    volts = excerpt_reading(doc, "Voltage", low=0.0, high=100_000.0) or 0.0
    return checked_power_w(amps * volts * power_factor, what="CurrentAmps x Voltage")


def circuit_power(
    doc: object, *, power_factor: float | None = None, what: str = "circuit"
) -> PowerReading:
    """The active power of a ``Circuit`` (a PDU's main or branch)."""
    circuit = check_type(doc, "Circuit", what=what)
    fallbacks: list[str] = []
    cv = "CurrentAmps x Voltage" + (
        f" x power factor {power_factor:g}" if power_factor is not None else ""
    )
    power_w, detail = _first(
        [
            ("PowerWatts", lambda: _excerpt_w(circuit, "PowerWatts")),
            ("PolyPhasePowerWatts", lambda: _polyphase_w(circuit)),
            (cv, lambda: _current_voltage_w(circuit, power_factor)),
        ],
        fallbacks,
        what=what,
    )
    energy_j = _energy_j(circuit, fallbacks)
    return PowerReading(power_w, f"{what} {detail}", energy_j, tuple(fallbacks))


def circuit_state(doc: object, *, what: str = "circuit") -> EquipmentState:
    """Whether a ``Circuit`` (a PDU's main, a feeder, a busway's subfeed) carries power.

    Down when its ``BreakerState`` is ``Tripped`` or ``Off``, or its ``PowerState`` is
    ``Off`` (or ``PoweringOff``); up when the breaker is ``Normal`` and the power ``On``
    (either may be absent, not both); anything else (both absent, a transition, a value
    the schema does not have) is unknown: the power tree then goes by the meter.
    """
    circuit = check_type(doc, "Circuit", what=what)
    breaker = circuit.get("BreakerState")
    power = circuit.get("PowerState")
    if breaker in ("Tripped", "Off") or power in ("Off", "PoweringOff"):
        return "down"
    breaker_ok = breaker == "Normal" or (breaker is None and power is not None)
    power_ok = power == "On" or (power is None and breaker is not None)
    return "up" if breaker_ok and power_ok else "unknown"


def environment_power(doc: object, *, what: str = "EnvironmentMetrics") -> PowerReading:
    """``EnvironmentMetrics.PowerWatts`` (of a chassis, a PDU, a CDU)."""
    metrics = check_type(doc, "EnvironmentMetrics", what=what)
    fallbacks: list[str] = []
    power_w, detail = _first(
        [("PowerWatts", lambda: _excerpt_w(metrics, "PowerWatts"))], fallbacks, what=what
    )
    return PowerReading(
        power_w, f"{what} {detail}", _energy_j(metrics, fallbacks), tuple(fallbacks)
    )


def sensor_power(doc: object, *, what: str = "sensor") -> PowerReading:
    """A ``Sensor`` with ``ReadingType: "Power"`` (W; ``kW`` units are converted)."""
    sensor = check_type(doc, "Sensor", what=what)
    if sensor.get("ReadingType") != "Power":
        msg = f"{what} is not a power sensor (ReadingType {str(sensor.get('ReadingType'))[:40]})"
        raise ReadingRejectedError(msg, reason="identity")
    units = sensor.get("ReadingUnits", "W")
    scale = {"W": 1.0, "kW": 1000.0}.get(units) if isinstance(units, str) else None
    if scale is None:
        msg = f"{what} reads in {str(units)[:20]!r}, not W"
        raise ReadingRejectedError(msg, reason="unsupported")
    reading = sensor.get("Reading")
    if reading is None:
        msg = f"{what}.Reading is null or absent"
        raise ReadingRejectedError(msg, reason="unsupported")
    number = checked_number(reading, what=f"{what}.Reading", low=0.0, high=MAX_SOURCE_POWER_W)
    power_w = checked_power_w(number * scale, what=f"{what}.Reading")
    return PowerReading(power_w, f"{what} Reading")


def power_supply_power(docs: Sequence[object], *, what: str = "power supplies") -> PowerReading:
    """The sum of ``PowerSupplyMetrics.InputPowerWatts`` over a chassis' power supplies.

    Every supply must be readable: a sum missing one supply would under-report.
    """
    total = 0.0
    for i, doc in enumerate(docs):
        metrics = check_type(doc, "PowerSupplyMetrics", what=f"{what}[{i}]")
        value = _excerpt_w(metrics, "InputPowerWatts")
        if value is None:
            msg = f"{what}[{i}] has no InputPowerWatts"
            raise ReadingRejectedError(msg, reason="unsupported")
        total += value
    if not docs:
        msg = f"{what}: none"
        raise ReadingRejectedError(msg, reason="unsupported")
    power_w = checked_power_w(total, what=what)
    return PowerReading(power_w, f"{what} InputPowerWatts ({len(docs)} supplies)")


def legacy_power(doc: object, *, what: str = "Power") -> PowerReading:
    """The deprecated ``Power`` resource: ``PowerControl[0].PowerConsumedWatts``."""
    power = check_type(doc, "Power", what=what)
    controls = power.get("PowerControl")
    if not isinstance(controls, list) or not controls or not isinstance(controls[0], Mapping):
        msg = f"{what} has no PowerControl"
        raise ReadingRejectedError(msg, reason="unsupported")
    consumed = controls[0].get("PowerConsumedWatts")
    if consumed is None:
        msg = f"{what}.PowerControl[0].PowerConsumedWatts is null or absent"
        raise ReadingRejectedError(msg, reason="unsupported")
    power_w = checked_power_w(consumed, what=f"{what}.PowerControl[0].PowerConsumedWatts")
    return PowerReading(power_w, f"{what} PowerControl[0].PowerConsumedWatts")


def sum_readings(readings: Sequence[PowerReading], *, what: str) -> PowerReading:
    """The sum of several readings (a PDU's A and B mains, its branches).

    Energy is summed only when every reading has it. ``ReadingRejectedError`` (``absurd``)
    when the sum exceeds the bound; ``unsupported`` for no readings at all.
    """
    if not readings:
        msg = f"{what}: nothing to sum"
        raise ReadingRejectedError(msg, reason="unsupported")
    power_w = checked_power_w(math.fsum(r.power_w for r in readings), what=what)
    energies = [r.energy_j for r in readings]
    energy_j = math.fsum(e for e in energies if e is not None) if None not in energies else None
    if len(readings) == 1:
        return readings[0]
    detail = f"{what}: sum of {len(readings)} ({'; '.join(r.detail for r in readings)})"
    fallbacks = tuple(f for r in readings for f in r.fallbacks)
    return PowerReading(power_w, detail, energy_j, fallbacks)
