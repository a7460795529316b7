"""The one outage book (``outages.py``): what a source's failures and recoveries are worth."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from polca.outages import Failed, OutageBook, Recovered


def test_an_outage_is_two_lines_whatever_its_length() -> None:
    """The first failure starts it (one line), repeats say nothing, the next good read ends
    it with its length and the failed reads (one line)."""
    book = OutageBook()
    assert book.ok(0.0) is None  # no outage: nothing to say
    assert book.failed("timeout", 1.0) == Failed("timeout", started=True)
    assert book.failed("timeout", 2.0) is None
    assert book.failed("timeout", 3.0) is None
    assert book.out
    assert book.ok(4.5) == Recovered(outage_s=3.5, failures=3)
    assert not book.out
    assert (book.failures, book.reasons, book.ok_s) == (0, set(), 4.5)


def test_a_new_reason_within_an_outage_is_worth_a_line_once() -> None:
    book = OutageBook()
    book.failed("timeout", 0.0)
    assert book.failed("refused", 1.0) == Failed("refused", started=False)
    assert book.failed("refused", 2.0) is None
    assert book.failed("timeout", 3.0) is None
    assert book.ok(4.0) == Recovered(outage_s=4.0, failures=4)
    assert book.failed("refused", 5.0) == Failed("refused", started=True)  # a new outage


def test_unread_counts_from_the_last_good_read_or_the_start() -> None:
    book = OutageBook()
    assert book.unread_s(10.0, started_s=4.0) == 6.0  # never read: since the start
    book.ok(7.0)
    book.failed("timeout", 8.0)
    assert book.unread_s(10.0, started_s=4.0) == 3.0  # the last good read, not the failure


@given(st.lists(st.tuples(st.sampled_from(["ok", "a", "b", "c"]), st.floats(0, 10)), max_size=60))
def test_lines_and_counts_match_the_reads_whatever_their_order(
    reads: list[tuple[str, float]],
) -> None:
    """Any sequence of reads: each outage gives exactly one start and one recovery (when it
    ended), a line per distinct reason, and the failures it counted."""
    book, now, starts, recoveries, failures_in_outage = OutageBook(), 0.0, 0, 0, 0
    reasons: set[str] = set()
    for what, step_s in reads:
        now += step_s
        if what == "ok":
            ended = book.ok(now)
            assert (ended is not None) == (failures_in_outage > 0)
            if ended is not None:
                assert ended.failures == failures_in_outage
                assert ended.outage_s >= 0
                recoveries += 1
            failures_in_outage, reasons = 0, set()
            continue
        line = book.failed(what, now)
        failures_in_outage += 1
        assert (line is not None) == (what not in reasons)
        assert line is None or line.started == (failures_in_outage == 1)
        starts += line is not None and line.started
        reasons.add(what)
    assert starts - recoveries == (1 if book.out else 0)
    assert book.failures == failures_in_outage
