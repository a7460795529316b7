"""MQTT clients for the broker tests: a blocking MQTT 3.1.1 client on a plain socket, a
client that vanishes with a Last Will, and aiomqtt clients that retry their connection.

The blocking client serves ``tests.nats_cluster``'s readiness checks, which run outside
any event loop (a fixture, or a thread); it speaks just enough MQTT 3.1.1 for them:
CONNECT, QoS 1 PUBLISH, QoS 0 SUBSCRIBE and the packets that answer them. The Last Will
client writes its CONNECT by hand so that it can drop the connection without a
DISCONNECT. ``mqtt_client`` retries a refused or timed-out connection for a while, as
polca's reconnect loop does while a cluster elects new leaders.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import ssl
import struct
from collections.abc import AsyncIterator

import aiomqtt

from polca.telemetry.bus import _reap

__all__ = ["RefusedError", "SyncMqtt", "connect_packet", "mqtt_client", "vanish_with_will"]

_ids = itertools.count()
_RETRY_PAUSE_S = 0.25
"""Pause between two connection attempts of ``mqtt_client``."""


def _string(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    return struct.pack("!H", len(raw)) + raw


def _packet(first_byte: int, body: bytes) -> bytes:
    length, remaining = b"", len(body)
    while True:  # the "remaining length" varint
        byte, remaining = remaining % 128, remaining // 128
        length += bytes([byte | (0x80 if remaining else 0)])
        if not remaining:
            return bytes([first_byte]) + length + body


def connect_packet(
    client_id: str,
    *,
    user: str | None = None,
    password: str | None = None,
    will: tuple[str, bytes] | None = None,
    keepalive_s: int = 30,
) -> bytes:
    """An MQTT 3.1.1 CONNECT, clean session; a ``will`` is retained at QoS 1, as polca's."""
    flags = 0x02
    payload = _string(client_id)
    if will is not None:
        flags |= 0x04 | 0x08 | 0x20  # will, QoS 1, retained
        payload += _string(will[0]) + _string(will[1])
    if user is not None:
        flags |= 0x80
        payload += _string(user)
    if password is not None:
        flags |= 0x40
        payload += _string(password)
    return _packet(
        0x10, _string("MQTT") + bytes([4, flags]) + struct.pack("!H", keepalive_s) + payload
    )


class RefusedError(Exception):
    """The broker refused the CONNECT (return code), which no retry changes."""


class SyncMqtt:
    """A blocking MQTT 3.1.1 client: connect, publish QoS 1, subscribe QoS 0, read."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._ids = itertools.count(1)

    @classmethod
    def connect(
        cls,
        endpoint: tuple[str, int],
        *,
        client_id: str,
        user: str | None,
        password: str | None,
        tls: ssl.SSLContext | None,
        timeout_s: float,
    ) -> SyncMqtt:
        sock = socket.create_connection(endpoint, timeout=timeout_s)
        try:
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=endpoint[0])
            client = cls(sock)
            sock.sendall(connect_packet(client_id, user=user, password=password))
            kind, body = client._read()
        except BaseException:
            sock.close()
            raise
        if kind != 0x20 or body[1] != 0:
            sock.close()
            msg = f"CONNECT to {endpoint} refused: packet {kind:#x}, {body!r}"
            raise RefusedError(msg)
        return client

    def _read_exactly(self, count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = self._sock.recv(count - len(data))
            if not chunk:
                msg = "the broker closed the connection"
                raise ConnectionError(msg)
            data += chunk
        return data

    def _read(self) -> tuple[int, bytes]:
        first = self._read_exactly(1)[0]
        length, shift = 0, 0
        while True:
            byte = self._read_exactly(1)[0]
            length += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        return first & 0xF0, self._read_exactly(length)

    def publish(self, topic: str, payload: bytes, *, retain: bool) -> None:
        packet_id = next(self._ids)
        first = 0x30 | 0x02 | (0x01 if retain else 0)
        self._sock.sendall(_packet(first, _string(topic) + struct.pack("!H", packet_id) + payload))
        while True:
            kind, body = self._read()
            if kind == 0x40 and struct.unpack("!H", body[:2])[0] == packet_id:
                return

    def subscribe(self, topic: str) -> None:
        """Subscribe to ``topic`` at QoS 0; wait for the SUBACK (messages before it are
        lost, which only ever are readiness messages)."""
        packet_id = next(self._ids)
        self._sock.sendall(_packet(0x82, struct.pack("!H", packet_id) + _string(topic) + b"\x00"))
        while True:
            kind, body = self._read()
            if kind == 0x90:
                if body[2:] == b"\x80":
                    msg = f"subscription to {topic} refused"
                    raise RefusedError(msg)
                return

    def next_message(self, topic: str, *, wait_s: float = 2.0) -> bytes:
        """The next message on ``topic``; a socket timeout after ``wait_s`` if none comes."""
        self._sock.settimeout(wait_s)
        while True:
            kind, body = self._read()
            if kind == 0x30:
                (length,) = struct.unpack("!H", body[:2])
                if body[2 : 2 + length].decode() == topic:
                    return body[2 + length :]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.sendall(b"\xe0\x00")  # DISCONNECT: no Last Will
        self._sock.close()


async def vanish_with_will(
    endpoint: tuple[str, int],
    *,
    client_id: str,
    will: tuple[str, bytes],
    user: str | None = None,
    password: str | None = None,
    keepalive_s: int = 30,
    tls_context: ssl.SSLContext | None = None,
    timeout_s: float = 20.0,
) -> None:
    """Connect with a Last Will (retained, QoS 1), then drop the TCP connection.

    No DISCONNECT is sent, so the broker publishes the will, if the user may write it.
    """
    reader, writer = await asyncio.open_connection(
        *endpoint, ssl=tls_context, server_hostname=endpoint[0] if tls_context else None
    )
    try:
        packet = connect_packet(
            client_id, user=user, password=password, will=will, keepalive_s=keepalive_s
        )
        writer.write(packet)
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            assert await reader.readexactly(4) == b"\x20\x02\x00\x00"  # CONNACK, accepted
    finally:
        writer.transport.abort()  # no FIN after a DISCONNECT: the connection just ends


@contextlib.asynccontextmanager
async def mqtt_client(
    endpoint: tuple[str, int],
    *,
    identifier: str | None = None,
    user: str | None = None,
    password: str | None = None,
    tls_context: ssl.SSLContext | None = None,
    retry_s: float = 0.0,
    timeout_s: float = 20.0,
) -> AsyncIterator[aiomqtt.Client]:
    """An aiomqtt client (MQTT 3.1.1, clean session) connected to ``endpoint``.

    ``retry_s``: keep trying to connect for that long (a cluster electing new leaders
    after a node died fails or times out CONNECTs for a few seconds), as polca's
    reconnect loop would.
    """
    deadline = asyncio.get_running_loop().time() + retry_s
    while True:
        client = aiomqtt.Client(
            endpoint[0],
            endpoint[1],
            identifier=identifier or f"polca-test-{next(_ids)}",
            username=user,
            password=password,
            protocol=aiomqtt.ProtocolVersion.V311,
            tls_context=tls_context,
            timeout=timeout_s,
        )
        try:
            await client.__aenter__()
        except aiomqtt.MqttError:
            await _reap(client)
            if asyncio.get_running_loop().time() >= deadline:
                raise
            await asyncio.sleep(_RETRY_PAUSE_S)
            continue
        break
    try:
        yield client
    finally:
        with contextlib.suppress(aiomqtt.MqttError):
            await client.__aexit__(None, None, None)
        await _reap(client)
