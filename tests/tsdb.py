"""Real time-series databases on free loopback ports: InfluxDB 1.x and VictoriaMetrics.

The sink tests never mock the database: each test gets its own ``/usr/bin/influxd``
(Debian ``influxdb`` 1.6.7, v1 API only) or ``/usr/bin/victoria-metrics`` (Debian
``victoria-metrics`` 1.79.5, which accepts ``/api/v2/write`` and ``/write``) process with its
data in the test's temporary directory. A test can stop, kill and start it again on the same
port (database-outage tests). When a binary is missing the fixtures fail with a message naming
the Debian package (they never skip).

The helpers talk HTTP with ``urllib`` (blocking, short); from an async test that must keep its
event loop running meanwhile, call ``start``/``stop`` through ``asyncio.to_thread``.

Register the fixtures with ``from tests.tsdb import influxdb1, victoria_metrics`` in a
``conftest.py``.
"""

from __future__ import annotations

import contextlib
import json
import signal
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
VICTORIA_METRICS = Path("/usr/bin/victoria-metrics")
_START_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 10.0
_HTTP_TIMEOUT_S = 10.0


def _http(
    method: str, url: str, *, body: bytes | None = None, timeout_s: float = _HTTP_TIMEOUT_S
) -> tuple[int, bytes]:
    """One HTTP request; the status and body, also for error statuses."""
    request = urllib.request.Request(url, data=body, method=method)  # noqa: S310 - loopback
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            status: int = response.status
            return status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class _ServiceProcess:
    """A database process on a fixed loopback port that a test can stop and start again."""

    name = "service"

    def __init__(self, workdir: Path, *, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = free_port(host)
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"{self.name}.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``http://host:port``, the base URL a client is configured with."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._process is not None and self._process.poll() is None

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        """Start the database (again, on the same port) and wait until it answers."""
        if self.running:
            return
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self._argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                pytest.fail(
                    f"{self.name} exited with {self._process.returncode}:\n{self.log_tail()}",
                    pytrace=False,
                )
            with contextlib.suppress(OSError):
                if self._ready():
                    return
            time.sleep(0.05)
        self.kill()
        pytest.fail(
            f"{self.name} did not answer on {self.url} within {_START_TIMEOUT_S} s:\n"
            f"{self.log_tail()}",
            pytrace=False,
        )

    def stop(self) -> None:
        """SIGTERM and wait: a clean shutdown (accepted writes are kept)."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL and wait: the database vanishes without a word."""
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
        """The last lines of the process's log, for failure messages."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class InfluxDB1Process(_ServiceProcess):
    """InfluxDB 1.x (``influxd``) with a generated config, no authentication.

    The HTTP API and the RPC (backup) port both listen on free loopback ports; meta, data and
    WAL live under ``workdir``, so a restart keeps what was written. ``start`` creates the
    ``polca`` database.
    """

    name = "influxd"
    database = "polca"

    def __init__(self, workdir: Path, *, host: str = "127.0.0.1") -> None:
        if not INFLUXD.exists():
            pytest.fail(
                f"{INFLUXD} is missing: the InfluxDB sink tests need a real InfluxDB 1.x "
                "(apt-get install influxdb; .ci/run installs it)",
                pytrace=False,
            )
        super().__init__(workdir, host=host)
        self.rpc_port = free_port(host)
        self.conf_path = workdir / "influxdb.conf"
        self._write_config()

    def _write_config(self) -> None:
        data = self.workdir / "data"
        self.conf_path.write_text(
            f"""\
reporting-disabled = true
bind-address = "{self.host}:{self.rpc_port}"

[meta]
  dir = "{data / "meta"}"
  logging-enabled = false

[data]
  dir = "{data / "data"}"
  wal-dir = "{data / "wal"}"
  query-log-enabled = false

[monitor]
  store-enabled = false

[subscriber]
  enabled = false

[retention]
  enabled = false

[continuous_queries]
  enabled = false

[http]
  enabled = true
  bind-address = "{self.host}:{self.port}"
  auth-enabled = false
  log-enabled = false
  pprof-enabled = false

[logging]
  level = "warn"
  suppress-logo = true
""",
            encoding="utf-8",
        )

    def _argv(self) -> list[str]:
        return [str(INFLUXD), "run", "-config", str(self.conf_path)]

    def _ready(self) -> bool:
        status, _ = _http("GET", f"{self.url}/ping", timeout_s=0.5)
        return status == 204

    def start(self) -> None:
        """Start ``influxd`` (again) and make sure the ``polca`` database exists."""
        super().start()
        self.query(f"CREATE DATABASE {self.database}", method="POST")

    def query(self, influxql: str, *, method: str = "GET") -> list[dict[str, Any]]:
        """Run InfluxQL against the ``polca`` database; the series of the first result.

        Times come back as epoch milliseconds. An error in the result fails the test.
        """
        params = urllib.parse.urlencode({"db": self.database, "q": influxql, "epoch": "ms"})
        status, body = _http(method, f"{self.url}/query?{params}")
        if status != 200:
            pytest.fail(f"InfluxQL {influxql!r} failed with HTTP {status}: {body!r}")
        results = json.loads(body)["results"]
        first: dict[str, Any] = results[0]
        if "error" in first:
            pytest.fail(f"InfluxQL {influxql!r} failed: {first['error']}")
        series: list[dict[str, Any]] = first.get("series", [])
        return series

    def count(self, measurement: str, field: str) -> int:
        """``SELECT count(field)`` over all time: the number of points holding ``field``."""
        influxql = f'SELECT count("{field}") FROM "{measurement}"'  # noqa: S608 - not SQL
        series = self.query(influxql)
        if not series:
            return 0
        value: int = series[0]["values"][0][1]
        return value

    def write(self, body: bytes, *, precision: str = "ms") -> None:
        """Write line protocol directly (``/write``), failing the test on an error."""
        params = urllib.parse.urlencode({"db": self.database, "precision": precision})
        status, answer = _http("POST", f"{self.url}/write?{params}", body=body)
        if status != 204:
            pytest.fail(f"write failed with HTTP {status}: {answer!r}")


class VictoriaMetricsProcess(_ServiceProcess):
    """Single-node VictoriaMetrics with its storage under ``workdir``.

    Influx line protocol becomes series named ``<measurement>_<field>`` with the tags as
    labels (string fields are not stored). ``export`` flushes first so that what was
    accepted is visible at once.
    """

    name = "victoria-metrics"

    def __init__(self, workdir: Path, *, host: str = "127.0.0.1") -> None:
        if not VICTORIA_METRICS.exists():
            pytest.fail(
                f"{VICTORIA_METRICS} is missing: the InfluxDB v2-API sink tests need a real "
                "VictoriaMetrics (apt-get install victoria-metrics; .ci/run installs it)",
                pytrace=False,
            )
        super().__init__(workdir, host=host)

    def _argv(self) -> list[str]:
        return [
            str(VICTORIA_METRICS),
            f"-httpListenAddr={self.host}:{self.port}",
            f"-storageDataPath={self.workdir / 'data'}",
            "-retentionPeriod=1",
            "-search.latencyOffset=0s",
            "-search.disableCache",
            "-loggerLevel=ERROR",
            "-memory.allowedPercent=20",
        ]

    def _ready(self) -> bool:
        status, _ = _http("GET", f"{self.url}/health", timeout_s=0.5)
        return status == 200

    def flush(self) -> None:
        """Make every accepted sample searchable now (``/internal/force_flush``)."""
        status, body = _http("GET", f"{self.url}/internal/force_flush")
        if status != 200:
            pytest.fail(f"force_flush failed with HTTP {status}: {body!r}")

    def export(self, match: str) -> list[dict[str, Any]]:
        """Every series matching the selector, as ``{"metric", "values", "timestamps"}``."""
        self.flush()
        params = urllib.parse.urlencode({"match[]": match})
        status, body = _http("GET", f"{self.url}/api/v1/export?{params}")
        if status != 200:
            pytest.fail(f"export {match!r} failed with HTTP {status}: {body!r}")
        return [json.loads(line) for line in body.splitlines() if line.strip()]

    def count(self, match: str) -> int:
        """The number of samples of every series matching the selector."""
        return sum(len(series["values"]) for series in self.export(match))


@pytest.fixture
def influxdb1(tmp_path: Path) -> Iterator[InfluxDB1Process]:
    """A running InfluxDB 1.x with a ``polca`` database on a free loopback port."""
    process = InfluxDB1Process(tmp_path / "influxdb")
    process.start()
    yield process
    process.kill()


@pytest.fixture
def victoria_metrics(tmp_path: Path) -> Iterator[VictoriaMetricsProcess]:
    """A running VictoriaMetrics on a free loopback port."""
    process = VictoriaMetricsProcess(tmp_path / "victoria-metrics")
    process.start()
    yield process
    process.kill()
