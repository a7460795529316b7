"""The actuator shape (``actuation.py``): what both actuators share, and that both take it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.actuation import ERROR_CHARS, Outcome, error_text, read_back_ok
from polca.agent.actuator import GpuOutcome, Setting
from polca.bmc.actuator import OobOutcome
from polca.errors import GpuError, GpuLostError, TransportError

PACKAGE = Path(__file__).resolve().parents[1] / "daemon" / "polca"


def test_polca_errors_read_as_their_message_and_anything_else_names_its_type() -> None:
    assert error_text(GpuError("NVML_ERROR_NO_PERMISSION")) == "NVML_ERROR_NO_PERMISSION"
    assert error_text(TransportError("BMC unreachable")) == "BMC unreachable"
    assert error_text(KeyError("x")) == "unexpected KeyError: 'x'"


def test_an_error_text_is_bounded() -> None:
    assert len(error_text(GpuLostError("x" * 10_000))) == ERROR_CHARS
    assert len(error_text(ValueError("y" * 10_000))) == ERROR_CHARS


@pytest.mark.parametrize(
    ("written", "read", "tolerance", "ok"),
    [
        (300_000, 300_000, 0.0, True),
        (300_000, 299_999, 0.0, False),  # NVML keeps mW exactly: one off is another value
        (300.0, 300.9, 1.0, True),  # a BMC that rounds to whole watts
        (300.0, 301.5, 1.0, False),
        (300.0, None, 1.0, False),  # no limit reported after a write is not the limit
    ],
)
def test_a_read_back_is_the_written_limit_within_the_devices_rounding(
    written: float, read: float | None, tolerance: float, ok: bool
) -> None:
    assert read_back_ok(written, read, tolerance=tolerance) is ok


def test_a_negative_tolerance_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        read_back_ok(1.0, 1.0, tolerance=-0.5)


@given(
    st.floats(min_value=0, max_value=1e7, allow_nan=False),
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False),
    st.floats(min_value=0, max_value=10, allow_nan=False),
)
def test_read_back_ok_is_the_distance_within_the_tolerance(
    written: float, offset: float, tolerance: float
) -> None:
    read = written + offset
    assert read_back_ok(written, read, tolerance=tolerance) is (abs(read - written) <= tolerance)


@pytest.mark.parametrize(
    ("action", "ok"),
    [
        ("applied", True),
        ("unchanged", True),
        ("reasserted", True),
        ("failed", False),
        ("lost", False),
    ],
)
def test_a_gpu_outcome_is_an_outcome(action: str, ok: bool) -> None:
    error = None if ok else "x"
    outcome: Outcome = GpuOutcome(0, "GPU-0", action, Setting(None, 1), error=error)  # type: ignore[arg-type]
    assert isinstance(outcome, Outcome)
    assert outcome.ok is ok
    assert outcome.error == error


@pytest.mark.parametrize(
    ("verified", "error", "ok"),
    [(True, None, True), (False, None, False), (False, "BMC unreachable", False)],
)
def test_a_bmc_outcome_is_an_outcome(verified: bool, error: str | None, ok: bool) -> None:
    outcome: Outcome = OobOutcome("n1", "cap", 300.0, 300.0, verified, error, "r", 0.1)
    assert isinstance(outcome, Outcome)
    assert outcome.ok is ok


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_every_actuator_takes_the_one_shape() -> None:
    """A module named ``actuator.py`` builds on ``actuation.py`` (its read-back and error
    words), and none writes the error wording of its own."""
    actuators = sorted(PACKAGE.rglob("actuator.py"))
    assert {p.parent.name for p in actuators} >= {"agent", "bmc"}
    for path in actuators:
        assert "polca.actuation" in _imports(path), f"{path} does not use polca.actuation"
        assert "type(exc).__name__" not in path.read_text(encoding="utf-8"), path
