"""One alarm's time behaviour on ranks alone: raise, escalate by persistence, step down, clear."""

from __future__ import annotations

from polca.cooling.debounce import AlarmState
from polca.cooling.loops import AlarmTiming

TIMING = AlarmTiming(
    raise_after_s=1.0, escalate_after_s=10.0, clear_after_s=5.0, escalation_ceiling="degraded"
)


def run(state: AlarmState, ranks: list[tuple[int, int | None]]) -> list[tuple[float, str, int]]:
    """Feed (seconds, rank) runs at 1 s steps from 0; return (at_s, action, rank) changes."""
    changes: list[tuple[float, str, int]] = []
    now_s = 0.0
    for seconds, rank in ranks:
        for _ in range(seconds):
            change = state.step(rank, now_s=now_s, timing=TIMING)
            if change is not None:
                changes.append((now_s, *change))
            now_s += 1.0
    return changes


def test_persistence_escalates_to_the_ceiling_and_clears_after_the_dwell() -> None:
    """A warning held 1 s raises, +10 s is degraded, never critical; clears 5 s after it ends."""
    state = AlarmState((1.0, 1.0, 1.0))
    assert run(state, [(41, 1), (10, 0)]) == [
        (1.0, "raised", 1),
        (11.0, "escalated", 2),
        (46.0, "cleared", 0),
    ]


def test_a_critical_condition_that_eases_steps_down_after_the_dwell() -> None:
    """Critical at once (delay 0), then a warning condition: deescalated to warning 5 s later."""
    state = AlarmState((1.0, 1.0, 0.0))
    assert run(state, [(3, 3), (8, 1)]) == [(0.0, "raised", 3), (8.0, "deescalated", 1)]
    assert state.rank == 1
    assert not state.idle
