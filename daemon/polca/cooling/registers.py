"""The Modbus register map of a CDU: which registers hold which reading, and how to decode.

Every CDU vendor lays out its Modbus registers differently; polca maps them onto one
schema, ``CduTelemetry`` (named after Redfish ``CoolingUnit``), with a YAML register map
(``deploy/cdu-modbus.example.yaml``, ``docs/cooling.md``). Each point names the register
(table, address), its encoding (16- or 32-bit, signed or not, IEEE float, word order, one
bit of a status word), a linear ``scale`` and ``offset`` in the device's unit, the
device's unit (converted here: F to C, GPM to L/min, psi to kPa, W to kW ...), and the
dotted ``CduTelemetry`` field it fills (``secondary.supply_temp_c``, ``pumps.0.state``).

This module is pure: it validates maps (``ConfigError`` for a bad one), plans the fewest
register reads that cover a map (``plan_reads``) and turns register values into a
``CduTelemetry`` (``assemble``). The network side is ``polca.cooling.modbus``.

Decoding is total: ``decode_point`` returns a reading or a ``DecodeProblem`` for any
register words (wrong count, words outside 16 bits, NaN or infinite floats, values outside
the schema's bounds), never an exception, and a validated map fits the wire schema (names,
pump and leak detector counts), so ``assemble`` of decoded values always validates. A map
file is read through ``polca.yamlkit`` (bounded) and its floats must be finite.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from polca import yamlkit
from polca.errors import ConfigError
from polca.telemetry.schema import CduTelemetry

__all__ = [
    "FIELD_PATTERNS",
    "DecodeProblem",
    "ModbusCduConfig",
    "ReadBlock",
    "RegisterPoint",
    "assemble",
    "decode_point",
    "load_map",
    "plan_reads",
]

RegisterType = Literal["uint16", "int16", "uint32", "int32", "float32"]
Table = Literal["holding", "input"]
WordOrder = Literal["big", "little"]
Unit = Literal[
    "C", "F", "K", "lpm", "gpm", "m3h", "lps", "kpa", "pa", "bar", "psi", "kw", "w", "pct"
]
Quantity = Literal["temperature", "flow", "pressure", "power", "percent", "state"]

_NAME = r"^[A-Za-z0-9_.:-]+$"
_NAME_CHARS = 128  # the wire schema's bound on a name
_FIELD_CHARS = 64  # longest dotted field path accepted (leak_detectors.63.state is 23)
_ENUM_CODES = 256  # raw codes of one state map
_WIDTH = {"uint16": 1, "int16": 1, "uint32": 2, "int32": 2, "float32": 2}
MAX_REGISTERS_PER_READ = 125  # Modbus limit of one read-registers request

# Device unit -> (quantity, factor, offset) so that polca_value = raw * factor + offset.
_UNITS: dict[str, tuple[Quantity, float, float]] = {
    "C": ("temperature", 1.0, 0.0),
    "F": ("temperature", 5.0 / 9.0, -32.0 * 5.0 / 9.0),
    "K": ("temperature", 1.0, -273.15),
    "lpm": ("flow", 1.0, 0.0),
    "gpm": ("flow", 3.785411784, 0.0),  # US gallons per minute
    "m3h": ("flow", 1000.0 / 60.0, 0.0),
    "lps": ("flow", 60.0, 0.0),
    "kpa": ("pressure", 1.0, 0.0),
    "pa": ("pressure", 0.001, 0.0),
    "bar": ("pressure", 100.0, 0.0),
    "psi": ("pressure", 6.894757293168, 0.0),
    "kw": ("power", 1.0, 0.0),
    "w": ("power", 0.001, 0.0),
    "pct": ("percent", 1.0, 0.0),
}
# Plausible bounds of each quantity in polca's units (the wire schema's own bounds).
_BOUNDS: dict[Quantity, tuple[float, float]] = {
    "temperature": (-60.0, 300.0),
    "flow": (0.0, 100_000.0),
    "pressure": (-1000.0, 10_000.0),
    "power": (-100_000.0, 100_000.0),
    "percent": (0.0, 100.0),
}
_PERCENT_SLACK = 0.5  # a valve at 100.3 % is read as 100 %, at 101 % as invalid

_CONNECTOR = r"(?:secondary|primary)\."
FIELD_PATTERNS: dict[str, Quantity] = {
    _CONNECTOR + r"(?:supply|return)_temp_c": "temperature",
    _CONNECTOR + r"flow_lpm": "flow",
    _CONNECTOR + r"delta_pressure_kpa": "pressure",
    _CONNECTOR + r"heat_removed_kw": "power",
    r"valve_position_pct": "percent",
    r"pumps\.\d+\.speed_pct": "percent",
    r"pumps\.\d+\.state": "state",
    r"leak_detectors\.\d+\.state": "state",
    r"status": "state",
}
"""The CduTelemetry fields a point can fill (regular expressions) and their quantity."""

# The states each state field accepts, and the conservative one used for an unknown code.
_STATES: dict[str, tuple[frozenset[str], str]] = {
    "pumps": (frozenset({"running", "standby", "failed", "off"}), "failed"),
    "leak_detectors": (frozenset({"ok", "warning", "critical"}), "critical"),
    "status": (frozenset({"ok", "warning", "critical"}), "critical"),
}


def _quantity(field: str) -> Quantity | None:
    for pattern, quantity in FIELD_PATTERNS.items():
        if re.fullmatch(pattern, field, flags=re.ASCII):
            return quantity
    return None


def _schema_max_len(field: str) -> int:
    """The wire schema's bound on the length of ``CduTelemetry.<field>``."""
    for item in CduTelemetry.model_fields[field].metadata:
        max_length = getattr(item, "max_length", None)
        if isinstance(max_length, int):
            return max_length
    msg = f"CduTelemetry.{field} has no max_length"  # pragma: no cover - schema invariant
    raise AssertionError(msg)  # pragma: no cover


# How many pumps and leak detectors a CDU message carries at most (the wire schema's bounds).
MAX_PUMPS = _schema_max_len("pumps")
MAX_LEAK_DETECTORS = _schema_max_len("leak_detectors")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RegisterPoint(_Model):
    """One reading: where it sits in the device and which CduTelemetry field it fills."""

    field: str = Field(
        max_length=_FIELD_CHARS,
        description="CduTelemetry dotted path, e.g. secondary.supply_temp_c.",
    )
    address: int = Field(ge=0, le=65535, description="Register address (0-based, as on the wire).")
    table: Table = Field("holding", description="holding (function 3) or input (function 4).")
    type: RegisterType = Field("uint16", description="Encoding; 32-bit types use 2 registers.")
    word_order: WordOrder | None = Field(
        None, description="32-bit word order: big = high word first; default: the map's."
    )
    scale: float = Field(1.0, description="Multiplier applied to the raw value.")
    offset: float = Field(0.0, description="Added after scaling (in the device's unit).")
    unit: Unit | None = Field(
        None, description="The device's unit, converted to polca's; default: polca's own."
    )
    bit: int | None = Field(
        None, ge=0, le=31, description="Read one bit of an integer register (0 = LSB)."
    )
    enum: dict[int, str] | None = Field(
        None, max_length=_ENUM_CODES, description="Raw value -> state, required for state fields."
    )

    @property
    def width(self) -> int:
        """Registers the point spans."""
        return _WIDTH[self.type]

    @property
    def quantity(self) -> Quantity:
        """What the target field measures (validated to exist)."""
        quantity = _quantity(self.field)
        if quantity is None:  # pragma: no cover - rejected by validation
            msg = f"unknown field {self.field}"
            raise ValueError(msg)
        return quantity

    @model_validator(mode="after")
    def _check(self) -> Self:
        quantity = _quantity(self.field)
        if quantity is None:
            msg = (
                f"unknown field {self.field!r}; use one of: secondary.* / primary.* "
                "(supply_temp_c, return_temp_c, flow_lpm, delta_pressure_kpa, "
                "heat_removed_kw), valve_position_pct, pumps.N.state, pumps.N.speed_pct, "
                "leak_detectors.N.state, status"
            )
            raise ValueError(msg)
        if self.bit is not None and (self.type == "float32" or self.bit >= 16 * self.width):
            msg = f"{self.field}: bit {self.bit} does not fit a {self.type} register"
            raise ValueError(msg)
        if quantity == "state":
            if not self.enum:
                msg = f"{self.field}: a state field needs an enum map (raw value -> state)"
                raise ValueError(msg)
            if self.type == "float32":
                msg = f"{self.field}: a state field needs an integer register, not float32"
                raise ValueError(msg)
            allowed, _ = _STATES[self.field.split(".")[0]]
            bad = sorted(set(self.enum.values()) - allowed)
            if bad:
                msg = f"{self.field}: states {bad} are not among {sorted(allowed)}"
                raise ValueError(msg)
            if self.unit is not None:
                msg = f"{self.field}: a state field has no unit"
                raise ValueError(msg)
            return self
        if self.enum is not None:
            msg = f"{self.field}: enum is only for state fields"
            raise ValueError(msg)
        if self.unit is not None and _UNITS[self.unit][0] != quantity:
            msg = f"{self.field}: unit {self.unit} is a {_UNITS[self.unit][0]}, not a {quantity}"
            raise ValueError(msg)
        return self


class ModbusCduConfig(_Model):
    """One CDU reached over Modbus TCP, and its register map."""

    cdu: str = Field(
        pattern=_NAME,
        max_length=_NAME_CHARS,
        description="CDU name: the topic segment and `cdu` field.",
    )
    loop: str = Field(
        pattern=_NAME, max_length=_NAME_CHARS, description="The cooling loop the CDU serves."
    )
    host: str = Field(description="The CDU's (or gateway's) address.")
    port: int = Field(502, ge=1, le=65535, description="Modbus TCP port.")
    device_id: int = Field(1, ge=0, le=255, description="Modbus unit / device id.")
    timeout_s: float = Field(2.0, gt=0, le=60, description="Bound on connect and each read.")
    reconnect_min_s: float = Field(
        0.5, ge=0, description="First reconnect delay; doubles per failure, with jitter."
    )
    reconnect_max_s: float = Field(30.0, ge=0, description="Largest reconnect delay.")
    word_order: WordOrder = Field("big", description="Default 32-bit word order.")
    max_gap_registers: int = Field(
        0,
        ge=0,
        le=MAX_REGISTERS_PER_READ,
        description="Read across gaps of up to this many unmapped registers to save "
        "requests (only if the device allows reading them).",
    )
    max_registers_per_read: int = Field(
        MAX_REGISTERS_PER_READ, ge=2, le=MAX_REGISTERS_PER_READ, description="Request size."
    )
    pumps: tuple[str, ...] = Field(
        (),
        max_length=MAX_PUMPS,
        description="Pump names by index (pumps.N.*); default pump1, pump2, ...",
    )
    leak_detectors: tuple[str, ...] = Field(
        (),
        max_length=MAX_LEAK_DETECTORS,
        description="Leak detector names by index; default leak1, leak2, ...",
    )
    points: tuple[RegisterPoint, ...] = Field(min_length=1, max_length=1024)

    @model_validator(mode="after")
    def _check(self) -> Self:
        seen: set[str] = set()
        for point in self.points:
            if point.field in seen:
                msg = f"field {point.field} is mapped twice"
                raise ValueError(msg)
            seen.add(point.field)
        groups = (
            ("pumps", self.pumps, MAX_PUMPS),
            ("leak_detectors", self.leak_detectors, MAX_LEAK_DETECTORS),
        )
        for group, names, most in groups:
            indices = {int(f.split(".")[1]) for f in seen if f.startswith(group + ".")}
            count = max(len(names), max(indices, default=-1) + 1)
            if count > most:  # also bounds the search for missing indices below
                msg = f"{group}: index {count - 1} is beyond the {most} a CDU message carries"
                raise ValueError(msg)
            missing = [i for i in range(count) if f"{group}.{i}.state" not in seen]
            if missing:
                msg = (
                    f"{group} {missing} have no state point ({group}.N.state): every "
                    f"{group[:-1].replace('_', ' ')} needs one"
                )
                raise ValueError(msg)
            for name in names:
                if len(name) > _NAME_CHARS or not re.fullmatch(_NAME, name):
                    msg = f"{group} name {name[:_NAME_CHARS]!r} must match {_NAME}"
                    msg += f" and have at most {_NAME_CHARS} characters"
                    raise ValueError(msg)
        return self

    def names(self, group: Literal["pumps", "leak_detectors"]) -> tuple[str, ...]:
        """The names of the pumps or leak detectors, by index."""
        given = self.pumps if group == "pumps" else self.leak_detectors
        count = sum(
            1 for p in self.points if re.fullmatch(group + r"\.\d+\.state", p.field, flags=re.ASCII)
        )
        prefix = "pump" if group == "pumps" else "leak"
        return tuple(given[i] if i < len(given) else f"{prefix}{i + 1}" for i in range(count))


def load_map(raw: Mapping[str, Any] | Path, *, where: str = "") -> ModbusCduConfig:
    """Validate a register map (a mapping, or a YAML file); ``ConfigError`` if it is bad."""
    source = where
    if isinstance(raw, Path):
        source = source or str(raw)
        raw = (
            yamlkit.load_file(raw, what="the Modbus register map", error=ConfigError, source=source)
            or {}
        )
    try:
        return ModbusCduConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()
        )
        at = f" in {source}" if source else ""
        msg = f"invalid Modbus register map{at}: {problems}"
        raise ConfigError(msg) from exc


@dataclass(frozen=True, slots=True)
class ReadBlock:
    """One read request: ``count`` registers of ``table`` from ``address``, and its points."""

    table: Table
    address: int
    count: int
    points: tuple[RegisterPoint, ...]


def plan_reads(
    points: Sequence[RegisterPoint],
    *,
    max_gap: int = 0,
    max_count: int = MAX_REGISTERS_PER_READ,
) -> tuple[ReadBlock, ...]:
    """The fewest requests covering ``points``: contiguous (or overlapping) registers of
    one table share a request, and so do registers at most ``max_gap`` apart, as long as
    a request stays within ``max_count`` registers."""
    blocks: list[ReadBlock] = []
    ordered = sorted(points, key=lambda p: (p.table, p.address, p.width))
    start = end = 0  # current block: registers [start, end)
    members: list[RegisterPoint] = []
    table: Table = "holding"
    for point in ordered:
        p_end = point.address + point.width
        if (
            members
            and point.table == table
            and point.address <= end + max_gap
            and max(end, p_end) - start <= max_count
        ):
            members.append(point)
            end = max(end, p_end)
            continue
        if members:
            blocks.append(ReadBlock(table, start, end - start, tuple(members)))
        table, start, end, members = point.table, point.address, p_end, [point]
    if members:
        blocks.append(ReadBlock(table, start, end - start, tuple(members)))
    return tuple(blocks)


@dataclass(frozen=True, slots=True)
class DecodeProblem:
    """A register value that could not become a reading (the field is left out)."""

    field: str
    raw: float | int
    reason: str


def decode_point(
    point: RegisterPoint, registers: Sequence[int], *, word_order: WordOrder = "big"
) -> float | str | DecodeProblem:
    """The value of ``point`` from its registers (``point.width`` of them, in wire order).

    Numbers come back in polca's unit (C, L/min, kPa, kW, %), states as their name; an
    unknown state code becomes the conservative state (pump ``failed``, leak and status
    ``critical``) and a value outside the field's bounds, a float NaN or infinity, or
    registers that are not ``point.width`` 16-bit words, a ``DecodeProblem``. Total: never
    raises for any ``registers``.
    """
    bad = _bad_words(point, registers)
    if bad is not None:
        return bad
    raw = _raw(point, registers, point.word_order or word_order)
    if point.bit is not None and isinstance(raw, int):
        raw = (raw >> point.bit) & 1
    quantity = point.quantity
    if quantity == "state":
        assert point.enum is not None  # noqa: S101 - guaranteed by validation
        state = point.enum.get(int(raw))
        if state is None:
            _, fallback = _STATES[point.field.split(".")[0]]
            return DecodeProblem(point.field, raw, f"unknown state code, read as {fallback}")
        return state
    if isinstance(raw, float) and not math.isfinite(raw):
        return DecodeProblem(point.field, raw, "not a number" if math.isnan(raw) else "infinite")
    value = raw * point.scale + point.offset
    if point.unit is not None:
        _, factor, shift = _UNITS[point.unit]
        value = value * factor + shift
    if not math.isfinite(value):  # a huge scale can overflow a finite raw value
        return DecodeProblem(point.field, raw, "overflows after scaling")
    low, high = _BOUNDS[quantity]
    if quantity == "percent" and low - _PERCENT_SLACK <= value <= high + _PERCENT_SLACK:
        value = min(high, max(low, value))
    if not low <= value <= high:
        return DecodeProblem(point.field, raw, f"{value:g} is outside [{low:g}, {high:g}]")
    return value


def _bad_words(point: RegisterPoint, registers: Sequence[object]) -> DecodeProblem | None:
    """A problem when ``registers`` are not ``point.width`` words of 16 bits.

    Typed ``object``: a ``RegisterClient`` other than pymodbus' may hand back anything.
    """
    if len(registers) != point.width:
        reason = f"expected {point.width} registers, got {len(registers)}"
        return DecodeProblem(point.field, len(registers), reason)
    for word in registers:
        if isinstance(word, bool) or not isinstance(word, int) or not 0 <= word <= 0xFFFF:
            if isinstance(word, int) and not isinstance(word, bool):
                # str() of a huge int raises; the sign and bit length say enough
                what = "negative" if word < 0 else f"{word.bit_length()} bits wide"
                return DecodeProblem(point.field, -1, f"register value is {what}, not 16 bits")
            reason = f"register value of type {type(word).__name__}, not a 16-bit word"
            return DecodeProblem(point.field, -1, reason)
    return None


def _raw(point: RegisterPoint, registers: Sequence[int], word_order: WordOrder) -> int | float:
    if point.width == 1:
        word = registers[0] & 0xFFFF
        return word - 0x10000 if point.type == "int16" and word & 0x8000 else word
    high, low = (
        (registers[0], registers[1]) if word_order == "big" else (registers[1], registers[0])
    )
    data = struct.pack(">HH", high & 0xFFFF, low & 0xFFFF)
    fmt = {"uint32": ">I", "int32": ">i", "float32": ">f"}[point.type]
    value: int | float = struct.unpack(fmt, data)[0]
    return value


def assemble(
    config: ModbusCduConfig,
    values: Mapping[str, float | str | DecodeProblem],
    *,
    ts_ns: int,
) -> CduTelemetry:
    """Build the CDU's telemetry from decoded point values (by field).

    Fields with a ``DecodeProblem`` are left out, except states, which take their
    conservative value. ``primary`` is present when the map has primary points;
    ``status`` is ``ok`` unless the map reads it.
    """
    tree: dict[str, Any] = {"secondary": {}}
    for field, decoded in values.items():
        value = decoded
        if isinstance(decoded, DecodeProblem):
            if _quantity(field) != "state":
                continue
            value = _STATES[field.split(".")[0]][1]
        parts = field.split(".")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    message: dict[str, Any] = {
        "ts_ns": ts_ns,
        "cdu": config.cdu,
        "loop": config.loop,
        "secondary": tree["secondary"],
    }
    if "primary" in tree:
        message["primary"] = tree["primary"]
    for group in ("pumps", "leak_detectors"):
        names = config.names(group)
        readings = tree.get(group, {})
        message[group] = [
            {"name": name, **readings.get(str(i), {})} for i, name in enumerate(names)
        ]
    for key in ("valve_position_pct", "status"):
        if key in tree:
            message[key] = tree[key]
    return CduTelemetry.model_validate(message)
