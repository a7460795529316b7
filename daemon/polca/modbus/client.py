"""The Modbus TCP client: the only module that imports ``pymodbus``.

Why it exists: polca reads CDUs (``polca.cdu.modbus``) and meters
(``polca.meter.modbus``) over Modbus TCP, and both go through one seam,
``RegisterClient``: connect, read registers, close. ``PymodbusClient`` implements it over
pymodbus, so that the library stays replaceable and its errors become polca's here.

How it fails:

- Reconnection lives outside the client, as for MQTT (``polca.telemetry.bus``): a fresh
  client per connection, pymodbus' own reconnect and retries off. A device that does not
  answer a connect, or a read that fails on the connection, raises ``TransportError``.
- A device that rejects a read as an illegal function, address or value (Modbus exception
  codes 1-3) is answering, but the map does not fit it: ``ConfigError``. Other exception
  codes (busy, gateway) are transient: ``TransportError``.
- A response with fewer or more registers than asked for: ``TransportError``.

What it must not do: decode registers (``polca.modbus.registers``), back off or log (the
readers that use it do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pymodbus.client import AsyncModbusTcpClient
from pymodbus.exceptions import ModbusException
from pymodbus.pdu import ExceptionResponse

from polca.errors import ConfigError, TransportError
from polca.modbus.registers import Table

__all__ = ["ModbusDevice", "PymodbusClient", "RegisterClient"]

# Modbus exception codes meaning "your request does not fit me": illegal function, data
# address, data value. Retrying the same map cannot help.
_MAP_ERRORS = frozenset({1, 2, 3})


class RegisterClient(Protocol):
    """The seam to a Modbus device: connect, read registers, close."""

    async def connect(self) -> None:
        """Open the connection; raise ``TransportError`` if the device is unreachable."""

    async def read(self, table: Table, address: int, count: int) -> Sequence[int]:
        """``count`` registers of ``table`` from ``address``.

        Raises ``TransportError`` on a connection problem and ``ConfigError`` when the
        device rejects the request as not fitting it (exception codes 1-3).
        """

    def close(self) -> None:
        """Close the connection (idempotent)."""


class ModbusDevice(Protocol):
    """Where a Modbus TCP device is (a CDU's map, a meter's): what a client needs."""

    @property
    def host(self) -> str:
        """The device's (or gateway's) address."""
        ...

    @property
    def port(self) -> int:
        """Its Modbus TCP port."""
        ...

    @property
    def device_id(self) -> int:
        """The Modbus unit / device id."""
        ...

    @property
    def timeout_s(self) -> float:
        """Bound on connect and each read."""
        ...


class PymodbusClient:
    """``RegisterClient`` over pymodbus' ``AsyncModbusTcpClient``, with its retries off."""

    def __init__(self, config: ModbusDevice) -> None:
        """Prepare a client for ``config``'s device (no I/O)."""
        self._config = config
        self._where = f"{config.host}:{config.port}"
        # reconnect_delay=0: no reconnect inside the client; retries=0: one try per read.
        self._client = AsyncModbusTcpClient(
            config.host,
            port=config.port,
            timeout=config.timeout_s,
            retries=0,
            reconnect_delay=0,
            name=f"polca-{config.host}:{config.port}",
        )

    async def connect(self) -> None:
        """Connect; ``TransportError`` when the device does not answer."""
        try:
            connected = await self._client.connect()
        except (OSError, ModbusException) as exc:
            msg = f"cannot connect to Modbus device {self._where}: {exc}"
            raise TransportError(msg) from exc
        if not connected:
            msg = f"cannot connect to Modbus device {self._where}"
            raise TransportError(msg)

    async def read(self, table: Table, address: int, count: int) -> Sequence[int]:
        """Read holding (function 3) or input (function 4) registers."""
        reader = (
            self._client.read_holding_registers
            if table == "holding"
            else self._client.read_input_registers
        )
        try:
            response = await reader(address, count=count, device_id=self._config.device_id)
        except (OSError, ModbusException) as exc:
            msg = (
                f"Modbus read of {count} {table} registers at {address} from "
                f"{self._where} failed: {exc}"
            )
            raise TransportError(msg) from exc
        if isinstance(response, ExceptionResponse) or response.isError():
            code = getattr(response, "exception_code", None)
            msg = (
                f"Modbus device {self._where} (device id {self._config.device_id}) rejected "
                f"a read of {count} {table} registers at {address}: exception code {code}"
            )
            if code in _MAP_ERRORS:
                msg += (
                    "; the register map does not fit the device (check the addresses, "
                    "tables and device_id)"
                )
                raise ConfigError(msg)
            raise TransportError(msg)
        registers = list(response.registers)
        if len(registers) != count:
            msg = f"Modbus device {self._where} returned {len(registers)} of {count} registers"
            raise TransportError(msg)
        return registers

    def close(self) -> None:
        """Close the connection."""
        self._client.close()
