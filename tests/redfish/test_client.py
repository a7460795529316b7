"""The Redfish HTTP client against the stand-in, a real server process on loopback."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from polca.errors import ConfigError, ReadingRejectedError, TransportAuthError, TransportError
from polca.redfish.api import RedfishEndpoint
from polca.redfish.client import MAX_DEPTH, HttpRedfishSession, connect
from polca.redfish.client import decode_document as decode
from polca.redfish.documents import checked_path
from tests.fuzzing import FUZZ
from tests.services import free_port
from tests.standins.fixtures import PASSWORD, USERNAME, TlsFiles
from tests.standins.process import RedfishStandIn

CONTROL = "/redfish/v1/Chassis/node1/Controls/NodePower"


def endpoint(standin: RedfishStandIn, **over: Any) -> RedfishEndpoint:
    """The stand-in as a configured endpoint (plain HTTP allowed), with ``over`` applied."""
    fields: dict[str, Any] = {
        "url": standin.url,
        "username": USERNAME,
        "allow_http": True,
        "timeout_s": 2.0,
    }
    return RedfishEndpoint(**(fields | over))


async def session_of(standin: RedfishStandIn, **over: Any) -> HttpRedfishSession:
    """A logged-in session with the stand-in."""
    return await connect(endpoint(standin, **over), password=PASSWORD)


def served(standin: RedfishStandIn, method: str, path: str) -> list[dict[str, Any]]:
    """The requests the stand-in served with this method and path."""
    return [r for r in standin.requests() if (r["method"], r["path"]) == (method, path)]


async def test_session_login_and_logout(redfish_standin: RedfishStandIn) -> None:
    """A user logs in with a Redfish session, uses its token and deletes it on close."""
    session = await session_of(redfish_standin)
    chassis = await session.get("/redfish/v1/Chassis")
    await session.close()
    await session.close()  # idempotent
    assert chassis["Members@odata.count"] == 2
    log = redfish_standin.requests()
    assert [(r["method"], r["status"]) for r in log] == [
        ("GET", 200),
        ("POST", 201),
        ("GET", 200),
        ("DELETE", 204),
    ]
    assert log[2]["auth"] == "token"
    assert log[3]["path"] == "/redfish/v1/SessionService/Sessions/1"


async def test_basic_auth_without_a_session_service(
    standin_factory: Callable[..., RedfishStandIn],
) -> None:
    """A service without a session service is spoken to with HTTP basic auth."""
    standin = standin_factory(
        devices=["bmc:node1"], username=USERNAME, password=PASSWORD, session_service=False
    )
    session = await session_of(standin)
    try:
        control = await session.get(CONTROL)
    finally:
        await session.close()
    assert control["ControlType"] == "Power"
    log = standin.requests()
    assert [(r["method"], r["path"], r["auth"]) for r in log] == [
        ("GET", "/redfish/v1", None),  # no Links.Sessions: no session service
        ("GET", CONTROL, "basic"),
    ]  # and nothing to delete on close


async def test_wrong_password_is_an_auth_error(redfish_standin: RedfishStandIn) -> None:
    """Refused credentials are TransportAuthError (fatal), at connect."""
    with pytest.raises(TransportAuthError, match="401"):
        await connect(endpoint(redfish_standin), password="wrong")  # noqa: S106 - a test value


async def test_relogin_once_when_the_session_expired(redfish_standin: RedfishStandIn) -> None:
    """A 401 on a session token logs in again and retries the request once."""
    session = await session_of(redfish_standin)
    try:
        await session.get("/redfish/v1/Chassis")
        redfish_standin.expire_sessions()
        chassis = await session.get("/redfish/v1/Chassis")
    finally:
        await session.close()
    assert chassis["Members@odata.count"] == 2
    statuses = [(r["method"], r["status"]) for r in redfish_standin.requests()]
    assert [s for s in statuses if s != ("GET", 200)] == [
        ("POST", 201),
        ("GET", 401),
        ("POST", 201),
        ("DELETE", 204),
    ]
    assert statuses[-2:] == [("GET", 200), ("DELETE", 204)]


async def test_password_from_file_and_missing_password(
    redfish_standin: RedfishStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The password comes from password_file; a user without one is a ConfigError."""
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD + "\n", encoding="utf-8")
    session = await connect(endpoint(redfish_standin, password_file=secret))
    await session.close()
    with pytest.raises(ConfigError, match="no password"):
        await connect(endpoint(redfish_standin))


async def test_anonymous_service(standin_factory: Callable[..., RedfishStandIn]) -> None:
    """Without a user nothing logs in; requests go out unauthenticated."""
    standin = standin_factory(devices=["bmc:node1"])
    session = await connect(endpoint(standin, username=None))
    try:
        root = await session.get("/redfish/v1/")
    finally:
        await session.close()
    assert root["Chassis"] == {"@odata.id": "/redfish/v1/Chassis"}
    assert [(r["method"], r["auth"]) for r in standin.requests()] == [("GET", None)]


@pytest.mark.parametrize(
    ("mode", "opts", "error", "reason"),
    [
        ("error500", {}, TransportError, None),
        ("unauthorized", {}, TransportAuthError, None),
        ("redirect_offhost", {}, ReadingRejectedError, "redirect"),
        ("redirect_samehost", {"hops": 10}, ReadingRejectedError, "redirect"),
        ("oversized", {}, ReadingRejectedError, "oversized"),
        ("oversized", {"chunked": True}, ReadingRejectedError, "oversized"),
        ("deep", {}, ReadingRejectedError, "malformed"),
        ("deep", {"depth": 40}, ReadingRejectedError, "malformed"),  # parses, but too deep
    ],
)
async def test_hostile_answers(
    redfish_standin: RedfishStandIn,
    mode: str,
    opts: dict[str, Any],
    error: type[Exception],
    reason: str | None,
) -> None:
    """Each hostile answer becomes the documented error, never anything else."""
    session = await session_of(redfish_standin)
    try:
        redfish_standin.fault(mode, **opts)
        with pytest.raises(error) as caught:
            await session.get(CONTROL)
    finally:
        redfish_standin.fault("none")
        await session.close()
    if reason is not None:
        assert isinstance(caught.value, ReadingRejectedError)
        assert caught.value.reason == reason
    if error is TransportError:
        assert not isinstance(caught.value, TransportAuthError)


async def test_oversized_is_refused_without_reading_it(redfish_standin: RedfishStandIn) -> None:
    """A 20 MB answer over a small bound is refused quickly (by Content-Length, or streamed)."""
    session = await session_of(redfish_standin, max_body_bytes=4096)
    try:
        redfish_standin.fault("oversized", chunked=True)
        start = time.monotonic()
        with pytest.raises(ReadingRejectedError) as caught:
            await session.get(CONTROL)
        elapsed_s = time.monotonic() - start
    finally:
        redfish_standin.fault("none")
        await session.close()
    assert caught.value.reason == "oversized"
    assert "over 4096 bytes" in str(caught.value)
    assert elapsed_s < 5.0, "read the whole answer before refusing it"


async def test_same_origin_redirects_are_followed(redfish_standin: RedfishStandIn) -> None:
    """Up to three redirects to the service itself are followed."""
    session = await session_of(redfish_standin)
    try:
        redfish_standin.fault("redirect_samehost", hops=3)
        control = await session.get(CONTROL)
    finally:
        await session.close()
    assert control["Id"] == "NodePower"
    assert [r["status"] for r in served(redfish_standin, "GET", CONTROL)] == [302] * 3 + [200]


async def test_offhost_redirect_is_never_followed(redfish_standin: RedfishStandIn) -> None:
    """A redirect to another host is refused before any connection to it (no timeout)."""
    session = await session_of(redfish_standin, timeout_s=20.0)
    try:
        redfish_standin.fault("redirect_offhost")
        start = time.monotonic()
        with pytest.raises(ReadingRejectedError, match="another origin"):
            await session.get(CONTROL)
        assert time.monotonic() - start < 10.0, "tried the other host until the deadline"
    finally:
        redfish_standin.fault("none")
        await session.close()


async def test_not_found(redfish_standin: RedfishStandIn) -> None:
    """A 404 is ReadingRejectedError with reason not_found."""
    session = await session_of(redfish_standin)
    try:
        with pytest.raises(ReadingRejectedError) as caught:
            await session.get("/redfish/v1/Chassis/nope")
    finally:
        await session.close()
    assert caught.value.reason == "not_found"


async def test_timeout_bound_holds(redfish_standin: RedfishStandIn) -> None:
    """A service that answers after 30 s is a TransportError after timeout_s."""
    session = await session_of(redfish_standin, timeout_s=0.5)
    try:
        redfish_standin.fault("slow", delay_s=30)
        start = time.monotonic()
        with pytest.raises(TransportError, match=r"no answer within 0\.5 s"):
            await session.get(CONTROL)
        elapsed_s = time.monotonic() - start
    finally:
        redfish_standin.fault("none")
        await session.close()
    assert 0.4 < elapsed_s < 15.0, "waited for the answer (30 s), not the deadline"


async def test_unreachable_is_a_transport_error() -> None:
    """Nothing listening is a TransportError, not an aiohttp error."""
    url = f"http://127.0.0.1:{free_port()}"
    ep = RedfishEndpoint(url=url, allow_http=True, timeout_s=1.0)
    session = await connect(ep)
    try:
        with pytest.raises(TransportError, match="cannot reach"):
            await session.get("/redfish/v1")
    finally:
        await session.close()
    with pytest.raises(TransportError, match="closed"):
        await session.get("/redfish/v1")


@pytest.mark.parametrize(
    "path",
    [
        "/redfish/v1/../../etc/passwd",
        "/redfish/v1/Chassis/%2e%2e/x",
        "http://evil.example/redfish/v1",
        "//evil.example/redfish/v1",
        "/redfish/v10",
        "/other/v1",
        "/redfish/v1/Chassis?$expand=*",
        "/redfish/v1//Chassis",
    ],
)
async def test_paths_elsewhere_are_refused_before_any_request(
    redfish_standin: RedfishStandIn, path: str
) -> None:
    """An odata.id that leaves the service's Redfish tree is malformed; nothing is sent."""
    session = await session_of(redfish_standin)
    redfish_standin.clear_log()
    try:
        with pytest.raises(ReadingRejectedError) as caught:
            await session.get(path)
        with pytest.raises(ReadingRejectedError):
            await session.patch(path, {"SetPoint": 1})
    finally:
        await session.close()
    assert caught.value.reason == "malformed"
    assert [r["method"] for r in redfish_standin.requests()] == ["DELETE"]


async def test_patch_sends_if_match_from_the_last_get(redfish_standin: RedfishStandIn) -> None:
    """A PATCH after a GET carries the ETag; without a GET it carries none."""
    session = await session_of(redfish_standin)
    try:
        await session.patch(CONTROL, {"SetPoint": 1000})
        await session.get(CONTROL)
        await session.patch(CONTROL, {"SetPoint": 1100})
        after = await session.get(CONTROL)
    finally:
        await session.close()
    patches = served(redfish_standin, "PATCH", CONTROL)
    assert [p["status"] for p in patches] == [204, 204]
    assert patches[0]["if_match"] is None
    assert patches[1]["if_match"] is not None
    assert patches[1]["if_match"].startswith('"')
    assert after["SetPoint"] == 1100


async def test_stale_etag_and_refused_patch(redfish_standin: RedfishStandIn) -> None:
    """A 412 (changed since the GET) and a 400 (out of range) are refused, with the reason."""
    session = await session_of(redfish_standin)
    try:
        await session.get(CONTROL)
        redfish_standin.set_state("node1", limit_w=800)
        with pytest.raises(ReadingRejectedError, match="412") as stale:
            await session.patch(CONTROL, {"SetPoint": 1000})
        with pytest.raises(ReadingRejectedError, match="out of the range") as refused:
            await session.patch(CONTROL, {"SetPoint": 5000})
    finally:
        await session.close()
    assert stale.value.reason == refused.value.reason == "refused"


def test_plain_http_needs_allow_http() -> None:
    """An http:// endpoint is refused unless allow_http is set."""
    with pytest.raises(ValidationError, match="allow_http"):
        RedfishEndpoint(url="http://127.0.0.1:8000")
    assert RedfishEndpoint(url="http://127.0.0.1:8000", allow_http=True).allow_http


async def test_tls_verified_with_the_ca_file(
    standin_factory: Callable[..., RedfishStandIn], tls_files: TlsFiles
) -> None:
    """HTTPS is verified: trusted with ca_file, refused without, accepted when turned off."""
    standin = standin_factory(
        devices=["bmc:node1"],
        username=USERNAME,
        password=PASSWORD,
        tls=(tls_files.cert, tls_files.key),
    )
    assert standin.url.startswith("https://")
    session = await session_of(standin, ca_file=tls_files.ca, allow_http=False)
    try:
        assert (await session.get(CONTROL))["Id"] == "NodePower"
    finally:
        await session.close()
    with pytest.raises(TransportError, match="ca_file") as caught:
        await session_of(standin, allow_http=False)
    assert not isinstance(caught.value, TransportAuthError)
    insecure = await session_of(standin, verify_tls=False)
    await insecure.close()


def nested(depth: int) -> bytes:
    """A JSON object nested ``depth`` levels deep (objects and arrays alternating)."""
    value: Any = 1
    for level in range(depth - 1):
        value = {"a": value} if level % 2 else [value]
    return json.dumps({"a": value}).encode()


@FUZZ
@given(depth=st.integers(min_value=1, max_value=3 * MAX_DEPTH))
def test_depth_bound(depth: int) -> None:
    """Documents nested up to MAX_DEPTH parse; deeper ones are malformed."""
    if depth <= MAX_DEPTH:
        assert isinstance(decode(nested(depth), what="t"), dict)
    else:
        with pytest.raises(ReadingRejectedError) as caught:
            decode(nested(depth), what="t")
        assert caught.value.reason == "malformed"


def test_very_deep_documents_are_malformed() -> None:
    """Nesting far past the recursion limit is malformed, not a RecursionError."""
    for body in (b"[" * 200_000 + b"]" * 200_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        with pytest.raises(ReadingRejectedError) as caught:
            decode(body, what="t")
        assert caught.value.reason == "malformed"


@FUZZ
@given(body=st.binary(max_size=256) | st.from_regex(rb"\A[\[\]{}:,\"a0-9 ]{0,64}\Z"))
def test_any_bytes_decode_or_are_malformed(body: bytes) -> None:
    """No body makes decode_document raise anything but ReadingRejectedError."""
    reason = None
    try:
        document: object = decode(body, what="t")
    except ReadingRejectedError as exc:
        reason = exc.reason
        document = {}
    assert reason in {None, "malformed"}
    assert isinstance(document, dict)


@FUZZ
@given(path=st.text(max_size=80) | st.builds("/redfish/v1/{}".format, st.text(max_size=40)))
def test_checked_paths_stay_in_the_redfish_tree(path: str) -> None:
    """A path either stays under /redfish/v1 without dot segments, or is malformed."""
    reason: str | None = None
    try:
        checked = checked_path(path)
    except ReadingRejectedError as exc:
        reason = exc.reason
    else:
        assert checked == path
        assert path == "/redfish/v1" or path.startswith("/redfish/v1/")
        assert ".." not in path.split("/")
        assert "//" not in path
    assert reason in {None, "malformed"}
