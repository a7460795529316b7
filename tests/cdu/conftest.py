"""Fixtures of the cooling tests: the Modbus TCP stand-in of ``tests/modbus``."""

from __future__ import annotations

from tests.modbus.conftest import modbus_server

__all__ = ["modbus_server"]
