"""The power tree end to end: a row fed by two mains of a Redfish PDU, ``polca meter`` reading
each main as its own source, a real aggregator and ``polca site run`` on Mosquitto.

The row is budgeted over one feed's rating (a Flex row: 10 kW on two 6 kW feeds). When a
main's breaker trips in the stand-in, the aggregator cuts the row to the survivor on the
meter's next reading (its own feeds) and the site controller lowers the leased budget
(the UPS above it); an operator's limit goes through ``polca budget``; a killed site
controller leaves the row on its lease, then on its fallback once the lease lapses.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import yaml

from polca.telemetry.schema import Budget, Control, RowSummary
from tests.integration.aggregator_rig import AggregatorProcess
from tests.integration.rig import ROW, SITE, MqttProbe, mqtt_config, mqtt_probe, wait_until
from tests.integration.test_aggregator_e2e import _test_policy
from tests.integration.test_facility_e2e import MeterProcess, TwoWordProcess
from tests.mqtt_broker import MosquittoProcess
from tests.standins.process import RedfishStandIn

USER, PASSWORD = "polca", "pdu-secret"
BUDGET_W, FEED_W = 10_000.0, 6_000.0
RACKS = {"rack1": ["node1"], "rack2": ["node2"]}
SITE_LEASE_S = 4.0


class SiteProcess(TwoWordProcess):
    """``polca site run``."""

    command = "site"
    verb = "run"


class Tree:
    """The PDU stand-in, the meter, the aggregator and the site controller."""

    def __init__(self, tmp_path: Path, broker: MosquittoProcess) -> None:
        self.policy = _test_policy(tmp_path)
        secret = tmp_path / "redfish.pass"
        secret.write_text(PASSWORD + "\n", encoding="utf-8")
        self.standin = RedfishStandIn(
            tmp_path / "standin", devices=["pdu:pdu-a"], username=USER, password=PASSWORD
        )
        self.endpoint = {
            "url": "",
            "username": USER,
            "password_file": str(secret),
            "allow_http": True,
            "timeout_s": 0.8,
        }
        self.tmp_path, self.broker = tmp_path, broker
        site_file = tmp_path / "site.yaml"
        site_file.write_text(
            yaml.safe_dump(
                {
                    "rows": {ROW: {"rating_w": BUDGET_W}},
                    "domains": {
                        "ups-a": {
                            "kind": "ups",
                            "rating_w": 2 * FEED_W,
                            "feeds": [
                                {"name": "A", "rating_w": FEED_W, "sources": [f"{ROW}/feed-a"]},
                                {"name": "B", "rating_w": FEED_W, "sources": [f"{ROW}/feed-b"]},
                            ],
                            "supplies": [ROW],
                        }
                    },
                }
            ),
            encoding="utf-8",
        )
        self.site_config = {
            "mqtt": mqtt_config(broker),
            "site": SITE,
            "instance": "site-a",
            "tree_file": str(site_file),
            "interval_s": 0.5,
            "lease_s": SITE_LEASE_S,
            "dark_polls_down": 2,
            "logging": {"format": "json", "level": "info"},
        }
        self.aggregator: AggregatorProcess | None = None
        self.meter: MeterProcess | None = None
        self.site: SiteProcess | None = None

    def start(self) -> None:
        """The stand-in at 70% of the row's budget on both mains, then the daemons."""
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
        feeds = [
            {"name": "A", "rating_w": FEED_W, "sources": ["feed-a"]},
            {"name": "B", "rating_w": FEED_W, "sources": ["feed-b"]},
        ]
        self.aggregator = AggregatorProcess(
            self.tmp_path / "aggregator", broker=self.broker, policy=self.policy, racks=RACKS,
            budget_w=BUDGET_W, extra={"site_budget": {"issuers": ["site-a"], "dark_polls_down": 2}},
        )  # fmt: skip
        config = yaml.safe_load(self.aggregator.config_path.read_text(encoding="utf-8"))
        config["rows"][0].update({"fallback_budget_w": FEED_W, "feeds": feeds})
        config["rows"][0]["meter_max_w"] = 2 * BUDGET_W
        self.aggregator.config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        self.site = SiteProcess(self.tmp_path / "site", policy=self.policy, config=self.site_config)
        self.site.start()
        self.aggregator.start()
        self.meter.start()

    async def trip(self, main: str) -> None:
        """Trip a main's breaker; the row's load moves to the other main."""
        other = "AC1" if main == "AC2" else "AC2"
        await asyncio.to_thread(self.standin.set_state, "pdu-a", breakers={main: "Tripped"})
        await asyncio.to_thread(
            self.standin.set_state, "pdu-a", mains={other: 0.7 * BUDGET_W, main: 0.0}
        )

    def budget_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``polca budget ARGS`` as an operator runs it."""
        config = self.tmp_path / "operator.yaml"
        config.write_text(
            yaml.safe_dump({"mqtt": mqtt_config(self.broker), "site": SITE}), encoding="utf-8"
        )
        return subprocess.run(
            [sys.executable, "-m", "polca", "budget", *args, "--config", str(config)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    def kill(self) -> None:
        """Kill every process."""
        for process in (self.aggregator, self.meter, self.site):
            if process is not None:
                process.kill()
        self.standin.kill()


@pytest.fixture
def tree(tmp_path: Path, mosquitto: MosquittoProcess) -> Iterator[Tree]:
    """The processes, killed after the test."""
    made = Tree(tmp_path, mosquitto)
    yield made
    made.kill()


@pytest.fixture
async def running(tree: Tree, mosquitto: MosquittoProcess) -> AsyncIterator[MqttProbe]:
    """Everything started, warm, and the row on its lease."""
    async with mqtt_probe(mosquitto) as probe:
        await asyncio.to_thread(tree.start)
        assert tree.aggregator is not None
        await tree.aggregator.wait_log("aggregator_warm", timeout_s=30)
        await wait_until(
            lambda: (s := _summary(probe)) is not None and s.leased_budget_w == BUDGET_W,
            timeout_s=30,
            what="the row on the site controller's lease",
        )
        yield probe


def _summary(probe: MqttProbe) -> RowSummary | None:
    summaries = [m for m in probe.of("summary") if isinstance(m, RowSummary)]
    return summaries[-1] if summaries else None


def _budget(probe: MqttProbe) -> Budget | None:
    budgets = [m for m in probe.of("budget") if isinstance(m, Budget)]
    return budgets[-1] if budgets else None


def _row_level(probe: MqttProbe) -> int:
    controls = [m for m in probe.of("control") if isinstance(m, Control) and m.scope == "row"]
    return controls[-1].level if controls else 0


def _now(probe: MqttProbe) -> RowSummary:
    summary = _summary(probe)
    assert summary is not None
    return summary


async def test_a_tripped_feed_cuts_the_row_to_the_survivor_and_the_site_follows(
    tree: Tree, running: MqttProbe
) -> None:
    """Breaker B trips: the row's own feeds cut it to A's 6 kW on the next readings (7 kW
    drawn: it escalates), and the site controller's lease follows, limited by the UPS."""
    probe = running
    assert _now(probe).budget_origin == "config"
    assert _now(probe).feeds == {"A": True, "B": True}
    assert _row_level(probe) == 0
    await tree.trip("AC2")
    await wait_until(lambda: _now(probe).feeds.get("B") is False, timeout_s=10, what="feed B down")
    summary = _now(probe)
    assert summary.electrical_budget_w == FEED_W
    assert summary.budget_origin in ("feeds", "lease")
    await wait_until(lambda: _row_level(probe) >= 1, timeout_s=15, what="the row capped")
    await wait_until(
        lambda: (b := _budget(probe)) is not None and b.budget_w == FEED_W,
        timeout_s=10,
        what="the site controller's budget at the survivor",
    )
    budget = _budget(probe)
    assert budget is not None
    assert budget.limited_by == "ups-a"
    assert budget.issuer == "site-a"
    shown = tree.budget_cli("show", "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)["report"]
    (ups,) = report["domains"]
    assert [(f["name"], f["up"]) for f in ups["feeds"]] == [("A", True), ("B", False)]
    assert ups["capacity_w"] == FEED_W


async def test_an_operators_limit_is_set_refused_above_capacity_and_cleared(
    tree: Tree, running: MqttProbe
) -> None:
    """``polca budget set`` lowers the UPS for a window; the row runs on the lease it
    brings; a value above what the UPS carries is refused in one line; ``clear`` ends it."""
    probe = running
    done = tree.budget_cli("set", "ups-a", "--watts", "5000", "--until", "+1h", "--reason",
                           "UPS-A battery service")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["watts"] == 5000
    await wait_until(
        lambda: _now(probe).electrical_budget_w == 5000.0, timeout_s=10, what="the limit"
    )
    assert _now(probe).budget_origin == "lease"
    assert _now(probe).budget_limited_by == "ups-a"
    assert tree.site is not None
    logged = await tree.site.wait_log("domain_limit_set", timeout_s=5)
    assert logged["reason"] == "UPS-A battery service"
    refused = tree.budget_cli("set", "ups-a", "--watts", "99000", "--reason", "more")
    assert refused.returncode == 65
    assert refused.stderr.count("\n") == 1
    assert "above what ups-a can carry" in refused.stderr
    unknown = tree.budget_cli("set", "ups-z", "--watts", "1", "--reason", "x")
    assert unknown.returncode == 65
    cleared = tree.budget_cli("clear", "ups-a", "--reason", "service done")
    assert cleared.returncode == 0, cleared.stderr
    await wait_until(
        lambda: _now(probe).electrical_budget_w == BUDGET_W, timeout_s=10, what="cleared"
    )


async def test_a_killed_site_controller_leaves_the_lease_then_the_fallback(
    tree: Tree, running: MqttProbe
) -> None:
    """SIGKILL the site controller: the row holds its leased budget for the lease, then
    runs on its fallback (one feed's rating), and says so."""
    probe = running
    assert tree.site is not None
    tree.site.kill()
    killed = asyncio.get_running_loop().time()
    await wait_until(
        lambda: _now(probe).budget_origin == "fallback", timeout_s=15, what="the fallback"
    )
    held_s = asyncio.get_running_loop().time() - killed
    assert held_s >= SITE_LEASE_S - 1.5  # the lease held (from the last budget, 0.5 s apart)
    assert _now(probe).electrical_budget_w == FEED_W
    assert _now(probe).leased_budget_w is None
