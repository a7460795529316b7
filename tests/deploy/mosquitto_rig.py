"""A real Mosquitto with deploy/mosquitto's files, and probes of what each user may do.

Brokers run ``/usr/sbin/mosquitto`` with a copy of ``deploy/mosquitto/mosquitto.conf`` in
which only the listener port, the file paths and the process user are rewritten (each
rewrite must match exactly once, so a changed file is noticed), with users made by the
folder's own scripts. Clients are aiomqtt clients speaking MQTT 3.1.1, in which the broker
acknowledges a publish it refuses and silently drops it.

The probes answer "what may each user write and read" without waiting for timeouts. To
the ACL under test they append three test-only grants that decide nothing about polca's
topics (a section applies only to its own user, and the pattern matches only
``polca-test/...``): ``polca-test-observer`` reads ``#``, ``polca-test-writer`` writes
``#``, and every user may read its own end marker ``polca-test/done/<user>``. Every
publish is QoS 1 and awaited, so the broker has routed it before the next step; the end
marker, published last, then arrives after everything that got through.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pwd
import re
import ssl
import struct
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path

import aiomqtt
import pytest

from tests.mqtt_broker import MOSQUITTO_PASSWD, MosquittoProcess, TlsFiles

ROOT = Path(__file__).resolve().parents[2]
MOSQUITTO_DIR = ROOT / "deploy" / "mosquitto"
CONF = MOSQUITTO_DIR / "mosquitto.conf"
COMPOSE_CONF = MOSQUITTO_DIR / "compose.conf"
PATTERN_ACL = MOSQUITTO_DIR / "acl"
MAKE_ACL = MOSQUITTO_DIR / "make-acl.py"
MAKE_PASSWORDS = MOSQUITTO_DIR / "make-passwords.sh"

WAIT_S = 5.0
"""Bound on every wait for the broker; reached only when a test fails."""

OBSERVER = "polca-test-observer"
WRITER = "polca-test-writer"
TEST_USERS = (OBSERVER, WRITER)

PROBE_GRANTS = f"""
# --- Test only (tests/deploy/mosquitto_rig.py) ---
user {OBSERVER}
topic read #
user {WRITER}
topic write #
pattern read polca-test/done/%u
"""

BrokerFactory = Callable[..., MosquittoProcess]

_will_ids = itertools.count()


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


def node_listener(tls: TlsFiles, port: int, *, bind_client_id: bool = True) -> str:
    """The commented node listener of mosquitto.conf (``listener 8883`` through
    ``use_username_as_clientid``), uncommented, on 127.0.0.1:``port`` with ``tls``'s files;
    without the ``use_username_as_clientid`` line when ``bind_client_id`` is false."""
    text = CONF.read_text(encoding="utf-8")
    block = re.search(r"(?ms)^#listener 8883\n.*?^#use_username_as_clientid true\n", text)
    assert block is not None, "the node listener block is not in mosquitto.conf"
    enabled = re.sub(r"(?m)^#(?=[a-z_]+ )", "", block.group(0))
    enabled = enabled.replace("listener 8883", f"listener {port} 127.0.0.1")
    enabled = re.sub(r"(?m)^cafile .*$", f"cafile {tls.ca_cert}", enabled)
    enabled = re.sub(r"(?m)^certfile .*$", f"certfile {tls.server_cert}", enabled)
    enabled = re.sub(r"(?m)^keyfile .*$", f"keyfile {tls.server_key}", enabled)
    if not bind_client_id:
        enabled = enabled.replace("use_username_as_clientid true\n", "")
    return enabled


def run_script(argv: Sequence[str | Path], **env: str) -> subprocess.CompletedProcess[str]:
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
    """Users made by make-passwords.sh in ``workdir/passwd``; name -> password."""
    secrets = workdir / "secrets"
    result = run_script(
        ["sh", MAKE_PASSWORDS, *users],
        PASSWORD_FILE=str(workdir / "passwd"),
        SECRETS_DIR=str(secrets),
    )
    assert result.returncode == 0, result.stderr
    return {user: (secrets / f"{user}.pass").read_text(encoding="utf-8").strip() for user in users}


def probe_acl(acl: Path, copy: Path) -> Path:
    """``copy``: the ACL ``acl`` with the test-only grants of the probes appended."""
    copy.write_text(acl.read_text(encoding="utf-8") + PROBE_GRANTS, encoding="utf-8")
    return copy


@contextmanager
def brokers(tmp_path: Path) -> Iterator[BrokerFactory]:
    """Start Mosquitto with the deploy configuration, an ACL and a password file; kill all after."""
    started: list[MosquittoProcess] = []

    def start(*, acl: Path, password_file: Path, extra: str = "") -> MosquittoProcess:
        workdir = tmp_path / f"broker-{len(started)}"
        broker = MosquittoProcess(workdir)
        started.append(broker)
        broker.conf_path.write_text(
            deploy_config(
                workdir, port=broker.port, acl=acl, password_file=password_file, extra=extra
            ),
            encoding="utf-8",
        )
        broker.start()
        return broker

    try:
        yield start
    finally:
        for broker in started:
            broker.kill()


@asynccontextmanager
async def connected(
    broker: MosquittoProcess,
    user: str | None,
    password: str | None,
    *,
    port: int | None = None,
    tls_context: ssl.SSLContext | None = None,
    timeout_s: float = WAIT_S,
    identifier: str | None = None,
) -> AsyncIterator[aiomqtt.Client]:
    """An MQTT 3.1.1 client logged in as ``user`` (client id ``identifier``, default
    ``test-USER``)."""
    client = aiomqtt.Client(
        broker.host,
        port or broker.port,
        username=user,
        password=password,
        identifier=identifier or f"test-{user}",
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
    client: aiomqtt.Client,
    topics: Sequence[str],
    *,
    retain: bool = False,
    payload: bytes | None = None,
) -> None:
    """Publish each topic at QoS 1, one after the other (payload: the topic by default)."""
    for topic in topics:
        body = topic.encode() if payload is None else payload
        await client.publish(topic, body, qos=1, retain=retain)


def expected(topics: Sequence[str]) -> list[tuple[str, bytes]]:
    """What ``received`` returns for messages published by ``publish_all``."""
    return [(topic, topic.encode()) for topic in topics]


def done_topic(user: str) -> str:
    """The end marker of the probes for ``user``, which only ``user`` may read."""
    return f"polca-test/done/{user}"


async def until_done(client: aiomqtt.Client, user: str) -> list[tuple[str, bytes]]:
    """Every message before ``user``'s end marker, as (topic, payload)."""
    messages: list[tuple[str, bytes]] = []
    async with asyncio.timeout(WAIT_S):
        async for message in client.messages:
            if message.topic.value == done_topic(user):
                return messages
            assert isinstance(message.payload, bytes)
            messages.append((message.topic.value, message.payload))
    msg = "the message iterator ended before the end marker"
    raise AssertionError(msg)


async def _mark_done(
    broker: MosquittoProcess, passwords: Mapping[str, str], users: Sequence[str]
) -> None:
    async with connected(broker, WRITER, passwords[WRITER]) as writer:
        await publish_all(writer, [done_topic(user) for user in users], payload=b"")


async def observed_writes(
    broker: MosquittoProcess, passwords: Mapping[str, str], topics: Sequence[str]
) -> dict[str, list[str]]:
    """Each user publishes every topic; what the observer got, by user, sorted.

    Every user of ``passwords`` but the test users is logged in at once and publishes all
    of ``topics`` (payload: its name).
    """
    users = [user for user in passwords if user not in TEST_USERS]
    async with connected(broker, OBSERVER, passwords[OBSERVER]) as observer:
        await observer.subscribe("#", qos=1)
        async with AsyncExitStack() as stack:
            clients = {
                user: await stack.enter_async_context(connected(broker, user, passwords[user]))
                for user in users
            }
            await asyncio.gather(
                *(
                    publish_all(client, topics, payload=user.encode())
                    for user, client in clients.items()
                )
            )
        await _mark_done(broker, passwords, [OBSERVER])
        messages = await until_done(observer, OBSERVER)
    seen: dict[str, list[str]] = {user: [] for user in users}
    for topic, payload in messages:
        seen[payload.decode()].append(topic)
    return {user: sorted(written) for user, written in seen.items()}


async def observed_reads(
    broker: MosquittoProcess, passwords: Mapping[str, str], topics: Sequence[str]
) -> dict[str, dict[str, list[str]]]:
    """What each user, subscribed to ``#``, gets of every topic: ``retained`` and ``live``.

    The writer publishes every topic retained before the users subscribe (as an agent
    finds control and policy after a restart), then every topic again, live. Returns
    kind -> user -> sorted topics.
    """
    users = [user for user in passwords if user not in TEST_USERS]
    async with connected(broker, WRITER, passwords[WRITER]) as writer:
        await publish_all(writer, topics, retain=True, payload=b"retained")
        async with AsyncExitStack() as stack:
            clients = {
                user: await stack.enter_async_context(connected(broker, user, passwords[user]))
                for user in users
            }
            await asyncio.gather(*(client.subscribe("#", qos=1) for client in clients.values()))
            await publish_all(writer, topics, payload=b"live")
            await publish_all(writer, [done_topic(user) for user in users], payload=b"")
            results = await asyncio.gather(
                *(until_done(client, user) for user, client in clients.items())
            )
    return {
        kind: {
            user: sorted(topic for topic, payload in messages if payload == kind.encode())
            for user, messages in zip(users, results, strict=True)
        }
        for kind in ("retained", "live")
    }


def _string(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("!H", len(raw)) + raw


def _connect_packet(client_id: str, user: str, password: str, will: str) -> bytes:
    """An MQTT 3.1.1 CONNECT with a retained QoS 1 Last Will, as polca registers it."""
    flags = 0x80 | 0x40 | 0x20 | 0x08 | 0x04 | 0x02  # user, password, will retain+QoS 1, clean
    body = _string("MQTT") + bytes([4, flags]) + struct.pack("!H", 60)
    body += _string(client_id) + _string(will) + _string(f"will of {user}")
    body += _string(user) + _string(password)
    length, remaining = b"", len(body)
    while True:  # the "remaining length" varint
        byte, remaining = remaining % 128, remaining // 128
        length += bytes([byte | (0x80 if remaining else 0)])
        if not remaining:
            return b"\x10" + length + body


async def vanish_with_will(broker: MosquittoProcess, user: str, password: str, will: str) -> None:
    """Log in as ``user`` with a Last Will on ``will``, then drop the TCP connection.

    No DISCONNECT is sent, so the broker publishes the will if the ACL lets ``user`` write
    ``will`` (Mosquitto accepts the connection either way). The broker has handled the
    connection's end before it answers the next CONNECT it receives.
    """
    reader, writer = await asyncio.open_connection(broker.host, broker.port)
    try:
        writer.write(_connect_packet(f"test-will-{next(_will_ids)}", user, password, will))
        await writer.drain()
        async with asyncio.timeout(WAIT_S):
            assert await reader.readexactly(4) == b"\x20\x02\x00\x00"  # CONNACK, accepted
    finally:
        writer.close()
        await writer.wait_closed()


def differences(
    got: Mapping[str, Sequence[str]], want: Mapping[str, Sequence[str]]
) -> dict[str, dict[str, list[str]]]:
    """Per user whose topics differ: those it got but should not have, and those missing."""
    result: dict[str, dict[str, list[str]]] = {}
    for user in sorted({*got, *want}):
        have, should = set(got.get(user, ())), set(want.get(user, ()))
        if have != should:
            result[user] = {
                "unexpected": sorted(have - should),
                "missing": sorted(should - have),
            }
    return result
