"""The Modbus TCP stand-in: pymodbus' own server on a free loopback port.

The server is the real one (``pymodbus.server.ModbusTcpServer``), started in-process, so
the client, the CDU poller and the meter talk Modbus over a real TCP socket (the cooling
and meter tests use it too). ``ModbusTestServer`` keeps the register values itself, so a
restart on the same port serves the same values (as a device would after a reboot), and
counts the read requests it answers.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Sequence

import pytest
from pymodbus.server import ModbusTcpServer
from pymodbus.simulator import DataType, SimData, SimDevice

from tests.mqtt_broker import free_port

REGISTERS = 256  # registers 0..255 of each table exist on the test device
DEVICE_ID = 1
_READS = frozenset({3, 4})  # read holding / input registers


class ModbusTestServer:
    """pymodbus' TCP server with one device, holding and input registers 0..255."""

    def __init__(self, port: int) -> None:
        self.host = "127.0.0.1"
        self.port = port
        self.values: dict[str, list[int]] = {"holding": [0] * REGISTERS, "input": [0] * REGISTERS}
        self.reads: list[tuple[int, int, int]] = []  # (function code, address, count)
        self._server: ModbusTcpServer | None = None
        self._setting = False

    @property
    def running(self) -> bool:
        """Whether the server is listening."""
        return self._server is not None

    async def start(self) -> None:
        """Listen on ``port`` (again) with the current register values."""
        if self._server is not None:
            return
        bits = [SimData(0, count=16, values=False, datatype=DataType.BITS)]
        device = SimDevice(
            DEVICE_ID,
            simdata=(
                bits,
                bits,
                [SimData(0, values=list(self.values["holding"]), datatype=DataType.REGISTERS)],
                [SimData(0, values=list(self.values["input"]), datatype=DataType.REGISTERS)],
            ),
            action=self._action,
        )
        server = ModbusTcpServer(device, address=(self.host, self.port))
        await server.serve_forever(background=True)
        self._server = server

    async def stop(self) -> None:
        """Close the listener and every connection."""
        server, self._server = self._server, None
        if server is not None:
            await server.shutdown()  # type: ignore[no-untyped-call]

    async def set(self, table: str, address: int, words: Sequence[int]) -> None:
        """Write ``words`` from ``address`` (kept across restarts)."""
        self.values[table][address : address + len(words)] = list(words)
        if self._server is not None:
            code = 16 if table == "holding" else 4
            self._setting = True  # the action hook sees this write as function 4 too
            try:
                await self._server.async_setValues(DEVICE_ID, code, address, list(words))
            finally:
                self._setting = False

    async def _action(
        self,
        function_code: int,
        _start_address: int,
        address: int,
        count: int,
        _registers: list[int],
        _set_values: list[int] | list[bool] | None,
    ) -> None:
        if function_code in _READS and not self._setting:
            self.reads.append((function_code, address, count))


def words32(value: int | float, kind: str, *, word_order: str = "big") -> list[int]:
    """The two registers of a 32-bit value (``uint32``, ``int32`` or ``float32``)."""
    fmt = {"uint32": ">I", "int32": ">i", "float32": ">f"}[kind]
    high, low = struct.unpack(">HH", struct.pack(fmt, value))
    return [high, low] if word_order == "big" else [low, high]


def word16(value: int) -> int:
    """One register holding a signed or unsigned 16-bit value."""
    return value & 0xFFFF


@pytest.fixture
async def modbus_server() -> AsyncIterator[ModbusTestServer]:
    """A running Modbus TCP server (pymodbus) on a free loopback port, stopped afterwards."""
    server = ModbusTestServer(free_port())
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
