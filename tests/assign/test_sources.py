"""One shape for the assignment sources, and the one place that picks the configured one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from polca.assign.config import AssignmentSettings
from polca.assign.model import AssignmentUpdate
from polca.assign.rules import Classes
from polca.assign.sources import FileSource, source_for, task_for
from polca.errors import ConfigError

CLASSES = Classes(("high", "low"), "low")


def _task(settings: AssignmentSettings, updates: list[AssignmentUpdate]) -> object:
    return task_for(
        settings,
        node="n1",
        debounce_s=0.05,
        on_update=updates.append,
        gpus=dict,
        classes=lambda: CLASSES,
    )


def test_mqtt_needs_no_task_its_updates_are_messages() -> None:
    settings = AssignmentSettings()
    assert settings.source == "mqtt"
    assert source_for(settings, node="n1", debounce_s=0.1) is None
    assert _task(settings, []) is None


def test_the_file_source_is_the_configured_file(tmp_path: Path) -> None:
    settings = AssignmentSettings(source="file", file=tmp_path / "map.yaml")
    assert source_for(settings, node="n1", debounce_s=0.1) == FileSource(
        tmp_path / "map.yaml", "n1", 0.1
    )


async def test_the_file_task_hands_on_the_nodes_map(tmp_path: Path) -> None:
    """The task built for ``file`` reads the map and hands ``n1``'s on, as an update."""
    path = tmp_path / "map.yaml"
    path.write_text("nodes:\n  n1:\n    gpus: {0: high, 1: low}\n", encoding="utf-8")
    updates: list[AssignmentUpdate] = []
    task = _task(AssignmentSettings(source="file", file=path), updates)
    assert asyncio.iscoroutine(task)
    running = asyncio.ensure_future(task)
    try:
        async with asyncio.timeout(10):
            while not updates:  # noqa: ASYNC110 - the source has no event to wait on
                await asyncio.sleep(0.01)
    finally:
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
    assert updates[0].healthy
    assert dict(updates[0].classes) == {"0": "high", "1": "low"}


async def test_a_kubernetes_source_that_cannot_be_built_fails_its_task_not_the_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the node's name the Kubernetes source cannot be built: the choice still
    returns a task, and the task fails when it starts (inside the agent's supervision,
    whose shutdown leaves the GPUs at the fail-safe caps)."""
    monkeypatch.delenv("NODE_NAME", raising=False)
    task = _task(AssignmentSettings(source="kubernetes"), [])
    assert asyncio.iscoroutine(task)
    with pytest.raises(ConfigError, match="needs this node's name"):
        await task
