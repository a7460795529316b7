"""Line protocol and the InfluxDB schema: escaping, types, builders, and the documentation."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from polca.aggregator import points
from polca.aggregator.points import SCHEMA, Point, encode_lines, make_point
from polca.telemetry.schema import Control, Event, GpuTelemetry, Telemetry
from tests.tsdb import InfluxDB1Process

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


def _assert_matches_schema(point: Point) -> None:
    schema = SCHEMA[point.measurement]
    assert set(point.tags) <= set(schema.tags)
    for name, value in point.fields.items():
        declared = schema.field_type(name)
        assert declared is not None, f"{point.measurement}.{name} is not in SCHEMA"
        assert type(value) is declared, f"{point.measurement}.{name}: {type(value)}"


def test_gpu_points_follow_schema() -> None:
    """Every gpu field of a full telemetry message is in SCHEMA with its declared type."""
    telemetry = _telemetry((_gpu(0), _gpu(1)))
    built = points.gpu_points(telemetry, site="s1", row="r1", rack="k1")
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
    (point,) = points.gpu_points(_telemetry((gpu,)), site="s", row="r", rack="k")
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
