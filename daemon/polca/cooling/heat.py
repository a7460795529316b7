"""A cooling loop's heat: what its racks put in, what the CDU removes, and their balance.

Why this module exists: the heat balance is the supervision's one estimator (filters, a
lag, a settling time), the evidence behind ``sensor_disagreement``, and it changes for its
own reasons (a better lag model, another filter). Pure: no I/O, no clock (``now_s`` comes
in, monotonic).

**Heat.** The loop's heat load is the sum of its racks' power times ``capture_fraction``.
Heat removed is measured as flow x density x cp x (return - supply), or the CDU's
``heat_removed_kw`` when it does not report all three. The heat balance compares the two
after the same filter (``heat_balance_window_s``), the electrical side first delayed by the
loop's lag (``heat_balance_lag_s``); it is not judged below ``min_load_kw`` or while a
rack's power is unknown, nor while flow_low (or pump_failure at critical) is active: a loop
starved of flow stores heat rather than removing it (the supervisor then ``reset``s it).
After each such gap (and at start) the filters settle for two windows before the balance
is judged again. A negative error (less heat in the coolant than the racks put out) means a
sensor reading low, or heat escaping to room air because the cold plates are starved (a
bypass, a clogged manifold); a positive one, a sensor reading high or a
``capture_fraction`` set too low. Either way ``sensor_disagreement`` says: do not trust the
loop's readings, and check them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from polca.cooling.evidence import Reading
from polca.cooling.loops import LoopSpec

__all__ = ["HeatBalance", "heat_load_kw", "heat_removed_kw"]

_SECONDS_PER_MINUTE: Final = 60.0
_W_PER_KW: Final = 1000.0
# After a (re)start the heat balance settles this many filter windows before it is judged,
# so that neither the first sample nor a transient (heat stored while flow was lost and
# flushed when it returns) weighs more than e**-2 = 14% in the filtered values.
_BALANCE_SETTLE_WINDOWS: Final = 2.0


def heat_load_kw(
    spec: LoopSpec, rack_power_w: Mapping[str, float]
) -> tuple[float, tuple[str, ...]]:
    """The heat the racks put into the loop, and the racks whose power is unknown."""
    power_w = 0.0
    missing: tuple[str, ...] = ()
    for rack in spec.racks:  # a plain loop: this runs every second for every loop
        rack_w = rack_power_w.get(rack)
        if rack_w is None:
            missing = (*missing, rack)
        else:
            power_w += rack_w
    return power_w * spec.capture_fraction / _W_PER_KW, missing


def heat_removed_kw(spec: LoopSpec, reading: Reading, delta_t_c: float | None) -> float | None:
    """Heat removed: flow x density x cp x dT, else the CDU's own figure, else None."""
    if reading.flow_lpm is not None and delta_t_c is not None:
        kg_per_s = reading.flow_lpm / _SECONDS_PER_MINUTE * spec.coolant_density_kg_per_l
        return kg_per_s * spec.coolant_cp_kj_per_kg_k * delta_t_c
    return reading.heat_removed_kw


@dataclass(slots=True)
class HeatBalance:
    """Filters of the heat balance of one loop (see the module docstring)."""

    last_s: float | None = None
    since_s: float = 0.0  # when the filters (re)started
    expected_kw: float = 0.0  # heat load, lagged like the loop
    expected_f_kw: float = 0.0
    measured_f_kw: float = 0.0

    def reset(self) -> None:
        """Stop judging: the next ``update`` restarts the filters (and their settling)."""
        self.last_s = None

    def update(self, spec: LoopSpec, load_kw: float, measured_kw: float, now_s: float) -> None:
        """Filter one pair of heat load and heat removed, taken at ``now_s``."""
        if self.last_s is None:
            self.since_s = now_s
            self.expected_kw = self.expected_f_kw = load_kw
            self.measured_f_kw = measured_kw
        else:
            dt_s = max(0.0, now_s - self.last_s)
            lag = (
                1.0
                if spec.heat_balance_lag_s <= 0
                else 1 - math.exp(-dt_s / spec.heat_balance_lag_s)
            )
            win = 1 - math.exp(-dt_s / spec.heat_balance_window_s)
            self.expected_kw += lag * (load_kw - self.expected_kw)
            self.expected_f_kw += win * (self.expected_kw - self.expected_f_kw)
            self.measured_f_kw += win * (measured_kw - self.measured_f_kw)
        self.last_s = now_s

    def error_pct(self, spec: LoopSpec, now_s: float) -> float | None:
        """The filtered, signed error (measured vs expected); None while not judged."""
        if (
            self.last_s is None
            or now_s - self.since_s < _BALANCE_SETTLE_WINDOWS * spec.heat_balance_window_s
            or self.expected_f_kw < spec.min_load_kw
        ):
            return None
        return 100.0 * (self.measured_f_kw - self.expected_f_kw) / self.expected_f_kw
