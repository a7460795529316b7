"""The ``file`` assignment source: one node's or a whole site's YAML map, its errors at
FILE:LINE:COL, and the watch that applies good edits and keeps the last good map."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from polca.assign.filesource import load_assignment, watch_assignment
from polca.assign.model import AssignmentUpdate
from polca.errors import ConfigError, YamlError

UUID = "GPU-5d2b7c1e-0a7f-4e0c-9a51-0c3c2d1b9f00"

SITE = f"""\
# GPU 0 of every node is high
gpus:
  0: high
  "1": batch
nodes:
  node1:
    gpus:
      "{UUID}": low
      1: high
  node2:
    gpus: {{}}
  node3:
"""


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_a_site_file_merges_each_nodes_entries_over_the_common_ones(tmp_path: Path) -> None:
    path = _write(tmp_path / "site.yaml", SITE)
    node1 = load_assignment(path, "node1")
    assert node1 == AssignmentUpdate(
        source="file",
        classes={"0": "high", "1": "high", UUID: "low"},
        origins={"0": "file", "1": "file", UUID: "file"},
    )
    assert dict(load_assignment(path, "node2").classes) == {"0": "high", "1": "batch"}
    assert dict(load_assignment(path, "node3").classes) == {"0": "high", "1": "batch"}
    assert dict(load_assignment(path, "other").classes) == {"0": "high", "1": "batch"}


def test_a_node_file_and_an_empty_file(tmp_path: Path) -> None:
    one = _write(tmp_path / "node.yaml", f'gpus: {{"0": high, "{UUID}": low}}\n')
    assert dict(load_assignment(one, "any").classes) == {"0": "high", UUID: "low"}
    empty = _write(tmp_path / "empty.yaml", "# nothing assigned\n")
    assert load_assignment(empty, "any") == AssignmentUpdate(source="file", classes={})


def test_every_problem_is_reported_at_its_line_and_column(tmp_path: Path) -> None:
    text = (
        "gpus:\n"  # 1
        "  gpu0: high\n"  # 2: not a GPU
        "  1: [a, b]\n"  # 3: not a class
        "  2: no spaces\n"  # 4: not a class
        "  007: low\n"  # 5: leading zero
        "nodes:\n"  # 6
        "  node/1: {gpus: {0: high}}\n"  # 7: not a node name
        "  node2:\n"  # 8
        "    gpu: {0: high}\n"  # 9: unknown key
        "  node3: [0, 1]\n"  # 10: not a mapping
        "extra: 1\n"  # 11: unknown key
    )
    path = _write(tmp_path / "bad.yaml", text)
    with pytest.raises(YamlError) as caught:
        load_assignment(path, "node2")
    assert [line.split(": ", 1)[0] for line in caught.value.lines()] == [
        f"{path}:2:3",
        f"{path}:3:6",
        f"{path}:4:6",
        f"{path}:5:3",
        f"{path}:7:3",
        f"{path}:9:5",
        f"{path}:10:10",
        f"{path}:11:1",
    ]
    lines = "\n".join(caught.value.lines())
    assert "'gpu0' is not a GPU" in lines
    assert "'no spaces' is not a class name" in lines
    assert "unknown key 'extra'" in lines
    assert "nodes.node3 must be a mapping" in lines


def test_bad_yaml_and_duplicate_gpus_are_refused_with_their_place(tmp_path: Path) -> None:
    broken = _write(tmp_path / "broken.yaml", "gpus:\n  0: high\n  1: [low\n")
    with pytest.raises(YamlError) as caught:
        load_assignment(broken, "n1")
    assert caught.value.line is not None
    assert str(caught.value).startswith(f"{broken}:")
    twice = _write(tmp_path / "twice.yaml", 'gpus:\n  0: high\n  "0": low\n')
    with pytest.raises(YamlError) as caught:
        load_assignment(twice, "n1")
    assert caught.value.lines() == (f"{twice}:3:3: duplicate key '0'",)


def test_a_file_that_cannot_be_read_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the assignment file"):
        load_assignment(tmp_path / "missing.yaml", "n1")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"gpus: {0: \xff}\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_assignment(binary, "n1")


@contextlib.asynccontextmanager
async def _watching(path: Path, node: str) -> AsyncIterator[asyncio.Queue[AssignmentUpdate]]:
    """``watch_assignment`` running; the updates it hands on, in order."""
    updates: asyncio.Queue[AssignmentUpdate] = asyncio.Queue()
    task = asyncio.create_task(watch_assignment(path, node, updates.put_nowait, debounce_s=0.05))
    try:
        yield updates
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _next(updates: asyncio.Queue[AssignmentUpdate]) -> AssignmentUpdate:
    async with asyncio.timeout(10):
        return await updates.get()


def _replace(path: Path, text: str) -> None:
    """Write as editors and configuration management do: a new file renamed over."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


async def test_the_watch_applies_good_edits_and_keeps_the_last_good_map(tmp_path: Path) -> None:
    path = _write(tmp_path / "assign.yaml", "gpus: {0: high}\n")
    async with _watching(path, "node1") as updates:
        first = await _next(updates)
        assert (dict(first.classes), first.healthy) == ({"0": "high"}, True)
        _replace(path, "nodes: {node1: {gpus: {0: low, 1: high}}}\n")
        edited = await _next(updates)
        assert (dict(edited.classes), edited.healthy) == ({"0": "low", "1": "high"}, True)
        _replace(path, "gpus: {0: high\n")  # a bad edit
        bad = await _next(updates)
        assert (dict(bad.classes), bad.healthy) == ({"0": "low", "1": "high"}, False)
        assert bad.reason.startswith(f"{path}:")
        path.unlink()  # gone: the last good map stays, still unhealthy
        await asyncio.sleep(0.5)
        _replace(path, "gpus: {2: batch}\n")
        healed = await _next(updates)
        while not healed.healthy:  # the deletion may have been reported on its own
            assert dict(healed.classes) == {"0": "low", "1": "high"}
            healed = await _next(updates)
        assert dict(healed.classes) == {"2": "batch"}
        assert updates.empty()


async def test_a_bad_file_at_start_is_reported_with_an_empty_map(tmp_path: Path) -> None:
    path = _write(tmp_path / "assign.yaml", "gpus: {0: high, 0: low}\n")
    async with _watching(path, "node1") as updates:
        first = await _next(updates)
        assert (dict(first.classes), first.healthy) == ({}, False)
        assert "duplicate key" in first.reason
