"""BMC power-limit control through Redfish: both shapes, against the stand-in process.

Discovery's edge cases (bounds, the chassis rule) also run against ``DictSession``, an
in-memory ``RedfishSession`` (the seam ``bmc/redfish.py`` takes; no HTTP is faked).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from polca.bmc.redfish import (
    MAX_CHASSIS,
    BmcPowerControl,
    BmcReading,
    CapResult,
    PowerControlShape,
    discover,
)
from polca.errors import ConfigError, ReadingRejectedError
from polca.redfish.api import RedfishEndpoint, RedfishSession
from polca.redfish.client import connect
from tests.standins.fixtures import PASSWORD, USERNAME
from tests.standins.process import RedfishStandIn

NODE = "/redfish/v1/Chassis/node1"
CONTROLS = {"controls": f"{NODE}/Controls/NodePower", "legacy": f"{NODE}/Power"}


def shape_of(standin: RedfishStandIn) -> str:
    """The power-limit shape the stand-in serves."""
    return standin.devices[0].rsplit(":", 1)[1]


@pytest.fixture
async def session(bmc_standin: RedfishStandIn) -> AsyncIterator[RedfishSession]:
    """A logged-in session with the stand-in; closed after."""
    endpoint = RedfishEndpoint(
        url=bmc_standin.url, username=USERNAME, allow_http=True, timeout_s=2.0
    )
    session = await connect(endpoint, password=PASSWORD)
    yield session
    await session.close()


@pytest.fixture
def control(session: RedfishSession) -> BmcPowerControl:
    """A BmcPowerControl over ``session``."""
    return BmcPowerControl(session)


def patches(standin: RedfishStandIn) -> list[dict[str, Any]]:
    """The PATCH requests the stand-in served."""
    return [r for r in standin.requests() if r["method"] == "PATCH"]


async def test_discovers_the_node_chassis_control(
    bmc_standin: RedfishStandIn, control: BmcPowerControl
) -> None:
    """Controls are preferred over legacy Power, and the RackMount chassis over a Module."""
    shape = shape_of(bmc_standin)
    found = await control.discover()
    assert (found.chassis, found.control, found.kind) == (NODE, CONTROLS[shape], shape)
    assert isinstance(found, PowerControlShape)
    assert await control.discover() is found  # once per BMC
    gets = [r["path"] for r in bmc_standin.requests() if r["method"] == "GET"]
    assert gets.count("/redfish/v1/Chassis") == 1


async def test_read(bmc_standin: RedfishStandIn, control: BmcPowerControl) -> None:
    """A reading has the draw, the limit and the allowable range, in W."""
    reading = await control.read()
    shape = shape_of(bmc_standin)
    assert reading == BmcReading(
        power_w=900.0,
        limit_w=1200.0,
        limit_min_w=300.0,
        limit_max_w=1500.0,
        control=CONTROLS[shape],
    )


async def test_cap_is_written_and_verified(
    bmc_standin: RedfishStandIn, control: BmcPowerControl
) -> None:
    """A cap is PATCHed with the ETag, read back and verified; the draw follows it."""
    result = await control.cap(800.0)
    assert result == CapResult(limit_w=800.0, verified=True)
    reading = await control.read()
    assert (reading.limit_w, reading.power_w) == (800.0, 800.0)
    (patch,) = patches(bmc_standin)
    assert patch["path"] == CONTROLS[shape_of(bmc_standin)]
    assert patch["status"] in {200, 204}
    assert patch["if_match"] is not None


async def test_restore_lifts_the_cap(bmc_standin: RedfishStandIn, control: BmcPowerControl) -> None:
    """Restore sets the allowable maximum and reads it back."""
    await control.cap(500.0)
    assert (await control.read()).power_w == 500.0
    assert await control.restore() == CapResult(limit_w=1500.0, verified=True)
    assert (await control.read()).power_w == 900.0


@pytest.mark.parametrize("bmc_standin", ["legacy"], indirect=True)
async def test_legacy_restore_without_a_known_maximum(
    session: RedfishSession, control: BmcPowerControl
) -> None:
    """A legacy BMC with no allowable numbers and no capacity is restored to no limit."""
    no_range = BmcPowerControl(_NoRange(session))
    reading = await no_range.read()
    assert (reading.limit_min_w, reading.limit_max_w) == (0.0, None)
    with pytest.raises(ConfigError, match="no allowable range"):
        await no_range.cap(800.0)
    assert await no_range.restore() == CapResult(limit_w=None, verified=True)
    assert (await control.read()).limit_w is None


@pytest.mark.parametrize("bmc_standin", ["controls"], indirect=True)
async def test_controls_restore_needs_a_maximum(
    bmc_standin: RedfishStandIn, control: BmcPowerControl
) -> None:
    """A control without AllowableMax cannot be restored (nor capped): nothing is written."""
    await control.discover()
    bmc_standin.fault("nan", value=None, path_prefix=CONTROLS["controls"])
    with pytest.raises(ConfigError, match="AllowableMax"):
        await control.restore()
    assert patches(bmc_standin) == []


class _NoRange:
    """A session that hides a legacy BMC's allowable numbers and capacity (a test seam)."""

    def __init__(self, session: RedfishSession) -> None:
        self._session = session

    async def get(self, path: str) -> Mapping[str, Any]:
        doc = dict(await self._session.get(path))
        if "PowerControl" not in doc:
            return doc
        first = dict(doc["PowerControl"][0])
        first.pop("PowerCapacityWatts")
        first["PowerLimit"] = {"LimitInWatts": first["PowerLimit"]["LimitInWatts"]}
        doc["PowerControl"] = [first]
        return doc

    async def patch(self, path: str, body: Mapping[str, Any]) -> None:
        await self._session.patch(path, body)

    async def close(self) -> None:
        await self._session.close()


async def test_liar_is_not_verified(bmc_standin: RedfishStandIn, control: BmcPowerControl) -> None:
    """A BMC that accepts the PATCH but keeps its limit gives verified=False, no exception."""
    await control.discover()
    bmc_standin.fault("liar")
    assert await control.cap(800.0) == CapResult(limit_w=1200.0, verified=False)
    assert await control.restore() == CapResult(limit_w=1200.0, verified=False)


@pytest.mark.parametrize("watts", [299.0, 1500.5, 0.0, -5.0, math.nan, math.inf])
async def test_out_of_range_cap_is_never_written(
    bmc_standin: RedfishStandIn, control: BmcPowerControl, watts: float
) -> None:
    """A cap outside the allowable range is a ConfigError, and no PATCH is sent."""
    with pytest.raises(ConfigError):
        await control.cap(watts)
    assert patches(bmc_standin) == []
    assert await control.cap(300.0) == CapResult(limit_w=300.0, verified=True)  # the edge


@pytest.mark.parametrize(
    ("mode", "opts", "reason"),
    [
        ("wrong_types", {}, "type"),
        ("nan", {}, "nan"),
        ("nan", {"value": -1}, "negative"),
        ("nan", {"value": 1e9}, "absurd"),
    ],
)
async def test_hostile_values_are_rejected(
    bmc_standin: RedfishStandIn,
    control: BmcPowerControl,
    mode: str,
    opts: dict[str, Any],
    reason: str,
) -> None:
    """Wrong types, NaN, -1 and absurd numbers are ReadingRejectedError with their reason."""
    await control.discover()
    bmc_standin.fault(mode, **opts)
    with pytest.raises(ReadingRejectedError) as caught:
        await control.read()
    assert caught.value.reason == reason
    with pytest.raises(ReadingRejectedError):
        await control.cap(800.0)
    assert patches(bmc_standin) == []


async def test_state_out_of_bounds_is_rejected(
    bmc_standin: RedfishStandIn, control: BmcPowerControl
) -> None:
    """An absurd limit (over 100 kW) or a minimum above the maximum is rejected."""
    bmc_standin.set_state("node1", limit_w=250_000.0, load_w=250_000.0)
    with pytest.raises(ReadingRejectedError) as absurd:
        await control.read()
    bmc_standin.set_state("node1", limit_w=1000.0, load_w=900.0, min_w=1400.0, max_w=1200.0)
    with pytest.raises(ReadingRejectedError) as inverted:
        await control.read()
    assert absurd.value.reason == inverted.value.reason == "absurd"


@pytest.mark.parametrize("bmc_standin", ["controls"], indirect=True)
async def test_power_from_the_sensor_link(
    bmc_standin: RedfishStandIn, control: BmcPowerControl
) -> None:
    """Without a reading in the Sensor excerpt, the power comes from the sensor it names."""
    bmc_standin.set_state("node1", excerpt_reading=False, load_w=700.0)
    assert (await control.read()).power_w == 700.0
    assert any(r["path"].endswith("/Sensors/TotalPower") for r in bmc_standin.requests())


class DictSession:
    """An in-memory Redfish service: documents by path (the seam, not the network)."""

    def __init__(self, docs: dict[str, dict[str, Any]]) -> None:
        self.docs = docs
        self.gets: list[str] = []

    async def get(self, path: str) -> Mapping[str, Any]:
        self.gets.append(path)
        if path not in self.docs:
            raise ReadingRejectedError(path, reason="not_found")
        return self.docs[path]

    async def patch(self, path: str, body: Mapping[str, Any]) -> None:
        raise AssertionError(path)

    async def close(self) -> None:
        return None


def tree(chassis: list[tuple[str, str, bool]]) -> dict[str, dict[str, Any]]:
    """A service with these chassis: (id, ChassisType, has a power control)."""
    docs: dict[str, dict[str, Any]] = {
        "/redfish/v1": {
            "@odata.type": "#ServiceRoot.v1_16_0.ServiceRoot",
            "Chassis": {"@odata.id": "/redfish/v1/Chassis"},
        },
        "/redfish/v1/Chassis": {
            "Members": [{"@odata.id": f"/redfish/v1/Chassis/{c}"} for c, _, _ in chassis]
        },
    }
    for cid, ctype, powered in chassis:
        path = f"/redfish/v1/Chassis/{cid}"
        docs[path] = {
            "@odata.type": "#Chassis.v1_23_0.Chassis",
            "ChassisType": ctype,
            "Controls": {"@odata.id": f"{path}/Controls"},
        }
        docs[f"{path}/Controls"] = {"Members": [{"@odata.id": f"{path}/Controls/P"}]}
        docs[f"{path}/Controls/P"] = {
            "@odata.type": "#Control.v1_3_0.Control",
            "ControlType": "Power" if powered else "Temperature",
            "SetPoint": 100,
        }
    return docs


async def test_sub_component_only_when_nothing_else() -> None:
    """A Module's control is used only when no node or enclosure chassis has one."""
    shape = await discover(DictSession(tree([("gpu", "Module", True), ("n", "RackMount", False)])))
    assert shape.control == "/redfish/v1/Chassis/gpu/Controls/P"
    shape = await discover(DictSession(tree([("gpu", "Module", True), ("e", "Enclosure", True)])))
    assert shape.control == "/redfish/v1/Chassis/e/Controls/P"


async def test_discovery_is_bounded() -> None:
    """More than MAX_CHASSIS chassis are refused as 'oversized' before any is read (never
    cut short: the node's control may be past the bound); MAX_CHASSIS are all examined."""
    many = [(f"c{i}", "RackMount", i == MAX_CHASSIS) for i in range(MAX_CHASSIS + 1)]
    session = DictSession(tree(many))
    with pytest.raises(ReadingRejectedError, match=f"at most {MAX_CHASSIS}") as caught:
        await discover(session)
    assert caught.value.reason == "oversized"
    assert session.gets == ["/redfish/v1", "/redfish/v1/Chassis"]
    docs = tree(many[1:])  # MAX_CHASSIS, the only one with Controls last
    for cid, _, powered in many[1:]:
        if not powered:
            del docs[f"/redfish/v1/Chassis/{cid}"]["Controls"]
    bounded = DictSession(docs)
    shape = await discover(bounded)
    assert shape.control == f"/redfish/v1/Chassis/c{MAX_CHASSIS}/Controls/P"
    assert len(bounded.gets) <= 2 + MAX_CHASSIS * 3


async def test_broken_chassis_are_skipped() -> None:
    """A chassis whose documents are missing or malformed does not stop discovery."""
    docs = tree([("gone", "RackMount", True), ("bad", "RackMount", True), ("ok", "Blade", True)])
    del docs["/redfish/v1/Chassis/gone"]
    docs["/redfish/v1/Chassis/bad/Controls"] = {"Members": "not a list"}
    shape = await discover(DictSession(docs))
    assert shape.control == "/redfish/v1/Chassis/ok/Controls/P"
