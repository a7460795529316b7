"""Real service processes on loopback ports for the tests: one lifecycle for all of them.

The MQTT broker (``tests/mqtt_broker.py``) and the time-series databases (``tests/tsdb.py``)
are real programs that a test starts on a free loopback port, stops cleanly or kills, and
starts again on the same port (outage tests). ``ServiceProcess`` is that lifecycle once:
start and poll until the service answers (failing the test with the log's tail when it
exits or stays silent), SIGTERM or SIGKILL and wait, and the log for failure messages.
A subclass says how to run the program (``_argv``) and how to tell it is ready
(``_ready``). ``require_binary`` makes a fixture fail, never skip, when the program is not
installed, naming the Debian package.

Everything here blocks (short waits on subprocesses and sockets); from an async test that
must keep its event loop running meanwhile, call ``start``/``stop`` through
``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar, TypeVar

import pytest

_HANDED_OUT: set[int] = set()
"""Every port ``free_port`` gave this process: the kernel's pick for port 0 can repeat
(a cluster's twelve ports picked in a row once held the same port twice)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's pick for port 0), never one
    this process was given before."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port: int = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    msg = "no free TCP port this process was not given before"
    raise RuntimeError(msg)


def http_request(
    method: str, url: str, *, body: bytes | None = None, timeout_s: float = 10.0
) -> tuple[int, bytes]:
    """One HTTP request to a service; the status and body, also for error statuses."""
    request = urllib.request.Request(url, data=body, method=method)  # noqa: S310 - loopback
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            status: int = response.status
            return status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def require_binary(path: Path, *, needed_by: str, package: str) -> None:
    """Fail the test (never skip) when ``path`` is missing, naming the Debian package."""
    if not path.exists():
        pytest.fail(
            f"{path} is missing: {needed_by} (apt-get install {package}; .ci/run installs it)",
            pytrace=False,
        )


class ServiceProcess:
    """One service process on a fixed loopback port that a test can stop and start again.

    Its output (stdout and stderr) appends to ``workdir/<name>.log``, across restarts.
    """

    name: ClassVar[str] = "service"
    """The program's short name: log file name and failure messages."""
    start_timeout_s: ClassVar[float] = 20.0
    """How long ``start`` waits for ``_ready``."""
    stop_timeout_s: ClassVar[float] = 10.0
    """How long ``stop``/``kill`` wait for the process to exit (then SIGKILL)."""
    poll_interval_s: ClassVar[float] = 0.05
    """The pause between two readiness checks."""

    def __init__(self, workdir: Path, *, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"{self.name}.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The process id while started (benchmarks read its CPU and memory)."""
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._process is not None and self._process.poll() is None

    def _argv(self) -> list[str]:
        """The command line that runs the service in the foreground."""
        raise NotImplementedError

    def _ready(self) -> bool:
        """Whether the service answers now; an ``OSError`` counts as not yet."""
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        """The process environment; None inherits the test's."""
        return None

    def start(self) -> None:
        """Start the service (again, on the same port) and wait until it answers."""
        if self.running:
            return
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self._argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
            )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                pytest.fail(
                    f"{self.name} exited with {self._process.returncode}:\n{self.log_tail()}",
                    pytrace=False,
                )
            with contextlib.suppress(OSError):
                if self._ready():
                    return
            time.sleep(self.poll_interval_s)
        self.kill()
        pytest.fail(
            f"{self.name} did not answer on {self.host}:{self.port} within "
            f"{self.start_timeout_s} s:\n{self.log_tail()}",
            pytrace=False,
        )

    def stop(self) -> None:
        """SIGTERM and wait: a clean shutdown."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL and wait: the service vanishes without a word."""
        self._end(signal.SIGKILL)

    def _end(self, sig: signal.Signals, *, wait_s: float | None = None) -> None:
        """Send ``sig`` and wait for the exit (``wait_s``, else ``stop_timeout_s``); SIGKILL
        after that."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(sig)
        try:
            process.wait(timeout=wait_s if wait_s is not None else self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=self.stop_timeout_s)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the process's log, for failure messages."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


_Service = TypeVar("_Service", bound=ServiceProcess)


def started(process: _Service) -> Iterator[_Service]:
    """Start ``process``, yield it, then kill it: the body of a per-test service fixture.

    Use as ``yield from started(SomeProcess(tmp_path / "name"))``.
    """
    process.start()
    yield process
    process.kill()
