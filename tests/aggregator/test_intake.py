"""Intake: messages routed to their row; bad ones dropped, counted, logged once per source."""

from __future__ import annotations

import json

from structlog.testing import capture_logs

from polca.aggregator.config import NodeSpec, RackSpec, RowSpec
from polca.aggregator.intake import Intake
from polca.aggregator.rollup import RowTracker
from polca.telemetry.bus import InMessage
from polca.telemetry.schema import Control, Status, Telemetry, encode
from polca.telemetry.topics import Topics

BASE = "polca/v1/dc1/row1"


def _intake() -> tuple[Intake, RowTracker, list[Control]]:
    row = RowSpec(
        name="row1", budget_w=10_000, racks=(RackSpec(name="r1", nodes=(NodeSpec(name="n1"),)),)
    )
    tracker = RowTracker(row)
    seeded: list[Control] = []
    intake = Intake(
        site="dc1",
        topics=Topics(),
        trackers={"row1": tracker},
        issuer="agg",
        on_retained_control=seeded.append,
    )
    return intake, tracker, seeded


def _msg(topic: str, payload: bytes, *, retain: bool = False) -> InMessage:
    return InMessage(topic, payload, retain, 0)


def _telemetry(node: str) -> bytes:
    return encode(
        Telemetry(
            ts_ns=1,
            seq=1,
            node=node,
            interval_s=1,
            node_gpu_power_w=100,
            node_energy_delta_j=1,
            gpus=(),
        )
    )


def test_valid_messages_reach_their_node() -> None:
    """Telemetry and status of a known node update its view."""
    intake, tracker, _ = _intake()
    intake.handle(_msg(f"{BASE}/r1/n1/telemetry", _telemetry("n1")), now_s=1)
    intake.handle(
        _msg(f"{BASE}/r1/n1/status", encode(Status(ts_ns=1, state="offline", node="n1"))), 2
    )
    view = tracker.nodes["n1"]
    assert view.telemetry is not None
    assert view.status == "offline"
    assert not intake.dropped


def test_bad_messages_are_dropped_by_reason_and_logged_once_per_source() -> None:
    """Each kind of bad input has its own reason; repeats from one source log once."""
    intake, tracker, _ = _intake()
    with capture_logs() as logs:
        for _ in range(3):
            intake.handle(_msg(f"{BASE}/r1/n1/telemetry", b"{broken"), 1)
        intake.handle(_msg(f"{BASE}/r1/n1/telemetry", b'{"schema_version": 2}'), 1)
        intake.handle(_msg(f"{BASE}/r1/n1/telemetry", b"x" * 300_000), 1)
        intake.handle(_msg(f"{BASE}/r9/n1/telemetry", _telemetry("n1")), 1)  # wrong rack
        intake.handle(_msg(f"{BASE}/r1/n1/telemetry", _telemetry("n2")), 1)  # spoofed node
        intake.handle(_msg("polca/v1/dc2/row1/r1/n1/telemetry", _telemetry("n1")), 1)
    assert intake.dropped == {"malformed": 3, "schema_version": 1, "oversized": 1, "topology": 3}
    assert tracker.nodes["n1"].telemetry is None
    dropped_logs = [e for e in logs if e["event"] == "message_dropped"]
    assert len(dropped_logs) == 6  # the three malformed repeats logged once


def test_retained_own_control_seeds_and_foreign_control_is_dropped() -> None:
    """Our retained control seeds the ladder; another issuer's control is a conflict."""
    intake, _, seeded = _intake()
    own = Control(
        ts_ns=1,
        scope="row",
        row="row1",
        issuer="agg",
        epoch_ns=1,
        seq=9,
        level=2,
        issued_ns=1,
        lease_expires_ns=2,
    )
    other = own.model_copy(update={"issuer": "rogue"})
    intake.handle(_msg(f"{BASE}/control", encode(own), retain=True), 1)
    intake.handle(_msg(f"{BASE}/control", encode(own), retain=False), 1)  # live echo: ignored
    intake.handle(_msg(f"{BASE}/control", encode(other), retain=True), 1)
    assert seeded == [own]
    assert intake.dropped == {"foreign_control": 1}
    assert json.loads(encode(own))["issuer"] == "agg"


def test_subscriptions_cover_owned_rows_only() -> None:
    """The aggregator never subscribes to '#', only to its rows' topics and meters."""
    intake, _, _ = _intake()
    filters = [f for f, _ in intake.subscriptions()]
    assert all(f.startswith(f"{BASE}/") for f in filters)
    assert f"{BASE}/+/+/telemetry" in filters
    assert f"{BASE}/meter" in filters
