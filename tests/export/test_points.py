"""Line protocol and the InfluxDB schema: escaping, types, builders, and the documentation."""

from __future__ import annotations

import json
import math
import random
import re
import time
from pathlib import Path
from typing import Final

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polca.aggregator import points
from polca.aggregator.step import RowResult, StepResult
from polca.cooling.alarms import AlarmEvent
from polca.cooling.loops import LoopSpec
from polca.cooling.supervisor import CoolingStep, LoopAssessment, LoopSupervisor
from polca.export import gpus
from polca.export.points import AnyPoint, LineTemplate, Point, encode_lines, make_point
from polca.export.schema import BULK_MEASUREMENTS, ESSENTIAL_MEASUREMENTS, SCHEMA
from polca.telemetry.schema import CduTelemetry, Control, Event, GpuTelemetry, Telemetry
from tests.aggregator import test_budgets as budget_rig
from tests.tsdb import InfluxDB1Process, VictoriaMetricsProcess

ROOT = Path(__file__).resolve().parents[2]
TS_NS = 1_700_000_000_123_456_789


def _gpu(index: int, **overrides: object) -> GpuTelemetry:
    values: dict[str, object] = {
        "index": index,
        "uuid": f"GPU-{index:08d}-aaaa-bbbb-cccc-dddddddddddd",
        "name": "NVIDIA H100 80GB HBM3",
        "priority_class": "high" if index < 2 else "low",
        "samples": 10,
        "power_w": 401.0,
        "power_min_w": 380.0,
        "power_mean_w": 400.0 + index,
        "power_max_w": 420.0,
        "power_avg_w": 399.0,
        "energy_j": 1.5e6,
        "energy_delta_j": 400.0,
        "gpu_temp_c": 61.0,
        "gpu_temp_max_c": 63.0,
        "mem_temp_c": 70.0,
        "sm_clock_mhz": 1980,
        "mem_clock_mhz": 2619,
        "gpu_util_pct": 97.0,
        "mem_util_pct": 40.0,
        "power_limit_w": 700.0,
        "enforced_power_limit_w": 700.0,
        "clock_event_reasons": 4,
        "locked_sm_clock_max_mhz": 1980,
    }
    values.update(overrides)
    return GpuTelemetry.model_validate(values)


def _telemetry(gpus: tuple[GpuTelemetry, ...]) -> Telemetry:
    return Telemetry(
        ts_ns=TS_NS,
        seq=7,
        node="n01",
        interval_s=1.0,
        node_gpu_power_w=sum(g.power_mean_w or 0.0 for g in gpus),
        node_energy_delta_j=3200.0,
        gpus=gpus,
    )


def test_line_escapes_measurement_tags_keys_and_strings() -> None:
    """Commas, spaces, equals signs, quotes and backslashes are escaped where each matters."""
    point = Point(
        "my meas,x",
        {"z key": "a b,c=d", "a": "plain"},
        {"f=1 x": 1.5, "s": 'say "hi" \\ bye'},
        TS_NS,
    )
    assert point.to_line() == (
        r"my\ meas\,x,a=plain,z\ key=a\ b\,c\=d "
        r'f\=1\ x=1.5,s="say \"hi\" \\ bye" 1700000000123'
    )


def test_line_types_int_float_bool() -> None:
    """Ints get the i suffix, floats stay floats (even whole ones), bools are true/false."""
    point = Point("m", {}, {"i": 3, "f": 250.0, "t": True, "n": False, "big": 1e20}, TS_NS)
    assert point.to_line() == "m i=3i,f=250.0,t=true,n=false,big=1e+20 1700000000123"


def test_line_drops_none_nan_empty_tags_and_empty_points() -> None:
    """None and non-finite values and empty tag values are left out; no fields, no line."""
    point = Point("m", {"b": "", "a": "x"}, {"v": None, "w": math.nan, "u": math.inf, "k": 1.0}, 0)
    assert point.to_line() == "m,a=x k=1.0 0"
    assert Point("m", {"a": "x"}, {"v": None}, TS_NS).to_line() == ""
    body = encode_lines([Point("m", {}, {"v": None}, 1), Point("m", {}, {"v": 2.0}, 2_000_000)])
    assert body == b"m v=2.0 2"


def test_line_precision_and_newlines() -> None:
    """The timestamp follows the precision; newlines never split a line."""
    point = Point("m", {"t": "a\nb"}, {"s": "one\ntwo"}, TS_NS)
    assert point.to_line("s") == 'm,t=a\\nb s="one\\ntwo" 1700000000'
    assert point.to_line("ns").endswith(f" {TS_NS}")
    assert "\n" not in point.to_line()


def test_escaped_point_reads_back_from_influxdb(influxdb1: InfluxDB1Process) -> None:
    """A hostile tag and string survive a real InfluxDB round trip; types stay int/float."""
    point = Point(
        "gpu",
        {"node": "n 1,x=y", "site": "s"},
        {"power_w": 250.0, "clock_event_reasons": 4, "text": 'q"uote \\ back'},
        1_700_000_000_000_000_000,
    )
    influxdb1.write(point.to_line().encode())
    series = influxdb1.query('SELECT * FROM "gpu"')
    row = dict(zip(series[0]["columns"], series[0]["values"][0], strict=True))
    assert row["node"] == "n 1,x=y"
    assert row["text"] == 'q"uote \\ back'
    assert row["power_w"] == 250.0
    assert row["clock_event_reasons"] == 4
    keys = influxdb1.query('SHOW FIELD KEYS FROM "gpu"')[0]["values"]
    assert dict(keys) == {"clock_event_reasons": "integer", "power_w": "float", "text": "string"}


def _assert_matches_schema(point: AnyPoint) -> None:
    schema = SCHEMA[point.measurement]
    assert set(point.tags) <= set(schema.tags)
    for name, value in point.fields.items():
        declared = schema.field_type(name)
        assert declared is not None, f"{point.measurement}.{name} is not in SCHEMA"
        assert type(value) is declared, f"{point.measurement}.{name}: {type(value)}"


def test_gpu_points_follow_schema() -> None:
    """Every gpu field of a full telemetry message is in SCHEMA with its declared type."""
    telemetry = _telemetry((_gpu(0), _gpu(1)))
    built = gpus.gpu_points(telemetry, site="s1", row="r1", rack="k1")
    assert len(built) == 2
    for point in built:
        _assert_matches_schema(point)
        assert set(point.fields) == set(SCHEMA["gpu"].fields)
        assert set(point.tags) == set(SCHEMA["gpu"].tags)
    first = built[0]
    assert first.fields["power_w"] == 400.0  # the interval mean, not the last sample
    assert first.fields["sm_clock_mhz"] == 1980.0
    assert first.fields["clock_event_reasons"] == 4
    assert first.fields["lost"] == 0.0
    assert first.tags["gpu_index"] == "0"
    assert first.tags["class"] == "high"
    assert first.ts_ns == TS_NS


def test_gpu_point_of_lost_gpu_leaves_missing_readings_out() -> None:
    """A lost GPU is flagged and its missing readings are absent, not zero."""
    gpu = GpuTelemetry(index=3, uuid="GPU-3", name="A100", state="lost", priority_class=None)
    (point,) = gpus.gpu_points(_telemetry((gpu,)), site="s", row="r", rack="k")
    assert point.fields == {"lost": 1.0}
    assert "class=" not in point.to_line()


def test_generic_builders_coerce_to_schema_types() -> None:
    """Builders turn measured ints and bools into floats and counters into ints."""
    built = [
        points.node_point(
            ts_ns=1,
            site="s",
            row="r",
            rack="k",
            node="n",
            power_w=900,
            fail_safe=True,
            gpus=8,
            outbox_dropped=2.0,
            tick_p99_ms=None,
        ),
        points.rack_point(ts_ns=1, site="s", row="r", rack="k", power_w=1000, nodes_online=3),
        points.row_point(ts_ns=1, site="s", row="r", power_w=1, level=2, threshold_1_w=80),
        points.control_point(
            ts_ns=1, site="s", row="r", scope="row", level=1, seq=5, observe=False, reason="x"
        ),
        points.aggregator_point(
            ts_ns=1, site="s", instance="a", messages_in=10, dropped={"malformed": 2}
        ),
    ]
    for point in built:
        _assert_matches_schema(point)
    node, rack, row, control, aggregator = built
    assert node.fields == {"power_w": 900.0, "fail_safe": 1.0, "gpus": 8.0, "outbox_dropped": 2}
    assert rack.fields["nodes_online"] == 3.0
    assert row.fields["level"] == 2.0
    assert control.fields["seq"] == 5
    assert control.fields["observe"] == 0.0
    assert aggregator.fields == {"messages_in": 10, "dropped_malformed": 2}


def test_builders_refuse_unknown_names() -> None:
    """A field, tag or measurement outside SCHEMA is a programming error."""
    with pytest.raises(ValueError, match="no field 'power_kw'"):
        points.row_point(ts_ns=1, site="s", row="r", power_kw=1.0)
    with pytest.raises(ValueError, match="no tags"):
        make_point("row", ts_ns=1, tags={"job": "x"}, fields={"power_w": 1.0})
    with pytest.raises(ValueError, match="unknown measurement"):
        make_point("rows", ts_ns=1, tags={}, fields={})
    with pytest.raises(ValueError, match="no field 'dropped_Bad Reason'"):
        points.aggregator_point(ts_ns=1, site="s", instance="a", dropped={"Bad Reason": 1})


def test_control_point_from_control_message() -> None:
    """A rack-scope control becomes scope=rack:<rack> with its lease length in seconds."""
    control = Control(
        ts_ns=5,
        scope="rack",
        row="r1",
        rack="k7",
        issuer="agg",
        epoch_ns=1,
        seq=9,
        level=2,
        level_name="T2",
        issued_ns=1_000_000_000,
        lease_expires_ns=31_000_000_000,
        observe=True,
        reason="power 93% of budget",
    )
    point = points.control_point_from(control, site="s")
    _assert_matches_schema(point)
    assert point.tags == {"site": "s", "row": "r1", "scope": "rack:k7"}
    assert point.fields["lease_s"] == 30.0
    assert point.fields["observe"] == 1.0
    assert point.fields["level_name"] == "T2"
    assert point.ts_ns == 1_000_000_000


def test_event_point_has_text_and_json_detail() -> None:
    """An event carries a readable one-line text and its detail as JSON."""
    event = Event(
        ts_ns=7,
        seq=1,
        node="n01",
        event="cap_changed",
        gpu=3,
        uuid="GPU-3",
        detail={"power_limit_w": 300.0, "reasons": ["T2"]},
    )
    point = points.event_point(event, site="s", row="r", rack="k")
    _assert_matches_schema(point)
    assert point.tags["kind"] == "cap_changed"
    assert point.fields["gpu"] == 3.0
    assert point.fields["text"] == "n01: cap_changed gpu 3: power_limit_w=300.0"
    detail = point.fields["detail"]
    assert isinstance(detail, str)
    assert json.loads(detail) == {"power_limit_w": 300.0, "reasons": ["T2"], "uuid": "GPU-3"}


_LOOP = LoopSpec(
    name="loopA", cdu="cduA", racks=("r1", "r2"), heat_capacity_kw=100.0, design_flow_lpm=150.0
)


def _cdu(supply_c: float) -> CduTelemetry:
    """A reading of loopA with one of its two pumps failed and a 6 C supply-return rise."""
    return CduTelemetry.model_validate(
        {
            "ts_ns": 0,
            "cdu": "cduA",
            "loop": "loopA",
            "secondary": {
                "supply_temp_c": supply_c,
                "return_temp_c": supply_c + 6.0,
                "flow_lpm": 150.0,
            },
            "pumps": [{"name": "pump1", "state": "running"}, {"name": "pump2", "state": "failed"}],
            "leak_detectors": [{"name": "leak1", "state": "ok"}],
        }
    )


def _supervised() -> tuple[LoopAssessment, list[AlarmEvent]]:
    """131 s of loopA: supply 36 C (warning) until 100 s, then 30 C; a pump failed."""
    sup = LoopSupervisor(_LOOP)
    events: list[AlarmEvent] = []
    power_w = {"r1": 40_000.0, "r2": 40_000.0}
    for t in range(131):
        supply_c = 36.0 if t < 100 else 30.0
        a = sup.update(_cdu(supply_c), rack_power_w=power_w, now_s=float(t), top_level=3)
        events.extend(a.events)
    return a, events


def test_cooling_loop_point_has_every_schema_field_as_a_float() -> None:
    """A loop reporting every reading fills each cooling_loop field, typed and in order."""
    loop, _ = _supervised()
    point = points.cooling_loop_point(loop, ts_ns=TS_NS, site="s1")
    _assert_matches_schema(point)
    assert point.measurement == "cooling_loop"
    assert point.tags == {"site": "s1", "loop": "loopA", "cdu": "cduA"}
    assert list(point.fields) == list(SCHEMA["cooling_loop"].fields)
    assert point.fields["heat_balance_error_pct"] == pytest.approx(-2.423125)
    fields = {k: v for k, v in point.fields.items() if k != "heat_balance_error_pct"}
    assert fields == pytest.approx(
        {
            "heat_load_kw": 64.0,
            "heat_removed_kw": 62.4492,
            "rated_capacity_kw": 100.0,
            "capacity_kw": 90.0,  # N of N+1 pumps: 0.9
            "headroom_kw": 26.0,
            "load_pct": 100 * 64 / 90,
            "derate_fraction": 0.9,
            "supply_temp_c": 30.0,
            "return_temp_c": 36.0,
            "delta_t_c": 6.0,
            "flow_lpm": 150.0,
            "flow_fraction": 1.0,
            "pumps_available": 1.0,
            "pumps_failed": 1.0,
            "leaks": 0.0,
            "thermal_budget_w": 112_500.0,
            "forced_level": 2.0,
            "severity": 2.0,  # degraded: the pump
            "alarms": 1.0,  # pump_failure (supply_temp_high cleared at 130 s)
            "emergency": 0.0,
            "stale": 0.0,
            "telemetry_age_s": 0.0,
        }
    )
    assert point.ts_ns == TS_NS


def test_cooling_loop_point_of_a_silent_cdu_leaves_its_readings_out() -> None:
    """A CDU never heard from: flagged stale, 75% of the rating, no readings written."""
    sup = LoopSupervisor(_LOOP)
    for t in range(7):
        loop = sup.update(None, rack_power_w={"r1": 40_000.0}, now_s=float(t), top_level=3)
    line = points.cooling_loop_point(loop, ts_ns=TS_NS, site="s1").to_line("ns")
    assert line == (
        "cooling_loop,cdu=cduA,loop=loopA,site=s1 heat_load_kw=32.0,rated_capacity_kw=100.0,"
        "capacity_kw=75.0,headroom_kw=43.0,load_pct=42.666666666666664,derate_fraction=0.75,"
        "pumps_failed=0.0,leaks=0.0,thermal_budget_w=93750.0,forced_level=0.0,severity=1.0,"
        "alarms=1.0,emergency=0.0,stale=1.0 1700000000123456789"
    )


def test_cooling_alarm_points_are_the_lines_written_before() -> None:
    """Raised and cleared alarms give the same tags, fields, types and order as ever."""
    _, events = _supervised()
    lines = [points.cooling_alarm_point(e, ts_ns=TS_NS, site="s1").to_line("ns") for e in events]
    tags = "cooling_alarm,action={},alarm={},loop=loopA,severity={},site=s1"
    assert lines == [
        tags.format("raised", "supply_temp_high", "warning")
        + ' value=36.0,threshold=35.0,rank=1.0,text="loopA: supply_temp_high raised (warning): '
        'supply 36.0 C (limit 35.0 C)",detail="supply 36.0 C (limit 35.0 C)" 1700000000123456789',
        tags.format("raised", "pump_failure", "degraded")
        + ' value=1.0,threshold=2.0,rank=2.0,text="loopA: pump_failure raised (degraded): '
        'pumps available 1 (limit 2): pump2",detail="pumps available 1 (limit 2): pump2" '
        "1700000000123456789",
        tags.format("cleared", "supply_temp_high", "warning")
        + ' value=30.0,threshold=34.0,rank=1.0,previous_severity="warning",text="loopA: '
        'supply_temp_high cleared (warning): supply 30.0 C (back past 34.0 C)",detail="'
        'supply 30.0 C (back past 34.0 C)" 1700000000123456789',
    ]
    for event in events:
        _assert_matches_schema(points.cooling_alarm_point(event, ts_ns=TS_NS, site="s1"))


_HEADING = re.compile(r"^### `(\w+)`")
_TAGS = re.compile(r"^Tags: (.+)$")
_FIELD_ROW = re.compile(r"^\| `([\w<>]+)` \| (float|int|string) \|")


def _documented_schema() -> dict[str, tuple[tuple[str, ...], dict[str, str]]]:
    """Measurements, tags and field types as docs/influxdb.md documents them."""
    text = (ROOT / "docs" / "influxdb.md").read_text(encoding="utf-8")
    found: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {}
    current: str | None = None
    for line in text.splitlines():
        if heading := _HEADING.match(line):
            current = heading.group(1)
            found[current] = ((), {})
        elif current is not None and (tags := _TAGS.match(line)):
            names = tuple(re.findall(r"`(\w+)`", tags.group(1)))
            found[current] = (names, found[current][1])
        elif current is not None and (row := _FIELD_ROW.match(line)):
            found[current][1][row.group(1)] = row.group(2)
    return found


def test_documentation_matches_schema() -> None:
    """docs/influxdb.md lists exactly SCHEMA's measurements, tags and typed fields."""
    names = {float: "float", int: "int", str: "string"}
    expected = {
        measurement: (
            schema.tags,
            {field: names[kind] for field, kind in schema.fields.items()},
        )
        for measurement, schema in SCHEMA.items()
    }
    assert _documented_schema() == expected


def test_lone_surrogate_in_an_event_becomes_a_replacement_character() -> None:
    """A lone surrogate (no UTF-8 for it) in an event's detail or a tag encodes as U+FFFD."""
    event = Event(ts_ns=7, seq=1, node="n01", event="cap_changed", detail={"e": "x\ud800y"})
    point = points.event_point(event, site="s\udfff", row="r", rack="k")
    body = encode_lines([point])
    line = body.decode("utf-8")  # strict: valid UTF-8
    assert "site=s\ufffd" in line
    assert 'text="n01: cap_changed: e=x\ufffdy"' in line


def test_backslash_that_would_escape_a_delimiter_or_end_a_name_is_replaced() -> None:
    """A backslash at the end of a name or tag value, or before , = or space, becomes U+FFFD."""
    point = Point(
        "m\\",
        {"k\\": "a\\", "b": "x\\,y", "c": "keep\\this", "d": "two\\\\"},
        {"f\\": 1.0, "s": "ends in \\"},
        TS_NS,
    )
    assert point.to_line() == (
        "m\ufffd,b=x\ufffd\\,y,c=keep\\this,d=two\\\ufffd,k\ufffd=a\ufffd "
        'f\ufffd=1.0,s="ends in \\\\" 1700000000123'
    )


def test_empty_and_colliding_keys_are_left_out() -> None:
    """Tags without a key, fields without a key, and a tag key met twice are left out."""
    tags = {"": "v", "a\n": "first", "a\\n": "second"}  # both keys are written a\n
    point = Point("m", tags, {"": 1.0, "x": 2.0}, 0)
    assert point.to_line() == "m,a\\n=first x=2.0 0"


def test_long_string_field_is_cut() -> None:
    """A string field longer than 16,384 characters is cut, ending in an ellipsis."""
    line = Point("m", {}, {"s": "y" * 100_000}, 0).to_line()
    assert line == 'm s="' + "y" * 16_383 + '…" 0'


@pytest.mark.parametrize(
    ("point", "error"),
    [
        (Point("", {}, {"v": 1.0}, 0), "cannot start a line"),
        (Point("#m", {}, {"v": 1.0}, 0), "cannot start a line"),
        (Point("m", {}, {"v": 2**63}, 0), "int64"),
        (Point("m", {}, {"v": -(2**63) - 1}, 0), "int64"),
        (Point("m", {}, {"v": 1.0}, 2**63 + 10**6), "outside"),
        (Point("m", {}, {"v": 1.0}, -(2**63) + 1), "outside"),  # rounded down to the ms
    ],
)
def test_line_refuses_only_what_no_line_can_carry(point: Point, error: str) -> None:
    """An empty or comment measurement, an int beyond int64, a time beyond InfluxDB's range."""
    with pytest.raises(ValueError, match=error):
        point.to_line()


def test_largest_values_still_encode() -> None:
    """The int64 bounds and InfluxDB's time bounds are written, not refused."""
    point = Point("m", {}, {"a": 2**63 - 1, "b": -(2**63)}, 9_223_372_036_854_775_806)
    assert point.to_line("ns") == (
        "m a=9223372036854775807i,b=-9223372036854775808i 9223372036854775806"
    )


_HOSTILE: Final = ["\\", ",", "=", " ", '"', "'", "\n", "\r", "\t", "#", "\x00", "\ud800"]
_TEXT: Final = st.text(
    st.one_of(st.sampled_from(_HOSTILE), st.characters(exclude_categories=())), max_size=30
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.dictionaries(_TEXT, _TEXT, max_size=4),
            st.dictionaries(_TEXT, _TEXT, max_size=3),
            st.integers(-(2**62), 2**62),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_any_text_encodes_to_one_utf8_line_per_point(
    specs: list[tuple[dict[str, str], dict[str, str], int]],
) -> None:
    """Whatever text tags and string fields hold, encode_lines never raises: one line each."""
    built = [
        Point("m", tags, {**fields, "v": 1.0}, ts_ns)  # one field every line has
        for tags, fields, ts_ns in specs
    ]
    body = encode_lines(built)
    lines = body.decode("utf-8").split("\n")
    assert len(lines) == len(built)
    for line, point in zip(lines, built, strict=True):
        assert line.endswith(f" {point.ts_ns // 1_000_000}")
        assert "\r" not in line


def _hostile_points(count: int) -> list[Point]:
    """Points whose tag keys, tag values, field keys and strings are made of hostile text."""
    alphabet = [*_HOSTILE, "\udfff", "é", "🙂", "a", "b"]  # no letters of "time"
    rng = random.Random(20261201)  # noqa: S311 - reproducible test data, not secrets

    def text() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))

    return [
        Point(
            "hostile",
            {text(): text() for _ in range(3)},
            {text(): text(), "v": float(i)},
            TS_NOW_NS + i * 1_000_000,
        )
        for i in range(count)
    ]


TS_NOW_NS = (time.time_ns() // 10**9 - 3600) * 10**9  # VictoriaMetrics keeps the last month


def test_hostile_text_is_parsed_whole_by_influxdb(influxdb1: InfluxDB1Process) -> None:
    """InfluxDB 1.6.7 takes every line of 300 hostile points (204, nothing partial)."""
    influxdb1.write(encode_lines(_hostile_points(300)))
    assert influxdb1.count("hostile", "v") == 300


def test_hostile_text_is_parsed_whole_by_victoria_metrics(
    victoria_metrics: VictoriaMetricsProcess,
) -> None:
    """VictoriaMetrics, which skips bad lines silently, stores all 300 hostile points."""
    victoria_metrics.write(encode_lines(_hostile_points(300)))
    assert victoria_metrics.count('{__name__="hostile_v"}') == 300


def test_surrogate_reads_back_from_influxdb_as_replacement_character(
    influxdb1: InfluxDB1Process,
) -> None:
    """What UTF-8 cannot carry arrives as U+FFFD, in a tag and in a string field."""
    influxdb1.write(
        Point("e", {"node": "n\ud800"}, {"text": "a\udfffb"}, TS_NOW_NS).to_line().encode()
    )
    (series,) = influxdb1.query('SELECT "node", "text" FROM "e"')
    assert series["values"][0][1:] == ["n\ufffd", "a\ufffdb"]


# -- line templates (the per-GPU hot path) -------------------------------------------------

_TEMPLATE = LineTemplate(
    "gpu", tag_keys=("site", "node", "gpu_uuid", "class"), fields=("power_w", "temp_c", "lost")
)
_INT_TEMPLATE = LineTemplate("node", tag_keys=("node",), fields=("level", "outbox_dropped"))


def _parsed(line: str) -> tuple[str, dict[str, float | int], str]:
    """A numeric line as (head, field -> value, timestamp), so that 1980 equals 1980.0."""
    head, fields, ts = line.rsplit(" ", 2)
    values: dict[str, float | int] = {}
    for item in fields.split(","):
        key, text = item.split("=")
        values[key] = int(text[:-1]) if text.endswith("i") else float(text)
    return head, values, ts


def _as_point(
    template: LineTemplate, tags: tuple[str, ...], values: tuple[float | int | None, ...]
) -> Point:
    return Point(
        template.measurement,
        dict(zip(template.tag_keys, tags, strict=True)),
        {
            name: kind(value)  # type: ignore[misc]
            for name, kind, value in zip(
                template.field_names,
                (SCHEMA[template.measurement].field_type(n) for n in template.field_names),
                values,
                strict=True,
            )
            if value is not None
        },
        TS_NS,
    )


_NUMBER = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**6), max_value=10**6),
    st.integers(min_value=2**63, max_value=2**70),  # beyond int64 and orjson's 64 bits
    st.booleans(),  # not what a caller may pass, but it must not make a bad line
)
_TAG_TEXT = st.text(max_size=12)


@settings(max_examples=400, deadline=None)
@given(
    tags=st.tuples(_TAG_TEXT, _TAG_TEXT, _TAG_TEXT, _TAG_TEXT),
    values=st.tuples(_NUMBER, _NUMBER, _NUMBER),
    ints=st.tuples(_NUMBER, st.one_of(st.none(), st.integers(min_value=-(2**65), max_value=2**65))),
)
def test_template_writes_what_the_point_writes(
    tags: tuple[str, str, str, str],
    values: tuple[float | int | None, ...],
    ints: tuple[float | int | None, int | None],
) -> None:
    """Differential: a templated point encodes as the equivalent Point (values, errors)."""
    for template, tag_values, field_values in (
        (_TEMPLATE, tags, values),
        (_INT_TEMPLATE, tags[:1], ints),
    ):
        templated = template.point(tag_values, field_values, TS_NS)
        plain = _as_point(template, tag_values, field_values)
        try:
            expected = plain.to_line()
        except ValueError as exc:
            with pytest.raises(ValueError, match=str(exc).split(" ")[0]):
                templated.to_line()
            continue
        line = templated.to_line()
        if not expected:
            assert line == ""
            continue
        assert _parsed(line) == _parsed(expected)
        assert templated.tags == plain.tags
        assert repr(templated.fields) == repr(plain.fields)  # NaN included


_EXTREMES: Final = (
    5e-324,
    -2.2250738585072014e-308,
    1e-07,
    0.1,
    1 / 3,
    -0.0,
    123456789.12345679,
    1e16,
    1.7976931348623157e308,
    -1.7976931348623157e308,
    2**53 + 1,  # an int in a float field
    1980,
)


def _extreme_points() -> list[bytes]:
    template = LineTemplate("gpu", tag_keys=("gpu_index",), fields=("power_w", "lost"))
    return [
        template.point((str(i),), (value, float(i)), TS_NOW_NS).encode()
        for i, value in enumerate(_EXTREMES)
    ]


def test_template_values_read_back_exactly_from_influxdb(influxdb1: InfluxDB1Process) -> None:
    """orjson's digits (``1e-7``, ``1e+16``, subnormals, ``-0.0``) are parsed by InfluxDB
    to the very float written, and an int in a float field stays a float field."""
    influxdb1.write(b"\n".join(_extreme_points()))
    (series,) = influxdb1.query('SELECT "power_w", "gpu_index" FROM "gpu"')
    stored = {int(index): value for _, value, index in series["values"]}
    assert stored == {i: float(v) for i, v in enumerate(_EXTREMES)}
    keys = influxdb1.query('SHOW FIELD KEYS FROM "gpu"')[0]["values"]
    assert dict(keys) == {"lost": "float", "power_w": "float"}


def test_template_values_are_parsed_by_victoria_metrics(
    victoria_metrics: VictoriaMetricsProcess,
) -> None:
    """VictoriaMetrics parses every one of those lines (it skips bad ones silently)."""
    victoria_metrics.write(b"\n".join(_extreme_points()))
    exported = victoria_metrics.export('{__name__="gpu_power_w"}')
    stored = {int(s["metric"]["gpu_index"]): s["values"][0] for s in exported}
    assert set(stored) == set(range(len(_EXTREMES)))
    for i, value in enumerate(_EXTREMES):  # VictoriaMetrics keeps 15 or so digits
        assert math.isclose(stored[i], float(value), rel_tol=1e-12, abs_tol=1e-300), i


def test_template_caches_one_head_per_series_and_stays_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Heads are escaped once per series; the cache empties when full instead of growing."""
    import polca.export.points as module

    monkeypatch.setattr(module, "_CACHE_MAX", 4)
    template = LineTemplate("gpu", tag_keys=("node",), fields=("power_w",))
    for i in range(10):
        line = template.point((f"n {i}",), (1.5,), TS_NS).to_line()
        assert line.startswith(f"gpu,node=n\\ {i} power_w=1.5 ")
        assert len(template._heads) <= 4
    assert template.point(("n 9",), (2.5,), TS_NS).to_line().startswith("gpu,node=n\\ 9 ")


def test_template_refuses_unknown_names_and_text_fields() -> None:
    """Templates are checked against SCHEMA when made, like make_point's names."""
    with pytest.raises(ValueError, match="unknown measurement"):
        LineTemplate("gpus", tag_keys=(), fields=("power_w",))
    with pytest.raises(ValueError, match="tags"):
        LineTemplate("gpu", tag_keys=("job",), fields=("power_w",))
    with pytest.raises(ValueError, match="not a numeric field"):
        LineTemplate("event", tag_keys=(), fields=("text",))
    with pytest.raises(ValueError, match="not a numeric field"):
        LineTemplate("gpu", tag_keys=(), fields=("watts",))


def test_gpu_points_encode_as_points_built_field_by_field() -> None:
    """The templated gpu points write the same lines as the general Point would."""
    for gpu in (_gpu(0), _gpu(1, locked_sm_clock_max_mhz=None, power_avg_w=None)):
        (templated,) = gpus.gpu_points(_telemetry((gpu,)), site="s1", row="r1", rack="k 1")
        plain = Point("gpu", templated.tags, templated.fields, templated.ts_ns)
        assert _parsed(templated.to_line()) == _parsed(plain.to_line())


def test_every_measurement_is_essential_or_bulk() -> None:
    """The sink's two classes split SCHEMA: a new measurement must be put in one of them."""
    assert not ESSENTIAL_MEASUREMENTS & BULK_MEASUREMENTS
    assert set(SCHEMA) == ESSENTIAL_MEASUREMENTS | BULK_MEASUREMENTS
    # What the nodes' messages multiply is bulk; what the aggregator decided is essential.
    assert {"gpu", "gpu_cap", "gpu_health", "gpu_workload", "agent", "event"} == BULK_MEASUREMENTS
    assert {"row", "rack", "node", "control", "cooling_alarm"} <= ESSENTIAL_MEASUREMENTS


_NO_COOLING = CoolingStep(
    loops={}, events=(), rack_thermal_budget_w={}, forced_levels={}, emergency_racks=()
)


def _row_point_of(row: RowResult) -> AnyPoint:
    written = points.step_points(
        StepResult(now_ns=TS_NS, cooling=_NO_COOLING, rows=(row,)), site="dc1", instance="a"
    )
    (point,) = [p for p in written if p.measurement == "row"]
    return point


def test_the_row_point_says_which_budget_the_row_runs_on(tmp_path: Path) -> None:
    """The row's electrical budget and its origin: its fallback until a lease comes (and
    ``on_fallback``), the lease limited by the site's domain, its own feeds once one is
    down; the configured and effective budgets as before."""
    core = budget_rig._core(tmp_path)
    fallback = _row_point_of(budget_rig._step(core, 1.0))
    assert fallback.fields["budget_origin"] == "fallback"
    assert fallback.fields["on_fallback"] == 1.0
    assert fallback.fields["electrical_budget_w"] == 6_000.0
    assert fallback.fields["effective_budget_w"] == 6_000.0
    assert fallback.fields["budget_w"] == 10_000.0
    assert "leased_budget_w" not in fallback.fields
    assert "budget_limited_by" not in fallback.fields
    budget_rig._send(core, "budget", budget_rig._budget(8_000.0), now_s=1.5)
    leased = _row_point_of(budget_rig._step(core, 2.0))
    assert (leased.fields["budget_origin"], leased.fields["on_fallback"]) == ("lease", 0.0)
    assert leased.fields["leased_budget_w"] == leased.fields["electrical_budget_w"] == 8_000.0
    assert leased.fields["budget_limited_by"] == "ups-a"
    down = budget_rig._meter(states={"pdu-a": "up", "pdu-b": "down"})
    budget_rig._send(core, "meter", down, now_s=2.5)
    feeds = _row_point_of(budget_rig._step(core, 3.0))
    assert (feeds.fields["budget_origin"], feeds.fields["on_fallback"]) == ("feeds", 0.0)
    assert feeds.fields["electrical_budget_w"] == 6_000.0
    assert feeds.fields["leased_budget_w"] == 8_000.0
    assert feeds.fields["budget_limited_by"] == "feed B"
    for point in (fallback, leased, feeds):
        for name, value in point.fields.items():
            assert type(value) is SCHEMA["row"].field_type(name), name
    line = feeds.to_line()
    assert 'budget_origin="feeds"' in line
    assert 'budget_limited_by="feed B"' in line


def test_a_row_without_site_budgets_runs_on_its_configuration(tmp_path: Path) -> None:
    core = budget_rig._core(tmp_path, fallback_budget_w=None, feeds=[])
    point = _row_point_of(budget_rig._step(core, 1.0))
    assert (point.fields["budget_origin"], point.fields["on_fallback"]) == ("config", 0.0)
    assert point.fields["electrical_budget_w"] == 10_000.0
