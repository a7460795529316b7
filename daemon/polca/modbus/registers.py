"""Modbus register decoding: where a reading sits, how it is encoded, and its value.

Why it exists: every Modbus device lays out its registers its own way, but the encodings
are few. A point names a register (table, address), its encoding (16- or 32-bit, signed
or not, IEEE float, word order, one bit of a status word), a linear ``scale`` and
``offset`` in the device's unit, and the device's unit (converted here: F to C, GPM to
L/min, psi to kPa, W to kW ...). Each kind of map subclasses ``RegisterPoint`` and says
which field a point fills and what it measures (``polca.cdu.registers.CduPoint``, a
CDU's reading; ``polca.meter.modbus.MeterPoint``, a meter's power).

This module is pure: it checks a point's encoding (``RegisterPoint.encoding_problem``),
plans the fewest register reads that cover a map (``plan_reads``) and turns register
words into readings (``decode_point``). The network side is ``polca.modbus.client``.

Decoding is total: ``decode_point`` returns a reading or a ``DecodeProblem`` for any
register words (wrong count, words outside 16 bits, NaN or infinite floats, values outside
the quantity's bounds), never an exception.

What it must not do: know a device's fields (a CDU's, a meter's), or do I/O.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MAX_REGISTERS_PER_READ",
    "DecodeProblem",
    "Quantity",
    "ReadBlock",
    "RegisterPoint",
    "RegisterType",
    "Table",
    "Unit",
    "WordOrder",
    "decode_point",
    "plan_reads",
]

RegisterType = Literal["uint16", "int16", "uint32", "int32", "float32"]
Table = Literal["holding", "input"]
WordOrder = Literal["big", "little"]
Unit = Literal[
    "C", "F", "K", "lpm", "gpm", "m3h", "lps", "kpa", "pa", "bar", "psi", "kw", "w", "pct"
]
Quantity = Literal["temperature", "flow", "pressure", "power", "percent", "state"]

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


class RegisterPoint(BaseModel):
    """One reading in a device's registers: where it sits and how it is encoded.

    A kind of map subclasses it: ``quantity`` (what the point's field measures) and
    ``unknown_state`` (the state an unknown code of a state field is read as) are its to
    say, and its validator checks the field, then ``encoding_problem``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    field: str = Field(max_length=64, description="The reading the point fills.")
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
        """What the point's field measures: each kind of map says."""
        msg = f"{type(self).__name__} does not say what {self.field} measures"
        raise NotImplementedError(msg)

    @property
    def unknown_state(self) -> str:
        """The state an unknown code of this state point is read as: each kind of map says."""
        msg = f"{type(self).__name__} has no state for an unknown code of {self.field}"
        raise NotImplementedError(msg)

    def encoding_problem(
        self, quantity: Quantity, *, states: frozenset[str] = frozenset()
    ) -> str | None:
        """What keeps the point from encoding a reading of ``quantity``, or ``None``.

        A bit must fit an integer register; a state needs an enum map over an integer
        register, onto ``states`` only, and no unit; any other quantity no enum, and a
        unit (if any) of that quantity.
        """
        if self.bit is not None and (self.type == "float32" or self.bit >= 16 * self.width):
            return f"{self.field}: bit {self.bit} does not fit a {self.type} register"
        if quantity == "state":
            if not self.enum:
                return f"{self.field}: a state field needs an enum map (raw value -> state)"
            if self.type == "float32":
                return f"{self.field}: a state field needs an integer register, not float32"
            bad = sorted(set(self.enum.values()) - states)
            if bad:
                return f"{self.field}: states {bad} are not among {sorted(states)}"
            if self.unit is not None:
                return f"{self.field}: a state field has no unit"
            return None
        if self.enum is not None:
            return f"{self.field}: enum is only for state fields"
        if self.unit is not None and _UNITS[self.unit][0] != quantity:
            return f"{self.field}: unit {self.unit} is a {_UNITS[self.unit][0]}, not a {quantity}"
        return None


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
    unknown state code becomes a ``DecodeProblem`` naming the state it is read as
    (``point.unknown_state``), and so does a value outside the quantity's bounds, a float
    NaN or infinity, or registers that are not ``point.width`` 16-bit words. Total: never
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
            return DecodeProblem(
                point.field, raw, f"unknown state code, read as {point.unknown_state}"
            )
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
