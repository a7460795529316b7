"""``polca meter`` polling 200 SNMP PDUs, and out-of-band caps after an agent's death.

Two measurements, every process its own OS process, the floors in the same run:

1. **Meter.** One ``polca meter run`` (the real CLI, JSON logs) polls ``--pdus``
   simulated APC rPDU2s (snmpsim serving ``tests/data/snmprec/apc.snmprec`` under one
   community per PDU, ``--per-row`` PDUs per row) every second and publishes each row's
   reading to a local Mosquitto. After ``--warmup-s`` it is watched for ``--seconds``:

   - ``poll_p99_ms``: polca's own round times (a round = every source of every row read
     concurrently, then every row published), from its ``meter_rounds`` log lines with
     ``stats_every_s: 0.5``, so each line is one round (the p99 is nearest rank);
   - ``cpu_pct``: its user + system CPU time over the window (``/proc/PID/stat``), as a
     percentage of one core;
   - every row every second: a separate subscriber process (``benchkit listen``) counts
     each row's messages, the longest gap between two of them, and partial readings.

   Floor (``snmp-floor`` role of this script, its own process, run alone afterwards
   against the same agent): bare pysnmp asyncio, one engine, the same PDUs every second,
   rounds timed the same way and CPU measured the same way, in two shapes: ``get``, one
   GET of the device-power OID per PDU (the protocol's least cost for the same answer, and
   what a polca source asks a PDU measuring its total power once it has found that out);
   ``same``, every request of the APC profile each poll (one GET, then four GETBULKs of
   the phase columns, one after the other, per PDU: what polca asked before it learnt
   which value a device supports).

2. **Out-of-band cap.** Mosquitto, one Redfish stand-in per node (``bmc:NODE``), a real
   ``polca aggregator`` (control every 0.2 s, telemetry stale after 1.5 s, ``bmc.nodes``
   for each node) and ``--nodes`` real agents on the fake NVML library (8 A100s each).
   The row meter is fed at ``--meter-pct`` of the budget (T2 of ``policies/polca-a100.yaml``
   at 89%, T3 at 98%). A trial SIGKILLs one agent (rotating over the nodes) while the row
   has been at level 2 for 1 s, and times from the kill to:

   - ``oob_cap_s`` (the headline): the aggregator's ``oob_cap_applied`` log line (the
     limit written and read back, verified), its ISO timestamp against the wall clock
     read just before the kill;
   - ``bmc_seen_s``: this process polling the node's ``Controls/NodePower`` every 20 ms
     until it reports ``fail_safe_w`` (a cross-check, on the monotonic clock).

   The agent is then restarted, the meter dropped to 50% until the row is at level 0 and
   the BMC's limit is back (the release), and raised again before the next kill.
   Floor (``bmc-floor`` role): a separate process doing PATCH ``SetPoint`` + GET on a
   stand-in BMC over one keep-alive connection, ``bmc_latency_ms`` its median.

    .venv/bin/python bench/bench_meter.py            # ~4.5 min; writes bench/results/meter.json
    .venv/bin/python bench/bench_meter.py --quick    # ~1.5 min

Needs ``.snmpsim-venv`` (``scripts/snmpsim-env.sh``), Mosquitto and gcc (the fake NVML).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import (  # noqa: E402
    BROKER_CONFIG,
    Child,
    RowDriver,
    median,
    percentile,
    proc_cpu_s,
    stop_all,
    write_result,
)

SITE = "bench"
APC_POWER_W = 5230.0  # what apc.snmprec reports (device power, hundredths of kW)
DEVICE_POWER_OID = "1.3.6.1.4.1.318.1.1.26.4.3.1.5.1"
BMC_LIMIT_W = 1200.0  # the stand-in BMC's limit at start
FAIL_SAFE_W = 800.0
BUDGET_W = 10_000.0


def _summary(values_ms: Sequence[float]) -> dict[str, Any]:
    if not values_ms:
        return {"n": 0}
    return {
        "n": len(values_ms),
        "p50": round(median(values_ms), 2),
        "p99": round(percentile(values_ms, 0.99), 2),
        "max": round(max(values_ms), 2),
    }


def _wall_s(stamp: str) -> float:
    """A structlog ISO timestamp (UTC) as seconds since the epoch."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _json_lines(path: Path) -> Iterator[dict[str, Any]]:
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if raw.startswith("{"):
            with contextlib.suppress(ValueError):
                yield json.loads(raw)


# --- the floors' processes -------------------------------------------------------------------


def _snmp_floor(args: argparse.Namespace) -> dict[str, Any]:
    """Bare pysnmp: the PDUs every second, one engine; round times and own CPU."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from pysnmp.hlapi.v3arch import asyncio as hlapi  # type: ignore[import-untyped]

    walks = (
        "1.3.6.1.4.1.318.1.1.26.6.3.1.7",
        "1.3.6.1.4.1.318.1.1.26.6.3.1.2",
        "1.3.6.1.4.1.318.1.1.26.6.3.1.5",
        "1.3.6.1.4.1.318.1.1.26.6.3.1.6",
    )
    communities = [f"{args.prefix}{i:03d}" for i in range(args.pdus)]

    async def run() -> dict[str, Any]:
        engine = hlapi.SnmpEngine()
        target = await hlapi.UdpTransportTarget.create(
            (args.host, args.port), timeout=0.5, retries=1
        )
        auths = {c: hlapi.CommunityData(c, mpModel=1) for c in communities}  # noqa: S508
        errors = 0

        async def one(community: str) -> None:
            nonlocal errors
            auth, context = auths[community], hlapi.ContextData()
            indication, status, _, _ = await hlapi.get_cmd(
                engine,
                auth,
                target,
                context,
                hlapi.ObjectType(hlapi.ObjectIdentity(DEVICE_POWER_OID)),
                lookupMib=False,
            )
            errors += bool(indication or status)
            if args.shape == "same":
                for prefix in walks:
                    indication, status, _, _ = await hlapi.bulk_cmd(
                        engine,
                        auth,
                        target,
                        context,
                        0,
                        16,
                        hlapi.ObjectType(hlapi.ObjectIdentity(prefix)),
                        lookupMib=False,
                    )
                    errors += bool(indication or status)

        loop = asyncio.get_running_loop()
        rounds_ms: list[float] = []
        start = loop.time()
        measure_from = start + args.warmup_s
        end = measure_from + args.seconds
        cpu0 = None
        tick = start
        while tick < end:
            if cpu0 is None and tick >= measure_from:
                cpu0, errors = proc_cpu_s(os.getpid()), 0
            began = time.monotonic()
            await asyncio.gather(*(one(c) for c in communities))
            if tick >= measure_from:
                rounds_ms.append(1000 * (time.monotonic() - began))
            tick += 1.0
            while tick < loop.time():  # a late round is skipped, as polca's loop does
                tick += 1.0
            await asyncio.sleep(max(0.0, tick - loop.time()))
        cpu_s = proc_cpu_s(os.getpid()) - (cpu0 or 0.0)
        engine.close_dispatcher()
        return {
            "shape": args.shape,
            "requests_per_round": args.pdus * (5 if args.shape == "same" else 1),
            "rounds_ms": [round(r, 2) for r in rounds_ms],
            "cpu_pct": round(100 * cpu_s / args.seconds, 2),
            "errors": errors,
        }

    return asyncio.run(run())


def _bmc_floor(args: argparse.Namespace) -> dict[str, Any]:
    """PATCH SetPoint + GET on one BMC over one keep-alive connection; each pair timed."""
    host, port = args.url.split("//", 1)[1].rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    pairs_ms: list[float] = []
    for i in range(args.count):
        body = json.dumps({"SetPoint": 1000.0 + 100 * (i % 2)}).encode()
        began = time.perf_counter()
        connection.request("PATCH", args.path, body, {"Content-Type": "application/json"})
        patched = connection.getresponse()
        patched.read()
        connection.request("GET", args.path)
        got = connection.getresponse()
        doc = json.loads(got.read())
        pairs_ms.append(1000 * (time.perf_counter() - began))
        if patched.status >= 300 or doc.get("SetPoint") != 1000.0 + 100 * (i % 2):
            msg = f"stand-in BMC: PATCH {patched.status}, read back {doc.get('SetPoint')}"
            raise RuntimeError(msg)
    connection.close()
    return {"pairs_ms": [round(p, 3) for p in pairs_ms]}


def _role_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_meter.py ROLE")
    sub = parser.add_subparsers(dest="role", required=True)
    snmp = sub.add_parser("snmp-floor")
    snmp.add_argument("--host", default="127.0.0.1")
    snmp.add_argument("--port", type=int, required=True)
    snmp.add_argument("--pdus", type=int, required=True)
    snmp.add_argument("--prefix", default="pdu")
    snmp.add_argument("--shape", choices=["get", "same"], default="get")
    snmp.add_argument("--warmup-s", type=float, default=3.0)
    snmp.add_argument("--seconds", type=float, default=30.0)
    bmc = sub.add_parser("bmc-floor")
    bmc.add_argument("--url", required=True)
    bmc.add_argument("--path", required=True)
    bmc.add_argument("--count", type=int, default=50)
    args = parser.parse_args(argv)
    result = _snmp_floor(args) if args.role == "snmp-floor" else _bmc_floor(args)
    print(json.dumps(result), flush=True)
    return 0


def _role(role: str, *args: str) -> Child:
    return Child.start([sys.executable, str(Path(__file__).resolve()), role, *args])


# --- 1. the meter ----------------------------------------------------------------------------


def _snmp_agent(workdir: Path, pdus: int) -> Any:
    """snmpsim with ``pdus`` copies of apc.snmprec, communities ``pdu000``..."""
    from tests.snmpsim import SnmpSimProcess

    class ManyPdus(SnmpSimProcess):
        start_timeout_s = 60.0

        def __init__(self, workdir: Path) -> None:
            super().__init__(workdir)
            apc = self.data_dir / "apc.snmprec"
            for i in range(pdus):
                copy = self.data_dir / f"pdu{i:03d}.snmprec"
                shutil.copyfile(apc, copy)
                copy.chmod(0o644)

    return ManyPdus(workdir)


def _meter_config(
    workdir: Path, *, broker_port: int, snmp_port: int, pdus: int, per_row: int
) -> Path:
    secrets = workdir / "communities"
    secrets.mkdir()
    rows = []
    for r in range(pdus // per_row):
        sources = []
        for s in range(per_row):
            i = r * per_row + s
            community = secrets / f"pdu{i:03d}"
            community.write_text(f"pdu{i:03d}\n", encoding="utf-8")
            sources.append(
                {
                    "protocol": "snmp",
                    "name": f"pdu-{s}",
                    "host": "127.0.0.1",
                    "port": snmp_port,
                    "community_file": str(community),
                    "timeout_s": 0.5,
                    "retries": 1,
                }
            )
        rows.append({"row": f"r{r:03d}", "sources": sources})
    config = {
        "mqtt": {"host": "127.0.0.1", "port": broker_port},
        "site": SITE,
        "interval_s": 1.0,
        "stats_every_s": 0.5,  # one round per meter_rounds line (after the first)
        "logging": {"level": "info", "format": "json"},
        "rows": rows,
    }
    path = workdir / "meter.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _rows_seen(arrivals: list[Any], rows: int, per_row: int, seconds: float) -> dict[str, Any]:
    """Per row: messages, the longest gap between two, partial and wrong readings."""
    times: dict[str, list[int]] = {}
    partial = wrong = 0
    for t_ns, topic, text in arrivals:
        row = topic.split("/")[-2]
        times.setdefault(row, []).append(t_ns)
        meter = json.loads(text)
        partial += bool(meter.get("partial"))
        wrong += not meter.get("partial") and abs(meter["power_w"] - per_row * APC_POWER_W) > 1e-6
    counts = [len(times.get(f"r{r:03d}", [])) for r in range(rows)]
    gaps = [
        (b - a) / 1e9
        for ts in times.values()
        for a, b in zip(sorted(ts), sorted(ts)[1:], strict=False)
    ]
    return {
        "rows": rows,
        "rows_heard": len(times),
        "messages": sum(counts),
        "expected_about": int(rows * seconds),
        "per_row_min": min(counts),
        "per_row_max": max(counts),
        "max_gap_s": round(max(gaps), 3) if gaps else None,
        "gaps_over_1_5_s": sum(g > 1.5 for g in gaps),
        "partial": partial,
        "wrong_power": wrong,
        "every_row_every_second": len(times) == rows
        and min(counts) >= int(seconds) - 1
        and (max(gaps) if gaps else 99) < 1.5,
    }


def _first_round(meter: Child, log_path: Path, *, timeout_s: float) -> dict[str, Any]:
    """The meter's first ``meter_rounds`` line, waiting for it and for its MQTT connection.

    Readings made before the connection are queued and sent when it comes: the window
    starts after both, so it counts no backlog.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if meter.process.poll() is not None:
            msg = f"polca meter exited: {log_path.read_text()[-2000:]}"
            raise RuntimeError(msg)
        lines = list(_json_lines(log_path))
        first = next((e for e in lines if e.get("event") == "meter_rounds"), None)
        if first is not None and any(e.get("event") == "mqtt_connected" for e in lines):
            return first
        time.sleep(0.5)
    msg = f"no meter_rounds line within {timeout_s} s"
    raise RuntimeError(msg)


def _event_s(lines: list[dict[str, Any]], event: str, since: float) -> float | None:
    hit = next((e for e in lines if e.get("event") == event), None)
    return round(_wall_s(hit["timestamp"]) - since, 2) if hit else None


def run_meter(args: argparse.Namespace, workdir: Path, broker: Any) -> dict[str, Any]:
    """Part 1: the meter process, then the floors, against one snmpsim."""
    agent = _snmp_agent(workdir / "snmpsim", args.pdus)
    agent.start()
    try:
        config = _meter_config(
            workdir,
            broker_port=broker.port,
            snmp_port=agent.port,
            pdus=args.pdus,
            per_row=args.per_row,
        )
        rows = args.pdus // args.per_row
        listen = Child.role("listen", f"--port={broker.port}", f"--topic=polca/v1/{SITE}/+/meter")
        assert listen.line().get("ready")
        log_path = workdir / "meter.log"
        meter = Child.start(
            [sys.executable, "-m", "polca", "meter", "run", "--config", str(config)],
            output=log_path,
        )
        try:
            started = time.time()
            first = _first_round(meter, log_path, timeout_s=args.startup_timeout_s)
            time.sleep(args.warmup_s)
            listen.ask("arrivals", timeout_s=60)  # forget the warm-up
            snmp_cpu0, cpu0, wall0 = proc_cpu_s(agent.pid), meter.cpu_s(), time.time()
            time.sleep(args.seconds)
            cpu_s, snmp_cpu_s = meter.cpu_s() - cpu0, proc_cpu_s(agent.pid) - snmp_cpu0
            wall1 = time.time()
            arrivals = listen.ask("arrivals", timeout_s=120)["arrivals"]
            rss_mb = meter.rss_mb()
        finally:
            meter.stop()
            stop_all([listen])
        lines = list(_json_lines(log_path))
        rounds = [
            e
            for e in lines
            if e.get("event") == "meter_rounds" and wall0 <= _wall_s(e["timestamp"]) <= wall1
        ]
        rounds_ms = [e["max_ms"] for e in rounds]  # one round per line
        failing = sorted({f for e in rounds for f in e.get("failing", [])})
        source_failures = [e for e in lines if e.get("event") == "meter_source_failed"]
        result: dict[str, Any] = {
            "pdus": args.pdus,
            "per_row": args.per_row,
            "rows": rows,
            "window_s": args.seconds,
            "startup": {
                "first_round_logged_s": round(_wall_s(first["timestamp"]) - started, 2),
                "first_rounds": first["rounds"],
                "first_max_ms": first["max_ms"],
                "mqtt_connected_s": _event_s(lines, "mqtt_connected", started),
                "source_failed_before_first_round": sum(
                    _wall_s(e["timestamp"]) <= _wall_s(first["timestamp"]) for e in source_failures
                ),
            },
            "rounds": _summary(rounds_ms),
            "rounds_per_line_max": max((e["rounds"] for e in rounds), default=0),
            "cpu_pct": round(100 * cpu_s / (wall1 - wall0), 2),
            "snmpsim_cpu_pct": round(100 * snmp_cpu_s / (wall1 - wall0), 2),
            "rss_mb": round(rss_mb, 1),
            "published": _rows_seen(arrivals, rows, args.per_row, args.seconds),
            "failing_sources": failing[:20],
            "source_failed_lines": len(source_failures),
        }
        floors = {}
        for shape in ("get", "same"):
            floor = _role(
                "snmp-floor",
                f"--port={agent.port}",
                f"--pdus={args.pdus}",
                f"--shape={shape}",
                f"--seconds={args.floor_seconds}",
            )
            t0 = time.time()
            snmp0 = proc_cpu_s(agent.pid)
            out = floor.line(timeout_s=args.floor_seconds + 120)
            snmp_pct = 100 * (proc_cpu_s(agent.pid) - snmp0) / (time.time() - t0)
            floor.stop()
            floors[shape] = {
                "requests_per_round": out["requests_per_round"],
                "rounds": _summary(out["rounds_ms"]),
                "cpu_pct": out["cpu_pct"],
                "errors": out["errors"],
                "snmpsim_cpu_pct_incl_warmup": round(snmp_pct, 2),
            }
        result["floor"] = floors
        return result
    finally:
        agent.cleanup()


# --- 2. the out-of-band cap -------------------------------------------------------------------


class BmcWatch:
    """GETs of one stand-in BMC's power control over a keep-alive connection."""

    def __init__(self, url: str, node: str) -> None:
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.connection = http.client.HTTPConnection(host, int(port), timeout=5)
        self.path = f"/redfish/v1/Chassis/{node}/Controls/NodePower"

    def limit_w(self) -> float | None:
        """The limit the BMC reports now."""
        self.connection.request("GET", self.path)
        answer = self.connection.getresponse()
        value = json.loads(answer.read()).get("SetPoint")
        return float(value) if isinstance(value, int | float) else None

    def wait_for(self, watts: float, *, timeout_s: float, every_s: float = 0.02) -> float:
        """Monotonic time at which the BMC first reported ``watts``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.limit_w() == watts:
                return time.monotonic()
            time.sleep(every_s)
        msg = f"{self.path}: limit not {watts:g} W within {timeout_s} s (now {self.limit_w()})"
        raise RuntimeError(msg)


def _kill_trials(
    args: argparse.Namespace,
    driver: RowDriver,
    agents: dict[str, Any],
    watches: dict[str, BmcWatch],
    *,
    row: str,
    high_w: float,
) -> list[dict[str, Any]]:
    """``args.kills`` trials: SIGKILL an agent at T2, wait for the cap, restart, release."""
    nodes = list(agents)
    trials: list[dict[str, Any]] = []
    for k in range(args.kills):
        node = nodes[k % len(nodes)]
        driver.meters_w[row] = high_w
        driver.wait_level(row, 2, settle_s=1.0, timeout_s=30)
        wall_kill = time.time()
        t_kill = time.monotonic()
        process = agents[node].process
        os.kill(process.pid, signal.SIGKILL)
        seen = watches[node].wait_for(FAIL_SAFE_W, timeout_s=20)
        process.wait(timeout=10)
        agents[node].start()
        driver.meters_w[row] = BUDGET_W * 0.5  # under T1's release band: level 0, release
        t_drop = time.monotonic()
        released = watches[node].wait_for(BMC_LIMIT_W, timeout_s=60, every_s=0.05)
        trials.append(
            {
                "node": node,
                "wall_kill": wall_kill,
                "bmc_seen_s": round(seen - t_kill, 3),
                "release_after_drop_s": round(released - t_drop, 3),
            }
        )
    return trials


def _from_log(trials: list[dict[str, Any]], logs: list[dict[str, Any]]) -> None:
    """Add to each trial when the aggregator logged the cap wanted and applied."""
    for trial in trials:
        after = [
            e
            for e in logs
            if e.get("node") == trial["node"] and _wall_s(e["timestamp"]) >= trial["wall_kill"]
        ]
        for event, key in (("oob_cap_wanted", "wanted_s"), ("oob_cap_applied", "oob_cap_s")):
            hit = next((e for e in after if e.get("event") == event), None)
            trial[key] = round(_wall_s(hit["timestamp"]) - trial["wall_kill"], 3) if hit else None
            if event == "oob_cap_applied" and hit:
                trial["limit_w"] = hit.get("limit_w")
                trial["write_latency_s"] = hit.get("latency_s")


def run_oob(args: argparse.Namespace, workdir: Path, broker: Any) -> dict[str, Any]:
    """Part 2: kill agents at T2, time their BMC caps."""
    from tests.fake_nvml import FakeNvml, build_fake_nvml
    from tests.integration.aggregator_rig import AggregatorProcess
    from tests.integration.rig import ROW, AgentProcess
    from tests.integration.rig import SITE as RIG_SITE
    from tests.integration.test_aggregator_e2e import _test_policy
    from tests.standins.process import RedfishStandIn

    lib = build_fake_nvml()
    nodes = [f"node{i + 1}" for i in range(args.nodes)]
    bmcs = {n: RedfishStandIn(workdir / f"bmc-{n}", devices=[f"bmc:{n}"]) for n in nodes}
    agents: dict[str, AgentProcess] = {}
    aggregator: AggregatorProcess | None = None
    driver: RowDriver | None = None
    policy = _test_policy(workdir)
    try:
        for bmc in bmcs.values():
            bmc.start()
        # The floor, before anything else writes: PATCH + GET on node1's BMC, then reset.
        floor = _role(
            "bmc-floor",
            f"--url={bmcs[nodes[0]].url}",
            f"--path=/redfish/v1/Chassis/{nodes[0]}/Controls/NodePower",
            f"--count={args.bmc_floor_count}",
        )
        pairs_ms = floor.line(timeout_s=120)["pairs_ms"]
        floor.stop()
        bmcs[nodes[0]].set_state(nodes[0], limit_w=BMC_LIMIT_W)
        for i, node in enumerate(nodes):
            (workdir / f"nvml-{node}").mkdir()
            fake = FakeNvml(
                workdir / f"nvml-{node}", gpus=8, model="NVIDIA A100-SXM4-80GB", lib_path=lib
            )
            fake.set(None)
            agents[node] = AgentProcess(
                workdir / f"agent-{node}",
                fake=fake,
                broker=broker,
                policy=policy,
                startup_grace_s=60,
                node=node,
                rack=f"rack{i + 1}",
                extra={"logging": {"level": "info"}},
            )
        aggregator = AggregatorProcess(
            workdir / "aggregator",
            broker=broker,
            policy=policy,
            racks={f"rack{i + 1}": [n] for i, n in enumerate(nodes)},
            budget_w=BUDGET_W,
            interval_s=args.control_interval_s,
            extra={
                "logging": {"level": "info"},
                "bmc": {
                    "min_write_interval_s": 0.2,
                    "agent_back_s": 0.5,
                    "nodes": {
                        n: {
                            "endpoint": {"url": bmcs[n].url, "allow_http": True},
                            "fail_safe_w": FAIL_SAFE_W,
                        }
                        for n in nodes
                    },
                },
            },
        )
        for agent in agents.values():
            agent.start()
        aggregator.start()
        asyncio.run(aggregator.wait_log("aggregator_warm", timeout_s=30))
        assert RIG_SITE
        driver = RowDriver(
            broker.port, site=RIG_SITE, meters_w={ROW: 0.0}, watch=[ROW], period_s=0.2
        )
        watches = {n: BmcWatch(bmcs[n].url, n) for n in nodes}
        trials = _kill_trials(
            args, driver, agents, watches, row=ROW, high_w=BUDGET_W * args.meter_pct / 100
        )
        logs = aggregator.logs()
        _from_log(trials, logs)
        failed = [
            e for e in logs if e.get("event", "").startswith("oob_") and "failed" in e["event"]
        ]
        caps = [t["oob_cap_s"] for t in trials if t.get("oob_cap_s") is not None]
        return {
            "nodes": len(nodes),
            "kills": len(trials),
            "control_interval_s": args.control_interval_s,
            "meter_pct": args.meter_pct,
            "oob_cap_s": _summary(caps),
            "bmc_seen_s": _summary([t["bmc_seen_s"] for t in trials]),
            "wanted_s": _summary([t["wanted_s"] for t in trials if t.get("wanted_s") is not None]),
            "write_latency_s": _summary(
                [t["write_latency_s"] for t in trials if t.get("write_latency_s") is not None]
            ),
            "oob_failed_lines": len(failed),
            "bmc_floor_ms": _summary(pairs_ms),
            "trials": trials,
        }
    finally:
        if driver is not None:
            driver.close()
        for agent in agents.values():
            agent.kill()
        if aggregator is not None:
            aggregator.kill()
        for bmc in bmcs.values():
            bmc.kill()


def main() -> int:
    """Run, print, write JSON (or run a floor role)."""
    if sys.argv[1:2] and sys.argv[1] in ("snmp-floor", "bmc-floor"):
        return _role_main(sys.argv[1:])
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pdus", type=int, default=200)
    parser.add_argument("--per-row", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--floor-seconds", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=10.0, help="after the first round")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--meter-pct", type=float, default=93.0)
    parser.add_argument("--control-interval-s", type=float, default=0.2)
    parser.add_argument("--bmc-floor-count", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="20 s window, 10 s floors, 6 kills")
    parser.add_argument("--skip", choices=["meter", "oob"], default=None)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "meter.json")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.floor_seconds, args.warmup_s, args.kills = 20.0, 10.0, 6.0, 6
    from tests.mqtt_broker import MosquittoProcess

    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="polca-bench-meter-") as tmp:
        workdir = Path(tmp)
        broker = MosquittoProcess(workdir / "mosquitto", extra_config=BROKER_CONFIG)
        broker.start()
        try:
            meter = run_meter(args, workdir, broker) if args.skip != "meter" else {}
            oob = run_oob(args, workdir, broker) if args.skip != "oob" else {}
        finally:
            broker.kill()
    figures: dict[str, Any] = {"benchmark": "meter", "quick": args.quick}
    if meter:
        floor = meter["floor"]
        figures.update(
            pdus=meter["pdus"],
            poll_p50_ms=meter["rounds"]["p50"],
            poll_p99_ms=meter["rounds"]["p99"],
            cpu_pct=meter["cpu_pct"],
            every_row_every_second=meter["published"]["every_row_every_second"],
            floor_get_p99_ms=floor["get"]["rounds"]["p99"],
            floor_get_cpu_pct=floor["get"]["cpu_pct"],
            floor_same_p99_ms=floor["same"]["rounds"]["p99"],
            floor_same_cpu_pct=floor["same"]["cpu_pct"],
        )
    if oob:
        figures.update(
            oob_cap_p50_s=oob["oob_cap_s"].get("p50"),
            oob_cap_p99_s=oob["oob_cap_s"].get("p99"),
            oob_cap_max_s=oob["oob_cap_s"].get("max"),
            bmc_latency_ms=oob["bmc_floor_ms"].get("p50"),
        )
    figures["meter"], figures["oob"] = meter, oob
    figures["run_s"] = round(time.monotonic() - began, 1)
    _print(figures)
    write_result(args.out, figures)
    return 0


def _print(figures: dict[str, Any]) -> None:
    meter, oob = figures["meter"], figures["oob"]
    if meter:
        floor = meter["floor"]
        print(
            f"meter: {meter['pdus']} SNMP PDUs, {meter['rows']} rows, 1 Hz, "
            f"{meter['window_s']:g} s window"
        )
        print(f"{'(round ms)':<44}{'p50':>8}{'p99':>8}{'max':>8}{'CPU %':>8}")
        for label, rounds, cpu in (
            ("polca meter run (meter_rounds lines)", meter["rounds"], meter["cpu_pct"]),
            ("floor: bare pysnmp, 1 GET per PDU", floor["get"]["rounds"], floor["get"]["cpu_pct"]),
            (
                "floor: bare pysnmp, the APC profile's 5 requests/PDU",
                floor["same"]["rounds"],
                floor["same"]["cpu_pct"],
            ),
        ):
            print(f"{label:<44}{rounds['p50']:>8}{rounds['p99']:>8}{rounds['max']:>8}{cpu:>8}")
        seen = meter["published"]
        print(
            f"rows heard {seen['rows_heard']}/{seen['rows']}, messages {seen['messages']} "
            f"(~{seen['expected_about']}), per row {seen['per_row_min']}-{seen['per_row_max']}, "
            f"longest gap {seen['max_gap_s']} s, partial {seen['partial']}, "
            f"wrong power (whole readings) {seen['wrong_power']}; "
            f"snmpsim CPU {meter['snmpsim_cpu_pct']} %"
        )
        up = meter["startup"]
        print(
            f"startup: first round logged {up['first_round_logged_s']} s after start "
            f"(it took {up['first_max_ms'] / 1000:.1f} s), MQTT connected at "
            f"{up['mqtt_connected_s']} s, {up['source_failed_before_first_round']} sources "
            f"failed in it; RSS {meter['rss_mb']} MiB"
        )
    if oob:
        print(f"out-of-band cap: {oob['kills']} SIGKILLs over {oob['nodes']} nodes at T2")
        print(f"{'(s from the kill)':<44}{'p50':>8}{'p99':>8}{'max':>8}")
        for label, key in (
            ("oob_cap_applied logged (verified)", "oob_cap_s"),
            ("BMC reports fail_safe_w (our 20 ms poll)", "bmc_seen_s"),
            ("oob_cap_wanted logged", "wanted_s"),
            ("write: wanted -> verified (its latency_s)", "write_latency_s"),
        ):
            s = oob[key]
            print(f"{label:<44}{s.get('p50', '-'):>8}{s.get('p99', '-'):>8}{s.get('max', '-'):>8}")
        f = oob["bmc_floor_ms"]
        print(f"floor: PATCH + GET on a stand-in BMC, median {f['p50']} ms (p99 {f['p99']} ms)")


if __name__ == "__main__":
    raise SystemExit(main())
