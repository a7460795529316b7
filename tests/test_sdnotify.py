"""The sd_notify client against real AF_UNIX datagram sockets, and the watchdog gate."""

from __future__ import annotations

import os
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from polca.sdnotify import SystemdNotifier, WatchdogGate


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: AF_UNIX paths are limited to 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="sdn") as name:
        yield Path(name)


@pytest.fixture
def receiver(short_dir: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket standing in for systemd, and its NOTIFY_SOCKET value."""
    path = short_dir / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(2.0)
    sock.bind(str(path))
    try:
        yield sock, str(path)
    finally:
        sock.close()


def _recv(sock: socket.socket) -> bytes:
    return sock.recv(4096)


def _assert_nothing_queued(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        with pytest.raises(BlockingIOError):
            sock.recv(4096)
    finally:
        sock.settimeout(2.0)


def test_ready_with_status_is_one_datagram(receiver: tuple[socket.socket, str]) -> None:
    """ready(status) sends READY=1 and STATUS in a single datagram, in that order."""
    sock, address = receiver
    notifier = SystemdNotifier({"NOTIFY_SOCKET": address})
    assert notifier.ready("8 GPUs, policy default") is True
    assert _recv(sock) == b"READY=1\nSTATUS=8 GPUs, policy default"
    _assert_nothing_queued(sock)
    notifier.close()


def test_helpers_send_exact_datagrams(receiver: tuple[socket.socket, str]) -> None:
    """Each helper sends exactly the protocol assignment systemd expects."""
    sock, address = receiver
    notifier = SystemdNotifier({"NOTIFY_SOCKET": address})
    notifier.ready()
    notifier.status("capping row1")
    notifier.watchdog()
    notifier.stopping()
    notifier.notify(READY=1, STATUS="up", ERRNO=0)
    notifier.send("EXTEND_TIMEOUT_USEC=5000000")
    assert [_recv(sock) for _ in range(6)] == [
        b"READY=1",
        b"STATUS=capping row1",
        b"WATCHDOG=1",
        b"STOPPING=1",
        b"READY=1\nSTATUS=up\nERRNO=0",
        b"EXTEND_TIMEOUT_USEC=5000000",
    ]
    notifier.close()


def test_reloading_carries_monotonic_usec(receiver: tuple[socket.socket, str]) -> None:
    """reloading() sends RELOADING=1 and the current CLOCK_MONOTONIC in microseconds."""
    sock, address = receiver
    notifier = SystemdNotifier({"NOTIFY_SOCKET": address})
    before_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    after_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    first, second = _recv(sock).decode().split("\n")
    assert first == "RELOADING=1"
    key, value = second.split("=")
    assert key == "MONOTONIC_USEC"
    assert before_us <= int(value) <= after_us
    notifier.close()


def test_newline_in_value_cannot_inject_an_assignment(
    receiver: tuple[socket.socket, str],
) -> None:
    """A newline inside a status text becomes a space instead of a second assignment."""
    sock, address = receiver
    notifier = SystemdNotifier({"NOTIFY_SOCKET": address})
    notifier.status("bad\nREADY=1")
    assert _recv(sock) == b"STATUS=bad READY=1"
    notifier.close()


def test_abstract_namespace_address() -> None:
    """A NOTIFY_SOCKET starting with '@' reaches a socket in the abstract namespace."""
    name = f"polca-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(2.0)
    sock.bind("\0" + name)
    try:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.enabled is True
        assert notifier.ready() is True
        assert _recv(sock) == b"READY=1"
        notifier.close()
    finally:
        sock.close()


def test_unset_socket_is_a_silent_no_op() -> None:
    """Without NOTIFY_SOCKET every call returns False, opens nothing and logs nothing."""
    notifier = SystemdNotifier({})
    with capture_logs() as logs:
        assert notifier.enabled is False
        assert notifier.ready("x") is False
        assert notifier.watchdog() is False
        assert notifier.reloading() is False
        assert notifier.notify(STATUS="x") is False
    assert logs == []
    assert notifier.watchdog_interval_s() is None


def test_reads_process_environment_by_default(
    receiver: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an explicit mapping the notifier reads NOTIFY_SOCKET from os.environ."""
    sock, address = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    notifier = SystemdNotifier()
    assert notifier.stopping() is True
    assert _recv(sock) == b"STOPPING=1"
    notifier.close()


def test_send_failure_logged_once_never_raised(short_dir: Path) -> None:
    """Sending to a missing socket returns False and logs sd_notify_failed only once."""
    missing = str(short_dir / "absent")
    with capture_logs() as logs:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": missing})
        assert logs == []  # construction does no I/O
        assert notifier.ready() is False
        assert notifier.watchdog() is False
        assert notifier.stopping() is False
    failures = [entry for entry in logs if entry["event"] == "sd_notify_failed"]
    assert len(failures) == 1
    assert failures[0]["log_level"] == "warning"
    assert failures[0]["socket"] == missing
    notifier.close()


def test_socket_opened_lazily_works_once_systemd_listens(short_dir: Path) -> None:
    """A notifier built before the socket exists delivers once it appears, after a failure."""
    path = short_dir / "late"
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(path)})
    with capture_logs():
        assert notifier.watchdog() is False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(2.0)
    sock.bind(str(path))
    try:
        assert notifier.watchdog() is True
        assert _recv(sock) == b"WATCHDOG=1"
    finally:
        sock.close()
        notifier.close()


@pytest.mark.parametrize(
    ("env", "timeout_s"),
    [
        ({"WATCHDOG_USEC": "10000000"}, 10.0),
        ({"WATCHDOG_USEC": "2500000", "WATCHDOG_PID": str(os.getpid())}, 2.5),
        ({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "ten"}, None),
        ({"WATCHDOG_USEC": ""}, None),
        ({}, None),
    ],
    ids=["plain", "our-pid", "other-pid", "zero", "negative", "garbage", "empty", "unset"],
)
def test_watchdog_usec_parsing(env: dict[str, str], timeout_s: float | None) -> None:
    """WATCHDOG_USEC gives the timeout, half of it the ping interval; a foreign PID gives none."""
    notifier = SystemdNotifier({"NOTIFY_SOCKET": "@unused", **env})
    assert notifier.watchdog_timeout_s() == timeout_s
    expected_interval_s = None if timeout_s is None else timeout_s / 2
    assert notifier.watchdog_interval_s() == expected_interval_s


def test_gate_closed_before_first_beat() -> None:
    """No ping is allowed before the control loop has ticked once."""
    gate = WatchdogGate(clock=lambda: 100.0)
    assert gate.last_beat_s is None
    assert gate.should_ping(100.0, max_stall_s=5.0) is False


def test_gate_stops_pings_when_beats_stop() -> None:
    """Pings are allowed while beats are fresh and refused once they are max_stall_s old."""
    now = [0.0]
    gate = WatchdogGate(clock=lambda: now[0])
    for tick in range(50):
        now[0] = tick * 0.1
        gate.beat()
        assert gate.should_ping(now[0] + 0.05, max_stall_s=1.0) is True
    last_beat_s = now[0]
    assert gate.last_beat_s == last_beat_s
    assert gate.should_ping(last_beat_s + 1.0, max_stall_s=1.0) is True
    assert gate.should_ping(last_beat_s + 1.01, max_stall_s=1.0) is False
    gate.beat(now=last_beat_s + 3.0)
    assert gate.should_ping(last_beat_s + 3.5, max_stall_s=1.0) is True


def test_gate_feed_pings_only_while_loop_progresses(
    receiver: tuple[socket.socket, str],
) -> None:
    """feed() sends WATCHDOG=1 while beats arrive, withholds it (logged once) when they stop."""
    sock, address = receiver
    notifier = SystemdNotifier({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "10000000"})
    gate = WatchdogGate()
    gate.beat(now=10.0)
    with capture_logs() as logs:
        assert gate.feed(notifier, 12.0, max_stall_s=5.0) is True
        assert _recv(sock) == b"WATCHDOG=1"
        assert gate.feed(notifier, 16.0, max_stall_s=5.0) is False
        assert gate.feed(notifier, 21.0, max_stall_s=5.0) is False
        _assert_nothing_queued(sock)
        gate.beat(now=22.0)
        assert gate.feed(notifier, 23.0, max_stall_s=5.0) is True
        assert _recv(sock) == b"WATCHDOG=1"
    events = [entry["event"] for entry in logs]
    assert events == ["watchdog_withheld", "watchdog_resumed"]
    assert logs[0]["stalled_s"] == 6.0
    notifier.close()
