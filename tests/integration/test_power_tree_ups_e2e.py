"""The power tree end to end over SNMP: a UPS read by ``polca meter`` (UPS-MIB, snmpsim),
two rows behind it, ``polca site run`` sharing it on Mosquitto.

The UPS (100 kW, 60 kW on battery) supplies two 80 kW rows, so their ratings sum above
it: the site controller shares it by priority (row1 holds mostly high-priority power,
row2 mostly low). The test publishes both rows' retained summaries itself, as their
aggregators would, and changes what the UPS answers with ``SnmpSimProcess.set_records``
(its ``upsOutputSource``): on battery, the budgets shrink to ``battery_w``, row1 keeping
more; back on mains they return; with the output off the feed is down and the domain
carries nothing. The report is read as an operator reads it (``polca budget show
--json``) and as retained.

The expected watts follow ``powertree/allocate.py``: nominally each row's floor (10 kW),
then the high class (row1's 50 kW fits), then the low class shares the 40 kW left in
proportion to what each still asks (5 and 45 kW): 54 and 46 kW. On battery the 60 kW keep
the floors and shrink the rest in proportion (10 + 40 * 44/80, 10 + 40 * 36/80).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import yaml

from polca.telemetry.schema import (
    Budget,
    ClassPower,
    DomainReport,
    Meter,
    RowSummary,
    SiteReport,
    SourceState,
    encode,
)
from polca.telemetry.topics import Topics
from tests.integration.rig import A100_POLICY, SITE, MqttProbe, mqtt_config, mqtt_probe, wait_until
from tests.integration.test_facility_e2e import MeterProcess, TwoWordProcess
from tests.mqtt_broker import MosquittoProcess
from tests.snmpsim import SnmpSimProcess, snmpsim_agent

UPS: Final = "ups-a"
"""The UPS domain of the site file."""
GROUP, SOURCE = "facility", "ups-a-snmp"
"""The meter group the UPS is read in (its readings' topic segment) and its source's name."""
UPS_W, BATTERY_W, ROW_W = 100_000.0, 60_000.0, 80_000.0
FLOOR_W: Final = 10_000.0
ROWS: Final = ("row1", "row2")
DEMAND_W: Final = {"row1": (50_000.0, 5_000.0), "row2": (5_000.0, 50_000.0)}
"""Each row's GPU power per class, high first: row1 mostly high, row2 mostly low."""
NOMINAL_W: Final = {"row1": 54_000.0, "row2": 46_000.0}
BATTERY_SHARE_W: Final = {"row1": 32_000.0, "row2": 28_000.0}
UPS_SOURCE_OID: Final = "1.3.6.1.2.1.33.1.4.1.0"  # upsOutputSource: 2 none, 3 normal, 5 battery
UPS_POWER_OID: Final = "1.3.6.1.2.1.33.1.4.4.1.4"  # upsOutputPower, per output line
TOPICS: Final = Topics("polca/v1")
STEP_S: Final = 10.0
"""Bound on a change reaching the budgets: a meter poll (0.5 s) and a site step (0.5 s),
with room for a loaded machine."""


class SiteProcess(TwoWordProcess):
    """``polca site run``."""

    command = "site"
    verb = "run"


class UpsSite:
    """snmpsim's UPS, the meter reading it, the site controller over the site file."""

    def __init__(self, tmp_path: Path, broker: MosquittoProcess, agent: SnmpSimProcess) -> None:
        self.tmp_path, self.broker, self.agent = tmp_path, broker, agent
        community = tmp_path / "ups.community"
        community.write_text("ups\n", encoding="utf-8")
        site_file = tmp_path / "site.yaml"
        site_file.write_text(
            yaml.safe_dump(
                {
                    "rows": {row: {"rating_w": ROW_W} for row in ROWS},
                    "domains": {
                        UPS: {
                            "kind": "ups",
                            "rating_w": UPS_W,
                            "battery_w": BATTERY_W,
                            "feeds": [
                                {
                                    "name": "mains",
                                    "rating_w": UPS_W,
                                    "sources": [f"{GROUP}/{SOURCE}"],
                                }
                            ],
                            "supplies": list(ROWS),
                        }
                    },
                }
            ),
            encoding="utf-8",
        )
        source = {
            "protocol": "snmp",
            "name": SOURCE,
            "host": agent.host,
            "port": agent.port,
            "community_file": str(community),
            "profile": "ups",
            "ups": True,
            "timeout_s": 0.5,
            "retries": 1,
        }
        self.meter = MeterProcess(
            tmp_path / "meter",
            policy=A100_POLICY,
            config={
                "mqtt": mqtt_config(broker),
                "site": SITE,
                "interval_s": 0.5,
                "read_timeout_s": 1.2,
                "rows": [{"row": GROUP, "sources": [source]}],
                "logging": {"format": "json", "level": "info"},
            },
        )
        self.site = SiteProcess(
            tmp_path / "site",
            policy=A100_POLICY,
            config={
                "mqtt": mqtt_config(broker),
                "site": SITE,
                "instance": "site-a",
                "tree_file": str(site_file),
                "interval_s": 0.5,
                "lease_s": 10.0,
                "logging": {"format": "json", "level": "info"},
            },
        )

    def start(self) -> None:
        """The site controller, then the meter."""
        self.site.start()
        self.meter.start()

    def output(self, source: int, *, power_w: int | None = None) -> None:
        """What the UPS says from now on: its ``upsOutputSource`` and, given, each of its
        three output lines' power."""
        records: dict[str, tuple[int, int | str] | None] = {UPS_SOURCE_OID: (2, source)}
        if power_w is not None:
            records |= {f"{UPS_POWER_OID}.{line}": (2, power_w) for line in (1, 2, 3)}
        self.agent.set_records("ups", records)

    def budget_show(self) -> dict[str, Any]:
        """``polca budget show --json`` as an operator runs it: the report and budgets."""
        config = self.tmp_path / "operator.yaml"
        config.write_text(
            yaml.safe_dump({"mqtt": mqtt_config(self.broker), "site": SITE}), encoding="utf-8"
        )
        shown = subprocess.run(
            [sys.executable, "-m", "polca", "budget", "show", "--json", "--config", str(config)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        data: dict[str, Any] = json.loads(shown.stdout)
        return data

    def kill(self) -> None:
        """Kill both processes."""
        self.meter.kill()
        self.site.kill()


@pytest.fixture
def ups_agent(tmp_path: Path) -> Iterator[SnmpSimProcess]:
    """snmpsim serving the UPS (community ``ups``), this test's own."""
    yield from snmpsim_agent(tmp_path / "snmpsim")


@pytest.fixture
def ups_site(
    tmp_path: Path, mosquitto: MosquittoProcess, ups_agent: SnmpSimProcess
) -> Iterator[UpsSite]:
    """The processes, killed after the test."""
    made = UpsSite(tmp_path, mosquitto, ups_agent)
    yield made
    made.kill()


@pytest.fixture
async def running(ups_site: UpsSite, mosquitto: MosquittoProcess) -> AsyncIterator[MqttProbe]:
    """Everything started, the rows' summaries retained, the budgets on their shares."""
    async with mqtt_probe(mosquitto) as probe:
        for row in ROWS:
            await probe.publish_raw(
                TOPICS.row_summary(SITE, row), encode(_summary(row)), retain=True
            )
        await asyncio.to_thread(ups_site.start)
        await wait_until(
            lambda: _source_state(probe) is not None, timeout_s=30, what="the UPS's first reading"
        )
        await wait_until(
            lambda: _budgets_near(probe, NOMINAL_W), timeout_s=30, what="the nominal shares"
        )
        # The report goes out right after the budgets of the same step: wait for it too.
        await wait_until(lambda: _ups(_report(probe)) is not None, timeout_s=10, what="a report")
        yield probe


def _summary(row: str) -> RowSummary:
    """A row's summary as its aggregator publishes it: its power, floor and classes."""
    high_w, low_w = DEMAND_W[row]
    power_w = FLOOR_W + high_w + low_w
    return RowSummary(
        ts_ns=time.time_ns(),
        row=row,
        issuer=f"aggregator-{row}",
        power_w=power_w,
        power_source="computed",
        budget_w=ROW_W,
        effective_budget_w=ROW_W,
        electrical_budget_w=ROW_W,
        floor_w=FLOOR_W,
        power_by_class=(
            ClassPower(priority_class="high", power_w=high_w),
            ClassPower(priority_class="low", power_w=low_w),
        ),
        level=0,
    )


def _budgets(probe: MqttProbe) -> dict[str, Budget]:
    """Each row's latest budget, as received on its own topic."""
    latest: dict[str, Budget] = {}
    for topic, message, _ in probe.messages:
        if isinstance(message, Budget) and topic == TOPICS.budget(SITE, message.row):
            latest[message.row] = message
    return latest


def _budgets_near(probe: MqttProbe, expected_w: dict[str, float]) -> bool:
    got = _budgets(probe)
    return all(row in got and abs(got[row].budget_w - w) < 1.0 for row, w in expected_w.items())


def _report(probe: MqttProbe) -> SiteReport | None:
    reports = [m for m in probe.of("state") if isinstance(m, SiteReport)]
    return reports[-1] if reports else None


def _ups(report: SiteReport | None) -> DomainReport | None:
    if report is None:
        return None
    (domain,) = report.domains
    return domain


def _source_state(probe: MqttProbe) -> SourceState | None:
    """What the meter's latest reading of the UPS says of its feed."""
    meters = [
        m for t, m, _ in probe.messages if isinstance(m, Meter) and t.endswith(f"/{GROUP}/meter")
    ]
    return meters[-1].states.get(SOURCE) if meters else None


def _total_w(probe: MqttProbe) -> float:
    return sum(b.budget_w for b in _budgets(probe).values())


async def test_two_rows_share_the_ups_by_priority_and_its_battery_when_on_it(
    ups_site: UpsSite, running: MqttProbe
) -> None:
    """On mains the two 80 kW rows share the 100 kW UPS: row1 (high priority) keeps its
    high-priority demand and more than row2, each above its floor. On battery the budgets
    fall within the 60 kW it carries so, the report says so, row1 still keeping more;
    back on mains the shares return."""
    probe = running
    budgets = _budgets(probe)
    assert _total_w(probe) <= UPS_W + 1.0
    assert budgets["row1"].budget_w > budgets["row2"].budget_w
    assert budgets["row1"].budget_w >= DEMAND_W["row1"][0]
    assert all(b.budget_w >= FLOOR_W for b in budgets.values())
    assert all(b.limited_by is None and b.issuer == "site-a" for b in budgets.values())
    ups = _ups(_report(probe))
    assert ups is not None
    assert (ups.on_battery, ups.capacity_w) == (False, UPS_W)

    ups_site.output(5)  # battery(5)
    switched = time.monotonic()
    await wait_until(
        lambda: (s := _source_state(probe)) is not None and s.on_battery,
        timeout_s=STEP_S,
        what="the meter reading the UPS on battery",
    )
    await wait_until(
        lambda: _total_w(probe) <= BATTERY_W + 1.0, timeout_s=STEP_S, what="budgets within battery"
    )
    assert time.monotonic() - switched < STEP_S
    await wait_until(
        lambda: _budgets_near(probe, BATTERY_SHARE_W), timeout_s=STEP_S, what="the battery shares"
    )
    budgets = _budgets(probe)
    assert budgets["row1"].budget_w > budgets["row2"].budget_w
    assert all(b.budget_w >= FLOOR_W and b.limited_by == UPS for b in budgets.values())
    shown = await asyncio.to_thread(ups_site.budget_show)
    (domain,) = shown["report"]["domains"]
    assert (domain["name"], domain["on_battery"], domain["capacity_w"]) == (UPS, True, BATTERY_W)
    assert [(f["name"], f["up"]) for f in domain["feeds"]] == [("mains", True)]
    assert sum(b["budget_w"] for b in shown["budgets"].values()) <= BATTERY_W + 1.0

    ups_site.output(3)  # normal(3)
    await wait_until(
        lambda: _budgets_near(probe, NOMINAL_W), timeout_s=STEP_S, what="the shares back on mains"
    )
    await wait_until(
        lambda: (u := _ups(_report(probe))) is not None and not u.on_battery,
        timeout_s=STEP_S,
        what="the report back on mains",
    )
    assert all(b.limited_by is None for b in _budgets(probe).values())


async def test_the_ups_output_off_takes_its_feed_down_and_the_rows_budgets_to_zero(
    ups_site: UpsSite, running: MqttProbe
) -> None:
    """upsOutputSource none(2): the feed is down, the domain carries nothing, so neither
    row is given anything, and the report shows the feed down; back to normal(3), the
    shares return."""
    probe = running
    ups_site.output(2, power_w=0)  # none(2): nothing on the output
    await wait_until(
        lambda: (s := _source_state(probe)) is not None and s.equipment == "down",
        timeout_s=STEP_S,
        what="the meter reading the UPS's output off",
    )
    await wait_until(
        lambda: _budgets_near(probe, dict.fromkeys(ROWS, 0.0)), timeout_s=STEP_S, what="no budget"
    )
    assert all(b.limited_by == UPS for b in _budgets(probe).values())
    await wait_until(
        lambda: (u := _ups(_report(probe))) is not None and u.capacity_w == 0.0,
        timeout_s=STEP_S,
        what="the report's UPS at 0 W",
    )
    ups = _ups(_report(probe))
    assert ups is not None
    assert [(f.name, f.up, f.equipment) for f in ups.feeds] == [("mains", False, "down")]
    assert (ups.budget_w, ups.on_battery) == (0.0, False)
    report = _report(probe)
    assert report is not None
    assert [(r.name, r.budget_w, r.limited_by) for r in report.rows] == [
        ("row1", 0.0, UPS),
        ("row2", 0.0, UPS),
    ]

    ups_site.output(3, power_w=4000)  # normal(3)
    await wait_until(
        lambda: _budgets_near(probe, NOMINAL_W), timeout_s=STEP_S, what="the shares back"
    )
