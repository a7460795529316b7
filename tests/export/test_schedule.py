"""Per-measurement write intervals: due times on the monotonic clock, slack, bounds."""

from __future__ import annotations

import pytest

from polca.export.schedule import WriteSchedule


def test_series_is_written_once_per_interval_with_a_tenth_of_slack() -> None:
    """1 Hz arrivals with jitter keep a 10 s series at 10 s; each series on its own."""
    schedule = WriteSchedule({"gpu": 10.0})
    arrivals = [0.0, 1.02, 1.98, 3.01, 4.0, 5.0, 6.0, 7.0, 8.0, 9.05, 9.98, 11.0, 20.1]
    due = [t for t in arrivals if schedule.due("gpu", "n1", t)]
    assert due == [0.0, 9.05, 20.1]
    assert schedule.due("gpu", "n2", 1.0)  # another series, its own clock
    assert not schedule.due("gpu", "n2", 2.0)


def test_measurements_without_an_interval_are_always_due() -> None:
    """Not named: every point is written (events and control are never thinned)."""
    schedule = WriteSchedule({"gpu": 10.0})
    assert all(schedule.due("node", "", t) for t in (0.0, 0.1, 0.2))
    assert all(schedule.due("event", "", t) for t in (0.0, 0.0))


def test_remembered_series_are_bounded() -> None:
    """Forgetting only writes a point early; the map never grows past its bound."""
    schedule = WriteSchedule({"gpu": 10.0}, max_series=8)
    for i in range(100):
        assert schedule.due("gpu", f"n{i}", 0.0)
        assert len(schedule._written_s) <= 8


@pytest.mark.parametrize(
    ("every_s", "error"),
    [
        ({"event": 10.0}, "only"),
        ({"gpu": 0.0}, "positive and finite"),
        ({"gpu": float("inf")}, "positive and finite"),
        ({"gpu": float("nan")}, "positive and finite"),
    ],
)
def test_bad_intervals_are_refused(every_s: dict[str, float], error: str) -> None:
    """Events cannot be thinned; an interval is positive and finite."""
    with pytest.raises(ValueError, match=error):
        WriteSchedule(every_s)
