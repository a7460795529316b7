"""Wire schema: strict decoding of every payload kind, and stable topics."""

from __future__ import annotations

import json

import pytest

from polca.telemetry.schema import (
    MAX_PAYLOAD_BYTES,
    Control,
    SchemaError,
    Status,
    Telemetry,
    decode,
    encode,
    json_schemas,
)
from polca.telemetry.topics import NodeAddress, Topics


def test_round_trip_by_kind() -> None:
    """decode(encode(m)) gives back the same model, found by its kind."""
    status = Status(ts_ns=1, state="online", node="n1", gpu_count=8)
    assert decode(encode(status)) == status


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"schema_version": 2, "kind": "status"}', "schema_version 2"),
        (b'{"schema_version": 1, "kind": "nope", "ts_ns": 1}', "schema error"),
        (
            json.dumps(
                {
                    "schema_version": 1,
                    "kind": "status",
                    "ts_ns": 1,
                    "state": "online",
                    "node": "n",
                    "extra": 1,
                }
            ).encode(),
            "extra",
        ),
        (
            json.dumps(
                {
                    "schema_version": 1,
                    "kind": "status",
                    "ts_ns": 1,
                    "state": "online",
                    "node": "bad/node",
                }
            ).encode(),
            "node",
        ),
        (b" " * (MAX_PAYLOAD_BYTES + 1), "exceeds"),
    ],
)
def test_bad_payloads_raise_schema_error(payload: bytes, fragment: str) -> None:
    """Malformed, unknown-version, wrong-shape and oversized payloads are one error type."""
    with pytest.raises(SchemaError, match=fragment):
        decode(payload)


def test_expected_kind_is_enforced() -> None:
    """Asking for a Control refuses a valid Status."""
    status = encode(Status(ts_ns=1, state="offline", node="n1"))
    with pytest.raises(SchemaError):
        decode(status, Control)


def test_json_schemas_cover_every_kind() -> None:
    """docs/mqtt.md can embed a schema for each payload kind."""
    schemas = json_schemas()
    assert set(schemas) == {
        "Telemetry",
        "Status",
        "State",
        "Event",
        "Control",
        "Assignment",
        "Meter",
        "Budget",
        "BudgetLimit",
        "SiteReport",
        "PolicyBundle",
        "RowSummary",
        "CduTelemetry",
        "CoolingLoopState",
        "CoolingAlarm",
    }
    assert "gpus" in schemas["Telemetry"]["properties"]
    assert Telemetry.model_fields["node_gpu_power_w"].description


def test_topics_build_and_parse() -> None:
    """Node topics parse back into their address and channel; others do not parse."""
    topics = Topics("polca/v1")
    addr = NodeAddress("dc1", "row4", "r12", "node-a17")
    topic = topics.node(addr, "telemetry")
    assert topic == "polca/v1/dc1/row4/r12/node-a17/telemetry"
    assert topics.parse_node(topic) == (addr, "telemetry")
    assert topics.parse_node("polca/v1/dc1/row4/control") is None
    assert topics.parse_node("polca/v2/dc1/row4/r12/n/telemetry") is None
    assert topics.row_control("dc1", "row4") == "polca/v1/dc1/row4/control"
    assert topics.rack_control("dc1", "row4", "r12") == "polca/v1/dc1/row4/r12/control"
    with pytest.raises(ValueError, match="topic segment"):
        NodeAddress("dc1", "row 4", "r", "n")
