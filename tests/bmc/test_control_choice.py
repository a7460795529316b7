"""Which power control caps the node, and in which unit: against the stand-in's variants of
a chassis with several power controls (DMTF's liquid-cooled-server mockup has a CPU's and
the chassis's), and ``polca bmc probe`` saying what it saw and chose.

Each test fails on a discovery that takes the first power control listed, or reads a
``SetPoint`` as watts whatever its ``SetPointUnits``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from polca.bmc import cli
from polca.bmc.redfish import BmcPowerControl, discover
from polca.errors import ConfigError, ReadingRejectedError
from polca.exits import EX_CONFIG
from polca.redfish.api import RedfishEndpoint, RedfishSession
from polca.redfish.client import connect
from tests.bmc.test_redfish import DictSession, tree
from tests.standins.fixtures import PASSWORD, USERNAME
from tests.standins.process import RedfishStandIn

NODE = "/redfish/v1/Chassis/node1"
NODE_CONTROL = f"{NODE}/Controls/NodePower"
CPU_CONTROL = f"{NODE}/Controls/CPUPower"
OTHER_CONTROL = f"{NODE}/Controls/PowerLimit2"


@asynccontextmanager
async def _session(standin: RedfishStandIn) -> AsyncIterator[RedfishSession]:
    endpoint = RedfishEndpoint(url=standin.url, username=USERNAME, allow_http=True, timeout_s=2.0)
    session = await connect(endpoint, password=PASSWORD)
    try:
        yield session
    finally:
        await session.close()


def _bmc(factory: Callable[..., RedfishStandIn], variant: str) -> RedfishStandIn:
    return factory(devices=[f"bmc:node1:{variant}"], username=USERNAME, password=PASSWORD)


async def test_the_chassis_control_is_capped_not_the_cpus_listed_first(
    standin_factory: Callable[..., RedfishStandIn],
) -> None:
    """A CPU's power control (20-120 W) listed before the chassis's: the cap and the restore
    go to the chassis's control, the CPU's limit never moves, and discovery says why."""
    standin = _bmc(standin_factory, "cpu_first")
    async with _session(standin) as session:
        control = BmcPowerControl(session)
        shape = await control.discover()
        assert shape.control == NODE_CONTROL
        seen = {s.path: s for s in shape.seen}
        assert seen[NODE_CONTROL].chosen
        assert "whole node" in seen[NODE_CONTROL].why
        assert not seen[CPU_CONTROL].chosen
        assert "component" in seen[CPU_CONTROL].why
        result = await control.cap(1000.0)
        assert (result.limit_w, result.verified) == (1000.0, True)
        restored = await control.restore()
        assert (restored.limit_w, restored.verified) == (1500.0, True)
        assert (await session.get(CPU_CONTROL))["SetPoint"] == 120
    written = [r["path"] for r in standin.requests() if r["method"] == "PATCH"]
    assert written == [NODE_CONTROL, NODE_CONTROL]


async def test_two_controls_no_rule_tells_apart_are_refused_unless_named(
    standin_factory: Callable[..., RedfishStandIn],
) -> None:
    """Two power controls without a PhysicalContext and no total-power sensor: refused with
    a line naming both (nothing written); the configured control is used when named."""
    standin = _bmc(standin_factory, "ambiguous")
    async with _session(standin) as session:
        with pytest.raises(ConfigError) as caught:
            await BmcPowerControl(session).cap(1000.0)
        assert NODE_CONTROL in str(caught.value)
        assert OTHER_CONTROL in str(caught.value)
        assert "control" in str(caught.value)
        named = BmcPowerControl(session, control="NodePower")
        assert (await named.discover()).control == NODE_CONTROL
        assert (await named.cap(1000.0)).verified
        with pytest.raises(ConfigError, match="no power control 'Nope'"):
            await BmcPowerControl(session, control="Nope").discover()
    written = [r["path"] for r in standin.requests() if r["method"] == "PATCH"]
    assert written == [NODE_CONTROL]


async def test_the_control_whose_sensor_is_the_chassis_total_power_is_chosen(
    standin_factory: Callable[..., RedfishStandIn],
) -> None:
    """The same two controls, and EnvironmentMetrics.PowerWatts naming NodePower's sensor."""
    standin = _bmc(standin_factory, "by_sensor")
    async with _session(standin) as session:
        shape = await discover(session)
    assert shape.control == NODE_CONTROL
    (chosen,) = [s for s in shape.seen if s.chosen]
    assert "total power" in chosen.why


async def test_a_milliwatt_control_is_read_and_written_in_milliwatts(
    standin_factory: Callable[..., RedfishStandIn],
) -> None:
    """SetPointUnits mW: 1,200,000 reads as 1,200 W; a 300 W cap is written as 300,000."""
    standin = _bmc(standin_factory, "mw")
    async with _session(standin) as session:
        control = BmcPowerControl(session)
        reading = await control.read()
        assert (reading.limit_w, reading.limit_min_w, reading.limit_max_w) == (
            1200.0,
            300.0,
            1500.0,
        )
        result = await control.cap(300.0)
        assert (result.limit_w, result.verified) == (300.0, True)
        assert (await session.get(NODE_CONTROL))["SetPoint"] == 300_000
    (patch,) = [r for r in standin.requests() if r["method"] == "PATCH"]
    assert (patch["path"], patch["status"]) == (NODE_CONTROL, 204)


async def test_units_polca_does_not_know_are_refused() -> None:
    """A SetPointUnits other than W, mW or kW is never read as watts; kW is converted."""
    docs = tree([("n", "RackMount", True)])
    control = docs["/redfish/v1/Chassis/n/Controls/P"]
    control["SetPointUnits"] = "%"
    with pytest.raises(ReadingRejectedError, match="SetPointUnits") as caught:
        await discover(DictSession(docs))
    assert caught.value.reason == "unsupported"
    control["SetPointUnits"] = "kW"
    control.update(SetPoint=1.2, AllowableMin=0.3, AllowableMax=1.5)
    reading = await BmcPowerControl(DictSession(docs)).read()
    assert (reading.limit_w, reading.limit_max_w) == (1200.0, 1500.0)


def _probe(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any, str]:
    p = argparse.ArgumentParser(prog="polca")
    cli.add_parsers(p.add_subparsers(dest="command", required=True))
    code = cli.main(p.parse_args(["bmc", "probe", *argv]))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, json.loads(out) if out else None, err


def test_probe_lists_every_power_control_and_the_choice(
    standin_factory: Callable[..., RedfishStandIn],
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """polca bmc probe prints each power control it saw, which it chose and why; on an
    ambiguous BMC it fails with one line and EX_CONFIG, and --control settles it."""
    password = tmp_path / "pw"
    password.write_text(PASSWORD + "\n", encoding="utf-8")
    login = ["--username", USERNAME, "--password-file", str(password)]
    cpu_first = _bmc(standin_factory, "cpu_first")
    code, answer, err = _probe(cpu_first.url, *login, capsys=capsys)
    assert (code, err) == (0, "")
    assert answer["control"] == NODE_CONTROL
    assert answer["units"] == "W"
    listed = {c["path"]: c for c in answer["controls"]}
    assert set(listed) == {NODE_CONTROL, CPU_CONTROL}
    assert listed[NODE_CONTROL]["chosen"] is True
    assert listed[CPU_CONTROL] == {
        "path": CPU_CONTROL,
        "physical_context": "CPU",
        "units": "W",
        "chosen": False,
        "why": listed[CPU_CONTROL]["why"],
    }
    ambiguous = _bmc(standin_factory, "ambiguous")
    code, answer, err = _probe(ambiguous.url, *login, capsys=capsys)
    assert code == EX_CONFIG
    assert answer is None
    assert len(err.splitlines()) == 1
    assert OTHER_CONTROL in err
    code, answer, _ = _probe(ambiguous.url, *login, "--control", OTHER_CONTROL, capsys=capsys)
    assert (code, answer["control"]) == (0, OTHER_CONTROL)
