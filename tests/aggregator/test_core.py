"""The aggregator's core without a shell: a received message or a step in, effects out.

Standby routing and thinning, deposition by a higher term, publish gating on the lease
(monotonic time passed in), the step as a transaction and the quarantine plan.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import structlog

from polca.aggregator.config import AggregatorSettings
from polca.aggregator.core import AggregatorCore, Received
from polca.aggregator.intake import node_shard
from polca.export.sink import FanOut, MemorySink
from polca.policy import PolicyStore
from polca.telemetry.messages import InMessage
from polca.telemetry.schema import (
    Control,
    Event,
    GpuTelemetry,
    Meter,
    Status,
    Telemetry,
    decode,
    encode,
)

POLICY = Path(__file__).resolve().parents[2] / "policies" / "polca-a100.yaml"
BASE = "polca/v1/dc1/row1"
S = 1_000_000_000


def _core(tmp_path: Path, *, ha: bool = False, **intake: float) -> AggregatorCore:
    settings = AggregatorSettings(
        site="dc1",
        instance="agg",
        policy_file=POLICY,
        state_dir=tmp_path,
        rows=[
            {
                "name": "row1",
                "budget_w": 10_000.0,
                "racks": [{"name": "r1", "nodes": [{"name": "n1"}, {"name": "n2"}]}],
            }
        ],
        control={"warmup_s": 0.0, "stale_after_s": 5.0, "lease_s": 10.0},
        influx={"write_every_s": {"gpu": 10.0}},
        ha={"etcd_endpoints": ["http://127.0.0.1:2379"] if ha else [], "peers": ["agg-b"]},
        intake=intake,
    )
    store = PolicyStore(POLICY)
    store.reload()
    core = AggregatorCore(settings, policy_store=store, epoch_ns=1, log=structlog.get_logger())
    core.rows.start(0.0)
    return core


def _telemetry(node: str, *, gpus: int = 2) -> bytes:
    return encode(
        Telemetry(
            ts_ns=1,
            seq=1,
            node=node,
            interval_s=1,
            node_gpu_power_w=200.0 * gpus,
            node_energy_delta_j=1,
            gpus=tuple(
                GpuTelemetry(index=i, uuid=f"GPU-{node}-{i}", name="A100", power_mean_w=200.0)
                for i in range(gpus)
            ),
        )
    )


def _control(level: int, *, term: int, issuer: str = "agg-b") -> bytes:
    return encode(
        Control(
            ts_ns=1,
            scope="row",
            row="row1",
            issuer=issuer,
            term=term,
            epoch_ns=1,
            seq=1,
            level=level,
            issued_ns=1,
            lease_expires_ns=10 * S,
        )
    )


def _receive(
    core: AggregatorCore,
    topic: str,
    payload: bytes,
    *,
    now_s: float = 1.0,
    retain: bool = False,
    writing: bool = True,
) -> Received:
    message = InMessage(f"{BASE}/{topic}", payload, retain, 1, int(now_s * S))
    return core.receive(message, received_s=now_s, now_s=now_s, writing=writing)


def _measurements(received: Received) -> list[list[str]]:
    return [[p.measurement for p in batch] for batch in received.writes]


def test_an_instance_alone_writes_gpu_points_thinned_to_their_interval(tmp_path: Path) -> None:
    """A node's per-GPU series are written at most every ``write_every_s.gpu`` (10 s, due
    a tenth early), as one batch; without a sink nothing is built."""
    core = _core(tmp_path)
    first = _receive(core, "r1/n1/telemetry", _telemetry("n1"), now_s=1.0)
    assert _measurements(first) == [["gpu", "gpu"]]
    assert not first.wake
    assert _receive(core, "r1/n1/telemetry", _telemetry("n1"), now_s=5.0).writes == ()
    other = _receive(core, "r1/n2/telemetry", _telemetry("n2"), now_s=5.0)
    assert _measurements(other) == [["gpu", "gpu"]]  # intervals are per node
    assert _measurements(_receive(core, "r1/n1/telemetry", _telemetry("n1"), now_s=10.0)) == [
        ["gpu", "gpu"]
    ]
    silent = _receive(core, "r1/n1/telemetry", _telemetry("n1"), now_s=30.0, writing=False)
    assert silent == Received()


def test_a_standby_writes_no_series_of_the_rows_but_wakes_and_writes_events(
    tmp_path: Path,
) -> None:
    """The leader writes the rows' series; a standby applies the reading (its ladders stay
    warm), still wakes its step on an urgent one and writes the nodes' events."""
    core = _core(tmp_path, ha=True)
    assert core.leadership.role == "standby"
    received = _receive(core, "r1/n1/telemetry", _telemetry("n1"))
    assert received == Received()
    assert core.rows.trackers["row1"].nodes["n1"].telemetry is not None
    event = encode(Event(ts_ns=1, seq=1, node="n1", event="cap_changed"))
    assert _measurements(_receive(core, "r1/n1/events", event)) == [["event"]]
    assert core.step(1.0, now_ns=1, now_mono_ns=S) is not None  # arms the row at T1
    meter = encode(Meter(ts_ns=1, power_w=9_500.0))
    assert _receive(core, "meter", meter, now_s=1.5).wake


def test_a_leader_is_deposed_by_a_peers_live_control_at_a_higher_term(tmp_path: Path) -> None:
    """A peer's live control at a higher term: this instance stops leading at once (before
    its deadline) and says so; a retained one at a higher term is of unknown age: ignored."""
    core = _core(tmp_path, ha=True)
    core.leadership.elected(term=5, instance="agg", sent_mono_ns=0, ttl_s=2.0)
    retained = _receive(core, "control", _control(2, term=9), retain=True)
    assert retained.deposed is None
    assert core.leadership.may_publish(S)
    live = _receive(core, "control", _control(2, term=6))
    assert live.deposed == 6
    assert not core.leadership.may_publish(S)
    assert core.leadership.status("row1")["role"] == "standby"
    stepped = core.step(1.0, now_ns=1, now_mono_ns=S)
    assert stepped is not None
    assert stepped.messages == []


def test_a_forged_term_neither_deposes_a_leader_nor_leads_a_standby(tmp_path: Path) -> None:
    """A control at a term no etcd reaches (above 2**40) is dropped as term_jump: the leader
    keeps leading, a standby's ladder ignores it, and one retained under the instance's own
    name does not seed its ladder after a restart."""
    core = _core(tmp_path, ha=True)
    core.leadership.elected(term=5, instance="agg", sent_mono_ns=0, ttl_s=2.0)
    forged = _receive(core, "control", _control(0, term=2**63 - 1))
    assert forged.deposed is None
    assert core.leadership.may_publish(S)
    assert core.intake.drops.counts["term_jump"] == 1
    standby = _core(tmp_path / "b", ha=True)
    standby.leadership.observed(leader="agg-b", term=7)
    _receive(standby, "control", _control(2, term=7))
    _receive(standby, "control", _control(0, term=2**40 + 1))
    assert standby.rows.controllers[("row1", None)].ladder.level == 2
    # Retained under this instance's own name, it does not seed a restarted ladder.
    alone = _core(tmp_path / "c")
    _receive(alone, "control", _control(3, term=2**63 - 1, issuer="agg"), retain=True)
    assert alone.rows.controllers[("row1", None)].ladder.level == 0
    assert alone.intake.drops.counts["term_jump"] == 1


def test_a_standby_follows_its_leaders_level_not_an_older_terms(tmp_path: Path) -> None:
    """A standby's ladder takes the leader's level; a live control of a lower term (a
    deposed leader still publishing) is ignored."""
    core = _core(tmp_path, ha=True)
    core.leadership.observed(leader="agg-b", term=7)
    controllers = core.rows.controllers
    assert _receive(core, "control", _control(2, term=7)) == Received()
    assert controllers[("row1", None)].ladder.level == 2
    _receive(core, "control", _control(3, term=6))
    assert controllers[("row1", None)].ladder.level == 2
    _receive(core, "control", _control(1, term=8))
    assert controllers[("row1", None)].ladder.level == 1


def test_a_leader_publishes_only_within_its_lease(tmp_path: Path) -> None:
    """The step decides either way; its control goes out only while the leader's deadline
    (80% of the ttl after the keepalive was sent, monotonic) has not passed."""
    core = _core(tmp_path, ha=True)
    core.rows.trackers["row1"].ingest_meter(Meter(ts_ns=1, power_w=9_200.0), 1.0)
    standby = core.step(1.0, now_ns=1, now_mono_ns=S)
    assert standby is not None
    assert standby.messages == []
    core.leadership.elected(term=5, instance="agg", sent_mono_ns=10 * S, ttl_s=2.0)
    within = core.step(2.0, now_ns=2, now_mono_ns=10 * S + int(1.5 * S))
    assert within is not None
    controls = [m for m in within.messages if m.topic.endswith("/control")]
    assert [m.topic for m in controls] == [f"{BASE}/control"]
    assert controls[0].retain
    late = core.step(3.0, now_ns=3, now_mono_ns=10 * S + int(1.6 * S))
    assert late is not None
    assert (late.messages, late.changed) == ([], [])
    assert late.result.rows[0].decision.level == 2  # decided all the same


def test_a_standby_writes_only_its_own_health_point(tmp_path: Path) -> None:
    """A step's row, rack, node and control series are the leader's to write; every
    instance writes its ``aggregator`` point."""
    sinks = FanOut([MemorySink()])
    standby = _core(tmp_path / "a", ha=True)
    stepped = standby.step(1.0, now_ns=1, now_mono_ns=S)
    assert stepped is not None
    written = standby.step_points(stepped.result, sinks=sinks, now_s=1.0)
    assert written is not None
    assert [p.measurement for p in written] == ["aggregator"]
    alone = _core(tmp_path / "b")
    stepped = alone.step(1.0, now_ns=1, now_mono_ns=S)
    assert stepped is not None
    written = alone.step_points(stepped.result, sinks=sinks, now_s=1.0)
    assert written is not None
    assert {"row", "node", "control", "aggregator"} <= {p.measurement for p in written}


def test_a_step_that_fails_is_undone_counted_and_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever raised while building the messages, the ladders and sequences are as
    before the step, and the next step decides it again."""
    core = _core(tmp_path)
    core.rows.trackers["row1"].ingest_meter(Meter(ts_ns=1, power_w=9_200.0), 1.0)

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        msg = "a message could not be built"
        raise ValueError(msg)

    monkeypatch.setattr("polca.aggregator.messages.step_messages", broken)
    assert core.step(1.0, now_ns=1, now_mono_ns=S) is None
    assert core.step_failures.total == 1
    controller = core.rows.controllers[("row1", None)]
    assert (controller.ladder.level, controller.seq, core.rows.last) == (0, 0, None)
    monkeypatch.undo()
    stepped = core.step(2.0, now_ns=2, now_mono_ns=2 * S)
    assert stepped is not None
    assert [d.level for d in stepped.changed] == [2]


def test_a_flooding_node_is_planned_onto_the_quarantine_connection(tmp_path: Path) -> None:
    """Refused ``quarantine_after`` times, a node's topics leave its shared connection for
    the quarantine one (both resubscribed); its neighbours stay where they were."""
    core = _core(tmp_path, telemetry_per_s=0.001, telemetry_burst=1, quarantine_after=3)
    shared = node_shard("n1", core.settings.intake.connections)
    moves = [_receive(core, "r1/n1/telemetry", _telemetry("n1")).moves for _ in range(5)]
    assert [len(m) for m in moves] == [0, 0, 0, 1, 0]  # one accepted, the third refusal moves
    (moved,) = moves[3]
    assert (moved.row, moved.node, moved.kind, moved.shared) == (
        "row1",
        "n1",
        "quarantined",
        shared,
    )
    assert set(moved.resubscribe) == {shared, "quarantine"}
    n1_topics = {f"{BASE}/r1/n1/{c}" for c in ("telemetry", "status", "events")}
    assert {t for t, _ in moved.resubscribe["quarantine"]} == n1_topics
    assert not n1_topics & {t for t, _ in moved.resubscribe[shared]}


def test_the_status_carries_the_leadership_and_a_crash_loop(tmp_path: Path) -> None:
    """The retained status says the role and term this instance knows (``ha`` only)."""
    core = _core(tmp_path, ha=True)
    core.leadership.observed(leader="agg-b", term=7)
    core.crash_loop = "crash loop: RuntimeError: x (3 runs)"
    status = Status.model_validate_json(core.status_message("online", now_ns=5).payload)
    assert (status.role, status.term, status.leader, status.shard) == (
        "standby",
        7,
        "agg-b",
        "row1",
    )
    assert status.reason == core.crash_loop
    alone = _core(tmp_path / "alone")
    assert Status.model_validate_json(alone.status_message("online", now_ns=5).payload).role is None


def _bmc_core(tmp_path: Path) -> AggregatorCore:
    settings = AggregatorSettings(
        site="dc1",
        instance="agg",
        policy_file=POLICY,
        state_dir=tmp_path,
        rows=[
            {
                "name": "row1",
                "budget_w": 10_000.0,
                # The nodes' telemetry declares small GPUs: the row's meter may read more.
                "meter_max_w": 12_000.0,
                "racks": [{"name": "r1", "nodes": [{"name": "n1"}, {"name": "n2"}]}],
            }
        ],
        control={"warmup_s": 0.0, "stale_after_s": 5.0, "lease_s": 10.0},
        bmc={
            "agent_back_s": 0.0,
            "nodes": {
                "n1": {
                    "endpoint": {"url": "http://127.0.0.1:9", "allow_http": True},
                    "fail_safe_w": 2500.0,
                }
            },
        },
    )
    store = PolicyStore(POLICY)
    store.reload()
    core = AggregatorCore(settings, policy_store=store, epoch_ns=1, log=structlog.get_logger())
    core.rows.start(0.0)
    return core


def test_a_node_whose_agent_went_quiet_at_a_capping_level_is_capped_through_its_bmc(
    tmp_path: Path,
) -> None:
    """n1 (with a BMC) and n2 (without) go quiet while the row's meter holds it at level
    2: only n1 gets an out-of-band target, once, with its fail-safe limit; the outcome of
    the write becomes an ``oob_cap`` event and an ``oob`` point with the node's counts."""
    from polca.bmc.actuator import OobOutcome

    core = _bmc_core(tmp_path)
    for node in ("n1", "n2"):
        _receive(core, f"r1/{node}/telemetry", _telemetry(node), now_s=1.0)
    core.rows.trackers["row1"].ingest_meter(Meter(ts_ns=1, power_w=9_200.0), 1.0)
    hot = core.step(1.5, now_ns=1, now_mono_ns=S)
    assert hot is not None
    assert hot.result.rows[0].decision.level == 2
    assert hot.oob == []  # both agents answer
    core.rows.trackers["row1"].ingest_meter(Meter(ts_ns=2, power_w=9_200.0), 8.0)
    quiet = core.step(8.0, now_ns=2, now_mono_ns=8 * S)
    assert quiet is not None
    assert [(t.node, t.watts) for t in quiet.oob] == [("n1", 2500.0)]
    assert "stale at level 2" in quiet.oob[0].reason
    core.rows.trackers["row1"].ingest_meter(Meter(ts_ns=3, power_w=9_200.0), 9.0)
    again = core.step(9.0, now_ns=3, now_mono_ns=9 * S)
    assert again is not None
    assert again.oob == []  # held, not asked again
    outcome = OobOutcome(
        node="n1",
        action="cap",
        target_w=2500.0,
        limit_w=2500.0,
        verified=True,
        error=None,
        reason=quiet.oob[0].reason,
        latency_s=0.4,
    )
    event, point = core.oob_reported(outcome, now_ns=10)
    assert event is not None
    assert b'"event":"oob_cap"' in event.payload
    assert point.measurement == "oob"
    assert point.fields["caps"] == 1
    assert point.fields["capped"] == 1.0
    failed = replace(outcome, verified=False, limit_w=3000.0)
    event, point = core.oob_reported(failed, now_ns=11)
    assert event is not None
    assert b'"event":"oob_cap_failed"' in event.payload
    assert (point.fields["caps"], point.fields["failures"]) == (1, 1)


def test_a_quarantined_node_quiet_for_the_release_time_moves_back(tmp_path: Path) -> None:
    """A fault that clears, clears: a quarantined node whose next admitted message comes
    quarantine_release_s after its last refused one is planned back onto its shared
    connection (both resubscribed), counted, and counts towards quarantine afresh; one
    admitted sooner stays where it is."""
    core = _core(
        tmp_path, telemetry_per_s=0.01, telemetry_burst=1, quarantine_after=2,
        quarantine_release_s=120.0,
    )  # fmt: skip
    shared = node_shard("n1", core.settings.intake.connections)
    view = core.rows.trackers["row1"].nodes["n1"]

    def send(now_s: float) -> Received:
        return _receive(core, "r1/n1/telemetry", _telemetry("n1"), now_s=now_s)

    for now_s in (1.0, 1.0, 50.0):  # one admitted, two refused (the token refills in 100 s)
        send(now_s)
    assert view.quarantined
    early = send(150.0)  # admitted, 100 s after the last refusal
    assert early.moves == ()
    assert view.quarantined
    back = send(300.0)  # admitted, 250 s after it
    (moved,) = back.moves
    assert (moved.kind, moved.shared) == ("released", shared)
    n1_topics = {f"{BASE}/r1/n1/{c}" for c in ("telemetry", "status", "events")}
    assert n1_topics <= {t for t, _ in moved.resubscribe[shared]}
    assert not n1_topics & {t for t, _ in moved.resubscribe["quarantine"]}
    assert (view.quarantined, view.releases, view.flood_refusals) == (False, 1, 0)
    stepped = core.step(300.0, now_ns=1, now_mono_ns=300 * S)
    assert stepped is not None
    (n1,) = [n for n in stepped.result.rows[0].nodes if n.node == "n1"]
    assert (n1.quarantined, n1.quarantine_releases) == (False, 1)


def test_a_refused_policy_file_is_one_small_event_naming_the_revision_kept(
    tmp_path: Path,
) -> None:
    """However many or long the problems, the event carries the first 20, each cut to
    1,000 characters, and the revision still in force."""
    core = _core(tmp_path)
    message = core.policy_rejected([f"{i}:" + "x" * 5_000 for i in range(50)], now_ns=7)
    assert message is not None
    event = decode(message.payload)
    assert isinstance(event, Event)
    assert event.event == "policy_rejected"
    problems = event.detail["problems"]
    assert isinstance(problems, list)
    assert [str(p).split(":")[0] for p in problems] == [str(i) for i in range(20)]
    assert {len(str(p)) for p in problems} == {1000}
    assert event.detail["revision_in_force"] == core.policy.revision
