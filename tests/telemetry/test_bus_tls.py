"""MqttBus over TLS against a real Mosquitto: server-verified and mutual TLS, wrong CA.

The certificates are a throwaway PKI made once per session with the ``openssl`` command
(``tests.mqtt_broker.make_tls_files``); each test starts its own TLS-only broker.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from polca.settings import MqttSettings
from polca.telemetry.bus import MqttBus
from polca.telemetry.messages import OutMessage
from tests.mqtt_broker import MosquittoFactory, TlsFiles, make_tls_files
from tests.telemetry.test_bus import fast_settings, running, wait_until

WAIT_S = 5.0
REFUSED_WINDOW_S = 1.0  # long enough for several attempts at the test's backoff
TOPIC = "polca/test/tls"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """The CA, broker and client certificates every test here shares."""
    return make_tls_files(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """An unrelated CA (and its certificates): the wrong one to trust."""
    return make_tls_files(tmp_path_factory.mktemp("other-pki"), ca_name="polca-other-ca")


def tls_settings(port: int, **overrides: Any) -> MqttSettings:
    """TLS settings that reconnect quickly, for tests (``fast_settings`` with TLS on)."""
    return fast_settings(port, **{"tls": True, **overrides})


async def assert_round_trip(bus: MqttBus, task: asyncio.Task[None]) -> None:
    """The bus connects, and a message it publishes comes back through its subscription."""
    async with asyncio.timeout(WAIT_S):
        connected = asyncio.create_task(bus.connected.wait())
        done, _ = await asyncio.wait({connected, task}, return_when=asyncio.FIRST_COMPLETED)
        connected.cancel()
        if task in done:
            task.result()
            pytest.fail("bus.run() returned unexpectedly")
        # The subscription is sent after CONNACK: publish until the echo arrives.
        while True:
            await bus.publish(OutMessage(TOPIC, b"over tls", qos=1))
            try:
                async with asyncio.timeout(0.2):
                    message = await bus.get()
            except TimeoutError:
                continue
            break
    assert message.topic == TOPIC
    assert message.payload == b"over tls"
    assert bus.stats.connects == 1
    assert bus.stats.last_error is None


def _refusals(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == "mqtt_disconnected"]


async def assert_never_connects(bus: MqttBus, task: asyncio.Task[None]) -> None:
    """Within the window the bus never connects, yet keeps trying (run() does not end)."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(bus.connected.wait(), REFUSED_WINDOW_S)
    assert not task.done(), "a TLS failure must be retried, not end run()"
    assert bus.stats.connects == 0


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_round_trip_over_tls_verified_with_the_ca_file(
    mosquitto_factory: MosquittoFactory, pki: TlsFiles, host: str
) -> None:
    """With tls_ca_file the bus verifies the broker by IP or DNS name and round-trips."""
    broker = mosquitto_factory(tls=pki)
    assert broker.url.startswith("mqtts://")
    bus = MqttBus(
        tls_settings(broker.port, host=host, tls_ca_file=pki.ca_cert),
        client_id="node-tls",
        subscriptions=[(TOPIC, 1)],
    )
    async with running(bus, connect=False) as task:
        await assert_round_trip(bus, task)


async def test_mutual_tls_with_a_client_certificate(
    mosquitto_factory: MosquittoFactory, pki: TlsFiles
) -> None:
    """A broker that requires client certificates accepts the bus's cert and key."""
    broker = mosquitto_factory(tls=pki, require_certificate=True)
    settings = tls_settings(
        broker.port,
        tls_ca_file=pki.ca_cert,
        tls_cert_file=pki.client_cert,
        tls_key_file=pki.client_key,
    )
    bus = MqttBus(settings, client_id="node-mtls", subscriptions=[(TOPIC, 1)])
    async with running(bus, connect=False) as task:
        await assert_round_trip(bus, task)


async def test_mutual_tls_without_a_client_certificate_never_connects(
    mosquitto_factory: MosquittoFactory, pki: TlsFiles
) -> None:
    """A broker that requires client certificates never accepts a bus without one."""
    broker = mosquitto_factory(tls=pki, require_certificate=True)
    # With TLS 1.3 the client's handshake completes before the broker checks for a client
    # certificate; its refusal (an alert) only ends the wait for CONNACK, which times out.
    settings = tls_settings(broker.port, tls_ca_file=pki.ca_cert, connack_timeout_s=0.3)
    bus = MqttBus(settings, client_id="node-no-cert")
    async with running(bus, connect=False) as task:
        await assert_never_connects(bus, task)
        assert bus.stats.last_error is not None


async def test_wrong_ca_never_connects_and_reports_the_certificate_error(
    mosquitto_factory: MosquittoFactory, pki: TlsFiles, other_pki: TlsFiles
) -> None:
    """Trusting another CA fails verification: retried, logged, never connected."""
    broker = mosquitto_factory(tls=pki)
    bus = MqttBus(
        tls_settings(broker.port, tls_ca_file=other_pki.ca_cert), client_id="node-wrong-ca"
    )
    with capture_logs() as logs:
        async with running(bus, connect=False) as task:
            await assert_never_connects(bus, task)
            # Retried: a second refusal, however long a busy machine takes for the first.
            await wait_until(lambda: len(_refusals(logs)) >= 2, "a second attempt")
            assert bus.stats.connects == 0
    gc.collect()  # a socket paho leaked would warn here (an error), not in a later test
    last_error = bus.stats.last_error
    assert last_error is not None
    assert "certificate verify failed" in last_error.lower()
    failures = _refusals(logs)
    assert len(failures) >= 2, "the bus should keep retrying"
    assert all(not e["was_connected"] for e in failures)
    assert all("CERTIFICATE_VERIFY_FAILED" in e["error"] for e in failures)


async def test_plain_mqtt_client_cannot_use_the_tls_listener(
    mosquitto_factory: MosquittoFactory, pki: TlsFiles
) -> None:
    """The TLS listener speaks no plain MQTT: a bus without tls never connects."""
    broker = mosquitto_factory(tls=pki)
    bus = MqttBus(tls_settings(broker.port, tls=False), client_id="node-plain")
    async with running(bus, connect=False) as task:
        await assert_never_connects(bus, task)


def test_tls_broker_config_names_the_pki(
    mosquitto_factory: MosquittoFactory, pki: TlsFiles, tmp_path: Path
) -> None:
    """The broker config points at the PKI and asks for client certificates on request."""
    broker = mosquitto_factory(tls=pki, require_certificate=True)
    config = broker.conf_path.read_text(encoding="utf-8").splitlines()
    assert config[0] == f"listener {broker.port} 127.0.0.1"
    assert f"cafile {pki.ca_cert}" in config
    assert f"certfile {pki.server_cert}" in config
    assert f"keyfile {pki.server_key}" in config
    assert "require_certificate true" in config
    fresh = mosquitto_factory(tls=True)
    assert fresh.tls is not None
    assert fresh.tls.ca_cert.is_relative_to(tmp_path)
    assert fresh.tls.ca_cert.read_bytes() != pki.ca_cert.read_bytes()
