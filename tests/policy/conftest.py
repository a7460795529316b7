"""Fixtures of the policy tests: a valid policy as plain data, and a file writer."""

from __future__ import annotations

import copy
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from polca.policy import Policy

BASE_POLICY: dict[str, Any] = {
    "schema_version": 1,
    "name": "test",
    "classes": ["high", "low"],
    "default_class": "low",
    "assignment": {"by_index": {0: "high"}, "by_uuid": {"GPU-hi": "high"}},
    "levels": [
        {"name": "T1", "threshold_pct": 80, "caps": {"low": {"sm_clock_max_mhz": 1275}}},
        {
            "name": "T2",
            "threshold_pct": 89,
            "caps": {"low": {"sm_clock_max_mhz": 1110}, "high": {"sm_clock_max_mhz": 1305}},
        },
        {
            "name": "brake",
            "threshold_pct": 98,
            "caps": {"low": {"sm_clock_max_mhz": 288}, "high": {"sm_clock_max_mhz": 288}},
        },
    ],
    "release": {"margin_pct": 5, "dwell_s": 10, "one_level_at_a_time": True},
    "trend": {"reaction_s": 5},
    "thermal_guards": [
        {
            "name": "gpu_hot",
            "gpu_temp_c": 85,
            "release_gpu_temp_c": 80,
            "caps": {"sm_clock_max_pct": 75},
        },
        {
            "name": "hbm_hot",
            "mem_temp_c": 92,
            "release_mem_temp_c": 87,
            "caps": {"power_limit_pct": 70},
        },
    ],
    "fail_safe": {"caps": {"low": {"sm_clock_max_mhz": 1110}, "high": {"sm_clock_max_mhz": 1305}}},
    "on_stop": "restore",
}

# The same policy as YAML, with known line numbers for location tests.
BASE_YAML = textwrap.dedent(
    """\
    schema_version: 1
    name: test
    classes: [high, low]
    default_class: low
    levels:
      - name: T1
        threshold_pct: 80
        caps:
          low: {sm_clock_max_mhz: 1275}
      - name: T2
        threshold_pct: 89
        caps:
          low: {sm_clock_max_mhz: 1110}
          high: {sm_clock_max_mhz: 1305}
    thermal_guards:
      - name: gpu_hot
        gpu_temp_c: 85
        release_gpu_temp_c: 80
        caps: {sm_clock_max_pct: 75}
    fail_safe:
      caps:
        low: {sm_clock_max_mhz: 1110}
    """
)


@pytest.fixture
def policy_data() -> dict[str, Any]:
    """A fresh, mutable copy of a valid policy as plain data."""
    return copy.deepcopy(BASE_POLICY)


@pytest.fixture
def policy() -> Policy:
    """The valid base policy."""
    return Policy.model_validate(copy.deepcopy(BASE_POLICY))


@pytest.fixture
def write_policy(tmp_path: Path) -> Callable[[str, str], Path]:
    """Write YAML text to ``tmp_path/NAME`` and return the path."""

    def write(text: str, name: str = "policy.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write
