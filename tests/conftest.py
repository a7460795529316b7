"""Shared test rig: real Mosquitto, databases, etcd and fake-NVML fixtures, leak and logging
hygiene."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Iterator

import pytest
import structlog

from tests.etcd import etcd
from tests.fake_nvml.plugin import fake_nvml, fake_nvml_lib
from tests.mqtt_broker import mosquitto, mosquitto_factory
from tests.tsdb import influxdb1, victoria_metrics

# The Redfish stand-in's fixtures (tests/redfish, tests/bmc, tests/meter use them).
pytest_plugins = ["tests.standins.fixtures"]

__all__ = [
    "etcd",
    "fake_nvml",
    "fake_nvml_lib",
    "influxdb1",
    "mosquitto",
    "mosquitto_factory",
    "victoria_metrics",
]


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """Every test starts from structlog's defaults, with no cached loggers."""
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    yield
    structlog.reset_defaults()


@pytest.fixture
async def _no_leaked_tasks() -> AsyncIterator[None]:
    """Fail an async test that leaves asyncio tasks running behind it."""
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)
    leaked = [
        task
        for task in asyncio.all_tasks() - before
        if task is not asyncio.current_task() and not task.done()
    ]
    for task in leaked:
        task.cancel()
    assert not leaked, f"test leaked asyncio tasks: {[t.get_name() for t in leaked]}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Apply the task-leak check to every coroutine test."""
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and inspect.iscoroutinefunction(function):
            item.add_marker(pytest.mark.usefixtures("_no_leaked_tasks"))
