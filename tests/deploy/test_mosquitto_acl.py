"""deploy/mosquitto against a real Mosquitto: authentication, the pattern ACL, the strict ACL.

Each test starts ``/usr/sbin/mosquitto`` with a copy of ``deploy/mosquitto/mosquitto.conf``
in which only the listener port, the file paths and the process user are rewritten (each
rewrite must match exactly once, so a changed file is noticed), with users made by the
folder's own scripts. Clients are aiomqtt clients speaking MQTT 3.1.1.

"Not delivered" is checked without waiting for a timeout: forbidden messages are published
first and allowed ones after, each publish awaited (QoS 1, so the broker has routed it
before it acknowledges), and the subscriber's first messages must be exactly the allowed
ones, in order. A forbidden message that got through would come first.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import re
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import aiomqtt
import pytest
import yaml

from polca.settings import load_settings
from tests.mqtt_broker import MOSQUITTO_PASSWD, MosquittoProcess, free_port, make_tls_files

ROOT = Path(__file__).resolve().parents[2]
MOSQUITTO_DIR = ROOT / "deploy" / "mosquitto"
CONF = MOSQUITTO_DIR / "mosquitto.conf"
PATTERN_ACL = MOSQUITTO_DIR / "acl"
MAKE_ACL = MOSQUITTO_DIR / "make-acl.py"
MAKE_PASSWORDS = MOSQUITTO_DIR / "make-passwords.sh"
EXAMPLE_CONFIG = ROOT / "deploy" / "aggregator.example.yaml"
AGENT_EXAMPLE = ROOT / "deploy" / "agent.example.yaml"
COMPOSE_CONF = MOSQUITTO_DIR / "compose.conf"

WAIT_S = 5.0
SERVICE_USERS = ("polca-aggregator", "polca-scheduler", "polca-viewer", "meter")

NODE1 = "polca/v1/dc1/row1/rack1/node1"
NODE2 = "polca/v1/dc1/row1/rack1/node2"
ROW1_CONTROL = "polca/v1/dc1/row1/control"
RACK1_CONTROL = "polca/v1/dc1/row1/rack1/control"
ROW1_POLICY = "polca/v1/dc1/row1/policy"

# The strict ACL's topology: node1 and node2 share rack1, node3 is in rack2 of the same
# row, node9 in another row.
TOPOLOGY = """\
site: dc1
policy_file: /etc/polca/policy.yaml
rows:
  - name: row1
    budget_w: 120000
    meter_topic: polca/v1/dc1/row1/meter
    racks:
      - name: rack1
        nodes:
          - {name: node1, non_gpu_w: 1200}
          - {name: node2, non_gpu_w: 1200}
      - name: rack2
        nodes:
          - {name: node3, non_gpu_w: 1200}
  - name: row2
    budget_w: 60000
    racks:
      - name: rack9
        nodes:
          - {name: node9, non_gpu_w: 1200}
"""


def _rewrite(text: str, pattern: str, replacement: str) -> str:
    """Replace the one line matching ``pattern`` (a whole line); fail unless exactly one."""
    result, count = re.subn(rf"(?m)^{pattern}$", replacement, text)
    assert count == 1, f"expected exactly one line matching {pattern!r} in {CONF.name}"
    return result


def deploy_config(
    workdir: Path, *, port: int, acl: Path, password_file: Path, extra: str = ""
) -> str:
    """deploy/mosquitto/mosquitto.conf with port, paths and user pointed at ``workdir``."""
    text = CONF.read_text(encoding="utf-8")
    text = _rewrite(text, r"listener 1883 127\.0\.0\.1", f"listener {port} 127.0.0.1")
    text = _rewrite(text, r"password_file \S+", f"password_file {password_file}")
    text = _rewrite(text, r"acl_file \S+", f"acl_file {acl}")
    text = _rewrite(text, r"persistence_location \S+", f"persistence_location {workdir}/")
    text = _rewrite(text, r"pid_file \S+", f"pid_file {workdir}/mosquitto.pid")
    # As root, Mosquitto would switch to the mosquitto user and lose our files.
    text = _rewrite(text, r"user mosquitto", f"user {pwd.getpwuid(os.getuid()).pw_name}")
    return text + extra


def _run(argv: Sequence[str | Path], **env: str) -> subprocess.CompletedProcess[str]:
    """Run one of the folder's scripts; mosquitto_passwd must be on PATH for them."""
    if not MOSQUITTO_PASSWD.exists():
        pytest.fail(f"{MOSQUITTO_PASSWD} is missing (apt-get install mosquitto)", pytrace=False)
    path = f"{MOSQUITTO_PASSWD.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    return subprocess.run(
        [str(arg) for arg in argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PATH": path, **env},
    )


def make_passwords(workdir: Path, users: Sequence[str]) -> dict[str, str]:
    """Users made by make-passwords.sh; returns name -> password from its secrets."""
    secrets = workdir / "secrets"
    result = _run(
        ["sh", MAKE_PASSWORDS, *users],
        PASSWORD_FILE=str(workdir / "passwd"),
        SECRETS_DIR=str(secrets),
    )
    assert result.returncode == 0, result.stderr
    return {user: (secrets / f"{user}.pass").read_text(encoding="utf-8").strip() for user in users}


BrokerFactory = Callable[..., MosquittoProcess]


@pytest.fixture
def deployed_broker(tmp_path: Path) -> Iterator[BrokerFactory]:
    """Start Mosquitto with the deploy configuration, an ACL file and a password file."""
    brokers: list[MosquittoProcess] = []

    def start(*, acl: Path, password_file: Path, extra: str = "") -> MosquittoProcess:
        workdir = tmp_path / f"broker-{len(brokers)}"
        broker = MosquittoProcess(workdir)
        brokers.append(broker)
        broker.conf_path.write_text(
            deploy_config(
                workdir,
                port=broker.port,
                acl=acl,
                password_file=password_file,
                extra=extra,
            ),
            encoding="utf-8",
        )
        broker.start()
        return broker

    yield start
    for broker in brokers:
        broker.kill()


@pytest.fixture
def pattern_broker(
    tmp_path: Path, deployed_broker: BrokerFactory
) -> tuple[MosquittoProcess, dict[str, str]]:
    """The pattern ACL, with the service users and nodes node1 and node2."""
    passwords = make_passwords(tmp_path, [*SERVICE_USERS, "node1", "node2"])
    broker = deployed_broker(acl=PATTERN_ACL, password_file=tmp_path / "passwd")
    return broker, passwords


@asynccontextmanager
async def connected(
    broker: MosquittoProcess,
    user: str | None,
    password: str | None,
    *,
    port: int | None = None,
    tls_context: ssl.SSLContext | None = None,
    timeout_s: float = WAIT_S,
) -> AsyncIterator[aiomqtt.Client]:
    """An MQTT 3.1.1 client logged in as ``user``."""
    client = aiomqtt.Client(
        broker.host,
        port or broker.port,
        username=user,
        password=password,
        identifier=f"test-{user}",
        tls_context=tls_context,
        timeout=timeout_s,
    )
    async with client:
        yield client


async def received(client: aiomqtt.Client, count: int) -> list[tuple[str, bytes]]:
    """The next ``count`` messages as (topic, payload)."""
    messages: list[tuple[str, bytes]] = []
    async with asyncio.timeout(WAIT_S):
        async for message in client.messages:
            assert isinstance(message.payload, bytes)
            messages.append((message.topic.value, message.payload))
            if len(messages) == count:
                break
    return messages


async def publish_all(
    client: aiomqtt.Client, topics: Sequence[str], *, retain: bool = False
) -> None:
    """Publish each topic (payload = topic) at QoS 1, one after the other."""
    for topic in topics:
        await client.publish(topic, topic.encode(), qos=1, retain=retain)


def expected(topics: Sequence[str]) -> list[tuple[str, bytes]]:
    """What ``received`` returns for messages published by ``publish_all``."""
    return [(topic, topic.encode()) for topic in topics]


# --- The pattern ACL ---------------------------------------------------------------


async def test_node_writes_only_its_own_topics(
    pattern_broker: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """node1's own telemetry/status/state/events reach the aggregator; nothing else does."""
    broker, passwords = pattern_broker
    forbidden = [
        f"{NODE2}/telemetry",
        f"{NODE2}/status",
        f"{NODE1}/assign",
        ROW1_CONTROL,
        RACK1_CONTROL,
        ROW1_POLICY,
        "polca/v1/dc1/row1/summary",
        "polca/v1/dc1/aggregator/node1/status",
        "polca/v1/dc1/row1/meter",
        "elsewhere/node1/telemetry",
    ]
    allowed = [f"{NODE1}/{channel}" for channel in ("telemetry", "status", "state", "events")]
    async with (
        connected(broker, "polca-aggregator", passwords["polca-aggregator"]) as aggregator,
        connected(broker, "node1", passwords["node1"]) as node1,
    ):
        await aggregator.subscribe("#", qos=1)
        await publish_all(node1, [*forbidden, *allowed])
        assert await received(aggregator, len(allowed)) == expected(allowed)


async def test_node_reads_its_control_policy_and_own_assignment(
    pattern_broker: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """node1 gets row and rack control, the row policy and its assignment, not node2's."""
    broker, passwords = pattern_broker
    async with (
        connected(broker, "polca-aggregator", passwords["polca-aggregator"]) as aggregator,
        connected(broker, "polca-scheduler", passwords["polca-scheduler"]) as scheduler,
        connected(broker, "node2", passwords["node2"]) as node2,
    ):
        # Retained before node1 connects, as after an agent restart.
        await publish_all(scheduler, [f"{NODE2}/assign", f"{NODE1}/assign"], retain=True)
        async with connected(broker, "node1", passwords["node1"]) as node1:
            await node1.subscribe("polca/v1/#", qos=1)
            await publish_all(scheduler, [f"{NODE2}/assign"])
            await publish_all(node2, [f"{NODE2}/telemetry", f"{NODE2}/state"])
            await publish_all(aggregator, [ROW1_CONTROL, RACK1_CONTROL, ROW1_POLICY])
            assert await received(node1, 4) == expected(
                [f"{NODE1}/assign", ROW1_CONTROL, RACK1_CONTROL, ROW1_POLICY]
            )


async def test_services_write_only_their_topics(
    pattern_broker: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """Aggregator, scheduler and meter each write their own topics; the viewer sees all."""
    broker, passwords = pattern_broker
    users = ("polca-aggregator", "polca-scheduler", "meter", "polca-viewer")
    async with (
        connected(broker, users[0], passwords[users[0]]) as aggregator,
        connected(broker, users[1], passwords[users[1]]) as scheduler,
        connected(broker, users[2], passwords[users[2]]) as meter,
        connected(broker, users[3], passwords[users[3]]) as viewer,
    ):
        await viewer.subscribe("polca/v1/#", qos=1)
        await aggregator.subscribe("polca/v1/#", qos=1)
        # Forbidden: each service outside its topics, and the viewer anywhere.
        await publish_all(aggregator, [f"{NODE1}/assign", f"{NODE1}/telemetry"])
        await publish_all(scheduler, [ROW1_CONTROL, f"{NODE1}/telemetry"])
        await publish_all(meter, [f"{NODE1}/telemetry", ROW1_CONTROL])
        await publish_all(viewer, [ROW1_CONTROL, "polca/v1/dc1/row1/meter"])
        allowed = [
            ROW1_CONTROL,
            RACK1_CONTROL,
            ROW1_POLICY,
            "polca/v1/dc1/row1/summary",
            "polca/v1/dc1/aggregator/agg1/status",
            f"{NODE1}/assign",
            "polca/v1/dc1/row1/meter",
        ]
        await publish_all(aggregator, allowed[:5])
        await publish_all(scheduler, allowed[5:6])
        await publish_all(meter, allowed[6:])
        assert await received(viewer, len(allowed)) == expected(allowed)
        assert await received(aggregator, len(allowed)) == expected(allowed)


@pytest.mark.parametrize(
    ("user", "password"),
    [(None, None), ("node1", "wrong"), ("stranger", "whatever")],
    ids=["anonymous", "wrong-password", "unknown-user"],
)
async def test_unauthenticated_clients_are_refused(
    pattern_broker: tuple[MosquittoProcess, dict[str, str]], user: str | None, password: str | None
) -> None:
    """allow_anonymous false and the password file: no way in without a valid password."""
    broker, _ = pattern_broker
    with pytest.raises(aiomqtt.MqttError, match=r"[Nn]ot authori[sz]ed"):
        async with connected(broker, user, password):
            pass


async def test_pattern_acl_does_not_confine_a_node_to_its_rack(
    pattern_broker: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """The documented trade-off: node1 may write node1 topics in another row and rack."""
    broker, passwords = pattern_broker
    elsewhere = "polca/v1/dc1/row2/rack9/node1/telemetry"
    async with (
        connected(broker, "polca-aggregator", passwords["polca-aggregator"]) as aggregator,
        connected(broker, "node1", passwords["node1"]) as node1,
    ):
        await aggregator.subscribe("polca/v1/#", qos=1)
        await publish_all(node1, [elsewhere])
        assert await received(aggregator, 1) == expected([elsewhere])


async def test_tls_block_gives_mutual_tls_with_the_certificate_name_as_user(
    tmp_path: Path, deployed_broker: BrokerFactory
) -> None:
    """The commented TLS listener, enabled: a client certificate's CN is the ACL user name."""
    tls = make_tls_files(tmp_path / "pki")
    passwords = make_passwords(tmp_path, ["polca-aggregator"])
    tls_port = free_port()
    text = CONF.read_text(encoding="utf-8")
    block = re.search(r"(?ms)^#listener 8883\n.*?^#use_identity_as_username true\n", text)
    assert block is not None, "the TLS listener block is not in mosquitto.conf"
    enabled = re.sub(r"(?m)^#(?=[a-z_]+ )", "", block.group(0))
    enabled = enabled.replace("listener 8883", f"listener {tls_port} 127.0.0.1")
    enabled = re.sub(r"(?m)^cafile .*$", f"cafile {tls.ca_cert}", enabled)
    enabled = re.sub(r"(?m)^certfile .*$", f"certfile {tls.server_cert}", enabled)
    enabled = re.sub(r"(?m)^keyfile .*$", f"keyfile {tls.server_key}", enabled)
    broker = deployed_broker(acl=PATTERN_ACL, password_file=tmp_path / "passwd", extra=enabled)

    context = ssl.create_default_context(cafile=tls.ca_cert)
    context.load_cert_chain(tls.client_cert, tls.client_key)
    own = "polca/v1/dc1/row1/rack1/polca-test-client/telemetry"
    async with (
        connected(broker, "polca-aggregator", passwords["polca-aggregator"]) as aggregator,
        connected(broker, None, None, port=tls_port, tls_context=context) as node,
    ):
        await aggregator.subscribe("polca/v1/#", qos=1)
        await publish_all(node, [f"{NODE1}/telemetry", own])
        assert await received(aggregator, 1) == expected([own])

    # Without a certificate: with TLS 1.3 the client's handshake completes before the
    # broker checks, and its refusal only ends the wait for CONNACK (a short timeout).
    no_certificate = ssl.create_default_context(cafile=tls.ca_cert)
    with pytest.raises(aiomqtt.MqttError, match="timed out"):
        async with connected(
            broker, None, None, port=tls_port, tls_context=no_certificate, timeout_s=0.5
        ):
            pass


# --- The strict ACL from make-acl.py -----------------------------------------------


@pytest.fixture
def strict_broker(
    tmp_path: Path, deployed_broker: BrokerFactory
) -> tuple[MosquittoProcess, dict[str, str]]:
    """The ACL and users make-acl.py generates for TOPOLOGY, run as documented."""
    config = tmp_path / "aggregator.yaml"
    config.write_text(TOPOLOGY, encoding="utf-8")
    acl, script = tmp_path / "acl", tmp_path / "add-users.sh"
    result = _run([sys.executable, MAKE_ACL, config, "-o", acl, "--passwd-commands", script])
    assert result.returncode == 0, result.stderr
    secrets = tmp_path / "secrets"
    result = _run(["sh", script], PASSWORD_FILE=str(tmp_path / "passwd"), SECRETS_DIR=str(secrets))
    assert result.returncode == 0, result.stderr
    passwords = {
        path.stem: path.read_text(encoding="utf-8").strip() for path in secrets.glob("*.pass")
    }
    assert set(passwords) == {
        "polca-aggregator",
        "polca-scheduler",
        "polca-viewer",
        "meter-row1",
        "node1",
        "node2",
        "node3",
        "node9",
    }
    return deployed_broker(acl=acl, password_file=tmp_path / "passwd"), passwords


async def test_strict_acl_confines_node_writes_to_its_row_and_rack(
    strict_broker: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """With the generated ACL, node1 writes node1 topics only under row1/rack1."""
    broker, passwords = strict_broker
    forbidden = [
        "polca/v1/dc1/row2/rack9/node1/telemetry",
        "polca/v1/dc1/row1/rack2/node1/telemetry",
        "polca/v1/dc2/row1/rack1/node1/telemetry",
        f"{NODE2}/telemetry",
        f"{NODE1}/assign",
        ROW1_CONTROL,
        ROW1_POLICY,
    ]
    allowed = [f"{NODE1}/{channel}" for channel in ("telemetry", "status", "state", "events")]
    async with (
        connected(broker, "polca-viewer", passwords["polca-viewer"]) as viewer,
        connected(broker, "node1", passwords["node1"]) as node1,
    ):
        await viewer.subscribe("polca/v1/#", qos=1)
        await publish_all(node1, [*forbidden, *allowed])
        assert await received(viewer, len(allowed)) == expected(allowed)


async def test_strict_acl_confines_node_reads_to_its_row_and_rack(
    strict_broker: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """node1 reads row1 and rack1 control, row1 policy, its assignment; not other rows'."""
    broker, passwords = strict_broker
    async with (
        connected(broker, "polca-aggregator", passwords["polca-aggregator"]) as aggregator,
        connected(broker, "polca-scheduler", passwords["polca-scheduler"]) as scheduler,
        connected(broker, "node1", passwords["node1"]) as node1,
    ):
        await node1.subscribe("polca/v1/#", qos=1)
        await publish_all(
            aggregator,
            [
                "polca/v1/dc1/row2/control",
                "polca/v1/dc1/row1/rack2/control",
                "polca/v1/dc1/row2/policy",
            ],
        )
        await publish_all(scheduler, [f"{NODE2}/assign", "polca/v1/dc1/row2/rack9/node9/assign"])
        allowed = [ROW1_CONTROL, RACK1_CONTROL, ROW1_POLICY, f"{NODE1}/assign"]
        await publish_all(aggregator, allowed[:3])
        await publish_all(scheduler, allowed[3:])
        assert await received(node1, len(allowed)) == expected(allowed)


async def test_strict_acl_limits_services_to_the_topology(
    strict_broker: tuple[MosquittoProcess, dict[str, str]],
) -> None:
    """The aggregator controls only its rows and racks; the row meter writes its topic."""
    broker, passwords = strict_broker
    async with (
        connected(broker, "polca-aggregator", passwords["polca-aggregator"]) as aggregator,
        connected(broker, "meter-row1", passwords["meter-row1"]) as meter,
        connected(broker, "node9", passwords["node9"]) as node9,
        connected(broker, "polca-viewer", passwords["polca-viewer"]) as viewer,
    ):
        await viewer.subscribe("polca/v1/#", qos=1)
        await aggregator.subscribe("polca/v1/#", qos=1)
        await publish_all(
            aggregator, ["polca/v1/dc1/row3/control", "polca/v1/dc1/row1/rack7/control"]
        )
        await publish_all(meter, ["polca/v1/dc1/row2/meter", f"{NODE1}/telemetry"])
        allowed = [
            ROW1_CONTROL,
            "polca/v1/dc1/row2/rack9/control",
            "polca/v1/dc1/row2/policy",
            "polca/v1/dc1/row2/summary",
            "polca/v1/dc1/aggregator/agg1/status",
            "polca/v1/dc1/row1/meter",
            "polca/v1/dc1/row2/rack9/node9/telemetry",
        ]
        await publish_all(aggregator, allowed[:5])
        await publish_all(meter, allowed[5:6])
        await publish_all(node9, allowed[6:])
        assert await received(viewer, len(allowed)) == expected(allowed)
        assert await received(aggregator, len(allowed)) == expected(allowed)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("name: node2", "name: node1"), "node 'node1' appears in row row1 rack rack1 and in"),
        (("name: node9", "name: polca-viewer"), "user names used twice"),
        (("name: rack9", "name: rack/9"), "rack name 'rack/9' is not one topic level"),
        (("dc1/row1/meter", "dc1/+/meter"), "must be a plain topic"),
        (("name: row2", "name: row1"), "row 'row1' is listed twice"),
        (("site: dc1", "site: ''"), "site name '' is not one topic level"),
        (("name: row2", "name: aggregator"), "row name 'aggregator' is reserved"),
    ],
    ids=[
        "duplicate-node",
        "node-named-like-service",
        "bad-rack",
        "wildcard-meter",
        "dup-row",
        "empty-site",
        "reserved-row",
    ],
)
def test_make_acl_refuses_bad_topologies(
    tmp_path: Path, edit: tuple[str, str], message: str
) -> None:
    """make-acl.py exits 2 naming the problem, and writes no ACL."""
    config = tmp_path / "aggregator.yaml"
    assert edit[0] in TOPOLOGY
    config.write_text(TOPOLOGY.replace(edit[0], edit[1], 1), encoding="utf-8")
    acl = tmp_path / "acl"
    result = _run([sys.executable, MAKE_ACL, config, "-o", acl])
    assert result.returncode == 2
    assert message in result.stderr
    assert not acl.exists()


def test_make_acl_covers_the_example_configuration() -> None:
    """The example aggregator configuration gives a user section for every node in it."""
    result = _run([sys.executable, MAKE_ACL, EXAMPLE_CONFIG])
    assert result.returncode == 0, result.stderr
    users = re.findall(r"(?m)^user (\S+)$", result.stdout)
    assert users[:3] == ["polca-aggregator", "polca-scheduler", "polca-viewer"]
    assert {"node1", "node2", "node3", "node4"} <= set(users)
    assert "topic write polca/v1/dc1/row1/rack2/node3/telemetry" in result.stdout


def test_agent_example_logs_in_as_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """agent.example.yaml is valid, its user is its node, and the node is in the topology."""
    for name in [n for n in os.environ if n.startswith("POLCA_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    settings = load_settings(AGENT_EXAMPLE)
    topics = settings.topics
    assert settings.mqtt.username == topics.node
    assert settings.mqtt.tls
    assert settings.mqtt.port == 8883
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
    assert topics.site == config["site"]
    placed = {
        node["name"]: (row["name"], rack["name"])
        for row in config["rows"]
        for rack in row["racks"]
        for node in rack["nodes"]
    }
    assert placed[topics.node] == (topics.row, topics.rack)


# --- The files themselves ----------------------------------------------------------


@pytest.mark.parametrize("path", [CONF, COMPOSE_CONF, PATTERN_ACL], ids=lambda p: p.name)
def test_every_line_is_explained(path: Path) -> None:
    """Every setting, active or commented out, follows a comment line that explains it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    directive = re.compile(r"^#?[a-z_]+ \S")
    unexplained = [
        f"{number}: {line}"
        for number, (previous, line) in enumerate(zip(["", *lines], lines, strict=False), 1)
        if directive.match(line) and not (previous.startswith("# ") or previous == "#")
    ]
    assert unexplained == []


def test_config_defaults_are_safe() -> None:
    """Loopback listener, no anonymous access, password and ACL files, persistence on."""
    active = [
        line
        for line in CONF.read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    ]
    assert [line for line in active if line.startswith("listener ")] == ["listener 1883 127.0.0.1"]
    for setting in (
        "allow_anonymous false",
        "password_file /etc/mosquitto/passwd",
        "acl_file /etc/mosquitto/acl",
        "persistence true",
        "persistence_location /var/lib/mosquitto/",
        "log_dest stderr",
    ):
        assert setting in active


def test_scripts_are_executable() -> None:
    """The two generators can be run directly, as the README shows."""
    for script in (MAKE_ACL, MAKE_PASSWORDS):
        assert os.access(script, os.X_OK), script
