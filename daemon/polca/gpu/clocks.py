"""Pure helpers for SM clock values: which clock a GPU will actually accept.

NVML lists the SM clocks a GPU supports (``supported_sm_clocks_mhz`` in ``GpuInfo``); a
lock request between two of them is rounded by the driver in ways NVIDIA does not
document. The actuator snaps requests itself, with this function, so that what it logs and
publishes is what the GPU runs. No I/O here, no NVML.
"""

from __future__ import annotations

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
