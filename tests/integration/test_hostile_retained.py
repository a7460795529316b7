"""Hostile messages, retained on every topic the daemons subscribe to, against real processes.

A broker holds poison on each topic the agent and the aggregator subscribe to (an integer
of 5,000 digits, nesting 50,000 deep, a lone surrogate in an event, strings for numbers,
``true`` for the schema version, ``1e999``, a node speaking for another, a control with
an epoch of 2**62, the highest fencing term and a lease of 100 years, a 0 W meter
reading, a YAML alias bomb in a policy bundle whose revision matches). Both daemons start
on that broker, stay up, drop every poison with a reason, and still obey: a meter over T2
caps the agent's GPUs. Then the poison is published again, both restart, and the same
holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from polca.telemetry.schema import (
    Control,
    Event,
    GpuHealthReport,
    GpuTelemetry,
    Meter,
    PolicyBundle,
    Status,
    Telemetry,
    encode,
)
from tests.fake_nvml import FakeNvml
from tests.integration.aggregator_rig import AggregatorProcess
from tests.integration.rig import (
    A100_POLICY,
    ROW,
    SITE,
    AgentProcess,
    Broker,
    MqttProbe,
    mqtt_probe,
    wait_until,
)

BUDGET_W = 10_000.0
BASE = f"polca/v1/{SITE}/{ROW}"
S = 1_000_000_000
HIGH = (0, 1, 2, 3)
LOW = (4, 5, 6, 7)


def _policy(tmp_path: Path) -> Path:
    text = A100_POLICY.read_text(encoding="utf-8")
    text = text.replace("by_index: {}", "by_index: {0: high, 1: high, 2: high, 3: high}", 1)
    text = text.replace("on_stop: fail_safe", "on_stop: restore", 1)
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _alias_bomb() -> str:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    names = "abcdefghi"
    for prev, name in itertools.pairwise(names):
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    return "\n".join(lines) + "\n"


def _splice(message: bytes, field: str, raw: str) -> bytes:
    """``message`` with the JSON value of ``field`` (first occurrence) replaced by ``raw``."""
    data = json.loads(message)
    marker = "@@POISON@@"
    node = data
    path = field.split(".")
    for part in path[:-1]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[path[-1]] = marker
    return json.dumps(data).replace(json.dumps(marker), raw, 1).encode()


def poison() -> dict[str, bytes]:
    """One hostile retained payload per subscribed topic."""
    now = time.time_ns()
    telemetry = encode(
        Telemetry(
            ts_ns=now,
            seq=1,
            node="node1",
            interval_s=1,
            node_gpu_power_w=100.0,
            node_energy_delta_j=1,
            # A GPU with health counters, so that the nested counters can be poisoned too.
            gpus=(
                GpuTelemetry(
                    index=0,
                    uuid="GPU-0",
                    name="NVIDIA A100-SXM4-80GB",
                    health=GpuHealthReport(xid_errors=0, last_xid=0, pcie_replays=0),
                ),
            ),
        )
    )
    control = Control(
        ts_ns=now,
        scope="row",
        row=ROW,
        issuer="agg1",
        term=2**63 - 1,  # the highest fencing term there is
        epoch_ns=2**62,
        seq=2**63 - 1,
        level=0,
        issued_ns=now,
        lease_expires_ns=now + 100 * 365 * 86_400 * S,
    )
    bomb = _alias_bomb()
    bundle = PolicyBundle(
        ts_ns=now,
        name="bomb",
        revision=hashlib.sha256(bomb.encode()).hexdigest()[:12],
        text=bomb,
    )
    event = encode(Event(ts_ns=now, seq=1, node="node2", event="cap_changed", detail={"x": "y"}))
    status = json.loads(encode(Status(ts_ns=now, state="online", node="node2")))
    return {
        # What the agent subscribes to.
        f"{BASE}/control": encode(control),
        f"{BASE}/rack1/control": _splice(
            encode(control.model_copy(update={"scope": "rack", "rack": "rack1", "epoch_ns": 1})),
            "seq",
            "9" * 5000,
        ),
        f"{BASE}/policy": encode(bundle),
        f"{BASE}/rack1/node1/assign": (
            b'{"schema_version": 1, "kind": "assignment", "ts_ns": 1, "classes": '
            + b"[" * 50_000
            + b"]" * 50_000
            + b"}"
        ),
        # What the aggregator subscribes to.
        f"{BASE}/rack1/node1/telemetry": _splice(
            _splice(telemetry, "node_gpu_power_w", "1e999"),
            "gpus.0.health.pcie_replays",
            "1" + "0" * 40,  # far beyond int64
        ),
        f"{BASE}/rack1/node1/events": encode(
            Event(ts_ns=now, seq=1, node="node2", event="cap_changed")  # node2 speaking
        ),
        f"{BASE}/rack2/node2/telemetry": _splice(
            telemetry.replace(b'"node1"', b'"node2"'), "schema_version", "true"
        ),
        f"{BASE}/rack2/node2/status": json.dumps({**status, "gpu_count": "100"}).encode(),
        f"{BASE}/rack2/node2/events": _splice(event, "detail.x", '"\\ud800"'),
        f"{BASE}/rack2/control": encode(
            control.model_copy(update={"scope": "rack", "rack": "rack9", "epoch_ns": 1})
        ),
        f"{BASE}/meter": encode(Meter(ts_ns=now, power_w=0.0)),
        f"polca/v1/{SITE}/cooling/cdu1/telemetry": json.dumps(
            {
                "schema_version": 1,
                "kind": "cdu",
                "ts_ns": 2**62,
                "cdu": "cdu9",
                "loop": "loop1",
                "secondary": {"supply_temp_c": 1e308 * 10},
            }
        ).encode(),
    }


async def _publish_poison(probe: MqttProbe) -> None:
    for topic, payload in poison().items():
        await probe.publish_raw(topic, payload, retain=True)


def _locks(fake: FakeNvml) -> list[int]:
    return [int(fake.get(g)["locked_max_mhz"] or 0) for g in range(8)]  # type: ignore[arg-type]


def _at_t2(fake: FakeNvml) -> bool:
    locks = _locks(fake)
    return all(0 < locks[g] <= 1110 for g in LOW) and all(1110 < locks[g] <= 1305 for g in HIGH)


async def _feed_meter(probe: MqttProbe, pct: float) -> None:
    while True:
        meter = Meter(ts_ns=time.time_ns(), power_w=BUDGET_W * pct / 100)
        await probe.publish_raw(f"{BASE}/meter", encode(meter))
        await asyncio.sleep(0.2)


@pytest.fixture
async def probe(broker: Broker) -> AsyncIterator[MqttProbe]:
    """The test's client, poison published retained before any daemon starts."""
    async with mqtt_probe(broker) as client:
        await _publish_poison(client)
        yield client


def _stop(process: AgentProcess | AggregatorProcess) -> int:
    process.signal(signal.SIGTERM)
    return process.wait(timeout_s=20)


def _alive(*processes: AgentProcess | AggregatorProcess) -> bool:
    return all(p.process is not None and p.process.poll() is None for p in processes)


async def test_poison_retained_on_every_topic_kills_nothing_and_caps_still_apply(
    tmp_path: Path,
    broker: Broker,
    a100_node: FakeNvml,
    probe: MqttProbe,
) -> None:
    """Both daemons stay up on a poisoned broker, across a restart, and T2 still caps;
    on one Mosquitto and on the NATS cluster (each process on its endpoints)."""
    policy = _policy(tmp_path)
    agent = AgentProcess(
        tmp_path / "agent",
        fake=a100_node,
        broker=broker,
        policy=policy,
        startup_grace_s=60,
        extra={"agent": {"control_issuers": ["agg1"]}},
    )
    aggregator = AggregatorProcess(
        tmp_path / "aggregator",
        broker=broker,
        policy=policy,
        racks={"rack1": ["node1"], "rack2": ["node2"]},
        budget_w=BUDGET_W,
        meter=False,  # the default meter topic, which holds the poison
        extra={
            "control": {"publish_policy": False},  # keep the poisoned policy bundle retained
            "cooling": {
                "loops": [
                    {
                        "name": "loop1",
                        "cdu": "cdu1",
                        "racks": ["rack2"],
                        "heat_capacity_kw": 100,
                        "design_flow_lpm": 150,
                    }
                ]
            },
        },
    )
    feeder = asyncio.create_task(_feed_meter(probe, 92.0))  # over T2 (89%), under the brake
    try:
        for restart in (False, True):
            if restart:
                assert _stop(agent) == 0
                assert _stop(aggregator) == 0
                await _publish_poison(probe)
            started = time.monotonic()
            agent.start()
            aggregator.start()
            await wait_until(lambda: _at_t2(a100_node), timeout_s=30, what="T2 caps")
            assert _alive(agent, aggregator)
            await asyncio.sleep(1.0)  # a few more control intervals on the poisoned broker
            assert _alive(agent, aggregator)
            assert _at_t2(a100_node)
            assert time.monotonic() - started < 30
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)

    agent_reasons = {e["reason"] for e in agent.logs() if e["event"] == "message_rejected"}
    assert {"malformed", "control_future"} <= agent_reasons, agent_reasons
    assert "internal" not in agent_reasons
    rejected = [e for e in agent.logs() if e["event"] == "policy_rejected"]
    assert rejected  # the alias bomb, refused by the bounded YAML loader
    dropped = {e["reason"] for e in aggregator.logs() if e["event"] == "message_dropped"}
    assert {"malformed", "identity", "stale"} <= dropped, dropped
    assert "internal" not in dropped
    for process in (agent, aggregator):
        assert not [e for e in process.logs() if e["event"] in ("task_failed", "crash_loop")]
    assert _stop(agent) == 0
    assert _stop(aggregator) == 0


async def test_agent_refuses_a_spoofed_issuer(
    tmp_path: Path, broker: Broker, a100_node: FakeNvml, probe: MqttProbe
) -> None:
    """With control_issuers set, control from another issuer never applies."""
    agent = AgentProcess(
        tmp_path / "agent",
        fake=a100_node,
        broker=broker,
        policy=_policy(tmp_path),
        startup_grace_s=60,
        extra={"agent": {"control_issuers": ["agg1"]}},
    )
    agent.start()
    try:
        await agent.wait_log("mqtt_connected")
        now = time.time_ns()
        rogue = Control(
            ts_ns=now,
            scope="row",
            row=ROW,
            issuer="mallory",
            epoch_ns=now,
            seq=1,
            level=3,
            issued_ns=now,
            lease_expires_ns=now + 10 * S,
        )
        await probe.publish_raw(f"{BASE}/control", encode(rogue), retain=True)
        await agent.wait_log("message_rejected", where=lambda e: e["reason"] == "control_issuer")
        assert _locks(a100_node) == [0] * 8
    finally:
        assert _stop(agent) == 0
