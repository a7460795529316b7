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
- A budget that is not a positive finite number counts as exceeded (``usable_budget_w``).

Each state carries the one-line reason for its level, which the control message carries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from polca.policy.model import Policy

MIN_BUDGET_W = 1e-3
"""Stands in for a budget that is not a positive finite number: any power is over it."""


def usable_budget_w(budget_w: float) -> float:
    """The budget the ladder compares with: ``budget_w``, or ``MIN_BUDGET_W`` when it is
    not a positive finite number (a thermal budget derated to nothing counts as exceeded)."""
    return budget_w if math.isfinite(budget_w) and budget_w > 0 else MIN_BUDGET_W


@dataclass(frozen=True, slots=True)
class LadderState:
    """The row's level and since when power has been below its release point.

    ``reason`` says, in one line, why the level is what it is after the step that made
    this state; it is not part of what the ladder remembers (equality ignores it).
    """

    level: int = 0  # 0 nominal, i -> policy.levels[i - 1]
    below_since_s: float | None = None  # start of the current dwell; None when not dwelling
    reason: str = field(default="", compare=False)


def next_level(
    *,
    power_w: float,
    budget_w: float,
    policy: Policy,
    state: LadderState,
    now_s: float,
    trend_w_per_s: float | None = None,
) -> LadderState:
    """The row's next ladder state (with its reason) after one power reading.

    A budget that is not a positive finite number is ``usable_budget_w``'s.
    """
    budget_w = usable_budget_w(budget_w)
    level = policy.clamp_level(state.level)
    if not math.isfinite(power_w):
        return LadderState(level=level, reason=f"row power unknown ({power_w}): level held")
    power_pct = 100.0 * power_w / budget_w
    holding = f"power {power_pct:.1f}% of budget"

    reached = sum(1 for lvl in policy.levels if power_pct >= lvl.threshold_pct)
    by_threshold = reached
    if (
        policy.trend is not None
        and trend_w_per_s is not None
        and trend_w_per_s > 0
        and power_w + trend_w_per_s * policy.trend.reaction_s >= budget_w
    ):
        reached = policy.top_level
    if reached > level:
        if reached > by_threshold and trend_w_per_s is not None:
            eta_s = (budget_w - power_w) / trend_w_per_s
            why = f"trend {trend_w_per_s:+.0f} W/s reaches the budget in {eta_s:.1f} s"
        else:
            threshold = policy.levels[reached - 1].threshold_pct
            why = f"power {power_pct:.1f}% >= {policy.level_name(reached)} at {threshold:g}%"
        return LadderState(level=reached, reason=why)
    if level == 0:
        return LadderState(level=0, reason=holding)

    margin_pct = policy.release.margin_pct
    release_pct = policy.levels[level - 1].threshold_pct - margin_pct
    if power_pct >= release_pct:
        return LadderState(level=level, reason=holding)  # in the hysteresis band
    below_since_s = now_s if state.below_since_s is None else state.below_since_s
    if now_s - below_since_s < policy.release.dwell_s:
        return LadderState(level=level, below_since_s=below_since_s, reason=holding)

    if policy.release.one_level_at_a_time:
        new_level = level - 1
    else:
        new_level = sum(1 for lvl in policy.levels if power_pct >= lvl.threshold_pct - margin_pct)
    # The next step down needs its own dwell, which starts now if power is already below.
    still_below = (
        new_level > 0 and power_pct < policy.levels[new_level - 1].threshold_pct - margin_pct
    )
    why = (
        f"power {power_pct:.1f}% stayed below {release_pct:g}% for "
        f"{policy.release.dwell_s:g} s: released {policy.level_name(level)}"
    )
    return LadderState(level=new_level, below_since_s=now_s if still_below else None, reason=why)
