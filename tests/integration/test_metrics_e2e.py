"""A real Prometheus scrapes a running aggregator (real agents on fake NVML, Mosquitto)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.integration.rig import mqtt_probe
from tests.integration.test_aggregator_e2e import (
    BUDGET_W,
    Cluster,
    _meter,
    _meter_for,
    _until_level,
)
from tests.mqtt_broker import MosquittoProcess
from tests.prometheus import PrometheusProcess
from tests.services import free_port

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "polca-rules.yml"


async def test_prometheus_scrapes_row_node_gpu_and_health_families(
    tmp_path: Path, mosquitto: MosquittoProcess, fake_nvml_lib: Path
) -> None:
    """With ``metrics.address`` set, Prometheus finds a series per GPU, per node and per
    row, with their values: row power near the meter, level 1 at 85%, 16 GPUs' power, the
    nodes online and not at fail-safe, the intake's message counter moving."""
    port = free_port()
    cluster = Cluster(tmp_path, mosquitto, fake_nvml_lib)
    cluster.aggregator = cluster.new_aggregator(extra={"metrics": {"address": f"127.0.0.1:{port}"}})
    prometheus = PrometheusProcess(
        tmp_path / "prometheus", targets=[f"127.0.0.1:{port}"], rule_files=[RULES]
    )
    try:
        await asyncio.to_thread(prometheus.start)
        async with mqtt_probe(mosquitto) as probe:
            await cluster.start_at_t1(probe)
            # Keep the row at T1 while Prometheus scrapes.
            await _meter_for(probe, cluster.aggregator.meter_topic, 85.0, steps=15)
            level = await asyncio.to_thread(prometheus.wait_for, 'polca_row_level{row="row1"}')
            assert float(level[0]["value"][1]) == 1.0
            row = await asyncio.to_thread(prometheus.query, 'polca_row_power_watts{row="row1"}')
            assert abs(float(row[0]["value"][1]) - 0.85 * BUDGET_W) < 0.05 * BUDGET_W
            budget = await asyncio.to_thread(prometheus.query, "polca_row_budget_watts")
            assert float(budget[0]["value"][1]) == BUDGET_W
            gpus = await asyncio.to_thread(prometheus.wait_for, "count(polca_gpu_power_watts > 0)")
            assert float(gpus[0]["value"][1]) == 16
            labels = (await asyncio.to_thread(prometheus.query, "polca_gpu_power_watts"))[0][
                "metric"
            ]
            assert {"site", "row", "rack", "node", "gpu", "uuid", "class"} <= set(labels)
            online = await asyncio.to_thread(prometheus.query, "sum(polca_node_online)")
            assert float(online[0]["value"][1]) == 2
            fail_safe = await asyncio.to_thread(prometheus.query, "sum(polca_node_fail_safe)")
            assert float(fail_safe[0]["value"][1]) == 0
            rate = await asyncio.to_thread(
                prometheus.wait_for, "increase(polca_aggregator_messages_total[10s]) > 0"
            )
            assert rate
            # The shipped rules evaluate on the real series; at T2 the T2 alert goes pending
            # (it fires after its 10 minutes), and nothing else is raised.
            await _meter_for(probe, cluster.aggregator.meter_topic, 92.0, steps=15)
            await _until_level(probe, 2)
            alerts: list[dict[str, object]] = []
            for _ in range(40):
                await _meter(probe, cluster.aggregator.meter_topic, 92.0)
                alerts = (await asyncio.to_thread(prometheus.api, "/api/v1/alerts"))["alerts"]
                if any(a["labels"]["alertname"] == "PolcaRowAtT2" for a in alerts):  # type: ignore[index]
                    break
                await asyncio.sleep(0.25)
            assert [(a["labels"]["alertname"], a["state"]) for a in alerts] == [  # type: ignore[index]
                ("PolcaRowAtT2", "pending")
            ]
            groups = (await asyncio.to_thread(prometheus.api, "/api/v1/rules"))["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            assert len(rules) == 22  # deploy/prometheus/polca-rules.yml
            assert {rule["health"] for rule in rules} == {"ok"}
    finally:
        cluster.kill_all()
        prometheus.kill()


async def test_prometheus_scrapes_the_agents_and_an_xid_fires_its_alert(
    tmp_path: Path, mosquitto: MosquittoProcess, fake_nvml_lib: Path
) -> None:
    """Prometheus scrapes both agents and the aggregator: the caps in force with the policy
    source that won them, the level and the lease on each agent, the GPUs' health counters
    on both paths; an XID on one fake GPU fires ``PolcaGpuXid`` naming its code, and no
    other alert is raised."""
    ports = {name: free_port() for name in ("node1", "node2", "aggregator")}
    # Health counters every 2 s (not only on change): the agents start before the aggregator
    # subscribes, so it may miss their first reading, which it would otherwise see 30 s later.
    metrics = {
        n: {"metrics": {"address": f"127.0.0.1:{ports[n]}"}, "agent": {"health_every_s": 2.0}}
        for n in ("node1", "node2")
    }
    cluster = Cluster(tmp_path, mosquitto, fake_nvml_lib, agent_extra=metrics)
    cluster.aggregator = cluster.new_aggregator(
        extra={"metrics": {"address": f"127.0.0.1:{ports['aggregator']}"}}
    )
    prometheus = PrometheusProcess(
        tmp_path / "prometheus",
        targets=[f"127.0.0.1:{port}" for port in ports.values()],
        rule_files=[RULES],
    )
    try:
        await asyncio.to_thread(prometheus.start)
        async with mqtt_probe(mosquitto) as probe:
            await cluster.start_at_t1(probe)
            await _meter_for(probe, cluster.aggregator.meter_topic, 85.0, steps=10)
            await _check_agent_families(prometheus, ports)
            # An XID on node2's GPU 3 reaches the agent's /metrics and, with the next
            # telemetry, the aggregator's; the alert fires (it has no hold time).
            await asyncio.to_thread(cluster.nodes["node2"].xid, 3, 79)
            alerts: list[dict[str, Any]] = []
            for _ in range(80):
                await _meter(probe, cluster.aggregator.meter_topic, 85.0)
                alerts = (await asyncio.to_thread(prometheus.api, "/api/v1/alerts"))["alerts"]
                if any(a["state"] == "firing" for a in alerts):
                    break
                await asyncio.sleep(0.25)
            firing = [a for a in alerts if a["state"] == "firing"]
            assert [a["labels"]["alertname"] for a in firing] == ["PolcaGpuXid"]
            assert (firing[0]["labels"]["node"], firing[0]["labels"]["gpu"]) == ("node2", "3")
            assert firing[0]["annotations"]["summary"] == "GPU 3 of node node2 reported XID 79"
            both = 'count(polca_gpu_xid_errors_total{node="node2",gpu="3"} == 1) == 2'
            assert await asyncio.to_thread(prometheus.wait_for, both)  # agent and aggregator
            assert await cluster.agents["node2"].wait_log("gpu_xid", timeout_s=5)
    finally:
        cluster.kill_all()
        prometheus.kill()


async def _check_agent_families(prometheus: PrometheusProcess, ports: dict[str, int]) -> None:
    """At T1: the agents' level, lease, caps and counters, and the health series.

    Each check first waits until every target has been scraped with it: the three
    targets are scraped independently, so one can lag the others by a scrape."""

    async def every_target(promql: str) -> None:
        await asyncio.to_thread(prometheus.wait_for, promql)

    await every_target("count(polca_agent_level == 1) == 2")
    level = await asyncio.to_thread(prometheus.wait_for, "polca_agent_level == 1")
    assert {s["metric"]["node"] for s in level} == {"node1", "node2"}
    lease = await asyncio.to_thread(
        prometheus.query, "polca_agent_lease_remaining_seconds / polca_agent_lease_seconds"
    )
    assert len(lease) == 2
    assert all(0.5 < float(s["value"][1]) <= 1.0 for s in lease)
    await every_target('count(polca_gpu_cap_sm_clock_hertz{clock_reason!="none"}) == 8')
    caps = await asyncio.to_thread(
        prometheus.wait_for, 'polca_gpu_cap_sm_clock_hertz{clock_reason!="none"}'
    )
    assert len(caps) == 8  # the 4 low-priority GPUs of each node are capped at T1
    assert {s["metric"]["clock_reason"] for s in caps} == {"level:T1"}
    assert {s["metric"]["gpu"] for s in caps} == {"4", "5", "6", "7"}
    applied = await asyncio.to_thread(prometheus.query, "sum(polca_gpu_cap_applied)")
    assert float(applied[0]["value"][1]) == 16
    for name in ("polca_agent_gpu_errors_total", "polca_agent_outbox_dropped_total"):
        series = await asyncio.to_thread(prometheus.query, name)
        assert [float(s["value"][1]) for s in series] == [0.0, 0.0], name
    await every_target('count(polca_gpu_xid_errors_total{node="node2",gpu="3"}) == 2')
    await every_target('count(polca_gpu_ecc_errors_total{node="node1"}) == 64')
    xids = await asyncio.to_thread(
        prometheus.wait_for, 'polca_gpu_xid_errors_total{node="node2",gpu="3"}'
    )
    where = {s["metric"]["instance"] for s in xids}
    assert where == {f"127.0.0.1:{ports['node2']}", f"127.0.0.1:{ports['aggregator']}"}
    assert all(float(s["value"][1]) == 0 for s in xids)
    ecc = await asyncio.to_thread(
        prometheus.query, 'count(polca_gpu_ecc_errors_total{node="node1"})'
    )
    assert float(ecc[0]["value"][1]) == 2 * 8 * 4  # agent and aggregator, 4 per GPU
