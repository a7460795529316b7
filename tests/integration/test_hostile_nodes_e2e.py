"""One node cannot take down, brake or starve its row: real processes, the shipped ACL.

A real Mosquitto runs deploy/mosquitto's configuration, pattern ACL and users
(``tests/deploy/mosquitto_rig.py``); a real ``polca aggregator`` (user
``polca-aggregator``) controls a row of two nodes: node1, an honest agent on eight fake
A100s (user ``node1``), and node2, whose topics the test writes with node2's own
credentials, which the ACL confines to node2's topics. The scheduler's, the meter's and
the aggregator's credentials are borrowed the same way for the messages only those roles
may send; the test watches as ``polca-viewer``.

node2 claims 1e7 W and 9e6 W, lists 1,024 GPUs at 9 kW limits and then goes offline,
floods telemetry at thousands of messages a second, flaps its status 2,000 times; the
scheduler flips two GPUs' classes 200 times and names GPUs node1 lacks; invalid policy
bundles arrive 100 times; a control with term 2**62 arrives under the aggregator's name.
In each case the aggregator stays up (no ``control_step_failed``), node1 stays at the
level its own load calls for (the budget leaves node1's load plus node2's plausible
bound under the first threshold: nominal, no cap written), never falls to fail-safe, and
every anomaly is counted by reason in the aggregator's ``/metrics`` or the daemons' logs.
The same scenarios run in one process in ``tests/test_hostile_nodes.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from polca.policy.loader import revision_of
from polca.telemetry.schema import (
    MAX_PAYLOAD_BYTES,
    Assignment,
    Control,
    Event,
    GpuTelemetry,
    Meter,
    PolicyBundle,
    RowSummary,
    Status,
    Telemetry,
    decode,
    encode,
)
from tests.deploy import mosquitto_rig
from tests.fake_nvml import FakeNvml
from tests.integration.aggregator_rig import AggregatorProcess
from tests.integration.rig import A100_POLICY, ROW, SITE, AgentProcess, wait_until
from tests.mqtt_broker import MosquittoProcess
from tests.services import free_port, http_request

HONEST, LIAR = "node1", "node2"
BASE = f"polca/v1/{SITE}/{ROW}"
HONEST_TOPIC = f"{BASE}/rack1/{HONEST}"
LIAR_TOPIC = f"{BASE}/rack2/{LIAR}"  # node2 alone in rack2: rack2's power is node2's
SUMMARY_TOPIC = f"{BASE}/summary"
CONTROL_TOPIC = f"{BASE}/control"
USERS = (HONEST, LIAR, "polca-aggregator", "polca-scheduler", "polca-viewer", "meter")

NON_GPU_W = 500.0  # the aggregator rig's non_gpu_w of every node
BUDGET_W = 40_000.0
"""T1 is at 32 kW: node1 (8 x 200 W + 500 W) plus node2's largest plausible bound
(8 x 500 W x 1.25 + 500 W, undeclared: its A100s' published limit) is 7.6 kW, so nominal
is the right level; one node counted at what it claims (9 MW, 9.2 MW of limits) would
brake the row."""
DECLARED = {"gpus": 8, "gpu_max_power_w": 400.0}
DECLARED_BOUND_W = 8 * 400.0 * 1.25 + NON_GPU_W
"""The most node2, declared with 8 GPUs of at most 400 W, is ever counted at."""
UNDECLARED_BOUND_W = 8 * 500.0 * 1.25 + NON_GPU_W
"""Undeclared: its first telemetry's 8 GPUs at the published maximum of the product they
name (an A100-SXM4-80GB: 500 W, polca.gpu.products), whatever limit they declare."""
INTERVAL_S = 0.5
"""The aggregator's control interval."""
GAP_BOUND_S = 2 * INTERVAL_S + 1.0
"""The longest gap between two control messages the probe may see (a busy machine)."""
T1_LOCK_MHZ = 1275  # the A100 policy's low-priority lock at T1
PLAIN_LIMIT_MW = 400_000  # the fake A100's power limit, never lowered at nominal


@dataclass
class Seen:
    """One message the viewer received, with its monotonic time of receipt."""

    topic: str
    payload: bytes
    retained: bool
    at_s: float


@dataclass
class Viewer:
    """The test's eyes: ``polca-viewer`` subscribed to the row summary, control and events."""

    client: aiomqtt.Client
    seen: list[Seen] = field(default_factory=list)

    async def pump(self) -> None:
        """Record every message until cancelled."""
        async for message in self.client.messages:
            payload = bytes(message.payload)
            self.seen.append(Seen(str(message.topic), payload, message.retain, time.monotonic()))

    def live(self, topic: str, since: int = 0) -> list[Seen]:
        """Non-retained messages on ``topic`` from index ``since`` of ``seen``."""
        return [s for s in self.seen[since:] if s.topic == topic and not s.retained and s.payload]

    def summaries(self, since: int = 0) -> list[RowSummary]:
        """The row summaries published live since ``since``."""
        return [decode(s.payload, RowSummary) for s in self.live(SUMMARY_TOPIC, since)]

    def controls(self, since: int = 0) -> list[tuple[float, Control]]:
        """The row control messages published live since ``since``, with receipt times."""
        return [(s.at_s, decode(s.payload, Control)) for s in self.live(CONTROL_TOPIC, since)]

    def events(self, node_topic: str, name: str, since: int = 0) -> list[Event]:
        """A node's events called ``name`` since ``since``."""
        events = [decode(s.payload, Event) for s in self.live(f"{node_topic}/events", since)]
        return [e for e in events if e.event == name]


@dataclass
class Row:
    """The row under test: broker, both daemons, the viewer and the users' passwords."""

    broker: MosquittoProcess
    passwords: dict[str, str]
    agent: AgentProcess
    aggregator: AggregatorProcess
    fake: FakeNvml
    viewer: Viewer
    metrics_port: int
    start: int = 0
    """Index in ``viewer.seen`` once the row runs: what the checks look at."""

    def client(self, user: str) -> contextlib.AbstractAsyncContextManager[aiomqtt.Client]:
        """An MQTT client logged in as ``user``."""
        return mosquitto_rig.connected(self.broker, user, self.passwords[user])

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the aggregator's ``/metrics`` samples ``name`` with ``labels`` (0: none)."""
        status, body = http_request("GET", f"http://127.0.0.1:{self.metrics_port}/metrics")
        assert status == 200, body[:200]
        return sum(
            sample.value
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    async def wait_metric(
        self,
        name: str,
        predicate: Callable[[float], bool],
        *,
        timeout_s: float = 20.0,
        **labels: str,
    ) -> float:
        """The metric's value once ``predicate`` holds for it, polling ``/metrics``."""
        deadline = time.monotonic() + timeout_s
        value = 0.0
        while time.monotonic() < deadline:
            value = await asyncio.to_thread(self.metric, name, **labels)
            if predicate(value):
                return value
            await asyncio.sleep(0.1)
        msg = f"{name}{labels} is {value} after {timeout_s} s"
        raise AssertionError(msg)

    async def wait_summary(
        self, predicate: Callable[[RowSummary], bool], *, since: int, timeout_s: float = 20.0
    ) -> RowSummary:
        """The first live row summary after index ``since`` satisfying ``predicate``."""
        found: list[RowSummary] = []

        def seen() -> bool:
            found[:] = [s for s in self.viewer.summaries(since) if predicate(s)]
            return bool(found)

        await wait_until(seen, timeout_s=timeout_s, what="a matching row summary")
        return found[0]

    async def more_summaries(self, count: int, *, timeout_s: float = 20.0) -> None:
        """Wait for ``count`` more live summaries (a few control steps)."""
        mark = len(self.viewer.seen)
        await wait_until(
            lambda: len(self.viewer.summaries(mark)) >= count,
            timeout_s=timeout_s,
            what=f"{count} more row summaries",
        )

    def logs(self, process: AgentProcess | AggregatorProcess, event: str) -> list[dict[str, Any]]:
        """The process's log lines of ``event``."""
        return [e for e in process.logs() if e.get("event") == event]

    def rejected(self, reason: str) -> list[dict[str, Any]]:
        """The agent's ``message_rejected`` lines of ``reason``."""
        return [e for e in self.logs(self.agent, "message_rejected") if e["reason"] == reason]

    def locks(self) -> list[int]:
        """Each fake GPU's locked SM clock ceiling (0: not locked)."""
        return [int(self.fake.get(g)["locked_max_mhz"] or 0) for g in range(8)]  # type: ignore[arg-type]

    def alive(self) -> bool:
        """Both daemons still run."""
        return all(
            p.process is not None and p.process.poll() is None
            for p in (self.agent, self.aggregator)
        )

    def check_daemons(self) -> None:
        """Both up; no failed control step or message; node1 never at fail-safe."""
        assert self.alive(), self.aggregator.log_text()[-3000:] + self.agent.log_text()[-3000:]
        assert not self.logs(self.aggregator, "control_step_failed")
        assert not self.logs(self.aggregator, "task_failed")
        assert not self.logs(self.agent, "fail_safe_entered")
        dropped = self.logs(self.aggregator, "message_dropped")
        assert not [e for e in dropped if e["reason"] == "internal"]
        assert not self.rejected("internal")

    async def check_nominal(self) -> None:
        """The row stayed nominal and node1 fresh; node1's GPUs were never capped.

        Waits for two more summaries first, so the last input has been through a step.
        """
        await self.more_summaries(2)
        self.check_daemons()
        summaries = self.viewer.summaries(self.start)
        assert summaries
        assert {s.level for s in summaries} == {0}
        assert all(HONEST not in s.stale_nodes + s.offline_nodes for s in summaries)
        real = [c for _, c in self.viewer.controls(self.start) if c.term == 0]
        assert real
        assert {c.level for c in real} == {0}
        assert not self.logs(self.agent, "cap_applied")
        assert self.locks() == [0] * 8
        assert [self.fake.get(g)["power_limit_mw"] for g in range(8)] == [PLAIN_LIMIT_MW] * 8


def _rack_w(summary: RowSummary, rack: str) -> float:
    return next(r.power_w for r in summary.racks if r.rack == rack)


def _telemetry(
    seq: int,
    node_w: float,
    *,
    gpus: int = 8,
    limit_max_w: float | None = None,
    node: str = LIAR,
) -> bytes:
    """Schema-valid telemetry of ``node`` claiming ``node_w`` of GPU power."""
    return encode(
        Telemetry(
            ts_ns=time.time_ns(),
            seq=seq,
            node=node,
            interval_s=INTERVAL_S,
            node_gpu_power_w=node_w,
            node_energy_delta_j=min(node_w * INTERVAL_S, 1e12),
            gpus=tuple(
                GpuTelemetry(
                    index=i,
                    uuid=f"GPU-{node}-{i}",
                    name="NVIDIA A100-SXM4-80GB",
                    power_mean_w=min(node_w / gpus, 1e7),
                    power_limit_w=400.0,
                    enforced_power_limit_w=400.0,
                    power_limit_max_w=limit_max_w,
                )
                for i in range(gpus)
            ),
        )
    )


def _many_gpus(limit_w: float = 9000.0) -> tuple[bytes, int]:
    """Telemetry listing as many GPUs (of 1,024) at ``limit_w`` as fit the payload bound.

    Each GPU draws 8 kW, and only the fields that say so are sent (the wire's optional
    fields may be left out), so that many fit.
    """
    count = 1024
    while True:
        gpus = [
            {
                "index": i,
                "uuid": f"GPU-{i}",
                "name": "NVIDIA A100-SXM4-80GB",
                "power_mean_w": 8000.0,
                "power_limit_w": limit_w,
                "enforced_power_limit_w": limit_w,
            }
            for i in range(count)
        ]
        message = {
            "schema_version": 1,
            "ts_ns": time.time_ns(),
            "kind": "telemetry",
            "seq": 1,
            "node": LIAR,
            "interval_s": INTERVAL_S,
            "node_gpu_power_w": 8000.0 * count,
            "node_energy_delta_j": 0.0,
            "gpus": gpus,
        }
        payload = json.dumps(message, separators=(",", ":")).encode()
        if len(payload) <= MAX_PAYLOAD_BYTES:
            decode(payload, Telemetry)  # schema-valid: only the aggregator's bounds refuse it
            return payload, count
        count -= 16


def _policy(tmp_path: Path) -> Path:
    """The A100 policy without its trend brake.

    Node2's first plausible reading is a jump of up to 14.5 kW in one interval, which the
    trend rule would rightly brake on (and a meter jumping to 85% too); the thresholds are
    what these tests are about.
    """
    text = A100_POLICY.read_text(encoding="utf-8")
    start = text.index("trend:")
    end = text.index("\n", text.index("reaction_s", start)) + 1
    text = text[:start] + text[end:]
    assert "trend:" not in text
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@contextlib.asynccontextmanager
async def _row(
    tmp_path: Path,
    fake: FakeNvml,
    *,
    liar: dict[str, Any] | None = None,
    control: dict[str, Any] | None = None,
    budget_w: float = BUDGET_W,
    protocol: str = "3.1.1",
) -> AsyncIterator[Row]:
    """The deploy broker, node1's agent and the aggregator, running and nominal.

    ``liar``: node2's topology fields (``DECLARED`` by default); ``control``: more
    aggregator control settings; ``protocol``: the aggregator's MQTT version.
    """
    with mosquitto_rig.brokers(tmp_path) as start_broker:
        passwords = mosquitto_rig.make_passwords(tmp_path, USERS)
        broker = start_broker(acl=mosquitto_rig.PATTERN_ACL, password_file=tmp_path / "passwd")

        def login(user: str) -> dict[str, Any]:
            return {"username": user, "password_file": str(tmp_path / "secrets" / f"{user}.pass")}

        policy = _policy(tmp_path)
        agent = AgentProcess(
            tmp_path / "agent",
            fake=fake,
            broker=broker,
            policy=policy,
            startup_grace_s=30,
            extra={"mqtt": login(HONEST), "agent": {"control_issuers": ["agg1"]}},
        )
        port = free_port()
        aggregator = AggregatorProcess(
            tmp_path / "aggregator",
            broker=broker,
            policy=policy,
            racks={"rack1": [HONEST], "rack2": [LIAR]},
            budget_w=budget_w,
            interval_s=INTERVAL_S,
            node_fields={LIAR: DECLARED if liar is None else liar},
            extra={
                "mqtt": {**login("polca-aggregator"), "protocol": protocol},
                "metrics": {"address": f"127.0.0.1:{port}"},
                "control": control or {},
            },
        )
        async with mosquitto_rig.connected(
            broker, "polca-viewer", passwords["polca-viewer"]
        ) as client:
            for topic in (SUMMARY_TOPIC, CONTROL_TOPIC, f"{HONEST_TOPIC}/events"):
                await client.subscribe(topic, qos=1)
            viewer = Viewer(client)
            pump = asyncio.create_task(viewer.pump())
            row = Row(broker, passwords, agent, aggregator, fake, viewer, port)
            try:
                aggregator.start()
                agent.start()
                await row.wait_summary(
                    lambda s: HONEST not in s.stale_nodes + s.offline_nodes,
                    since=0,
                    timeout_s=60,
                )
                await agent.wait_log("control_accepted", timeout_s=30)
                row.start = len(viewer.seen)
                yield row
            finally:
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
                agent.kill()
                aggregator.kill()


async def _feed_meter(client: aiomqtt.Client, pct: float) -> None:
    """Row meter readings at ``pct`` of the budget, every 0.2 s, until cancelled."""
    while True:
        reading = Meter(ts_ns=time.time_ns(), power_w=BUDGET_W * pct / 100)
        await client.publish(f"{BASE}/meter", encode(reading), qos=0)
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def _meter_at(row: Row, pct: float) -> AsyncIterator[None]:
    """The row meter (user ``meter``) reading ``pct`` of the budget while inside."""
    async with row.client("meter") as meter:
        feeder = asyncio.create_task(_feed_meter(meter, pct))
        try:
            yield
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)


@pytest.mark.parametrize(
    ("claim_w", "declared"),
    [(1e7, True), (9e6, False)],
    ids=["1e7W-declared-node", "9e6W-undeclared-node"],
)
async def test_a_node_claiming_megawatts_is_counted_at_its_bound(
    tmp_path: Path, a100_node: FakeNvml, claim_w: float, declared: bool
) -> None:
    """Megawatt claims every 0.5 s: counted at the liar's bound, flagged, the row nominal."""
    bound_w = DECLARED_BOUND_W if declared else UNDECLARED_BOUND_W
    async with _row(tmp_path, a100_node, liar=DECLARED if declared else {}) as row:
        async with row.client(LIAR) as liar:
            for seq in range(1, 9):  # 4 s of lies at the agent's publish interval
                payload = _telemetry(seq, claim_w, limit_max_w=1e7)
                await liar.publish(f"{LIAR_TOPIC}/telemetry", payload, qos=1)
                await asyncio.sleep(0.5)
        flagged = await row.wait_summary(lambda s: LIAR in s.implausible_nodes, since=row.start)
        assert flagged.level == 0
        line = await row.aggregator.wait_log("telemetry_implausible")
        assert (line["node"], line["reasons"]) == (LIAR, ["power"])
        assert line["gpu_bound_w"] == pytest.approx(bound_w - NON_GPU_W)
        assert len(row.logs(row.aggregator, "telemetry_implausible")) == 1  # once a minute
        counted = await row.wait_metric(
            "polca_aggregator_implausible_telemetry_total", lambda v: v >= 8, reason="power"
        )
        assert counted == 8
        assert row.metric("polca_node_implausible_readings_total", node=LIAR) == 8
        assert row.metric("polca_node_implausible", node=LIAR) == 1
        await row.more_summaries(2)
        liar_w = [_rack_w(s, "rack2") for s in row.viewer.summaries(row.start)]
        assert max(liar_w) == pytest.approx(bound_w)  # counted, at its bound
        await row.check_nominal()


async def test_a_thousand_gpus_at_9kw_then_offline_count_at_the_declared_bound(
    tmp_path: Path, a100_node: FakeNvml
) -> None:
    """1,024 GPUs at 9 kW limits, then a retained offline: node2 counts at its declared bound."""
    async with _row(tmp_path, a100_node) as row:
        payload, count = _many_gpus()
        assert count == 1024
        async with row.client(LIAR) as liar:
            await liar.publish(f"{LIAR_TOPIC}/telemetry", payload, qos=1)
            await row.wait_summary(lambda s: LIAR in s.implausible_nodes, since=row.start)
            offline = Status(ts_ns=time.time_ns(), state="offline", node=LIAR, reason="lie")
            mark = len(row.viewer.seen)
            await liar.publish(f"{LIAR_TOPIC}/status", encode(offline), qos=1, retain=True)
        await row.wait_summary(lambda s: LIAR in s.offline_nodes, since=mark)
        await row.more_summaries(4)
        after = row.viewer.summaries(mark)
        assert max(_rack_w(s, "rack2") for s in after if LIAR in s.offline_nodes) == (
            pytest.approx(DECLARED_BOUND_W)
        )
        assert max(_rack_w(s, "rack2") for s in row.viewer.summaries(row.start)) <= (
            DECLARED_BOUND_W + 1e-6
        )
        for reason in ("gpu_list", "power"):
            await row.wait_metric(
                "polca_aggregator_implausible_telemetry_total", lambda v: v == 1, reason=reason
            )
        assert row.metric("polca_node_power_watts", node=LIAR) <= DECLARED_BOUND_W + 1e-6
        line = await row.aggregator.wait_log("telemetry_implausible")
        assert (line["gpus_listed"], line["gpus_allowed"]) == (1024, 8)
        await row.aggregator.wait_log("node_offline", where=lambda e: e["node"] == LIAR)
        await row.check_nominal()


FLOOD = r"""
import sys, threading, time
import paho.mqtt.client as mqtt

host, port, user, secret, topic, payload_file, seconds, rate = sys.argv[1:9]
payload = open(payload_file, "rb").read()
password = open(secret, encoding="utf-8").read().splitlines()[0]
connected = threading.Event()
client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="flood-" + user)
client.username_pw_set(user, password)
client.on_connect = lambda c, u, flags, rc, props: rc == 0 and connected.set()
client.connect(host, int(port), keepalive=30)
client.loop_start()
if not connected.wait(10):
    sys.exit("not connected")
sent, start = 0, time.monotonic()
while (now := time.monotonic()) < start + float(seconds):
    while sent < int((now - start) * float(rate)):
        client.publish(topic, payload, qos=0)
        sent += 1
    time.sleep(0.002)
client.disconnect()
client.loop_stop()
print(sent)
"""


async def test_a_telemetry_flood_starves_neither_the_honest_node_nor_control(
    tmp_path: Path, a100_node: FakeNvml
) -> None:
    """Thousands of telemetry messages a second from node2: node1 stays fresh, control flows."""
    async with _row(tmp_path, a100_node) as row:
        payload_file = tmp_path / "flood.json"
        payload_file.write_bytes(_telemetry(1, 800.0))
        flood = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            FLOOD,
            row.broker.host,
            str(row.broker.port),
            LIAR,
            str(tmp_path / "secrets" / f"{LIAR}.pass"),
            f"{LIAR_TOPIC}/telemetry",
            str(payload_file),
            "5",
            "3000",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(flood.communicate(), timeout=60)
        assert flood.returncode == 0, err.decode()
        sent = int(out)
        assert sent >= 10_000  # thousands a second for 5 s
        await row.more_summaries(4)
        limited = await row.wait_metric(
            "polca_aggregator_messages_dropped_total", lambda v: v >= 1000, reason="rate_limited"
        )
        assert limited <= sent
        assert row.metric("polca_node_messages_rate_limited_total", node=LIAR) >= 1000
        assert row.metric("polca_node_messages_rate_limited_total", node=HONEST) == 0
        drops = row.logs(row.aggregator, "message_dropped")
        assert any(e["reason"] == "rate_limited" for e in drops)
        # Past intake.quarantine_after refusals the liar got a connection of its own.
        assert [e["node"] for e in row.logs(row.aggregator, "node_quarantined")] == [LIAR]
        assert row.metric("polca_node_quarantined", node=LIAR) == 1
        assert row.metric("polca_node_quarantined", node=HONEST) == 0
        times = [at for at, _ in row.viewer.controls(row.start)]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert len(times) >= 10
        assert max(gaps) <= GAP_BOUND_S, gaps
        await row.check_nominal()


async def test_status_flaps_log_a_handful_of_offline_warnings(
    tmp_path: Path, a100_node: FakeNvml
) -> None:
    """2,000 offline/online flaps: every one counted, at most a couple of node_offline lines."""
    async with _row(tmp_path, a100_node) as row:
        before = await asyncio.to_thread(row.metric, "polca_aggregator_messages_total")
        async with row.client(LIAR) as liar:
            for batch in range(20):
                await asyncio.gather(
                    *(
                        liar.publish(
                            f"{LIAR_TOPIC}/status",
                            encode(
                                Status(
                                    ts_ns=time.time_ns(),
                                    state="offline" if i % 2 == 0 else "online",
                                    node=LIAR,
                                )
                            ),
                            qos=1,
                            retain=True,
                        )
                        for i in range(batch * 100, batch * 100 + 100)
                    )
                )
        await row.wait_metric("polca_aggregator_messages_total", lambda v: v >= before + 2000)
        limited = await row.wait_metric(
            "polca_node_messages_rate_limited_total", lambda v: v >= 1000, node=LIAR
        )
        assert limited <= 2000
        offline = row.logs(row.aggregator, "node_offline")
        assert 1 <= len(offline) <= 2, offline
        assert {e["node"] for e in offline} == {LIAR}
        await row.check_nominal()


async def test_assignment_flips_and_strange_gpus_cost_a_bounded_number_of_writes(
    tmp_path: Path, a100_node: FakeNvml
) -> None:
    """At T1, 200 class flips of GPUs 0-1 write each at most twice; strange GPUs are counted."""
    async with _row(tmp_path, a100_node) as row, _meter_at(row, 85.0):
        await wait_until(lambda: row.locks() == [T1_LOCK_MHZ] * 8, timeout_s=20, what="T1")
        strangers = {"GPU-00000000-dead-beef-0000-000000000000": "high", "42": "low"}
        uuid0 = str(a100_node.get(0)["uuid"])

        def assignment(seq: int, cls: str) -> bytes:
            classes = {uuid0: cls, "1": cls, **strangers}
            return encode(Assignment(ts_ns=time.time_ns(), seq=seq, classes=classes))

        topic = f"{HONEST_TOPIC}/assign"
        writes_before = len(row.logs(row.agent, "cap_applied"))
        async with row.client("polca-scheduler") as scheduler:
            await scheduler.publish(topic, assignment(1, "high"), qos=1, retain=True)
            await wait_until(lambda: row.locks()[:2] == [0, 0], timeout_s=20, what="GPUs 0-1 high")
            for flip in range(200):  # high, low, ..., low: the last asks for low
                cls = "high" if flip % 2 == 0 else "low"
                await scheduler.publish(topic, assignment(2 + flip, cls), qos=1, retain=True)
                await asyncio.sleep(0.01)
        await wait_until(
            lambda: row.locks() == [T1_LOCK_MHZ] * 8, timeout_s=20, what="the last flip applied"
        )
        writes = [
            e for e in row.logs(row.agent, "cap_applied")[writes_before:] if e["gpu"] in (0, 1)
        ]
        assert len(writes) <= 4, writes  # GPUs 0 and 1: high once, low once (the dwell)
        assert row.rejected("unknown_gpu")
        assert not row.rejected("unknown_class")
        await row.agent.wait_log("priority_change_deferred")
        row.check_daemons()
        assert {s.level for s in row.viewer.summaries(row.start)} <= {0, 1}


async def test_invalid_policy_bundles_sent_100_times_publish_few_events(
    tmp_path: Path, a100_node: FakeNvml
) -> None:
    """100 invalid policy bundles (50 distinct, 50 repeats): at most 2 policy_rejected events."""
    async with _row(tmp_path, a100_node) as row:
        async with row.client("polca-aggregator") as aggregator:
            for i in range(100):
                text = f"schema_version: 1\nname: broken\n# bundle {min(i, 49)}\n"
                bundle = PolicyBundle(
                    ts_ns=time.time_ns(),
                    name="broken",
                    revision=revision_of(text.encode()),
                    text=text,
                )
                await aggregator.publish(f"{BASE}/policy", encode(bundle), qos=1, retain=True)

        def handled() -> int:
            names = ("policy_rejected", "policy_rejected_suppressed", "policy_rejected_again")
            return sum(len(row.logs(row.agent, name)) for name in names)

        await wait_until(lambda: handled() == 100, timeout_s=30, what="100 bundles handled")
        assert len(row.logs(row.agent, "policy_rejected_again")) == 50
        rejected = row.logs(row.agent, "policy_rejected")
        assert 1 <= len(rejected) <= 2
        await wait_until(
            lambda: bool(row.viewer.events(HONEST_TOPIC, "policy_rejected", row.start)),
            what="a policy_rejected event",
        )
        assert len(row.viewer.events(HONEST_TOPIC, "policy_rejected", row.start)) == len(rejected)
        assert not row.logs(row.agent, "policy_reloaded")
        await row.check_nominal()


async def test_a_forged_control_term_is_refused_while_the_real_lease_lives(
    tmp_path: Path, a100_node: FakeNvml
) -> None:
    """A brake at term 2**62 under the aggregator's name is refused; the real level is followed."""
    async with _row(tmp_path, a100_node) as row:
        now = time.time_ns()
        forged = Control(
            ts_ns=now,
            scope="row",
            row=ROW,
            issuer="agg1",
            term=2**62,
            epoch_ns=now,
            seq=1,
            level=3,
            issued_ns=now,
            lease_expires_ns=now + 30 * 1_000_000_000,
        )
        async with row.client("polca-aggregator") as aggregator:
            await aggregator.publish(CONTROL_TOPIC, encode(forged), qos=1, retain=True)
        await row.agent.wait_log(
            "message_rejected", where=lambda e: e["reason"] == "control_term_jump"
        )
        await row.more_summaries(4)
        await row.check_nominal()
        # The real aggregator is still followed: a meter at 85% takes the row to T1.
        async with _meter_at(row, 85.0):
            await wait_until(lambda: row.locks() == [T1_LOCK_MHZ] * 8, timeout_s=20, what="T1")
        assert not row.rejected("control_fenced")
        brakes = [e for e in row.logs(row.agent, "cap_applied") if e["sm_clock_max_mhz"] == 288]
        assert not brakes
        row.check_daemons()


async def _feed_node2(client: aiomqtt.Client, gpu_w: float) -> None:
    """node2 (its own credentials) reporting ``gpu_w`` of GPU power every 0.5 s."""
    for seq in itertools.count(1):
        await client.publish(f"{LIAR_TOPIC}/telemetry", _telemetry(seq, gpu_w), qos=0)
        await asyncio.sleep(INTERVAL_S)


async def _feed_meter_w(client: aiomqtt.Client, power_w: float, *, retain: bool = False) -> None:
    while True:
        reading = Meter(ts_ns=time.time_ns(), power_w=power_w)
        await client.publish(f"{BASE}/meter", encode(reading), qos=0, retain=retain)
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
async def test_a_meter_reading_sent_retained_is_refused_live_under_mqtt5(
    tmp_path: Path, a100_node: FakeNvml, protocol: str
) -> None:
    """The row's meter (user ``meter``, the shipped ACL) publishes fresh readings at 85%
    of the budget, each one retained. With the aggregator on MQTT 5 (the shipped
    configurations) each arrives with its retain flag, is dropped as ``stale`` and the
    row stays at level 0 on its nodes' power; on 3.1.1 the broker clears the flag on live
    delivery and the same readings take the row to T1 (what MQTT 5 is there for)."""
    async with _row(tmp_path, a100_node, protocol=protocol) as row:
        async with row.client("meter") as meter:
            feeder = asyncio.create_task(_feed_meter_w(meter, BUDGET_W * 0.85, retain=True))
            try:
                if protocol == "5":
                    dropped = await row.wait_metric(
                        "polca_aggregator_messages_dropped_total", lambda v: v >= 10, reason="stale"
                    )
                    assert dropped >= 10
                    await row.more_summaries(4)
                    assert {s.level for s in row.viewer.summaries(row.start)} == {0}
                    assert {s.power_source for s in row.viewer.summaries(row.start)} == {"computed"}
                else:
                    await wait_until(
                        lambda: row.locks() == [T1_LOCK_MHZ] * 8, timeout_s=20, what="T1"
                    )
                    assert (
                        row.metric("polca_aggregator_messages_dropped_total", reason="stale") == 0
                    )
            finally:
                feeder.cancel()
                await asyncio.gather(feeder, return_exceptions=True)
            await meter.publish(f"{BASE}/meter", b"", qos=1, retain=True)
        row.check_daemons()


async def test_a_meter_reading_a_quarter_low_is_not_believed_nor_a_wild_one(
    tmp_path: Path, a100_node: FakeNvml
) -> None:
    """The row's meter (user ``meter``, through the shipped ACL) reads 4.4 kW while its
    nodes report 5.8 kW for the whole node (GPUs plus 500 W each): 69% by the meter, 91%
    by the nodes. Believing the meter (it is above 90% of the nodes' GPU power alone)
    would leave the row uncapped; the aggregator refuses it as under-reading and caps the
    row at T2 on its computed power, says why in the summary, the log and /metrics. Then
    a 10 MW reading (the row can draw 12.8 kW) brakes nothing."""
    budget_w = 6_400.0  # T1 5,120 W, T2 5,696 W, brake 6,272 W
    async with _row(tmp_path, a100_node, budget_w=budget_w) as row:
        async with row.client(LIAR) as node2, row.client("meter") as meter:
            tasks = [asyncio.create_task(_feed_node2(node2, 8 * 400.0))]
            tasks.append(asyncio.create_task(_feed_meter_w(meter, 4_400.0)))
            try:
                mark = len(row.viewer.seen)
                capped = await row.wait_summary(
                    lambda s: s.level >= 2 and "below the nodes' own power" in s.power_note,
                    since=mark,
                )
                assert capped.power_source == "computed"
                assert capped.power_w > 0.89 * budget_w
                await wait_until(lambda: row.locks() == [1110] * 8, timeout_s=20, what="T2")
                assert await row.wait_metric("polca_row_meter_trusted", lambda v: v == 0) == 0
                distrusted = row.logs(row.aggregator, "meter_distrusted")
                assert [e["reason"] for e in distrusted] == ["under_reading"]
                tasks.pop().cancel()
                tasks.append(asyncio.create_task(_feed_meter_w(meter, 1e7)))
                mark = len(row.viewer.seen)
                wild = await row.wait_summary(
                    lambda s: "above what the row can draw" in s.power_note, since=mark
                )
                assert wild.power_source == "computed"
                await row.more_summaries(6)
                assert {s.level for s in row.viewer.summaries(mark)} <= {2}
                assert 288 not in row.locks()
                reasons = [e["reason"] for e in row.logs(row.aggregator, "meter_distrusted")]
                assert reasons == ["under_reading", "implausible"]
                assert (
                    await row.wait_metric("polca_row_meter_refusals_total", lambda v: v >= 10) >= 10
                )
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        row.check_daemons()


async def test_a_forged_term_arriving_first_does_not_lock_the_real_controller_out(
    tmp_path: Path, a100_node: FakeNvml
) -> None:
    """With the aggregator stopped, a brake at term 2**63 - 1 (it needs the control topic's
    write permission) is left retained on the row's control topic; node1's agent restarts
    and sees it before anything else. It is refused (control_term_jump), never braked on,
    and the real aggregator, back, is followed at once: its first control is accepted."""
    async with _row(tmp_path, a100_node) as row:
        assert row.aggregator.stop() == 0
        now = time.time_ns()
        forged = Control(
            ts_ns=now,
            scope="row",
            row=ROW,
            issuer="agg1",
            term=2**63 - 1,
            epoch_ns=now,
            seq=1,
            level=3,
            issued_ns=now,
            lease_expires_ns=now + 300 * 1_000_000_000,
        )
        async with row.client("polca-aggregator") as aggregator:
            await aggregator.publish(CONTROL_TOPIC, encode(forged), qos=1, retain=True)
        refused = len(row.rejected("control_term_jump"))
        accepted = len(row.logs(row.agent, "control_accepted"))
        row.agent.kill()
        row.agent.start()
        await wait_until(
            lambda: len(row.rejected("control_term_jump")) > refused,
            timeout_s=30,
            what="the forged first control refused",
        )
        row.aggregator.start()
        await wait_until(
            lambda: len(row.logs(row.agent, "control_accepted")) > accepted,
            timeout_s=30,
            what="the real controller's control accepted",
        )
        followed = row.logs(row.agent, "control_accepted")[accepted:]
        assert {e["issuer"] for e in followed} == {"agg1"}
        assert all(e["control_level"] < 3 for e in followed)
        assert not row.rejected("control_fenced")
        assert 288 not in row.locks()
        brakes = [e for e in row.logs(row.agent, "cap_applied") if e["sm_clock_max_mhz"] == 288]
        assert not brakes
