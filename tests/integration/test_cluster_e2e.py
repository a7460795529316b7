"""The core end-to-end scenarios on the 3-node NATS cluster: a row over T2 caps its agents,
the leading aggregator killed (a standby leads), the broker node under the leader killed
or stopped for maintenance (every process moves to another node), and one node cut off
from the other two.

Every process gets the three endpoints, starting on its own node (aggregators agg1 and
agg2 on nodes 1 and 2, agents node1 and node2 likewise), and the defaults polca takes on a
cluster (several endpoints): QoS 0 subscriptions and a 30 s control lease, since a node
lost makes the cluster elect new JetStream leaders and clients that reconnect meanwhile
wait for them (5 to 12 s measured, bench/bench_broker_failover.py). The test's probe sits
on node 0, which is never killed. The hostile retained messages run on the
cluster in test_hostile_retained.py (its ``broker`` fixture).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from polca.aggregator.config import CLUSTER_LEASE_S
from polca.telemetry.schema import Control, Status
from tests.etcd import EtcdCluster
from tests.integration.rig import ROW, ClusterBroker, MqttProbe, wait_until
from tests.integration.test_ha_e2e import INSTANCES, Shard, row_at_t2
from tests.nats_cluster import NatsCluster

PLACES = {"agg1": 1, "node1": 1, "agg2": 2, "node2": 2}
"""The node each process starts on (the first of its endpoints); each falls back to the
other of nodes 1 and 2 before node 0, the probe's, which the tests never kill."""


@pytest.fixture
def cluster_shard(
    tmp_path: Path, nats_cluster: NatsCluster, fake_nvml_lib: Path, etcd: EtcdCluster
) -> Iterator[Shard]:
    made = Shard(
        tmp_path,
        ClusterBroker.of(nats_cluster),
        fake_nvml_lib,
        etcd,
        placement=lambda name: ClusterBroker.of(
            nats_cluster, order=(PLACES[name], 3 - PLACES[name], 0)
        ),
        lease_s=None,  # the cluster's default: CLUSTER_LEASE_S
    )
    yield made
    made.kill_all()


@pytest.fixture
async def on_cluster_at_t2(
    cluster_shard: Shard, nats_cluster: NatsCluster
) -> AsyncIterator[MqttProbe]:
    async with row_at_t2(cluster_shard, ClusterBroker.of(nats_cluster)) as probe:
        yield probe


def _controls(probe: MqttProbe, start: int = 0) -> list[Control]:
    return [
        m
        for m in probe.of("control")[start:]
        if isinstance(m, Control) and m.scope == "row" and m.row == ROW
    ]


def _endpoints(probe: MqttProbe) -> dict[str, str | None]:
    """Each process's endpoint, from its latest online status."""
    seen: dict[str, str | None] = {}
    for message in probe.of("status"):
        if isinstance(message, Status) and message.state == "online":
            seen[message.node] = message.mqtt_endpoint
    return seen


_STORY = {
    "aggregator_warm",
    "intake_back_levels_free",
    "intake_cut_levels_held",
    "leadership_changed",
    "level_changed",
    "mqtt_connected",
    "mqtt_disconnected",
}
"""The aggregators' log events that tell what happened to the row's level."""


def _story(shard: Shard, levels: object) -> str:
    """An assertion's message: ``levels``, then the aggregators' ``_STORY`` events."""
    lines = [str(levels)]
    for name, aggregator in shard.aggregators.items():
        lines.extend(f"{name} {e}" for e in aggregator.logs() if e.get("event") in _STORY)
    return "\n".join(lines)


def _fell(shard: Shard) -> list[str]:
    return [
        name
        for name, agent in shard.agents.items()
        if [e for e in agent.logs() if e.get("event") == "fail_safe_entered"]
    ]


async def test_row_over_t2_caps_its_agents_and_a_standby_takes_over(
    cluster_shard: Shard, on_cluster_at_t2: MqttProbe, nats_cluster: NatsCluster
) -> None:
    """At T2 on the cluster, each process on its own node (its status says which); the
    leader killed, the standby's control reaches both agents through the other nodes."""
    probe = on_cluster_at_t2
    endpoints = [f"{h}:{p}" for h, p in nats_cluster.mqtt_endpoints]
    await wait_until(lambda: set(_endpoints(probe)) >= set(PLACES), what="every status")
    on = {name: _endpoints(probe)[name] for name in PLACES}
    assert set(on.values()) <= set(endpoints[1:]), on  # each names its node
    old = _controls(probe)[-1]
    assert old.lease_expires_ns - old.issued_ns == int(CLUSTER_LEASE_S * 1e9)  # the default
    (standby,) = [name for name in INSTANCES if name != old.issuer]
    start = len(probe.of("control"))
    cluster_shard.aggregators[old.issuer].kill()
    await wait_until(
        lambda: any(c.issuer == standby for c in _controls(probe, start)),
        timeout_s=15,
        what="the standby's first control",
    )
    await asyncio.sleep(2.0)
    after = _controls(probe, start)
    assert {c.level for c in after} == {2}
    assert all(c.term > old.term for c in after if c.issuer == standby)
    assert cluster_shard.at_t2()
    assert _fell(cluster_shard) == []


async def test_the_leaders_broker_node_killed_every_process_moves_and_the_row_stays_at_t2(
    cluster_shard: Shard, on_cluster_at_t2: MqttProbe, nats_cluster: NatsCluster
) -> None:
    """SIGKILL the broker node the leading aggregator and one agent are on: both connect to
    another node (their status names it), the row's control stays at T2 throughout, and no
    agent applies its fail-safe caps."""
    probe = on_cluster_at_t2
    await wait_until(lambda: set(_endpoints(probe)) >= set(PLACES), what="every status")
    leader = _controls(probe)[-1].issuer
    endpoints = [f"{h}:{p}" for h, p in nats_cluster.mqtt_endpoints]
    await wait_until(lambda: _endpoints(probe).get(leader) is not None, what="its endpoint")
    lost = _endpoints(probe)[leader]  # where the leader is now (its own node, or the other)
    assert lost in endpoints[1:], lost
    index = endpoints.index(lost)
    moving = {name for name, where in _endpoints(probe).items() if where == lost}
    assert leader in moving
    start = len(probe.of("control"))
    killed = time.monotonic()
    await asyncio.to_thread(nats_cluster.kill, index)
    await wait_until(
        lambda: all(_endpoints(probe).get(name) not in (None, lost) for name in moving),
        timeout_s=CLUSTER_LEASE_S,
        what="every process of the lost node on another one",
    )
    moved_s = time.monotonic() - killed
    moved_ns = time.time_ns()
    await wait_until(
        lambda: any(c.issued_ns > moved_ns for c in _controls(probe, start)),
        timeout_s=20,  # the leader's connections may move on (a hung CONNECT, 10 s)
        what="control after the move",
    )
    await asyncio.sleep(2.0)
    after = _controls(probe, start)
    levels = [(c.issuer, c.level) for c in after]
    assert {c.level for c in after} == {2}, _story(cluster_shard, levels)
    assert cluster_shard.at_t2()
    assert _fell(cluster_shard) == [], f"moved in {moved_s:.1f} s"
    for name in moving:  # the move is logged as a failover
        process = (
            cluster_shard.aggregators[name]
            if name in cluster_shard.aggregators
            else cluster_shard.agents[name]
        )
        moved = await process.wait_log("mqtt_connected", where=lambda e: e.get("failover") is True)
        assert moved["endpoint"] != lost


async def test_the_leaders_broker_node_stopped_for_maintenance_hands_everything_over(
    cluster_shard: Shard, on_cluster_at_t2: MqttProbe, nats_cluster: NatsCluster
) -> None:
    """Stop the leader's broker node as nats-server.service does (SIGUSR2, lame duck):
    it hands its JetStream leadership over, then closes its clients, and each moves to
    another node; control stays at T2 throughout and no agent applies its fail-safe caps."""
    probe = on_cluster_at_t2
    await wait_until(lambda: set(_endpoints(probe)) >= set(PLACES), what="every status")
    leader = _controls(probe)[-1].issuer
    endpoints = [f"{h}:{p}" for h, p in nats_cluster.mqtt_endpoints]
    await wait_until(lambda: _endpoints(probe).get(leader) is not None, what="its endpoint")
    stopped = _endpoints(probe)[leader]
    assert stopped in endpoints[1:], stopped
    moving = {name for name, where in _endpoints(probe).items() if where == stopped}
    start = len(probe.of("control"))
    await asyncio.to_thread(nats_cluster.lame_duck, endpoints.index(stopped))  # ~30 s
    await wait_until(
        lambda: all(_endpoints(probe).get(name) not in (None, stopped) for name in moving),
        timeout_s=10,
        what="every process of the stopped node on another one",
    )
    moved_ns = time.time_ns()
    await wait_until(
        lambda: any(c.issued_ns > moved_ns for c in _controls(probe, start)),
        timeout_s=10,
        what="control after the move",
    )
    after = _controls(probe, start)
    levels = [(c.issuer, c.level) for c in after]
    assert {c.level for c in after} == {2}, _story(cluster_shard, levels)
    assert cluster_shard.at_t2()
    assert _fell(cluster_shard) == []


async def test_a_node_cut_off_from_the_others_leads_no_agent_to_a_stale_leader(
    cluster_shard: Shard, on_cluster_at_t2: MqttProbe, nats_cluster: NatsCluster
) -> None:
    """Pause the leader and cut its broker node off from the other two (its cluster
    routes) until the standby leads. The agent on the cut-off node hears neither leader:
    the old one, resumed there, publishes nothing (its etcd deadline passed), and the new
    one's control cannot cross. After 10 s of silence (``control_silence_failover_s``) it
    moves to a node of the majority, inside its 30 s lease. Healed, every control is the
    new leader's, at T2, and no agent fell to its fail-safe caps."""
    probe = on_cluster_at_t2
    await wait_until(lambda: set(_endpoints(probe)) >= set(PLACES), what="every status")
    leader = _controls(probe)[-1].issuer
    (standby,) = [name for name in INSTANCES if name != leader]
    endpoints = [f"{h}:{p}" for h, p in nats_cluster.mqtt_endpoints]
    await wait_until(lambda: _endpoints(probe).get(leader) is not None, what="its endpoint")
    lost = _endpoints(probe)[leader]  # the leader's node now: its own, or the other
    assert lost in endpoints[1:], lost
    index = endpoints.index(lost)
    cut_agents = [n for n in cluster_shard.agents if _endpoints(probe).get(n) == lost]
    old = cluster_shard.aggregators[leader]
    old.signal(signal.SIGSTOP)  # first, so nothing it sent before the cut arrives after it
    await asyncio.sleep(0.5)
    await asyncio.to_thread(nats_cluster.isolate, index)
    try:
        await wait_until(
            lambda: any(c.issuer == standby for c in _controls(probe)[-3:]),
            timeout_s=20,
            what="the standby leading",
        )
    finally:
        old.signal(signal.SIGCONT)
    for cut_agent in cut_agents:  # silent for 10 s (control_silence_failover_s): it moves
        await wait_until(
            lambda name=cut_agent: _endpoints(probe).get(name) not in (None, lost),  # type: ignore[misc]
            timeout_s=25,
            what=f"{cut_agent} on a node of the majority",
        )
        left = await cluster_shard.agents[cut_agent].wait_log(
            "mqtt_disconnected", where=lambda e: e.get("endpoint") == lost
        )
        # Its own silence watch moved it, or the cut-off node closed its connection.
        assert "moving on: no control" in left["error"] or left["was_connected"], left
    await asyncio.to_thread(nats_cluster.heal, index)
    healed = len(probe.of("control"))
    await wait_until(  # routes back: the cluster may elect again before control flows
        lambda: len(_controls(probe, healed)) >= 3,
        timeout_s=30,
        what="control after the heal",
    )
    after = _controls(probe, healed)
    assert {c.issuer for c in after} == {standby}  # the deposed leader published nothing
    assert {c.level for c in after} == {2}
    assert cluster_shard.at_t2()
    assert _fell(cluster_shard) == []
