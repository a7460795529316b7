"""``polca assign`` against a real Mosquitto with the repo's ACL and users.

The node's retained status is published first, by the node's own user, as its agent
would; the command finds the node's row and rack there. Each change is read back from the
broker by the read-only viewer and must equal what the command printed. Refusals: another
node's user (the ACL drops its publish: exit 77), a wrong password and no user at all
(77), a node nobody has heard of (69), a bad command line (78), each in one line.

The command runs as a user runs it, in its own process.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from polca.assign.publish import Change, assign
from polca.settings import MqttSettings
from polca.telemetry.schema import Assignment, Status, decode, encode
from polca.telemetry.topics import NodeAddress, Topics
from tests.deploy import mosquitto_rig as rig
from tests.mqtt_broker import MosquittoProcess

SITE = "dc1"
TOPICS = Topics()
NODE1 = NodeAddress(SITE, "row1", "rack1", "node1")
NODE2 = NodeAddress(SITE, "row1", "rack2", "node2")
ASSIGN1 = TOPICS.node(NODE1, "assign")
SCHEDULER = "polca-scheduler"
VIEWER = "polca-viewer"
USERS = (SCHEDULER, VIEWER, "node1", "node2")
WRONG = "not-the-password"  # a password the broker refuses
UUID = "GPU-5d2b7c1e-0a7f-4e0c-9a51-0c3c2d1b9f00"

# Until polca.cli wires `assign` in; then: [sys.executable, "-m", "polca", "assign"].
COMMAND = [sys.executable, "-m", "polca", "assign"]


Rig = tuple[MosquittoProcess, dict[str, str]]


@pytest.fixture
def deployed(tmp_path: Path) -> Iterator[Rig]:
    """A broker with deploy/mosquitto's config, the repo's pattern ACL and its users;
    node1 and node2 have published their retained online status."""
    with rig.brokers(tmp_path) as start:
        passwords = rig.make_passwords(tmp_path, USERS)
        broker = start(acl=rig.PATTERN_ACL, password_file=tmp_path / "passwd")
        asyncio.run(_announce(broker, passwords, NODE1))
        asyncio.run(_announce(broker, passwords, NODE2))
        yield broker, passwords


async def _announce(broker: MosquittoProcess, passwords: dict[str, str], addr: NodeAddress) -> None:
    """The node's retained online status, published by its own user as its agent does."""
    status = Status(ts_ns=time.time_ns(), state="online", node=addr.node, gpu_count=8)
    async with rig.connected(broker, addr.node, passwords[addr.node]) as client:
        await client.publish(TOPICS.node(addr, "status"), encode(status), qos=1, retain=True)


def _assign(
    broker: MosquittoProcess, *args: str, user: str | None = SCHEDULER, secret: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``polca assign ARGS`` as the scheduler's hook runs it (the password from the env)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLCA_")}
    if secret is not None:
        env["POLCA_MQTT__PASSWORD"] = secret
    login = ["--username", user] if user is not None else []
    return subprocess.run(
        [*COMMAND, "--broker", f"{broker.host}:{broker.port}", "--site", SITE, *login, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def _printed(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The one JSON line of a successful run."""
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    printed: dict[str, Any] = json.loads(lines[0])
    return printed


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


async def _retained(broker: MosquittoProcess, password: str, addr: NodeAddress) -> bytes | None:
    """The retained assignment of ``addr`` as the viewer reads it (None: none retained).

    The assign and status topics are subscribed in one request: the broker sends their
    retained messages in that order, so the (always retained) status marks the end.
    """
    assign_topic, status_topic = TOPICS.node(addr, "assign"), TOPICS.node(addr, "status")
    found: bytes | None = None
    async with rig.connected(broker, VIEWER, password) as viewer:
        await viewer.subscribe([(assign_topic, 1), (status_topic, 1)])
        async with asyncio.timeout(rig.WAIT_S):
            async for message in viewer.messages:
                if message.topic.value == status_topic:
                    return found
                assert isinstance(message.payload, bytes)
                found = message.payload
    msg = "the viewer's messages ended before the status"
    raise AssertionError(msg)


def _read_back(deployed: Rig, addr: NodeAddress = NODE1) -> dict[str, Any]:
    """The retained assignment, shaped as the command prints it."""
    broker, passwords = deployed
    payload = asyncio.run(_retained(broker, passwords[VIEWER], addr))
    topic = TOPICS.node(addr, "assign")
    if payload is None:
        return {"node": addr.node, "topic": topic, "classes": {}, "seq": None}
    message = decode(payload, Assignment)
    return {"node": addr.node, "topic": topic, "classes": message.classes, "seq": message.seq}


def test_set_change_and_clear_a_nodes_classes(deployed: Rig) -> None:
    """Set, change, clear one GPU, clear all: each printed map is the one retained."""
    broker, passwords = deployed
    secret = passwords[SCHEDULER]

    def run(*args: str) -> dict[str, Any]:
        printed = _printed(_assign(broker, "--node", "node1", *args, secret=secret))
        assert printed == _read_back(deployed)
        return printed

    first = run("--gpu", "0", "--class", "high")
    assert first == {"node": "node1", "topic": ASSIGN1, "classes": {"0": "high"}, "seq": 1}
    changed = run("--gpu", "0", "--gpu", f"3,{UUID}", "--class", "low")
    assert changed["classes"] == {"0": "low", "3": "low", UUID: "low"}
    assert changed["seq"] == 2
    one_cleared = run("--gpu", "3", "--clear")
    assert one_cleared["classes"] == {"0": "low", UUID: "low"}
    assert one_cleared["seq"] == 3
    only = run("--gpu", "5", "--class", "batch", "--clear")
    assert only["classes"] == {"5": "batch"}
    assert only["seq"] == 4
    cleared = run("--clear")
    assert cleared == {"node": "node1", "topic": ASSIGN1, "classes": {}, "seq": None}
    again = run("--gpu", "1", "--class", "high")  # a new map after the clear
    assert again["classes"] == {"1": "high"}
    assert again["seq"] == 1
    # node2's map was never touched.
    assert _read_back(deployed, NODE2)["classes"] == {}


def test_row_and_rack_given_skip_the_status(deployed: Rig) -> None:
    """--row/--rack name the topic directly; the map lands where the agent reads it."""
    broker, passwords = deployed
    done = _assign(
        broker,
        *("--node", "node2", "--row", "row1", "--rack", "rack2"),
        *("--gpu", "7", "--class", "high"),
        secret=passwords[SCHEDULER],
    )
    printed = _printed(done)
    assert printed["topic"] == TOPICS.node(NODE2, "assign")
    assert printed == _read_back(deployed, NODE2)


def test_a_node_user_cannot_assign_another_node(deployed: Rig) -> None:
    """node2's user publishing node1's assignment: the ACL drops it, the command says so
    (77, one line) and the retained map is unchanged."""
    broker, passwords = deployed
    before = _printed(
        _assign(
            broker, "--node", "node1", "--gpu", "0", "--class", "high", secret=passwords[SCHEDULER]
        )
    )
    started = time.monotonic()
    done = _assign(
        broker,
        *("--node", "node1", "--row", "row1", "--rack", "rack1"),
        *("--gpu", "0", "--class", "low", "--timeout", "2"),
        user="node2",
        secret=passwords["node2"],
    )
    assert done.returncode == 77, done.stderr
    assert ASSIGN1 in _one_line(done)
    assert time.monotonic() - started < 15
    assert _read_back(deployed) == before


@pytest.mark.parametrize("user", ["wrong-password", "anonymous"])
def test_refused_credentials_fail_with_77(deployed: Rig, user: str) -> None:
    """The scheduler with a wrong password, or no user at all: 77, in one line."""
    broker, _ = deployed
    if user == "anonymous":
        done = _assign(broker, "--node", "node1", "--gpu", "0", "--class", "high", user=None)
    else:
        done = _assign(broker, "--node", "node1", "--gpu", "0", "--class", "high", secret=WRONG)
    assert done.returncode == 77, done.stderr
    _one_line(done)
    assert _read_back(deployed)["classes"] == {}


def test_an_unknown_node_fails_with_69_in_one_line(deployed: Rig) -> None:
    """No status names the node: 69 after --timeout, naming the node and the filter."""
    broker, passwords = deployed
    started = time.monotonic()
    done = _assign(
        broker,
        *("--node", "node9", "--gpu", "0", "--class", "high", "--timeout", "1"),
        secret=passwords[SCHEDULER],
    )
    took_s = time.monotonic() - started
    assert done.returncode == 69, done.stderr
    line = _one_line(done)
    assert "node9" in line
    assert f"polca/v1/{SITE}/+/+/node9/status" in line
    assert 1 <= took_s < 15


def test_an_unreachable_broker_fails_with_69(tmp_path: Path) -> None:
    """Nothing listening: 69 in one line naming the broker."""
    broker = MosquittoProcess(tmp_path / "never-started")  # a free port nobody listens on
    done = _assign(broker, "--node", "node1", "--gpu", "0", "--class", "high", secret=WRONG)
    assert done.returncode == 69, done.stderr
    assert f"{broker.host}:{broker.port}" in _one_line(done)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--node", "node1", "--gpu", "0"], "--class"),
        (["--node", "node1", "--gpu", "0", "--class", "no spaces"], "--class"),
        (["--node", "node1", "--gpu", "gpu0", "--class", "high"], "gpu0"),
        (["--node", "node1", "--class", "high"], "--gpu"),
        (["--node", "node1", "--row", "row1", "--gpu", "0", "--class", "high"], "--rack"),
        (["--node", "node/1", "--gpu", "0", "--class", "high"], "--node"),
        (["--gpu", "0", "--class", "high"], "--node"),
        (["--node", "node1", "--gpu", "0", "--class", "high", "--timeout", "0"], "--timeout"),
    ],
)
def test_usage_problems_exit_78_before_connecting(args: list[str], says: str) -> None:
    """A bad command line: 78 and one line saying which option, without any broker."""
    done = subprocess.run(
        [*COMMAND, "--broker", "127.0.0.1:1", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 78, done.stderr
    assert says in _one_line(done)


def test_a_bad_config_file_exits_78(tmp_path: Path) -> None:
    """Settings that do not validate: 78, one line naming the file."""
    config = tmp_path / "assign.yaml"
    config.write_text("mqtt:\n  port: 'not a port'\n", encoding="utf-8")
    done = subprocess.run(
        [*COMMAND, "--config", str(config), "--node", "n1", "--gpu", "0", "--class", "high"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 78, done.stderr
    assert str(config) in _one_line(done)


async def test_a_change_that_came_in_between_is_merged_not_lost(deployed: Rig) -> None:
    """Another writer publishes node1's map after this command read it and before it
    published: the command sees that map arrive before its own echo, applies its change
    on top of it and publishes again, so neither change is lost."""
    broker, passwords = deployed
    foreign = Assignment(ts_ns=1, seq=7, classes={"5": "batch"})
    calls = 0

    def clock_ns() -> int:
        # Called once per map built: the first time, right between the read and the publish.
        nonlocal calls
        calls += 1
        if calls == 1:
            _publish_from_another_client(broker, passwords[SCHEDULER], encode(foreign))
        return time.time_ns()

    settings = MqttSettings(
        host=broker.host,
        port=broker.port,
        username=SCHEDULER,
        password=SecretStr(passwords[SCHEDULER]),
    )
    outcome = await assign(
        settings,
        topics=TOPICS,
        site=SITE,
        node="node1",
        change=Change(("0",), "high", clear=False),
        timeout_s=5.0,
        clock_ns=clock_ns,
    )
    assert calls == 2  # published twice: the lost update was noticed
    assert dict(outcome.classes) == {"5": "batch", "0": "high"}
    assert outcome.seq == 8  # above the other writer's
    payload = await _retained(broker, passwords[VIEWER], NODE1)
    assert payload is not None
    retained = decode(payload, Assignment)
    assert (retained.classes, retained.seq) == (outcome.classes, outcome.seq)


def _publish_from_another_client(broker: MosquittoProcess, password: str, payload: bytes) -> None:
    """Publish node1's map (QoS 1, retained) from another connection, and wait for it."""

    async def publish() -> None:
        async with rig.connected(broker, SCHEDULER, password) as client:
            await client.publish(ASSIGN1, payload, qos=1, retain=True)

    thread = threading.Thread(target=asyncio.run, args=(publish(),))
    thread.start()
    thread.join(timeout=rig.WAIT_S)
    assert not thread.is_alive()
