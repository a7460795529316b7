"""The shared readers of Redfish documents: links stay under /redfish/v1, collections are
bounded by refusal, types are checked; arbitrary JSON gives a result or a refusal, never a
crash or a path the HTTP client would not send."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polca.errors import ReadingRejectedError
from polca.redfish.documents import (
    as_object,
    check_type,
    checked_path,
    member_links,
    odata_link,
    resource_path,
)

WELL_FORMED = [
    ("/redfish/v1", "/redfish/v1"),
    ("/redfish/v1/", "/redfish/v1"),
    ("/redfish/v1/Chassis/System.Embedded.1", "/redfish/v1/Chassis/System.Embedded.1"),
    ("/redfish/v1/Chassis/1/", "/redfish/v1/Chassis/1"),
    ("/redfish/v1/Chassis/HGX_GPU_SXM_1/Controls/PowerLimit_0", None),
    ("/redfish/v1/Chassis/a:b-c/Sensors/x%20y", None),
]
HOSTILE = [
    "https://evil.example/redfish/v1/Chassis",
    "//evil.example/redfish/v1",
    "/redfish/v10/Chassis",
    "/redfish/v1x",
    "/etc/passwd",
    "redfish/v1/Chassis",
    "/redfish/v1//Chassis",
    "/redfish/v1/../v2",
    "/redfish/v1/Chassis/..",
    "/redfish/v1/./Chassis",
    "/redfish/v1/.",
    "/redfish/v1/%2e%2e/%2e%2e/etc/passwd",
    "/redfish/v1/%2E%2E/x",
    "/redfish/v1/Chassis%2f..%2fx",
    "/redfish/v1/Chassis?$expand=*",
    "/redfish/v1/Power#/PowerControl/0",
    "/redfish/v1/Chassis/a b",
    "/redfish/v1/\u00e9",
    "/redfish/v1/" + "x" * 600,
    "",
]


@pytest.mark.parametrize(("path", "expected"), WELL_FORMED)
def test_well_formed_paths_are_kept(path: str, expected: str | None) -> None:
    """Redfish paths pass as given, less a trailing slash."""
    assert resource_path(path, what="link") == (expected or path)


@pytest.mark.parametrize("value", [*HOSTILE, None, 42, ["/redfish/v1"], {"@odata.id": "/x"}])
def test_links_off_the_service_are_malformed(value: object) -> None:
    """A host, a scheme, a query or fragment, an empty, '.' or '..' segment, a percent-encoded
    dot or slash, another root, a non-string: malformed, each where it is a link."""
    with pytest.raises(ReadingRejectedError, match="not a Redfish path") as caught:
        resource_path(value, what="x.Link")
    assert caught.value.reason == "malformed"
    with pytest.raises(ReadingRejectedError) as linked:
        odata_link({"Link": {"@odata.id": value}}, "Link", what="doc")
    assert linked.value.reason == "malformed"
    with pytest.raises(ReadingRejectedError, match=r"Members\[1\]") as member:
        member_links(
            {"Members": [{"@odata.id": "/redfish/v1/a"}, {"@odata.id": value}]},
            what="c",
            limit=4,
        )
    assert member.value.reason == "malformed"


def test_a_collection_past_its_bound_is_refused_not_cut() -> None:
    """limit + 1 members: oversized, naming both counts; limit members: every one."""
    paths = [f"/redfish/v1/Chassis/c{i}" for i in range(9)]
    collection = {"Members": [{"@odata.id": p} for p in paths]}
    with pytest.raises(ReadingRejectedError, match="has 9 members; polca reads at most 8") as c:
        member_links(collection, what="/redfish/v1/Chassis", limit=8)
    assert c.value.reason == "oversized"
    assert member_links(collection, what="/redfish/v1/Chassis", limit=9) == tuple(paths)


def test_types_are_checked() -> None:
    """check_type: another type is identity; no or a non-string @odata.type is malformed."""
    assert check_type({"@odata.type": "#Chassis.v1_23_0.Chassis"}, "Chassis", what="c")
    cases = [
        ({"@odata.type": "#ChassisCollection.ChassisCollection"}, "identity"),
        ({"@odata.type": "#Control.v1_3_0.Control"}, "identity"),
        ({"@odata.type": ["#Chassis.v1_0_0.Chassis"]}, "malformed"),
        ({}, "malformed"),
        ([], "malformed"),
    ]
    for doc, reason in cases:
        with pytest.raises(ReadingRejectedError) as caught:
            check_type(doc, "Chassis", what="c")
        assert caught.value.reason == reason


_SEGMENT = st.one_of(
    st.text(alphabet="Aa0_.:-%2eEfF/?#@~ ", min_size=0, max_size=8),
    st.sampled_from(["..", ".", "%2e", "%2E%2e", "%2f", "Chassis", "1", ""]),
)
_PATHS = st.one_of(
    st.builds(lambda parts: "/redfish/v1/" + "/".join(parts), st.lists(_SEGMENT, max_size=4)),
    st.text(max_size=40),
)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _PATHS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(["@odata.id", "@odata.type", "Members"]), children)
    ),
    max_leaves=12,
)


def _accepted(path: str) -> None:
    """What a reader may follow: under /redfish/v1, and a path the HTTP client sends."""
    assert path == "/redfish/v1" or path.startswith("/redfish/v1/")
    assert not path.endswith("/")
    assert checked_path(path) == path


@given(value=_PATHS | _JSON)
def test_any_link_is_a_path_of_the_service_or_refused(value: Any) -> None:
    """Arbitrary JSON as a link: a path the client accepts, or malformed; nothing else."""
    try:
        path = resource_path(value, what="link")
    except ReadingRejectedError as exc:
        reason = exc.reason
    else:
        _accepted(path)
        return
    assert reason == "malformed"


@given(
    members=st.lists(st.one_of(st.builds(lambda p: {"@odata.id": p}, _PATHS), _JSON), max_size=8),
    limit=st.integers(min_value=0, max_value=8),
    doc=_JSON,
)
def test_any_collection_is_bounded_or_refused(members: list[Any], limit: int, doc: Any) -> None:
    """Arbitrary Members: at most ``limit`` distinct accepted paths, else oversized (when
    longer than ``limit``) or malformed; any document as a link holder or typed resource
    reads or is refused, never raises anything else."""
    reasons: list[str] = []
    try:
        paths = member_links({"Members": members}, what="c", limit=limit)
    except ReadingRejectedError as exc:
        reasons.append(exc.reason)
    else:
        assert len(members) <= limit
        assert len(set(paths)) == len(paths) <= len(members)
        for path in paths:
            _accepted(path)
    assert reasons in ([], ["oversized" if len(members) > limit else "malformed"])
    for read in (
        lambda: member_links(doc, what="c", limit=limit),
        lambda: odata_link(as_object(doc, what="d"), "@odata.id", what="d"),
        lambda: check_type(doc, "Chassis", what="d"),
    ):
        try:
            read()
        except ReadingRejectedError as exc:
            reasons.append(exc.reason)
    assert set(reasons) <= {"malformed", "oversized", "identity"}


def test_the_path_rule_is_written_once() -> None:
    """The client's requests and the readers' links share ``checked_path``: no other module
    compiles a ``/redfish/v1`` path pattern of its own."""
    package = Path(__file__).resolve().parents[2] / "daemon" / "polca"
    writers = sorted(
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if 're.compile(r"^/redfish/v1' in p.read_text(encoding="utf-8")
    )
    assert writers == ["redfish/documents.py"]


def test_a_path_with_rfc3986_characters_is_followed_and_dots_never_are() -> None:
    assert checked_path("/redfish/v1/Chassis/1U~A(1);x=y@z") == "/redfish/v1/Chassis/1U~A(1);x=y@z"
    for bad in ("/redfish/v1/Chassis/a..b", "/redfish/v1/Chassis/.", "/redfish/v1/a b"):
        with pytest.raises(ReadingRejectedError):
            checked_path(bad)
