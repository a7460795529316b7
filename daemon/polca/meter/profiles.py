"""What each PDU vendor's MIB calls row power, and how to turn its answer into watts.

A ``Profile`` is data: the OIDs to read, in order of preference, each with its scale. The
first the device supports wins: the device's (or inlet's) total power, else the sum of its
phase power, else current x voltage x a configured power factor (``ups``, the standard
UPS-MIB, reads a UPS's output lines the same way). ``decode`` takes what a
GET and the column walks returned (OID string -> Python value, ``MISSING`` for "no such
object") and returns a ``SourceReading`` or raises:

- ``ReadingRejectedError``: a value is there but unusable (``type``, ``nan``, ``negative``,
  ``absurd``, ``oversized``), or every candidate is "not supported" (``unsupported``). A
  value that is present but wrong is never skipped over for a lower preference: it says
  the device misbehaves, and another value from it is no more trustworthy.
- ``ConfigError``: none of the profile's OIDs exists on the device (wrong profile or index).

Only "not supported" (``-1``, APC's and ServerTech's convention) or an OID the device does
not have moves on to the next candidate; ``SourceReading.fallbacks`` says which and why.

What this module must not do: import pysnmp or do I/O (``meter/snmp.py`` reads the device).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Final, Literal

from polca.errors import ConfigError, ReadingRejectedError
from polca.meter.source import SourceReading
from polca.readings import checked_number, checked_power_w

__all__ = [
    "MAX_CURRENT_A",
    "MAX_ROWS",
    "MAX_VOLTAGE_V",
    "MISSING",
    "PROFILES",
    "SYS_OBJECT_ID",
    "Kind",
    "Profile",
    "Value",
    "decode",
    "generic_profile",
    "profile_for",
    "vendor_of",
]

SYS_OBJECT_ID: Final = "1.3.6.1.2.1.1.2.0"
"""sysObjectID.0: the vendor's enterprise OID and model."""
SYS_DESCR: Final = "1.3.6.1.2.1.1.1.0"
"""sysDescr.0: the device's free-text description (the probe shows it)."""
MAX_ROWS: Final = 64
"""The most rows read from one table column per poll (phases, lines); more is ``oversized``."""
MAX_CURRENT_A: Final = 10_000.0
"""The most current one value may report (a row busway, not a rack PDU's ~100 A)."""
MAX_VOLTAGE_V: Final = 1_500.0
"""The most voltage one value may report (the low-voltage limit, 800 V DC included)."""
_MAX_RAW: Final = 2**64
"""Larger than any SNMP integer (Counter64): a bigger raw value is absurd before scaling."""

Kind = Literal["power_w", "current_a", "voltage_v"]
_BOUNDS: Final[Mapping[Kind, float]] = {
    "power_w": 2_000_000.0,
    "current_a": MAX_CURRENT_A,
    "voltage_v": MAX_VOLTAGE_V,
}


class _Missing(enum.Enum):
    MISSING = "no such object"


MISSING: Final = _Missing.MISSING
"""The value of an OID the device does not have (noSuchObject, noSuchInstance)."""

_UNSUPPORTED: Final = -1
"""What APC (rPDU2), ServerTech and Eaton answer for a quantity the model does not measure."""


@dataclass(frozen=True, slots=True)
class Value:
    """One quantity a profile reads: an OID (GET) or a table column (walked), and its scale.

    ``oid`` and the templates may hold ``{device}`` and ``{inlet}``, filled by
    ``Profile.bind``. The value in its unit is ``raw x scale / 10 ** digits``.
    """

    label: str
    """What it is, in ``detail`` and ``fallbacks`` (e.g. ``"device power"``)."""
    oid: str
    scale: float = 1.0
    column: bool = False
    """A table column: every row under ``oid`` (at most ``MAX_ROWS``), summed or paired."""
    digits_oid: str | None = None
    """An OID whose value is the number of decimal digits (Raritan); scalars only."""
    rows: tuple[int, ...] = ()
    """For a column: only rows whose last index is one of these (empty: every row)."""
    where: tuple[str, str] | None = None
    """For a column: keep a row only where this other column (same row index) equals the
    value, e.g. APC's phase table lists every daisy-chained device's phases."""
    noun: str = "rows"
    """What a column's rows are, in ``detail`` (``"phases"``)."""

    def bind(self, fields: Mapping[str, int]) -> Value:
        """This value with ``{device}`` and ``{inlet}`` filled in."""
        where = None
        if self.where is not None:
            where = (self.where[0].format(**fields), self.where[1].format(**fields))
        digits = self.digits_oid.format(**fields) if self.digits_oid else None
        return replace(self, oid=self.oid.format(**fields), digits_oid=digits, where=where)


@dataclass(frozen=True, slots=True)
class Profile:
    """One vendor MIB's candidates for row power, most preferred first."""

    name: str
    power: tuple[Value, ...] = ()
    """Power in W: total first, then sums of phase or inlet power."""
    current: Value | None = None
    """Current in A, for current x voltage x power factor (paired by row with voltage)."""
    voltage: Value | None = None
    """Voltage in V; without it a configured nominal voltage is used."""
    default_device: int = 1
    """The device (unit, PDU) index when the configuration names none (Eaton's is 0)."""

    def bind(self, *, device: int | None = None, inlet: int = 1) -> Profile:
        """This profile's OIDs for one device and inlet."""
        fields = {"device": self.default_device if device is None else device, "inlet": inlet}
        return replace(
            self,
            power=tuple(v.bind(fields) for v in self.power),
            current=self.current.bind(fields) if self.current else None,
            voltage=self.voltage.bind(fields) if self.voltage else None,
        )

    def values(self) -> tuple[Value, ...]:
        """Every value the profile may use, in order of preference."""
        return self.power + tuple(v for v in (self.current, self.voltage) if v is not None)

    def requests(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The OIDs to GET and the column prefixes to walk for one poll (bound profile)."""
        gets: list[str] = []
        walks: list[str] = []
        for value in self.values():
            (walks if value.column else gets).append(value.oid)
            if value.digits_oid:
                gets.append(value.digits_oid)
            if value.where:
                walks.append(value.where[0])
        return tuple(dict.fromkeys(gets)), tuple(dict.fromkeys(walks))


_R2 = "1.3.6.1.4.1.318.1.1.26"
_EATON = "1.3.6.1.4.1.534.6.6.7.3"
_GEIST = "1.3.6.1.4.1.21239.5.2.3"
_RARITAN_VALUE = "1.3.6.1.4.1.13742.6.5.2.3.1.4.{device}.{inlet}"
_RARITAN_DIGITS = "1.3.6.1.4.1.13742.6.3.3.4.1.7.{device}.{inlet}"
_ST4 = "1.3.6.1.4.1.1718.4.1"
_UPS_OUTPUT = "1.3.6.1.2.1.33.1.4.4.1"  # UPS-MIB upsOutputEntry


def _raritan(label: str, sensor: int) -> Value:
    return Value(label, f"{_RARITAN_VALUE}.{sensor}", digits_oid=f"{_RARITAN_DIGITS}.{sensor}")


PROFILES: Final[Mapping[str, Profile]] = {
    # PowerNet-MIB rPDU2: device power in hundredths of kW; the phase table, current in
    # tenths of A, voltage in V, power in hundredths of kW; -1 where the model has no meter.
    "apc": Profile(
        "apc",
        power=(
            Value("device power", f"{_R2}.4.3.1.5.{{device}}", scale=10.0),
            Value(
                "phase power",
                f"{_R2}.6.3.1.7",
                scale=10.0,
                column=True,
                where=(f"{_R2}.6.3.1.2", "{device}"),
                noun="phases",
            ),
        ),
        current=Value(
            "phase current",
            f"{_R2}.6.3.1.5",
            0.1,
            column=True,
            where=(f"{_R2}.6.3.1.2", "{device}"),
            noun="phases",
        ),
        voltage=Value(
            "phase voltage", f"{_R2}.6.3.1.6", 1.0, True, where=(f"{_R2}.6.3.1.2", "{device}")
        ),
    ),
    # PowerNet-MIB rPDU (older units): load current only, tenths of A, for each phase and
    # bank; rows with bank number 0 are the phases. Voltage: the configured nominal one.
    "apc_legacy": Profile(
        "apc_legacy",
        current=Value(
            "phase current",
            "1.3.6.1.4.1.318.1.1.12.2.3.1.1.2",
            0.1,
            True,
            where=("1.3.6.1.4.1.318.1.1.12.2.3.1.1.5", "0"),
            noun="phases",
        ),
    ),
    # PDU2-MIB measurementsInletSensorValue.<pdu>.<inlet>.<sensor>, scaled by
    # inletSensorDecimalDigits: sensor 5 active power (W), 1 RMS current, 4 RMS voltage.
    "raritan": Profile(
        "raritan",
        power=(_raritan("inlet active power", 5),),
        current=_raritan("inlet current", 1),
        voltage=_raritan("inlet voltage", 4),
    ),
    # Sentry4-MIB: st4InputCordActivePower (W); st4LineCurrent (hundredths of A) and
    # st4PhaseVoltage (tenths of V) per line/phase of the cord.
    "servertech": Profile(
        "servertech",
        power=(Value("input cord active power", f"{_ST4}.3.3.1.3.{{device}}.{{inlet}}"),),
        current=Value(
            "line current", f"{_ST4}.4.3.1.3.{{device}}.{{inlet}}", 0.01, True, noun="lines"
        ),
        voltage=Value("phase voltage", f"{_ST4}.5.3.1.3.{{device}}.{{inlet}}", 0.1, True),
    ),
    # EATON-EPDU-MIB, indexed by unit (0: the master) and input: inputTotalWatts (W), then
    # inputWatts per phase (W; rows 1-3, a 4th row is a total on some models), inputCurrent
    # (mA) and inputVoltage (mV).
    "eaton": Profile(
        "eaton",
        power=(
            Value("input total power", f"{_EATON}.5.1.4.{{device}}.{{inlet}}"),
            Value(
                "input phase power",
                f"{_EATON}.4.1.4.{{device}}.{{inlet}}",
                column=True,
                rows=(1, 2, 3),
                noun="phases",
            ),
        ),
        current=Value(
            "input current",
            f"{_EATON}.3.1.4.{{device}}.{{inlet}}",
            0.001,
            column=True,
            rows=(1, 2, 3),
            noun="phases",
        ),
        voltage=Value(
            "input voltage", f"{_EATON}.2.1.3.{{device}}.{{inlet}}", 0.001, True, rows=(1, 2, 3)
        ),
        default_device=0,
    ),
    # GEIST-V5-MIB (Vertiv/Geist): pduTotalReal (W), pduPhaseRealPower (W),
    # pduPhaseCurrent (hundredths of A), pduPhaseVoltage (tenths of V).
    "vertiv": Profile(
        "vertiv",
        power=(
            Value("total real power", f"{_GEIST}.1.1.9.{{device}}"),
            Value("phase real power", f"{_GEIST}.2.1.12", column=True, noun="phases"),
        ),
        current=Value("phase current", f"{_GEIST}.2.1.8", 0.01, True, noun="phases"),
        voltage=Value("phase voltage", f"{_GEIST}.2.1.4", 0.1, True),
    ),
    # UPS-MIB (RFC 1628), any vendor's UPS: upsOutputPower (W) per output line, then
    # upsOutputCurrent (tenths of A) x upsOutputVoltage (V) per line. What the UPS
    # delivers, not what it draws (its losses and its battery charging are not in it).
    "ups": Profile(
        "ups",
        power=(Value("output power", f"{_UPS_OUTPUT}.4", column=True, noun="lines"),),
        current=Value("output current", f"{_UPS_OUTPUT}.3", 0.1, column=True, noun="lines"),
        voltage=Value("output voltage", f"{_UPS_OUTPUT}.2", 1.0, column=True),
    ),
}
"""The built-in profiles by name (``generic`` is built from configuration)."""

_ENTERPRISES: Final[Mapping[int, str]] = {
    318: "apc",
    13742: "raritan",
    1718: "servertech",
    534: "eaton",
    21239: "vertiv",
}
_ENTERPRISE_PREFIX: Final = (1, 3, 6, 1, 4, 1)
_UPS_MIB: Final = (1, 3, 6, 1, 2, 1, 33)
"""upsMIB: the sysObjectID of agents that implement RFC 1628 without a vendor MIB (NUT's
``ietf`` mapping keys on it). A vendor's UPS names its enterprise instead: ``profile: ups``."""


def vendor_of(sys_object_id: object) -> str | None:
    """The vendor (a built-in profile's name) for a sysObjectID, or None if unknown."""
    if not isinstance(sys_object_id, str):
        return None
    try:
        arcs = tuple(int(arc) for arc in sys_object_id.strip(".").split("."))
    except ValueError:
        return None
    if arcs[: len(_UPS_MIB)] == _UPS_MIB:
        return "ups"
    if len(arcs) <= len(_ENTERPRISE_PREFIX) or arcs[:6] != _ENTERPRISE_PREFIX:
        return None
    return _ENTERPRISES.get(arcs[6])


def profile_for(sys_object_id: object) -> Profile:
    """The built-in profile for a device's sysObjectID; ``ConfigError`` when unknown."""
    vendor = vendor_of(sys_object_id)
    if vendor is None:
        msg = (
            f"unknown PDU vendor (sysObjectID {sys_object_id!r}): set profile to one of "
            f"{', '.join(sorted(PROFILES))} or generic with its OIDs"
        )
        raise ConfigError(msg)
    return PROFILES[vendor]


def generic_profile(values: Iterable[tuple[Kind, Value]]) -> Profile:
    """A profile from configured values: each power value in order, the first current and
    voltage for current x voltage."""
    power: list[Value] = []
    current: Value | None = None
    voltage: Value | None = None
    for kind, value in values:
        if kind == "power_w":
            power.append(value)
        elif kind == "current_a":
            current = current or value
        else:
            voltage = voltage or value
    return Profile("generic", power=tuple(power), current=current, voltage=voltage)


_CXV: Final = "current x voltage"


class _Skip(Exception):  # noqa: N818 - a control-flow signal, not an error
    """A candidate the device does not offer; ``missing`` when its OID does not exist."""

    def __init__(self, what: str, why: str, *, missing: bool) -> None:
        super().__init__(f"{what}: {why}")
        self.missing = missing


def _number(raw: object, *, what: str) -> float:
    """A raw SNMP value as a non-negative finite number, or ``_Skip``/``ReadingRejectedError``."""
    if raw is MISSING:
        raise _Skip(what, "no such object", missing=True)
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw == _UNSUPPORTED:
            raise _Skip(what, "-1 (not supported)", missing=False)
        if abs(raw) > _MAX_RAW:
            msg = f"{what} is absurd: an integer of {raw.bit_length()} bits"
            raise ReadingRejectedError(msg, reason="absurd")
    return checked_number(raw, what=what, low=0.0, high=math.inf)


def _scaled(value: Value, raw: object, varbinds: Mapping[str, object], kind: Kind) -> float:
    number = _number(raw, what=value.label) * value.scale
    if value.digits_oid is not None:
        digits = _number(varbinds.get(value.digits_oid, MISSING), what=f"{value.label} digits")
        if digits != int(digits) or digits > 9:
            msg = f"{value.label} decimal digits are not 0-9: {digits:g}"
            raise ReadingRejectedError(msg, reason="absurd")
        number /= 10 ** int(digits)
    return checked_number(number, what=value.label, low=0.0, high=_BOUNDS[kind])


def _rows(value: Value, varbinds: Mapping[str, object], kind: Kind) -> dict[str, float]:
    """A value's numbers by row index (``""`` for a scalar)."""
    if not value.column:
        return {"": _scaled(value, varbinds.get(value.oid, MISSING), varbinds, kind)}
    prefix = value.oid + "."
    raw = {oid[len(prefix) :]: v for oid, v in varbinds.items() if oid.startswith(prefix)}
    if len(raw) > MAX_ROWS:
        msg = f"{value.label}: {len(raw)} rows, more than {MAX_ROWS}"
        raise ReadingRejectedError(msg, reason="oversized")
    if value.rows:
        raw = {i: v for i, v in raw.items() if i.rsplit(".", 1)[-1] in map(str, value.rows)}
    if value.where is not None:
        column, wanted = value.where
        raw = {i: v for i, v in raw.items() if varbinds.get(f"{column}.{i}") == int(wanted)}
    if not raw:
        raise _Skip(value.label, "no such object", missing=True)
    numbers: dict[str, float] = {}
    for index, item in sorted(raw.items()):
        try:
            numbers[index] = _scaled(value, item, varbinds, kind)
        except _Skip as skip:
            raise _Skip(str(skip), f"row {index}", missing=skip.missing) from None
    return numbers


def _current_x_voltage(
    profile: Profile,
    varbinds: Mapping[str, object],
    *,
    power_factor: float,
    nominal_voltage_v: float | None,
) -> tuple[float, str]:
    if profile.current is None:
        raise _Skip(_CXV, "not in this profile", missing=True)
    amps = _rows(profile.current, varbinds, "current_a")
    if profile.voltage is not None:
        volts = _rows(profile.voltage, varbinds, "voltage_v")
        voltage_label = profile.voltage.label
    elif nominal_voltage_v is not None:
        volts = dict.fromkeys(amps, nominal_voltage_v)
        voltage_label = f"nominal voltage {nominal_voltage_v:g} V"
    else:
        raise _Skip(_CXV, "no voltage (set nominal_voltage_v)", missing=True)
    if "" in volts:  # one voltage for every current row (a scalar)
        volts = dict.fromkeys(amps, volts[""])
    pairs = [(amps[i], volts[i]) for i in amps if i in volts]
    if not pairs:
        raise _Skip(_CXV, "no row has both", missing=True)
    watts = sum(a * v for a, v in pairs) * power_factor
    rows = f" ({len(pairs)} {profile.current.noun})" if profile.current.column else ""
    detail = f"{profile.current.label} x {voltage_label} x power factor {power_factor:g}{rows}"
    return checked_power_w(watts, what=_CXV), detail


def decode(
    profile: Profile,
    varbinds: Mapping[str, object],
    *,
    power_factor: float,
    nominal_voltage_v: float | None = None,
) -> SourceReading:
    """Row power from one poll's answers to a bound ``profile`` (see the module docstring)."""
    fallbacks: list[str] = []
    missing: list[bool] = []
    for value in profile.power:
        try:
            rows = _rows(value, varbinds, "power_w")
        except _Skip as skip:
            fallbacks.append(str(skip))
            missing.append(skip.missing)
            continue
        watts = checked_power_w(sum(rows.values()), what=value.label)
        detail = f"{value.label} ({len(rows)} {value.noun})" if value.column else value.label
        return SourceReading(power_w=watts, detail=detail, fallbacks=tuple(fallbacks))
    try:
        watts, detail = _current_x_voltage(
            profile, varbinds, power_factor=power_factor, nominal_voltage_v=nominal_voltage_v
        )
    except _Skip as skip:
        fallbacks.append(str(skip))
        missing.append(skip.missing)
    else:
        return SourceReading(power_w=watts, detail=detail, fallbacks=tuple(fallbacks))
    if all(missing):
        msg = f"the device has none of profile {profile.name}'s values: {'; '.join(fallbacks)}"
        raise ConfigError(msg)
    msg = f"the device supports none of profile {profile.name}'s values: {'; '.join(fallbacks)}"
    raise ReadingRejectedError(msg, reason="unsupported")
