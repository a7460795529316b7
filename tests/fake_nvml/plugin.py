"""Pytest fixtures for the fake ``libnvidia-ml.so.1``, shareable across test folders.

Register once in ``tests/conftest.py`` with ``pytest_plugins = ["tests.fake_nvml.plugin"]``
(``tests/gpu/conftest.py`` imports them directly until then).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fake_nvml import FakeNvml, build_fake_nvml


@pytest.fixture(scope="session")
def fake_nvml_lib() -> Path:
    """The fake library, compiled once per source version (cached under build/)."""
    return build_fake_nvml()


@pytest.fixture
def fake_nvml(tmp_path: Path, fake_nvml_lib: Path) -> Iterator[FakeNvml]:
    """An 8-GPU H100 fake node, loaded into this process's pynvml for the test."""
    directory = tmp_path / "fake_nvml"
    directory.mkdir()
    fake = FakeNvml(directory, gpus=8, lib_path=fake_nvml_lib)
    fake.load_in_process()
    yield fake
    fake.unload_in_process()
