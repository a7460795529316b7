"""Which connection carries what: control apart, nodes spread, sources apart, quarantine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from polca.aggregator import connections
from polca.aggregator.config import AggregatorSettings
from polca.aggregator.core import AggregatorCore
from polca.aggregator.intake import node_shard
from polca.coord.leadership import Leadership
from polca.policy import PolicyStore
from polca.settings import MqttSettings
from polca.telemetry.memory import MemoryBroker, MemoryBus
from polca.telemetry.messages import OutMessage
from polca.telemetry.schema import Meter, encode

POLICY = Path(__file__).resolve().parents[2] / "policies" / "polca-a100.yaml"
NODES = [f"n{i}" for i in range(12)]


def _settings(tmp_path: Path, **over: Any) -> AggregatorSettings:
    return AggregatorSettings(
        site="dc1",
        instance="agg",
        policy_file=POLICY,
        state_dir=tmp_path,
        rows=[
            {
                "name": "row1",
                "budget_w": 10_000.0,
                "racks": [{"name": "r1", "nodes": [{"name": n} for n in NODES]}],
            }
        ],
        **over,
    )


def _core(settings: AggregatorSettings) -> AggregatorCore:
    return AggregatorCore(
        settings, policy_store=PolicyStore(POLICY), epoch_ns=1, log=structlog.get_logger()
    )


def test_each_node_is_on_exactly_one_node_connection_and_quarantine_is_kept(
    tmp_path: Path,
) -> None:
    """Nodes spread over ``nodes-N`` by their stable shard; ``quarantine`` exists, empty;
    the row meter's topic is on ``sources``; node topics at QoS 0."""
    settings = _settings(tmp_path, intake={"connections": 3})
    plan = connections.intake_plan(_core(settings).intake, 3)
    assert plan["quarantine"] == []
    assert set(plan) <= {"nodes-0", "nodes-1", "nodes-2", "quarantine", "sources"}
    assert plan["sources"] == [("polca/v1/dc1/row1/meter", 0)]
    for node in NODES:
        carrying = [name for name, subs in plan.items() if any(f"/{node}/" in t for t, _ in subs)]
        assert carrying == [node_shard(node, 3)]
    assert all(qos == 0 for subs in plan.values() for _, qos in subs)


def test_empty_node_connections_are_not_made(tmp_path: Path) -> None:
    """More connections than nodes: only those that carry a node exist."""
    settings = _settings(tmp_path, intake={"connections": 64})
    plan = connections.intake_plan(_core(settings).intake, 64)
    node_conns = {name for name in plan if name.startswith("nodes-")}
    assert node_conns == {node_shard(n, 64) for n in NODES}


def test_the_buses_have_their_client_ids_subscriptions_and_will(tmp_path: Path) -> None:
    """The control connection subscribes the rows' control only and carries the Last
    Will; each intake connection is ``<client id>-<name>``, without a will."""
    settings = _settings(tmp_path, intake={"connections": 2})
    core = _core(settings)
    will = OutMessage("polca/v1/dc1/aggregator/agg/status", b"offline", qos=1, retain=True)
    control, intake = connections.make_buses(
        MemoryBroker().bus,
        settings,
        core.intake,
        will=will,
        birth=list,
        clock_ns=lambda: 0,
        mono_ns=lambda: 0,
    )
    assert isinstance(control, MemoryBus)
    assert control.client_id == "polca-aggregator-agg"
    assert control.will == will
    assert set(control.filters) == {"polca/v1/dc1/row1/control", "polca/v1/dc1/row1/+/control"}
    assert set(intake) == {"nodes-0", "nodes-1", "quarantine", "sources"}
    for name, bus in intake.items():
        assert isinstance(bus, MemoryBus)
        assert bus.client_id == f"polca-aggregator-agg-{name}"
        assert bus.will is None
    named = _settings(tmp_path, mqtt={"client_id": "agg-main"})
    assert connections.client_id(named) == "agg-main"


def test_an_elector_only_with_etcd_endpoints(tmp_path: Path) -> None:
    """No endpoints: no campaign (the instance is alone); with them, the shard's key."""
    alone = _settings(tmp_path)
    lead = Leadership()
    assert connections.elector(alone, leadership=lead, on_change=list, mono_ns=lambda: 0) is None
    ha = _settings(tmp_path, ha={"etcd_endpoints": ["http://127.0.0.1:2379"]})
    elector = connections.elector(ha, leadership=lead, on_change=list, mono_ns=lambda: 0)
    assert elector is not None
    assert elector.key == "polca/v1/leader/dc1/row1"
    assert elector.instance == "agg"
    assert elector.leadership is lead


def _sources_bus(tmp_path: Path, protocol: str) -> tuple[MemoryBroker, MemoryBus, AggregatorCore]:
    settings = _settings(tmp_path, mqtt={"protocol": protocol})
    core = _core(settings)
    broker = MemoryBroker()
    _, intake = connections.make_buses(
        broker.bus,
        settings,
        core.intake,
        will=OutMessage("polca/v1/dc1/aggregator/agg/status", b"offline", qos=1, retain=True),
        birth=list,
        clock_ns=lambda: 1,
        mono_ns=lambda: 0,
    )
    sources = intake["sources"]
    assert isinstance(sources, MemoryBus)
    sources.connect()
    return broker, sources, core


def test_under_mqtt5_a_meter_reading_sent_retained_is_refused_live(tmp_path: Path) -> None:
    """Only the sources' connection asks for MQTT 5's retain-as-published: a meter reading
    its publisher sent retained reaches the intake flagged, live, and is refused as of
    unknown age; a plain reading is taken. Under 3.1.1 the broker clears the flag on live
    delivery (no such option), as MemoryBroker does."""
    meter = "polca/v1/dc1/row1/meter"
    reading = encode(Meter(ts_ns=1, power_w=5_000.0))
    for protocol, refused in (("5", True), ("3.1.1", False)):
        broker, sources, core = _sources_bus(tmp_path / protocol, protocol)
        assert sources.retain_as_published is (protocol == "5")
        broker.publish(OutMessage(meter, reading, qos=0, retain=True))
        (message,) = sources.inbox
        assert message.retain is refused
        core.intake.handle(message, now_s=1.0)
        assert core.intake.dropped["stale"] == int(refused), core.intake.dropped
        broker.publish(OutMessage(meter, reading, qos=0))
        core.intake.handle(sources.inbox[-1], now_s=1.1)
        assert core.intake.dropped["stale"] == int(refused)
        nodes = connections.make_buses(
            broker.bus,
            _settings(tmp_path / protocol, mqtt={"protocol": protocol}),
            core.intake,
            will=OutMessage("polca/v1/dc1/aggregator/agg/status", b"", qos=1, retain=True),
            birth=list,
            clock_ns=lambda: 1,
            mono_ns=lambda: 0,
        )[1]
        assert all(
            not bus.retain_as_published  # type: ignore[attr-defined]
            for name, bus in nodes.items()
            if name != "sources"
        )


def test_the_intake_is_cut_while_any_connection_waits_for_its_subscriptions(
    tmp_path: Path,
) -> None:
    """Connected but not yet subscribed (a cluster electing after a failover): cut;
    every connection subscribed: not cut; no control connection yet: the others decide."""
    settings = _settings(tmp_path, intake={"connections": 2})
    core = _core(settings)
    control, intake = connections.make_buses(
        MemoryBroker().bus,
        settings,
        core.intake,
        will=OutMessage("polca/v1/dc1/aggregator/agg/status", b"", qos=1, retain=True),
        birth=list,
        clock_ns=lambda: 0,
        mono_ns=lambda: 0,
    )
    assert connections.intake_cut(control, intake)
    for bus in (control, *intake.values()):
        assert isinstance(bus, MemoryBus)
        bus.connect()
    assert not connections.intake_cut(control, intake)
    assert not connections.intake_cut(None, intake)
    intake["nodes-0"].subscribed.clear()
    assert connections.intake_cut(control, intake)


def test_a_quarantine_move_resubscribes_the_connections_it_names(tmp_path: Path) -> None:
    """The shared connection drops the node's topics, ``quarantine`` takes them; a
    connection not made yet is skipped."""
    broker = MemoryBroker()
    shared = broker.bus(MqttSettings(), client_id="s")
    moved = connections.NodeMove(
        row="row1",
        node="n1",
        kind="quarantined",
        shared="nodes-0",
        resubscribe={"nodes-0": [("polca/v1/dc1/row1/r1/n2/telemetry", 0)], "quarantine": []},
    )
    connections.resubscribe({"nodes-0": shared}, moved)
    assert shared.filters == ("polca/v1/dc1/row1/r1/n2/telemetry",)


def _buses(tmp_path: Path) -> tuple[MemoryBroker, Any, dict[str, Any]]:
    broker = MemoryBroker()
    settings = _settings(tmp_path, intake={"connections": 2})
    control, intake = connections.make_buses(
        broker.bus,
        settings,
        _core(settings).intake,
        will=OutMessage("polca/v1/dc1/aggregator/agg/status", b"", qos=1, retain=True),
        birth=list,
        clock_ns=lambda: 0,
        mono_ns=lambda: 0,
    )
    return broker, control, intake


def test_the_supervised_connections_are_named_and_hand_every_message_over(
    tmp_path: Path,
) -> None:
    """``mqtt`` for control, ``mqtt-<name>`` for each intake connection, ``etcd`` only with
    an elector; every bus hands a received message to the one handler."""
    broker, control, intake = _buses(tmp_path)
    seen: list[str] = []
    runs = connections.tasks(control, intake, None, handler=lambda m: seen.append(m.topic))
    for run in runs.values():
        run.close()  # not started here: only their names and handlers matter
    assert set(runs) == {"mqtt", *(f"mqtt-{name}" for name in intake)}
    for bus in (control, *intake.values()):
        bus.connect()
        bus.deliver(OutMessage("polca/v1/dc1/t", b"x"), retain=False)
    assert seen == ["polca/v1/dc1/t"] * (1 + len(intake))
    assert broker.published == []  # nothing went out


def test_stats_name_each_connection_and_skip_one_not_made(tmp_path: Path) -> None:
    _, control, intake = _buses(tmp_path)
    control.connect()
    assert set(connections.stats(control, intake)) == {"control", *intake}
    assert connections.stats(control, intake)["control"].connects == 1
    assert set(connections.stats(None, intake)) == set(intake)


async def test_closing_sends_the_final_status_last_on_the_control_connection(
    tmp_path: Path,
) -> None:
    """The intake connections close first, then control with the final status; resigning
    without an elector does nothing."""
    broker, control, intake = _buses(tmp_path)
    for bus in (control, *intake.values()):
        bus.connect()
    final = OutMessage("polca/v1/dc1/aggregator/agg/status", b"offline", qos=1, retain=True)
    log = structlog.get_logger()
    await connections.resign(None, log)
    await connections.close(control, intake, final=final, log=log)
    assert broker.published == [final]
    assert not any(bus.connected.is_set() for bus in (control, *intake.values()))
    await connections.close(None, {}, final=final, log=log)  # nothing made: nothing to do
    assert broker.published == [final]
