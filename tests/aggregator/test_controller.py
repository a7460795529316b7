"""The row controller: ladder levels, leased control messages, audit, restart seeding."""

from __future__ import annotations

from pathlib import Path

import pytest

from polca.aggregator.controller import ScopeController, ScopeDecision
from polca.policy import load_policy
from polca.policy.model import Policy

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 10_000.0


@pytest.fixture
def policy() -> Policy:
    """The shipped A100 POLCA policy (T1 80%, T2 89%, brake 98%, dwell 40 s)."""
    return load_policy(ROOT / "policies" / "polca-a100.yaml").policy


def _decide(
    ctl: ScopeController, policy: Policy, pct: float, now_s: float, floor: int = 0
) -> ScopeDecision:
    return ctl.step(
        power_w=BUDGET * pct / 100,
        budget_w=BUDGET,
        policy=policy,
        revision="abc123abc123",
        now_s=now_s,
        now_ns=int(now_s * 1e9),
        lease_s=10,
        observe=False,
        trend_w_per_s=None,
        floor_level=floor,
        floor_reason="loop1 critical",
    )


def _step(ctl: ScopeController, policy: Policy, pct: float, now_s: float) -> int:
    return _decide(ctl, policy, pct, now_s).level


def test_levels_escalate_at_once_and_release_after_dwell(policy: Policy) -> None:
    """80% -> T1 and 89% -> T2 immediately; release needs 40 s below threshold - 5 points."""
    ctl = ScopeController(site="dc1", row="row1", rack=None, issuer="agg", epoch_ns=1)
    assert _step(ctl, policy, 70, 0) == 0
    assert _step(ctl, policy, 81, 1) == 1
    assert _step(ctl, policy, 90, 2) == 2
    assert _step(ctl, policy, 85, 3) == 2  # in the hysteresis band
    assert _step(ctl, policy, 80, 4) == 2  # below 84: dwell starts
    assert _step(ctl, policy, 80, 43) == 2
    assert _step(ctl, policy, 80, 44.5) == 1  # one level at a time
    assert _step(ctl, policy, 60, 45) == 1
    assert _step(ctl, policy, 60, 86) == 0


def test_control_message_carries_lease_seq_and_reason(policy: Policy) -> None:
    """Each step renews the lease with a higher seq; a change carries an audit record."""
    ctl = ScopeController(site="dc1", row="row1", rack="r7", issuer="agg", epoch_ns=5)
    first = ctl.step(
        power_w=9_000,
        budget_w=BUDGET,
        policy=policy,
        revision="abc123abc123",
        now_s=0,
        now_ns=1_000_000_000,
        lease_s=10,
        observe=True,
        trend_w_per_s=None,
    )
    second = ctl.step(
        power_w=9_000,
        budget_w=BUDGET,
        policy=policy,
        revision="abc123abc123",
        now_s=1,
        now_ns=2_000_000_000,
        lease_s=10,
        observe=True,
        trend_w_per_s=None,
    )
    assert first.control.scope == "rack"
    assert first.control.rack == "r7"
    assert first.changed
    assert not second.changed
    assert second.control.seq == first.control.seq + 1
    assert second.control.lease_expires_ns == 12_000_000_000
    assert first.control.observe
    assert first.control.level_name == "T2"
    assert "90.0% >= T2" in first.control.reason
    assert first.audit["previous_level"] == 0
    assert first.audit["thresholds_w"][:2] == [8000.0, 8900.0]


def test_trend_brakes_before_the_threshold(policy: Policy) -> None:
    """Power still under T2 but rising fast enough to reach 100% soon goes to the brake."""
    assert policy.trend is not None
    ctl = ScopeController(site="dc1", row="row1", rack=None, issuer="agg", epoch_ns=1)
    decision = ctl.step(
        power_w=8_500,
        budget_w=BUDGET,
        policy=policy,
        revision="abc123abc123",
        now_s=0,
        now_ns=0,
        lease_s=10,
        observe=False,
        trend_w_per_s=400,
    )
    assert decision.level == len(policy.levels)
    assert "trend" in decision.control.reason


def test_seed_from_retained_control_prevents_a_spurious_uncap(policy: Policy) -> None:
    """A restarted controller seeded at T2 stays at T2 until a full dwell has passed."""
    old = ScopeController(site="dc1", row="row1", rack=None, issuer="agg", epoch_ns=1)
    _step(old, policy, 95, 0)
    retained = old.step(
        power_w=9_500,
        budget_w=BUDGET,
        policy=policy,
        revision="abc123abc123",
        now_s=1,
        now_ns=1,
        lease_s=10,
        observe=False,
        trend_w_per_s=None,
    ).control
    new = ScopeController(site="dc1", row="row1", rack=None, issuer="agg", epoch_ns=2)
    new.seed(retained, policy=policy)
    assert new.ladder.level == retained.level
    assert _step(new, policy, 70, 100) == retained.level  # low power, but the dwell restarts
    assert new.seq > retained.seq
    other_row = ScopeController(site="dc1", row="row2", rack=None, issuer="agg", epoch_ns=2)
    other_row.seed(retained, policy=policy)
    assert other_row.ladder.level == 0


def _without_top_level(policy: Policy) -> Policy:
    return policy.model_copy(update={"levels": policy.levels[:-1]})


def test_a_reload_that_removes_levels_at_the_top_level_clamps(policy: Policy) -> None:
    """At the brake, a policy without it moves the scope to its new top level; nothing raises."""
    ctl = ScopeController(site="dc1", row="row1", rack=None, issuer="agg", epoch_ns=1)
    assert _step(ctl, policy, 99, 0) == policy.top_level
    smaller = _without_top_level(policy)
    assert _step(ctl, smaller, 99, 1) == smaller.top_level
    assert _step(ctl, smaller, 10, 2) == smaller.top_level  # releases only after the dwell
    one = policy.model_copy(update={"levels": policy.levels[:1]})
    assert _step(ctl, one, 10, 3) == 1


def test_retained_level_beyond_the_policy_is_clamped_when_seeding(policy: Policy) -> None:
    """A retained level 9 (or a seq near 2**63) seeds the top level and leaves room to count."""
    retained = (
        ScopeController(site="dc1", row="row1", rack=None, issuer="agg", epoch_ns=1)
        .step(
            power_w=9_500,
            budget_w=BUDGET,
            policy=policy,
            revision="abc123abc123",
            now_s=1,
            now_ns=1,
            lease_s=10,
            observe=False,
            trend_w_per_s=None,
        )
        .control.model_copy(update={"level": 9, "seq": 2**63 - 1})
    )
    new = ScopeController(site="dc1", row="row1", rack=None, issuer="agg", epoch_ns=2)
    new.seed(retained, policy=policy)
    assert new.ladder.level == policy.top_level
    assert _step(new, policy, 70, 2) == policy.top_level
    assert new.seq < 2**63 - 1


def test_a_budget_of_zero_counts_as_exceeded(policy: Policy) -> None:
    """A thermal budget derated to 0 W brakes the scope instead of raising."""
    ctl = ScopeController(site="dc1", row="row1", rack="r1", issuer="agg", epoch_ns=1)
    decision = ctl.step(
        power_w=100.0,
        budget_w=0.0,
        policy=policy,
        revision="abc123abc123",
        now_s=0,
        now_ns=0,
        lease_s=10,
        observe=False,
        trend_w_per_s=None,
    )
    assert decision.level == policy.top_level


def test_brakes_count_entries_into_the_top_level(policy: Policy) -> None:
    """Each rise into the brake counts once; holding it or a lower level does not."""
    ctl = ScopeController(site="dc1", row="row1", rack=None, issuer="agg", epoch_ns=1)
    top = policy.top_level
    assert _step(ctl, policy, 90, 0) == 2
    assert ctl.brakes == 0
    assert _step(ctl, policy, 99, 1) == top
    assert _step(ctl, policy, 99, 2) == top
    assert ctl.brakes == 1
    for t in range(3, 200):  # back down to nominal
        _step(ctl, policy, 50, t)
    assert ctl.published_level == 0
    assert _step(ctl, policy, 99, 200) == top
    assert ctl.brakes == 2


def test_the_reason_says_whether_the_ladder_or_a_forced_floor_set_the_level(
    policy: Policy,
) -> None:
    """A floor above the ladder is ``forced``; when it drops, the message says so and
    carries the ladder's own reason, not a release the ladder never made."""
    ctl = ScopeController(site="dc1", row="row1", rack=None, issuer="agg", epoch_ns=1)

    def reason(pct: float, now_s: float, floor: int = 0) -> tuple[int, str]:
        decision = _decide(ctl, policy, pct, now_s, floor)
        return decision.level, decision.control.reason

    assert reason(50, 0, floor=2) == (2, f"forced {policy.level_name(2)}: loop1 critical")
    assert reason(50, 1) == (0, "forced level lifted; power 50.0% of budget")
    assert reason(90, 2) == (2, f"power 90.0% >= {policy.level_name(2)} at 89%")
    assert reason(60, 3) == (2, "power 60.0% of budget")  # dwelling
    level, text = reason(60, 44)
    assert level == 1
    assert text.endswith(f"released {policy.level_name(2)}")
