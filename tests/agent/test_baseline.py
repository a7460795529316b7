"""BaselineStore: original GPU settings saved atomically and read back."""

from __future__ import annotations

from pathlib import Path

import pytest

from polca.agent.baseline import Baseline, BaselineStore, GpuBaseline
from polca.errors import FatalError


def test_round_trip_and_remove(tmp_path: Path) -> None:
    """What is saved loads back equal; remove() forgets it."""
    store = BaselineStore(tmp_path / "state")
    baseline = Baseline((GpuBaseline("GPU-a", 0, 700_000), GpuBaseline("GPU-b", 1, None)), 42)
    store.save(baseline)
    assert store.load() == baseline
    assert baseline.for_uuid("GPU-b") == GpuBaseline("GPU-b", 1, None)
    store.remove()
    assert store.load() is None


def test_corrupt_file_is_a_fatal_error_naming_the_file(tmp_path: Path) -> None:
    """A damaged baseline stops the agent with the path, rather than guessing originals."""
    store = BaselineStore(tmp_path)
    store.path.write_text("{not json", encoding="utf-8")
    with pytest.raises(FatalError, match=r"baseline\.json"):
        store.load()


def test_unwritable_state_dir_says_how_to_fix(tmp_path: Path) -> None:
    """Saving into a file path that cannot be a directory names the setting to change."""
    blocker = tmp_path / "file"
    blocker.write_text("x", encoding="utf-8")
    store = BaselineStore(blocker / "sub")
    with pytest.raises(FatalError, match="STATE_DIR"):
        store.save(Baseline((), 1))
