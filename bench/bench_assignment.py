"""The Kubernetes assignment source: pod scheduled -> class in force -> caps, and its CPU.

Real processes only: Mosquitto, the kubelet stand-in (a real gRPC pod-resources server on
a unix socket, ``tests/standins/kubelet.py``), the Kubernetes API stand-in (pod list and
watch over HTTP, ``tests/standins/kubeapi.py``) and ``polca agent`` processes on the fake
NVML library (8 A100s each, ``policies/polca-a100.yaml``). This process holds the row at
T2 (a retained control message, renewed every 5 s) and listens to telemetry with its own
MQTT client (paho, its own thread).

1. **Latency.** One agent with ``assignment.source: kubernetes``, ``refresh_s: 1.0`` (the
   default), ``class_dwell_s: 0`` and telemetry every ``--publish-s`` (0.25 s). A cycle
   puts a pod annotated ``polca.io/class: high`` in the top-class namespace to the API
   stand-in and gives it one GPU in the kubelet's state (the API first, as a scheduler
   binds before the kubelet admits), then deletes it; the GPU rotates over the 8. From
   the moment before the first write:

   - ``class_s``: the first telemetry message (receipt time here) showing the GPU at
     ``high`` with origin ``annotation``;
   - ``caps_s``: the fake's clock lock of the GPU at T2 high's 1305 MHz (polled every
     10 ms from the fake's state file): the caps applied at the control step the new
     class wakes;
   - on delete, the same back to ``low`` (``idle``) and 1110 MHz (``release_*``).

   Between cycles a random pause (0-1 s) puts the writes at a random phase of the refresh.
   Floor: the refresh itself. A change waits for the next read of pod-resources, uniform
   over ``refresh_s``: a p99 of about 0.99 s before anything polca does, plus up to one
   telemetry period for ``class_s``.

2. **CPU.** Two agents side by side for the same windows, identical but for the source:
   ``kubernetes`` (refresh 1 s, its own kubelet stand-in with a pod on each of its 8 GPUs,
   the API stand-in holding those pods and watched) and ``mqtt`` (the floor: the same
   agent reading the retained ``assign`` topic, which nobody writes). Both sample at 10 Hz
   and publish every second (the defaults). Each agent's user + system CPU over each
   window (``/proc/PID/stat``) as % of one core; ``cpu_pct`` is the median over the
   windows of (kubernetes - mqtt): what the source costs. Goal: under 1% of a core. The
   stand-ins' CPU is reported beside (not polca's).

3. **A large node's read** (``large_read``): 2,000 pods of 2 containers with 4 GPUs each
   (4,000 containers, 8,000 device ids) in the kubelet stand-in; ``read_p50_s`` is the
   median of ``--reads`` calls of ``PodResourcesClient.list_devices`` (gRPC over the unix
   socket, decoding, bounds and checks), after one call that lets the stand-in build its
   answer. Floor, in a separate process: the median time to decode the same answer's
   bytes with protobuf alone (``ListPodResourcesResponse.FromString``), what any client
   must spend.

    .venv/bin/python bench/bench_assignment.py           # ~2.5 min; bench/results/assignment.json
    .venv/bin/python bench/bench_assignment.py --quick   # ~35 s, not for the record

Needs Mosquitto and gcc (the fake NVML).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.* is repository tooling (fake NVML, stand-ins, Mosquitto)

from bench.benchkit import median, percentile, proc_cpu_s, write_result  # noqa: E402
from tests.fake_nvml import FakeNvml  # noqa: E402
from tests.mqtt_broker import MosquittoProcess  # noqa: E402
from tests.standins.kubeapi_process import KubeApiStandIn  # noqa: E402
from tests.standins.kubelet import KubeletStandIn, pod  # noqa: E402

from polca.assign.podresources import PodResourcesClient  # noqa: E402
from polca.telemetry.schema import Control, Status, Telemetry, decode, encode  # noqa: E402

SITE, ROW, RACK = "bench", "row1", "rack1"
POLICY = REPO / "policies" / "polca-a100.yaml"
GPUS = 8
HIGH_MHZ, LOW_MHZ = 1305, 1110  # polca-a100.yaml at T2
TOKEN = "bench-token"  # noqa: S105 - the stand-in's token
TOP_NAMESPACE = "prod"
RESOURCE = "nvidia.com/gpu"
S = 1_000_000_000


class Listener:
    """Every node's last telemetry, and each GPU's (class, origin) changes with the
    receipt time of the message that showed them first (paho, its own thread)."""

    def __init__(self, port: int) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self._lock = threading.Lock()
        self.shown: dict[tuple[str, int], list[tuple[float, str | None, str | None]]] = {}
        self.healthy: dict[str, bool | None] = {}
        self.seq = 0
        self.epoch_ns = time.time_ns()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-assignment")
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.subscribe(f"polca/v1/{SITE}/#", qos=1)
        self.client.loop_start()

    def _on_message(self, _client: Any, _userdata: Any, message: Any) -> None:
        now = time.monotonic()
        topic: str = message.topic
        if not message.payload or not (topic.endswith(("/telemetry", "/status"))):
            return
        try:
            decoded = decode(bytes(message.payload))
        except ValueError:
            return
        with self._lock:
            if isinstance(decoded, Telemetry):
                for g in decoded.gpus:
                    seen = self.shown.setdefault((decoded.node, g.index), [])
                    if not seen or seen[-1][1:] != (g.priority_class, g.class_origin):
                        seen.append((now, g.priority_class, g.class_origin))
            elif isinstance(decoded, Status):
                self.healthy[decoded.node] = decoded.assignment_healthy

    def first_shown(self, node: str, gpu: int, cls: str, origin: str, after: float) -> float | None:
        """When telemetry first showed ``gpu`` at (``cls``, ``origin``) after ``after``."""
        with self._lock:
            for at, c, o in self.shown.get((node, gpu), []):
                if at > after and (c, o) == (cls, origin):
                    return at
        return None

    def current(self, node: str, gpu: int) -> tuple[str | None, str | None] | None:
        """The GPU's (class, origin) in the node's last telemetry."""
        with self._lock:
            seen = self.shown.get((node, gpu))
            return seen[-1][1:] if seen else None

    def control(self, level: int, lease_s: float = 30.0) -> None:
        """A retained row control message, as a row controller publishes it."""
        self.seq += 1
        now = time.time_ns()
        control = Control(
            ts_ns=now,
            scope="row",
            row=ROW,
            issuer="bench",
            epoch_ns=self.epoch_ns,
            seq=self.seq,
            level=level,
            issued_ns=now,
            lease_expires_ns=now + int(lease_s * S),
        )
        self.client.publish(f"polca/v1/{SITE}/{ROW}/control", encode(control), qos=1, retain=True)

    def close(self) -> None:
        """Disconnect."""
        self.client.loop_stop()
        self.client.disconnect()


@dataclass
class Agent:
    """One ``polca agent`` process on its own fake node."""

    node: str
    fake: FakeNvml
    workdir: Path
    process: subprocess.Popen[bytes] | None = None
    config: dict[str, Any] = field(default_factory=dict)

    def start(self) -> None:
        """Write the config, start the process."""
        path = self.workdir / "agent.yaml"
        path.write_text(yaml.safe_dump(self.config), encoding="utf-8")
        with (self.workdir / "agent.log").open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "polca", "agent", "--config", str(path)],
                env=self.fake.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    @property
    def pid(self) -> int:
        """The running process's id."""
        assert self.process is not None
        if self.process.poll() is not None:
            tail = (self.workdir / "agent.log").read_text(errors="replace")[-3000:]
            msg = f"agent {self.node} exited with {self.process.returncode}:\n{tail}"
            raise RuntimeError(msg)
        return self.process.pid

    def stop(self) -> None:
        """SIGTERM, then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def locked_max(self, gpu: int) -> int:
        """The fake's clock lock of ``gpu`` (0: unlocked)."""
        value = self.fake.get(gpu)["locked_max_mhz"]
        assert isinstance(value, int)
        return value

    def uuid(self, gpu: int) -> str:
        """The fake's UUID of ``gpu``."""
        value = self.fake.get(gpu)["uuid"]
        assert isinstance(value, str)
        return value


def make_agent(
    work: Path,
    broker: MosquittoProcess,
    node: str,
    *,
    source: str,
    kubelet: KubeletStandIn | None = None,
    api: KubeApiStandIn | None = None,
    publish_s: float = 1.0,
) -> Agent:
    """An agent (not started) on a new 8-A100 fake node; ``source`` kubernetes or mqtt."""
    workdir = work / node
    (workdir / "nvml").mkdir(parents=True)
    fake = FakeNvml(workdir / "nvml", gpus=GPUS, model="NVIDIA A100-SXM4-80GB")
    config: dict[str, Any] = {
        "mqtt": {"host": broker.host, "port": broker.port},
        "topics": {"site": SITE, "row": ROW, "rack": RACK, "node": node},
        "gpu": {"backend": "nvml"},
        "agent": {
            "policy_file": str(POLICY),
            "state_dir": str(workdir / "state"),
            "startup_grace_s": 3600,
            "publish_interval_s": publish_s,
            "class_dwell_s": 0,
        },
        "assignment": {"source": source},
        "logging": {"level": "warning", "format": "json"},
    }
    if source == "kubernetes":
        assert kubelet is not None
        assert api is not None
        token_file = workdir / "token"
        token_file.write_text(TOKEN + "\n", encoding="utf-8")
        config["assignment"]["kubernetes"] = {
            "pod_resources_socket": str(kubelet.socket_path),
            "refresh_s": 1.0,
            "node_name": node,
            "api_url": api.url,
            "token_file": str(token_file),
            "allow_http": True,
            "top_class_namespaces": [TOP_NAMESPACE],
            "idle_class": "low",
        }
    return Agent(node, fake, workdir, config=config)


def wait(
    predicate: Callable[[], bool], *, timeout_s: float, what: str, step_s: float = 0.01
) -> None:
    """Poll ``predicate`` until it holds; ``RuntimeError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            msg = f"timed out after {timeout_s} s waiting for {what}"
            raise RuntimeError(msg)
        time.sleep(step_s)


def transition(
    agent: Agent,
    listener: Listener,
    gpu: int,
    *,
    cls: str,
    origin: str,
    mhz: int,
    act: Callable[[], None],
) -> tuple[float, float]:
    """Do ``act``; the seconds until telemetry shows (``cls``, ``origin``) on ``gpu`` and
    until the fake's lock is ``mhz`` (both from just before ``act``)."""
    t0 = time.monotonic()
    act()
    cap_at: float | None = None
    deadline = t0 + 20.0
    while True:
        now = time.monotonic()
        if cap_at is None and agent.locked_max(gpu) == mhz:
            cap_at = now
        class_at = listener.first_shown(agent.node, gpu, cls, origin, t0)
        if cap_at is not None and class_at is not None:
            return class_at - t0, cap_at - t0
        if now > deadline:
            msg = (
                f"GPU {gpu}: no {cls}/{origin} within 20 s (telemetry shows "
                f"{listener.current(agent.node, gpu)}, lock {agent.locked_max(gpu)} MHz)"
            )
            raise RuntimeError(msg)
        time.sleep(0.01)


def latency(
    work: Path, broker: MosquittoProcess, listener: Listener, *, cycles: int, publish_s: float
) -> dict[str, Any]:
    """Schedule/delete ``cycles`` pods; class and caps latencies."""
    with ExitStack() as stack:
        kubelet, api = stack.enter_context(standins(work / "lat"))
        agent = make_agent(
            work,
            broker,
            "k8s-lat",
            source="kubernetes",
            kubelet=kubelet,
            api=api,
            publish_s=publish_s,
        )
        kubelet.set_allocatable({RESOURCE: [agent.uuid(g) for g in range(GPUS)]})
        agent.start()
        stack.callback(agent.stop)
        wait(
            lambda: (
                all(agent.locked_max(g) == LOW_MHZ for g in range(GPUS))
                and listener.healthy.get(agent.node) is True
            ),
            timeout_s=60,
            what="the latency agent healthy, every GPU at T2 low",
            step_s=0.1,
        )
        figures: dict[str, list[float]] = {
            k: [] for k in ("class", "caps", "rel_class", "rel_caps")
        }
        for i in range(cycles):
            gpu, name = i % GPUS, f"job-{i}"
            time.sleep(random.uniform(0.0, 1.0))

            def put(gpu: int = gpu, name: str = name) -> None:
                api.put_pod(
                    TOP_NAMESPACE, name, node=agent.node, annotations={"polca.io/class": "high"}
                )
                kubelet.set_pods(
                    [pod(TOP_NAMESPACE, name, {"main": {RESOURCE: [agent.uuid(gpu)]}})]
                )

            def delete(name: str = name) -> None:
                kubelet.set_pods([])
                api.delete_pod(TOP_NAMESPACE, name)

            class_s, caps_s = transition(
                agent, listener, gpu, cls="high", origin="annotation", mhz=HIGH_MHZ, act=put
            )
            figures["class"].append(class_s)
            figures["caps"].append(caps_s)
            time.sleep(random.uniform(0.0, 1.0))
            class_s, caps_s = transition(
                agent, listener, gpu, cls="low", origin="idle", mhz=LOW_MHZ, act=delete
            )
            figures["rel_class"].append(class_s)
            figures["rel_caps"].append(caps_s)
            print(
                f"  cycle {i + 1:2d}/{cycles} GPU {gpu}: class {figures['class'][-1]:.2f} s, "
                f"caps {figures['caps'][-1]:.2f} s; deleted: class {class_s:.2f} s, "
                f"caps {caps_s:.2f} s",
                flush=True,
            )
    out: dict[str, Any] = {"cycles": cycles}
    names = {"rel_class": "release_class", "rel_caps": "release_caps"}
    for key, values in figures.items():
        name = names.get(key, key)
        out[f"{name}_p50_s"] = round(median(values), 3)
        out[f"{name}_p99_s"] = round(percentile(values, 0.99), 3)
        out[f"{name}_max_s"] = round(max(values), 3)
    return out


def cpu(
    work: Path, broker: MosquittoProcess, listener: Listener, *, windows: int, window_s: float
) -> dict[str, Any]:
    """The kubernetes agent against the mqtt agent over the same windows."""
    with ExitStack() as stack:
        kubelet, api = stack.enter_context(standins(work / "cpu"))
        k8s = make_agent(work, broker, "k8s-cpu", source="kubernetes", kubelet=kubelet, api=api)
        floor = make_agent(work, broker, "mqtt-cpu", source="mqtt")
        kubelet.set_allocatable({RESOURCE: [k8s.uuid(g) for g in range(GPUS)]})
        pods = []
        for g in range(GPUS):
            cls = "high" if g < GPUS // 2 else "low"
            namespace = TOP_NAMESPACE if cls == "high" else "batch"
            api.put_pod(namespace, f"w{g}", node=k8s.node, annotations={"polca.io/class": cls})
            pods.append(pod(namespace, f"w{g}", {"main": {RESOURCE: [k8s.uuid(g)]}}))
        kubelet.set_pods(pods)
        for agent in (k8s, floor):
            agent.start()
            stack.callback(agent.stop)
        wait(
            lambda: (
                listener.current(k8s.node, 0) == ("high", "annotation")
                and listener.healthy.get(k8s.node) is True
                and listener.current(floor.node, 0) is not None
            ),
            timeout_s=60,
            what="both CPU agents up, the kubernetes one with its pods' classes",
            step_s=0.1,
        )
        time.sleep(5.0)  # warm-up: imports done, first lists and watches made
        pids = {"k8s": k8s.pid, "mqtt": floor.pid}
        assert kubelet.pid is not None
        assert api.pid is not None
        procs = {**pids, "kubelet": kubelet.pid, "kubeapi": api.pid}
        samples: dict[str, list[float]] = {k: [] for k in (*procs, "diff")}
        for w in range(windows):
            before = {k: proc_cpu_s(p) for k, p in procs.items()}
            t0 = time.monotonic()
            time.sleep(window_s)
            elapsed = time.monotonic() - t0
            pct = {k: 100.0 * (proc_cpu_s(p) - before[k]) / elapsed for k, p in procs.items()}
            for k, v in pct.items():
                samples[k].append(v)
            samples["diff"].append(pct["k8s"] - pct["mqtt"])
            print(
                f"  window {w + 1}/{windows} ({elapsed:.0f} s): kubernetes agent "
                f"{pct['k8s']:.2f} %, mqtt agent {pct['mqtt']:.2f} %, difference "
                f"{pct['k8s'] - pct['mqtt']:+.2f} % of a core",
                flush=True,
            )
        assert k8s.pid  # both still alive after the windows (raises if not)
        assert floor.pid
    return {
        "windows": windows,
        "window_s": window_s,
        "cpu_pct": round(median(samples["diff"]), 2),
        "agent_kubernetes_pct": round(median(samples["k8s"]), 2),
        "agent_mqtt_pct": round(median(samples["mqtt"]), 2),
        "kubelet_standin_pct": round(median(samples["kubelet"]), 2),
        "kubeapi_standin_pct": round(median(samples["kubeapi"]), 2),
        "cpu_diff_windows_pct": [round(v, 2) for v in samples["diff"]],
    }


@contextmanager
def standins(workdir: Path) -> Iterator[tuple[KubeletStandIn, KubeApiStandIn]]:
    """A kubelet stand-in (its socket in a short directory) and an API stand-in."""
    short = Path(tempfile.mkdtemp(prefix="polca-bk-"))
    kubelet = KubeletStandIn(workdir / "kubelet", short / "kubelet.sock")
    api = KubeApiStandIn(workdir / "kubeapi", token=TOKEN)
    try:
        kubelet.start()
        api.start()
        yield kubelet, api
    finally:
        kubelet.stop()
        api.stop()
        shutil.rmtree(short, ignore_errors=True)


def large_pods() -> list[dict[str, Any]]:
    """2,000 pods of 2 containers with 4 GPUs each, in 50 namespaces."""
    return [
        pod(
            f"ns-{i % 50}",
            f"job-{i}",
            {
                f"c{c}": {RESOURCE: [f"GPU-{i:08x}-{c:04x}-{g:04x}" for g in range(4)]}
                for c in range(2)
            },
        )
        for i in range(2000)
    ]


_CALL_FLOOR = """
import json, statistics, sys, time
import grpc
sys.path.insert(0, sys.argv[1])
from polca.assign._pb import api_pb2, api_pb2_grpc
limit = 16 * 1024 * 1024
with grpc.insecure_channel(
    "unix://" + sys.argv[2], options=[("grpc.max_receive_message_length", limit)]
) as channel:
    stub = api_pb2_grpc.PodResourcesListerStub(channel)
    answer = stub.List(api_pb2.ListPodResourcesRequest(), timeout=30)
    times = []
    for _ in range(int(sys.argv[3])):
        start = time.perf_counter()
        stub.List(api_pb2.ListPodResourcesRequest(), timeout=30)
        times.append(time.perf_counter() - start)
print(json.dumps({"call_p50_s": statistics.median(times), "answer_bytes": answer.ByteSize()}))
"""


def large_read(work: Path, *, reads: int) -> dict[str, Any]:
    """``list_devices`` of a 2,000-pod node against the protobuf decode of its answer."""
    pods = large_pods()
    with standins(work / "large") as (kubelet, _api):
        kubelet.set_pods(pods)

        async def measure() -> list[float]:
            times = []
            async with PodResourcesClient(kubelet.socket_path, timeout_s=30.0) as client:
                assert len(await client.list_devices()) == 4000
                for _ in range(reads):
                    start = time.perf_counter()
                    devices = await client.list_devices()
                    times.append(time.perf_counter() - start)
                    assert len(devices) == 4000
            return times

        times = asyncio.run(measure())
        floor = subprocess.run(
            [sys.executable, "-c", _CALL_FLOOR, str(REPO), str(kubelet.socket_path), str(reads)],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
    found = json.loads(floor.stdout)
    return {
        "pods": len(pods),
        "containers": 4000,
        "device_ids": 8000,
        "reads": reads,
        "read_p50_s": median(times),
        "read_max_s": max(times),
        "floor_call_p50_s": found["call_p50_s"],
        "answer_bytes": found["answer_bytes"],
        "ratio_to_floor": median(times) / found["call_p50_s"],
    }


def run(
    *, cycles: int, windows: int, window_s: float, publish_s: float, reads: int
) -> dict[str, Any]:
    """Broker and listener; the latency, the CPU measurement, then the large read."""
    with tempfile.TemporaryDirectory(prefix="polca-bench-assign-") as tmp:
        work = Path(tmp)
        broker = MosquittoProcess(work / "mosquitto")
        broker.start()
        listener = Listener(broker.port)
        stop = threading.Event()

        def hold_t2() -> None:
            while not stop.is_set():
                listener.control(2)
                stop.wait(5.0)

        holder = threading.Thread(target=hold_t2, daemon=True)
        holder.start()
        try:
            print(f"latency: {cycles} schedule/delete cycles, refresh 1 s", flush=True)
            lat = latency(work, broker, listener, cycles=cycles, publish_s=publish_s)
            print(f"cpu: {windows} window(s) of {window_s:.0f} s, both agents", flush=True)
            use = cpu(work, broker, listener, windows=windows, window_s=window_s)
            print(f"large read: a 2,000-pod node, {reads} reads", flush=True)
            big = large_read(work, reads=reads)
        finally:
            stop.set()
            holder.join()
            listener.close()
            broker.kill()
    return {
        "benchmark": "assignment_kubernetes",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "gpus": GPUS,
        "refresh_s": 1.0,
        "telemetry_period_s": publish_s,
        "class_p99_s": lat["class_p99_s"],
        "caps_p99_s": lat["caps_p99_s"],
        "cpu_pct": use["cpu_pct"],
        "read_p50_s": big["read_p50_s"],
        "latency": lat,
        "cpu": use,
        "large_read": big,
        "floor_refresh_p99_s": 0.99,
        "goal_cpu_pct": 1.0,
    }


def main(argv: list[str] | None = None) -> int:
    """Run, print the figures next to their floors, write the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="5 cycles, one 10 s window")
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--publish-s", type=float, default=0.25)
    parser.add_argument("--reads", type=int, default=21, help="large reads (median)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "assignment.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.cycles, args.windows, args.window_s, args.reads = 5, 1, 10.0, 5
    figures = run(
        cycles=args.cycles,
        windows=args.windows,
        window_s=args.window_s,
        publish_s=args.publish_s,
        reads=args.reads,
    )
    lat, use = figures["latency"], figures["cpu"]
    print()
    print(f"{'':46s} {'p50':>7s} {'p99':>7s}")
    for label, key in (
        ("pod scheduled -> class in telemetry", "class"),
        ("pod scheduled -> caps on the GPU", "caps"),
        ("pod deleted -> idle class in telemetry", "release_class"),
        ("pod deleted -> idle caps on the GPU", "release_caps"),
    ):
        print(f"{label:46s} {lat[key + '_p50_s']:6.2f}s {lat[key + '_p99_s']:6.2f}s")
    print(f"{'floor: the next refresh (uniform over 1 s)':46s} {0.5:6.2f}s {0.99:6.2f}s")
    print()
    print(
        f"agent, source kubernetes (refresh 1 s)   {use['agent_kubernetes_pct']:6.2f} % of a core"
    )
    print(f"agent, source mqtt (floor)               {use['agent_mqtt_pct']:6.2f} % of a core")
    print(f"the source's cost (median difference)    {use['cpu_pct']:+6.2f} % of a core (goal < 1)")
    print(
        f"stand-ins (not polca): kubelet {use['kubelet_standin_pct']:.2f} %, "
        f"API {use['kubeapi_standin_pct']:.2f} %"
    )
    big = figures["large_read"]
    print()
    print(f"a 2,000-pod node (8,000 GPU ids), list_devices  {big['read_p50_s'] * 1e3:7.1f} ms p50")
    print(
        f"floor: the bare gRPC call ({big['answer_bytes']:,} bytes)     "
        f"{big['floor_call_p50_s'] * 1e3:7.1f} ms p50 (polca x{big['ratio_to_floor']:.1f})"
    )
    write_result(args.out, figures)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
