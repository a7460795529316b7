"""One node flooding its row: the row's control, its honest nodes and the broker under it.

A real Mosquitto runs the shipped configuration (``deploy/mosquitto/mosquitto.conf``, the
pattern ACL ``deploy/mosquitto/acl``, users made by ``make-passwords.sh``; only the port,
the file paths and the process user are rewritten, as ``tests/deploy/mosquitto_rig.py``
does). Against it, each in its own process and logged in as its own user:

- the real aggregator (``polca aggregator``, user ``polca-aggregator``): one row of four
  nodes, control every ``--interval-s`` (1 s), default ``intake`` settings, its
  Prometheus ``/metrics`` on a loopback port (for its counters);
- three honest agents (``polca agent``, one process each, users ``n0-1``, ``n0-2`` and
  ``n1-0``) on simulated GPUs (8 H100s each, one telemetry message a second of about
  6 KB). With the aggregator's default four node connections, ``n0-2`` shares the
  flooder's (``polca.aggregator.intake.node_shard``), the others do not;
- ``--flooders`` processes (2), logged in as the fourth node ``n0-0`` (whose credentials
  were stolen, or whose firmware went wrong), publishing valid telemetry on that node's
  own topic ``polca/v1/bench/row1/r0/n0-0/telemetry`` at QoS 0 as fast as the broker takes
  it: small messages (1 GPU, about 0.9 KB) in one phase, large ones (232 GPUs, about
  127 KiB) in the next. A flooder writes pre-encoded MQTT packets to its socket (each
  stamped with the time): a C client's speed rather than paho's;
- an observer (paho, user ``polca-bench-observer``) subscribed to the row's control and
  summary topics and to the broker's ``$SYS/broker/publish/messages/dropped``;
- with ``--load-nodes N``, one publisher process (``benchkit publish``, user
  ``polca-bench-load``) sending the telemetry of N more nodes of the row, one message a
  second each: an aggregator's legitimate load (the aggregator then serves no
  ``/metrics``, whose scrape of 300,000 series would stall it, and its log's running
  totals give the rate-limited counts).

The observer's and the load generator's users are the only additions to the shipped ACL
(like the test rig's probe users), and ``sys_interval 2`` the only addition to the
configuration (``$SYS`` every 2 s instead of 10): none changes what the broker limits.
``--broker-option LINE`` appends more lines (a later option overrides the shipped one),
to measure other limits against the same flood (the limits before this configuration:
``--broker-option "max_packet_size 1048576" --broker-option "max_queued_messages 10000"
--broker-option "memory_limit 0" --broker-option "max_qos 2"``).

Phases: ``baseline`` (no flood: the floor, measured in the same run), ``small_flood``,
``large_flood``, ``recovery``. Per phase: what the flooders achieved
(``flood_msgs_per_s``); the largest gap between two control messages of the row at the
observer (``control_gap_max_s``, goal at most 2 x the control interval; the time from the
last control message to the end of the phase counts as a gap) and the largest delay of one
(arrival minus its stamp, ``control_delay_max_s``); row summaries listing an honest node
as stale or offline (``honest_stale_summaries``, goal 0; per node in
``honest_stale_by_node``); the broker's largest resident memory (``broker_rss_mib``, from
/proc every 0.2 s) and its CPU; the aggregator's CPU (% of one core), the messages its
intake handled and dropped as ``rate_limited``, its MQTT disconnections
(``mqtt_disconnected`` in its log) and the honest agents'; the messages the broker
dropped (``$SYS``: every client's); the broker log's out-of-memory disconnections.

All processes share this machine's cores: the flooders compete with the aggregator and
the broker for CPU, which a node on another host would not. Run from the repository
root (under 2 minutes with the default durations):

    .venv/bin/python bench/bench_flood.py [--baseline-s 20] [--small-s 30] [--large-s 30]
        [--recovery-s 20] [--flooders 2] [--load-nodes 1000] [--broker-option LINE]

Writes ``bench/results/flood.json``: ``flood_msgs_per_s``, ``control_gap_max_s``,
``control_delay_max_s``, ``broker_rss_mib`` (the largest of the two flood phases and the
recovery), ``honest_stale_summaries``, ``mqtt_disconnected`` (their sums over those
three phases), ``floor`` (the same keys for the baseline) and ``phases`` (every figure per
phase). ``--keep DIR`` keeps the logs, ``--py-spy DIR`` records the aggregator in each
flood (py-spy installed in the virtual environment).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bench.* and tests.* (the Mosquitto rig)

from bench.benchkit import (  # noqa: E402
    Child,
    node_name,
    proc_cpu_s,
    proc_rss_mb,
    site_node,
    telemetry_payloads,
    write_result,
)

SITE, ROW, INSTANCE = "bench", "row1", "bench-agg"
FLOODER = node_name(0, 0)
HONEST = (("r0", node_name(0, 1)), ("r0", node_name(0, 2)), ("r1", node_name(1, 0)))
"""The honest agents; with the aggregator's default 4 node connections, n0-2 shares the
flooder's (``polca.aggregator.intake.node_shard``), n0-1 and n1-0 do not."""
OBSERVER = "polca-bench-observer"
LOAD = "polca-bench-load"
LOAD_PER_RACK = 50
OBSERVER_GRANTS = f"""
# --- Bench only (bench/bench_flood.py): the observer reads the row and the broker's $SYS ---
user {OBSERVER}
topic read polca/v1/#
topic read $SYS/#
# ...and the load generator writes the telemetry of the row's --load-nodes.
user {LOAD}
topic write polca/v1/{SITE}/{ROW}/+/+/telemetry
"""
SYS_DROPPED = "$SYS/broker/publish/messages/dropped"
GPU_W = 700.0


# --- the flooder (its own process) ------------------------------------------------------------


def _remaining_length(length: int) -> bytes:
    """MQTT's variable-length encoding of a packet's remaining length."""
    out = bytearray()
    while True:
        byte, length = length % 128, length // 128
        out.append(byte | (0x80 if length else 0))
        if not length:
            return bytes(out)


def _string(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("!H", len(raw)) + raw


def _connect(host: str, port: int, *, client_id: str, user: str, password: str) -> socket.socket:
    """A TCP connection with an accepted MQTT 3.1.1 CONNECT (clean session, 60 s keepalive)."""
    body = _string("MQTT") + bytes([4, 0xC2]) + struct.pack("!H", 60)
    body += _string(client_id) + _string(user) + _string(password)
    sock = socket.create_connection((host, port), timeout=10)
    sock.sendall(b"\x10" + _remaining_length(len(body)) + body)
    connack = b""
    while len(connack) < 4:
        chunk = sock.recv(4 - len(connack))
        if not chunk:
            msg = "the broker closed the connection before CONNACK"
            raise ConnectionError(msg)
        connack += chunk
    if connack != b"\x20\x02\x00\x00":
        sock.close()
        msg = f"CONNECT refused: {connack.hex()}"
        raise ConnectionError(msg)
    return sock


@dataclass(frozen=True)
class _Packet:
    """A PUBLISH of the flooding node's telemetry, split around its time stamp."""

    prefix: bytes  # fixed header, topic and the payload up to the stamp's digits
    tail: bytes  # the payload after them
    stamp_digits: int

    @classmethod
    def of(cls, gpus: int) -> _Packet:
        """The node's telemetry listing ``gpus`` GPUs, as a QoS 0 PUBLISH."""
        topic, payload = telemetry_payloads(
            site=SITE, row=ROW, racks=1, nodes_per_rack=1, gpus=gpus
        )[0]
        key = b'"ts_ns":'
        start = payload.index(key) + len(key)
        end = start
        while payload[end : end + 1].isdigit():
            end += 1
        head, tail = payload[:start], payload[end:]
        digits = len(str(time.time_ns()))
        length = 2 + len(topic.encode()) + len(head) + digits + len(tail)
        return cls(b"\x30" + _remaining_length(length) + _string(topic) + head, tail, digits)

    @property
    def size(self) -> int:
        """Bytes on the wire."""
        return len(self.prefix) + self.stamp_digits + len(self.tail)

    def stamped(self, count: int) -> bytes:
        """``count`` packets, each stamped now."""
        parts: list[bytes] = []
        for _ in range(count):
            parts += (self.prefix, str(time.time_ns()).encode(), self.tail)
        return b"".join(parts)


def _read_commands(go: threading.Event, stop: threading.Event) -> None:
    """``go`` and ``stop`` lines from the parent (stdin); its end means stop."""
    for line in sys.stdin:
        if line.strip() == "go":
            go.set()
        else:
            break
    go.set()
    stop.set()


def _flood(args: argparse.Namespace) -> dict[str, Any]:
    """Publish the node's telemetry at QoS 0, flat out (or at ``--rate``), go to stop.

    Prints ``ready`` once connected, floods from a ``go`` line on stdin until a ``stop``
    line (or ``--max-s``), and reconnects when the broker drops the connection (as an
    attacker would).
    """
    packet = _Packet.of(args.gpus)
    password = Path(args.password_file).read_text(encoding="utf-8").strip()
    client_id = f"flood-{os.getpid()}"
    sock: socket.socket | None = _connect(
        args.host, args.port, client_id=client_id, user=FLOODER, password=password
    )
    go, stop = threading.Event(), threading.Event()
    threading.Thread(target=_read_commands, args=(go, stop), daemon=True).start()
    print(json.dumps({"ready": True, "message_bytes": packet.size}), flush=True)
    go.wait()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    sent = losses = 0
    interval_s = 1.0 / args.rate if args.rate > 0 else 0.0
    per_write = 1 if interval_s else max(1, 65536 // packet.size)
    while not stop.is_set() and time.monotonic() < t0 + args.max_s:
        if interval_s and (delay := t0 + sent * interval_s - time.monotonic()) > 0:
            time.sleep(delay)
        try:
            if sock is None:
                sock = _connect(
                    args.host, args.port, client_id=client_id, user=FLOODER, password=password
                )
            sock.sendall(packet.stamped(per_write))
            sent += per_write
        except OSError:
            # Disconnected by the broker (a limit): come back.
            losses += 1
            if sock is not None:
                sock.close()
            sock = None
            time.sleep(0.1)
    elapsed = time.monotonic() - t0
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.sendall(b"\xe0\x00")  # DISCONNECT
        sock.close()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    return {
        "sent": sent,
        "elapsed_s": elapsed,
        "rate": sent / elapsed if elapsed else 0.0,
        "bytes": sent * packet.size,
        "message_bytes": packet.size,
        "connection_losses": losses,
        "cpu_pct": 100 * cpu_s / elapsed if elapsed else 0.0,
    }


# --- the observer (its own process) -----------------------------------------------------------


def _observe(args: argparse.Namespace) -> dict[str, Any]:
    """Note every live control and summary message of the row and the broker's drop count.

    Commands on stdin: ``take`` -> what arrived since the last ``take``; ``stop``.
    Each arrival: [monotonic s, kind, wall-clock ns of arrival, detail].
    """
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    arrivals: list[list[Any]] = []
    lock = threading.Lock()
    subscribed = threading.Event()

    def on_message(_client: Any, _userdata: Any, message: Any) -> None:
        now, wall_ns = time.monotonic(), time.time_ns()
        topic: str = message.topic
        if topic == SYS_DROPPED:  # retained too: $SYS values are published on change
            entry = [now, "sys_dropped", wall_ns, int(message.payload)]
        elif message.retain:
            return  # a control or summary delivered at subscription: of unknown age
        else:
            body = json.loads(message.payload)
            if topic.endswith("/control"):
                entry = [now, "control", wall_ns, {"ts_ns": body["ts_ns"], "level": body["level"]}]
            else:
                detail = {
                    "ts_ns": body["ts_ns"],
                    "stale": body["stale_nodes"],
                    "offline": body["offline_nodes"],
                    "implausible": body["implausible_nodes"],
                }
                entry = [now, "summary", wall_ns, detail]
        with lock:
            arrivals.append(entry)

    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"observer-{os.getpid()}")
    password = Path(args.password_file).read_text(encoding="utf-8").strip()
    client.username_pw_set(OBSERVER, password)
    client.on_message = on_message
    client.on_subscribe = lambda *_a: subscribed.set()
    client.connect(args.host, args.port, keepalive=15)
    client.subscribe(
        [
            (f"polca/v1/{SITE}/{ROW}/control", 1),
            (f"polca/v1/{SITE}/{ROW}/summary", 1),
            (SYS_DROPPED, 0),
        ]
    )
    client.loop_start()
    subscribed.wait(10)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "take":
            break
        with lock:
            out = list(arrivals)
            arrivals.clear()
        print(json.dumps({"arrivals": out}), flush=True)
    client.loop_stop()
    client.disconnect()
    return {"stopped": True}


# --- the parent ---------------------------------------------------------------------------------


@dataclass
class Phase:
    """One phase: its name, flood and monotonic and wall-clock bounds."""

    name: str
    seconds: float
    gpus: int | None  # the flood's message size (GPUs per telemetry); None: no flood
    start: float = 0.0
    end: float = 0.0
    wall_start: float = 0.0
    wall_end: float = 0.0
    flooders: list[dict[str, Any]] = field(default_factory=list)
    metrics_before: dict[str, float] = field(default_factory=dict)
    metrics_after: dict[str, float] = field(default_factory=dict)


def _metrics(address: str) -> dict[str, float]:
    """The aggregator's counters of interest from its ``/metrics`` (empty on failure)."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        if name == "polca_aggregator_messages_total":
            out["messages_in"] = float(value)
        elif (
            name == "polca_aggregator_messages_dropped_total" and 'reason="rate_limited"' in labels
        ):
            out["rate_limited"] = float(value)
        elif name == "polca_node_messages_rate_limited_total" and f'node="{FLOODER}"' in labels:
            out["flooder_rate_limited"] = float(value)
    return out


class Sampler:
    """Broker memory and CPU, aggregator CPU and memory, every ``period_s`` (a thread)."""

    def __init__(self, broker_pid: int, aggregator_pid: int, period_s: float = 0.2) -> None:
        self.samples: list[tuple[float, float, float, float, float]] = []
        self._pids = (broker_pid, aggregator_pid)
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        broker, aggregator = self._pids
        while not self._stop.wait(self._period_s):
            with contextlib.suppress(OSError, ValueError, IndexError):
                self.samples.append(
                    (
                        time.monotonic(),
                        proc_rss_mb(broker),
                        proc_cpu_s(broker),
                        proc_rss_mb(aggregator),
                        proc_cpu_s(aggregator),
                    )
                )

    def close(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()


def _load_nodes(count: int) -> dict[str, list[str]]:
    """The nodes the load generator publishes for, by rack (``LOAD_PER_RACK`` a rack)."""
    return {
        f"r{r}": [site_node(ROW, r, n) for n in range(LOAD_PER_RACK)]
        for r in range(count // LOAD_PER_RACK)
    }


def _configs(
    work: Path, *, port: int, metrics: str, interval_s: float, load_nodes: int
) -> tuple[Path, list[Path]]:
    """The aggregator's configuration file and the honest agents'."""
    secrets = work / "secrets"
    policy = str(REPO / "policies" / "polca-h100.yaml")
    nodes = len(HONEST) + 1 + load_nodes
    racks: dict[str, list[str]] = {"r0": [FLOODER]}
    for rack, node in HONEST:
        racks.setdefault(rack, []).append(node)
    for rack, names in _load_nodes(load_nodes).items():
        racks.setdefault(rack, []).extend(names)
    aggregator = {
        "site": SITE,
        "instance": INSTANCE,
        "policy_file": policy,
        "state_dir": str(work / "aggregator"),
        "mqtt": {
            "host": "127.0.0.1",
            "port": port,
            "username": "polca-aggregator",
            "password_file": str(secrets / "polca-aggregator.pass"),
        },
        "control": {"interval_s": interval_s},
        # Its counters, when the row is small: a scrape of a 1,000-node aggregator's
        # series (300,000) would stall it for seconds, so its log says the drops then.
        "metrics": {"address": metrics if not load_nodes else None},
        "rows": [
            {
                "name": ROW,
                # Twice the nameplate: the row stays at level 0, a control message a step.
                "budget_w": nodes * 8 * GPU_W * 2,
                "racks": [
                    {"name": rack, "nodes": [{"name": n} for n in names]}
                    for rack, names in racks.items()
                ],
            }
        ],
        "logging": {"level": "info", "format": "json"},
    }
    path = work / "aggregator.yaml"
    path.write_text(yaml.safe_dump(aggregator), encoding="utf-8")
    agents = []
    for seed, (rack, node) in enumerate(HONEST):
        agent = {
            "mqtt": {
                "host": "127.0.0.1",
                "port": port,
                "username": node,
                "password_file": str(secrets / f"{node}.pass"),
                "client_id": f"agent-{node}",
            },
            "topics": {"site": SITE, "row": ROW, "rack": rack, "node": node},
            "gpu": {"backend": "simulated", "simulated_seed": seed},
            "agent": {
                "policy_file": policy,
                "state_dir": str(work / node),
                "control_issuers": [INSTANCE],
            },
            "logging": {"level": "warning", "format": "json"},
        }
        agent_path = work / f"agent-{node}.yaml"
        agent_path.write_text(yaml.safe_dump(agent), encoding="utf-8")
        agents.append(agent_path)
    return path, agents


def _settle(observer: Child, arrivals: list[list[Any]], timeout_s: float = 90.0) -> None:
    """Until the row has control flowing and both honest nodes fresh for 3 summaries."""
    honest = {node for _rack, node in HONEST}
    fresh = 0
    deadline = time.monotonic() + timeout_s
    while fresh < 3:
        if time.monotonic() > deadline:
            msg = f"the row did not settle within {timeout_s} s: {arrivals[-5:]}"
            raise RuntimeError(msg)
        time.sleep(1.0)
        new = observer.ask("take")["arrivals"]
        arrivals.extend(new)
        for _t, kind, _wall, detail in new:
            if kind == "summary":
                listed = set(detail["stale"]) | set(detail["offline"])
                fresh = 0 if listed & honest else fresh + 1


def _py_spy(directory: Path | None, pid: int, phase: Phase) -> subprocess.Popen[bytes] | None:
    """``py-spy record`` of the aggregator for a flood phase, into ``directory`` (or None)."""
    if directory is None or phase.gpus is None:
        return None
    spy = Path(sys.executable).parent / "py-spy"
    directory.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            str(spy if spy.exists() else "py-spy"),
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(int(phase.seconds)),
            "--format",
            "raw",
            "--output",
            str(directory / f"aggregator-{phase.name}.txt"),
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _log_events(*paths: Path) -> list[tuple[float, dict[str, Any]]]:
    """The JSON log lines of daemons as (Unix time, fields)."""
    events = []
    for path in paths:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            with contextlib.suppress(ValueError, KeyError):
                fields = json.loads(line)
                stamp = datetime.fromisoformat(fields["timestamp"]).timestamp()
                events.append((stamp, fields))
    return events


def _broker_log(text: str) -> dict[str, Any]:
    """What the broker's log says of its limits (it has no time stamps: the whole run)."""
    dropping: set[str] = set()
    out_of_memory: dict[str, int] = {}
    oversize: dict[str, int] = {}
    for line in text.splitlines():
        if "Outgoing messages are being dropped for client " in line:
            dropping.add(line.rsplit("client ", 1)[1].rstrip("."))
        elif line.startswith("Client ") and " disconnected due to " in line:
            client, reason = line[len("Client ") :].split(" disconnected due to ", 1)
            kind = "flooder" if client.startswith("flood-") else client
            counts = out_of_memory if "out of memory" in reason else oversize
            counts[kind] = counts.get(kind, 0) + 1
    return {
        "outgoing_dropped_for": sorted(dropping),
        "disconnected_out_of_memory": out_of_memory,
        "disconnected_other": oversize,
    }


@dataclass
class Run:
    """Everything measured in a run, for the figures of its phases."""

    arrivals: list[list[Any]] = field(default_factory=list)
    samples: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    aggregator_events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    agent_events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    broker: dict[str, Any] = field(default_factory=dict)
    observer: Child | None = None
    aggregator_pid: int = 0


def _gaps(phase: Phase, arrivals: Sequence[list[Any]]) -> tuple[list[float], list[float], int]:
    """Gaps between the row's control messages ending in ``phase``, their delays, count.

    The gap running at the end of the phase counts: control that stops is a gap.
    """
    controls = [a for a in arrivals if a[1] == "control"]
    before = [a[0] for a in controls if a[0] < phase.start]
    inside = [a for a in controls if phase.start <= a[0] < phase.end]
    times = before[-1:] + [a[0] for a in inside] + [phase.end]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    delays = [(a[2] - a[3]["ts_ns"]) / 1e9 for a in inside]
    return gaps, delays, len(inside)


def _load_missing(summary: dict[str, Any]) -> int:
    """The load generator's nodes a row summary lists as stale or offline."""
    prefix = f"{ROW}-"
    return sum(1 for node in (*summary["stale"], *summary["offline"]) if node.startswith(prefix))


def _figures(phase: Phase, run: Run) -> dict[str, Any]:
    """Every figure of one phase."""
    honest = {node for _rack, node in HONEST}
    gaps, delays, controls = _gaps(phase, run.arrivals)
    summaries = [
        a[3] for a in run.arrivals if a[1] == "summary" and phase.start <= a[0] < phase.end
    ]
    window = [s for s in run.samples if phase.start <= s[0] <= phase.end]
    span_s = window[-1][0] - window[0][0] if len(window) > 1 else 0.0

    def share(index: int) -> float | None:
        if not span_s:
            return None
        return round(100 * (window[-1][index] - window[0][index]) / span_s, 1)

    def disconnects(events: Sequence[tuple[float, dict[str, Any]]]) -> int:
        return sum(
            1
            for t, f in events
            if phase.wall_start <= t < phase.wall_end and f.get("event") == "mqtt_disconnected"
        )

    sys_dropped = [(a[0], a[3]) for a in run.arrivals if a[1] == "sys_dropped"]
    at_start = [0, *(v for t, v in sys_dropped if t <= phase.start)]
    at_end = [0, *(v for t, v in sys_dropped if t <= phase.end)]
    flooders = phase.flooders
    elapsed = phase.end - phase.start

    def delta(name: str) -> float | None:
        # A counter not served yet has not counted anything; an empty scrape is unknown.
        if phase.metrics_after and phase.metrics_before:
            return phase.metrics_after.get(name, 0.0) - phase.metrics_before.get(name, 0.0)
        return None

    messages_in, rate_limited = delta("messages_in"), delta("rate_limited")
    if rate_limited is None:  # no /metrics: the log's running total (one line per 10 s)
        totals = [
            (t, f["total"])
            for t, f in run.aggregator_events
            if f.get("event") == "message_dropped" and f.get("reason") == "rate_limited"
        ]
        before = [n for t, n in totals if t < phase.wall_start]
        upto = [n for t, n in totals if t < phase.wall_end]
        rate_limited = (upto[-1] if upto else 0) - (before[-1] if before else 0)
    return {
        "seconds": round(elapsed, 1),
        "flood_message_bytes": flooders[0]["message_bytes"] if flooders else 0,
        "flood_msgs_per_s": round(sum(f["rate"] for f in flooders)),
        "flood_mib_per_s": round(sum(f["bytes"] for f in flooders) / elapsed / 2**20, 1),
        "flooder_cpu_pct": round(sum(f["cpu_pct"] for f in flooders), 1),
        "flooder_connection_losses": sum(f["connection_losses"] for f in flooders),
        "control_messages": controls,
        "control_gap_max_s": round(max(gaps), 3) if gaps else None,
        "control_delay_max_s": round(max(delays), 3) if delays else None,
        "summaries": len(summaries),
        "honest_stale_summaries": sum(1 for s in summaries if honest & set(s["stale"])),
        "honest_offline_summaries": sum(1 for s in summaries if honest & set(s["offline"])),
        "honest_stale_by_node": {
            node: sum(1 for s in summaries if node in s["stale"] or node in s["offline"])
            for node in sorted(honest)
        },
        "flooder_implausible_summaries": sum(1 for s in summaries if FLOODER in s["implausible"]),
        "load_stale_summaries": sum(1 for s in summaries if _load_missing(s)),
        "load_stale_max": max((_load_missing(s) for s in summaries), default=0),
        "broker_rss_mib": round(max(s[1] for s in window), 1) if window else None,
        "broker_cpu_pct": share(2),
        "aggregator_rss_mib": round(max(s[3] for s in window), 1) if window else None,
        "aggregator_cpu_pct": share(4),
        "aggregator_msgs_per_s": round(messages_in / elapsed) if messages_in is not None else None,
        "rate_limited": int(rate_limited) if rate_limited is not None else None,
        "broker_dropped": at_end[-1] - at_start[-1],
        "mqtt_disconnected": disconnects(run.aggregator_events),
        "honest_mqtt_disconnected": disconnects(run.agent_events),
    }


def _start_broker(work: Path, options: Sequence[str]) -> Any:
    """Mosquitto with the shipped configuration, ACL (plus the observer) and users."""
    from tests.deploy.mosquitto_rig import PATTERN_ACL, deploy_config, make_passwords
    from tests.mqtt_broker import MosquittoProcess

    users = ["polca-aggregator", FLOODER, *(n for _r, n in HONEST), OBSERVER, LOAD]
    make_passwords(work, users)
    acl = work / "acl"
    acl.write_text(PATTERN_ACL.read_text(encoding="utf-8") + OBSERVER_GRANTS, encoding="utf-8")
    broker = MosquittoProcess(work / "mosquitto")
    extra = "\n# --- bench only ---\nsys_interval 2\n" + "".join(f"{line}\n" for line in options)
    broker.conf_path.write_text(
        deploy_config(
            broker.workdir, port=broker.port, acl=acl, password_file=work / "passwd", extra=extra
        ),
        encoding="utf-8",
    )
    broker.start()
    return broker


def _role(role: str, port: int, password_file: Path, *extra: str) -> Child:
    """One of this script's child roles (``flood``, ``observe``) in its own process."""
    return Child.start(
        [
            sys.executable,
            "-m",
            "bench.bench_flood",
            role,
            f"--port={port}",
            f"--password-file={password_file}",
            *extra,
        ]
    )


def _load(args: argparse.Namespace, *, port: int, work: Path, phases: Sequence[Phase]) -> Child:
    """The load generator: one telemetry message a second for each of ``--load-nodes``."""
    seconds = 120 + sum(p.seconds for p in phases)  # the settling, the phases and a margin
    return Child.role(
        "publish",
        f"--port={port}",
        f"--count={int(args.load_nodes * seconds)}",
        f"--rate={args.load_nodes}",
        f"--site={SITE}",
        f"--row={ROW}",
        f"--rows={ROW}",
        f"--racks={args.load_nodes // LOAD_PER_RACK}",
        f"--nodes-per-rack={LOAD_PER_RACK}",
        f"--username={LOAD}",
        f"--password-file={work / 'secrets' / f'{LOAD}.pass'}",
    )


def _run_phase(
    phase: Phase, *, args: argparse.Namespace, port: int, work: Path, metrics: str, run: Run
) -> None:
    """One phase: its flooders started, released, stopped; the observer's arrivals kept."""
    observer = run.observer
    assert observer is not None
    secret = work / "secrets" / f"{FLOODER}.pass"
    flooders = [
        _role(
            "flood",
            port,
            secret,
            f"--gpus={phase.gpus}",
            f"--rate={args.flood_rate / args.flooders}",
            f"--max-s={phase.seconds + 30}",
        )
        for _ in range(args.flooders if phase.gpus else 0)
    ]
    for flooder in flooders:
        assert flooder.line().get("ready")
    phase.metrics_before = _metrics(metrics)
    phase.start, phase.wall_start = time.monotonic(), time.time()
    for flooder in flooders:
        assert flooder.process.stdin is not None
        flooder.process.stdin.write("go\n")
        flooder.process.stdin.flush()
    print(f"{phase.name}: {phase.seconds:g} s", flush=True)
    spy = _py_spy(args.py_spy, run.aggregator_pid, phase)
    while time.monotonic() < phase.start + phase.seconds:
        time.sleep(1.0)
        run.arrivals.extend(observer.ask("take")["arrivals"])
    for flooder in flooders:
        assert flooder.process.stdin is not None
        flooder.process.stdin.write("stop\n")
        flooder.process.stdin.flush()
    phase.end, phase.wall_end = time.monotonic(), time.time()
    phase.metrics_after = _metrics(metrics)
    phase.flooders = [flooder.line(timeout_s=60) for flooder in flooders]
    for flooder in flooders:
        flooder.process.wait(timeout=30)
    if spy is not None:
        spy.wait(timeout=30)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start everything, run the phases, stop everything; the figures."""
    from tests.mqtt_broker import free_port

    phases = [
        Phase("baseline", args.baseline_s, None),
        Phase("small_flood", args.small_s, args.small_gpus),
        Phase("large_flood", args.large_s, args.large_gpus),
        Phase("recovery", args.recovery_s, None),
    ]
    result = Run()
    with tempfile.TemporaryDirectory(prefix="polca-bench-flood-") as tmp:
        work = Path(tmp)
        broker = _start_broker(work, args.broker_option)
        metrics = f"127.0.0.1:{free_port()}"
        config, agent_configs = _configs(
            work,
            port=broker.port,
            metrics=metrics,
            interval_s=args.interval_s,
            load_nodes=args.load_nodes,
        )
        children: list[Child] = []
        sampler: Sampler | None = None
        try:
            observer = _role("observe", broker.port, work / "secrets" / f"{OBSERVER}.pass")
            children.append(observer)
            assert observer.line().get("ready")
            aggregator = Child.start(
                [sys.executable, "-m", "polca", "aggregator", "--config", str(config)],
                output=work / "aggregator.log",
            )
            children.append(aggregator)
            for path in agent_configs:
                argv = [sys.executable, "-m", "polca", "agent", "--config", str(path)]
                children.append(Child.start(argv, output=path.with_suffix(".log")))
            if args.load_nodes:
                children.append(_load(args, port=broker.port, work=work, phases=phases))
            _settle(observer, result.arrivals)
            sampler = Sampler(broker.pid, aggregator.process.pid)
            result.observer, result.aggregator_pid = observer, aggregator.process.pid
            for phase in phases:
                _run_phase(
                    phase, args=args, port=broker.port, work=work, metrics=metrics, run=result
                )
            result.arrivals.extend(observer.ask("take")["arrivals"])
        finally:
            if sampler is not None:
                sampler.close()
                result.samples = sampler.samples
            for child in reversed(children):
                child.stop()
            broker_log = broker.log_path.read_text(encoding="utf-8", errors="replace")
            broker.kill()
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                for path in [*work.glob("*.log"), broker.log_path, broker.conf_path]:
                    shutil.copy(path, args.keep / path.name)
        result.aggregator_events = _log_events(work / "aggregator.log")
        result.agent_events = _log_events(*(p.with_suffix(".log") for p in agent_configs))
    result.broker = _broker_log(broker_log)
    per_phase = {p.name: _figures(p, result) for p in phases}
    return _result(args, per_phase, result.broker)


def _node_connections() -> dict[str, str]:
    """Which of the aggregator's node connections carries each node (by default)."""
    from polca.aggregator.config import IntakeSettings
    from polca.aggregator.intake import node_shard

    count = IntakeSettings().connections
    return {node: node_shard(node, count) for node in [FLOODER, *(n for _rack, n in HONEST)]}


def _result(
    args: argparse.Namespace, per_phase: dict[str, dict[str, Any]], broker: dict[str, Any]
) -> dict[str, Any]:
    """The JSON document: the worst of the flood and recovery phases, the floor, each phase."""
    flooded = [per_phase[name] for name in ("small_flood", "large_flood", "recovery")]
    peaks = (
        "flood_msgs_per_s",
        "control_gap_max_s",
        "control_delay_max_s",
        "broker_rss_mib",
        "aggregator_cpu_pct",
    )
    counts = (
        "honest_stale_summaries",
        "honest_offline_summaries",
        "mqtt_disconnected",
        "honest_mqtt_disconnected",
    )
    worst: dict[str, Any] = {
        key: max((p[key] for p in flooded if p[key] is not None), default=None) for key in peaks
    }
    worst |= {key: sum(p[key] for p in flooded) for key in counts}
    goal_gap_s = 2 * args.interval_s
    return {
        "benchmark": "row_flood",
        **worst,
        "floor": {key: per_phase["baseline"][key] for key in (*peaks, *counts)},
        "goals": {
            "control_gap_max_s": goal_gap_s,
            "honest_stale_summaries": 0,
            "met": (worst["control_gap_max_s"] or 0) <= goal_gap_s
            and all(worst[key] == 0 for key in counts),
        },
        "phases": per_phase,
        "broker": {
            "config": "deploy/mosquitto/mosquitto.conf",
            "options_added": list(args.broker_option),
            **broker,
        },
        "node_connections": _node_connections(),
        "control_interval_s": args.interval_s,
        "flooders": args.flooders,
        "flood_rate_asked": args.flood_rate,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def _print(result: dict[str, Any]) -> None:
    rows = (
        ("flood_message_bytes", "flood message (bytes)"),
        ("flood_msgs_per_s", "flood published (msg/s)"),
        ("flood_mib_per_s", "flood published (MiB/s)"),
        ("aggregator_msgs_per_s", "aggregator handled (msg/s)"),
        ("rate_limited", "  of which rate_limited"),
        ("broker_dropped", "broker dropped (msgs)"),
        ("control_messages", "control messages"),
        ("control_gap_max_s", "control gap max (s)"),
        ("control_delay_max_s", "control delay max (s)"),
        ("summaries", "row summaries"),
        ("honest_stale_summaries", "  honest node stale"),
        ("honest_offline_summaries", "  honest node offline"),
        ("load_stale_summaries", "  a load node stale/offline"),
        ("load_stale_max", "  load nodes stale/offline max"),
        ("broker_rss_mib", "broker RSS max (MiB)"),
        ("broker_cpu_pct", "broker CPU (% of a core)"),
        ("aggregator_cpu_pct", "aggregator CPU (% of a core)"),
        ("aggregator_rss_mib", "aggregator RSS max (MiB)"),
        ("flooder_cpu_pct", "flooders' CPU (% of a core)"),
        ("mqtt_disconnected", "aggregator MQTT disconnects"),
        ("honest_mqtt_disconnected", "honest agents' disconnects"),
    )
    phases = result["phases"]
    names = list(phases)
    print(f"{'':<30}" + "".join(f"{name:>14}" for name in names))
    for key, label in rows:
        cells = "".join(f"{'-' if phases[n][key] is None else phases[n][key]!s:>14}" for n in names)
        print(f"{label:<30}{cells}")
    connections = result["node_connections"]
    for _rack, node in HONEST:
        shared = connections[node] == connections[FLOODER]
        label = f"  {node} stale{' (flooder conn.)' if shared else ''}"
        cells = "".join(f"{phases[n]['honest_stale_by_node'][node]:>14}" for n in names)
        print(f"{label:<30}{cells}")
    goals, broker = result["goals"], result["broker"]
    print(
        f"goals (control gap <= {goals['control_gap_max_s']:g} s, no honest node stale or "
        f"offline, no disconnect): {'met' if goals['met'] else 'NOT met'}"
    )
    print(
        f"broker: dropped outgoing messages for {', '.join(broker['outgoing_dropped_for']) or '-'}"
        f"; out-of-memory disconnects {broker['disconnected_out_of_memory'] or '-'}"
        f"; other disconnects {broker['disconnected_other'] or '-'}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or one of its child roles: ``flood``, ``observe``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="role")
    for role in ("flood", "observe"):
        p = sub.add_parser(role)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--password-file", required=True)
    flood = sub.choices["flood"]
    flood.add_argument("--gpus", type=int, required=True)
    flood.add_argument("--rate", type=float, default=0.0, help="msg/s; 0: flat out")
    flood.add_argument("--max-s", type=float, default=600.0)
    parser.add_argument("--baseline-s", type=float, default=20.0)
    parser.add_argument("--small-s", type=float, default=30.0)
    parser.add_argument("--large-s", type=float, default=30.0)
    parser.add_argument("--recovery-s", type=float, default=20.0)
    parser.add_argument("--small-gpus", type=int, default=1, help="GPUs per small message")
    parser.add_argument("--large-gpus", type=int, default=232, help="GPUs per large message")
    parser.add_argument("--flooders", type=int, default=2, help="flooder processes per flood")
    parser.add_argument("--flood-rate", type=float, default=0.0, help="msg/s in all; 0: flat out")
    parser.add_argument("--interval-s", type=float, default=1.0, help="control.interval_s")
    parser.add_argument(
        "--load-nodes",
        type=int,
        default=0,
        help=f"more honest nodes in the row (a multiple of {LOAD_PER_RACK}), 1 msg/s each, "
        "from one publisher process",
    )
    parser.add_argument(
        "--broker-option",
        action="append",
        default=[],
        help="a line appended to the broker configuration (repeatable)",
    )
    parser.add_argument("--keep", type=Path, help="copy the logs and the broker's files here")
    parser.add_argument(
        "--py-spy", type=Path, help="record the aggregator with py-spy in each flood, here"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "flood.json")
    args = parser.parse_args(argv)
    if args.role == "flood":
        print(json.dumps(_flood(args)), flush=True)
        return 0
    if args.role == "observe":
        print(json.dumps(_observe(args)), flush=True)
        return 0
    result = run(args)
    _print(result)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
