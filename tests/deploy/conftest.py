"""A real InfluxDB 1.x shared by a test module, for the Grafana dashboard tests.

The dashboard tests run every panel's InfluxQL against a real server, so they need one:
``tests.tsdb.InfluxDB1Process`` (``/usr/bin/influxd`` from the Debian ``influxdb`` package,
a generated config and a ``polca`` database on free loopback ports). One server serves a
whole test module, since starting one takes about a second. When the binary is missing the
fixture fails with the package name; it never skips.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.tsdb import InfluxDB1Process


@pytest.fixture(scope="module")
def grafana_influxdb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InfluxDB1Process]:
    """A running InfluxDB 1.x with an empty ``polca`` database, shared by one test module."""
    server = InfluxDB1Process(tmp_path_factory.mktemp("influxdb1"))
    server.start()
    yield server
    server.stop()
