"""A real InfluxDB 1.x on free loopback ports, for the Grafana dashboard tests.

The dashboard tests run every panel's InfluxQL against a real server, so they need one:
``/usr/bin/influxd`` from the Debian ``influxdb`` package (1.6.7 on bookworm), started with
a generated config in a temporary directory (HTTP and the RPC bind address on free loopback
ports, usage reporting, the self-monitor store and query logging off) and a ``polca``
database. One server serves a whole test module, since starting one takes about a second.
When the binary is missing the fixture fails with the package name; it never skips.

The shared ``tests/tsdb.py`` (another helper's) may offer the same as ``influxdb1``; this
module keeps the deploy tests independent of when that lands.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mqtt_broker import free_port

INFLUXD = Path("/usr/bin/influxd")
DATABASE = "polca"
_START_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 10.0
_HTTP_TIMEOUT_S = 10.0


class InfluxDb1:
    """One ``influxd`` 1.x process with its own config and data in ``workdir``.

    ``url`` is the HTTP API (``/ping``, ``/write``, ``/query``); ``query`` runs InfluxQL
    and returns the decoded JSON answer, ``write`` posts line protocol.
    """

    def __init__(self, workdir: Path, *, host: str = "127.0.0.1") -> None:
        if not INFLUXD.exists():
            pytest.fail(
                f"{INFLUXD} is missing: the Grafana dashboard tests need a real InfluxDB 1.x "
                "(apt-get install influxdb; then systemctl disable --now influxdb)",
                pytrace=False,
            )
        self.host = host
        self.http_port = free_port(host)
        self.rpc_port = free_port(host)
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.conf_path = workdir / "influxdb.conf"
        self.log_path = workdir / "influxd.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._write_config()

    @property
    def url(self) -> str:
        """The HTTP API's base URL, ``http://host:port``."""
        return f"http://{self.host}:{self.http_port}"

    def _write_config(self) -> None:
        root = self.workdir
        self.conf_path.write_text(
            f"""\
reporting-enabled = false
bind-address = "{self.host}:{self.rpc_port}"

[meta]
  dir = "{root / "meta"}"
  logging-enabled = false

[data]
  dir = "{root / "data"}"
  wal-dir = "{root / "wal"}"
  query-log-enabled = false

[retention]
  enabled = false

[shard-precreation]
  enabled = false

[monitor]
  store-enabled = false

[http]
  enabled = true
  bind-address = "{self.host}:{self.http_port}"
  log-enabled = false

[continuous_queries]
  enabled = false

[subscriber]
  enabled = false

[logging]
  level = "warn"
""",
            encoding="utf-8",
        )

    def start(self) -> None:
        """Start ``influxd``, wait for ``/ping`` and create the ``polca`` database."""
        # INFLUXDB_* variables override the config file; the test's config must win.
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFLUXDB_")}
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [str(INFLUXD), "run", "-config", str(self.conf_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self._process.poll() is not None:
                pytest.fail(
                    f"influxd exited with {self._process.returncode}:\n{self.log_tail()}",
                    pytrace=False,
                )
            if self._pings():
                break
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(
                    f"influxd did not answer /ping on {self.url} within "
                    f"{_START_TIMEOUT_S} s:\n{self.log_tail()}",
                    pytrace=False,
                )
            time.sleep(0.05)
        answer = self.query(f'CREATE DATABASE "{DATABASE}"', method="POST")
        errors = [r["error"] for r in answer.get("results", []) if "error" in r]
        if errors:
            pytest.fail(f"CREATE DATABASE {DATABASE} failed: {errors}", pytrace=False)

    def _pings(self) -> bool:
        url = f"{self.url}/ping"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=0.5) as response:  # noqa: S310
            return bool(response.status == 204)
        return False

    def query(self, influxql: str, *, method: str = "GET") -> dict[str, Any]:
        """Run InfluxQL against the ``polca`` database; the decoded JSON answer.

        An HTTP error status still returns the body (InfluxDB puts ``{"error": ...}``
        there), so callers see the server's message.
        """
        params = urllib.parse.urlencode({"db": DATABASE, "q": influxql, "epoch": "ms"})
        if method == "GET":
            request = urllib.request.Request(f"{self.url}/query?{params}")  # noqa: S310
        else:
            request = urllib.request.Request(  # noqa: S310
                f"{self.url}/query",
                data=params.encode(),
                method="POST",
                headers={"Content-Type": "application/x-www-form-urlencoded"},
            )
        try:
            with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as response:  # noqa: S310
                body = response.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
        decoded: dict[str, Any] = json.loads(body)
        return decoded

    def write(self, lines: list[str], *, precision: str = "ms") -> None:
        """POST line protocol to ``/write?db=polca``; fail the test on any rejection."""
        params = urllib.parse.urlencode({"db": DATABASE, "precision": precision})
        request = urllib.request.Request(  # noqa: S310
            f"{self.url}/write?{params}", data="\n".join(lines).encode(), method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as response:  # noqa: S310
                status = response.status
        except urllib.error.HTTPError as exc:
            pytest.fail(f"InfluxDB rejected the write ({exc.code}): {exc.read()!r}")
        assert status == 204, f"/write answered {status}"

    def kill(self) -> None:
        """Stop the server: SIGTERM, then SIGKILL if it does not exit in time."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=_STOP_TIMEOUT_S)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log, for failure messages."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="module")
def grafana_influxdb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InfluxDb1]:
    """A running InfluxDB 1.x with an empty ``polca`` database, shared by one test module."""
    server = InfluxDb1(tmp_path_factory.mktemp("influxdb1"))
    server.start()
    yield server
    server.kill()
