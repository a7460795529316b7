"""The power tree's metrics end to end: ``polca site run`` and the aggregator of
``test_power_tree_e2e.py`` (a Flex row on the two mains of a Redfish PDU stand-in, Mosquitto)
with their sinks on, a real Prometheus scraping both with the shipped rules, and a real
InfluxDB 1.x holding what they write.

A main's breaker trips: the feed is down on both paths, the UPS's capacity falls to the
survivor, the row's lease follows it, and ``PolcaFeedDown`` and ``PolcaDomainOverCapacity``
are raised (the row still draws more than the survivor carries). The site controller is
killed: ``PolcaSiteControllerLost`` is raised, and once the row's lease lapses it runs on
its fallback, which its aggregator's series say and ``PolcaRowOnFallback`` raises.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import yaml

from tests.integration.aggregator_rig import AggregatorProcess
from tests.integration.rig import ROW, SITE, MqttProbe, mqtt_config, mqtt_probe, wait_until
from tests.integration.test_facility_e2e import MeterProcess
from tests.integration.test_power_tree_e2e import BUDGET_W, FEED_W, RACKS, SiteProcess, Tree
from tests.integration.test_power_tree_e2e import _summary as summary_of
from tests.mqtt_broker import MosquittoProcess
from tests.prometheus import PrometheusProcess
from tests.services import free_port
from tests.tsdb import InfluxDB1Process

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "polca-rules.yml"


class SinkTree(Tree):
    """``Tree`` with the site controller's and the aggregator's sinks: ``/metrics`` on
    ``ports`` and InfluxDB ``influx``."""

    def __init__(
        self,
        tmp_path: Path,
        broker: MosquittoProcess,
        *,
        ports: dict[str, int],
        influx: InfluxDB1Process,
    ) -> None:
        super().__init__(tmp_path, broker)
        self.sink = {
            "url": influx.url,
            "api": "v1",
            "database": influx.database,
            "flush_interval_s": 0.2,
        }
        self.ports = ports
        self.site_config |= {
            "metrics": {"address": f"127.0.0.1:{ports['site']}"},
            "influx": self.sink,
            "state_dir": str(tmp_path / "site" / "state"),
        }

    def start(self) -> None:
        """``Tree.start``, the aggregator with its sinks too."""
        self.standin.start()
        self.standin.set_state("pdu-a", mains={"AC1": 0.35 * BUDGET_W, "AC2": 0.35 * BUDGET_W})
        endpoint = {**self.endpoint, "url": self.standin.url}
        sources = [
            {"protocol": "redfish", "name": f"feed-{x}", "endpoint": endpoint,
             "resource": "mains", "circuits": [main]}
            for x, main in (("a", "AC1"), ("b", "AC2"))
        ]  # fmt: skip
        self.meter = MeterProcess(
            self.tmp_path / "meter",
            policy=self.policy,
            config={
                "mqtt": mqtt_config(self.broker),
                "site": SITE,
                "interval_s": 0.5,
                "read_timeout_s": 1.0,
                "rows": [{"row": ROW, "sources": sources}],
                "logging": {"format": "json", "level": "info"},
            },
        )
        extra: dict[str, Any] = {
            "site_budget": {"issuers": ["site-a"], "dark_polls_down": 2},
            "metrics": {"address": f"127.0.0.1:{self.ports['aggregator']}"},
            "influx": self.sink,
        }
        self.aggregator = AggregatorProcess(
            self.tmp_path / "aggregator", broker=self.broker, policy=self.policy, racks=RACKS,
            budget_w=BUDGET_W, extra=extra,
        )  # fmt: skip
        config = yaml.safe_load(self.aggregator.config_path.read_text(encoding="utf-8"))
        feeds = [
            {"name": "A", "rating_w": FEED_W, "sources": ["feed-a"]},
            {"name": "B", "rating_w": FEED_W, "sources": ["feed-b"]},
        ]
        config["rows"][0].update({"fallback_budget_w": FEED_W, "feeds": feeds})
        config["rows"][0]["meter_max_w"] = 2 * BUDGET_W
        self.aggregator.config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        self.site = SiteProcess(self.tmp_path / "site", policy=self.policy, config=self.site_config)
        self.site.start()
        self.aggregator.start()
        self.meter.start()


async def _alert(
    prometheus: PrometheusProcess, probe: MqttProbe, name: str, *, timeout_s: float = 20.0
) -> dict[str, Any]:
    """The first alert ``name`` (pending or firing) the shipped rules raise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    alerts: list[dict[str, Any]] = []
    while loop.time() < deadline:
        alerts = (await asyncio.to_thread(prometheus.api, "/api/v1/alerts"))["alerts"]
        for alert in alerts:
            if alert["labels"]["alertname"] == name:
                found: dict[str, Any] = alert
                return found
        await asyncio.sleep(0.25)
    names = sorted({a["labels"]["alertname"] for a in alerts})
    msg = f"no {name} within {timeout_s} s; raised: {names}; summaries: {len(probe.of('summary'))}"
    raise AssertionError(msg)


async def _value(prometheus: PrometheusProcess, promql: str) -> float:
    (sample,) = await asyncio.to_thread(prometheus.wait_for, promql)
    return float(sample["value"][1])


UPS = '{domain="ups-a",kind="ups"}'
ROW_LABEL = f'{{row="{ROW}"}}'


async def test_a_tripped_feed_and_a_lost_site_controller_on_both_paths(
    tmp_path: Path, mosquitto: MosquittoProcess, influxdb1: InfluxDB1Process
) -> None:
    ports = {"site": free_port(), "aggregator": free_port()}
    tree = SinkTree(tmp_path, mosquitto, ports=ports, influx=influxdb1)
    prometheus = PrometheusProcess(
        tmp_path / "prometheus",
        targets=[f"127.0.0.1:{port}" for port in ports.values()],
        rule_files=[RULES],
    )
    try:
        await asyncio.to_thread(prometheus.start)
        async with mqtt_probe(mosquitto) as probe:
            await asyncio.to_thread(tree.start)
            assert tree.aggregator is not None
            assert tree.site is not None
            await tree.aggregator.wait_log("aggregator_warm", timeout_s=30)
            await wait_until(
                lambda: (s := summary_of(probe)) is not None and s.leased_budget_w == BUDGET_W,
                timeout_s=30,
                what="the row on the site controller's lease",
            )
            await _both_feeds_up(prometheus)
            await tree.trip("AC2")
            await _feed_b_down(prometheus, probe)
            await _feed_b_down_in_influxdb(influxdb1)
            tree.site.kill()
            await _site_controller_lost(prometheus, probe)
    finally:
        tree.kill()
        prometheus.kill()


async def _both_feeds_up(prometheus: PrometheusProcess) -> None:
    """The tree as the leading site controller serves it, and the row's own view (its
    aggregator): on its configuration, the lease equal to it."""
    assert await _value(prometheus, f"polca_power_domain_capacity_watts{UPS}") == 12_000
    assert await _value(prometheus, f"polca_power_domain_rating_watts{UPS}") == 12_000
    assert await _value(prometheus, "sum(polca_power_feed_up)") == 2
    assert await _value(prometheus, f"polca_power_row_budget_watts{ROW_LABEL}") == BUDGET_W
    assert await _value(prometheus, f"polca_power_row_limited{ROW_LABEL}") == 0
    origin = f'polca_row_budget_origin{{row="{ROW}",origin="config"}} == 1'
    assert await _value(prometheus, origin) == 1
    assert await _value(prometheus, f"polca_row_on_fallback{ROW_LABEL}") == 0
    assert await _value(prometheus, f"polca_row_leased_budget_watts{ROW_LABEL}") == BUDGET_W


async def _feed_b_down(prometheus: PrometheusProcess, probe: MqttProbe) -> None:
    """Breaker B tripped: the feed is down, the UPS carries A's 6 kW, the row draws 7."""
    await asyncio.to_thread(prometheus.wait_for, 'polca_power_feed_up{feed="B"} == 0')
    await asyncio.to_thread(
        prometheus.wait_for, f"polca_power_domain_capacity_watts{UPS} == {FEED_W}"
    )
    await asyncio.to_thread(prometheus.wait_for, f"polca_power_row_limited{ROW_LABEL} == 1")
    assert await _value(prometheus, f"polca_power_domain_feeds_down{UPS}") == 1
    assert await _value(prometheus, f"polca_power_row_budget_watts{ROW_LABEL}") == FEED_W
    down = await _alert(prometheus, probe, "PolcaFeedDown")
    assert (down["labels"]["domain"], down["labels"]["feed"]) == ("ups-a", "B")
    assert down["labels"]["severity"] == "critical"
    assert down["annotations"]["summary"] == f"Feed B of {SITE}/ups-a is down"
    over = await _alert(prometheus, probe, "PolcaDomainOverCapacity")
    assert over["labels"]["domain"] == "ups-a"


async def _feed_b_down_in_influxdb(influxdb1: InfluxDB1Process) -> None:
    """The same on the InfluxDB path, written by the site controller and the aggregator."""

    def feed_b_down() -> bool:
        series = influxdb1.query(
            """SELECT last("up"), last("equipment") FROM "power_feed" WHERE "feed" = 'B'"""
        )
        return bool(series) and series[0]["values"][0][1:] == [0.0, "down"]

    await wait_until(feed_b_down, timeout_s=10, what="power_feed B down in InfluxDB")
    (domain,) = influxdb1.query(
        'SELECT last("feeds_down"), last("capacity_w"), last("unlimited_w") '
        'FROM "power_domain" GROUP BY "kind"'
    )
    assert domain["tags"] == {"kind": "ups"}
    assert domain["values"][0][1:] == [1.0, FEED_W, FEED_W]
    (budget,) = influxdb1.query('SELECT last("limited_by"), last("budget_w") FROM "row_budget"')
    assert budget["values"][0][1:] == ["ups-a", FEED_W]

    def origins() -> set[str]:
        found = influxdb1.query('SELECT DISTINCT("budget_origin") FROM "row"')
        return {value for _, value in found[0]["values"]} if found else set()

    # The row's own feeds cut it first (or the lease, when it comes first).
    await wait_until(
        lambda: "config" in origins() and bool(origins() & {"feeds", "lease"}),
        timeout_s=10,
        what="the row's budget origins in InfluxDB",
    )


async def _site_controller_lost(prometheus: PrometheusProcess, probe: MqttProbe) -> None:
    """Its series gone, the alert; once the lease lapses, the row on its fallback."""
    lost = await _alert(prometheus, probe, "PolcaSiteControllerLost")
    assert lost["labels"]["site"] == SITE
    await wait_until(
        lambda: (s := summary_of(probe)) is not None and s.budget_origin == "fallback",
        timeout_s=15,
        what="the row on its fallback",
    )
    assert await _value(prometheus, f"polca_row_on_fallback{ROW_LABEL} == 1") == 1
    fallback = f'polca_row_budget_origin{{row="{ROW}",origin="fallback"}} == 1'
    assert await _value(prometheus, fallback) == 1
    on_fallback = await _alert(prometheus, probe, "PolcaRowOnFallback")
    assert on_fallback["labels"]["row"] == ROW
    groups = (await asyncio.to_thread(prometheus.api, "/api/v1/rules"))["groups"]
    health = {rule["name"]: rule["health"] for g in groups for rule in g["rules"]}
    assert len(health) == 22
    assert set(health.values()) == {"ok"}, health
