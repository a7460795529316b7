"""UPS-MIB (RFC 1628) values decoded into a UPS's state; anything out of the MIB refused."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.errors import ReadingRejectedError
from polca.meter.ups import UPS_OIDS, UpsState, decode_ups


def test_the_oids_are_the_mibs() -> None:
    assert UPS_OIDS["output_source"] == "1.3.6.1.2.1.33.1.4.1.0"
    assert all(oid.startswith("1.3.6.1.2.1.33.1.") for oid in UPS_OIDS.values())


@pytest.mark.parametrize(
    ("source", "name", "equipment", "on_battery"),
    [
        (1, "other", "unknown", False),
        (2, "none", "down", False),
        (3, "normal", "up", False),
        (4, "bypass", "up", False),
        (5, "battery", "up", True),
        (6, "booster", "up", False),
        (7, "reducer", "up", False),
    ],
)
def test_each_output_source_is_a_feed_state(
    source: int, name: str, equipment: str, on_battery: bool
) -> None:
    state = decode_ups({"output_source": source})
    assert state.output_source == name
    assert state.equipment == equipment
    assert state.on_battery is on_battery


def test_a_ups_on_battery_says_how_long_it_lasts() -> None:
    assert decode_ups(
        {"output_source": 5, "battery_status": 3, "minutes_remaining": 7, "output_percent_load": 64}
    ) == UpsState("battery", "low", 7.0, 64.0)
    assert decode_ups({"output_source": 5, "input_voltage": 0}).input_voltage_v == 0.0


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ({}, "unsupported"),
        ({"output_source": 0}, "absurd"),
        ({"output_source": 8}, "absurd"),
        ({"output_source": "5"}, "type"),
        ({"output_source": True}, "type"),
        ({"output_source": 3, "battery_status": 9}, "absurd"),
        ({"output_source": 3, "minutes_remaining": -1}, "negative"),
        ({"output_source": 3, "minutes_remaining": 2**31}, "absurd"),
        ({"output_source": 3, "output_percent_load": 201}, "absurd"),
        ({"output_source": 3, "output_percent_load": 50.5}, "type"),
        ({"output_source": 3, "input_voltage": 1501}, "absurd"),
        ({"output_source": 3, "input_voltage": "230"}, "type"),
    ],
)
def test_a_value_outside_the_mib_is_refused(values: dict[str, Any], reason: str) -> None:
    with pytest.raises(ReadingRejectedError) as caught:
        decode_ups(values)
    assert caught.value.reason == reason


_ANY = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=4)
    | st.binary(max_size=4)
)


@given(st.dictionaries(st.sampled_from(sorted(UPS_OIDS)), _ANY))
def test_any_answer_is_a_state_or_refused(values: dict[str, object]) -> None:
    reason: str | None = None
    state: UpsState | None = None
    try:
        state = decode_ups(values)
    except ReadingRejectedError as exc:
        reason = exc.reason
    assert (state is None) != (reason is None)
    assert reason in {None, "unsupported", "absurd", "type", "negative", "nan"}
    if state is not None:
        assert state.equipment in {"up", "down", "unknown"}
        if state.minutes_remaining is not None:
            assert 0 <= state.minutes_remaining < 2**31
