"""The row's power from its sources (pure): sums, partial readings, what gets logged once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.meter.row import SourceFailure, SourceLog, row_meter
from polca.meter.source import SourceReading
from polca.telemetry.schema import Meter, decode, encode


def test_a_row_is_the_sum_of_its_sources_and_their_energy() -> None:
    meter = row_meter(
        [
            ("pdu-a", SourceReading(5200.0, "device power", energy_j=1e6)),
            ("pdu-b", SourceReading(4800.0, "device power", energy_j=2e6)),
        ],
        now_ns=1,
    )
    assert meter.power_w == 10_000.0
    assert meter.energy_j == 3e6
    assert meter.sources == 2
    assert not meter.partial
    assert meter.missing == {}


def test_one_failed_source_makes_the_reading_partial_and_says_why() -> None:
    meter = row_meter(
        [
            ("pdu-a", SourceReading(5200.0, "device power", energy_j=1e6)),
            ("pdu-b", SourceFailure("timeout", "no answer within 0.8 s")),
        ],
        now_ns=1,
    )
    assert meter.partial
    assert meter.missing == {"pdu-b": "timeout"}
    assert meter.power_w == 5200.0  # the sources that answered, flagged: never the row's
    assert meter.energy_j is None  # half a counter is no counter
    assert meter.sources == 1


def test_energy_is_left_out_unless_every_source_counts_it() -> None:
    meter = row_meter(
        [("a", SourceReading(1.0, "x", energy_j=5.0)), ("b", SourceReading(1.0, "x"))], now_ns=1
    )
    assert meter.energy_j is None


@given(
    st.lists(
        st.one_of(
            st.builds(
                SourceReading,
                st.floats(0, 2e6),
                st.text(max_size=8),
                st.none() | st.floats(0, 1e12),
            ),
            st.builds(SourceFailure, st.text(min_size=1, max_size=200), st.text(max_size=20)),
        ),
        min_size=1,
        max_size=64,
    )
)
def test_every_round_makes_a_message_that_passes_the_wire_schema(results: list[object]) -> None:
    named = [(f"s{i}", r) for i, r in enumerate(results)]
    meter = row_meter(named, now_ns=1)  # type: ignore[arg-type]
    again = decode(encode(meter), Meter)
    assert again == meter
    assert meter.partial == any(isinstance(r, SourceFailure) for r in results)


def test_an_outage_is_logged_when_it_starts_and_when_it_ends_not_per_poll() -> None:
    log = SourceLog()
    good = SourceReading(100.0, "device power")
    assert log.note("r/a", good, 0.0) == []
    first = log.note("r/a", SourceFailure("timeout", "slow"), 1.0)
    assert [c.event for c in first] == ["meter_source_failed"]
    assert log.note("r/a", SourceFailure("timeout", "slow"), 2.0) == []
    changed = log.note("r/a", SourceFailure("unreachable", "refused"), 3.0)
    assert [c.event for c in changed] == ["meter_source_failed"]  # a new reason is news
    assert log.note("r/a", SourceFailure("timeout", "slow"), 3.2) == []  # seen in this outage
    assert log.failing() == ["r/a"]
    back = log.note("r/a", good, 4.5)
    assert [c.event for c in back] == ["meter_source_recovered"]
    assert back[0].fields["outage_s"] == pytest.approx(3.5)
    assert back[0].fields["failed_reads"] == 4
    assert log.failures == {("r/a", "timeout"): 3, ("r/a", "unreachable"): 1}
    assert log.reads == {"r/a": 2}
    assert log.failing() == []


def test_a_fallback_is_logged_once_when_the_value_used_changes() -> None:
    log = SourceLog()
    apc = SourceReading(
        900.0, "phase power (1 phase)", fallbacks=("device power: -1 (not supported)",)
    )
    first = log.note("r/a", apc, 0.0)
    assert [c.event for c in first] == ["meter_source_fallback"]
    assert first[0].fields["skipped"] == ["device power: -1 (not supported)"]
    assert log.note("r/a", apc, 1.0) == []
    assert [c.event for c in log.note("r/a", SourceReading(1.0, "device power"), 2.0)] == [
        "meter_source_fallback"
    ]
