"""Leadership: when a leader may publish, on its monotonic clock, and how terms move."""

from __future__ import annotations

from polca.coord.leadership import SAFETY_FRACTION, Leadership

S = 1_000_000_000


def test_alone_always_publishes_with_term_zero() -> None:
    """Without etcd the aggregator controls its rows as it always did."""
    alone = Leadership()
    assert alone.may_publish(0)
    assert alone.may_publish(10**18)
    assert alone.term == 0
    assert not alone.lost()  # nothing to lose
    assert alone.role == "alone"


def test_a_standby_never_publishes() -> None:
    """A standby decides but publishes nothing until elected."""
    standby = Leadership.standby()
    assert not standby.may_publish(0)
    standby.observed(leader="agg-a", term=7)
    assert not standby.may_publish(S)
    assert (standby.leader, standby.leader_term) == ("agg-a", 7)


def test_the_deadline_counts_from_the_send_time_less_a_safety_margin() -> None:
    """etcd's lease ends no earlier than send + ttl; the leader stops before that."""
    lead = Leadership.standby()
    assert lead.elected(term=12, instance="agg-b", sent_mono_ns=100 * S, ttl_s=2.0)
    deadline = 100 * S + int(2.0 * SAFETY_FRACTION * S)
    assert lead.may_publish(deadline - 1)
    assert not lead.may_publish(deadline)
    assert deadline < 102 * S  # strictly inside etcd's ttl
    lead.renewed(sent_mono_ns=101 * S, ttl_s=2.0)
    assert lead.may_publish(deadline + 1)
    lead.renewed(sent_mono_ns=99 * S, ttl_s=2.0)  # a late answer never shortens it
    assert lead.may_publish(deadline + 1)


def test_elected_again_at_the_same_term_is_no_change_and_losing_is_one() -> None:
    """Each change of role or term counts once (the audit event and the point)."""
    lead = Leadership.standby()
    assert lead.elected(term=5, instance="a", sent_mono_ns=0, ttl_s=2.0)
    assert not lead.elected(term=5, instance="a", sent_mono_ns=S, ttl_s=2.0)
    assert lead.elected(term=9, instance="a", sent_mono_ns=S, ttl_s=2.0)
    assert lead.lost()
    assert not lead.lost()
    assert lead.role == "standby"
    assert not lead.may_publish(S)
    assert lead.changes == 3
    assert lead.leader is None
