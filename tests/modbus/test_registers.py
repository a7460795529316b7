"""The shared register point: each kind of map says what its points measure."""

from __future__ import annotations

import pytest

from polca.modbus.registers import RegisterPoint, decode_point


def test_a_bare_point_does_not_guess_what_it_measures() -> None:
    point = RegisterPoint.model_validate({"field": "anything", "address": 0})
    with pytest.raises(NotImplementedError, match="does not say what anything measures"):
        _ = point.quantity
    with pytest.raises(NotImplementedError, match="no state for an unknown code"):
        _ = point.unknown_state
    with pytest.raises(NotImplementedError):
        decode_point(point, [1])
