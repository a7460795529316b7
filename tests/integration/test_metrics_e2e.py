"""A real Prometheus scrapes a running aggregator (real agents on fake NVML, Mosquitto)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.integration.rig import mqtt_probe
from tests.integration.test_aggregator_e2e import BUDGET_W, Cluster, _meter, _until_level
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
            for agent in cluster.agents.values():
                agent.start()
            cluster.aggregator.start()
            await cluster.aggregator.wait_log("aggregator_warm", timeout_s=20)
            for _ in range(25):
                await _meter(probe, cluster.aggregator.meter_topic, 85.0)
                await asyncio.sleep(0.2)
            await _until_level(probe, 1)
            for _ in range(15):  # keep the row at T1 while Prometheus scrapes
                await _meter(probe, cluster.aggregator.meter_topic, 85.0)
                await asyncio.sleep(0.2)
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
            for _ in range(15):
                await _meter(probe, cluster.aggregator.meter_topic, 92.0)
                await asyncio.sleep(0.2)
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
            assert len(rules) == 9
            assert {rule["health"] for rule in rules} == {"ok"}
    finally:
        cluster.kill_all()
        prometheus.kill()
