"""snap_sm_clock_mhz: the SM clock a lock request turns into."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.gpu.clocks import snap_down_to_grid_mhz, snap_sm_clock_mhz
from polca.physics.presets import MODEL_NAMES, get_model

H100_CLOCKS_MHZ = tuple(range(1980, 344, -15))


@pytest.mark.parametrize(
    ("requested_mhz", "expected_mhz"),
    [
        (1980, 1980),  # exact, highest
        (5000, 1980),  # above everything: the highest
        (1500, 1500),  # exact, in the middle
        (1509, 1500),  # between two: the lower one
        (1514, 1500),
        (345, 345),  # exact, lowest
        (100, 345),  # below everything: the lowest
    ],
)
def test_snap_on_h100_clocks(requested_mhz: int, expected_mhz: int) -> None:
    """Largest supported clock at or below the request, else the lowest supported."""
    assert snap_sm_clock_mhz(requested_mhz, H100_CLOCKS_MHZ) == expected_mhz


def test_snap_accepts_any_order() -> None:
    """The supported list need not be sorted."""
    assert snap_sm_clock_mhz(1000, [1410, 810, 1200, 990]) == 990


def test_snap_without_a_list_keeps_the_request() -> None:
    """No known clocks: the request passes through for the driver to decide."""
    assert snap_sm_clock_mhz(1234, ()) == 1234


@given(
    requested_mhz=st.integers(min_value=0, max_value=4000),
    supported_mhz=st.lists(st.integers(min_value=1, max_value=4000), min_size=1, max_size=50),
)
def test_snap_returns_a_supported_clock_never_above_the_request_unless_forced(
    requested_mhz: int, supported_mhz: list[int]
) -> None:
    """The result is supported, and above the request only when nothing lower exists."""
    snapped = snap_sm_clock_mhz(requested_mhz, supported_mhz)
    assert snapped in supported_mhz
    if snapped > requested_mhz:
        assert snapped == min(supported_mhz)
        assert all(mhz > requested_mhz for mhz in supported_mhz)
    else:
        assert not any(snapped < mhz <= requested_mhz for mhz in supported_mhz)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_grid_snap_agrees_with_the_list_snap_on_every_whole_mhz(name: str) -> None:
    """On a preset's evenly spaced grid the O(1) snap answers as the list scan does."""
    model = get_model(name)
    grid = {
        "min_mhz": model.sm_clock_min_mhz,
        "max_mhz": model.sm_clock_max_mhz,
        "step_mhz": model.sm_clock_step_mhz,
    }
    for requested_mhz in range(model.sm_clock_max_mhz + 200):
        assert snap_down_to_grid_mhz(requested_mhz, **grid) == snap_sm_clock_mhz(
            requested_mhz, model.supported_sm_clocks_mhz
        ), requested_mhz


def test_grid_snap_forgives_rounding_just_below_a_grid_clock() -> None:
    """A computed clock a hair below a grid clock is that clock; a real shortfall is not."""
    grid = {"min_mhz": 345, "max_mhz": 1980, "step_mhz": 15}
    assert snap_down_to_grid_mhz(1500.0 - 1e-9, **grid) == 1500
    assert snap_down_to_grid_mhz(1499.9, **grid) == 1485
    assert snap_down_to_grid_mhz(-50.0, **grid) == 345
    assert snap_down_to_grid_mhz(1e6, **grid) == 1980
