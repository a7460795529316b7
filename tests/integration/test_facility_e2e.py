"""The site's own equipment end to end: a Redfish PDU read by ``polca meter``, a Redfish
CDU read by ``polca cdu redfish``, BMCs the aggregator caps out of band, real agents on the
fake NVML library, a real aggregator and Mosquitto.

The PDU, the CDU and the two BMCs are one Redfish stand-in process
(``tests/standins/redfish.py``) that keeps their state like the devices: a PATCH of a
BMC's power limit changes what later GETs return.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from polca.bmc.redfish import BmcPowerControl
from polca.redfish.api import RedfishEndpoint
from polca.redfish.client import connect
from polca.telemetry.schema import Control, Meter, RowSummary
from tests.fake_nvml import FakeNvml
from tests.integration.aggregator_rig import AggregatorProcess
from tests.integration.rig import (
    ROW,
    SITE,
    AgentProcess,
    JsonLogProcess,
    MqttProbe,
    mqtt_config,
    mqtt_probe,
    wait_until,
)
from tests.integration.test_aggregator_e2e import BUDGET_W, LOW, RACKS, _test_policy
from tests.mqtt_broker import MosquittoProcess
from tests.standins.process import RedfishStandIn

USER, PASSWORD = "polca", "pdu-and-bmc-secret"
FAIL_SAFE_W, BRAKE_W, ORIGINAL_W = 800.0, 500.0, 1200.0  # the BMC stand-in starts at 1200 W
TOP_LEVEL = 3


class TwoWordProcess(JsonLogProcess):
    """``python -m polca GROUP VERB --config FILE`` (``meter run``, ``cdu redfish``)."""

    verb: ClassVar[str]

    def __init__(self, workdir: Path, *, policy: Path, config: dict[str, Any]) -> None:
        super().__init__(workdir, policy=policy)
        self._write_config(config)

    def start(self) -> None:
        """Start the process (its output appends to the log)."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "polca", self.command, self.verb,
                 "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
            )  # fmt: skip


class MeterProcess(TwoWordProcess):
    """``polca meter run``."""

    command = "meter"
    verb = "run"


class CduProcess(TwoWordProcess):
    """``polca cdu redfish``."""

    command = "cdu"
    verb = "redfish"


class Site:
    """Two racks of one node each, their BMCs, a PDU feeding the row, a CDU on rack1."""

    def __init__(self, tmp_path: Path, broker: MosquittoProcess, lib: Path) -> None:
        self.policy = _test_policy(tmp_path)
        secret = tmp_path / "redfish.pass"
        secret.write_text(PASSWORD + "\n", encoding="utf-8")
        self.standin = RedfishStandIn(
            tmp_path / "standin",
            devices=["pdu:pdu-a", "cdu:cdu1", "bmc:node1:controls", "bmc:node2:legacy"],
            username=USER,
            password=PASSWORD,
        )
        endpoint = {
            "url": "",  # set once the stand-in has its port
            "username": USER,
            "password_file": str(secret),
            "allow_http": True,
            "timeout_s": 2.0,
        }
        self.endpoint = endpoint
        self.nodes: dict[str, FakeNvml] = {}
        self.agents: dict[str, AgentProcess] = {}
        for rack, names in RACKS.items():
            for name in names:
                directory = tmp_path / f"nvml-{name}"
                directory.mkdir()
                fake = FakeNvml(directory, gpus=8, model="NVIDIA A100-SXM4-80GB", lib_path=lib)
                fake.set(None)
                self.nodes[name] = fake
                self.agents[name] = AgentProcess(
                    tmp_path / f"agent-{name}", fake=fake, broker=broker, policy=self.policy,
                    startup_grace_s=60, node=name, rack=rack,
                )  # fmt: skip
        self.tmp_path, self.broker = tmp_path, broker
        self.aggregator: AggregatorProcess | None = None
        self.meter: MeterProcess | None = None
        self.cdu: CduProcess | None = None

    def start(self) -> None:
        """The stand-in, then the daemons configured against it."""
        self.standin.start()
        self.standin.set_state("pdu-a", power_w=0.5 * BUDGET_W)
        url = self.standin.url
        endpoint = {**self.endpoint, "url": url}
        cooling = {
            "stale_after_s": 2.0,
            "loops": [
                {
                    "name": "loop1",
                    "cdu": "cdu1",
                    "racks": ["rack1"],
                    "heat_capacity_kw": 100.0,
                    "design_flow_lpm": 150.0,
                    "timing": {"raise_after_s": 0.4, "critical_raise_after_s": 0.2},
                }
            ],
        }
        bmc = {
            "min_write_interval_s": 0.5,
            "agent_back_s": 1.0,
            "nodes": {
                n: {
                    "endpoint": endpoint,
                    "chassis": n,  # one stand-in serves both BMCs, as an enclosure would
                    "fail_safe_w": FAIL_SAFE_W,
                    "brake_w": BRAKE_W,
                }
                for n in self.nodes
            },
        }
        self.aggregator = AggregatorProcess(
            self.tmp_path / "aggregator", broker=self.broker, policy=self.policy, racks=RACKS,
            budget_w=BUDGET_W, extra={"cooling": cooling, "bmc": bmc},
        )  # fmt: skip
        self.meter = MeterProcess(
            self.tmp_path / "meter",
            policy=self.policy,
            config={
                "mqtt": mqtt_config(self.broker),
                "site": SITE,
                "interval_s": 0.5,
                "read_timeout_s": 2.0,
                "rows": [
                    {
                        "row": ROW,
                        "sources": [{"protocol": "redfish", "name": "pdu-a", "endpoint": endpoint}],
                    }
                ],
                "logging": {"format": "json", "level": "info"},
            },
        )
        self.cdu = CduProcess(
            self.tmp_path / "cdu",
            policy=self.policy,
            config={
                "mqtt": mqtt_config(self.broker),
                "site": SITE,
                "interval_s": 0.3,
                "redfish": {"cdu": "cdu1", "loop": "loop1", "endpoint": endpoint},
                "logging": {"format": "json", "level": "info"},
            },
        )
        for agent in self.agents.values():
            agent.start()
        self.aggregator.start()
        self.meter.start()
        self.cdu.start()

    async def pdu_w(self, power_w: float) -> None:
        """Set what the PDU's mains read (split over its two feeds)."""
        await asyncio.to_thread(self.standin.set_state, "pdu-a", power_w=power_w)

    async def bmc_limit_w(self, node: str) -> float | None:
        """The node's power limit as its BMC reports it."""
        endpoint = RedfishEndpoint(url=self.standin.url, username=USER, allow_http=True)
        session = await connect(endpoint, password=PASSWORD)
        try:
            control = BmcPowerControl(session, chassis_id=node)
            shape = await control.discover()
            assert shape.chassis.endswith(node), shape
            return (await control.read()).limit_w
        finally:
            await session.close()

    def locked_max(self, node: str, gpu: int) -> int:
        """The fake's locked SM clock ceiling (0 = unlocked)."""
        value = self.nodes[node].get(gpu)["locked_max_mhz"]
        assert isinstance(value, int)
        return value

    def kill(self) -> None:
        """Kill every process."""
        for process in (*self.agents.values(), self.aggregator, self.meter, self.cdu):
            if process is not None:
                process.kill()
        self.standin.kill()


@pytest.fixture
def site(tmp_path: Path, mosquitto: MosquittoProcess, fake_nvml_lib: Path) -> Iterator[Site]:
    """The site, killed after the test."""
    made = Site(tmp_path, mosquitto, fake_nvml_lib)
    yield made
    made.kill()


@pytest.fixture
async def running(site: Site, mosquitto: MosquittoProcess) -> AsyncIterator[MqttProbe]:
    """Everything started and warm, the row at half its budget by the PDU."""
    async with mqtt_probe(mosquitto) as probe:
        await asyncio.to_thread(site.start)
        assert site.aggregator is not None
        await site.aggregator.wait_log("aggregator_warm", timeout_s=30)
        yield probe


def _row_level(probe: MqttProbe) -> int | None:
    controls = [m for m in probe.of("control") if isinstance(m, Control) and m.scope == "row"]
    return controls[-1].level if controls else None


def _rack_level(probe: MqttProbe, rack: str) -> int | None:
    controls = [
        m
        for m in probe.of("control")
        if isinstance(m, Control) and m.scope == "rack" and m.rack == rack
    ]
    return controls[-1].level if controls else None


async def test_the_pdus_reading_drives_the_row_and_its_agents(
    site: Site, running: MqttProbe
) -> None:
    """The row runs on the PDU's reading: at 95% of its budget the row goes to T2 and the
    agents cap their low-priority GPUs; the summary says the power is the meter's."""
    probe = running
    await wait_until(lambda: _row_level(probe) == 0, timeout_s=15, what="row nominal")

    def whole_meters() -> list[Meter]:
        return [m for m in probe.of("meter") if isinstance(m, Meter) and not m.partial]

    await wait_until(lambda: bool(whole_meters()), timeout_s=30, what="the PDU's reading")
    assert whole_meters()[-1].power_w == pytest.approx(0.5 * BUDGET_W)
    assert whole_meters()[-1].sources == 1
    await site.pdu_w(0.95 * BUDGET_W)
    await wait_until(lambda: (_row_level(probe) or 0) >= 2, timeout_s=30, what="row at T2")
    await wait_until(
        lambda: all(0 < site.locked_max(n, g) <= 1110 for n in site.nodes for g in LOW),
        timeout_s=15,
        what="low-priority GPUs capped",
    )
    summaries = [m for m in probe.of("summary") if isinstance(m, RowSummary)]
    assert summaries[-1].power_source == "meter"
    # No agent was unable: no out-of-band cap.
    assert await site.bmc_limit_w("node1") == ORIGINAL_W
    assert site.aggregator is not None
    assert not [e for e in site.aggregator.logs() if e.get("event") == "oob_cap_applied"]


async def test_a_node_whose_agent_dies_at_t2_is_capped_through_its_bmc_then_released(
    site: Site, running: MqttProbe
) -> None:
    """SIGKILL node1's agent while the PDU holds the row at T2: its BMC gets the fail-safe
    limit (verified); node2 (alive) is not touched. The agent returns, the row falls under
    the release band: the limit in force before is written back."""
    probe = running
    assert site.aggregator is not None
    await site.pdu_w(0.93 * BUDGET_W)
    await wait_until(lambda: (_row_level(probe) or 0) >= 2, timeout_s=30, what="row at T2")
    site.agents["node1"].kill()
    capped = await site.aggregator.wait_log(
        "oob_cap_applied", timeout_s=15, where=lambda e: e.get("node") == "node1"
    )
    assert capped["limit_w"] == FAIL_SAFE_W
    assert capped["verified"] is True
    assert "at level 2" in capped["reason"]
    assert await site.bmc_limit_w("node1") == FAIL_SAFE_W
    assert await site.bmc_limit_w("node2") == ORIGINAL_W
    # The agent comes back while the row is still hot: the out-of-band cap stays.
    agent = site.agents["node1"]
    before = len(agent.logs())
    agent.start()
    await wait_until(
        lambda: any(e.get("event") == "control_accepted" for e in agent.logs()[before:]),
        timeout_s=30,
        what="node1's agent back under control",
    )
    await asyncio.sleep(2.0)
    assert await site.bmc_limit_w("node1") == FAIL_SAFE_W
    # The row falls under the release band: released, one level at a time, then the BMC.
    await site.pdu_w(0.5 * BUDGET_W)
    released = await site.aggregator.wait_log(
        "oob_release_applied", timeout_s=30, where=lambda e: e.get("node") == "node1"
    )
    assert released["limit_w"] == ORIGINAL_W
    assert await site.bmc_limit_w("node1") == ORIGINAL_W

    def oob_events() -> set[str]:
        return {
            name for e in probe.of("events") if (name := getattr(e, "event", "")).startswith("oob_")
        }

    await wait_until(
        lambda: oob_events() >= {"oob_cap", "oob_release"}, timeout_s=5, what="oob events"
    )
    assert "oob_cap_failed" not in oob_events()


async def test_a_leak_the_cdu_reports_over_redfish_caps_its_rack(
    site: Site, running: MqttProbe
) -> None:
    """A critical leak on the CDU's Redfish LeakDetection reaches the aggregator through
    ``polca cdu redfish`` and forces rack1 (its loop's) to the top level; rack2 is spared."""
    probe = running
    await wait_until(lambda: _rack_level(probe, "rack1") == 0, timeout_s=15, what="rack1 ok")
    await asyncio.to_thread(site.standin.set_state, "cdu1", leak="Critical")
    await wait_until(
        lambda: (_rack_level(probe, "rack1") or 0) >= TOP_LEVEL,
        timeout_s=20,
        what="rack1 forced to the top level",
    )
    await wait_until(
        lambda: all(0 < site.locked_max("node1", g) <= 288 for g in LOW),
        timeout_s=15,
        what="node1 braked",
    )
    assert all(site.locked_max("node2", g) == 0 for g in range(8))
    assert (_rack_level(probe, "rack2") or 0) == 0
