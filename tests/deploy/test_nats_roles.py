"""Every role against a real 3-node NATS cluster with deploy/nats's generated authorization.

The cluster runs ``deploy/nats/nats-server.conf`` as shipped (MQTT over TLS only, routes
over mutual TLS) with the users and permissions that ``deploy/nats/make-auth.py`` builds
from the strict topology of ``test_mosquitto_roles`` (its tables are reused: the same
users, the same universe of topics, the same writes). Each user connects to its own node
(user k to node k mod 3), so every grant is checked away from the writer's node too.

NATS refuses a subscription wider than the grants instead of filtering what it delivers
(Mosquitto's way), so reads are probed topic by topic: every user subscribes to every
topic of the universe (and to ``#``) in one SUBSCRIBE, and the test compares the granted
filters and the messages received, retained and live, with the role matrix. A refused
subscription must deliver nothing, retained messages included: releases before
2.12.12 / 2.14.3 delivered retained messages and QoS replays past subscribe-deny rules.
The reads differ from Mosquitto's only where make-auth.py grants the filters polca's
own tools subscribe with (``WIDE_READS``); ``polca status`` runs against the cluster to
prove its filters are granted.

As in ``mosquitto_rig``, test-only users and grants decide nothing about polca's topics:
``polca-test-observer`` reads everything, ``polca-test-writer`` writes everything,
``polca-test-ready`` has ``polca-test/ready/#`` (the rig's readiness checks), and every
user may read its own end marker ``polca-test/done/<user>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import aiomqtt
import pytest

from tests.deploy.test_mosquitto_roles import (
    S_NODES,
    S_READS,
    S_TOPOLOGY,
    S_UNIVERSE,
    S_USERS,
    S_WRITES,
    SITE,
    TOPICS,
    node,
    site_controller_filters,
)
from tests.mqtt_broker import make_tls_files
from tests.mqtt_wire import connect_packet, mqtt_client, vanish_with_will
from tests.nats_cluster import NATS_SERVER, NatsAuth, NatsCluster

ROOT = Path(__file__).resolve().parents[2]
MAKE_AUTH = ROOT / "deploy" / "nats" / "make-auth.py"

WAIT_S = 20.0
"""Bound on every wait for the cluster; reached only when a test fails."""

OBSERVER = "polca-test-observer"
WRITER = "polca-test-writer"
READY = "polca-test-ready"
TEST_USERS = (OBSERVER, WRITER, READY)
SENTINEL = "polca-test/sentinel"
"""Published retained after the universe: once a node serves it, it serves all of it."""

WIDE_READS: dict[str, list[str]] = {
    # polca status --site dc1 (polca/status.py, collect).
    "polca-viewer": [
        TOPICS.row_summary(SITE, "+"),
        TOPICS.row_control(SITE, "+"),
        TOPICS.rack_control(SITE, "+", "+"),
        TOPICS.all_nodes(SITE, "+", "status"),
        TOPICS.all_nodes(SITE, "+", "state"),
        TOPICS.aggregator(SITE, "+", "status"),
    ],
    # polca assign finding a node (polca/assign/publish.py).
    "polca-scheduler": [f"{TOPICS.root}/{SITE}/+/+/{name}/status" for name in S_NODES],
    # polca cdu simulate --rack row2/rack9 (polca/cdu/cli.py).
    "cdu2": [TOPICS.all_nodes(SITE, "row2", "telemetry")],
}
"""The filters polca's tools subscribe with that are wider than the strict ACL's grants,
built here from polca's own ``Topics``; make-auth.py grants them on NATS."""

POWER_TREE_FILTERS: dict[str, list[str]] = {
    # polca site run (polca/sitectl/core.py, SiteCore.subscriptions), and the limit on a
    # domain of its tree that it takes.
    "polca-site": [*site_controller_filters(), TOPICS.budget_limit(SITE, "ups-a")],
    # polca budget (polca/sitectl/budget.py): the site report, the rows' budgets and
    # summaries, and the limit it sets read back.
    "polca-operator": [
        TOPICS.site_report(SITE),
        TOPICS.budget(SITE, "+"),
        TOPICS.row_summary(SITE, "+"),
        TOPICS.budget_limit(SITE, "ups-a"),
    ],
}
"""What the site controller and the operator subscribe to: within their site-wide grants,
so make-auth.py widens nothing for them."""


def _nats_reads() -> dict[str, list[str]]:
    """S_READS plus the topics of the universe that ``WIDE_READS`` match."""
    reads = {user: set(topics) for user, topics in S_READS.items()}
    for user, filters in WIDE_READS.items():
        reads[user] |= {t for t in S_UNIVERSE if any(aiomqtt.Topic(t).matches(f) for f in filters)}
    return {user: sorted(topics) for user, topics in reads.items()}


N_READS = _nats_reads()


def _load_make_auth() -> ModuleType:
    spec = importlib.util.spec_from_file_location("polca_make_auth", MAKE_AUTH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


make_auth: Any = _load_make_auth()


def done_topic(user: str) -> str:
    """The end marker of the probes for ``user``, which only ``user`` may read."""
    return f"polca-test/done/{user}"


def role_grants(config: Path) -> dict[str, Any]:
    """make-auth.py's grants for ``config`` (cdu2 simulated), plus the probes' grants."""
    grants: dict[str, Any] = make_auth.configs_grants([config], simulated=["cdu2"])
    for user in [*grants, *TEST_USERS]:
        grants.setdefault(user, make_auth.Grants())
        grants[user].add(subscribe=make_auth.subjects(done_topic(user)))
    grants[OBSERVER].add(subscribe=[">"])
    grants[WRITER].add(publish=[">"])
    ready = make_auth.subjects("polca-test/ready/#")
    grants[READY].add(publish=ready, subscribe=ready)
    return grants


def roles_cluster(workdir: Path) -> Iterator[tuple[NatsCluster, dict[str, str]]]:
    """A TLS-only cluster in ``workdir`` with make-auth.py's users for the strict topology
    (and the probes'), with their passwords; killed when the generator closes."""
    config = workdir / "aggregator.yaml"
    config.write_text(S_TOPOLOGY, encoding="utf-8")
    grants = role_grants(config)
    passwords: dict[str, str] = make_auth.passwords_in(workdir / "secrets", grants)
    text: str = make_auth.auth_text(grants, passwords, source=str(config))
    cluster = NatsCluster(
        workdir / "cluster", auth=NatsAuth(text, READY, passwords[READY]), tls=True
    )
    try:
        cluster.start_all()
        yield cluster, passwords
    finally:
        cluster.kill_all()


@pytest.fixture(scope="module")
def roles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsCluster, dict[str, str]]]:
    """One TLS-only cluster with the generated users (and the probes'), for the module."""
    yield from roles_cluster(tmp_path_factory.mktemp("nats-roles"))


@asynccontextmanager
async def connected(
    cluster: NatsCluster, index: int, user: str | None, password: str | None
) -> AsyncIterator[aiomqtt.Client]:
    """``user`` connected to node ``index`` (mod 3) over TLS."""
    endpoint = cluster.mqtt_endpoints[index % len(cluster.mqtt_endpoints)]
    async with mqtt_client(
        endpoint, user=user, password=password, tls_context=cluster.tls_context(), timeout_s=WAIT_S
    ) as client:
        yield client


async def until_done(client: aiomqtt.Client, user: str) -> list[aiomqtt.Message]:
    """Every message before ``user``'s end marker."""
    messages: list[aiomqtt.Message] = []
    async with asyncio.timeout(WAIT_S):
        async for message in client.messages:
            if message.topic.value == done_topic(user):
                return messages
            messages.append(message)
    msg = "the message iterator ended before the end marker"
    raise AssertionError(msg)


def differences(
    got: Mapping[str, Sequence[str]], want: Mapping[str, Sequence[str]]
) -> dict[str, dict[str, list[str]]]:
    """Per user whose topics differ: those it got but should not have, and those missing."""
    result: dict[str, dict[str, list[str]]] = {}
    for user in sorted({*got, *want}):
        have, should = set(got.get(user, ())), set(want.get(user, ()))
        if have != should:
            result[user] = {"unexpected": sorted(have - should), "missing": sorted(should - have)}
    return result


def granted(codes: Sequence[object]) -> list[bool]:
    """Which SUBACK return codes grant the subscription (0x80 refuses it)."""
    return [int(getattr(code, "value", code)) < 0x80 for code in codes]  # type: ignore[call-overload]


def test_the_nats_matrix_widens_only_the_tools_filters() -> None:
    """NATS reads are the strict ACL's, plus what polca's tools subscribe to: only the
    viewer's differ in this universe (polca status reads the site's status and control)."""
    assert set(N_READS) == set(S_READS) == set(S_USERS)
    changed = {user for user in N_READS if N_READS[user] != S_READS[user]}
    assert changed == {"polca-viewer"}
    assert TOPICS.row_control(SITE, "row3") in N_READS["polca-viewer"]


async def test_writes_by_role(roles: tuple[NatsCluster, dict[str, str]]) -> None:
    """Each user's publishes that reach an observer are exactly its role's."""
    cluster, passwords = roles
    async with connected(cluster, 0, OBSERVER, passwords[OBSERVER]) as observer:
        await observer.subscribe("#", qos=0)
        async with AsyncExitStack() as stack:
            clients = {
                user: await stack.enter_async_context(
                    connected(cluster, index, user, passwords[user])
                )
                for index, user in enumerate(S_USERS)
            }
            for user, client in clients.items():
                for topic in S_UNIVERSE:
                    await client.publish(topic, user.encode(), qos=1)
        # One marker through each node: it follows that node's users' messages.
        for index in range(3):
            async with connected(cluster, index, WRITER, passwords[WRITER]) as writer:
                await writer.publish(done_topic(OBSERVER), str(index).encode(), qos=1)
        seen: dict[str, list[str]] = {user: [] for user in S_USERS}
        markers = 0
        async with asyncio.timeout(WAIT_S):
            async for message in observer.messages:
                assert isinstance(message.payload, bytes)
                if message.topic.value == done_topic(OBSERVER):
                    markers += 1
                    if markers == 3:
                        break
                elif message.topic.value in S_UNIVERSE:
                    seen[message.payload.decode()].append(message.topic.value)
    assert differences(seen, S_WRITES) == {}


async def _wait_for_sentinel(cluster: NatsCluster, password: str, payload: bytes) -> None:
    """Every node serves the retained sentinel (so the whole universe before it)."""
    for index in range(3):
        async with connected(cluster, index, OBSERVER, password) as observer:
            async with asyncio.timeout(WAIT_S):
                while True:
                    await observer.subscribe(SENTINEL, qos=0)
                    try:
                        async with asyncio.timeout(1.0):
                            async for message in observer.messages:
                                if message.payload == payload:
                                    break
                            break
                    except TimeoutError:
                        await observer.unsubscribe(SENTINEL)


async def test_reads_by_role(roles: tuple[NatsCluster, dict[str, str]]) -> None:
    """Each user gets exactly its role's topics, retained and live; its subscriptions to
    every other topic and to ``#`` are refused and deliver nothing, retained included."""
    cluster, passwords = roles
    async with connected(cluster, 0, WRITER, passwords[WRITER]) as writer:
        for topic in S_UNIVERSE:
            await writer.publish(topic, b"retained", qos=1, retain=True)
        sentinel = f"sentinel {id(writer)}".encode()
        await writer.publish(SENTINEL, sentinel, qos=1, retain=True)
        await _wait_for_sentinel(cluster, passwords[OBSERVER], sentinel)
        async with AsyncExitStack() as stack:
            clients = {
                user: await stack.enter_async_context(
                    connected(cluster, index, user, passwords[user])
                )
                for index, user in enumerate(S_USERS)
            }
            filters = [*S_UNIVERSE, "#"]
            codes = {
                user: granted(
                    await client.subscribe([(f, 0) for f in [*filters, done_topic(user)]])
                )
                for user, client in clients.items()
            }
            for topic in S_UNIVERSE:
                await writer.publish(topic, b"live", qos=1)
            for user in S_USERS:
                await writer.publish(done_topic(user), b"", qos=1)
            results = await asyncio.gather(*(until_done(c, u) for u, c in clients.items()))
    grants = {
        user: [f for f, ok in zip(filters, codes[user], strict=False) if ok] for user in S_USERS
    }
    got = {
        kind: {
            user: sorted(
                m.topic.value
                for m in messages
                if m.payload == kind.encode() and m.retain == (kind == "retained")
            )
            for user, messages in zip(S_USERS, results, strict=True)
        }
        for kind in ("retained", "live")
    }
    assert all(codes[user][-1] for user in S_USERS)  # the end markers
    assert differences(grants, N_READS) == {}
    assert {kind: differences(seen, N_READS) for kind, seen in got.items()} == {
        "retained": {},
        "live": {},
    }


async def test_qos1_needs_no_internal_grants(roles: tuple[NatsCluster, dict[str, str]]) -> None:
    """A QoS 1 subscription works with a role's grants alone: NATS 2.15 needs no grant on
    its internal ``$MQTT.sub.>`` delivery subjects (older documentation asked for one)."""
    cluster, passwords = roles
    topic = TOPICS.row_control(SITE, "row1")
    async with (
        connected(cluster, 1, "node1", passwords["node1"]) as agent,
        connected(cluster, 2, "polca-aggregator", passwords["polca-aggregator"]) as aggregator,
    ):
        (code,) = await agent.subscribe(topic, qos=1)
        assert granted([code]) == [True]
        await aggregator.publish(topic, b"qos1 control", qos=1)
        async with asyncio.timeout(WAIT_S):
            async for message in agent.messages:
                if message.payload == b"qos1 control":
                    assert message.qos == 1
                    break


async def test_the_power_tree_roles_filters_are_granted_and_no_more(
    roles: tuple[NatsCluster, dict[str, str]],
) -> None:
    """The site controller's and the operator's subscriptions are granted as they make
    them; each one's filter of a topic only the other reads, and ``#``, are refused."""
    cluster, passwords = roles
    refused = {
        "polca-site": [TOPICS.site_report(SITE), TOPICS.budget(SITE, "+"), "#"],
        "polca-operator": [TOPICS.meter(SITE, "+"), TOPICS.row_control(SITE, "+"), "#"],
    }
    for index, (user, filters) in enumerate(POWER_TREE_FILTERS.items()):
        async with connected(cluster, index, user, passwords[user]) as client:
            codes = await client.subscribe([(f, 1) for f in [*filters, *refused[user]]])
            want = [True] * len(filters) + [False] * len(refused[user])
            assert granted(codes) == want, user


async def test_polca_tools_filters_are_granted(roles: tuple[NatsCluster, dict[str, str]]) -> None:
    """The wide filters polca's tools subscribe with are granted to their users, and
    the aggregator's own subscriptions (test_mosquitto_roles) are within its grants."""
    cluster, passwords = roles
    for index, (user, filters) in enumerate(WIDE_READS.items()):
        async with connected(cluster, index, user, passwords[user]) as client:
            codes = await client.subscribe([(f, 1) for f in filters])
            assert granted(codes) == [True] * len(filters), user


async def test_polca_status_as_the_viewer(
    tmp_path: Path, roles: tuple[NatsCluster, dict[str, str]]
) -> None:
    """`polca status --site dc1` as polca-viewer over TLS lists a node's retained status:
    its subscriptions are granted on NATS."""
    import time

    from polca.telemetry.schema import Status, encode

    cluster, passwords = roles
    status = Status(ts_ns=time.time_ns(), state="online", node="node2", gpu_count=4)
    async with connected(cluster, 0, "node2", passwords["node2"]) as client:
        await client.publish(
            node("row1", "rack1", "node2", "status"), encode(status), qos=1, retain=True
        )
    password_file = tmp_path / "viewer.pass"
    password_file.write_text(passwords["polca-viewer"] + "\n", encoding="utf-8")
    assert cluster.tls is not None
    host, port = cluster.mqtt_endpoints[1]
    argv = [sys.executable, "-m", "polca", "status", "--broker", f"{host}:{port}", "--site", SITE]
    argv += ["--username", "polca-viewer", f"--password-file={password_file}", "--tls"]
    argv += [f"--ca-file={cluster.tls.ca_cert}", "--json", "--wait=2", "--timeout=15"]
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:  # node 1 serves the status once its retained index has it
        result = await asyncio.to_thread(
            subprocess.run, argv, capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, result.stderr
        nodes = [n for n in json.loads(result.stdout)["nodes"] if n["node"] == "node2"]
        if nodes or asyncio.get_running_loop().time() > deadline:
            break
    (entry,) = nodes
    assert (entry["row"], entry["rack"], entry["status"]["gpu_count"]) == ("row1", "rack1", 4)


async def test_last_wills_only_on_the_users_own_status(
    roles: tuple[NatsCluster, dict[str, str]],
) -> None:
    """A vanished node's or aggregator's will is published on its own status only: a
    will on a topic the user may not write is dropped, live and retained."""
    cluster, passwords = roles
    node1_status = node("row1", "rack1", "node1", "status")
    aggregator_status = TOPICS.aggregator(SITE, "agg1", "status")
    forbidden = [
        ("node1", node("row1", "rack1", "node2", "status")),
        ("node1", aggregator_status),
        ("polca-aggregator", node1_status),
    ]
    allowed = [("node1", node1_status), ("polca-aggregator", aggregator_status)]
    endpoint = cluster.mqtt_endpoints[0]
    async with connected(cluster, 1, OBSERVER, passwords[OBSERVER]) as observer:
        await observer.subscribe([("polca/v1/#", 1), (done_topic(OBSERVER), 1)])
        for number, (user, will) in enumerate([*forbidden, *allowed]):
            await _vanish_over_tls(cluster, endpoint, user, passwords[user], will=will, n=number)
        got: list[tuple[str, bytes]] = []
        async with asyncio.timeout(WAIT_S):
            async for message in observer.messages:
                assert isinstance(message.payload, bytes)
                if message.payload.startswith(b"will of ") and not message.retain:
                    got.append((message.topic.value, message.payload))
                if len(got) == len(allowed):
                    break
        # The marker takes the wills' way (node 0 to node 1): any late will comes first.
        async with connected(cluster, 0, WRITER, passwords[WRITER]) as writer:
            await writer.publish(done_topic(OBSERVER), b"", qos=1)
        for message in await until_done(observer, OBSERVER):
            assert isinstance(message.payload, bytes)
            if message.payload.startswith(b"will of "):
                got.append((message.topic.value, message.payload))
    assert sorted(got) == sorted((will, f"will of {user}".encode()) for user, will in allowed)


async def _vanish_over_tls(
    cluster: NatsCluster, endpoint: tuple[str, int], user: str, password: str, *, will: str, n: int
) -> None:
    """``vanish_with_will`` through a TLS connection (the listener is TLS-only)."""
    context = cluster.tls_context()
    assert context is not None
    await vanish_with_will(
        endpoint,
        client_id=f"will-{n}",
        will=(will, f"will of {user}".encode()),
        user=user,
        password=password,
        tls_context=context,
    )


@pytest.mark.parametrize(("user", "password"), [(None, None), ("node1", "wrong"), ("nobody", "x")])
async def test_anonymous_and_wrong_passwords_are_refused(
    roles: tuple[NatsCluster, dict[str, str]], user: str | None, password: str | None
) -> None:
    """No user, a wrong password or an unknown user: refused at connect."""
    cluster, _ = roles
    with pytest.raises(aiomqtt.MqttCodeError):
        async with connected(cluster, 0, user, password):
            pass


async def test_tls_with_the_right_ca_only(
    tmp_path: Path, roles: tuple[NatsCluster, dict[str, str]]
) -> None:
    """The listener is TLS-only: a client trusting the cluster's CA connects; the
    handshake fails for one trusting another CA, and plain MQTT gets no CONNACK."""
    cluster, passwords = roles
    endpoint = cluster.mqtt_endpoints[2]
    async with connected(cluster, 2, "polca-viewer", passwords["polca-viewer"]):
        pass
    other = make_tls_files(tmp_path / "other-ca", ca_name="another-ca")
    wrong = ssl.create_default_context(cafile=str(other.ca_cert))
    # A raw connection: paho leaks the socket of a failed handshake (an unraisable warning).
    with pytest.raises(ssl.SSLCertVerificationError):
        await asyncio.wait_for(
            asyncio.open_connection(*endpoint, ssl=wrong, server_hostname=endpoint[0]), WAIT_S
        )
    reader, writer = await asyncio.open_connection(*endpoint)
    try:
        writer.write(
            connect_packet("plain", user="polca-viewer", password=passwords["polca-viewer"])
        )
        await writer.drain()
        async with asyncio.timeout(WAIT_S):
            answer = await reader.read(4)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    assert answer != b"\x20\x02\x00\x00"  # no CONNACK: the server wanted a TLS handshake


# --- make-auth.py as an operator runs it ----------------------------------------------


def run_make_auth(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """deploy/nats/make-auth.py with ``args``."""
    return subprocess.run(
        [sys.executable, str(MAKE_AUTH), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_make_auth_writes_users_and_keeps_passwords(tmp_path: Path) -> None:
    """The command line writes auth.conf and one password per user (mode 600), reuses
    the passwords when run again, and writes what the module functions write; nats-server
    accepts the deploy configuration with it."""
    config = tmp_path / "aggregator.yaml"
    config.write_text(S_TOPOLOGY, encoding="utf-8")
    auth, secrets = tmp_path / "auth.conf", tmp_path / "secrets"
    result = run_make_auth(config, "-o", auth, "--secrets-dir", secrets, "--simulated-cdu", "cdu2")
    assert result.returncode == 0, result.stderr
    assert auth.stat().st_mode & 0o777 == 0o600
    files = {path.stem: path for path in secrets.glob("*.pass")}
    assert set(files) == set(S_USERS)
    assert all(path.stat().st_mode & 0o777 == 0o600 for path in files.values())
    passwords = {user: path.read_text(encoding="utf-8").strip() for user, path in files.items()}
    first = auth.read_text(encoding="utf-8")
    assert (
        run_make_auth(
            config, "-o", auth, "--secrets-dir", secrets, "--simulated-cdu", "cdu2"
        ).returncode
        == 0
    )
    assert auth.read_text(encoding="utf-8") == first
    grants = make_auth.configs_grants([config], simulated=["cdu2"])
    assert first == make_auth.auth_text(grants, passwords, source=str(config))
    assert '"node1"' in first
    assert 'subscribe: {deny: [">"]}' in first  # meters and cdu1 read nothing
    cluster = NatsCluster(tmp_path / "cluster", auth=NatsAuth(first, "", ""), tls=True)
    (cluster.nodes[0].workdir / "auth.conf").write_text(first, encoding="utf-8")
    conf = cluster.nodes[0].workdir / "check.conf"
    conf.write_text(cluster.config_text(0), encoding="utf-8")
    check = subprocess.run(
        [str(NATS_SERVER), "-t", "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_make_auth_subjects() -> None:
    """MQTT filters become the subjects the gateway uses: ``/`` levels, ``.`` as ``//``,
    ``+`` and ``#`` as ``*`` and ``>``, and a trailing ``#`` also grants its parent."""
    assert make_auth.subjects("polca/v1/dc1/+/+/n.1/status") == ["polca.v1.dc1.*.*.n//1.status"]
    assert make_auth.subjects("polca/v1/dc1/row1/#") == ["polca.v1.dc1.row1", "polca.v1.dc1.row1.>"]
    assert make_auth.subjects("#") == [">"]


def test_make_auth_merges_aggregators_and_refuses_clashes(tmp_path: Path) -> None:
    """Two aggregators' configurations: the shared services get both grants; a node in
    both, or a simulated CDU in neither, is refused (exit 2, nothing written)."""
    first = tmp_path / "a.yaml"
    first.write_text(S_TOPOLOGY, encoding="utf-8")
    second = tmp_path / "b.json"
    second.write_text(
        json.dumps(
            {
                "site": SITE,
                "instance": "agg2",
                "mqtt": {"username": "polca-aggregator-2"},
                "rows": [
                    {"name": "row5", "racks": [{"name": "rack5", "nodes": [{"name": "node5"}]}]}
                ],
            }
        ),
        encoding="utf-8",
    )
    grants = make_auth.configs_grants([first, second])
    assert "polca.v1.dc1.row5.*.*.assign" in grants["polca-scheduler"].publish
    assert "polca.v1.dc1.row1.*.*.assign" in grants["polca-scheduler"].publish
    assert {"polca-aggregator", "polca-aggregator-2", "node5", "node1"} <= set(grants)
    clash = tmp_path / "c.json"
    clash.write_text(second.read_text(encoding="utf-8").replace("node5", "node1"), encoding="utf-8")
    auth = tmp_path / "auth.conf"
    result = run_make_auth(first, clash, "-o", auth, "--secrets-dir", tmp_path / "s")
    assert result.returncode == 2
    assert "node1" in result.stderr
    result = run_make_auth(first, "-o", auth, "--simulated-cdu", "cdu9")
    assert (result.returncode, "cdu9" in result.stderr) == (2, True)
    assert not auth.exists()


async def test_polca_logs_a_subscription_the_cluster_refuses(
    roles: tuple[NatsCluster, dict[str, str]],
) -> None:
    """NATS refuses a subscription beyond the user's grants (Mosquitto accepts it and
    filters each message): polca's bus says so (``mqtt_subscription_refused``) instead of
    waiting for messages that never come, and keeps the granted ones."""
    from pydantic import SecretStr
    from structlog.testing import capture_logs

    from polca.settings import MqttSettings
    from polca.telemetry.bus import MqttBus

    cluster, passwords = roles
    assert cluster.tls is not None
    settings = MqttSettings(
        endpoints=[f"{host}:{port}" for host, port in cluster.mqtt_endpoints],
        username="node1",
        password=SecretStr(passwords["node1"]),
        tls=True,
        tls_ca_file=cluster.tls.ca_cert,
        connect_timeout_s=WAIT_S,
    )
    own = "polca/v1/dc1/row1/rack1/node1/assign"
    other = "polca/v1/dc1/row1/rack1/node2/assign"
    bus = MqttBus(settings, client_id="polca-agent-node1", subscriptions=[(own, 0), (other, 0)])
    task = asyncio.create_task(bus.run())
    try:
        with capture_logs() as logs:
            async with asyncio.timeout(WAIT_S * 2):
                while not [e for e in logs if e["event"] == "mqtt_subscription_refused"]:  # noqa: ASYNC110 - polls captured logs
                    await asyncio.sleep(0.05)
        refused = [e["topic"] for e in logs if e["event"] == "mqtt_subscription_refused"]
        assert refused == [other]
    finally:
        await bus.close(timeout_s=2.0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
