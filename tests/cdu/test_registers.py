"""Modbus register maps: validation, read planning and decoding (no network)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.cdu.registers import (
    MAX_LEAK_DETECTORS,
    MAX_PUMPS,
    CduPoint,
    ModbusCduConfig,
    assemble,
    load_map,
)
from polca.errors import ConfigError
from polca.modbus.registers import (
    DecodeProblem,
    WordOrder,
    decode_point,
    plan_reads,
)
from tests.fuzzing import FUZZ
from tests.modbus.conftest import word16, words32

EXAMPLE_MAP = Path(__file__).resolve().parents[2] / "deploy" / "cdu-modbus.example.yaml"


def base_map(*points: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A minimal valid map with ``points``."""
    raw: dict[str, Any] = {"cdu": "cdu1", "loop": "loop1", "host": "127.0.0.1"}
    raw["points"] = list(points) or [{"field": "secondary.supply_temp_c", "address": 0}]
    raw.update(extra)
    return raw


def point(**kwargs: Any) -> CduPoint:
    """A validated point."""
    return CduPoint.model_validate(kwargs)


@pytest.mark.parametrize(
    ("kind", "value", "order"),
    [
        ("uint32", 4_000_000_000, "big"),
        ("uint32", 70_000, "little"),
        ("int32", -123_456, "big"),
        ("int32", -2, "little"),
        ("float32", 31.25, "big"),
        ("float32", -7.5, "little"),
    ],
)
def test_decode_32_bit_types_in_both_word_orders(kind: str, value: float, order: str) -> None:
    """32-bit integers and floats decode in big and little word order."""
    p = point(field="secondary.heat_removed_kw", address=0, type=kind, word_order=order, scale=1e-5)
    decoded = decode_point(p, words32(value, kind, word_order=order))
    assert decoded == pytest.approx(value * 1e-5, rel=1e-12)


def test_map_word_order_is_the_default() -> None:
    """A point without word_order uses the map's."""
    p = point(field="secondary.heat_removed_kw", address=0, type="int32")
    little = words32(-5, "int32", word_order="little")
    assert decode_point(p, little, word_order="little") == -5
    assert decode_point(p, little, word_order="big") != -5


def test_decode_16_bit_scale_offset_and_units() -> None:
    """Scale and offset apply in the device's unit, then the unit is converted."""
    fahrenheit = point(
        field="secondary.supply_temp_c", address=0, type="int16", scale=0.1, unit="F"
    )
    assert decode_point(fahrenheit, [word16(860)]) == pytest.approx(30.0)
    below_zero = point(field="primary.supply_temp_c", address=0, type="int16", scale=0.1)
    assert decode_point(below_zero, [word16(-55)]) == pytest.approx(-5.5)
    kelvin = point(field="primary.return_temp_c", address=0, scale=0.01, unit="K")
    assert decode_point(kelvin, [30_315]) == pytest.approx(30.0)
    gpm = point(field="secondary.flow_lpm", address=0, scale=0.1, unit="gpm")
    assert decode_point(gpm, [396]) == pytest.approx(39.6 * 3.785411784)
    psi = point(field="secondary.delta_pressure_kpa", address=0, scale=0.01, unit="psi")
    assert decode_point(psi, [2176]) == pytest.approx(21.76 * 6.894757293168)
    bar = point(field="secondary.delta_pressure_kpa", address=0, scale=0.01, unit="bar")
    assert decode_point(bar, [150]) == pytest.approx(150.0)
    watts = point(field="secondary.heat_removed_kw", address=0, type="uint32", unit="w")
    assert decode_point(watts, words32(80_500, "uint32")) == pytest.approx(80.5)
    offset = point(field="valve_position_pct", address=0, scale=0.5, offset=-10.0)
    assert decode_point(offset, [100]) == pytest.approx(40.0)


def test_decode_states_bits_and_bounds() -> None:
    """Enums map codes to states; bits pick one flag; bad values become problems."""
    pump = point(
        field="pumps.0.state", address=0, enum={0: "off", 1: "running", 2: "standby", 3: "failed"}
    )
    assert decode_point(pump, [2]) == "standby"
    unknown = decode_point(pump, [9])
    assert isinstance(unknown, DecodeProblem)
    assert "failed" in unknown.reason
    leak = point(field="leak_detectors.0.state", address=0, bit=3, enum={0: "ok", 1: "critical"})
    assert decode_point(leak, [0b1000]) == "critical"
    assert decode_point(leak, [0b0111]) == "ok"
    nan = point(field="secondary.supply_temp_c", address=0, type="float32")
    assert isinstance(decode_point(nan, words32(math.nan, "float32")), DecodeProblem)
    hot = point(field="secondary.supply_temp_c", address=0)
    problem = decode_point(hot, [65_000])
    assert isinstance(problem, DecodeProblem)
    assert "outside" in problem.reason
    valve = point(field="valve_position_pct", address=0, scale=0.1)
    assert decode_point(valve, [1003]) == 100.0  # within slack: clamped
    assert isinstance(decode_point(valve, [1100]), DecodeProblem)


def test_plan_reads_groups_contiguous_registers() -> None:
    """Contiguous registers of one table share a request; gaps and tables split them."""
    config = load_map(
        base_map(
            {"field": "secondary.supply_temp_c", "address": 10},
            {"field": "secondary.return_temp_c", "address": 11},
            {"field": "secondary.heat_removed_kw", "address": 12, "type": "float32"},
            {"field": "secondary.flow_lpm", "address": 20},
            {"field": "primary.supply_temp_c", "address": 10, "table": "input"},
            {"field": "primary.return_temp_c", "address": 11, "table": "input"},
        )
    )
    blocks = plan_reads(config.points)
    assert [(b.table, b.address, b.count) for b in blocks] == [
        ("holding", 10, 4),
        ("holding", 20, 1),
        ("input", 10, 2),
    ]
    bridged = plan_reads(config.points, max_gap=6)
    assert [(b.table, b.address, b.count) for b in bridged] == [
        ("holding", 10, 11),
        ("input", 10, 2),
    ]
    capped = plan_reads(config.points, max_count=3)
    assert [(b.table, b.address, b.count) for b in capped] == [
        ("holding", 10, 2),
        ("holding", 12, 2),
        ("holding", 20, 1),
        ("input", 10, 2),
    ]


def test_plan_reads_shares_a_register_between_bits() -> None:
    """Several bits of one status word cost one register in one request."""
    config = load_map(
        base_map(
            {
                "field": "leak_detectors.0.state",
                "address": 5,
                "bit": 0,
                "enum": {0: "ok", 1: "critical"},
            },
            {
                "field": "leak_detectors.1.state",
                "address": 5,
                "bit": 1,
                "enum": {0: "ok", 1: "critical"},
            },
        )
    )
    assert [(b.address, b.count, len(b.points)) for b in plan_reads(config.points)] == [(5, 1, 2)]


@pytest.mark.parametrize(
    ("points", "extra", "match"),
    [
        ([{"field": "secondary.colour", "address": 0}], {}, "unknown field"),
        (
            [{"field": "secondary.flow_lpm", "address": 0, "unit": "psi"}],
            {},
            "unit psi is a pressure",
        ),
        ([{"field": "pumps.0.state", "address": 0}], {}, "needs an enum"),
        ([{"field": "pumps.0.state", "address": 0, "enum": {1: "spinning"}}], {}, "spinning"),
        ([{"field": "secondary.flow_lpm", "address": 0, "enum": {1: "ok"}}], {}, "only for state"),
        ([{"field": "secondary.flow_lpm", "address": 0, "type": "float32", "bit": 1}], {}, "bit 1"),
        ([{"field": "secondary.flow_lpm", "address": 70000}], {}, "less than or equal"),
        ([{"field": "secondary.flow_lpm", "address": 0, "type": "int8"}], {}, "type"),
        (
            [{"field": "pumps.1.speed_pct", "address": 0}],
            {},
            r"pumps \[0, 1\] have no state point",
        ),
        (
            [
                {"field": "secondary.flow_lpm", "address": 0},
                {"field": "secondary.flow_lpm", "address": 1},
            ],
            {},
            "mapped twice",
        ),
        ([], {"pumps": ["P1"]}, r"pumps \[0\] have no state point"),
        ([], {"port": 0}, "port"),
        ([], {"extra_key": 1}, "extra_key"),
    ],
)
def test_bad_maps_are_refused_with_a_clear_error(
    points: list[dict[str, Any]], extra: dict[str, Any], match: str
) -> None:
    """Every kind of bad map raises ConfigError naming the problem."""
    with pytest.raises(ConfigError, match=match):
        load_map(base_map(*points, **extra), where="test-map")


def test_bad_map_file_names_the_file(tmp_path: Path) -> None:
    """A map file that is not YAML, or invalid, is reported with its path."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("points: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"broken\.yaml"):
        load_map(broken)
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        load_map(tmp_path / "missing.yaml")


def test_assemble_builds_the_nested_message() -> None:
    """Decoded values land in their CduTelemetry fields, with names from the map."""
    config = load_map(
        base_map(
            {"field": "secondary.supply_temp_c", "address": 0},
            {"field": "secondary.flow_lpm", "address": 1},
            {"field": "primary.supply_temp_c", "address": 2},
            {"field": "pumps.0.state", "address": 3, "enum": {1: "running"}},
            {"field": "pumps.0.speed_pct", "address": 4},
            {"field": "pumps.1.state", "address": 5, "enum": {1: "running"}},
            {"field": "leak_detectors.0.state", "address": 6, "enum": {0: "ok"}},
            {"field": "status", "address": 7, "enum": {0: "ok"}},
            {"field": "valve_position_pct", "address": 8},
            pumps=["P-A"],
        )
    )
    message = assemble(
        config,
        {
            "secondary.supply_temp_c": 30.5,
            "secondary.flow_lpm": DecodeProblem("secondary.flow_lpm", 1, "bad"),
            "primary.supply_temp_c": 21.0,
            "pumps.0.state": "running",
            "pumps.0.speed_pct": 70.0,
            "pumps.1.state": DecodeProblem("pumps.1.state", 9, "unknown"),
            "leak_detectors.0.state": DecodeProblem("leak_detectors.0.state", 9, "unknown"),
            "status": "ok",
            "valve_position_pct": 55.0,
        },
        ts_ns=123,
    )
    assert message.ts_ns == 123
    assert message.secondary.supply_temp_c == 30.5
    assert message.secondary.flow_lpm is None  # undecodable: left out
    assert message.primary is not None
    assert message.primary.supply_temp_c == 21.0
    assert [(p.name, p.state, p.speed_pct) for p in message.pumps] == [
        ("P-A", "running", 70.0),
        ("pump2", "failed", None),  # unknown code: the conservative state
    ]
    assert [(d.name, d.state) for d in message.leak_detectors] == [("leak1", "critical")]
    assert message.valve_position_pct == 55.0


def test_example_map_is_valid() -> None:
    """deploy/cdu-modbus.example.yaml validates and needs few requests."""
    from polca.cdu.config import CduSettings
    from polca.settings import load_settings_as

    settings = load_settings_as(CduSettings, EXAMPLE_MAP)
    assert settings.modbus is not None
    config = settings.modbus
    fields = {p.field for p in config.points}
    assert {"secondary.supply_temp_c", "pumps.0.state", "leak_detectors.0.state"} <= fields
    assert len(plan_reads(config.points, max_gap=config.max_gap_registers)) <= 4


@pytest.mark.parametrize(
    ("points", "extra", "match"),
    [
        (
            [{"field": "pumps.99999999999.state", "address": 0, "enum": {1: "running"}}],
            {},
            "index 99999999999 is beyond the 16",
        ),
        (
            [
                {"field": f"pumps.{i}.state", "address": i, "enum": {1: "running"}}
                for i in range(17)
            ],
            {},
            "index 16 is beyond the 16",
        ),
        ([], {"leak_detectors": ["x"] * 65}, "at most 64"),
        ([], {"cdu": "c" * 129}, "at most 128"),
        (
            [{"field": "pumps.0.state", "address": 0, "enum": {1: "running"}}],
            {"pumps": ["p" * 129]},
            "at most 128 characters",
        ),
        ([{"field": "secondary.flow_lpm", "address": 0, "scale": math.inf}], {}, "finite"),
        ([{"field": "secondary.flow_lpm", "address": 0, "offset": math.nan}], {}, "finite"),
        ([{"field": "pumps.\u0663.state", "address": 0, "enum": {1: "ok"}}], {}, "unknown field"),
        ([{"field": "status." + "x" * 100, "address": 0}], {}, "at most 64"),
        (
            [{"field": "status", "address": 0, "enum": dict.fromkeys(range(300), "ok")}],
            {},
            "at most 256",
        ),
    ],
)
def test_maps_are_bounded_to_what_the_wire_schema_carries(
    points: list[dict[str, Any]], extra: dict[str, Any], match: str
) -> None:
    """Names, counts, indices and scales a CDU message cannot carry are refused up front."""
    with pytest.raises(ConfigError, match=match):
        load_map(base_map(*points, **extra), where="test-map")


def test_schema_bounds_are_the_wire_schema_s() -> None:
    """MAX_PUMPS and MAX_LEAK_DETECTORS follow CduTelemetry's own list bounds."""
    assert (MAX_PUMPS, MAX_LEAK_DETECTORS) == (16, 64)


def test_hostile_map_file_is_a_config_error(tmp_path: Path) -> None:
    """A map file with an alias bomb or deep nesting is refused by the bounded loader."""
    path = tmp_path / "map.yaml"
    path.write_text("points: " + "[" * 10_000 + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"map\.yaml:1:72: YAML nested deeper than 64"):
        load_map(path)


@pytest.mark.parametrize(
    ("registers", "reason"),
    [
        ([], "expected 1 registers, got 0"),
        ([1, 2], "expected 1 registers, got 2"),
        ([-1], "negative"),
        ([0x10000], "17 bits wide"),
        ([10**5000], "bits wide"),
        ([True], "type bool"),
        (["1"], "type str"),
    ],
)
def test_wrong_register_words_are_problems(registers: list[Any], reason: str) -> None:
    """A wrong count or a word that is not 16 bits is a DecodeProblem, never an exception."""
    decoded = decode_point(point(field="secondary.flow_lpm", address=0), registers)
    assert isinstance(decoded, DecodeProblem)
    assert reason in decoded.reason


def test_infinite_float_and_overflowing_scale_are_problems() -> None:
    """An infinite float32 and a huge scale that overflows are problems, not readings."""
    temp = point(field="secondary.supply_temp_c", address=0, type="float32")
    problem = decode_point(temp, words32(math.inf, "float32"))
    assert isinstance(problem, DecodeProblem)
    assert problem.reason == "infinite"
    huge = point(field="secondary.heat_removed_kw", address=0, type="float32", scale=1e308)
    overflow = decode_point(huge, words32(3.0e38, "float32"))
    assert isinstance(overflow, DecodeProblem)
    assert "overflows" in overflow.reason


_FIELDS = (
    "secondary.supply_temp_c",
    "primary.return_temp_c",
    "secondary.flow_lpm",
    "secondary.delta_pressure_kpa",
    "secondary.heat_removed_kw",
    "valve_position_pct",
    "pumps.0.speed_pct",
    "pumps.0.state",
    "leak_detectors.0.state",
    "status",
)
_STATE_NAMES = {
    "pumps": ("running", "standby", "failed", "off"),
    "leak_detectors": ("ok", "warning", "critical"),
    "status": ("ok", "warning", "critical"),
}
_BOUNDS = {
    "temp": (-60.0, 300.0),
    "flow": (0.0, 100_000.0),
    "pressure": (-1000.0, 10_000.0),
    "heat": (-100_000.0, 100_000.0),
    "pct": (0.0, 100.0),
}


@st.composite
def register_points(draw: st.DrawFn) -> CduPoint:
    """Any valid point: every field kind, type, word order, scale, unit and bit."""
    field = draw(st.sampled_from(_FIELDS))
    raw: dict[str, Any] = {"field": field, "address": draw(st.integers(0, 65534))}
    group = field.split(".")[0]
    if field.endswith("state") or field == "status":
        raw["type"] = draw(st.sampled_from(("uint16", "int16", "uint32", "int32")))
        names = _STATE_NAMES[group]
        raw["enum"] = draw(
            st.dictionaries(st.integers(-70_000, 70_000), st.sampled_from(names), min_size=1)
        )
        if draw(st.booleans()):
            raw["bit"] = draw(st.integers(0, 15))
    else:
        raw["type"] = draw(st.sampled_from(("uint16", "int16", "uint32", "int32", "float32")))
        finite = st.floats(-1e12, 1e12, allow_nan=False, allow_infinity=False)
        raw["scale"] = draw(finite)
        raw["offset"] = draw(finite)
        units = {
            "temp": ("C", "F", "K"),
            "flow": ("lpm", "gpm", "m3h", "lps"),
            "pressure": ("kpa", "pa", "bar", "psi"),
            "heat": ("kw", "w"),
            "valve": ("pct",),
            "pumps": ("pct",),
        }
        kind = next(k for k in units if k in field.replace("delta_", "").replace("removed", ""))
        raw["unit"] = draw(st.none() | st.sampled_from(units[kind]))
    raw["word_order"] = draw(st.none() | st.sampled_from(("big", "little")))
    return CduPoint.model_validate(raw)


def _bounds_of(field: str) -> tuple[float, float]:
    for key, name in (
        ("temp", "temp"),
        ("flow", "flow"),
        ("pressure", "pressure"),
        ("heat", "heat"),
        ("pct", "pct"),
    ):
        if key in field:
            return _BOUNDS[name]
    msg = f"no bounds for {field}"
    raise AssertionError(msg)


@FUZZ
@given(
    p=register_points(),
    words=st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=3),
    order=st.sampled_from(("big", "little")),
)
def test_fuzz_any_16_bit_words_decode_to_a_reading_or_a_problem(
    p: CduPoint, words: list[int], order: WordOrder
) -> None:
    """Any register words give a bounded finite number, a valid state or a DecodeProblem."""
    decoded = decode_point(p, words, word_order=order)
    if isinstance(decoded, DecodeProblem):
        assert decoded.field == p.field
        if len(words) == p.width:
            assert "registers" not in decoded.reason
        return
    assert len(words) == p.width
    if isinstance(decoded, str):
        assert decoded in _STATE_NAMES[p.field.split(".")[0]]
    else:
        low, high = _bounds_of(p.field)
        assert math.isfinite(decoded)
        assert low <= decoded <= high


@functools.cache
def example_map() -> ModbusCduConfig:
    """The register map of deploy/cdu-modbus.example.yaml, read once."""
    from polca.cdu.config import CduSettings
    from polca.settings import load_settings_as

    settings = load_settings_as(CduSettings, EXAMPLE_MAP)
    assert settings.modbus is not None
    return settings.modbus


@FUZZ
@given(data=st.data())
def test_fuzz_example_map_assembles_from_any_registers(data: st.DataObject) -> None:
    """Every register block of the example map, filled with any words, assembles validly."""
    config = example_map()
    values: dict[str, float | str | DecodeProblem] = {}
    for block in plan_reads(config.points, max_gap=config.max_gap_registers):
        words = data.draw(
            st.lists(st.integers(0, 0xFFFF), min_size=block.count, max_size=block.count)
        )
        for p in block.points:
            start = p.address - block.address
            values[p.field] = decode_point(
                p, words[start : start + p.width], word_order=config.word_order
            )
    message = assemble(config, values, ts_ns=1)
    assert message.cdu == config.cdu
    assert len(message.pumps) == len(config.names("pumps"))


def test_map_in_a_cdu_config_file_is_typed_yaml(tmp_path: Path) -> None:
    """An address written as a string in the CDU settings file is refused, not converted."""
    from polca.cdu.config import CduSettings
    from polca.settings import load_settings_as

    config = tmp_path / "cdu.yaml"
    config.write_text(
        "modbus: {cdu: c, loop: l, host: h, points: [{field: status, address: '3', "
        "enum: {0: ok}}]}\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=r"modbus\.points\.0\.address: expected a number"):
        load_settings_as(CduSettings, config)
