"""Load profiles of the simulated GPUs: SM utilization as a pure function of time.

The simulated backend asks its profile for the utilization of a GPU at each integration
sub-step and derives clocks, power and temperature from it. The profiles live apart from
the physics so that they can be read, tested and extended on their own: idle and constant
load, bursty LLM inference, a ramp, a square wave (the worst row swing), and a scripted
trace. ``load_profile(spec)`` builds one from its settings name
(``gpu.simulated_load``).

Profiles are pure: the same ``(t_s, stream)`` always gives the same utilization, so a
seeded simulation repeats exactly. The randomness they need comes from
``polca.seeds.mix64``, a counter-based hash that the backend also uses to derive per-GPU
streams and UUIDs. Profiles say what a GPU is asked to do, never how it responds (clocks,
power and heat are ``polca.physics`` and the backend's); like the backend, this module
must stay free of I/O and threads.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from polca.seeds import MASK64, mix64


def _uniform(stream: int, key: int) -> float:
    """A uniform number in [0, 1) that depends only on ``stream`` and ``key``."""
    return mix64(stream ^ mix64(key & MASK64)) / 2.0**64


@runtime_checkable
class LoadProfile(Protocol):
    """SM utilization (0..1) as a pure function of time since the start of the simulation.

    ``stream`` is a per-GPU number derived from the seed; profiles with randomness use it so
    that GPUs differ and a run repeats exactly.
    """

    def utilization(self, t_s: float, stream: int) -> float:
        """Return the utilization at ``t_s`` seconds for the GPU of ``stream``."""
        ...


@dataclass(frozen=True, slots=True)
class ConstantLoad:
    """The same utilization forever; ``ConstantLoad(0.0)`` is an idle GPU."""

    util: float = 1.0

    def __post_init__(self) -> None:
        _check_util(self.util, "util")

    def utilization(self, t_s: float, stream: int) -> float:
        """Return the constant utilization."""
        return self.util


@dataclass(frozen=True, slots=True)
class InferenceLoad:
    """LLM serving: decode at 60-70 % with prefill bursts near 100 % on top.

    Time is cut into slots of ``slot_s``; a prefill burst starts in a slot with probability
    ``prefill_probability`` and lasts 1 to ``prefill_max_slots`` slots. The decode level is
    redrawn every ``slots_per_epoch`` slots (batch composition changes), with a little
    per-slot jitter.
    Each GPU gets its own random stream and phase, so a node's power swings less than one
    GPU's, as in a real row. The numbers follow the simulator recipe in
    ``polca-paper.md`` §4.2 [U].
    """

    decode_util_low: float = 0.60
    decode_util_high: float = 0.70
    prefill_util: float = 1.0
    prefill_probability: float = 0.1
    prefill_max_slots: int = 3
    slot_s: float = 0.25
    slots_per_epoch: int = 20  # the decode level changes every 5 s
    jitter: float = 0.03
    # Utilization is constant within a slot and the integrator takes several sub-steps per
    # slot: remember recent slots. Values are pure, so sharing and clearing are safe.
    _cache: dict[tuple[int, int], float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def utilization(self, t_s: float, stream: int) -> float:
        """Return the utilization at ``t_s``: a prefill burst or the decode level."""
        phase = (stream & 0xFFFF) / 65536.0 * self.slots_per_epoch  # per-GPU, in slots
        slot = math.floor(t_s / self.slot_s + phase)
        key = (stream, slot)
        util = self._cache.get(key)
        if util is None:
            if len(self._cache) >= 4096:
                self._cache.clear()
            util = self._cache[key] = self._slot_utilization(slot, stream)
        return util

    def _slot_utilization(self, slot: int, stream: int) -> float:
        for back in range(self.prefill_max_slots):
            h = mix64(stream ^ mix64(((slot - back) * 4 + 1) & MASK64))
            starts = (h & 0xFFFFFF) / 16777216.0 < self.prefill_probability
            if starts and (h >> 24) % self.prefill_max_slots >= back:
                return self.prefill_util - self.jitter * ((h >> 40) & 0xFF) / 256.0
        epoch = slot // self.slots_per_epoch
        level = self.decode_util_low + (self.decode_util_high - self.decode_util_low) * (
            _uniform(stream, epoch * 4 + 2)
        )
        level += self.jitter * (2.0 * _uniform(stream, slot * 4 + 3) - 1.0)
        return min(1.0, max(0.0, level))


@dataclass(frozen=True, slots=True)
class RampLoad:
    """Linear from ``low`` to ``high`` over ``period_s``; then again (``repeat``) or hold."""

    period_s: float = 60.0
    low: float = 0.0
    high: float = 1.0
    repeat: bool = True

    def __post_init__(self) -> None:
        _check_period(self.period_s)
        _check_util(self.low, "low")
        _check_util(self.high, "high")

    def utilization(self, t_s: float, stream: int) -> float:
        """Return the ramp value at ``t_s``."""
        frac = t_s / self.period_s
        frac = frac - math.floor(frac) if self.repeat else min(1.0, max(0.0, frac))
        return self.low + (self.high - self.low) * frac


@dataclass(frozen=True, slots=True)
class SquareLoad:
    """Alternates ``high`` (first ``duty`` of each period) and ``low``: the worst row swing.

    All GPUs switch together on purpose: that is the case a row cap must survive.
    """

    period_s: float = 10.0
    low: float = 0.1
    high: float = 1.0
    duty: float = 0.5

    def __post_init__(self) -> None:
        _check_period(self.period_s)
        _check_util(self.low, "low")
        _check_util(self.high, "high")
        _check_util(self.duty, "duty")

    def utilization(self, t_s: float, stream: int) -> float:
        """Return ``high`` or ``low`` depending on the phase of ``t_s``."""
        frac = t_s / self.period_s
        return self.high if frac - math.floor(frac) < self.duty else self.low


@dataclass(frozen=True, slots=True)
class ScriptedLoad:
    """A trace of ``(t_s, util)`` points, linearly interpolated (or stepped), held at the ends."""

    points: Sequence[tuple[float, float]]  # stored as a tuple
    interpolate: bool = True
    _times_s: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        points = tuple((float(t_s), float(util)) for t_s, util in self.points)
        if not points:
            msg = "a scripted load needs at least one (t_s, util) point"
            raise ValueError(msg)
        object.__setattr__(self, "points", points)
        times_s = tuple(t_s for t_s, _ in points)
        if any(b < a for a, b in itertools.pairwise(times_s)):
            msg = f"scripted load times must not decrease: {times_s}"
            raise ValueError(msg)
        for _, util in self.points:
            _check_util(util, "util")
        object.__setattr__(self, "_times_s", times_s)

    def utilization(self, t_s: float, stream: int) -> float:
        """Return the scripted utilization at ``t_s``."""
        i = bisect.bisect_right(self._times_s, t_s)
        if i == 0:
            return self.points[0][1]
        if i == len(self.points) or not self.interpolate:
            return self.points[i - 1][1]
        (t0_s, u0), (t1_s, u1) = self.points[i - 1], self.points[i]
        return u0 + (u1 - u0) * (t_s - t0_s) / (t1_s - t0_s)


def _check_util(value: float, name: str) -> None:
    if not 0.0 <= value <= 1.0:
        msg = f"{name} must be within 0..1, got {value}"
        raise ValueError(msg)


def _check_period(period_s: float) -> None:
    if not period_s > 0:
        msg = f"period_s must be positive, got {period_s}"
        raise ValueError(msg)


def load_profile(spec: str | LoadProfile) -> LoadProfile:
    """Build a profile from its settings name, with an optional argument after a colon.

    ``idle``, ``constant[:UTIL]`` (default 1.0), ``inference``, ``ramp[:PERIOD_S]``,
    ``square[:PERIOD_S]``. A ``LoadProfile`` is returned unchanged.
    """
    if not isinstance(spec, str):
        return spec
    name, _, arg = spec.strip().lower().partition(":")
    try:
        value = float(arg) if arg else None
        if name == "idle" and value is None:
            return ConstantLoad(0.0)
        if name == "constant":
            return ConstantLoad(1.0 if value is None else value)
        if name == "inference" and value is None:
            return InferenceLoad()
        if name == "ramp":
            return RampLoad() if value is None else RampLoad(period_s=value)
        if name == "square":
            return SquareLoad() if value is None else SquareLoad(period_s=value)
    except ValueError as exc:
        msg = f"invalid load profile {spec!r}: {exc}"
        raise ValueError(msg) from exc
    msg = (
        f"unknown load profile {spec!r}; use idle, constant[:UTIL], inference, "
        "ramp[:PERIOD_S] or square[:PERIOD_S]"
    )
    raise ValueError(msg)


__all__ = [
    "ConstantLoad",
    "InferenceLoad",
    "LoadProfile",
    "RampLoad",
    "ScriptedLoad",
    "SquareLoad",
    "load_profile",
]
