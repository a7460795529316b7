"""A real etcd v3 cluster for the tests: three members on loopback ports (Debian's etcd-server).

Each member is a ``ServiceProcess`` (start, SIGTERM, SIGKILL, start again on the same ports
with its data kept), so a test can stop one member (the cluster keeps its quorum) or two
(quorum lost) and bring them back. A member counts as started when its peer port listens (it
serves clients only within a quorum); ``EtcdCluster.wait_healthy`` waits for a leader.
Raft timing as docs/ha.md recommends for a site: heartbeat 50 ms, election timeout 500 ms.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services import ServiceProcess, free_port, http_request, require_binary

ETCD = Path("/usr/bin/etcd")


class EtcdMember(ServiceProcess):
    """One member of a static cluster; its data directory survives restarts."""

    name = "etcd"
    start_timeout_s = 30.0

    def __init__(self, workdir: Path, *, member: str, cluster: str, peer_port: int) -> None:
        require_binary(
            ETCD, needed_by="the high-availability tests need a real etcd", package="etcd-server"
        )
        self.member = member
        self.cluster = cluster
        self.peer_port = peer_port
        super().__init__(workdir)
        self._started_once = False

    @property
    def url(self) -> str:
        """The client URL."""
        return f"http://{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        return [
            str(ETCD),
            f"--name={self.member}",
            f"--data-dir={self.workdir / 'data'}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls=http://{self.host}:{self.peer_port}",
            f"--initial-advertise-peer-urls=http://{self.host}:{self.peer_port}",
            f"--initial-cluster={self.cluster}",
            "--initial-cluster-token=polca-tests",
            "--initial-cluster-state=new",
            # A member lost is replaced within about half a second, well inside a polca
            # leader's deadline (docs/ha.md, "etcd settings").
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--log-level=warn",
            "--logger=zap",
        ]

    def _ready(self) -> bool:
        # etcd serves clients only once it has joined a quorum, which needs the other
        # members started: a member counts as started when its peer port listens.
        with socket.create_connection((self.host, self.peer_port), timeout=0.5):
            return True


class EtcdCluster:
    """Three etcd members on loopback; ``endpoints`` for the aggregators."""

    def __init__(self, workdir: Path, *, members: int = 3) -> None:
        names = [f"m{i}" for i in range(members)]
        peers = {name: free_port() for name in names}
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in peers.items())
        self.members = [
            EtcdMember(workdir / name, member=name, cluster=cluster, peer_port=peers[name])
            for name in names
        ]

    @property
    def endpoints(self) -> list[str]:
        """Every member's client URL."""
        return [m.url for m in self.members]

    def start(self) -> None:
        """Start every member and wait until the cluster has a leader."""
        for member in self.members:
            member.start()
        self.wait_healthy()

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Wait until some member answers ``/health`` with a leader (a quorum)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for member in self.members:
                if not member.running:
                    continue
                try:
                    status, body = http_request("GET", f"{member.url}/health", timeout_s=0.5)
                except OSError:
                    continue
                if status == 200 and json.loads(body).get("health") == "true":
                    return
            time.sleep(0.1)
        tails = "\n".join(m.log_tail(10) for m in self.members)
        pytest.fail(f"etcd cluster has no leader after {timeout_s} s:\n{tails}", pytrace=False)

    def kill(self) -> None:
        """SIGKILL every member."""
        for member in self.members:
            member.kill()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A running 3-member etcd cluster on loopback ports, killed after the test."""
    cluster = EtcdCluster(tmp_path / "etcd")
    cluster.start()
    yield cluster
    cluster.kill()
