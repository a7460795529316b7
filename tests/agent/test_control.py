"""ControlTracker: which control messages the agent believes, and for how long."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from polca.agent.control import ControlTracker, Verdict
from polca.telemetry.checks import ClockWindow
from polca.telemetry.schema import Control

S = 1_000_000_000
MAX_LEASE = 30 * S
HOUR = 3600 * S
WALL0 = 1_700_000_000 * S  # the controller's and (unless skewed) the node's wall clock
MONO0 = 5_000 * S  # the node's monotonic clock at the same instant


def _control(
    *,
    seq: int,
    level: int = 1,
    scope: str = "row",
    rack: str | None = None,
    row: str = "row1",
    issued_ns: int = WALL0,
    lease_s: float = 10,
    epoch_ns: int = WALL0 - 60 * S,
    observe: bool = False,
    issuer: str = "agg",
    term: int = 0,
) -> Control:
    return Control(
        ts_ns=issued_ns,
        scope=scope,
        row=row,
        rack=rack,
        issuer=issuer,
        term=term,
        epoch_ns=epoch_ns,
        seq=seq,
        level=level,
        issued_ns=issued_ns,
        lease_expires_ns=issued_ns + int(lease_s * S),
        observe=observe,
    )


def _tracker(*, issuers: frozenset[str] = frozenset()) -> ControlTracker:
    return ControlTracker(row="row1", rack="r1", window=ClockWindow.of_seconds(5), issuers=issuers)


def _offer(
    tracker: ControlTracker,
    control: Control,
    *,
    mono: int = MONO0,
    wall: int = WALL0,
    retained: bool = False,
    max_lease: int = MAX_LEASE,
) -> Verdict:
    return tracker.offer(
        control,
        received_mono_ns=mono,
        received_wall_ns=wall,
        retained=retained,
        max_lease_ns=max_lease,
    )


def _expiry(tracker: ControlTracker, now: int = MONO0) -> int:
    lease = tracker.current(now)
    assert lease is not None
    return lease.expires_mono_ns


def test_accepts_newer_and_ignores_stale_and_duplicate() -> None:
    """A lower or equal (epoch, seq) than the last accepted one is ignored and counted."""
    tracker = _tracker()
    assert _offer(tracker, _control(seq=5, level=2)) == "accepted"
    assert _offer(tracker, _control(seq=4, level=0)) == "stale"
    assert _offer(tracker, _control(seq=5, level=0)) == "stale"
    assert tracker.rejected == 2
    lease = tracker.current(MONO0 + S)
    assert lease is not None
    assert lease.control.level == 2


def test_new_epoch_supersedes_higher_seq() -> None:
    """A restarted controller (larger epoch) is accepted even with a lower seq."""
    tracker = _tracker()
    _offer(tracker, _control(seq=99, epoch_ns=WALL0 - 60 * S))
    assert _offer(tracker, _control(seq=1, epoch_ns=WALL0 - S, level=0)) == "accepted"


def test_lease_runs_on_the_monotonic_clock_from_receipt() -> None:
    """The lease ends the granted time after receipt on the monotonic clock."""
    tracker = _tracker()
    _offer(tracker, _control(seq=1, lease_s=10), mono=MONO0)
    assert _expiry(tracker) == MONO0 + 10 * S
    assert tracker.active(MONO0 + 10 * S) == []


def test_lease_is_cut_to_the_policy_maximum() -> None:
    """A control granting 100 years gets the policy's maximum lease, no more."""
    tracker = _tracker()
    years = _control(seq=1, lease_s=100 * 365 * 24 * 3600)
    assert _offer(tracker, years, max_lease=MAX_LEASE) == "accepted"
    assert _expiry(tracker) == MONO0 + MAX_LEASE


def test_node_clock_ahead_still_follows_live_control() -> None:
    """A node whose clock runs 11 s ahead follows live control and measures the skew."""
    tracker = _tracker()
    verdict = _offer(tracker, _control(seq=1, lease_s=10), wall=WALL0 + 11 * S)
    assert verdict == "accepted"
    assert _expiry(tracker) == MONO0 + 10 * S
    assert tracker.skew_ns == 11 * S


def test_node_clock_behind_still_follows_live_control() -> None:
    """A node whose clock runs an hour behind follows live control all the same."""
    tracker = _tracker()
    assert _offer(tracker, _control(seq=1), wall=WALL0 - HOUR) == "accepted"
    assert _expiry(tracker) == MONO0 + 10 * S
    assert tracker.skew_ns == -HOUR


def test_clock_steps_neither_expire_nor_extend_a_lease() -> None:
    """A wall clock (node's or controller's) stepped by an hour either way changes no lease."""
    for node_step, ctl_step in ((HOUR, 0), (-HOUR, 0), (0, HOUR), (0, -HOUR)):
        tracker = _tracker()
        _offer(tracker, _control(seq=1))
        # One second later (monotonic), the next renewal arrives across the step.
        renewal = _control(seq=2, issued_ns=WALL0 + S + ctl_step)
        verdict = _offer(tracker, renewal, mono=MONO0 + S, wall=WALL0 + S + node_step)
        assert verdict == "accepted", (node_step, ctl_step)
        assert _expiry(tracker, MONO0 + S) == MONO0 + 11 * S, (node_step, ctl_step)


def test_retained_control_is_judged_by_its_age() -> None:
    """A retained control grants only what is left of its lease, and nothing once it is older."""
    tracker = _tracker()
    issued_4s_ago = _control(seq=1, issued_ns=WALL0 - 4 * S, lease_s=10)
    assert _offer(tracker, issued_4s_ago, retained=True) == "accepted"
    assert _expiry(tracker) == MONO0 + 6 * S
    hour_old = _control(seq=2, issued_ns=WALL0 - HOUR, lease_s=10)
    assert _offer(_tracker(), hour_old, retained=True) == "expired"


def test_retained_control_from_the_future_is_refused() -> None:
    """A retained control issued beyond the tolerance in the future grants nothing."""
    tracker = _tracker()
    ahead = _control(seq=1, issued_ns=WALL0 + 60 * S)
    assert _offer(tracker, ahead, retained=True) == "future"
    assert tracker.current(MONO0) is None


def test_future_epoch_is_refused_and_cannot_lock_out_the_controller() -> None:
    """An epoch of 2**62 is refused, stamped honestly or not; the real controller keeps control."""
    tracker = _tracker()
    assert _offer(tracker, _control(seq=1, level=2)) == "accepted"
    assert _offer(tracker, _control(seq=1, level=0, epoch_ns=2**62)) == "future"
    forged = _control(seq=1, level=0, epoch_ns=2**62, issued_ns=2**62)
    assert _offer(tracker, forged) == "skewed"
    assert _offer(tracker, forged, retained=True) == "future"
    assert _offer(tracker, _control(seq=2, level=2), mono=MONO0 + S) == "accepted"
    lease = tracker.current(MONO0 + S)
    assert lease is not None
    assert lease.control.level == 2


def test_a_bogus_epoch_holds_at_most_one_lease() -> None:
    """A plausible but bogus higher epoch stops locking the controller out when its lease ends."""
    tracker = _tracker()
    bogus = _control(seq=1, level=0, epoch_ns=WALL0 + 3 * S, issued_ns=WALL0 + 4 * S)
    assert _offer(tracker, bogus) == "accepted"
    real = _control(seq=7, level=2)
    assert _offer(tracker, real, mono=MONO0 + S) == "stale"
    assert _offer(tracker, real, mono=MONO0 + 10 * S) == "accepted"


def test_lower_epoch_is_accepted_once_the_higher_lease_ran_out() -> None:
    """A controller restarted after its clock stepped back regains control after the old lease."""
    tracker = _tracker()
    _offer(tracker, _control(seq=50, epoch_ns=WALL0 - S))
    restarted = _control(seq=1, epoch_ns=WALL0 - HOUR, level=3)
    assert _offer(tracker, restarted, mono=MONO0 + 5 * S) == "stale"
    assert _offer(tracker, restarted, mono=MONO0 + 10 * S) == "accepted"


def test_a_higher_term_wins_whatever_its_epoch_and_sequence() -> None:
    """A new leader (higher term) is followed at once, though it started earlier (lower
    epoch) and counts from a lower sequence; the deposed leader is fenced from then on."""
    tracker = _tracker()
    assert _offer(tracker, _control(seq=900, term=7, issuer="a", epoch_ns=WALL0 - S)) == (
        "accepted"
    )
    new = _control(seq=3, term=12, level=2, issuer="b", epoch_ns=WALL0 - HOUR)
    assert _offer(tracker, new, mono=MONO0 + S) == "accepted"
    assert tracker.term == 12
    old = _control(seq=901, term=7, level=0, issuer="a", epoch_ns=WALL0 - S)
    assert _offer(tracker, old, mono=MONO0 + 2 * S) == "fenced"
    rack = _control(seq=902, term=7, level=0, issuer="a", scope="rack", rack="r1")
    assert _offer(tracker, rack, mono=MONO0 + 2 * S) == "fenced"  # every scope of the node
    lease = tracker.current(MONO0 + 3 * S)
    assert lease is not None
    assert (lease.control.issuer, lease.control.level) == ("b", 2)
    assert _offer(tracker, _control(seq=4, term=12, level=1, issuer="b"), mono=MONO0 + 3 * S) == (
        "accepted"
    )


def test_a_lower_term_is_followed_again_only_after_every_lease_lapsed() -> None:
    """An etcd cluster rebuilt from scratch restarts its revisions: its leader's low term
    is fenced while a higher term's lease runs, then followed, so no term locks it out."""
    tracker = _tracker()
    _offer(tracker, _control(seq=1, term=500, lease_s=10))
    rebuilt = _control(seq=1, term=2, level=3, issuer="b")
    assert _offer(tracker, rebuilt, mono=MONO0 + 5 * S) == "fenced"
    assert _offer(tracker, rebuilt, mono=MONO0 + 10 * S) == "accepted"
    assert tracker.term == 2


def test_a_term_jump_waits_for_the_current_lease_to_lapse() -> None:
    """A term far above the current one (2**39) cannot fence out the real controller: it
    is refused (``term_jump``) while the current term's lease lives, and the real
    controller's renewals keep being followed; only once that lease lapsed is it accepted."""
    tracker = _tracker()
    assert _offer(tracker, _control(seq=1, term=5, level=2, lease_s=10)) == "accepted"
    forged = _control(seq=1, term=2**39, level=0, issuer="mallory", epoch_ns=WALL0 - S)
    for i in range(1, 5):
        assert _offer(tracker, forged, mono=MONO0 + i * S) == "term_jump"
    assert tracker.term == 5
    assert tracker.rejected == 4
    renewal = _control(seq=2, term=5, level=2, lease_s=10)
    assert _offer(tracker, renewal, mono=MONO0 + 5 * S) == "accepted"  # lease to MONO0 + 15 s
    assert _offer(tracker, forged, mono=MONO0 + 14 * S) == "term_jump"
    lease = tracker.current(MONO0 + 14 * S)
    assert lease is not None
    assert (lease.control.term, lease.control.level) == (5, 2)
    # The real controller went quiet: its lease lapsed, and the big term is followed.
    assert _offer(tracker, forged, mono=MONO0 + 15 * S) == "accepted"
    assert tracker.term == 2**39


def test_a_term_step_within_the_bound_is_a_takeover_at_once() -> None:
    """A new leader's term a plausible step above the current one (5 -> 9, or exactly
    max_term_step above) is followed at once, while the old lease still runs."""
    tracker = _tracker()
    _offer(tracker, _control(seq=1, term=5, level=1))
    assert _offer(tracker, _control(seq=1, term=9, level=2, issuer="b"), mono=MONO0 + S) == (
        "accepted"
    )
    assert tracker.term == 9
    step = tracker.max_term_step
    assert step == 2**32
    at_bound = _control(seq=1, term=9 + step, level=3, issuer="c")
    assert _offer(tracker, at_bound, mono=MONO0 + 2 * S) == "accepted"
    beyond = _control(seq=1, term=9 + 2 * step + 1, level=0, issuer="d")
    assert _offer(tracker, beyond, mono=MONO0 + 3 * S) == "term_jump"


def test_the_first_term_ever_seen_is_accepted_up_to_the_plausible_bound() -> None:
    """An agent that has followed no one yet takes a large term (an etcd cluster with a
    long history: up to 2**40); a jump from term 0 (no high availability) waits while a
    term-0 lease runs."""
    fresh = _tracker()
    assert _offer(fresh, _control(seq=1, term=2**40)) == "accepted"
    assert fresh.term == 2**40
    tracker = _tracker()
    assert _offer(tracker, _control(seq=1, term=0, lease_s=10)) == "accepted"
    ha = _control(seq=1, term=2**40, issuer="b")
    assert _offer(tracker, ha, mono=MONO0 + S) == "term_jump"
    assert _offer(tracker, ha, mono=MONO0 + 10 * S) == "accepted"


def test_a_forged_first_term_cannot_lock_the_real_controller_out() -> None:
    """A control at term 2**63 - 1 arriving before the real controller's (it needs the
    control topic's write permission) is refused, first or not, lease or none; the real
    controller's small term is then followed at once, and the forged term stays refused
    after every lease lapsed."""
    tracker = _tracker()
    forged = _control(seq=1, term=2**63 - 1, level=0, issuer="mallory", lease_s=3600)
    assert _offer(tracker, forged) == "term_jump"
    assert tracker.term == 0
    assert tracker.current(MONO0 + S) is None
    real = _control(seq=1, term=3, level=2, lease_s=10)
    assert _offer(tracker, real, mono=MONO0 + S) == "accepted"
    assert _offer(tracker, forged, mono=MONO0 + 60 * S) == "term_jump"
    just_over = _control(seq=2, term=2**40 + 1, level=0, issuer="mallory")
    assert _offer(tracker, just_over, mono=MONO0 + 61 * S) == "term_jump"
    assert tracker.term == 3


def test_max_term_step_is_a_parameter() -> None:
    """A smaller bound (``agent.max_term_step``) refuses smaller jumps."""
    tracker = ControlTracker(
        row="row1", rack="r1", window=ClockWindow.of_seconds(5), max_term_step=10
    )
    _offer(tracker, _control(seq=1, term=5))
    assert _offer(tracker, _control(seq=1, term=16), mono=MONO0 + S) == "term_jump"
    assert _offer(tracker, _control(seq=1, term=15), mono=MONO0 + S) == "accepted"


@settings(max_examples=200, deadline=None)
@given(
    offers=st.lists(
        st.tuples(st.integers(0, 20), st.integers(0, 50), st.integers(0, 3)), max_size=30
    )
)
def test_the_level_in_force_never_comes_from_a_fenced_term(
    offers: list[tuple[int, int, int]],
) -> None:
    """Property: whatever order messages of several terms arrive in (all within one lease),
    the lease in force is always from the highest term offered so far."""
    tracker = _tracker()
    highest = -1
    for i, (term, seq, level) in enumerate(offers):
        _offer(tracker, _control(seq=seq, term=term, level=level), mono=MONO0 + i)
        highest = max(highest, term)
        lease = tracker.current(MONO0 + i)
        assert lease is not None
        assert lease.control.term == highest


def test_issuer_not_named_by_the_row_is_refused() -> None:
    """With control_issuers set, another issuer's control is refused."""
    tracker = _tracker(issuers=frozenset({"agg"}))
    assert _offer(tracker, _control(seq=1, issuer="mallory")) == "issuer"
    assert _offer(tracker, _control(seq=1, issuer="agg")) == "accepted"


def test_expired_and_foreign_messages_are_ignored() -> None:
    """Leases ending before they start and other rows' or racks' control never apply."""
    tracker = _tracker()
    assert _offer(tracker, _control(seq=1, lease_s=-1)) == "expired"
    assert _offer(tracker, _control(seq=2, row="row2")) == "foreign"
    assert _offer(tracker, _control(seq=3, scope="rack", rack="r9")) == "foreign"
    assert tracker.current(MONO0) is None


def test_highest_level_of_row_and_rack_scope_wins_until_it_expires() -> None:
    """Row and rack leases combine by the higher level while both are valid."""
    tracker = _tracker()
    _offer(tracker, _control(seq=1, level=1, lease_s=10))
    _offer(tracker, _control(seq=1, level=3, scope="rack", rack="r1", lease_s=2))
    now = tracker.current(MONO0 + S)
    assert now is not None
    assert now.control.level == 3
    later = tracker.current(MONO0 + 5 * S)
    assert later is not None
    assert later.control.level == 1
    gone = tracker.current(MONO0 + 20 * S)
    assert gone is not None  # the expired lease is still reported, so callers see "expired"
    assert gone.expires_mono_ns <= MONO0 + 20 * S


def test_observe_mode_never_raises_the_level() -> None:
    """Shadow-mode control is acknowledged but not applied."""
    tracker = _tracker()
    assert _offer(tracker, _control(seq=1, level=3, observe=True)) == "observed"
    assert tracker.current(MONO0) is None


@settings(max_examples=300, deadline=None)
@given(
    node_offset_s=st.integers(-100 * 365 * 86400, 100 * 365 * 86400),
    issued_offset_s=st.integers(-100 * 365 * 86400, 100 * 365 * 86400),
    lease_s=st.integers(-(10**9), 10**9),
    retained=st.booleans(),
)
def test_no_wall_clock_makes_a_lease_longer_than_granted(
    node_offset_s: int, issued_offset_s: int, lease_s: int, retained: bool
) -> None:
    """Whatever the clocks say, a lease never outlasts min(granted, maximum) after receipt."""
    tracker = _tracker()
    issued = max(0, WALL0 + issued_offset_s * S)
    control = _control(seq=1, issued_ns=issued, lease_s=max(lease_s, -issued // S))
    verdict = _offer(tracker, control, wall=WALL0 + node_offset_s * S, retained=retained)
    lease = tracker.current(MONO0)
    if verdict != "accepted":
        assert lease is None
        return
    assert lease is not None
    granted = control.lease_expires_ns - control.issued_ns
    assert 0 < lease.expires_mono_ns - MONO0 <= min(granted, MAX_LEASE)
