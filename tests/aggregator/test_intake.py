"""Intake: messages routed to their row; bad ones dropped, counted, logged once per source."""

from __future__ import annotations

import json

from structlog.testing import capture_logs

from polca.aggregator.config import NodeSpec, RackSpec, RowSpec
from polca.aggregator.intake import Accepted, Intake, RetainedControl, TelemetryIn
from polca.aggregator.rollup import Ingested, RowTracker
from polca.telemetry.messages import InMessage
from polca.telemetry.schema import Control, Event, Meter, State, Status, Telemetry, encode
from polca.telemetry.topics import Topics

BASE = "polca/v1/dc1/row1"


class _Seeds(list[Control]):
    """The retained controls of ours an intake accepted (what the runtime seeds from)."""

    def take(self, accepted: Accepted | None) -> Accepted | None:
        if isinstance(accepted, RetainedControl):
            self.append(accepted.control)
        return accepted


def _row() -> RowSpec:
    return RowSpec(
        name="row1", budget_w=10_000, racks=(RackSpec(name="r1", nodes=(NodeSpec(name="n1"),)),)
    )


def _intake(tracker: RowTracker | None = None) -> tuple[Intake, RowTracker, _Seeds]:
    tracker = tracker or RowTracker(_row())
    intake = Intake(site="dc1", topics=Topics(), trackers={"row1": tracker}, issuer="agg")
    return intake, tracker, _Seeds()


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


def test_bad_messages_are_dropped_by_reason_and_logged_at_a_bounded_rate() -> None:
    """Each kind of bad input has its own reason; repeats of a reason log once a minute."""
    intake, tracker, _ = _intake()
    with capture_logs() as logs:
        for _ in range(3):
            intake.handle(_msg(f"{BASE}/r1/n1/telemetry", b"{broken"), 1)
        intake.handle(_msg(f"{BASE}/r1/n1/telemetry", b'{"schema_version": 2}'), 1)
        intake.handle(_msg(f"{BASE}/r1/n1/telemetry", b"x" * 300_000), 1)
        intake.handle(_msg(f"{BASE}/r9/n1/telemetry", _telemetry("n1")), 1)  # wrong rack
        intake.handle(_msg(f"{BASE}/r1/n1/telemetry", _telemetry("n2")), 1)  # spoofed node
        intake.handle(_msg("polca/v1/dc2/row1/r1/n1/telemetry", _telemetry("n1")), 1)
    assert intake.dropped == {
        "malformed": 3,
        "schema_version": 1,
        "oversized": 1,
        "topology": 2,
        "identity": 1,
    }
    assert tracker.nodes["n1"].telemetry is None
    dropped_logs = [e for e in logs if e["event"] == "message_dropped"]
    assert len(dropped_logs) == 5  # one line per reason; the repeats are counted
    assert {e["reason"] for e in dropped_logs} == set(intake.dropped)


def test_invented_topics_grow_no_memory_and_no_log() -> None:
    """200,000 topics invented under one row add no state and a single log line."""
    intake, _, _ = _intake()
    with capture_logs() as logs:
        for i in range(200_000):
            intake.handle(_msg(f"{BASE}/r1/n1/x{i}", b"{}"), 1)
            intake.handle(_msg(f"{BASE}/r1/ghost{i}/telemetry", b"{}"), 1)
    assert intake.dropped == {"topology": 400_000}
    assert len([e for e in logs if e["event"] == "message_dropped"]) == 1
    assert len(intake.drops._logged_at) == 1  # one entry per reason, whatever the topics


def test_payload_identity_must_match_the_topic_on_every_channel() -> None:
    """Status, events and state naming another node are dropped, never applied."""
    intake, tracker, _ = _intake()
    other = "n2"
    status = encode(Status(ts_ns=1, state="offline", node=other))
    event = encode(Event(ts_ns=1, seq=1, node=other, event="cap_changed"))
    state = encode(State(ts_ns=1, seq=1, node=other, level=0, fail_safe=False, gpus=()))
    accepted = [
        intake.handle(_msg(f"{BASE}/r1/n1/{channel}", payload), 1)
        for channel, payload in (("status", status), ("events", event), ("state", state))
    ]
    assert intake.dropped == {"identity": 3}
    assert tracker.nodes["n1"].status is None
    assert accepted == [None, None, None]


def test_control_naming_another_row_or_rack_than_its_topic_is_dropped() -> None:
    """A retained control whose row or rack differs from its topic never seeds a ladder."""
    intake, _, seeded = _intake()
    own = Control(
        ts_ns=1,
        scope="row",
        row="row2",
        issuer="agg",
        epoch_ns=1,
        seq=9,
        level=2,
        issued_ns=1,
        lease_expires_ns=2,
    )
    seeded.take(intake.handle(_msg(f"{BASE}/control", encode(own), retain=True), 1))
    rack = own.model_copy(update={"row": "row1", "scope": "rack", "rack": "r9"})
    seeded.take(intake.handle(_msg(f"{BASE}/r1/control", encode(rack), retain=True), 1))
    assert seeded == []
    assert intake.dropped == {"identity": 2}


def test_retained_readings_are_of_unknown_age_and_dropped() -> None:
    """Telemetry and meter readings delivered retained are dropped as stale."""
    intake, tracker, _ = _intake()
    intake.handle(_msg(f"{BASE}/r1/n1/telemetry", _telemetry("n1"), retain=True), 1)
    meter = encode(Meter(ts_ns=1, power_w=0.0))
    intake.handle(_msg(f"{BASE}/meter", meter, retain=True), 1)
    assert intake.dropped == {"stale": 2}
    assert tracker.nodes["n1"].telemetry is None
    assert tracker.meter_w is None


def test_skewed_stamps_are_kept_counted_and_restamped_on_receipt() -> None:
    """Telemetry stamped an hour ahead is applied, counted, and carries its receipt time."""
    intake, tracker, _ = _intake()
    received_ns = 1_700_000_000 * 10**9
    ahead = Telemetry.model_validate(
        {**json.loads(_telemetry("n1")), "ts_ns": received_ns + 3600 * 10**9}
    )
    accepted = intake.handle(
        InMessage(f"{BASE}/r1/n1/telemetry", encode(ahead), False, received_ns), now_s=1
    )
    assert tracker.nodes["n1"].telemetry is not None
    assert isinstance(accepted, TelemetryIn)
    assert accepted.telemetry.ts_ns == received_ns
    assert intake.skewed.counts == {"telemetry": 1}
    assert not intake.dropped


def test_a_failing_handler_is_counted_and_the_intake_carries_on() -> None:
    """An unexpected error handling one message is counted as internal; the next one is applied."""
    calls: list[str] = []

    class Exploding(RowTracker):
        def ingest_telemetry(self, node: str, telemetry: Telemetry, now_s: float) -> Ingested:
            calls.append(node)
            if len(calls) == 1:
                msg = "boom"
                raise RuntimeError(msg)
            return super().ingest_telemetry(node, telemetry, now_s)

    intake, tracker, _ = _intake(Exploding(_row()))
    with capture_logs() as logs:
        intake.handle(_msg(f"{BASE}/r1/n1/telemetry", _telemetry("n1")), 1)
        intake.handle(_msg(f"{BASE}/r1/n1/telemetry", _telemetry("n1")), 2)
    assert intake.dropped == {"internal": 1}
    assert calls == ["n1", "n1"]
    assert tracker.nodes["n1"].received_s == 2
    assert any(e.get("reason") == "internal" and e.get("exc_info") for e in logs)


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
    seeded.take(intake.handle(_msg(f"{BASE}/control", encode(own), retain=True), 1))
    seeded.take(intake.handle(_msg(f"{BASE}/control", encode(own), retain=False), 1))  # echo
    seeded.take(intake.handle(_msg(f"{BASE}/control", encode(other), retain=True), 1))
    assert seeded == [own]
    assert intake.dropped == {"foreign_control": 1}
    assert json.loads(encode(own))["issuer"] == "agg"


def test_subscriptions_cover_owned_rows_only() -> None:
    """The aggregator never subscribes to '#', only to its rows' topics and meters: control
    and meters on one connection, each node's topics on exactly one of the others."""
    row = RowSpec(
        name="row1",
        budget_w=10_000,
        racks=(RackSpec(name="r1", nodes=tuple(NodeSpec(name=f"n{i}") for i in range(40))),),
    )
    intake, _, _ = _intake(RowTracker(row))
    filters = [f for f, _ in intake.subscriptions()]
    assert all(f.startswith(f"{BASE}/") for f in filters)
    assert f"{BASE}/control" in filters
    assert not any(f.endswith(("/telemetry", "/meter")) for f in filters)
    assert intake.source_subscriptions() == [(f"{BASE}/meter", 0)]
    shards = list(intake.node_subscriptions(4).values())
    assert shards.pop() == []  # nobody quarantined
    assert all(shards)  # 40 nodes spread over every connection
    topics = [f for shard in shards for f, _ in shard]
    assert len(topics) == len(set(topics)) == 40 * 3
    for i in range(40):
        holders = [k for k, shard in enumerate(shards) if (f"{BASE}/r1/n{i}/telemetry", 0) in shard]
        assert len(holders) == 1
        assert (f"{BASE}/r1/n{i}/status", 0) in shards[holders[0]]
        assert (f"{BASE}/r1/n{i}/events", 0) in shards[holders[0]]


def test_a_bound_resting_on_the_nodes_word_is_said_once() -> None:
    """A node whose GPUs are not in the table of published limits: one warning naming it and
    what to configure, not one per message; a known product says nothing."""
    from polca.telemetry.schema import GpuTelemetry

    def telemetry(node: str, name: str, seq: int) -> bytes:
        gpu = GpuTelemetry(index=0, uuid=f"GPU-{node}", name=name, power_limit_max_w=9_000.0)
        return encode(
            Telemetry(
                ts_ns=1,
                seq=seq,
                node=node,
                interval_s=1,
                node_gpu_power_w=100,
                node_energy_delta_j=1,
                gpus=(gpu,),
            )
        )

    row = RowSpec(
        name="row1",
        budget_w=10_000,
        racks=(RackSpec(name="r1", nodes=(NodeSpec(name="n1"), NodeSpec(name="n2"))),),
    )
    intake, tracker, _ = _intake(RowTracker(row))
    with capture_logs() as logs:
        for seq in (1, 2, 3):
            intake.handle(_msg(f"{BASE}/r1/n1/telemetry", telemetry("n1", "Future GPU", seq)), 0.0)
            intake.handle(_msg(f"{BASE}/r1/n2/telemetry", telemetry("n2", "NVIDIA H200", seq)), 0.0)
    said = [e for e in logs if e["event"] == "node_bound_declared"]
    assert [(e["node"], e["source"]) for e in said] == [("n1", "declared")]
    assert "gpu_max_power_w" in said[0]["detail"]
    assert tracker.nodes["n2"].gpu_bound_w == 700.0 * 1.25
