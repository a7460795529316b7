"""A node's certificate is its one identity on the shipped node listener (a real Mosquitto).

The node listener of deploy/mosquitto/mosquitto.conf, enabled: mutual TLS, the
certificate's CN as the user name and the user name as the client id. Two node
certificates issued by ``deploy/mosquitto/make-node-cert.sh``: node1's cannot take over
node2's session by connecting with node2's client id, nor publish or read node2's topics.
The same listener without ``use_username_as_clientid`` lets the takeover happen (what the
line is there for).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from pathlib import Path

import aiomqtt
import pytest

from tests.deploy.mosquitto_rig import (
    MOSQUITTO_DIR,
    PATTERN_ACL,
    BrokerFactory,
    brokers,
    connected,
    make_passwords,
    node_listener,
    run_script,
)
from tests.mqtt_broker import MosquittoProcess, TlsFiles, free_port, make_tls_files

NODE1 = "polca/v1/dc1/row1/rack1/node1"
NODE2 = "polca/v1/dc1/row1/rack1/node2"


@pytest.fixture
def deployed_broker(tmp_path: Path) -> Iterator[BrokerFactory]:
    """Start brokers with the deploy configuration; all are killed after the test."""
    with brokers(tmp_path) as start:
        yield start


def _issue(tls: TlsFiles, node: str, out: Path) -> tuple[Path, Path]:
    done = run_script(
        [MOSQUITTO_DIR / "make-node-cert.sh", tls.ca_cert, tls.ca_key, node, out, "30"]
    )
    assert done.returncode == 0, done.stderr
    assert f"CN = {node}" in done.stdout
    return out / f"{node}.crt", out / f"{node}.key"


def _context(tls: TlsFiles, cert: tuple[Path, Path]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=tls.ca_cert)
    context.load_cert_chain(*cert)
    return context


async def _delivered(client: aiomqtt.Client, topic: str, timeout_s: float = 2.0) -> bool:
    """Whether the next message ``client`` receives within ``timeout_s`` is on ``topic``."""
    try:
        async with asyncio.timeout(timeout_s):
            async for message in client.messages:
                return message.topic.value == topic
    except TimeoutError:
        return False
    return False


async def _still_connected(node: aiomqtt.Client, watcher: aiomqtt.Client, topic: str) -> bool:
    """Whether ``node`` can still publish ``topic`` for ``watcher`` to receive."""
    await asyncio.sleep(0.5)  # the broker has handled the other CONNECT by now
    try:
        await node.publish(topic, b"alive", qos=1, timeout=2)
    except aiomqtt.MqttError:
        return False
    return await _delivered(watcher, topic)


async def _takeover(
    broker: MosquittoProcess,
    port: int,
    tls: TlsFiles,
    certs: dict[str, tuple[Path, Path]],
    password: str,
) -> tuple[bool, bool]:
    """node2 connected as polca-agent-node2, then node1's certificate connecting with the
    same client id: (node2 still connected, node1's write to node2's topic delivered)."""
    async with (
        connected(broker, "polca-aggregator", password) as aggregator,
        connected(
            broker, None, None, port=port, tls_context=_context(tls, certs["node2"]),
            identifier="polca-agent-node2",
        ) as node2,
    ):  # fmt: skip
        await aggregator.subscribe("polca/v1/#", qos=1)
        async with connected(
            broker, None, None, port=port, tls_context=_context(tls, certs["node1"]),
            identifier="polca-agent-node2",
        ) as node1:  # fmt: skip
            alive = await _still_connected(node2, aggregator, f"{NODE2}/telemetry")
            await node1.publish(f"{NODE2}/telemetry", b"forged", qos=1)
            forged = await _delivered(aggregator, f"{NODE2}/telemetry", timeout_s=1.0)
    return alive, forged


async def _takeover_on(
    tmp_path: Path, deployed_broker: BrokerFactory, *, bind_client_id: bool
) -> tuple[bool, bool]:
    """``_takeover`` on the shipped broker with its node listener, bound or not."""
    tls = make_tls_files(tmp_path / "pki")
    certs = {n: _issue(tls, n, tmp_path / "certs") for n in ("node1", "node2")}
    password = make_passwords(tmp_path, ["polca-aggregator"])["polca-aggregator"]
    port = free_port()
    broker = deployed_broker(
        acl=PATTERN_ACL,
        password_file=tmp_path / "passwd",
        extra=node_listener(tls, port, bind_client_id=bind_client_id),
    )
    return await _takeover(broker, port, tls, certs, password)


async def test_a_nodes_certificate_cannot_take_over_or_speak_for_another_node(
    tmp_path: Path, deployed_broker: BrokerFactory
) -> None:
    """node1's certificate, connecting with node2's client id: node2 stays connected (the
    broker gives node1 its own id), and node1's writes to node2's topics go nowhere."""
    alive, forged = await _takeover_on(tmp_path, deployed_broker, bind_client_id=True)
    assert alive, "node1's certificate took over node2's session"
    assert not forged


async def test_without_the_client_id_binding_one_node_evicts_another(
    tmp_path: Path, deployed_broker: BrokerFactory
) -> None:
    """The same listener without use_username_as_clientid: node1's certificate with node2's
    client id disconnects node2 (the takeover the shipped line prevents)."""
    alive, forged = await _takeover_on(tmp_path, deployed_broker, bind_client_id=False)
    assert not alive
    assert not forged  # the ACL still holds: node1 writes as node1


async def test_a_node_reads_only_its_own_assignment(
    tmp_path: Path, deployed_broker: BrokerFactory
) -> None:
    """node1 subscribed to every node's assign topic receives its own only."""
    tls = make_tls_files(tmp_path / "pki")
    certs = {n: _issue(tls, n, tmp_path / "certs") for n in ("node1",)}
    passwords = make_passwords(tmp_path, ["polca-scheduler"])
    port = free_port()
    broker = deployed_broker(
        acl=PATTERN_ACL,
        password_file=tmp_path / "passwd",
        extra=node_listener(tls, port),
    )
    async with (
        connected(broker, "polca-scheduler", passwords["polca-scheduler"]) as scheduler,
        connected(
            broker, None, None, port=port, tls_context=_context(tls, certs["node1"]),
            identifier="polca-agent-node1",
        ) as node1,
    ):  # fmt: skip
        await node1.subscribe("polca/v1/dc1/row1/rack1/+/assign", qos=1)
        await node1.subscribe(f"{NODE2}/assign", qos=1)
        await scheduler.publish(f"{NODE2}/assign", b"theirs", qos=1)
        await scheduler.publish(f"{NODE1}/assign", b"mine", qos=1)
        assert await _delivered(node1, f"{NODE1}/assign")
        assert not await _delivered(node1, f"{NODE2}/assign", timeout_s=1.0)


def test_make_node_cert_refuses_what_is_not_a_node_name(tmp_path: Path) -> None:
    """One line and exit 2 for a name that is not a node name, or a bad day count."""
    tls = make_tls_files(tmp_path / "pki")
    script = MOSQUITTO_DIR / "make-node-cert.sh"
    bad = run_script([script, tls.ca_cert, tls.ca_key, "node/2", tmp_path / "out"])
    assert (bad.returncode, len(bad.stderr.splitlines())) == (2, 1)
    days = run_script([script, tls.ca_cert, tls.ca_key, "node2", tmp_path / "out", "-1"])
    assert days.returncode == 2
    assert not (tmp_path / "out" / "node2.crt").exists()


async def test_polca_connects_with_the_node_certificate_alone(
    tmp_path: Path, deployed_broker: BrokerFactory
) -> None:
    """polca's own bus with what the Kubernetes DaemonSet gives an agent (the node's
    certificate and key from its node-local directory, no user name, no password) is
    node1 on the node listener: its telemetry arrives, its write to node2's topic does not."""
    from polca.settings import MqttSettings
    from polca.telemetry.bus import MqttBus
    from polca.telemetry.messages import OutMessage

    tls = make_tls_files(tmp_path / "pki")
    cert, key = _issue(tls, "node1", tmp_path / "mqtt-identity")
    password = make_passwords(tmp_path, ["polca-aggregator"])["polca-aggregator"]
    port = free_port()
    broker = deployed_broker(
        acl=PATTERN_ACL, password_file=tmp_path / "passwd", extra=node_listener(tls, port)
    )
    settings = MqttSettings(
        host="localhost",
        port=port,
        tls=True,
        tls_ca_file=tls.ca_cert,
        tls_cert_file=cert,
        tls_key_file=key,
        connect_timeout_s=10.0,
    )
    assert settings.username is None
    bus = MqttBus(settings, client_id="polca-agent-node1")
    async with connected(broker, "polca-aggregator", password) as aggregator:
        await aggregator.subscribe("polca/v1/#", qos=1)
        task = asyncio.create_task(bus.run())
        try:
            async with asyncio.timeout(10.0):
                await bus.connected.wait()
            await bus.publish(OutMessage(f"{NODE2}/telemetry", b"forged", qos=1))
            await bus.publish(OutMessage(f"{NODE1}/telemetry", b"mine", qos=1))
            assert await bus.flush(5.0)
            async with asyncio.timeout(5.0):
                async for message in aggregator.messages:
                    assert message.topic.value == f"{NODE1}/telemetry", message.topic
                    assert message.payload == b"mine"
                    break
        finally:
            await bus.close(timeout_s=2.0)
            await task
