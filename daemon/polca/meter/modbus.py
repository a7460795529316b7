"""A row power source read over Modbus TCP: a meter's (or PDU's) power registers.

Many switchboard meters and some PDUs publish their active power in Modbus registers.
The map is polca's register decoding (``polca.modbus.registers``: encodings, word order,
scale, offset, units, the fewest reads) with power points only: ``power.N``, each in ``w``
or ``kw``; the source's power is their sum (one point for a meter's total, one per phase
or per feed otherwise). The connection is ``polca.modbus.client.PymodbusClient`` (the one
module that imports pymodbus).

How it fails (``polca.meter.source``): no connection, a timeout, a response of the wrong
length: ``TransportError`` (the connection is dropped, the next read reconnects); the
device refuses the map (Modbus exception 1-3): ``ConfigError``; a register that decodes to
NaN, a negative or an absurd power: ``ReadingRejectedError``. No backoff of its own: the meter
service reads each source once per period and a failed source makes its row partial.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from polca.errors import ReadingRejectedError, TransportError
from polca.meter.source import SourceReading
from polca.modbus.client import PymodbusClient, RegisterClient
from polca.modbus.registers import (
    MAX_REGISTERS_PER_READ,
    DecodeProblem,
    RegisterPoint,
    WordOrder,
    decode_point,
    plan_reads,
)
from polca.readings import checked_power_w

__all__ = ["MeterPoint", "ModbusMeterConfig", "ModbusMeterSource"]

_SOURCE_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
_POWER_FIELD = r"power\.\d{1,2}"


class MeterPoint(RegisterPoint):
    """One power register of a meter: ``power.N`` in W or kW (summed over N)."""

    field: str = Field(max_length=64, description="power.N (N = 0..99): summed.")
    unit: Literal["w", "kw"] | None = Field(
        None, description="The register's unit: w or kw (required)."
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not re.fullmatch(_POWER_FIELD, self.field, flags=re.ASCII):
            msg = f"unknown field {self.field!r}: a meter maps power.0, power.1, ..."
            raise ValueError(msg)
        if self.unit is None:
            msg = f"{self.field}: give the register's unit (w or kw)"
            raise ValueError(msg)
        if self.bit is not None or self.enum is not None:
            msg = f"{self.field}: a power register has no bit or enum"
            raise ValueError(msg)
        return self

    @property
    def quantity(self) -> Literal["power"]:
        """Every meter point is a power."""
        return "power"


class ModbusMeterConfig(BaseModel):
    """A power source reached over Modbus TCP, and its power registers."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    protocol: Literal["modbus"] = Field(description="modbus")
    name: str = Field(pattern=_SOURCE_NAME, description="Source name, unique in its row.")
    host: str = Field(max_length=253, description="The meter's (or gateway's) address.")
    port: int = Field(502, ge=1, le=65535, description="Modbus TCP port.")
    device_id: int = Field(1, ge=0, le=255, description="Modbus unit / device id.")
    timeout_s: float = Field(1.0, gt=0, le=60, description="Bound on connect and each read.")
    word_order: WordOrder = Field("big", description="Default 32-bit word order.")
    points: tuple[MeterPoint, ...] = Field(min_length=1, max_length=64)

    @model_validator(mode="after")
    def _unique(self) -> Self:
        fields = [p.field for p in self.points]
        if len(set(fields)) != len(fields):
            msg = "a power point is mapped twice"
            raise ValueError(msg)
        return self


class ModbusMeterSource:
    """``MeterSource`` over Modbus TCP: one connection, kept between reads."""

    def __init__(self, config: ModbusMeterConfig) -> None:
        """Plan the reads; no I/O (the first ``read`` connects)."""
        self.config = config
        self.blocks = plan_reads(config.points, max_count=MAX_REGISTERS_PER_READ)
        self._client: RegisterClient | None = None

    @property
    def name(self) -> str:
        """The source's configured name."""
        return self.config.name

    async def read(self) -> SourceReading:
        """Read every power register once; their sum."""
        timeout_s = self.config.timeout_s
        try:
            if self._client is None:
                client = PymodbusClient(self.config)
                try:
                    async with asyncio.timeout(timeout_s):
                        await client.connect()
                except BaseException:
                    client.close()
                    raise
                self._client = client
            total_w = 0.0
            for block in self.blocks:
                async with asyncio.timeout(timeout_s):
                    words = await self._client.read(block.table, block.address, block.count)
                total_w += self._decode(block.points, block.address, block.count, words)
        except TimeoutError as exc:
            await self.close()
            msg = f"Modbus meter {self.config.host}:{self.config.port} timed out"
            raise TransportError(msg) from exc
        except TransportError:
            await self.close()
            raise
        count = len(self.config.points)
        detail = "power register" if count == 1 else f"sum of {count} power registers"
        return SourceReading(checked_power_w(total_w, what="meter power"), detail)

    def _decode(
        self, points: Sequence[RegisterPoint], address: int, count: int, words: Sequence[int]
    ) -> float:
        """The block's power in W; ``ReadingRejectedError`` for a bad response or value."""
        words_ok = all(type(w) is int and 0 <= w <= 0xFFFF for w in words)
        if len(words) != count or not words_ok:
            msg = "Modbus meter answered words that are not 16-bit registers"
            raise ReadingRejectedError(msg, reason="malformed")
        total_w = 0.0
        for point in points:
            start = point.address - address
            value = decode_point(
                point, words[start : start + point.width], word_order=self.config.word_order
            )
            if isinstance(value, DecodeProblem):
                reason = "nan" if value.reason in ("not a number", "infinite") else "absurd"
                msg = f"{point.field}: {value.reason} (raw {value.raw})"
                raise ReadingRejectedError(msg, reason=reason)
            total_w += checked_power_w(float(value) * 1000.0, what=point.field)  # kW -> W
        return total_w

    async def close(self) -> None:
        """Close the connection (the next read reconnects)."""
        client, self._client = self._client, None
        if client is not None:
            client.close()
