"""The aggregator end to end: real agent processes (fake NVML), a real aggregator, Mosquitto."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from polca.telemetry.schema import Control, Meter, RowSummary, Status, encode
from tests.fake_nvml import FakeNvml
from tests.integration.aggregator_rig import AggregatorProcess
from tests.integration.rig import (
    A100_POLICY,
    ROW,
    SITE,
    AgentProcess,
    MqttProbe,
    mqtt_probe,
    polca_status,
    wait_until,
)
from tests.mqtt_broker import MosquittoProcess
from tests.tsdb import VictoriaMetricsProcess

BUDGET_W = 10_000.0
RACKS = {"rack1": ["node1"], "rack2": ["node2"]}
HIGH = (0, 1, 2, 3)
LOW = (4, 5, 6, 7)


def _test_policy(tmp_path: Path) -> Path:
    """The A100 policy with GPUs 0-3 high priority, a 1 s dwell and no trend brake."""
    text = A100_POLICY.read_text(encoding="utf-8")
    text = text.replace("by_index: {}", "by_index: {0: high, 1: high, 2: high, 3: high}", 1)
    text = text.replace("dwell_s: 40 ", "dwell_s: 1  ", 1)
    start = text.index("trend:")
    end = text.index("\n", text.index("reaction_s", start)) + 1
    text = text[:start] + text[end:]
    assert "dwell_s: 1 " in text
    assert "trend:" not in text
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    return path


class Cluster:
    """Two agents on two fake nodes and one aggregator, on one broker."""

    def __init__(
        self,
        tmp_path: Path,
        broker: MosquittoProcess,
        lib: Path,
        *,
        agent_extra: Mapping[str, dict[str, Any]] | None = None,
    ) -> None:
        """``agent_extra``: per node, settings groups merged into its configuration."""
        self.tmp_path = tmp_path
        self.broker = broker
        self.policy = _test_policy(tmp_path)
        self.nodes: dict[str, FakeNvml] = {}
        self.agents: dict[str, AgentProcess] = {}
        for rack, names in RACKS.items():
            for name in names:
                directory = tmp_path / f"nvml-{name}"
                directory.mkdir()
                fake = FakeNvml(directory, gpus=8, model="NVIDIA A100-SXM4-80GB", lib_path=lib)
                fake.set(None)  # node keys unchanged; makes the state file exist
                self.nodes[name] = fake
                self.agents[name] = AgentProcess(
                    tmp_path / f"agent-{name}",
                    fake=fake,
                    broker=broker,
                    policy=self.policy,
                    startup_grace_s=60,
                    node=name,
                    rack=rack,
                    extra=(agent_extra or {}).get(name),
                )
        self.aggregator = self.new_aggregator()

    def new_aggregator(self, **kwargs: object) -> AggregatorProcess:
        """An aggregator over both racks (not started)."""
        return AggregatorProcess(
            self.tmp_path / "aggregator",
            broker=self.broker,
            policy=self.policy,
            racks=RACKS,
            budget_w=BUDGET_W,
            **kwargs,  # type: ignore[arg-type]
        )

    def locked_max(self, node: str, gpu: int) -> int:
        """The fake's locked SM clock ceiling (0 = unlocked)."""
        value = self.nodes[node].get(gpu)["locked_max_mhz"]
        assert isinstance(value, int)
        return value

    def all_locks(self) -> dict[str, list[int]]:
        """Every GPU's lock, per node."""
        return {n: [self.locked_max(n, g) for g in range(8)] for n in self.nodes}

    async def start_at_t1(self, probe: MqttProbe, *, meter_steps: int = 25) -> None:
        """Start every process, wait for the aggregator's warm-up, then meter the row at
        85% (``meter_steps`` readings, 0.2 s apart) until it is at T1."""
        for agent in self.agents.values():
            agent.start()
        self.aggregator.start()
        await self.aggregator.wait_log("aggregator_warm", timeout_s=20)
        await _meter_for(probe, self.aggregator.meter_topic, 85.0, steps=meter_steps)
        await _until_level(probe, 1)

    def kill_all(self) -> None:
        """Kill every process (test teardown)."""
        for agent in self.agents.values():
            agent.kill()
        self.aggregator.kill()


@pytest.fixture
def cluster(tmp_path: Path, mosquitto: MosquittoProcess, fake_nvml_lib: Path) -> Iterator[Cluster]:
    """Agents and aggregator, killed after the test."""
    made = Cluster(tmp_path, mosquitto, fake_nvml_lib)
    yield made
    made.kill_all()


async def _meter(probe: MqttProbe, topic: str, pct: float) -> None:
    meter = Meter(ts_ns=time.time_ns(), power_w=BUDGET_W * pct / 100.0)
    await probe.publish_raw(topic, encode(meter))


async def _meter_for(probe: MqttProbe, topic: str, pct: float, *, steps: int) -> None:
    """``steps`` meter readings at ``pct`` of the budget, 0.2 s apart."""
    for _ in range(steps):
        await _meter(probe, topic, pct)
        await asyncio.sleep(0.2)


@pytest.fixture
async def running(cluster: Cluster, mosquitto: MosquittoProcess) -> AsyncIterator[MqttProbe]:
    """Start everything; a probe feeds the row meter at 5 Hz from ``probe.meter_pct``."""
    async with mqtt_probe(mosquitto) as probe:
        for agent in cluster.agents.values():
            agent.start()
        cluster.aggregator.start()
        probe.meter_pct = 70.0

        async def feed() -> None:
            while True:
                await _meter(probe, cluster.aggregator.meter_topic, probe.meter_pct)
                await asyncio.sleep(0.2)

        task = asyncio.create_task(feed())
        try:
            await cluster.aggregator.wait_log("aggregator_warm", timeout_s=20)
            yield probe
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


def _reason_is(reason: str) -> Callable[[dict[str, Any]], bool]:
    return lambda entry: entry.get("reason") == reason


def _row_level(probe: MqttProbe) -> int | None:
    controls = [m for m in probe.of("control") if isinstance(m, Control) and m.scope == "row"]
    return controls[-1].level if controls else None


async def _until_level(probe: MqttProbe, level: int, timeout_s: float = 10) -> None:
    await wait_until(
        lambda: _row_level(probe) == level, timeout_s=timeout_s, what=f"row level {level}"
    )


async def test_rising_load_walks_t1_t2_and_back_with_hysteresis(
    cluster: Cluster, running: MqttProbe
) -> None:
    """Row power crossing 80% then 89% caps low then both classes; release steps back down."""
    probe = running
    await _until_level(probe, 0)
    assert all(v == 0 for locks in cluster.all_locks().values() for v in locks)

    probe.meter_pct = 85.0
    await _until_level(probe, 1)
    await wait_until(
        lambda: all(0 < cluster.locked_max(n, g) <= 1275 for n in cluster.nodes for g in LOW),
        what="T1 low caps",
    )
    assert all(cluster.locked_max(n, g) == 0 for n in cluster.nodes for g in HIGH)

    probe.meter_pct = 92.0
    await _until_level(probe, 2)
    await wait_until(
        lambda: all(0 < cluster.locked_max(n, g) <= 1110 for n in cluster.nodes for g in LOW),
        what="T2 low caps",
    )
    await wait_until(
        lambda: all(1110 < cluster.locked_max(n, g) <= 1305 for n in cluster.nodes for g in HIGH),
        what="T2 high caps",
    )

    # 86% is inside the hysteresis band of T2 (89 - 5 = 84): T2 holds beyond the dwell.
    probe.meter_pct = 86.0
    await asyncio.sleep(2.5)
    assert _row_level(probe) == 2

    # Below 84% for the dwell: one level at a time, T2 -> T1 -> nominal.
    probe.meter_pct = 70.0
    await _until_level(probe, 1)
    await _until_level(probe, 0)
    levels = [m.level for m in probe.of("control") if isinstance(m, Control) and m.scope == "row"]
    drop = levels[levels.index(2) :]
    assert drop == sorted(drop, reverse=True)
    assert 1 in drop  # never 2 -> 0 directly
    await wait_until(
        lambda: all(v == 0 for locks in cluster.all_locks().values() for v in locks),
        what="all locks released",
    )
    audit = await cluster.aggregator.wait_log(
        "level_changed", where=lambda e: e.get("new_level") == 2
    )
    assert audit["power_pct"] >= 89
    assert audit["previous_level"] == 1


async def test_aggregator_killed_agents_fail_safe_then_restart_resumes_without_uncap(
    cluster: Cluster, running: MqttProbe
) -> None:
    """Lease expiry brings fail-safe caps; a restarted aggregator picks up at the same level."""
    probe = running
    probe.meter_pct = 92.0
    await _until_level(probe, 2)
    await wait_until(
        lambda: all(0 < cluster.locked_max(n, g) <= 1110 for n in cluster.nodes for g in LOW),
        what="T2 low caps",
    )
    cluster.aggregator.kill()
    for agent in cluster.agents.values():
        await agent.wait_log("fail_safe_entered", timeout_s=15)

    restarted_at = len(probe.of("control"))
    probe.meter_pct = 86.0
    cluster.aggregator.start()
    await cluster.aggregator.wait_log("control_seeded", where=lambda e: e.get("seeded_level") == 2)
    await wait_until(lambda: len(probe.of("control")) > restarted_at + 5, what="new control")
    after = [m for m in probe.of("control")[restarted_at:] if isinstance(m, Control)]
    assert after
    assert all(m.level == 2 for m in after if m.scope == "row"), [m.level for m in after]
    for agent in cluster.agents.values():
        await agent.wait_log("fail_safe_left", timeout_s=10)


async def test_stale_and_offline_nodes_count_conservatively(
    cluster: Cluster, mosquitto: MosquittoProcess
) -> None:
    """Without a meter, a node whose agent died counts at its GPU limits plus non-GPU power."""
    cluster.aggregator = cluster.new_aggregator(meter=False)
    async with mqtt_probe(mosquitto) as probe:
        for agent in cluster.agents.values():
            agent.start()
        cluster.aggregator.start()
        await cluster.aggregator.wait_log("aggregator_warm", timeout_s=20)

        def summary() -> RowSummary | None:
            rows = [m for m in probe.of("summary") if isinstance(m, RowSummary)]
            return rows[-1] if rows else None

        await wait_until(
            lambda: (s := summary()) is not None and not s.offline_nodes,
            what="both nodes reporting",
        )
        first = summary()
        assert first is not None
        fresh_w = first.power_w
        cluster.agents["node2"].kill()  # no clean stop: the Last Will says offline
        await wait_until(
            lambda: (s := summary()) is not None and "node2" in s.offline_nodes,
            timeout_s=15,
            what="node2 offline",
        )
        now = summary()
        assert now is not None
        # node2: 8 x 400 W enforced limits + 500 W non-GPU = 3700 W, at least its fresh share.
        rack2 = next(r for r in now.racks if r.rack == "rack2")
        assert rack2.power_w == pytest.approx(8 * 400 + 500)
        assert rack2.nodes_offline == 1
        assert now.power_w >= fresh_w - 1e-6 or now.power_w > 3700
        statuses = [m for m in probe.of("status") if isinstance(m, Status) and m.node == "node2"]
        assert statuses[-1].state == "offline"


async def test_bad_payloads_are_counted_and_ignored(cluster: Cluster, running: MqttProbe) -> None:
    """Malformed, oversized, wrong-version and out-of-topology messages are dropped and
    counted. Node topics outside the topology never even arrive: the aggregator subscribes
    to each node of its rows where it is, not to wildcards."""
    probe = running
    base = f"polca/v1/{SITE}/{ROW}"
    await probe.publish_raw(f"{base}/rack9/intruder/telemetry", b"{}")
    await probe.publish_raw(f"{base}/rack2/node1/status", b"{}")  # node1 is not in rack2
    await probe.publish_raw(f"{base}/rack1/node1/telemetry", b"\x00not json")
    await probe.publish_raw(f"{base}/rack1/node1/telemetry", b'{"schema_version": 7}')
    await probe.publish_raw(f"{base}/rack1/node1/telemetry", b"[" * 300_000)
    await probe.publish_raw(f"{base}/rack9/control", b"{}")  # a rack the row does not have
    await probe.publish_raw(f"{base}/control", json.dumps({"kind": "control"}).encode())
    for reason in ("malformed", "schema_version", "oversized", "topology"):
        await cluster.aggregator.wait_log("message_dropped", where=_reason_is(reason))
    topics = [
        e.get("topic", "") for e in cluster.aggregator.logs() if e["event"] == "message_dropped"
    ]
    assert not any("intruder" in t or "rack2/node1" in t for t in topics)
    # Still controlling: the row keeps publishing fresh control at level 0.
    count = len(probe.of("control"))
    await wait_until(lambda: len(probe.of("control")) > count + 3, what="control continues")
    assert _row_level(probe) == 0
    assert cluster.aggregator.process is not None
    assert cluster.aggregator.process.poll() is None


async def test_policy_edit_reaches_agents_and_invalid_edit_never_does(
    cluster: Cluster, running: MqttProbe
) -> None:
    """A valid edit of the aggregator's policy reaches every agent; an invalid one none."""
    probe = running

    def agent_revisions() -> set[str | None]:
        latest: dict[str, str | None] = {}
        for message in probe.of("status"):
            if isinstance(message, Status) and message.node in cluster.agents:
                latest[message.node] = message.policy_revision
        return set(latest.values())

    start = await cluster.aggregator.wait_log("aggregator_started")
    for agent in cluster.agents.values():
        copy = agent.state_dir / "policy.remote.yaml"
        await wait_until(copy.exists, what=f"{agent.node} keeps the aggregator's policy")
    path = cluster.aggregator.policy_path
    good = path.read_text(encoding="utf-8")
    path.write_text(good.replace("threshold_pct: 89", "threshold_pct: 60"), encoding="utf-8")
    await cluster.aggregator.wait_log("policy_rejected")
    await asyncio.sleep(1.0)
    for agent in cluster.agents.values():
        assert not any(e.get("event") == "policy_rejected" for e in agent.logs())
    assert agent_revisions() == {start["revision"]}

    path.write_text(
        good.replace("low: {sm_clock_max_mhz: 1275}", "low: {sm_clock_max_mhz: 1200}"),
        encoding="utf-8",
    )
    reloaded = await cluster.aggregator.wait_log("policy_reloaded")
    new_revision = reloaded["revision"]
    assert new_revision != start["revision"]
    await wait_until(
        lambda: agent_revisions() == {new_revision}, timeout_s=10, what="agents on the new revision"
    )
    for agent in cluster.agents.values():
        assert (agent.state_dir / "policy.remote.yaml").read_text(encoding="utf-8").count("1200")
    probe.meter_pct = 85.0
    await wait_until(
        lambda: all(0 < cluster.locked_max(n, g) <= 1200 for n in cluster.nodes for g in LOW),
        what="new T1 cap applied",
    )
    assert cluster.aggregator.stop() == 0
    for agent in cluster.agents.values():
        agent.signal(signal.SIGTERM)
        assert agent.wait() == 0


async def test_status_command_and_history_in_victoria_metrics(
    cluster: Cluster, mosquitto: MosquittoProcess, victoria_metrics: VictoriaMetricsProcess
) -> None:
    """`polca status` shows the row, racks and nodes; the aggregator's points reach the TSDB."""
    cluster.aggregator = cluster.new_aggregator(
        extra={"influx": {"url": victoria_metrics.url, "api": "v2", "flush_interval_s": 0.5}}
    )
    async with mqtt_probe(mosquitto) as probe:
        await cluster.start_at_t1(probe, meter_steps=15)
        # The meter keeps reading 85% while polca status runs: with this policy's 1 s dwell,
        # a meter gone stale would release T1 before a slow start of the command read it.
        feeder = asyncio.create_task(
            _meter_for(probe, cluster.aggregator.meter_topic, 85.0, steps=10_000)
        )
        try:
            result = await polca_status(mosquitto)
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"{SITE}/{ROW}" in out
    assert "T1" in out, out
    assert "rack rack1" in out
    assert "rack rack2" in out
    assert f"{SITE}/{ROW}/rack1/node1" in out
    assert "online" in out

    def stored(name: str) -> int:
        victoria_metrics.flush()
        return victoria_metrics.count(f'{{__name__="{name}"}}')

    await wait_until(lambda: stored("row_power_w") > 0, timeout_s=15, what="row points")
    assert stored("node_power_w") > 0
    assert stored("gpu_power_w") > 0
    assert stored("control_level") > 0


async def test_observe_mode_decides_but_agents_do_not_apply(
    cluster: Cluster, mosquitto: MosquittoProcess
) -> None:
    """Shadow mode: control is published (marked observe) and logged; no GPU is capped."""
    cluster.aggregator = cluster.new_aggregator(extra={"control": {"observe": True}})
    async with mqtt_probe(mosquitto) as probe:
        for agent in cluster.agents.values():
            agent.start()
        cluster.aggregator.start()
        await cluster.aggregator.wait_log("aggregator_warm", timeout_s=20)
        for _ in range(10):
            await _meter(probe, cluster.aggregator.meter_topic, 92.0)
            await asyncio.sleep(0.2)
        await _until_level(probe, 2)
        controls = [m for m in probe.of("control") if isinstance(m, Control)]
        assert controls[-1].observe
        for agent in cluster.agents.values():
            await agent.wait_log("control_observed")
        assert all(v == 0 for locks in cluster.all_locks().values() for v in locks)


def _without_brake(text: str) -> str:
    start = text.index("  - name: brake")
    end = text.index("\n\n", start)
    return text[:start] + text[end:]


async def test_policy_edit_removing_the_top_level_while_at_it_and_a_restart(
    cluster: Cluster, running: MqttProbe
) -> None:
    """At the brake, a reload without it clamps to T2; so does a restart seeded at the brake."""
    probe = running
    full = cluster.aggregator.policy_path.read_text(encoding="utf-8")
    assert "name: brake" in full
    probe.meter_pct = 99.0
    await _until_level(probe, 3)
    # (a) a live reload that removes the level in force
    cluster.aggregator.policy_path.write_text(_without_brake(full), encoding="utf-8")
    await cluster.aggregator.wait_log("policy_reloaded")
    await _until_level(probe, 2)
    await wait_until(
        lambda: all(0 < cluster.locked_max(n, g) <= 1110 for n in cluster.nodes for g in LOW),
        what="T2 low caps after the reload",
    )
    # (b) back to the brake, killed there; the retained control says 3; edited; restarted
    cluster.aggregator.policy_path.write_text(full, encoding="utf-8")
    await wait_until(
        lambda: sum(e["event"] == "policy_reloaded" for e in cluster.aggregator.logs()) >= 2,
        what="the full policy reloaded",
    )
    await _until_level(probe, 3)
    cluster.aggregator.kill()
    cluster.aggregator.policy_path.write_text(_without_brake(full), encoding="utf-8")
    seen = len(probe.of("control"))
    cluster.aggregator.start()
    seeded = await cluster.aggregator.wait_log(
        "control_seeded", where=lambda e: e.get("retained_level") == 3
    )
    assert seeded["seeded_level"] == 2
    await wait_until(lambda: len(probe.of("control")) > seen + 5, what="control after restart")
    assert _row_level(probe) == 2
    assert cluster.aggregator.process is not None
    assert cluster.aggregator.process.poll() is None
    assert not [e for e in cluster.aggregator.logs() if e["event"] == "task_failed"]
