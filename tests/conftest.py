"""Shared test rig: real Mosquitto, databases, etcd and fake-NVML fixtures, leak and logging
hygiene."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

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


SERVER_FIXTURES = frozenset(
    {
        "mosquitto",
        "mosquitto_factory",
        "etcd",
        "influxdb1",
        "victoria_metrics",
        "grafana_influxdb",
        "modbus_server",
        "snmpsim",
        "snmpsim_own",
        "redfish_standin",
        "bmc_standin",
        "standin_factory",
        "nats_cluster",
        "nats_cluster_factory",
        "broker",
        "agent_factory",
    }
)
"""Fixtures that start a real server or a stand-in process: a test using one is
``integration``."""
INTEGRATION_DIRS = ("integration", "deploy")
"""Folders of tests/ whose every test runs real processes (end to end, the deploy files)."""
_STARTS_PROCESSES = re.compile(
    r"\bsubprocess\b|create_subprocess|\bPopen\b|ServiceProcess|\bstarted\(|run_polca"
)
"""A test module that starts processes of its own (a polca command, a stand-in, a tool)."""
_module_starts: dict[Path, bool] = {}


def _integration(item: pytest.Item) -> bool:
    """Whether ``item`` starts real servers or processes (the ``integration`` marker)."""
    path = Path(str(item.path))
    parts = (
        path.relative_to(Path(__file__).parent).parts
        if path.is_relative_to(Path(__file__).parent)
        else ()
    )
    if parts and parts[0] in INTEGRATION_DIRS:
        return True
    if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    if path not in _module_starts:
        _module_starts[path] = bool(_STARTS_PROCESSES.search(path.read_text(encoding="utf-8")))
    return _module_starts[path]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Apply the task-leak check to every coroutine test; mark the tests that start real
    servers or processes ``integration`` (``-m "not integration"``: the unit tests alone)."""
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and inspect.iscoroutinefunction(function):
            item.add_marker(pytest.mark.usefixtures("_no_leaked_tasks"))
        if _integration(item):
            item.add_marker(pytest.mark.integration)
