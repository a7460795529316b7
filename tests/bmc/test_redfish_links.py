"""Hostile BMC answers: links off the service, too many members, the wrong ``@odata.type``.

``bmc/redfish.py`` follows links a BMC gives it and may PATCH what they lead to, so each
test here feeds discovery or a reading one hostile document and checks that it is refused
with a ``ReadingRejectedError`` naming the reason (before any request to the bad link),
never followed, cut short or written. Against the stand-in over HTTP where the stand-in can
serve it (a collection past the bound), else through ``Rewriting``, a session over the real
HTTP one that edits one document on its way (the documents are the stand-in's), or the
in-memory ``DictSession``, which serves any path it is asked for, as a session that does not
check paths would.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from polca.bmc import cli
from polca.bmc.redfish import MAX_CHASSIS, MAX_CONTROLS, BmcPowerControl, discover
from polca.errors import ReadingRejectedError
from polca.exits import EX_DATAERR
from polca.redfish.api import RedfishEndpoint, RedfishSession
from polca.redfish.client import connect
from tests.bmc.test_redfish import DictSession, tree
from tests.standins.fixtures import PASSWORD, USERNAME
from tests.standins.process import RedfishStandIn

NODE = "/redfish/v1/Chassis/node1"
NODE_CONTROL = f"{NODE}/Controls/NodePower"
EVIL = "https://evil.example/redfish/v1/Chassis/n"
HOSTILE_LINKS = [
    EVIL,
    "//evil.example/redfish/v1/Chassis",
    "/etc/passwd",
    "/redfish/v1/../../etc/passwd",
    "/redfish/v1/%2e%2e/%2e%2e/etc/passwd",
    "/redfish/v1/Chassis?$expand=*",
    42,
    ["/redfish/v1/Chassis"],
]

Edit = Callable[[str, dict[str, Any]], None]


class Rewriting:
    """The real HTTP session, with ``edit(path, doc)`` applied to every document it returns."""

    def __init__(self, session: RedfishSession, edit: Edit) -> None:
        self._session = session
        self._edit = edit

    async def get(self, path: str) -> Mapping[str, Any]:
        doc = dict(await self._session.get(path))
        self._edit(path, doc)
        return doc

    async def patch(self, path: str, body: Mapping[str, Any]) -> None:
        await self._session.patch(path, body)

    async def close(self) -> None:
        await self._session.close()


@pytest.fixture
async def http(bmc_standin: RedfishStandIn) -> AsyncIterator[RedfishSession]:
    """A logged-in HTTP session with the stand-in (the controls shape); closed after."""
    endpoint = RedfishEndpoint(url=bmc_standin.url, username=USERNAME, allow_http=True)
    session = await connect(endpoint, password=PASSWORD)
    yield session
    await session.close()


def _served(standin: RedfishStandIn, method: str) -> list[str]:
    return [r["path"] for r in standin.requests() if r["method"] == method]


# -- links off the service ------------------------------------------------------------------


@pytest.mark.parametrize("link", HOSTILE_LINKS)
async def test_a_chassis_link_off_the_service_is_refused_unfollowed(link: object) -> None:
    """A service root whose Chassis link leaves /redfish/v1 (another host, a dot segment, a
    percent-encoded dot, a query, not a string): malformed, and nothing but the root read."""
    docs = tree([("n", "RackMount", True)])
    docs["/redfish/v1"]["Chassis"] = {"@odata.id": link}
    if isinstance(link, str):
        docs[link] = docs["/redfish/v1/Chassis"]  # a session that serves any path
    session = DictSession(docs)
    with pytest.raises(ReadingRejectedError, match="not a Redfish path") as caught:
        await discover(session)
    assert caught.value.reason == "malformed"
    assert session.gets == ["/redfish/v1"]


@pytest.mark.parametrize("bmc_standin", ["controls"], indirect=True)
async def test_a_chassis_member_on_another_host_refuses_discovery(
    bmc_standin: RedfishStandIn, http: RedfishSession
) -> None:
    """A Chassis collection listing a chassis on another host is refused whole (malformed,
    naming the member), not quietly read around: nothing is PATCHed, no chassis read."""

    def edit(path: str, doc: dict[str, Any]) -> None:
        if path == "/redfish/v1/Chassis":
            doc["Members"] = [{"@odata.id": EVIL}, *doc["Members"]]

    control = BmcPowerControl(Rewriting(http, edit))
    with pytest.raises(ReadingRejectedError, match=r"Members\[0\]") as caught:
        await control.cap(800.0)
    assert caught.value.reason == "malformed"
    assert EVIL[:40] in str(caught.value)
    assert not [p for p in _served(bmc_standin, "GET") if p.startswith(NODE)]
    assert _served(bmc_standin, "PATCH") == []


@pytest.mark.parametrize("source", [EVIL, "/redfish/v1/../x", 7, {"@odata.id": NODE}])
@pytest.mark.parametrize("bmc_standin", ["controls"], indirect=True)
async def test_a_sensor_link_off_the_service_is_refused(
    bmc_standin: RedfishStandIn, http: RedfishSession, source: object
) -> None:
    """A control whose Sensor excerpt has no reading and a DataSourceUri that is not a path
    under /redfish/v1 (or not a string): the reading is refused (malformed), not read as
    'no power', and the link is never requested; a cap writes nothing."""
    bmc_standin.set_state("node1", excerpt_reading=False)

    def edit(path: str, doc: dict[str, Any]) -> None:
        if path == NODE_CONTROL:
            doc["Sensor"] = {"DataSourceUri": source}

    control = BmcPowerControl(Rewriting(http, edit))
    with pytest.raises(ReadingRejectedError, match="DataSourceUri") as caught:
        await control.read()
    assert caught.value.reason == "malformed"
    with pytest.raises(ReadingRejectedError):
        await control.cap(800.0)
    assert not [p for p in _served(bmc_standin, "GET") if p.endswith("/Sensors/TotalPower")]
    assert _served(bmc_standin, "PATCH") == []


async def test_a_sensor_link_names_a_sensor() -> None:
    """The document a DataSourceUri leads to must be a Sensor (identity), else no reading."""
    docs = tree([("n", "RackMount", True)])
    path = "/redfish/v1/Chassis/n/Controls/P"
    docs[path].update(AllowableMin=10, AllowableMax=200, Sensor={"DataSourceUri": path})
    with pytest.raises(ReadingRejectedError, match="not a Sensor") as caught:
        await BmcPowerControl(DictSession(docs)).read()
    assert caught.value.reason == "identity"


# -- too many members -------------------------------------------------------------------------


def test_more_chassis_than_the_bound_is_refused_over_http(
    standin_factory: Callable[..., RedfishStandIn],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A BMC listing more than MAX_CHASSIS chassis (two a node here): polca bmc probe exits
    65 with one line naming 'oversized', after reading the root and the collection only;
    cutting the list short would have capped whatever its first chassis offered."""
    nodes = MAX_CHASSIS // 2 + 1
    standin = standin_factory(
        devices=[f"bmc:n{i}:controls" for i in range(nodes)], username=USERNAME, password=PASSWORD
    )
    password = tmp_path / "pw"
    password.write_text(PASSWORD + "\n", encoding="utf-8")
    p = argparse.ArgumentParser(prog="polca")
    cli.add_parsers(p.add_subparsers(dest="command", required=True))
    argv = ["bmc", "probe", standin.url, "--username", USERNAME, "--password-file", str(password)]
    code = cli.main(p.parse_args(argv))
    out, err = capsys.readouterr()
    assert (code, out) == (EX_DATAERR, "")
    assert len(err.splitlines()) == 1
    assert "(oversized)" in err
    assert f"{2 * nodes} members" in err
    gets = [g for g in _served(standin, "GET") if g.startswith("/redfish/v1/Chassis")]
    assert gets == ["/redfish/v1/Chassis"]


async def test_a_controls_collection_past_the_bound_is_refused() -> None:
    """A Controls collection of MAX_CONTROLS + 1 members, the node's power control last:
    oversized (not 'no power control', as a cut-short list would find)."""
    docs = tree([("n", "RackMount", True)])
    controls = "/redfish/v1/Chassis/n/Controls"
    members = [f"{controls}/T{i}" for i in range(MAX_CONTROLS)] + [f"{controls}/P"]
    docs[controls] = {"Members": [{"@odata.id": m} for m in members]}
    for member in members[:-1]:
        docs[member] = {"@odata.type": "#Control.v1_3_0.Control", "ControlType": "Temperature"}
    session = DictSession(docs)
    with pytest.raises(ReadingRejectedError, match=f"at most {MAX_CONTROLS}") as caught:
        await discover(session)
    assert caught.value.reason == "oversized"
    assert not [g for g in session.gets if g.startswith(f"{controls}/")]


async def test_controls_past_the_bound_over_all_chassis_are_refused() -> None:
    """A Module's controls and then the node's exceed MAX_CONTROLS together: refused
    (oversized), where a budget cut short would have capped the Module's control instead
    of the node's."""
    docs = tree([("gpu", "Module", True), ("n", "RackMount", True)])
    half = MAX_CONTROLS // 2 + 1
    for cid in ("gpu", "n"):
        controls = f"/redfish/v1/Chassis/{cid}/Controls"
        members = [f"{controls}/T{i}" for i in range(half - 1)] + [f"{controls}/P"]
        docs[controls] = {"Members": [{"@odata.id": m} for m in members]}
        for member in members[:-1]:
            docs[member] = {"@odata.type": "#Control.v1_3_0.Control", "ControlType": "Fan"}
    with pytest.raises(ReadingRejectedError, match="over all chassis") as caught:
        await discover(DictSession(docs))
    assert caught.value.reason == "oversized"


# -- the wrong @odata.type ------------------------------------------------------------------


@pytest.mark.parametrize("bmc_standin", ["controls"], indirect=True)
async def test_a_power_control_of_another_type_is_never_written(
    bmc_standin: RedfishStandIn, http: RedfishSession
) -> None:
    """NodePower answering as a Sensor (ControlType and SetPoint still there) is no
    candidate: the cap goes to the node's legacy Power resource, never to that document."""

    def edit(path: str, doc: dict[str, Any]) -> None:
        if path == NODE_CONTROL:
            doc["@odata.type"] = "#Sensor.v1_9_0.Sensor"

    control = BmcPowerControl(Rewriting(http, edit))
    shape = await control.discover()
    assert (shape.kind, shape.control) == ("legacy", f"{NODE}/Power")
    assert (await control.cap(800.0)).verified
    assert _served(bmc_standin, "PATCH") == [f"{NODE}/Power"]


@pytest.mark.parametrize("bmc_standin", ["controls"], indirect=True)
async def test_a_control_that_changes_type_after_discovery_is_refused(
    bmc_standin: RedfishStandIn, http: RedfishSession
) -> None:
    """The discovered control read back as another resource type: identity, nothing
    written."""
    odata_type = {"value": "#Control.v1_3_0.Control"}

    def edit(path: str, doc: dict[str, Any]) -> None:
        if path == NODE_CONTROL:
            doc["@odata.type"] = odata_type["value"]

    control = BmcPowerControl(Rewriting(http, edit))
    assert (await control.discover()).control == NODE_CONTROL
    odata_type["value"] = "#Chassis.v1_23_0.Chassis"
    with pytest.raises(ReadingRejectedError, match="not a Control") as caught:
        await control.cap(800.0)
    assert caught.value.reason == "identity"
    assert _served(bmc_standin, "PATCH") == []


@pytest.mark.parametrize(
    ("odata_type", "reason"),
    [("#Chassis.v1_23_0.Chassis", "identity"), (None, "malformed"), (7, "malformed")],
)
async def test_a_service_root_of_another_type_is_refused(odata_type: object, reason: str) -> None:
    """A service root that is not a ServiceRoot is refused before its links are followed."""
    docs = tree([("n", "RackMount", True)])
    docs["/redfish/v1"]["@odata.type"] = odata_type
    session = DictSession(docs)
    with pytest.raises(ReadingRejectedError) as caught:
        await discover(session)
    assert caught.value.reason == reason
    assert session.gets == ["/redfish/v1"]


async def test_skipped_chassis_are_named_in_the_refusal() -> None:
    """No usable chassis: 'unsupported', saying what was wrong with each one skipped."""
    docs = tree([("a", "RackMount", True), ("b", "RackMount", True)])
    docs["/redfish/v1/Chassis/a"]["@odata.type"] = "#Manager.v1_19_0.Manager"
    docs["/redfish/v1/Chassis/b"]["Controls"] = {"@odata.id": EVIL}
    with pytest.raises(ReadingRejectedError) as caught:
        await discover(DictSession(docs))
    assert caught.value.reason == "unsupported"
    message = str(caught.value)
    assert "/redfish/v1/Chassis/a is a '#Manager" in message
    assert "(identity)" in message
    assert "/redfish/v1/Chassis/b.Controls is not a Redfish path" in message
    assert "(malformed)" in message
