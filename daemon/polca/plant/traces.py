"""Long, reproducible runs of a simulated CDU: a manual clock, a day of load, traces.

``run_trace`` drives any ``SimulatedCdu`` with a heat profile (faults can be injected
between samples); ``healthy_day`` is a fault-free day under ``DiurnalLoad``, what the alarm
tests use to check that a healthy plant raises nothing; ``ManualClock`` makes any run
reproducible. Generators over the model: no threads, no I/O, no wall clock.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from polca.plant.cdu import SimulatedCdu
from polca.plant.ratings import CduRatings
from polca.plant.sample import CduSample
from polca.seeds import MASK64, mix64

__all__ = ["DiurnalLoad", "ManualClock", "healthy_day", "run_trace"]


class ManualClock:
    """A clock that only moves when told: inject it for reproducible runs."""

    def __init__(self, start_s: float = 0.0) -> None:
        """Start at ``start_s`` seconds."""
        self.now_s = start_s

    def __call__(self) -> float:
        """The current time in seconds."""
        return self.now_s

    def advance(self, delta_s: float) -> float:
        """Move forward by ``delta_s`` seconds; returns the new time."""
        self.now_s += delta_s
        return self.now_s


@functools.lru_cache(maxsize=64)
def _jitter(seed: int, slot: int) -> float:
    """A uniform value in [-1, 1] for one time slot (a hash, so it needs no state)."""
    return mix64((seed << 32) ^ slot) / MASK64 * 2.0 - 1.0


@dataclass(frozen=True, slots=True)
class DiurnalLoad:
    """A day of IT load on one loop, as heat (kW): a diurnal swing plus 5-minute steps.

    Between ``low_fraction`` and ``high_fraction`` of the CDU's capacity: lowest at 04:00,
    highest at 16:00, with a seeded level change every ``step_s`` of up to
    ``jitter_fraction`` of capacity. Deterministic for a seed.
    """

    capacity_kw: float
    seed: int = 0
    low_fraction: float = 0.45
    high_fraction: float = 0.85
    jitter_fraction: float = 0.04
    step_s: float = 300.0

    def __call__(self, t_s: float) -> float:
        """The heat input at ``t_s`` seconds after midnight."""
        phase = 2.0 * math.pi * ((t_s / 86_400.0) - 4.0 / 24.0)
        swing = 0.5 - 0.5 * math.cos(phase)  # 0 at 04:00, 1 at 16:00
        mid = self.low_fraction + (self.high_fraction - self.low_fraction) * swing
        jitter = _jitter(self.seed, int(t_s // self.step_s))
        fraction = mid + self.jitter_fraction * jitter
        lo, hi = self.low_fraction - self.jitter_fraction, self.high_fraction
        return self.capacity_kw * min(hi, max(lo, fraction))


def run_trace(
    plant: SimulatedCdu,
    *,
    heat_kw: Callable[[float], float],
    duration_s: float,
    step_s: float = 1.0,
    start_s: float = 0.0,
    facility_supply_c: Callable[[float], float] | None = None,
) -> Iterator[CduSample]:
    """Drive ``plant`` with ``heat_kw(t)`` and yield one sample per ``step_s``.

    Times are explicit (``now_s``), so the plant's clock does not matter; faults can be
    injected on ``plant`` between two samples. Samples are yielded also while telemetry is
    lost (``telemetry_lost`` is set): skip those to get what a subscriber would see.
    """
    steps = round(duration_s / step_s)
    for k in range(1, steps + 1):
        t_prev = start_s + (k - 1) * step_s
        plant.set_heat_input_kw(heat_kw(t_prev), now_s=t_prev)
        if facility_supply_c is not None:
            plant.set_facility_supply_c(facility_supply_c(t_prev), now_s=t_prev)
        yield plant.sample(now_s=start_s + k * step_s)


def healthy_day(
    *,
    ratings: CduRatings | None = None,
    seed: int = 0,
    cdu: str = "cdu1",
    loop: str = "loop1",
    duration_s: float = 86_400.0,
    step_s: float = 1.0,
    epoch_ns: int = 0,
) -> Iterator[CduSample]:
    """A healthy CDU through a day of diurnal load (``DiurnalLoad``), one sample per step.

    No fault is injected: every reading stays within its normal band (supply at the
    setpoint within the noise, flow at design, return below setpoint + max delta-T). The
    alarm tests use it to check that a healthy day raises nothing.
    """
    rated = ratings if ratings is not None else CduRatings()
    load = DiurnalLoad(rated.heat_capacity_kw, seed=seed)
    clock = ManualClock()
    plant = SimulatedCdu(
        cdu, loop=loop, ratings=rated, seed=seed, clock=clock, epoch_ns=epoch_ns, heat_kw=load(0)
    )
    return run_trace(plant, heat_kw=load, duration_s=duration_s, step_s=step_s)
