"""The row ladder: immediate escalation, dwell, one level at a time, trend brake."""

from __future__ import annotations

from typing import Any

import pytest

from polca.policy import LadderState, Policy, next_level
from polca.policy.ladder import MIN_BUDGET_W, usable_budget_w

BUDGET_W = 100_000.0  # row budget; 1% = 1 kW


def step(
    policy: Policy,
    state: LadderState,
    pct: float,
    now_s: float,
    trend_w_per_s: float | None = None,
) -> LadderState:
    """One ladder step at ``pct`` % of the budget."""
    return next_level(
        power_w=BUDGET_W * pct / 100,
        budget_w=BUDGET_W,
        policy=policy,
        state=state,
        now_s=now_s,
        trend_w_per_s=trend_w_per_s,
    )


@pytest.mark.parametrize(
    ("pct", "level"), [(0, 0), (79.9, 0), (80, 1), (88.9, 1), (89, 2), (97.9, 2), (98, 3), (150, 3)]
)
def test_escalates_at_once_to_highest_reached_level(policy: Policy, pct: float, level: int) -> None:
    """From nominal, one reading jumps straight to the highest level reached."""
    assert step(policy, LadderState(), pct, 0.0) == LadderState(level=level)


def test_release_waits_for_dwell(policy: Policy) -> None:
    """Below threshold - margin, the level holds until dwell_s has passed."""
    state = step(policy, LadderState(), 90, 0.0)
    assert state.level == 2
    state = step(policy, state, 83.9, 1.0)  # below 89 - 5
    assert state == LadderState(level=2, below_since_s=1.0)
    state = step(policy, state, 83.0, 10.9)
    assert state == LadderState(level=2, below_since_s=1.0)
    state = step(policy, state, 83.0, 11.0)  # 10 s after 1.0
    assert state == LadderState(level=1, below_since_s=None)  # 83% is not below 80 - 5


def test_hysteresis_band_resets_dwell(policy: Policy) -> None:
    """A reading back inside the band (>= threshold - margin) restarts the dwell."""
    state = LadderState(level=2, below_since_s=None)
    state = step(policy, state, 80, 0.0)
    assert state.below_since_s == 0.0
    state = step(policy, state, 84.0, 5.0)  # 84 >= 89 - 5: in the band
    assert state == LadderState(level=2, below_since_s=None)
    state = step(policy, state, 80, 6.0)
    state = step(policy, state, 80, 15.9)
    assert state.level == 2
    assert step(policy, state, 80, 16.0).level == 1


def test_one_level_at_a_time_with_a_dwell_each(policy: Policy) -> None:
    """From the brake at idle power, each step down waits its own dwell."""
    state = step(policy, LadderState(), 99, 0.0)
    assert state.level == 3
    levels = []
    for now_s in range(1, 40):
        state = step(policy, state, 10, float(now_s))
        levels.append(state.level)
    # below since 1 s: 3 -> 2 at 11 s, 2 -> 1 at 21 s, 1 -> 0 at 31 s.
    assert levels.index(2) == 10
    assert levels.index(1) == 20
    assert levels.index(0) == 30
    assert state == LadderState(level=0, below_since_s=None)


def test_release_straight_down_without_one_level_at_a_time(
    policy_data: dict[str, Any],
) -> None:
    """With one_level_at_a_time false, release jumps to the level power still needs."""
    policy_data["release"]["one_level_at_a_time"] = False
    policy = Policy.model_validate(policy_data)
    state = LadderState(level=3, below_since_s=0.0)
    assert step(policy, state, 10, 10.0) == LadderState(level=0)
    assert step(policy, state, 77, 10.0) == LadderState(level=1)  # 77 >= 80 - 5


def test_escalation_during_dwell_wins(policy: Policy) -> None:
    """A spike during a dwell escalates immediately and forgets the dwell."""
    state = LadderState(level=1, below_since_s=0.0)
    assert step(policy, state, 95, 5.0) == LadderState(level=2)


def test_trend_brakes_early(policy: Policy) -> None:
    """A rising trend that reaches 100% within reaction_s jumps to the brake."""
    state = step(policy, LadderState(), 90, 0.0, trend_w_per_s=2_000.0)  # 90% + 5 s x 2%
    assert state == LadderState(level=3)
    state = step(policy, LadderState(), 90, 0.0, trend_w_per_s=1_999.0)
    assert state == LadderState(level=2)
    assert step(policy, LadderState(), 90, 0.0, trend_w_per_s=-5_000.0).level == 2


def test_trend_ignored_without_trend_section(policy_data: dict[str, Any]) -> None:
    """Without a trend section the trend is not used."""
    del policy_data["trend"]
    policy = Policy.model_validate(policy_data)
    assert step(policy, LadderState(), 90, 0.0, trend_w_per_s=1e9).level == 2


def test_zero_dwell_releases_on_the_first_reading(policy_data: dict[str, Any]) -> None:
    """dwell_s 0 releases as soon as power is below the release point."""
    policy_data["release"]["dwell_s"] = 0
    policy = Policy.model_validate(policy_data)
    assert step(policy, LadderState(level=2), 50, 0.0) == LadderState(level=1, below_since_s=0.0)


def test_non_finite_power_holds_the_level(policy: Policy) -> None:
    """A NaN reading neither escalates nor counts towards the dwell."""
    state = LadderState(level=2, below_since_s=0.0)
    assert step(policy, state, float("nan"), 100.0) == LadderState(level=2)


def test_stale_state_level_is_clamped(policy: Policy) -> None:
    """A level from a policy with more levels is clamped to this policy's top."""
    assert step(policy, LadderState(level=7), 99, 0.0) == LadderState(level=3)


@pytest.mark.parametrize("budget_w", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_budget_counts_as_exceeded(policy: Policy, budget_w: float) -> None:
    """A budget that is not a positive finite number brakes any power above a milliwatt."""
    state = next_level(power_w=1.0, budget_w=budget_w, policy=policy, state=LadderState(), now_s=0)
    assert state.level == policy.top_level
    assert usable_budget_w(budget_w) == MIN_BUDGET_W
    assert usable_budget_w(5.0) == 5.0


def test_each_state_says_why_its_level_is_what_it_is(policy: Policy) -> None:
    """The reason comes with the level: escalation, hold, dwell, release, trend, unknown."""
    up = step(policy, LadderState(), 90, 0.0)
    assert (up.level, up.reason) == (2, "power 90.0% >= T2 at 89%")
    held = step(policy, up, 86, 1.0)
    assert (held.level, held.reason) == (2, "power 86.0% of budget")
    release = step(policy, step(policy, held, 70, 2.0), 70, 2.0 + policy.release.dwell_s)
    assert release.level == 1
    assert release.reason == (
        f"power 70.0% stayed below {89 - policy.release.margin_pct:g}% for "
        f"{policy.release.dwell_s:g} s: released T2"
    )
    unknown = step(policy, up, float("nan"), 3.0)
    assert (unknown.level, unknown.reason) == (2, "row power unknown (nan): level held")
    assert LadderState(level=2, reason="a") == LadderState(level=2, reason="b")
    trend = step(policy, LadderState(), 90, 0.0, trend_w_per_s=2_000.0)
    assert (trend.level, trend.reason) == (3, "trend +2000 W/s reaches the budget in 5.0 s")
