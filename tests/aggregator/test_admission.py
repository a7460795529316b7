"""Fair intake: per-node admission before decoding, and warnings bounded per node."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from polca.aggregator.config import IntakeSettings, NodeSpec, RackSpec, RowSpec
from polca.aggregator.intake import Intake, TelemetryIn
from polca.aggregator.rollup import RowTracker
from polca.telemetry.checks import RateGate, TokenBucket
from polca.telemetry.messages import InMessage
from polca.telemetry.schema import Event, GpuTelemetry, Meter, Status, Telemetry, encode
from polca.telemetry.topics import Topics

BASE = "polca/v1/dc1/row1"


def _intake(**limits: float) -> tuple[Intake, RowTracker]:
    row = RowSpec(
        name="row1",
        budget_w=10_000,
        racks=(RackSpec(name="r1", nodes=(NodeSpec(name="n1"), NodeSpec(name="n2"))),),
    )
    tracker = RowTracker(row)
    intake = Intake(
        site="dc1",
        topics=Topics(),
        trackers={"row1": tracker},
        issuer="agg",
        limits=IntakeSettings(**limits),
    )
    return intake, tracker


def _telemetry(node: str, *, gpus: int = 1, seq: int = 1) -> bytes:
    return encode(
        Telemetry(
            ts_ns=1,
            seq=seq,
            node=node,
            interval_s=1,
            node_gpu_power_w=100.0 * gpus,
            node_energy_delta_j=1,
            gpus=tuple(
                GpuTelemetry(index=i, uuid=f"GPU-{node}-{i}", name="H100", power_mean_w=100.0)
                for i in range(gpus)
            ),
        )
    )


def _msg(topic: str, payload: bytes) -> InMessage:
    return InMessage(topic, payload, False, 0)


def test_token_bucket_admits_the_burst_then_the_rate() -> None:
    """Full at first; then the rate; a refused take costs nothing; time never runs back."""
    bucket = TokenBucket(rate_per_s=2.0, burst=3)
    assert [bucket.take(1, 0.0) for _ in range(5)] == [True, True, True, False, False]
    assert bucket.take(1, 0.5)  # one token back after half a second at 2/s
    assert not bucket.take(1, 0.5)
    assert not bucket.take(1, 0.1)  # a clock going back refills nothing
    assert bucket.take(1, 1.0)
    assert not bucket.take(10, 100.0)  # more than the burst: never
    assert bucket.take(3, 100.0)


def test_rate_gate_passes_one_per_interval_with_the_count() -> None:
    """The first passes; repeats within the interval are held and counted into the next."""
    gate = RateGate(10.0)
    assert gate.admit("a", 0.0) == 1
    assert [gate.admit("a", t) for t in (1.0, 2.0, 3.0)] == [None, None, None]
    assert gate.admit("b", 3.0) == 1  # keys are independent
    assert gate.admit("a", 10.0) == 4


def test_a_flooding_node_is_cut_to_its_rate_and_the_others_are_untouched() -> None:
    """10,000 telemetry messages in one second from n1: its burst and rate go in, the
    rest is dropped as rate_limited before decoding; n2's one message is applied."""
    intake, tracker = _intake(telemetry_per_s=4, telemetry_burst=8)
    applied = 0
    payload = _telemetry("n1")
    for i in range(10_000):
        accepted = intake.handle(_msg(f"{BASE}/r1/n1/telemetry", payload), 1.0 + i / 10_000)
        applied += isinstance(accepted, TelemetryIn)
    assert 8 <= applied <= 8 + 4
    assert intake.dropped["rate_limited"] == 10_000 - applied
    assert tracker.nodes["n1"].rate_limited == 10_000 - applied
    honest = intake.handle(_msg(f"{BASE}/r1/n2/telemetry", _telemetry("n2")), 2.0)
    assert isinstance(honest, TelemetryIn)
    assert tracker.nodes["n2"].rate_limited == 0
    # The flood stops: the node's rate comes back.
    later = intake.handle(_msg(f"{BASE}/r1/n1/telemetry", payload), 10.0)
    assert isinstance(later, TelemetryIn)


def test_refused_messages_are_not_decoded() -> None:
    """Over its rate, even an undecodable payload is counted as rate_limited, not malformed."""
    intake, _ = _intake(telemetry_per_s=1, telemetry_burst=1)
    intake.handle(_msg(f"{BASE}/r1/n1/telemetry", _telemetry("n1")), 1.0)
    intake.handle(_msg(f"{BASE}/r1/n1/telemetry", b"{not json"), 1.0)
    assert intake.dropped == {"rate_limited": 1}


def test_bytes_are_admitted_per_node_across_channels() -> None:
    """Large messages exhaust a node's byte allowance; small ones of another node pass."""
    intake, _ = _intake(bytes_per_s=256 * 1024, bytes_burst=256 * 1024, telemetry_per_s=1000)
    big = _telemetry("n1", gpus=200)  # about 125 KB
    assert len(big) > 100_000
    admitted = sum(
        isinstance(intake.handle(_msg(f"{BASE}/r1/n1/telemetry", big), 1.0), TelemetryIn)
        for _ in range(10)
    )
    assert admitted == 256 * 1024 // len(big)
    detail = {f"k{i}": "a" * 4_000 for i in range(16)}  # 64 KB: more than is left
    event = encode(Event(ts_ns=1, seq=1, node="n1", event="cap_changed", detail=detail))
    assert 256 * 1024 - admitted * len(big) < len(event)
    assert intake.handle(_msg(f"{BASE}/r1/n1/events", event), 1.0) is None
    assert intake.dropped["rate_limited"] == 10 - admitted + 1
    assert isinstance(
        intake.handle(_msg(f"{BASE}/r1/n2/telemetry", _telemetry("n2")), 1.0), TelemetryIn
    )


def test_events_do_not_silence_a_nodes_telemetry() -> None:
    """A flood of events spends the node's message bucket, not its telemetry bucket."""
    intake, _ = _intake(messages_per_s=10, messages_burst=20)
    event = encode(Event(ts_ns=1, seq=1, node="n1", event="cap_changed"))
    for _ in range(1_000):
        intake.handle(_msg(f"{BASE}/r1/n1/events", event), 1.0)
    assert intake.dropped["rate_limited"] == 1_000 - 20
    assert isinstance(
        intake.handle(_msg(f"{BASE}/r1/n1/telemetry", _telemetry("n1")), 1.0), TelemetryIn
    )


def test_meter_topics_have_their_own_admission() -> None:
    """A meter flood is cut to its rate; readings within it still wake the step."""
    intake, tracker = _intake(source_per_s=20, source_burst=40)
    tracker.arm(1_000.0)
    meter = encode(Meter(ts_ns=1, power_w=5_000.0))
    for _ in range(1_000):
        intake.handle(_msg(f"{BASE}/meter", meter), 1.0)
    assert intake.dropped["rate_limited"] == 1_000 - 40
    assert tracker.meter_w == 5_000.0


def test_ten_thousand_status_flaps_warn_once_per_interval() -> None:
    """node_offline is logged at most once per node per warn_every_s, with the count."""
    intake, tracker = _intake(messages_per_s=10_000, messages_burst=100_000, warn_every_s=60)
    online = encode(Status(ts_ns=1, state="online", node="n1"))
    offline = encode(Status(ts_ns=1, state="offline", node="n1"))
    with capture_logs() as logs:
        for i in range(5_000):
            now_s = 1.0 + i * 0.01  # 50 s in all
            intake.handle(_msg(f"{BASE}/r1/n1/status", offline), now_s)
            intake.handle(_msg(f"{BASE}/r1/n1/status", online), now_s)
        intake.handle(_msg(f"{BASE}/r1/n1/status", offline), 70.0)
    warnings = [e for e in logs if e["event"] == "node_offline"]
    assert [w["times"] for w in warnings] == [1, 5_000]
    assert tracker.nodes["n1"].status == "offline"


def test_implausible_telemetry_is_counted_by_reason_and_warned_once_per_interval() -> None:
    """A node claiming 10 MW again and again: each counted, one warning a minute."""
    intake, tracker = _intake(telemetry_per_s=1_000, telemetry_burst=1_000, warn_every_s=60)
    intake.handle(_msg(f"{BASE}/r1/n1/telemetry", _telemetry("n1", gpus=8)), 0.0)
    lie = Telemetry.model_validate_json(_telemetry("n1", gpus=8)).model_copy(
        update={"node_gpu_power_w": 1e7}
    )
    with capture_logs() as logs:
        for i in range(100):
            accepted = intake.handle(_msg(f"{BASE}/r1/n1/telemetry", encode(lie)), 1.0 + i * 0.1)
            assert isinstance(accepted, TelemetryIn)
            assert accepted.anomalies == ("power",)
    warnings = [e for e in logs if e["event"] == "telemetry_implausible"]
    assert len(warnings) == 1
    assert warnings[0]["reasons"] == ["power"]
    assert warnings[0]["claimed_gpu_w"] == 1e7
    assert intake.implausible == {"power": 100}
    assert tracker.nodes["n1"].implausible_readings == 100
    assert tracker.nodes["n1"].counted_w == pytest.approx(8 * 1400 * 1.25)
