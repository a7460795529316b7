"""Debounce, escalation and clearing of one alarm: the time behaviour every kind shares.

Why this module exists: what an alarm *is* (its condition, limits and words) changes with
the alarm kind, in ``alarms``; how an alarm raises, escalates, steps down and clears is the
same for every kind and changes for other reasons (the CDU lessons: no flapping, and
emergencies act at once). ``AlarmState`` sees only severity ranks (0 none, 1 warning,
2 degraded, 3 critical) and time. Pure: ``now_s`` comes in (monotonic); no I/O, no clock,
and no alarm kind, loop or value.

A condition must hold its raise delay for its rank (``AlarmSpec.delays``: by default
``raise_after_s``, ``critical_raise_after_s`` when critical) to raise or escalate. A
persisting alarm escalates one severity per ``escalate_after_s`` up to
``escalation_ceiling``. An alarm steps down (to the severity its condition still holds,
never below one reached by persistence) or clears once that has held ``clear_after_s``
(the hysteresis, which relaxes the thresholds while an alarm is active, is the
condition's). No evidence (a stale CDU, an unreported reading) holds the state and
restarts every debounce: without evidence, nothing raises, clears or escalates.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from polca.cooling.loops import AlarmTiming, severity_rank

__all__ = ["AlarmAction", "AlarmState", "Delays"]

AlarmAction = Literal["raised", "escalated", "deescalated", "cleared"]

Delays = tuple[float, float, float]
"""How long a condition must hold to raise or escalate to warning, degraded, critical."""


@dataclass(slots=True)
class AlarmState:
    """Debounce, escalation and clearing of one alarm (see the module docstring)."""

    delays_s: Delays
    rank: int = 0
    raised_s: float = 0.0
    rank_since_s: float = 0.0
    time_rank: int = 0  # rank reached by persistence; held while the condition lasts
    above_since_s: list[float | None] = field(default_factory=lambda: [None, None, None, None])
    below_since_s: float | None = None

    def copy(self) -> AlarmState:
        """An independent copy (the delays are immutable and shared)."""
        return replace(self, above_since_s=list(self.above_since_s))

    @property
    def idle(self) -> bool:
        """Not raised and nothing pending: a condition of rank 0 changes nothing."""
        return self.rank == 0 and self.above_since_s[1] is None

    def step(
        self, rank: int | None, *, now_s: float, timing: AlarmTiming
    ) -> tuple[AlarmAction, int] | None:
        """Advance by the rank the condition holds now (None: no evidence).

        Returns (action, new rank) on a change, else None.
        """
        if rank is None:  # no evidence: hold the state, restart every debounce
            self.above_since_s = [None, None, None, None]
            self.below_since_s = None
            return None
        above = self.above_since_s
        if rank == 0 and self.rank == 0 and above[1] is None:
            return None  # the common case: nothing wrong, nothing pending
        for r in (1, 2, 3):
            if rank >= r:
                if above[r] is None:
                    above[r] = now_s
            else:
                above[r] = None
        target = 0
        for r in (3, 2, 1):
            since = above[r]
            if since is not None and now_s - since >= self.delays_s[r - 1]:
                target = r
                break
        if target > self.rank:
            if self.rank == 0:
                self.raised_s = now_s
                return self._move(target, "raised", now_s)
            return self._move(target, "escalated", now_s)
        if self.rank == 0:
            return None
        if (
            rank > 0
            and self.rank < severity_rank(timing.escalation_ceiling)
            and now_s - self.rank_since_s >= timing.escalate_after_s
        ):
            self.time_rank = self.rank + 1
            return self._move(self.rank + 1, "escalated", now_s)
        hold = max(rank, self.time_rank) if rank > 0 else 0
        if hold >= self.rank:
            self.below_since_s = None
            return None
        if self.below_since_s is None:
            self.below_since_s = now_s
        if now_s - self.below_since_s < timing.clear_after_s:
            return None
        if hold == 0:
            self.time_rank = 0
            return self._move(0, "cleared", now_s)
        return self._move(hold, "deescalated", now_s)

    def _move(self, rank: int, action: AlarmAction, now_s: float) -> tuple[AlarmAction, int]:
        self.rank = rank
        self.rank_since_s = now_s
        self.below_since_s = None
        return action, rank
