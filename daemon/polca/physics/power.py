"""How a GPU's power moves with its SM clock, and the clock a power limit leaves (pure).

polca has two GPU simulations and both model power the same way: the simulated backend
(``polca.gpu.simulated``: one GPU at a time, in plain floats, inside its integrator) and
the row simulator (``polca.sim``: every GPU of a row at once, in numpy arrays, per phase of
an inference request). Work that runs a GPU at the SM clock fraction ``x = f / f_max``
draws

    P(x) = base_w + dynamic_w * (m + (1 - m) * x ** a)

- ``base_w`` is what the GPU draws without the work's activity (the backend's idle power,
  the simulator's resident-model power);
- ``dynamic_w`` is the work's power above that at the maximum clock (the backend: the
  model's demand above idle times utilization; the simulator: the phase's power above
  resident);
- ``m`` (``mem_share``) is the share of the dynamic power spent in memory, which an SM
  clock lock does not reduce;
- ``a`` (``clock_power_exponent``) is how steeply the SM share falls with the clock:
  f x V^2 with the voltage rising with f, about 2.5.

The SM term ``x ** a`` is the *SM scale*. A power limit ``limit_w`` leaves the clock at
which ``P(x) = limit_w``: the SM scale ``((limit_w - base_w) / dynamic_w - m) / (1 - m)``,
then ``x = scale ** (1 / a)``. A scale at or below 0 means not even the lowest clock fits,
at or above 1 that the work fits at the maximum clock. What a GPU does then differs, so
callers clamp the scale themselves: the backend snaps to its supported clock grid
(``polca.gpu.clocks``), the simulator clips to its lowest lockable clock fraction.

Every function takes and returns floats or numpy arrays alike and uses only arithmetic
operators, so this module never imports numpy (the daemon installs without it) and each
caller keeps the arithmetic it had: Python floats in the backend's inner loop, whole arrays
in the simulator. No state, no clamping policy, no I/O. The per-phase serving model (how
prefill and decode power and speed depend on prompts, batches and clocks) is the
simulator's own, in ``polca.sim.model``, built on these functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# A float or an array of float64: the functions are written once for both.
FloatT = TypeVar("FloatT", float, "npt.NDArray[np.float64]")


def dynamic_scale(clock_frac: FloatT, *, mem_share: float, clock_power_exponent: float) -> FloatT:
    """The share of its full-clock dynamic power that work draws at ``clock_frac``.

    ``mem_share + (1 - mem_share) * clock_frac ** clock_power_exponent``: 1 at the
    maximum clock, ``mem_share`` in the limit of a stopped SM clock.
    """
    # A float power is typed Any (a negative base would give a complex): name its type.
    sm_scale: FloatT = clock_frac**clock_power_exponent
    return mem_share + (1.0 - mem_share) * sm_scale


def work_slowdown(
    clock_frac: FloatT,
    *,
    decode_share: float,
    prefill_clock_exponent: float,
    decode_clock_exponent: float,
) -> FloatT:
    """How much longer the same inference work takes at ``clock_frac`` of the maximum SM
    clock: prefill (compute-bound) time scales as ``f ** -prefill_clock_exponent``, decode
    (memory-bound) as ``f ** -decode_clock_exponent``, mixed by the share of busy time
    spent decoding. 1 at the maximum clock."""
    prefill: FloatT = clock_frac**-prefill_clock_exponent
    decode: FloatT = clock_frac**-decode_clock_exponent
    return (1.0 - decode_share) * prefill + decode_share * decode


def power_w(
    base_w: float,
    dynamic_w: FloatT,
    *,
    clock_frac: FloatT,
    mem_share: float,
    clock_power_exponent: float,
) -> FloatT:
    """Power of work drawing ``base_w + dynamic_w`` at the maximum clock, at ``clock_frac``."""
    scale = dynamic_scale(
        clock_frac, mem_share=mem_share, clock_power_exponent=clock_power_exponent
    )
    return base_w + dynamic_w * scale


def sm_scale_for_limit(
    base_w: float, dynamic_w: FloatT, *, limit_w: FloatT, mem_share: float
) -> FloatT:
    """The SM scale (``x ** a``) at which ``power_w`` equals ``limit_w``; unclamped.

    At or below 0 no clock fits the limit; at or above 1 the maximum clock does. Clamp it
    to [0, 1] (or branch) before ``clock_frac_for_sm_scale``: a negative scale has no root.
    """
    return ((limit_w - base_w) / dynamic_w - mem_share) / (1.0 - mem_share)


def clock_frac_for_sm_scale(sm_scale: FloatT, *, clock_power_exponent: float) -> FloatT:
    """The clock fraction whose SM scale is ``sm_scale`` (``sm_scale`` must be >= 0)."""
    clock_frac: FloatT = sm_scale ** (1.0 / clock_power_exponent)
    return clock_frac


__all__ = [
    "clock_frac_for_sm_scale",
    "dynamic_scale",
    "power_w",
    "sm_scale_for_limit",
    "work_slowdown",
]
