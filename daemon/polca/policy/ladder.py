"""POLCA's row ladder: row power -> level, with immediate escalation and slow release.

The aggregator calls ``next_level`` once per row power reading; the simulator does the
same. Like the engine it is pure: the time comes in as ``now_s`` and everything it
remembers is the returned ``LadderState``.

Rules (POLCA, see docs/policy.md):

- Escalate at once to the highest level whose threshold row power has reached.
- Jump to the top level (the brake) when ``policy.trend`` is set and the power trend would
  reach 100% of the budget within ``trend.reaction_s``.
- Release only after power has stayed below (threshold - ``release.margin_pct``) of the
  current level for ``release.dwell_s``; then step down one level (or, without
  ``one_level_at_a_time``, to the lowest level whose release point power still reaches),
  and time the next step afresh.
- A non-finite power reading holds the level and restarts the dwell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from polca.policy.model import Policy


@dataclass(frozen=True, slots=True)
class LadderState:
    """The row's level and since when power has been below its release point."""

    level: int = 0  # 0 nominal, i -> policy.levels[i - 1]
    below_since_s: float | None = None  # start of the current dwell; None when not dwelling


def next_level(
    *,
    power_w: float,
    budget_w: float,
    policy: Policy,
    state: LadderState,
    now_s: float,
    trend_w_per_s: float | None = None,
) -> LadderState:
    """The row's next ladder state after one power reading.

    Raises:
        ValueError: ``budget_w`` is not a positive finite number.
    """
    if not (math.isfinite(budget_w) and budget_w > 0):
        msg = f"row budget must be a positive number of watts, got {budget_w!r}"
        raise ValueError(msg)
    top = policy.top_level
    level = max(0, min(state.level, top))
    if not math.isfinite(power_w):
        return LadderState(level=level, below_since_s=None)
    power_pct = 100.0 * power_w / budget_w

    reached = sum(1 for lvl in policy.levels if power_pct >= lvl.threshold_pct)
    if (
        policy.trend is not None
        and trend_w_per_s is not None
        and trend_w_per_s > 0
        and power_w + trend_w_per_s * policy.trend.reaction_s >= budget_w
    ):
        reached = top
    if reached > level:
        return LadderState(level=reached, below_since_s=None)
    if level == 0:
        return LadderState(level=0, below_since_s=None)

    margin_pct = policy.release.margin_pct
    if power_pct >= policy.levels[level - 1].threshold_pct - margin_pct:
        return LadderState(level=level, below_since_s=None)  # in the hysteresis band
    below_since_s = now_s if state.below_since_s is None else state.below_since_s
    if now_s - below_since_s < policy.release.dwell_s:
        return LadderState(level=level, below_since_s=below_since_s)

    if policy.release.one_level_at_a_time:
        new_level = level - 1
    else:
        new_level = sum(1 for lvl in policy.levels if power_pct >= lvl.threshold_pct - margin_pct)
    # The next step down needs its own dwell, which starts now if power is already below.
    still_below = (
        new_level > 0 and power_pct < policy.levels[new_level - 1].threshold_pct - margin_pct
    )
    return LadderState(level=new_level, below_since_s=now_s if still_below else None)
