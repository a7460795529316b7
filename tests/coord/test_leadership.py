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


def _leader(term: int = 5, *, at_ns: int = 0) -> Leadership:
    lead = Leadership.standby()
    lead.elected(term=term, instance="agg-a", sent_mono_ns=at_ns, ttl_s=2.0)
    return lead


def test_publish_gating_runs_on_the_monotonic_time_passed_in() -> None:
    """A leader publishes until its deadline, whatever its role says after it; a renewal
    moves the deadline; a lost lease stops publishing at once, before the deadline."""
    lead = _leader(at_ns=10 * S)
    deadline = lead.deadline_mono_ns
    assert lead.role == "leader"
    assert lead.may_publish(10 * S)
    assert not lead.may_publish(deadline)  # still "leader" until the elector notices
    lead.renewed(sent_mono_ns=11 * S, ttl_s=2.0)
    assert lead.may_publish(deadline)
    assert lead.lost()
    assert not lead.may_publish(10 * S)


def test_a_leader_is_deposed_by_a_live_control_of_a_higher_term_only() -> None:
    """A peer publishing live at a higher term means our lease is gone: stop leading now.
    A retained one (of unknown age), our own term or a lower one changes nothing."""
    lead = _leader(term=5)
    assert lead.peer_control(9, retained=True) == "ignore"
    assert lead.peer_control(5, retained=False) == "ignore"
    assert lead.peer_control(3, retained=False) == "ignore"
    assert lead.status("row1")["role"] == "leader"
    assert lead.may_publish(0)
    assert lead.peer_control(6, retained=False) == "deposed"
    assert lead.status("row1")["role"] == "standby"
    assert not lead.may_publish(0)  # deposed before its deadline: nothing more goes out
    assert lead.term == 5  # the term it led at, for the log line
    assert lead.leader is None  # the leader it knew was itself


def test_a_standby_follows_the_leader_it_knows_and_any_retained_control() -> None:
    """A standby keeps its ladders on the leader's level: a control at or above the
    leader term it knows, or a retained one (the last before it started); never an older
    term's live control (a deposed leader still publishing)."""
    standby = Leadership.standby()
    standby.observed(leader="agg-b", term=7)
    assert standby.peer_control(7, retained=False) == "follow"
    assert standby.peer_control(8, retained=False) == "follow"
    assert standby.peer_control(6, retained=False) == "ignore"
    assert standby.peer_control(6, retained=True) == "follow"
    assert standby.role == "standby"  # following is never a change of role


def test_an_instance_alone_follows_its_peers_and_is_never_deposed() -> None:
    """Without etcd (term 0) an instance with peers configured follows their controls."""
    alone = Leadership()
    assert alone.peer_control(0, retained=False) == "follow"
    assert alone.peer_control(12, retained=False) == "follow"
    assert alone.role == "alone"
    assert alone.may_publish(0)


def test_only_a_standby_leaves_the_rows_series_to_the_leader() -> None:
    """A standby writes none of the rows' series; a leader does, even past its deadline
    (points need no fencing), and so does an instance alone."""
    assert not Leadership.standby().writes_row_series
    assert Leadership().writes_row_series
    lead = _leader(at_ns=0)
    assert not lead.may_publish(100 * S)
    assert lead.writes_row_series
    lead.lost()
    assert not lead.writes_row_series


def test_the_status_shows_the_own_term_when_leading_else_the_leaders() -> None:
    """The retained status carries the role and the term this instance knows."""
    standby = Leadership.standby()
    standby.observed(leader="agg-b", term=7)
    assert standby.status("row1") == {
        "shard": "row1",
        "role": "standby",
        "term": 7,
        "leader": "agg-b",
    }
    lead = _leader(term=9)
    assert lead.status("row1") == {"shard": "row1", "role": "leader", "term": 9, "leader": "agg-a"}


def test_a_change_stamps_the_term_when_leading_and_audits_each_leader_once() -> None:
    """Elected: step at the new term and audit it; the same leader seen again: no audit;
    another leader (or none) after that: audited, no term to stamp."""
    lead = Leadership.standby()
    lead.elected(term=4, instance="agg-a", sent_mono_ns=0, ttl_s=2.0)
    first = lead.changed("row1")
    assert (first.lead_term, first.audit) == (4, True)
    assert first.detail == {
        "shard": "row1",
        "role": "leader",
        "term": 4,
        "leader": "agg-a",
        "leader_term": 4,
    }
    again = lead.changed("row1")
    assert (again.lead_term, again.audit) == (4, False)
    lead.lost()
    lost = lead.changed("row1")
    assert (lost.lead_term, lost.audit, lost.role, lost.leader) == (None, True, "standby", None)
    lead.observed(leader="agg-b", term=8)
    other = lead.changed("row1")
    assert (other.lead_term, other.audit, other.leader_term) == (None, True, 8)
    assert not lead.changed("row1").audit
