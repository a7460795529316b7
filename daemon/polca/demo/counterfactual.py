"""What polca's caps cost and save: the demo row's GPUs never capped, and clocks per class.

``Counterfactual`` runs the same GPUs as the row (one ``SimulatedBackend`` per node, with
the node's seed and trace loads) under the same load, never capped: the replay's
utilization does not depend on the caps, so its power is what the row would draw without
polca. ``ClassClocks`` accumulates, per priority class, the mean SM clock and the mean
work slowdown at the clocks the GPUs ran, by the planner's clock -> latency relation, so
that the demo's latency cost per class is the planner's model of it. The view compares
the row's with the counterfactual's. No I/O; reads the simulated GPUs when asked.
"""

from __future__ import annotations

from typing import Final

from polca.demo.options import NON_GPU_W
from polca.gpu.simulated import SimulatedBackend
from polca.physics import power
from polca.physics.presets import get_model

__all__ = ["DECODE_SHARE", "ClassClocks", "Counterfactual"]

DECODE_SHARE: Final = 0.5
"""Share of a busy GPU's time spent decoding, as the planner's ``--decode-share`` default."""


class ClassClocks:
    """Per priority class, over GPU samples: the mean SM clock, and the mean work slowdown
    of the busy GPUs at the clocks they ran, by the planner's clock -> latency relation
    (``physics.power.work_slowdown``, with the profile's exponents for the demo's GPU
    model), so that the demo's latency cost per class is the planner's model of it."""

    def __init__(self, model: str) -> None:
        from polca.sim.profile import shipped_profile  # noqa: PLC0415 - no numpy needed

        gpu, _ = shipped_profile(model.lower()).values()
        self.prefill_exponent = float(gpu["prefill_clock_exponent"])
        self.decode_exponent = float(gpu["decode_clock_exponent"])
        self.max_clock_mhz = get_model(model).sm_clock_max_mhz
        self._clock: dict[str, list[float]] = {}  # class -> [MHz sum, samples]
        self._slowdown: dict[str, list[float]] = {}  # class -> [slowdown sum, busy samples]

    def add(self, cls: str, sm_clock_mhz: int | None, util_pct: float | None) -> None:
        """One GPU sample; idle GPUs (no utilization) carry no work, so no slowdown."""
        if sm_clock_mhz is None:
            return
        _accumulate(self._clock, cls, sm_clock_mhz)
        if not sm_clock_mhz > 0 or not (util_pct or 0.0) > 0.0:
            return
        slow = power.work_slowdown(
            min(1.0, sm_clock_mhz / self.max_clock_mhz),
            decode_share=DECODE_SHARE,
            prefill_clock_exponent=self.prefill_exponent,
            decode_clock_exponent=self.decode_exponent,
        )
        _accumulate(self._slowdown, cls, slow)

    def classes(self) -> list[str]:
        """The classes seen so far, sorted."""
        return sorted(self._clock)

    def mean_clock_mhz(self, cls: str) -> float | None:
        """The class's time-averaged SM clock so far."""
        return _mean(self._clock, cls)

    def mean_slowdown(self, cls: str) -> float | None:
        """The class's mean slowdown so far (1.0: as fast as at the maximum clock)."""
        return _mean(self._slowdown, cls)


def _accumulate(sums: dict[str, list[float]], cls: str, value: float) -> None:
    acc = sums.setdefault(cls, [0.0, 0.0])
    acc[0] += value
    acc[1] += 1


def _mean(sums: dict[str, list[float]], cls: str) -> float | None:
    total, count = sums.get(cls, (0.0, 0.0))
    return total / count if count else None


class Counterfactual:
    """The same row's GPUs under the same load, never capped: what polca's caps save.

    One ``SimulatedBackend`` per node with the node's seed and trace loads (the replay's
    utilization does not depend on the caps), read once a second on the event loop.
    """

    def __init__(
        self,
        backends: list[SimulatedBackend],
        classes: dict[int, str],
        clocks: ClassClocks,
    ) -> None:
        """``classes``: GPU index -> priority class (as the policy assigns them)."""
        self.backends = backends
        self.classes = classes
        self.clocks = clocks
        self._gpus = [(b, [info.index for info in b.discover()]) for b in backends]

    def sample(self) -> tuple[float, dict[str, float]]:
        """Row power now (every GPU plus each node's non-GPU power), and the GPU power of
        each priority class."""
        total = NON_GPU_W * len(self.backends)
        by_class: dict[str, float] = {}
        for backend, indices in self._gpus:
            for index in indices:
                sample = backend.sample(index)
                power_w = (sample.power_mw or 0) / 1000.0
                total += power_w
                cls = self.classes.get(index)
                if cls is not None:
                    by_class[cls] = by_class.get(cls, 0.0) + power_w
                    self.clocks.add(cls, sample.sm_clock_mhz, sample.gpu_util_pct)
        return total, by_class
