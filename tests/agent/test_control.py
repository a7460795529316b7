"""ControlTracker: which control messages the agent believes, and for how long."""

from __future__ import annotations

from polca.agent.control import ControlTracker
from polca.telemetry.schema import Control

S = 1_000_000_000


def _control(
    *,
    seq: int,
    level: int = 1,
    scope: str = "row",
    rack: str | None = None,
    row: str = "row1",
    issued_ns: int = 100 * S,
    lease_s: float = 10,
    epoch_ns: int = 1,
    observe: bool = False,
) -> Control:
    return Control(
        ts_ns=issued_ns,
        scope=scope,
        row=row,
        rack=rack,
        issuer="agg",
        epoch_ns=epoch_ns,
        seq=seq,
        level=level,
        issued_ns=issued_ns,
        lease_expires_ns=issued_ns + int(lease_s * S),
        observe=observe,
    )


def test_accepts_newer_and_ignores_stale_and_duplicate() -> None:
    """A lower or equal (epoch, seq) than the last accepted one is ignored and counted."""
    tracker = ControlTracker(row="row1", rack="r1")
    assert tracker.offer(_control(seq=5, level=2), received_ns=100 * S) == "accepted"
    assert tracker.offer(_control(seq=4, level=0), received_ns=100 * S) == "stale"
    assert tracker.offer(_control(seq=5, level=0), received_ns=100 * S) == "stale"
    assert tracker.rejected == 2
    lease = tracker.current(101 * S)
    assert lease is not None
    assert lease.control.level == 2


def test_new_epoch_supersedes_higher_seq() -> None:
    """A restarted controller (larger epoch) is accepted even with a lower seq."""
    tracker = ControlTracker(row="row1", rack="r1")
    tracker.offer(_control(seq=99, epoch_ns=1), received_ns=100 * S)
    assert tracker.offer(_control(seq=1, epoch_ns=2, level=0), received_ns=100 * S) == "accepted"


def test_expired_and_foreign_messages_are_ignored() -> None:
    """Expired leases and other rows' or racks' control never apply."""
    tracker = ControlTracker(row="row1", rack="r1")
    assert tracker.offer(_control(seq=1), received_ns=200 * S) == "expired"
    assert tracker.offer(_control(seq=2, row="row2"), received_ns=100 * S) == "foreign"
    assert tracker.offer(_control(seq=3, scope="rack", rack="r9"), received_ns=100 * S) == "foreign"
    assert tracker.current(100 * S) is None


def test_lease_is_bounded_after_receipt_against_clock_skew() -> None:
    """A lease lasts at most its granted length after receipt, whatever the clocks say."""
    tracker = ControlTracker(row="row1", rack="r1")
    # Issued (by the controller's clock) 1 s "in the future" of ours, lease 10 s.
    tracker.offer(_control(seq=1, issued_ns=101 * S, lease_s=10), received_ns=100 * S)
    lease = tracker.current(100 * S)
    assert lease is not None
    assert lease.expires_ns == 110 * S


def test_highest_level_of_row_and_rack_scope_wins_until_it_expires() -> None:
    """Row and rack leases combine by the higher level while both are valid."""
    tracker = ControlTracker(row="row1", rack="r1")
    tracker.offer(_control(seq=1, level=1, lease_s=10), received_ns=100 * S)
    tracker.offer(_control(seq=1, level=3, scope="rack", rack="r1", lease_s=2), received_ns=100 * S)
    now = tracker.current(101 * S)
    assert now is not None
    assert now.control.level == 3
    later = tracker.current(105 * S)
    assert later is not None
    assert later.control.level == 1
    gone = tracker.current(120 * S)
    assert gone is not None  # the expired lease is still reported, so callers see "expired"
    assert gone.expires_ns <= 120 * S


def test_observe_mode_never_raises_the_level() -> None:
    """Shadow-mode control is acknowledged but not applied."""
    tracker = ControlTracker(row="row1", rack="r1")
    assert tracker.offer(_control(seq=1, level=3, observe=True), received_ns=100 * S) == "observed"
    assert tracker.current(100 * S) is None
