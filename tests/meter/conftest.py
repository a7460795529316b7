"""Fixtures of the meter tests: a real SNMP agent (snmpsim) on loopback; the Modbus TCP
stand-in of ``tests/modbus``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.modbus.conftest import modbus_server
from tests.snmpsim import SnmpSimProcess, snmpsim_agent

__all__ = ["modbus_server", "snmpsim", "snmpsim_own"]


@pytest.fixture(scope="module")
def snmpsim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SnmpSimProcess]:
    """One agent shared by a module's tests, which only read from it."""
    yield from snmpsim_agent(tmp_path_factory.mktemp("snmpsim"))


@pytest.fixture
def snmpsim_own(tmp_path: Path) -> Iterator[SnmpSimProcess]:
    """An agent of the test's own, which it may stop and start again."""
    yield from snmpsim_agent(tmp_path / "snmpsim")
