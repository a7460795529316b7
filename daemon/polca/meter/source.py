"""The seam every row power source speaks: one reading of one PDU, meter or circuit.

A source (``meter/snmp.py``, ``meter/redfish.py``, ``meter/modbus.py``) reads its device
and returns a ``SourceReading``; it never publishes and never sleeps between reads (the
service, ``meter/service.py``, schedules them). How a read fails:

- the device cannot be reached, times out or answers at the transport level with an error:
  ``TransportError`` (the service retries at the next period; the source may back off);
- the device answers, but with nothing polca can use as power (wrong types, NaN, negative
  or absurd values, every candidate value "not supported"): ``ReadingRejectedError``
  (``polca.errors``) with a ``reason`` (the drop counter's name); values are checked with
  ``polca.readings.checked_power_w``;
- the configuration does not fit the device (an OID or resource that does not exist, a
  Modbus map the device refuses): ``ConfigError``.

What this module must not do: import a protocol library; each protocol has one module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from polca.readings import EquipmentState

__all__ = ["MeterSource", "SourceReading"]


@dataclass(frozen=True, slots=True)
class SourceReading:
    """One source's power, and which of the device's values it came from."""

    power_w: float
    """Active power in watts, finite, within ``polca.readings.checked_power_w``'s range."""
    detail: str
    """Which value was used, for logs and the probe (e.g. ``"device power"``, ``"phase
    power (3 phases)"``, ``"current x voltage x power factor 0.95"``)."""
    energy_j: float | None = None
    """The device's energy counter, if it has one."""
    fallbacks: tuple[str, ...] = field(default=())
    """Values the profile wanted first but the device did not support (e.g. ``"device
    power: -1 (not supported)"``), so operators see why ``detail`` is not the first
    choice."""
    equipment: EquipmentState = "unknown"
    """What the device says of the feed it measures (a circuit's breaker and power state,
    a UPS's output source, a PDU's input voltage): ``unknown`` when it does not say."""
    on_battery: bool = False
    """A UPS whose output its battery carries (its input is lost)."""
    battery_minutes: float | None = None
    """A UPS's estimated minutes on battery, where it reports them."""
    load_pct: float | None = None
    """A UPS's output load in percent, where it reports it."""
    input_voltage_v: float | None = None
    """The feed's input voltage, where the source reads it."""


class MeterSource(Protocol):
    """One configured power source of a row: reads its device on demand."""

    @property
    def name(self) -> str:
        """The source's configured name (unique within its row)."""
        ...

    async def read(self) -> SourceReading:
        """Read the device once; raises ``TransportError``, ``ReadingRejectedError`` or
        ``ConfigError`` (see the module docstring), nothing else."""
        ...

    async def close(self) -> None:
        """Release connections and sockets (idempotent)."""
        ...
