"""The row power trend the ladder's brake-on-trend rule extrapolates."""

from __future__ import annotations

from collections import deque

import pytest

from polca.policy import trend_w_per_s


def test_a_steady_ramp_has_its_slope() -> None:
    """Power rising 100 W per second reads as +100 W/s, from a list or a deque."""
    history = [(float(t), 1000.0 + 100.0 * t) for t in range(6)]
    assert trend_w_per_s(history, 5.0, window_s=10.0) == pytest.approx(100.0)
    assert trend_w_per_s(deque(history, maxlen=8), 5.0, window_s=10.0) == pytest.approx(100.0)


def test_only_the_window_counts() -> None:
    """Readings older than the window are left out: a recent fall shows, an old rise not."""
    history = [(0.0, 0.0), (1.0, 500.0), (2.0, 1000.0), (10.0, 900.0), (11.0, 800.0)]
    history.append((12.0, 700.0))
    assert trend_w_per_s(history, 12.0, window_s=2.0) == pytest.approx(-100.0)


@pytest.mark.parametrize(
    "history",
    [[], [(0.0, 1.0), (1.0, 2.0)], [(5.0, 1.0), (5.0, 2.0), (5.0, 3.0)]],
    ids=["empty", "two-points", "one-instant"],
)
def test_too_little_history_has_no_trend(history: list[tuple[float, float]]) -> None:
    """Fewer than three readings, or all at one instant, give None rather than a guess."""
    assert trend_w_per_s(history, 5.0, window_s=10.0) is None
