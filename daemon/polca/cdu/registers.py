"""The Modbus register map of a CDU: which registers hold which reading, and how to decode.

Every CDU vendor lays out its Modbus registers differently; polca maps them onto one
schema, ``CduTelemetry`` (named after Redfish ``CoolingUnit``), with a YAML register map
(``deploy/cdu-modbus.example.yaml``, ``docs/cooling.md``). Each point (``CduPoint``) is a
``polca.modbus.registers.RegisterPoint`` (the register, its encoding, scale, offset and
device unit) that names the dotted ``CduTelemetry`` field it fills
(``secondary.supply_temp_c``, ``pumps.0.state``).

This module is pure: it validates maps (``ConfigError`` for a bad one) and turns decoded
register values into a ``CduTelemetry`` (``assemble``). Planning the reads and decoding
the registers are ``polca.modbus.registers``'; the poller is ``polca.cdu.modbus``.

A validated map fits the wire schema (names, pump and leak detector counts), so
``assemble`` of decoded values always validates. A map file is read through
``polca.yamlkit`` (bounded) and its floats must be finite.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from polca import yamlkit
from polca.errors import ConfigError
from polca.modbus.registers import (
    MAX_REGISTERS_PER_READ,
    DecodeProblem,
    Quantity,
    RegisterPoint,
    WordOrder,
)
from polca.telemetry.schema import CduTelemetry

__all__ = [
    "FIELD_PATTERNS",
    "MAX_LEAK_DETECTORS",
    "MAX_PUMPS",
    "CduPoint",
    "ModbusCduConfig",
    "assemble",
    "load_map",
]

_NAME = r"^[A-Za-z0-9_.:-]+$"
_NAME_CHARS = 128  # the wire schema's bound on a name
_FIELD_CHARS = 64  # longest dotted field path accepted (leak_detectors.63.state is 23)

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


class CduPoint(RegisterPoint):
    """One reading: where it sits in the device and which CduTelemetry field it fills."""

    field: str = Field(
        max_length=_FIELD_CHARS,
        description="CduTelemetry dotted path, e.g. secondary.supply_temp_c.",
    )

    @property
    def quantity(self) -> Quantity:
        """What the target field measures (validated to exist)."""
        quantity = _quantity(self.field)
        if quantity is None:  # pragma: no cover - rejected by validation
            msg = f"unknown field {self.field}"
            raise ValueError(msg)
        return quantity

    @property
    def unknown_state(self) -> str:
        """The conservative state of the field: pump ``failed``, leak and status ``critical``."""
        return _STATES[self.field.split(".")[0]][1]

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
        states = _STATES[self.field.split(".")[0]][0] if quantity == "state" else frozenset()
        problem = self.encoding_problem(quantity, states=states)
        if problem is not None:
            raise ValueError(problem)
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
    points: tuple[CduPoint, ...] = Field(min_length=1, max_length=1024)

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
