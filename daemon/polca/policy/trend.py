"""The row power trend (W/s) that the ladder's brake-on-trend rule extrapolates (pure).

``next_level`` (``polca.policy.ladder``) jumps to the brake when the row power, carried
forward by its trend for ``policy.trend.reaction_s``, would reach the budget. The aggregator
computes that trend from each row's power history, and the simulator from its simulated
row's, with this one function, so a policy behaves the same in both. It takes the history
and the time as inputs and keeps nothing: no clock, no I/O, no imports beyond the standard
library (the policy package stays pure).
"""

from __future__ import annotations

from collections.abc import Iterable


def trend_w_per_s(
    history: Iterable[tuple[float, float]], now_s: float, *, window_s: float
) -> float | None:
    """Least-squares slope of power over the last ``window_s``; None if it cannot be told.

    ``history`` holds ``(t_s, power_w)`` readings in any order; those at most ``window_s``
    before ``now_s`` count. Fewer than three of them, or all at one instant, give None.
    """
    points = [(t, p) for t, p in history if now_s - t <= window_s]
    if len(points) < 3:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_p = sum(p for _, p in points) / len(points)
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    if var_t <= 0:
        return None
    return sum((t - mean_t) * (p - mean_p) for t, p in points) / var_t


__all__ = ["trend_w_per_s"]
