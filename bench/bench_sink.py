"""The InfluxDB sink: encoding speed, and points/s into a real database next to raw POSTs.

Three figures, each in its own process, against VictoriaMetrics and InfluxDB 1.x started
here on loopback (the database in its own process too):

- ``encode_points_per_s``: per-GPU points encoded to line protocol (``SeriesPoint.encode``,
  the sink's hot path; ``build_encode_points_per_s`` includes making the points from
  decoded telemetry, ``point_encode_points_per_s`` is the general ``Point.encode``);
- ``sink_points_per_s``: the sink end to end (``InfluxSink.write`` of the points of 8-GPU
  telemetry messages, encoding, batching of 5,000, the HTTP writes) until the database
  has acknowledged every point;
- ``raw_post_points_per_s``: the floor: the same line protocol, encoded beforehand, POSTed
  in batches of 5,000 on one kept-alive connection by a process that does nothing else.

Target: encoding at most 4 µs per GPU point (250,000 points/s). Run from the repository
root:

    .venv/bin/python bench/bench_sink.py [--points 50000] [--trials 3] [--encode-runs 5]

It prints a table and writes ``bench/results/sink.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.benchkit import Child, median, write_result  # noqa: E402

TARGET_ENCODE_US = 4.0
BATCH = 5_000
NODES = 625  # x 8 GPUs = 5,000 points per round of messages


def _telemetry(points: int) -> list[Any]:
    """Decoded 8-GPU telemetry messages, ``points`` GPU points in all, all series distinct."""
    from bench.benchkit import telemetry_payloads

    from polca.telemetry.schema import Telemetry, decode

    base = [
        decode(p, Telemetry)
        for _, p in telemetry_payloads(site="s", row="r", racks=25, nodes_per_rack=NODES // 25)
    ]
    start_ns = time.time_ns() - 3_600 * 10**9
    rounds = -(-points // (8 * len(base)))
    messages = [
        m.model_copy(update={"ts_ns": start_ns + i * 10**9}) for i in range(rounds) for m in base
    ]
    return messages[: points // 8]


def _points(messages: list[Any]) -> list[Any]:
    from polca.export.gpus import gpu_points

    return [p for m in messages for p in gpu_points(m, site="s", row="r", rack="k1")]


def _realistic(points: list[Any]) -> list[Any]:
    """The points with readings as an agent sends them: the mean power of mW samples
    (a full-precision float), mW- and mJ-resolution readings, whole degrees and percent.

    The bench's messages carry round values (480.0), which format faster than real ones.
    """
    import random

    rng = random.Random(7)
    mean_ms = {"power_w"}
    milli = {"power_max_w", "power_avg_w", "energy_j", "energy_delta_j"}
    out = []
    for p in points:
        values = []
        for name, value in zip(p.template.field_names, p.values, strict=True):
            v = value
            if isinstance(v, float) and name in mean_ms:
                v = sum(rng.randrange(300_000, 700_000) for _ in range(10)) / 10 / 1000
            elif isinstance(v, float) and name in milli:
                v = round(v * (0.9 + 0.2 * rng.random()), 3)
            values.append(v)
        out.append(p._replace(values=tuple(values)))
    return out


def _encode(args: argparse.Namespace) -> dict[str, Any]:
    """Encoding only, in this process: the best of ``trials`` passes over every point."""
    from polca.export.points import Point

    messages = _telemetry(args.points)
    points = _points(messages)
    plain = [Point(p.measurement, p.tags, p.fields, p.ts_ns) for p in points]
    realistic = _realistic(points)

    def best(run: Any) -> float:
        times = []
        for _ in range(args.trials):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        return len(points) / min(times)

    return {
        "encode_points_per_s": round(best(lambda: [p.encode("ms") for p in points])),
        "encode_realistic_points_per_s": round(best(lambda: [p.encode("ms") for p in realistic])),
        "build_encode_points_per_s": round(
            best(lambda: [p.encode("ms") for p in _points(messages)])
        ),
        "point_encode_points_per_s": round(best(lambda: [p.encode("ms") for p in plain])),
        "line_bytes": round(sum(len(p.to_line("ms")) for p in points[:1000]) / 1000),
    }


def _sink(args: argparse.Namespace) -> dict[str, Any]:
    """The sink, end to end: write every message's points, wait for every acknowledgement."""
    import asyncio

    from polca import logs
    from polca.export.gpus import gpu_points
    from polca.export.influx import make_sink
    from polca.settings import InfluxSettings

    logs.configure(level="error", fmt="json", stream=sys.stderr)
    messages = _telemetry(args.points)
    settings = InfluxSettings(
        url=args.url,
        api=args.api,
        database=args.database,
        bucket=args.database,
        batch_size=BATCH,
    )

    async def run() -> dict[str, Any]:
        sink = make_sink(settings, state_dir=Path(args.state_dir))
        assert sink is not None
        task = asyncio.create_task(sink.run())
        start = time.perf_counter()
        for i, message in enumerate(messages):
            sink.write(gpu_points(message, site="s", row="r", rack="k1"))
            if i % 64 == 63:
                await asyncio.sleep(0)  # as the aggregator's loop lets the sink send
        total = 8 * len(messages)
        while sink.stats.points_written < total:
            if time.perf_counter() - start > 300:
                break
            await asyncio.sleep(0.001)
        elapsed = time.perf_counter() - start
        stats = sink.stats
        await sink.close(10)
        task.cancel()
        return {
            "points": total,
            "written": stats.points_written,
            "dropped": stats.points_dropped,
            "seconds": elapsed,
            "points_per_s": stats.points_written / elapsed,
        }

    return asyncio.run(run())


def _raw(args: argparse.Namespace) -> dict[str, Any]:
    """The floor: pre-encoded batches POSTed on one kept-alive connection."""
    import http.client
    import urllib.parse

    points = _points(_telemetry(args.points))
    bodies = [
        "\n".join(p.to_line("ms") for p in points[i : i + BATCH]).encode()
        for i in range(0, len(points), BATCH)
    ]
    url = urllib.parse.urlsplit(args.url)
    if args.api == "v1":
        path = f"/write?db={args.database}&precision=ms"
    else:
        path = f"/api/v2/write?bucket={args.database}&org=-&precision=ms"
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    start = time.perf_counter()
    for body in bodies:
        connection.request("POST", path, body=body)
        response = connection.getresponse()
        response.read()
        if response.status != 204:
            msg = f"raw POST answered {response.status}"
            raise RuntimeError(msg)
    elapsed = time.perf_counter() - start
    return {"points": len(points), "seconds": elapsed, "points_per_s": len(points) / elapsed}


def role(argv: list[str]) -> int:
    """``python bench/bench_sink.py --role encode|sink|raw ...``: one JSON line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", required=True, choices=["encode", "sink", "raw"])
    parser.add_argument("--points", type=int, default=50_000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--url", default="")
    parser.add_argument("--api", default="v2")
    parser.add_argument("--database", default="polca")
    parser.add_argument("--state-dir", default="")
    args = parser.parse_args(argv)
    result = {"encode": _encode, "sink": _sink, "raw": _raw}[args.role](args)
    print(json.dumps(result), flush=True)
    return 0


def _child(*args: str) -> dict[str, Any]:
    child = Child.start([sys.executable, str(Path(__file__).resolve()), *args])
    try:
        return child.line(timeout_s=600)
    finally:
        child.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Encoding, then each database: raw floor and sink, alternating, ``trials`` times."""
    from tests.tsdb import InfluxDB1Process, VictoriaMetricsProcess

    # Encoding is CPU-bound and this kind of machine is shared: each run is its own
    # process (best of ``trials`` passes), and the figures are the median of the runs.
    encodes = [
        _child("--role=encode", f"--points={args.points}", f"--trials={args.trials}")
        for _ in range(args.encode_runs)
    ]
    encode: dict[str, Any] = {key: round(median([e[key] for e in encodes])) for key in encodes[0]}
    encode["encode_runs"] = encodes
    targets: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="polca-bench-sink-") as tmp:
        workdir = Path(tmp)
        for name, make, api in (
            ("victoria_metrics", VictoriaMetricsProcess, "v2"),
            ("influxdb1", InfluxDB1Process, "v1"),
        ):
            db = make(workdir / name)
            db.start()
            try:
                database = getattr(db, "database", "polca")
                common = [f"--url={db.url}", f"--api={api}", f"--database={database}"]
                raws, sinks = [], []
                for trial in range(args.trials):
                    raws.append(_child("--role=raw", f"--points={args.points}", *common))
                    state = workdir / f"{name}-state-{trial}"
                    state.mkdir()
                    sinks.append(
                        _child(
                            "--role=sink",
                            f"--points={args.points}",
                            f"--state-dir={state}",
                            *common,
                        )
                    )
            finally:
                db.kill()
            raw_rate = median([r["points_per_s"] for r in raws])
            sink_rate = median([s["points_per_s"] for s in sinks])
            targets[name] = {
                "raw_post_points_per_s": round(raw_rate),
                "sink_points_per_s": round(sink_rate),
                "ratio": round(sink_rate / raw_rate, 3),
                "dropped": sum(s["dropped"] for s in sinks),
                "unwritten": sum(s["points"] - s["written"] for s in sinks),
                "raw_runs": raws,
                "sink_runs": sinks,
            }
    first = targets["victoria_metrics"]
    return {
        "benchmark": "sink",
        "points": args.points,
        "batch_size": BATCH,
        "trials": args.trials,
        **encode,
        "encode_us_per_point": round(1e6 / encode["encode_points_per_s"], 2),
        "build_encode_us_per_point": round(1e6 / encode["build_encode_points_per_s"], 2),
        "encode_realistic_us_per_point": round(1e6 / encode["encode_realistic_points_per_s"], 2),
        "target_encode_us": TARGET_ENCODE_US,
        "sink_points_per_s": first["sink_points_per_s"],
        "raw_post_points_per_s": first["raw_post_points_per_s"],
        "targets": targets,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def main() -> int:
    """Run, print, write bench/results/sink.json."""
    if "--role" in " ".join(sys.argv[1:]):
        return role(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", type=int, default=50_000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument(
        "--encode-runs", type=int, default=5, help="encoding processes (median reported)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sink.json")
    args = parser.parse_args()
    result = run(args)
    write_result(args.out, result)
    print(
        f"encoding: {result['encode_us_per_point']} µs per GPU point "
        f"({result['encode_realistic_us_per_point']} µs with an agent's readings) "
        f"({result['encode_points_per_s']:,} points/s; with building the points "
        f"{result['build_encode_us_per_point']} µs; general Point "
        f"{1e6 / result['point_encode_points_per_s']:.2f} µs); target <= {TARGET_ENCODE_US} µs"
    )
    runs = result["encode_runs"]
    spread = sorted(1e6 / r["encode_realistic_points_per_s"] for r in runs)
    print(
        f"  median of {len(runs)} encoding processes; an agent's readings "
        f"{spread[0]:.2f} to {spread[-1]:.2f} µs"
    )
    print(f"{'points/s, median of ' + str(args.trials):34} {'raw POST':>10} {'sink':>10} ratio")
    for name, t in result["targets"].items():
        print(
            f"{name:34} {t['raw_post_points_per_s']:>10,} {t['sink_points_per_s']:>10,} "
            f"{t['ratio']:.2f}  (dropped {t['dropped']}, unwritten {t['unwritten']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
