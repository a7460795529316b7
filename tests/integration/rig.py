"""End-to-end rig: a real ``polca agent`` process on the fake NVML library and a real broker.

``AgentProcess`` writes a settings file, starts ``python -m polca agent`` with the fake
``libnvidia-ml.so.1`` on ``LD_LIBRARY_PATH`` and reads its JSON log lines; its base
``JsonLogProcess`` (start, signals, the JSON log) also serves the aggregator's rig
(``aggregator_rig.py``). ``MqttProbe``
is the test's own MQTT client (plain aiomqtt): it records what the agent publishes and
publishes control messages as a row controller would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import aiomqtt
import yaml

from polca.telemetry.schema import Control, Message, decode, encode
from tests.fake_nvml import FakeNvml
from tests.mqtt_broker import MosquittoProcess

if TYPE_CHECKING:
    from tests.nats_cluster import NatsCluster

ROOT = Path(__file__).resolve().parents[2]
A100_POLICY = ROOT / "policies" / "polca-a100.yaml"
SITE, ROW, RACK, NODE = "dc1", "row1", "rack1", "node1"
S = 1_000_000_000


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterBroker:
    """A clustered broker as the processes under test see it: every node's endpoint (each
    process starts on the first; ``turned`` gives the list starting elsewhere), and one
    node (``host``, ``port``) for the test's own probes."""

    host: str
    port: int
    endpoints: tuple[str, ...]

    @classmethod
    def of(
        cls, cluster: NatsCluster, *, first: int = 0, order: Sequence[int] | None = None
    ) -> ClusterBroker:
        """The cluster's MQTT endpoints, starting with node ``first`` (the others in node
        order after it), or in the ``order`` of node indices given."""
        named = [f"{host}:{port}" for host, port in cluster.mqtt_endpoints]
        count = len(named)
        indices = list(order) if order is not None else [(first + i) % count for i in range(count)]
        host, port = cluster.mqtt_endpoints[indices[0]]
        return cls(host, port, tuple(named[i] for i in indices))


Broker = MosquittoProcess | ClusterBroker
"""What a process under test connects to: one Mosquitto, or the nodes of a cluster."""


def mqtt_config(broker: Broker) -> dict[str, Any]:
    """The ``mqtt`` settings group of a process under test: ``broker``, fast reconnects;
    on a cluster, its endpoints (and so the cluster's defaults: QoS 0 subscriptions, a
    30 s control lease)."""
    config: dict[str, Any] = {
        "host": broker.host,
        "port": broker.port,
        "reconnect_min_s": 0.05,
        "reconnect_max_s": 0.5,
        "keepalive_s": 5,
    }
    if isinstance(broker, ClusterBroker):
        config["endpoints"] = list(broker.endpoints)
    return config


class JsonLogProcess:
    """One ``python -m polca COMMAND --config FILE`` process under test, logging JSON lines.

    ``workdir`` holds its copy of the policy (``policy.yaml``, kept when it exists so a
    restarted process sees the test's edits), its config (``COMMAND.yaml``) and its log
    (``COMMAND.log``, appended to across restarts).
    """

    command: ClassVar[str]
    """The ``polca`` subcommand."""

    def __init__(self, workdir: Path, *, policy: Path) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.policy_path = workdir / "policy.yaml"
        if not self.policy_path.exists():
            self.policy_path.write_text(policy.read_text(encoding="utf-8"), encoding="utf-8")
        self.log_path = workdir / f"{self.command}.log"
        self.config_path = workdir / f"{self.command}.yaml"
        self.process: subprocess.Popen[bytes] | None = None

    def _write_config(self, config: dict[str, Any]) -> None:
        self.config_path.write_text(yaml.safe_dump(config), encoding="utf-8")

    def _env(self) -> dict[str, str] | None:
        """The process environment; None inherits the test's."""
        return None

    def start(self) -> None:
        """Start the process (its output appends to the log)."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "polca", self.command, "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
                cwd=self.workdir,
            )

    def signal(self, sig: signal.Signals) -> None:
        """Send a signal to the process."""
        assert self.process is not None
        self.process.send_signal(sig)

    def wait(self, timeout_s: float = 15.0) -> int:
        """Wait for the process to exit; its exit code."""
        assert self.process is not None
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL the process (a crash: nothing is restored)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def logs(self) -> list[dict[str, Any]]:
        """Every JSON log line so far."""
        if not self.log_path.exists():
            return []
        lines = []
        for raw in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(raw)
                if isinstance(entry, dict):
                    lines.append(entry)
        return lines

    def log_text(self) -> str:
        """The raw log, for failure messages."""
        return (
            self.log_path.read_text(encoding="utf-8", errors="replace")
            if self.log_path.exists()
            else ""
        )

    async def wait_log(
        self,
        event: str,
        *,
        timeout_s: float = 15.0,
        where: Callable[[dict[str, Any]], bool] | None = None,
    ) -> dict[str, Any]:
        """The first log line with this event (and matching ``where``), waiting for it.

        Gives up early when the process has exited without writing it.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for entry in self.logs():
                if entry.get("event") == event and (where is None or where(entry)):
                    return entry
            if self.process is not None and self.process.poll() is not None:
                break
            await asyncio.sleep(0.05)
        msg = (
            f"no {event!r} {self.command} log line within {timeout_s} s; "
            f"log:\n{self.log_text()[-4000:]}"
        )
        raise AssertionError(msg)


class AgentProcess(JsonLogProcess):
    """One agent process under test, on the fake NVML library."""

    command = "agent"

    def __init__(
        self,
        workdir: Path,
        *,
        fake: FakeNvml,
        broker: Broker,
        policy: Path = A100_POLICY,
        observe_only: bool = False,
        startup_grace_s: float = 30.0,
        extra: dict[str, Any] | None = None,
        node: str = NODE,
        rack: str = RACK,
    ) -> None:
        super().__init__(workdir, policy=policy)
        self.fake = fake
        self.state_dir = workdir / "state"
        config: dict[str, Any] = {
            "mqtt": mqtt_config(broker),
            "topics": {"site": SITE, "row": ROW, "rack": rack, "node": node},
            "gpu": {"backend": "nvml"},
            "agent": {
                "sample_interval_s": 0.05,
                "publish_interval_s": 0.5,
                "policy_file": str(self.policy_path),
                "policy_reload_debounce_s": 0.05,
                "state_dir": str(self.state_dir),
                "observe_only": observe_only,
                "startup_grace_s": startup_grace_s,
            },
            "logging": {"level": "debug", "format": "json"},
        }
        for group, values in (extra or {}).items():
            config.setdefault(group, {}).update(values)
        self.node = node
        self._write_config(config)
        self.extra_env: dict[str, str] = {}

    def _env(self) -> dict[str, str]:
        env = self.fake.env()
        env.pop("NOTIFY_SOCKET", None)
        env.pop("POLCA_CONFIG", None)
        env.update(self.extra_env)
        return env


async def polca_status(broker: Broker, *args: str) -> subprocess.CompletedProcess[str]:
    """``polca status --broker ... --site SITE ARGS`` as a user runs it (off the event loop)."""
    argv = [sys.executable, "-m", "polca", "status", "--broker", f"{broker.host}:{broker.port}"]
    return await asyncio.to_thread(
        subprocess.run,
        [*argv, "--site", SITE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def wait_until(
    predicate: Callable[[], bool], *, timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` until it holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.02)
    msg = f"timed out after {timeout_s} s waiting for {what}"
    raise AssertionError(msg)


class MqttProbe:
    """The test's MQTT client: records the node's messages, publishes control."""

    def __init__(self, client: aiomqtt.Client, *, qos: int = 1) -> None:
        self.client = client
        self.qos = qos  # of what it publishes live (not retained)
        self.messages: list[tuple[str, Message, bool]] = []
        self.raw: list[tuple[str, bytes, bool]] = []
        self.epoch_ns = time.time_ns()
        self.seq = 0
        self.meter_pct = 0.0  # the row meter reading a test feeds, as % of the budget

    def of(self, channel: str) -> list[Message]:
        """Decoded messages received on one node channel, oldest first."""
        return [m for topic, m, _ in self.messages if topic.endswith("/" + channel)]

    async def control(
        self,
        level: int,
        *,
        lease_s: float = 30.0,
        seq: int | None = None,
        scope: Literal["row", "rack"] = "row",
        observe: bool = False,
        issued_ns: int | None = None,
    ) -> Control:
        """Publish a retained control message like a row controller."""
        self.seq = self.seq + 1 if seq is None else seq
        now = time.time_ns() if issued_ns is None else issued_ns
        control = Control(
            ts_ns=now,
            scope=scope,
            row=ROW,
            rack=RACK if scope == "rack" else None,
            issuer="test",
            epoch_ns=self.epoch_ns,
            seq=self.seq,
            level=level,
            issued_ns=now,
            lease_expires_ns=now + int(lease_s * S),
            observe=observe,
        )
        topic = (
            f"polca/v1/{SITE}/{ROW}/control"
            if scope == "row"
            else f"polca/v1/{SITE}/{ROW}/{RACK}/control"
        )
        await self.client.publish(topic, encode(control), qos=1, retain=True)
        return control

    async def publish_raw(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Publish arbitrary bytes (QoS 1 retained; live at the probe's QoS)."""
        await self.client.publish(topic, payload, qos=1 if retain else self.qos, retain=retain)

    async def clear_retained(self, topic: str) -> None:
        """Remove the retained message of ``topic`` (an empty retained payload)."""
        await self.client.publish(topic, b"", qos=1, retain=True)

    async def _pump(self) -> None:
        async for message in self.client.messages:
            payload = bytes(message.payload)
            self.raw.append((str(message.topic), payload, message.retain))
            if not payload:
                continue
            with contextlib.suppress(ValueError):
                self.messages.append((str(message.topic), decode(payload), message.retain))


@contextlib.asynccontextmanager
async def mqtt_probe(broker: Broker) -> AsyncIterator[MqttProbe]:
    """A connected probe subscribed to every polca topic of the test site. On a cluster it
    subscribes and publishes live messages at QoS 0, like the processes under test: a QoS 1
    subscription there is a JetStream consumer, whose node dies with the one killed."""
    client = aiomqtt.Client(
        broker.host, broker.port, identifier=f"probe-{os.getpid()}-{time.time_ns()}"
    )
    qos = 0 if isinstance(broker, ClusterBroker) else 1
    async with client:
        await client.subscribe(f"polca/v1/{SITE}/#", qos=qos)
        probe = MqttProbe(client, qos=qos)
        task = asyncio.create_task(probe._pump())
        try:
            yield probe
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
