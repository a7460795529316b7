"""Real time-series databases on free loopback ports: InfluxDB 1.x and VictoriaMetrics.

The sink and dashboard tests never mock the database: each test (or test module) gets its own
``/usr/bin/influxd`` (Debian ``influxdb`` 1.6.7, v1 API only) or ``/usr/bin/victoria-metrics``
(Debian ``victoria-metrics`` 1.79.5, which accepts ``/api/v2/write`` and ``/write``) process
with its data in a temporary directory. A test can stop, kill and start it again on the same
port (database-outage tests); the lifecycle is ``tests.services.ServiceProcess``. When a
binary is missing the fixtures fail with a message naming the Debian package (they never
skip).

The helpers talk HTTP with ``urllib`` (blocking, short); from an async test that must keep its
event loop running meanwhile, call ``start``/``stop`` through ``asyncio.to_thread``.

Register the fixtures with ``from tests.tsdb import influxdb1, victoria_metrics`` in a
``conftest.py``.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.services import ServiceProcess, free_port, http_request, require_binary, started

INFLUXD = Path("/usr/bin/influxd")
VICTORIA_METRICS = Path("/usr/bin/victoria-metrics")


class _HttpServiceProcess(ServiceProcess):
    """A database with an HTTP API; ready when ``GET ready_path`` answers ``ready_status``."""

    ready_path: ClassVar[str] = "/"
    ready_status: ClassVar[int] = 200

    @property
    def url(self) -> str:
        """``http://host:port``, the base URL a client is configured with."""
        return f"http://{self.host}:{self.port}"

    def _ready(self) -> bool:
        status, _ = http_request("GET", f"{self.url}{self.ready_path}", timeout_s=0.5)
        return status == self.ready_status


class InfluxDB1Process(_HttpServiceProcess):
    """InfluxDB 1.x (``influxd``) with a generated config, no authentication.

    The HTTP API and the RPC (backup) port both listen on free loopback ports; meta, data and
    WAL live under ``workdir``, so a restart keeps what was written. ``start`` creates the
    ``polca`` database.
    """

    name = "influxd"
    ready_path = "/ping"
    ready_status = 204
    database = "polca"

    def __init__(self, workdir: Path, *, host: str = "127.0.0.1") -> None:
        require_binary(
            INFLUXD, needed_by="the InfluxDB tests need a real InfluxDB 1.x", package="influxdb"
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

[shard-precreation]
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

    def _env(self) -> dict[str, str]:
        # INFLUXDB_* variables override the config file; the test's config must win.
        return {k: v for k, v in os.environ.items() if not k.startswith("INFLUXDB_")}

    def start(self) -> None:
        """Start ``influxd`` (again) and make sure the ``polca`` database exists."""
        super().start()
        self.query(f"CREATE DATABASE {self.database}", method="POST")

    def _query(self, influxql: str, method: str) -> tuple[int, bytes]:
        params = urllib.parse.urlencode({"db": self.database, "q": influxql, "epoch": "ms"})
        return http_request(method, f"{self.url}/query?{params}")

    def query_raw(self, influxql: str, *, method: str = "GET") -> dict[str, Any]:
        """Run InfluxQL against the ``polca`` database; the whole decoded JSON answer.

        Nothing fails the test here: an HTTP error status still returns the body (InfluxDB
        puts ``{"error": ...}`` there) and each result may hold its own ``error``, so a
        caller checking queries sees the server's message. Times are epoch milliseconds.
        """
        _, body = self._query(influxql, method)
        answer: dict[str, Any] = json.loads(body)
        return answer

    def query(self, influxql: str, *, method: str = "GET") -> list[dict[str, Any]]:
        """Run InfluxQL against the ``polca`` database; the series of the first result.

        Times come back as epoch milliseconds. An error in the result fails the test.
        """
        status, body = self._query(influxql, method)
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

    def post(self, body: bytes, *, precision: str = "ms") -> tuple[int, bytes]:
        """POST line protocol to ``/write``; the status and body, whatever they are."""
        params = urllib.parse.urlencode({"db": self.database, "precision": precision})
        return http_request("POST", f"{self.url}/write?{params}", body=body)

    def write(self, body: bytes, *, precision: str = "ms") -> None:
        """Write line protocol directly (``/write``), failing the test on an error."""
        status, answer = self.post(body, precision=precision)
        if status != 204:
            pytest.fail(f"write failed with HTTP {status}: {answer!r}")


class VictoriaMetricsProcess(_HttpServiceProcess):
    """Single-node VictoriaMetrics with its storage under ``workdir``.

    Influx line protocol becomes series named ``<measurement>_<field>`` with the tags as
    labels (string fields are not stored). ``export`` flushes first so that what was
    accepted is visible at once.
    """

    name = "victoria-metrics"
    ready_path = "/health"

    def __init__(self, workdir: Path, *, host: str = "127.0.0.1") -> None:
        require_binary(
            VICTORIA_METRICS,
            needed_by="the InfluxDB v2-API sink tests need a real VictoriaMetrics",
            package="victoria-metrics",
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
            # The sink delivers at least once: a batch whose answer the outage cut off is
            # sent again. InfluxDB overwrites an identical point; VictoriaMetrics keeps both
            # unless told to keep one sample per series and millisecond, as docs/influxdb.md
            # recommends. Points of polca's series are at least 1 ms apart.
            "-dedup.minScrapeInterval=1ms",
        ]

    def post(self, body: bytes, *, precision: str = "ms") -> tuple[int, bytes]:
        """POST line protocol to ``/write``; the status and body, whatever they are."""
        return http_request("POST", f"{self.url}/write?precision={precision}", body=body)

    def write(self, body: bytes, *, precision: str = "ms") -> None:
        """Write line protocol directly (``/write``), failing the test unless it says 204.

        VictoriaMetrics says 204 also when it skipped lines it could not parse (it logs
        them); count what arrived to know.
        """
        status, answer = self.post(body, precision=precision)
        if status != 204:
            pytest.fail(f"write failed with HTTP {status}: {answer!r}")

    def flush(self) -> None:
        """Make every accepted sample searchable now (``/internal/force_flush``)."""
        status, body = http_request("GET", f"{self.url}/internal/force_flush")
        if status != 200:
            pytest.fail(f"force_flush failed with HTTP {status}: {body!r}")

    def export(self, match: str) -> list[dict[str, Any]]:
        """Every series matching the selector, as ``{"metric", "values", "timestamps"}``."""
        self.flush()
        params = urllib.parse.urlencode({"match[]": match})
        status, body = http_request("GET", f"{self.url}/api/v1/export?{params}")
        if status != 200:
            pytest.fail(f"export {match!r} failed with HTTP {status}: {body!r}")
        return [json.loads(line) for line in body.splitlines() if line.strip()]

    def count(self, match: str) -> int:
        """The number of samples of every series matching the selector."""
        return sum(len(series["values"]) for series in self.export(match))


@pytest.fixture
def influxdb1(tmp_path: Path) -> Iterator[InfluxDB1Process]:
    """A running InfluxDB 1.x with a ``polca`` database on a free loopback port."""
    yield from started(InfluxDB1Process(tmp_path / "influxdb"))


@pytest.fixture
def victoria_metrics(tmp_path: Path) -> Iterator[VictoriaMetricsProcess]:
    """A running VictoriaMetrics on a free loopback port."""
    yield from started(VictoriaMetricsProcess(tmp_path / "victoria-metrics"))
