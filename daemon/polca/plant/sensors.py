"""What a simulated CDU's instruments report: noisy, stuck and drifting readings, and leaks.

The plant model (``model.py``) knows the truth; a real CDU only reports what its
sensors read. ``Sensors`` turns the model's perfect readings into reported ones: seeded,
bounded Gaussian-like noise on every reading, and the sensor faults (a reading stuck at a
value, one drifting linearly away from the truth). ``LeakDetectors`` are the CDU's leak
sensors: each dry, or wet since some time (warning), going critical after a while.

Deterministic for a seed and the same sequence of calls; time is passed in; no I/O.
"""

from __future__ import annotations

import random

from polca.plant.sample import LeakState

__all__ = [
    "NOISE_CLIP_SIGMA",
    "SENSORS",
    "TEMP_NOISE_C",
    "LeakDetectors",
    "Sensors",
    "check_sensor",
]

TEMP_NOISE_C = 0.1  # sensor noise, one standard deviation
FLOW_NOISE_FRACTION = 0.004  # of the design flow
PRESSURE_NOISE_KPA = 0.5
VALVE_NOISE_PCT = 0.3
NOISE_CLIP_SIGMA = 3.0  # noise is bounded: no reading strays beyond 3 sigma (see read)

SENSORS: tuple[str, ...] = (
    "secondary.supply_temp_c",
    "secondary.return_temp_c",
    "secondary.flow_lpm",
    "secondary.delta_pressure_kpa",
    "primary.supply_temp_c",
    "primary.return_temp_c",
    "primary.flow_lpm",
    "valve_position_pct",
)
"""Readings that ``stick_sensor`` and ``drift_sensor`` accept (CduTelemetry dotted paths)."""


def check_sensor(sensor: str) -> None:
    """Raise ``ValueError`` naming the known sensors unless ``sensor`` is one."""
    if sensor not in SENSORS:
        msg = f"unknown sensor {sensor!r}; known: {', '.join(SENSORS)}"
        raise ValueError(msg)


class Sensors:
    """The CDU's eight analogue sensors (``SENSORS``), with their noise and faults."""

    def __init__(self, *, design_flow_lpm: float, seed: int) -> None:
        """Noise from a generator seeded with ``seed``; flow noise scaled to the design."""
        self._rng = random.Random(seed)  # noqa: S311 - simulation noise, not cryptography
        self._stuck: dict[str, float] = {}
        self._drift: dict[str, tuple[float, float]] = {}  # sensor -> (rate per s, since)
        self._last: list[float] = []  # the last reported value of each of SENSORS
        flow_sigma = FLOW_NOISE_FRACTION * design_flow_lpm
        self._two_sigmas = tuple(
            2.0 * sigma
            for sigma in (
                TEMP_NOISE_C,
                TEMP_NOISE_C,
                flow_sigma,
                PRESSURE_NOISE_KPA,
                TEMP_NOISE_C,
                TEMP_NOISE_C,
                flow_sigma,
                VALVE_NOISE_PCT,
            )
        )

    def read(self, true_values: list[float], t: float) -> list[float]:
        """What the sensors report at ``t`` for the model's ``true_values`` (SENSORS order)."""
        # Bounded noise: the sum of three uniforms (Irwin-Hall), scaled to one sigma, is
        # bell-shaped, cheap and never beyond NOISE_CLIP_SIGMA = 3 sigma. It is drawn for
        # every sensor, faulty or not, so a fault does not shift the others' noise.
        rand = self._rng.random
        values = [
            v + (rand() + rand() + rand() - 1.5) * two_sigma
            for v, two_sigma in zip(true_values, self._two_sigmas, strict=True)
        ]
        if self._drift or self._stuck:
            for i, sensor in enumerate(SENSORS):
                drift = self._drift.get(sensor)
                if drift is not None:
                    values[i] += drift[0] * (t - drift[1])
                stuck = self._stuck.get(sensor)
                if stuck is not None:
                    values[i] = stuck
        values[2] = max(0.0, values[2])  # flows
        values[6] = max(0.0, values[6])
        values[7] = min(100.0, max(0.0, values[7]))  # valve
        self._last = values
        return values

    def last(self, sensor: str) -> float | None:
        """The value ``sensor`` last reported, or None before the first reading."""
        return self._last[SENSORS.index(sensor)] if self._last else None

    def stick(self, sensor: str, value: float) -> None:
        """Freeze ``sensor`` at ``value``."""
        check_sensor(sensor)
        self._stuck[sensor] = value

    def unstick(self, sensor: str | None) -> None:
        """Let a frozen reading (None: all) follow the process again."""
        if sensor is None:
            self._stuck.clear()
        else:
            self._stuck.pop(sensor, None)

    def drift(self, sensor: str, rate_per_s: float, *, since_s: float) -> None:
        """Make ``sensor`` drift by ``rate_per_s`` units per second from ``since_s`` on."""
        check_sensor(sensor)
        self._drift[sensor] = (rate_per_s, since_s)

    def clear_drift(self, sensor: str | None) -> None:
        """Recalibrate a drifting sensor (None: all)."""
        if sensor is None:
            self._drift.clear()
        else:
            self._drift.pop(sensor, None)


class LeakDetectors:
    """The CDU's leak detectors ``leak1``..``leakN``: dry, or wet (warning, then critical)."""

    def __init__(self, count: int) -> None:
        """``count`` detectors, all dry."""
        self.names = tuple(f"leak{i + 1}" for i in range(count))
        self._wet: dict[int, tuple[float, float | None]] = {}  # index -> (since, escalate)
        self._dry: tuple[tuple[str, LeakState], ...] = tuple((name, "ok") for name in self.names)

    def __bool__(self) -> bool:
        """Whether any detector is wet."""
        return bool(self._wet)

    def wet(self, detector: int, *, since_s: float, escalate_after_s: float | None) -> None:
        """Detector ``detector`` is wet from ``since_s``; critical after ``escalate_after_s``."""
        self._wet[detector] = (since_s, escalate_after_s)

    def dry(self, detector: int | None) -> None:
        """Dry one detector (None: all)."""
        if detector is None:
            self._wet.clear()
        else:
            self._wet.pop(detector, None)

    def states(self, t: float) -> tuple[tuple[str, LeakState], ...]:
        """``(name, state)`` of every detector at ``t``."""
        if not self._wet:
            return self._dry
        states: list[tuple[str, LeakState]] = []
        for i, name in enumerate(self.names):
            leak = self._wet.get(i)
            if leak is None:
                states.append((name, "ok"))
                continue
            since, escalate = leak
            critical = escalate is not None and t - since >= escalate
            states.append((name, "critical" if critical else "warning"))
        return tuple(states)
