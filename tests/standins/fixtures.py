"""Pytest fixtures around the Redfish stand-in, shared by ``tests/redfish`` and ``tests/bmc``.

A stand-in process takes about a second to start, so the common ones live for a test
module and are reset (devices rebuilt, fault cleared, log emptied) before each test;
``standin_factory`` starts special ones (no session service, TLS) for one test.
``tls_files`` makes a throwaway CA and a server certificate for 127.0.0.1 with
``openssl`` (installed by ``scripts/test.sh``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.services import require_binary
from tests.standins.process import RedfishStandIn

USERNAME = "admin"
PASSWORD = "s3cret-pw"  # noqa: S105 - the stand-in's test account
OPENSSL = Path("/usr/bin/openssl")

__all__ = [
    "PASSWORD",
    "USERNAME",
    "TlsFiles",
    "bmc_standin",
    "redfish_standin",
    "standin_factory",
    "tls_files",
]


@dataclass(frozen=True)
class TlsFiles:
    """A CA certificate and a server certificate and key signed by it."""

    ca: Path
    cert: Path
    key: Path


def _started(workdir: Path, **kwargs: Any) -> RedfishStandIn:
    standin = RedfishStandIn(workdir, **kwargs)
    standin.start()
    standin.clear_log()  # forget the readiness checks
    return standin


@pytest.fixture(scope="module")
def _redfish_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedfishStandIn]:
    standin = _started(
        tmp_path_factory.mktemp("redfish"),
        devices=["bmc:node1:controls"],
        username=USERNAME,
        password=PASSWORD,
    )
    yield standin
    standin.kill()


@pytest.fixture
def redfish_standin(_redfish_process: RedfishStandIn) -> RedfishStandIn:
    """A stand-in with one BMC (controls shape), user ``USERNAME``; reset for this test."""
    _redfish_process.reset()
    return _redfish_process


@pytest.fixture(scope="module")
def _bmc_processes() -> Iterator[dict[str, RedfishStandIn]]:
    started: dict[str, RedfishStandIn] = {}
    yield started
    for standin in started.values():
        standin.kill()


@pytest.fixture(params=["controls", "legacy"])
def bmc_standin(
    request: pytest.FixtureRequest,
    _bmc_processes: dict[str, RedfishStandIn],
    tmp_path_factory: pytest.TempPathFactory,
) -> RedfishStandIn:
    """One BMC ``node1`` of each power-limit shape (the test runs for both); reset."""
    shape: str = request.param
    if shape not in _bmc_processes:
        _bmc_processes[shape] = _started(
            tmp_path_factory.mktemp(f"bmc-{shape}"),
            devices=[f"bmc:node1:{shape}"],
            username=USERNAME,
            password=PASSWORD,
        )
    standin = _bmc_processes[shape]
    standin.reset()
    return standin


@pytest.fixture
def standin_factory(tmp_path: Path) -> Iterator[Callable[..., RedfishStandIn]]:
    """Start stand-ins with any options (``RedfishStandIn``'s) for this test only."""
    started: list[RedfishStandIn] = []

    def start(**kwargs: Any) -> RedfishStandIn:
        standin = _started(tmp_path / f"standin{len(started)}", **kwargs)
        started.append(standin)
        return standin

    yield start
    for standin in started:
        standin.kill()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A throwaway CA and a certificate for 127.0.0.1/localhost that it signed."""
    require_binary(OPENSSL, needed_by="the Redfish TLS tests make certificates", package="openssl")
    d = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*argv: str) -> None:
        subprocess.run([str(OPENSSL), *argv], check=True, capture_output=True, cwd=d)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=polca test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n",
        encoding="utf-8",
    )
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf")  # fmt: skip
    return TlsFiles(ca=d / "ca.pem", cert=d / "server.pem", key=d / "server.key")
