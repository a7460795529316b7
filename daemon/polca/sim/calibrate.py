"""Fit a GPU profile's clock relations to a measured clock sweep (pure, numpy).

``bench/gpu_check.py --profile-out FILE`` locks a real GPU's SM clock at several values and,
at each, runs a compute-bound kernel (a prefill stand-in: a large FP16 matmul) and a
memory-bound one (a decode stand-in: streaming a large tensor), recording mean power and
the time per iteration. This module turns those points into the profile fields the
simulator uses (``polca.sim.profile``):

- ``prefill_clock_exponent`` / ``decode_clock_exponent``: time ~ (f_max / f) ** e, fitted by
  least squares on the logs;
- ``clock_power_exponent`` and ``prefill_mem_share``: the compute kernel's power above the
  resident power, ``dyn(f) = dyn(1) (m + (1 - m) f ** a)``, fitted on a grid of (m, a);
- ``decode_mem_share``: the memory kernel's share, with the exponent fixed to the compute
  kernel's (one SM power curve per GPU);
- ``resident_power_w``: the idle reading, when measured.

Every other field keeps the base profile's value and source; each fitted one names the
sweep as its source, with the fit's residual.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from polca.errors import SimConfigError
from polca.sim.profile import SimProfile, dump_profile


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One locked clock: the kernel's mean power and its time per iteration."""

    sm_clock_mhz: float
    power_w: float
    seconds_per_iter: float


def _checked(points: Sequence[SweepPoint], max_mhz: float, what: str) -> None:
    if len(points) < 3:
        msg = f"{what}: a fit needs at least 3 clocks, got {len(points)}"
        raise SimConfigError(msg)
    for p in points:
        values = (p.sm_clock_mhz, p.power_w, p.seconds_per_iter)
        if not all(math.isfinite(v) and v > 0 for v in values) or p.sm_clock_mhz > max_mhz:
            msg = (
                f"{what}: a point must have a clock in (0, {max_mhz:g}] MHz and positive "
                f"readings: {p}"
            )
            raise SimConfigError(msg)


def fit_time_exponent(points: Sequence[SweepPoint], *, max_mhz: float) -> tuple[float, float]:
    """(e, rms of the log residual) for ``t(f) = t(f_max) (f_max / f) ** e``."""
    _checked(points, max_mhz, "time fit")
    x = np.log(max_mhz / np.array([p.sm_clock_mhz for p in points]))
    y = np.log(np.array([p.seconds_per_iter for p in points]))
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    return float(max(0.0, slope)), float(np.sqrt(np.mean(residual**2)))


def fit_power_curve(
    points: Sequence[SweepPoint],
    *,
    max_mhz: float,
    resident_w: float,
    exponent: float | None = None,
) -> tuple[float, float, float]:
    """(mem_share, exponent, rms error in W) for ``P(f) = R + D (m + (1 - m) (f/f_max)^a)``,
    with D the dynamic power at the highest clock swept; ``exponent`` fixes ``a``."""
    _checked(points, max_mhz, "power fit")
    f = np.array([p.sm_clock_mhz for p in points]) / max_mhz
    watts = np.array([p.power_w for p in points])
    top = int(np.argmax(f))
    dynamic_top = watts[top] - resident_w
    if dynamic_top <= 0:
        msg = f"power fit: the kernel drew no more than the resident {resident_w:g} W"
        raise SimConfigError(msg)
    shares = np.linspace(0.0, 0.95, 96)
    exponents = np.array([exponent]) if exponent is not None else np.linspace(1.0, 4.0, 121)
    best = (math.inf, 0.0, 0.0)
    for a in exponents:
        scale_top = f[top] ** a
        for m in shares:
            # Normalise so that the highest clock swept draws what it drew.
            norm = m + (1 - m) * scale_top
            model = resident_w + dynamic_top * (m + (1 - m) * f**a) / norm
            err = float(np.sqrt(np.mean((model - watts) ** 2)))
            if err < best[0]:
                best = (err, float(m), float(a))
    return best[1], best[2], best[0]


def calibrated_profile(
    base: SimProfile,
    *,
    name: str,
    where: str,
    prefill: Sequence[SweepPoint],
    decode: Sequence[SweepPoint],
    resident_w: float | None = None,
) -> str:
    """The text of ``base`` with the fitted fields replaced; ``where`` (GPU and date) goes
    into each fitted field's source."""
    gpu, server = base.values()
    sources = base.sources()
    max_mhz = float(gpu["sm_clock_max_mhz"])
    resident = float(resident_w) if resident_w is not None else float(gpu["resident_power_w"])
    if resident_w is not None:
        gpu["resident_power_w"] = round(resident, 1)
        sources["resident_power_w"] = f"measured idle on {where}"
    e_p, r_p = fit_time_exponent(prefill, max_mhz=max_mhz)
    e_d, r_d = fit_time_exponent(decode, max_mhz=max_mhz)
    m_p, a, w_p = fit_power_curve(prefill, max_mhz=max_mhz, resident_w=resident)
    m_d, _, w_d = fit_power_curve(decode, max_mhz=max_mhz, resident_w=resident, exponent=a)
    fitted = {
        "prefill_clock_exponent": (
            e_p,
            f"matmul sweep on {where}: {len(prefill)} clocks, log rms {r_p:.3f}",
        ),
        "decode_clock_exponent": (
            e_d,
            f"memory sweep on {where}: {len(decode)} clocks, log rms {r_d:.3f}",
        ),
        "clock_power_exponent": (a, f"matmul power sweep on {where}: rms {w_p:.1f} W"),
        "prefill_mem_share": (m_p, f"matmul power sweep on {where}: rms {w_p:.1f} W"),
        "decode_mem_share": (m_d, f"memory power sweep on {where}: rms {w_d:.1f} W"),
    }
    for key, (value, source) in fitted.items():
        gpu[key] = round(value, 3)
        sources[key] = source
    return dump_profile(
        name,
        gpu,
        server,
        sources=sources,
        description=f"{base.description} Clock relations fitted on {where}.".strip(),
    )


__all__ = [
    "SweepPoint",
    "calibrated_profile",
    "fit_power_curve",
    "fit_time_exponent",
]
