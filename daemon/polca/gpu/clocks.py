"""Pure helpers for SM clock values: which clock a GPU will actually accept.

NVML lists the SM clocks a GPU supports (``supported_sm_clocks_mhz`` in ``GpuInfo``); a
lock request between two of them is rounded by the driver in ways NVIDIA does not
document. The actuator snaps requests itself, with ``snap_sm_clock_mhz``, so that what it
logs and publishes is what the GPU runs; the simulated backend snaps the clocks its model
computes to its evenly spaced grid with ``snap_down_to_grid_mhz``, the same rule in
constant time. No I/O here, no NVML.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def snap_sm_clock_mhz(requested_mhz: int, supported_mhz: Sequence[int]) -> int:
    """The largest supported clock not above ``requested_mhz``, else the lowest supported.

    ``supported_mhz`` may come in any order. With no list (an unknown GPU) the request is
    returned unchanged: the driver then decides.
    """
    if not supported_mhz:
        return requested_mhz
    at_or_below = [mhz for mhz in supported_mhz if mhz <= requested_mhz]
    if at_or_below:
        return max(at_or_below)
    return min(supported_mhz)


def snap_down_to_grid_mhz(clock_mhz: float, *, min_mhz: int, max_mhz: int, step_mhz: int) -> int:
    """``snap_sm_clock_mhz`` for evenly spaced clocks, in constant time, for a computed clock.

    The supported clocks are ``min_mhz, min_mhz + step_mhz, ...`` up to ``max_mhz`` (the
    simulated GPUs' grid, ``polca.physics.presets``). ``clock_mhz`` may be a float that a
    model computed: one a billionth of a step below a grid clock (rounding) counts as that
    clock. On a grid whose span is a whole number of steps it answers whole MHz as
    ``snap_sm_clock_mhz`` answers for the grid's list (a test checks); it exists because
    the simulated backend snaps inside its integrator, where a scan of the list is too slow.
    """
    steps = math.floor((clock_mhz - min_mhz) / step_mhz + 1e-9)
    return min(max_mhz, min_mhz + max(0, steps) * step_mhz)
