"""A real Mosquitto on a free loopback port, for tests that need an MQTT broker.

Tests never talk to public brokers and never mock the network: each test gets its own
``/usr/sbin/mosquitto`` process with a config in a temporary directory, which it can stop,
kill and start again on the same port (broker-outage tests). CI installs Mosquitto; when it
is missing the fixtures fail with a message saying so (they never skip).

Register the fixtures with ``from tests.mqtt_broker import mosquitto, mosquitto_factory``
in a ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

MOSQUITTO = Path("/usr/sbin/mosquitto")
MOSQUITTO_PASSWD = Path("/usr/bin/mosquitto_passwd")
_START_TIMEOUT_S = 5.0
_STOP_TIMEOUT_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class MosquittoProcess:
    """One Mosquitto broker process with its own config, on a fixed loopback port.

    ``users`` (name -> password) turns anonymous access off and writes a password file
    with ``mosquitto_passwd``. Persistence is off: a restart forgets retained messages.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        users: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        if not MOSQUITTO.exists():
            pytest.fail(
                f"{MOSQUITTO} is missing: the MQTT tests need a real Mosquitto "
                "(apt-get install mosquitto; .ci/run installs it)",
                pytrace=False,
            )
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "mosquitto.log"
        self.conf_path = workdir / "mosquitto.conf"
        self._process: subprocess.Popen[bytes] | None = None
        self._write_config(users)

    @property
    def url(self) -> str:
        """``mqtt://host:port``."""
        return f"mqtt://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the broker process is alive."""
        return self._process is not None and self._process.poll() is None

    def _write_config(self, users: Mapping[str, str] | None) -> None:
        lines = [
            f"listener {self.port} {self.host}",
            "persistence false",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
            # Running as root, Mosquitto would switch to the "mosquitto" user and lose
            # access to our files; naming the current user keeps it as it is.
            f"user {pwd.getpwuid(os.getuid()).pw_name}",
        ]
        if users:
            password_file = self.workdir / "passwords"
            password_file.touch(mode=0o600)
            for name, password in users.items():
                subprocess.run(
                    [str(MOSQUITTO_PASSWD), "-b", str(password_file), name, password],
                    check=True,
                    capture_output=True,
                    timeout=10,
                )
            lines += ["allow_anonymous false", f"password_file {password_file}"]
        else:
            lines.append("allow_anonymous true")
        self.conf_path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    def start(self) -> None:
        """Start the broker (again, on the same port) and wait until it accepts TCP."""
        if self.running:
            return
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [str(MOSQUITTO), "-c", str(self.conf_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                pytest.fail(
                    f"mosquitto exited with {self._process.returncode}:\n{self.log_tail()}",
                    pytrace=False,
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.host, self.port), timeout=0.2),
            ):
                return
            time.sleep(0.02)
        self.kill()
        pytest.fail(
            f"mosquitto did not listen on {self.host}:{self.port} within "
            f"{_START_TIMEOUT_S} s:\n{self.log_tail()}",
            pytrace=False,
        )

    def stop(self) -> None:
        """SIGTERM and wait: a clean broker shutdown."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL and wait: the broker vanishes without a word."""
        self._end(signal.SIGKILL)

    def _end(self, sig: signal.Signals) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(sig)
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=_STOP_TIMEOUT_S)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the broker's log, for failure messages."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


MosquittoFactory = Callable[..., MosquittoProcess]


@pytest.fixture
def mosquitto_factory(tmp_path: Path) -> Iterator[MosquittoFactory]:
    """Start brokers with options (``users={...}``); all are killed after the test."""
    brokers: list[MosquittoProcess] = []

    def make(*, users: Mapping[str, str] | None = None) -> MosquittoProcess:
        broker = MosquittoProcess(tmp_path / f"mosquitto-{len(brokers)}", users=users)
        brokers.append(broker)
        broker.start()
        return broker

    yield make
    for broker in brokers:
        broker.kill()


@pytest.fixture
def mosquitto(mosquitto_factory: MosquittoFactory) -> MosquittoProcess:
    """A running anonymous Mosquitto on a free loopback port, killed after the test."""
    return mosquitto_factory()
