"""deploy/nats/check-identities.py, the compensating check for NATS's unbound client ids,
and the units that run it every minute.

NATS server's MQTT gateway keys sessions by client id within an account, whatever the
user: one node's credential connecting with another node's client id evicts that node's
agent, anywhere in the cluster (deploy/nats/README.md, "A client id is not bound to its
user"). The tests below show the takeover still happens on a real 3-node cluster running
the shipped configuration with make-auth.py's users (as ``test_nats_roles``), and that the
check, run as the unit runs it (a subprocess, ``python -I``) against every node's
monitoring endpoint, reports it by exit status, line and textfile, and stays quiet while
every client holds its own id. A small local HTTP server stands in for an endpoint that
answers garbage.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_nats_roles import OBSERVER, make_auth, roles_cluster
from tests.mqtt_wire import SyncMqtt
from tests.nats_cluster import DEPLOY_CONF, NatsCluster
from tests.services import free_port
from tests.systemd_units import (
    CONTAINER_NOISE,
    Unit,
    assert_documented,
    assert_verified,
    exposure,
    parse_unit,
    run_analyze,
    systemd_analyze,
    verifiable_copy,
)

ROOT = Path(__file__).resolve().parents[2]
NATS_DIR = ROOT / "deploy" / "nats"
SCRIPT = NATS_DIR / "check-identities.py"
SERVICE = NATS_DIR / "nats-identity-check.service"
TIMER = NATS_DIR / "nats-identity-check.timer"
AGENT_UNIT = ROOT / "systemd" / "polca-agent.service"
DAEMON = ROOT / "daemon" / "polca"

WAIT_S = 20.0
"""Bound on every wait for the cluster; reached only when a test fails."""

UNCHECKED_PREFIXES = {"polca-demo-": "`polca demo` runs its own embedded broker, never NATS"}
"""polca client ids the check leaves unchecked on purpose, and why."""


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("polca_check_identities", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


script: Any = _load_script()


def run_check(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """check-identities.py as the unit runs it (isolated Python), with ``args``."""
    return subprocess.run(
        [sys.executable, "-I", str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def monitors(cluster: NatsCluster) -> list[str]:
    """``--monitor URL`` for every node of ``cluster``."""
    return [arg for node in cluster.nodes for arg in ("--monitor", node.url(""))]


def assert_one_error_line(result: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit 3, one line on stderr naming ``words``, no traceback."""
    assert result.returncode == 3, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("check-identities.py: error: ")
    assert all(word in lines[0] for word in words), lines[0]
    assert "Traceback" not in result.stdout + result.stderr


def metrics(path: Path) -> dict[str, float]:
    """The samples of a Prometheus textfile, by name (parsed by prometheus_client)."""
    text = path.read_text(encoding="utf-8")
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# --- The rules, without a cluster ------------------------------------------------------


@pytest.mark.parametrize(
    ("client_id", "user", "verdict"),
    [
        ("polca-agent-node1", "node1", "ok"),
        ("polca-agent-node2", "node1", "mismatch"),
        # Another user's node id is a mismatch whoever holds it: a service, or nobody.
        ("polca-agent-node2", "polca-aggregator", "mismatch"),
        ("polca-agent-node2", None, "mismatch"),
        ("polca-agent-node-2", "node-2", "ok"),
        ("polca-agent-", "node1", "mismatch"),
        ("polca-cdu-cdu1", "cdu1", "ok"),
        ("polca-cdu-cdu1", "cdu2", "mismatch"),
        ("polca-aggregator-agg1", "polca-aggregator", "ok"),
        ("polca-aggregator-agg1-nodes-0", "polca-aggregator", "ok"),
        ("polca-aggregator-agg1", "node1", "mismatch"),
        ("polca-assign-123-456", "polca-scheduler", "ok"),
        ("polca-assign-123-456", "polca-viewer", "mismatch"),
        ("polca-status-789", "polca-viewer", "ok"),
        ("polca-status-789", "node3", "mismatch"),
        ("polca-meter-dc1", "meter-row1", "ok"),
        ("polca-meter-dc1", "node1", "mismatch"),
        ("polca-site-dc1-site1", "polca-site", "ok"),
        ("polca-site-dc1-site1", "polca-aggregator", "mismatch"),
        ("polca-budget-123-456", "polca-operator", "ok"),
        ("polca-budget-123-456", "polca-site", "mismatch"),
        # Ids that name no owner are not judged.
        ("node1-custom", "node2", "unchecked"),
        ("polca-demo-cdus", "node2", "unchecked"),
        ("polca-test-ready-1", "polca-test-ready", "unchecked"),
        ("", "node1", "unchecked"),
    ],
)
def test_who_may_hold_a_client_id(client_id: str, user: str | None, verdict: str) -> None:
    """A node's or CDU's id belongs to the user of its name, a service's prefix to that
    service's user; anything else is unchecked."""
    allowed = script.owner(client_id, script.Users())
    got = "unchecked" if allowed is None else "ok" if allowed.allows(user) else "mismatch"
    assert got == verdict


def test_other_aggregator_users_are_accepted_when_named() -> None:
    """``--aggregator-user`` (several aggregators, each its own ``mqtt.username``)."""
    users = script.Users(aggregators=frozenset({"polca-aggregator", "polca-aggregator-2"}))
    assert script.owner("polca-aggregator-agg2", users).allows("polca-aggregator-2")
    assert not script.owner("polca-aggregator-agg2", script.Users()).allows("polca-aggregator-2")


def test_every_polca_client_id_prefix_is_checked() -> None:
    """Every ``polca-<role>-`` client id polca builds (daemon/polca, ``client_id``) has an
    owner in the script, except those left unchecked on purpose: a new role's id must be
    added to the check."""
    pattern = re.compile(r'client_id\b[^\n]*?"(polca-[a-z]+-)')
    found = {
        match.group(1)
        for path in DAEMON.rglob("*.py")
        for match in pattern.finditer(path.read_text(encoding="utf-8"))
    }
    assert {"polca-agent-", "polca-aggregator-", "polca-cdu-", "polca-meter-"} <= found
    unowned = {p for p in found if script.owner(f"{p}x", script.Users()) is None}
    assert unowned == set(UNCHECKED_PREFIXES)


def test_the_default_users_are_make_auths() -> None:
    """The service users the script expects are those make-acl.py / make-auth.py grant."""
    services = make_auth.acl.ServiceUsers()
    users = script.Users()
    assert users.aggregators == {services.aggregator}
    assert (users.scheduler, users.viewer) == (services.scheduler, services.viewer)
    assert (users.site, users.operator) == (services.site, services.operator)
    assert services.meter("row1").startswith(users.meter_prefix)
    assert script.owner("polca-meter-dc1", users).allows(services.meter("row7"))


def test_lines_escape_what_a_client_sends() -> None:
    """A client id or user is printed on one line, control characters escaped, cut short."""
    client = script.Client("nats-1", 7, "127.0.0.1:5", "polca-agent-x\nFAKE line\x1b[2J", "n1")
    line = script.mismatch_line(client)
    assert "\n" not in line
    assert "\x1b" not in line
    assert line.startswith("client id polca-agent-x\\nFAKE line\\x1b[2J held by user n1 ")
    assert len(script.shown("a" * 10_000)) == script.SHOWN_CHARS + 3


# --- Paging and hostile answers, in process --------------------------------------------


def _fake_server(connections: Sequence[Mapping[str, object]]) -> Callable[[str], bytes]:
    """A fetch function that pages ``connections`` as /connz does (offset, limit)."""

    def fetch(url: str) -> bytes:
        if url.endswith("/varz"):
            return json.dumps({"server_name": "fake-1"}).encode()
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
        offset, limit = int(query["offset"][0]), int(query["limit"][0])
        page = list(connections[offset : offset + limit])
        body = {"total": len(connections), "offset": offset, "limit": limit, "connections": page}
        return json.dumps(body).encode()

    return fetch


def _conn(cid: int, client_id: str | None, user: str | None = None) -> dict[str, object]:
    conn: dict[str, object] = {"cid": cid, "ip": "127.0.0.1", "port": 40000 + cid}
    if client_id is not None:
        conn["mqtt_client"] = client_id
    if user is not None:
        conn["authorized_user"] = user
    return conn


def test_every_page_is_read() -> None:
    """Connections over several pages are all read; non-MQTT ones are left out."""
    conns = [_conn(i, f"polca-agent-n{i}", f"n{i}") for i in range(5)] + [_conn(9, None)]
    name, clients = script.server_clients("http://fake", _fake_server(conns), page_limit=2)
    assert name == "fake-1"
    assert sorted(c.cid for c in clients) == [0, 1, 2, 3, 4]
    report = script.check(["http://fake"], script.Users(), fetch=_fake_server(conns), page_limit=2)
    assert (report.checked, report.unchecked, report.mismatches, report.failures) == (5, 0, [], [])


def _page(total: object = 1, connections: Sequence[object] | None = ()) -> dict[str, object]:
    """A /connz page asked with ``offset=0&limit=2``."""
    page: dict[str, object] = {"total": total, "offset": 0, "limit": 2}
    if connections is not None:
        page["connections"] = list(connections)
    return page


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (_page(connections=None), "no 'connections'"),
        (_page(total="1"), "'total' is str"),
        (_page(total=True), "'total' is bool"),
        (_page(connections=[[]]), "not a JSON object"),
        (_page(connections=[{"cid": 1, "mqtt_client": 5}]), "'mqtt_client' is int"),
        (_page(connections=[{"cid": -1}]), "'cid' is negative"),
        (_page(total=9, connections=[_conn(i, "x") for i in range(3)]), "on a page of 2"),
        (_page(total=10**6), "more than --max-connections"),
    ],
)
def test_a_malformed_page_is_an_error(answer: dict[str, object], words: str) -> None:
    """Each field is type-checked; a page larger than asked or a server with more
    connections than the bound is refused."""

    def fetch(url: str) -> bytes:
        return json.dumps({"server_name": "s"} if url.endswith("/varz") else answer).encode()

    with pytest.raises(script.CheckError, match=re.escape(words)):
        script.server_clients("http://fake", fetch, page_limit=2, max_connections=100)


def test_a_server_that_ignores_the_offset_is_an_error() -> None:
    """A server answering the first page again and again ends the read, not a loop."""
    conns = [_conn(i, "x") for i in range(4)]
    fake = _fake_server(conns)

    def fetch(url: str) -> bytes:
        return fake(re.sub(r"offset=\d+", "offset=0", url))

    with pytest.raises(script.CheckError, match="paging not honoured"):
        script.server_clients("http://fake", fetch, page_limit=2)


@pytest.mark.parametrize(
    "body",
    [b'{"server_name": "a", "server_name": "b"}', b'{"server_name": NaN}', b"[" * 100_000],
)
def test_strict_json(body: bytes) -> None:
    """Duplicate keys, NaN and absurd nesting are refused as malformed."""
    with pytest.raises(script.CheckError, match="not a JSON answer"):
        script.parse_json(body, where="x")


# --- A local HTTP server that answers garbage ------------------------------------------


@contextlib.contextmanager
def garbage_server(answers: Mapping[str, tuple[int, bytes]]) -> Iterator[str]:
    """An HTTP server on a loopback port answering each path (the query dropped) with a
    (status, body); yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = answers.get(self.path.split("?", 1)[0], (404, b"no such path"))
            self.send_response(status)
            if status in (301, 302):
                self.send_header("Location", "http://127.0.0.1:9/elsewhere")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="garbage-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


VARZ = json.dumps({"server_name": "nats-x"}).encode()
EMPTY_CONNZ = json.dumps({"total": 0, "offset": 0, "limit": 1024, "connections": []}).encode()


@pytest.mark.parametrize(
    ("answers", "words"),
    [
        ({"/varz": (200, VARZ), "/connz": (200, b"<html>\x00garbage")}, ("/connz", "not a JSON")),
        ({"/varz": (200, b"[1, 2]")}, ("/varz", "not a JSON object")),
        ({"/varz": (200, VARZ), "/connz": (200, b'{"total": "3"}')}, ("'total' is str",)),
        ({"/varz": (500, b"oops")}, ("/varz", "HTTP 500")),
        ({"/varz": (302, b"")}, ("/varz", "HTTP 302")),
    ],
)
def test_a_malformed_answer_exits_3_with_one_line(
    answers: Mapping[str, tuple[int, bytes]], words: tuple[str, ...]
) -> None:
    """Garbage, a wrong type, an error status or a redirect: exit 3, one stderr line."""
    with garbage_server(answers) as url:
        result = run_check("--monitor", url)
    assert_one_error_line(result, url, *words)


def test_an_answer_over_the_bound_is_refused() -> None:
    """An answer larger than the bound is an error, not read whole."""
    with garbage_server({"/varz": (200, b" " * 5000)}) as url:
        with pytest.raises(script.CheckError, match="larger than 1000 bytes"):
            script.http_get(f"{url}/varz", max_bytes=1000)
        assert script.http_get(f"{url}/varz", max_bytes=5000) == b" " * 5000


def test_an_unreachable_endpoint_exits_3_with_one_line() -> None:
    """Nothing listening: exit 3, one line naming the URL."""
    url = f"http://127.0.0.1:{free_port()}"
    result = run_check("--monitor", url, "--timeout", "5")
    assert_one_error_line(result, url, "unreachable")
    assert result.stdout.strip().endswith("1 of 1 server(s) not read")


@pytest.mark.parametrize(
    "args",
    [["--monitor", "ftp://127.0.0.1"], ["--monitor", "http://h/connz?x=1"], ["--timeout", "0"]],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    """A URL that is not an http(s) base URL, or a bound that is not positive: exit 2."""
    result = run_check(*args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr


# --- Against a real cluster ------------------------------------------------------------


@pytest.fixture(scope="module")
def identities(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[NatsCluster, dict[str, str]]]:
    """One TLS-only cluster with make-auth.py's users (as test_nats_roles), for the module."""
    yield from roles_cluster(tmp_path_factory.mktemp("nats-identity"))


def _mqtt_clients(cluster: NatsCluster, index: int, state: str = "open") -> list[dict[str, Any]]:
    connz = cluster.nodes[index].monitor(f"/connz?auth=true&state={state}&limit=4096")
    assert isinstance(connz, dict)
    return [c for c in connz["connections"] or [] if "mqtt_client" in c]


def _settle(cluster: NatsCluster) -> None:
    """Wait until no node lists an MQTT client (those of earlier tests have closed)."""
    deadline = time.monotonic() + WAIT_S
    while any(_mqtt_clients(cluster, i) for i in range(len(cluster.nodes))):
        assert time.monotonic() < deadline, "MQTT clients of an earlier test are still listed"
        time.sleep(0.1)


@contextlib.contextmanager
def connected(
    cluster: NatsCluster, passwords: Mapping[str, str], specs: Sequence[tuple[int, str, str]]
) -> Iterator[list[SyncMqtt]]:
    """A client per (node index, user, client id), connected in order; closed after."""
    with contextlib.ExitStack() as stack:
        clients: list[SyncMqtt] = []
        for index, user, client_id in specs:
            client = SyncMqtt.connect(
                cluster.mqtt_endpoints[index],
                client_id=client_id,
                user=user,
                password=passwords[user],
                tls=cluster.tls_context(),
                timeout_s=WAIT_S,
            )
            stack.callback(client.close)
            clients.append(client)
        yield clients


OWN_IDS = [
    (0, "node1", "polca-agent-node1"),
    (1, "node2", "polca-agent-node2"),
    (2, "polca-aggregator", "polca-aggregator-agg1"),
    (2, "polca-aggregator", "polca-aggregator-agg1-nodes-0"),
    (0, "cdu1", "polca-cdu-cdu1"),
    (1, "meter-row1", "polca-meter-dc1"),
    (0, "polca-scheduler", "polca-assign-4242-17"),
    (1, "polca-viewer", "polca-status-99"),
    (2, "polca-site", "polca-site-dc1-site1"),
    (0, "polca-operator", "polca-budget-4242-18"),
    (2, OBSERVER, "polca-test-observer-1"),
]
"""Every role on its own client id (spread over the nodes), and a test client's id."""


def test_every_client_on_its_own_id_passes(
    identities: tuple[NatsCluster, dict[str, str]],
) -> None:
    """Each role holding its own client id: exit 0, no line but the summary, the test
    client's id unchecked; reading node 0 one connection per page finds the same."""
    cluster, passwords = identities
    _settle(cluster)
    with connected(cluster, passwords, OWN_IDS):
        result = run_check(*monitors(cluster))
        paged = script.server_clients(cluster.nodes[0].url(""), script.http_get, page_limit=1)
        whole = script.server_clients(cluster.nodes[0].url(""), script.http_get)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "0 client id mismatch(es) among 11 MQTT client(s) on 3 server(s): 10 checked, 1 unchecked"
    ]
    assert paged == whole
    assert paged[0] == "nats-0"
    assert {(c.user, c.client_id) for c in paged[1]} == {
        (user, client_id) for index, user, client_id in OWN_IDS if index == 0
    }


def test_a_node_taking_another_nodes_id_is_reported(
    identities: tuple[NatsCluster, dict[str, str]],
) -> None:
    """node1's credential with node2's client id, on another node: NATS closes node2's
    connection (the takeover the check exists for), and the check exits 1 naming node1,
    polca-agent-node2, the server and the address."""
    cluster, passwords = identities
    _settle(cluster)
    with (
        connected(cluster, passwords, [(1, "node2", "polca-agent-node2")]) as (victim,),
        connected(cluster, passwords, [(0, "node1", "polca-agent-node2")]),
    ):
        # NATS still lets one user take over another user's session.
        with pytest.raises((ConnectionError, ssl.SSLError)):
            victim.next_message("polca/v1/none", wait_s=WAIT_S)
        result = run_check(*monitors(cluster))
    closed = [
        c
        for c in _mqtt_clients(cluster, 1, state="closed")
        if (c["mqtt_client"], c.get("authorized_user")) == ("polca-agent-node2", "node2")
    ]
    assert "Duplicate Client ID" in [c.get("reason") for c in closed]
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(
        r"client id polca-agent-node2 held by user node1 \(server nats-0, 127\.0\.0\.1:\d+\)",
        lines[0],
    )
    assert lines[1] == (
        "1 client id mismatch(es) among 1 MQTT client(s) on 3 server(s): 1 checked, 0 unchecked"
    )


def test_the_textfile_says_what_was_found(
    tmp_path: Path, identities: tuple[NatsCluster, dict[str, str]]
) -> None:
    """The textfile (mode 644, no temporary file left) counts the mismatches, here a
    service holding a node's id and a node holding the aggregator's, and says the check
    succeeded and when it ran; an unreachable endpoint makes it say the check failed."""
    cluster, passwords = identities
    textfile = tmp_path / "nats-identity.prom"
    specs = [
        (0, "polca-aggregator", "polca-aggregator-agg1"),
        (1, "polca-viewer", "polca-agent-node3"),
        (2, "node1", "polca-aggregator-agg1-nodes-0"),
        (2, OBSERVER, "polca-test-observer-2"),
    ]
    _settle(cluster)
    with connected(cluster, passwords, specs):
        before = time.time()
        result = run_check(*monitors(cluster), "--textfile", textfile)
        after = time.time()
    assert result.returncode == 1, result.stdout + result.stderr
    assert "client id polca-agent-node3 held by user polca-viewer (server nats-1" in result.stdout
    got = metrics(textfile)
    stamp = got.pop("polca_nats_identity_check_timestamp_seconds")
    assert before - 0.01 <= stamp <= after + 0.01
    assert got == {
        "polca_nats_client_id_mismatches": 2,
        "polca_nats_identity_checked_clients": 3,
        "polca_nats_identity_unchecked_clients": 1,
        "polca_nats_identity_check_success": 1,
    }
    assert textfile.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == [textfile.name]
    failed = run_check("--monitor", f"http://127.0.0.1:{free_port()}", "--textfile", textfile)
    assert failed.returncode == 3
    got = metrics(textfile)
    assert got["polca_nats_identity_check_success"] == 0
    assert got["polca_nats_client_id_mismatches"] == 0
    assert [p.name for p in tmp_path.iterdir()] == [textfile.name]


def test_a_textfile_that_cannot_be_written_fails_the_check(tmp_path: Path) -> None:
    """A textfile in a missing directory: one line, and the check fails (exit 3)."""
    with garbage_server({"/varz": (200, VARZ), "/connz": (200, EMPTY_CONNZ)}) as url:
        ok = run_check("--monitor", url, "--textfile", tmp_path / "ok.prom")
        result = run_check("--monitor", url, "--textfile", tmp_path / "missing" / "x.prom")
    assert ok.returncode == 0, ok.stderr
    assert metrics(tmp_path / "ok.prom")["polca_nats_identity_check_success"] == 1
    assert_one_error_line(result, "textfile", "not written")


# --- The units -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service() -> Unit:
    """The parsed service unit."""
    return parse_unit(SERVICE.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("Type", "oneshot"),
        ("DynamicUser", "yes"),
        ("CapabilityBoundingSet", ""),
        ("AmbientCapabilities", ""),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("PrivateUsers", "yes"),
        ("RuntimeDirectory", "polca-nats-identity"),
        ("RuntimeDirectoryPreserve", "yes"),
        ("IPAddressDeny", "any"),
        ("IPAddressAllow", "localhost"),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
    ],
)
def test_key_directive(service: Unit, key: str, value: str) -> None:
    """Each key directive is set exactly once, to the documented value."""
    assert service["Service"].get(key) == [value]


def test_every_directive_is_commented_and_none_trails() -> None:
    """A comment above every KEY=value line of both units, none after one."""
    assert_documented(SERVICE.read_text(encoding="utf-8"), at_least=35)
    assert_documented(TIMER.read_text(encoding="utf-8"), at_least=5)


def test_the_service_runs_the_script_on_this_hosts_endpoint(service: Unit) -> None:
    """ExecStart's options are the script's; it reads nats-server.conf's monitoring
    listener and writes the textfile into the unit's own Runtime directory."""
    argv = service["Service"]["ExecStart"][0].split()
    assert argv[:3] == ["/usr/bin/python3", "-I", f"/usr/local/lib/polca/{SCRIPT.name}"]
    args = script.parser().parse_args(argv[3:])
    http = re.search(r"(?m)^http: (\S+)$", DEPLOY_CONF.read_text(encoding="utf-8"))
    assert http is not None
    assert args.monitor == [f"http://{http.group(1)}"]
    directory = service["Service"]["RuntimeDirectory"][0]
    assert args.textfile.parent == Path("/run") / directory
    assert args.textfile.suffix == ".prom"  # node_exporter reads *.prom only
    assert service["Service"]["RuntimeDirectoryMode"] == ["0755"]


def test_the_timer_runs_the_service_every_minute() -> None:
    """The timer starts the service at every minute, within seconds."""
    timer = parse_unit(TIMER.read_text(encoding="utf-8"))
    assert timer["Timer"]["Unit"] == [SERVICE.name]
    assert timer["Timer"]["OnCalendar"] == ["*-*-* *:*:00"]
    assert timer["Install"]["WantedBy"] == ["timers.target"]
    result = run_analyze(
        [systemd_analyze(), "calendar", "--iterations=3", timer["Timer"]["OnCalendar"][0]],
        TIMER.parent,
    )
    assert result.returncode == 0, result.stderr
    assert "Normalized form: *-*-* *:*:00" in result.stdout


def test_systemd_analyze_verify_is_clean_and_catches_mistakes(tmp_path: Path) -> None:
    """systemd-analyze verify is clean on the service, and reports a misspelt key."""
    text = SERVICE.read_text(encoding="utf-8")
    misspelt = ("RuntimeDirectoryPreserve=yes", "RuntimeDirectoryPreserv=yes")
    assert_verified(tmp_path, SERVICE.name, text, misspelt=misspelt, host_noise=[CONTAINER_NOISE])


@pytest.mark.parametrize("mistake", [None, ("OnCalendar=", "OnCalender=")])
def test_systemd_analyze_verifies_the_timer(
    tmp_path: Path, mistake: tuple[str, str] | None
) -> None:
    """The timer, next to its service, verifies clean; a misspelt key is reported."""
    verifiable_copy(tmp_path, SERVICE.name, SERVICE.read_text(encoding="utf-8"))
    text = TIMER.read_text(encoding="utf-8")
    if mistake is not None:
        text = text.replace(*mistake)
    (tmp_path / TIMER.name).write_text(text, encoding="utf-8")
    result = run_analyze(
        [systemd_analyze(), "verify", "--man=no", "--recursive-errors=no", TIMER.name], tmp_path
    )
    lines = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and not CONTAINER_NOISE.search(line)
    ]
    if mistake is None:
        assert (result.returncode, lines) == (0, [])
    else:
        assert "OnCalender" in "\n".join(lines)


def test_security_exposure_is_low() -> None:
    """The sandbox scores well below the agent's (which needs the GPUs)."""
    score = exposure(SERVICE)
    assert score < 1.5
    assert score < exposure(AGENT_UNIT)


def test_the_readme_lists_the_new_files() -> None:
    """deploy/nats/README.md's file table has the script and both units."""
    readme = (NATS_DIR / "README.md").read_text(encoding="utf-8")
    table = [line for line in readme.splitlines() if line.startswith("| `")]
    for path in (SCRIPT, SERVICE, TIMER):
        assert any(f"`{path.name}`" in line.split("|")[1] for line in table), path.name
