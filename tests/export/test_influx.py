"""The InfluxDB sink against real databases: batching, outages, the spool, bad data, close."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from polca.aggregator import points
from polca.errors import BatchRejectedError, ConfigError, FatalError, InfluxUnavailableError
from polca.export import spool
from polca.export.gpus import gpu_health_points, gpu_points
from polca.export.influx import InfluxSink, resolve_token
from polca.export.points import AnyPoint, Point
from polca.export.sink import MemorySink, Sink
from polca.export.transport import classify_status
from polca.settings import InfluxSettings
from polca.telemetry.schema import Event, GpuHealthReport, GpuTelemetry, Telemetry
from tests.mqtt_broker import free_port
from tests.tsdb import InfluxDB1Process, VictoriaMetricsProcess

BASE_NS = (time.time_ns() // 1_000_000_000 - 3600) * 1_000_000_000  # an hour ago, whole s
BASE_MS = BASE_NS // 1_000_000
ROOT = Path(__file__).resolve().parents[2]


def _settings(url: str, **overrides: Any) -> InfluxSettings:
    """Fast settings for tests: short intervals and retries."""
    values: dict[str, Any] = {
        "url": url,
        "api": "v2",
        "batch_size": 100,
        "flush_interval_s": 0.1,
        "retry_min_s": 0.05,
        "retry_max_s": 0.2,
        "timeout_s": 2.0,
    }
    values.update(overrides)
    return InfluxSettings(**values)


def _row_points(start: int, count: int, *, row: str = "r1") -> list[Point]:
    """``count`` row points, one millisecond apart, power_w equal to their index."""
    return [
        points.row_point(
            ts_ns=BASE_NS + i * 1_000_000, site="s1", row=row, power_w=float(i), level=1
        )
        for i in range(start, start + count)
    ]


@asynccontextmanager
async def _running(sink: InfluxSink, *, close_timeout_s: float = 5.0) -> AsyncIterator[None]:
    """Run the sink for the block; close it (bounded) afterwards."""
    task = asyncio.create_task(sink.run(), name="sink")
    try:
        yield
    finally:
        await sink.close(close_timeout_s)
        await asyncio.wait_for(task, 2.0)


async def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll until the predicate holds, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.02)


def _dead_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


def _vm_count(vm: VictoriaMetricsProcess, name: str = "row_power_w") -> int:
    return vm.count(f'{{__name__="{name}"}}')


def _settled(sink: InfluxSink, total: int) -> Callable[[], bool]:
    """Whether the sink has accounted for ``total`` points: written, or dropped and counted."""
    return lambda: sink.stats.points_written + sink.stats.points_dropped == total


def _lines(start: int, count: int) -> list[bytes]:
    """The line protocol of ``_row_points(start, count)``, as the sink spools it."""
    return [p.to_line().encode() for p in _row_points(start, count)]


def _legacy_segment(spool_dir: Path, seq: int, lines: list[bytes]) -> Path:
    """A segment as polca spooled before checksums: ``<seq>-<points>.lp``, plain lines."""
    spool_dir.mkdir(parents=True, exist_ok=True)
    path = spool_dir / f"{seq:016d}-{len(lines)}.lp"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


async def test_v2_writes_gpu_and_row_points_to_victoria_metrics(
    victoria_metrics: VictoriaMetricsProcess,
) -> None:
    """influxdb-client's v2 write path lands every value in VictoriaMetrics."""
    gpus = tuple(
        GpuTelemetry(
            index=i,
            uuid=f"GPU-{i}",
            name="NVIDIA H100 80GB HBM3",
            priority_class="low",
            power_mean_w=300.0 + i,
            gpu_temp_c=60.0 + i,
            clock_event_reasons=4,
        )
        for i in range(8)
    )
    telemetry = Telemetry(
        ts_ns=BASE_NS,
        seq=1,
        node="n01",
        interval_s=1.0,
        node_gpu_power_w=2428.0,
        node_energy_delta_j=2428.0,
        gpus=gpus,
    )
    sink = InfluxSink(_settings(victoria_metrics.url))
    async with _running(sink):
        sink.write(gpu_points(telemetry, site="s1", row="r1", rack="k1"))
        sink.write(_row_points(0, 250))
        await _until(lambda: sink.stats.points_written == 258)
    power = victoria_metrics.export('{__name__="gpu_power_w"}')
    by_index = {s["metric"]["gpu_index"]: s["values"] for s in power}
    assert by_index == {str(i): [300.0 + i] for i in range(8)}
    assert power[0]["metric"]["model"] == "NVIDIA H100 80GB HBM3"
    assert power[0]["timestamps"] == [BASE_NS // 1_000_000]
    reasons = victoria_metrics.export('{__name__="gpu_clock_event_reasons"}')
    assert {v for s in reasons for v in s["values"]} == {4}
    (row,) = victoria_metrics.export('{__name__="row_power_w"}')
    assert row["values"] == [float(i) for i in range(250)]
    assert sink.stats.points_dropped == 0


async def test_v1_writes_to_influxdb(influxdb1: InfluxDB1Process) -> None:
    """The v1 /write path lands every point in InfluxDB 1.x."""
    sink = InfluxSink(_settings(influxdb1.url, api="v1", database=influxdb1.database))
    async with _running(sink):
        sink.write(_row_points(0, 1234))
        await _until(lambda: sink.stats.points_written == 1234)
    assert influxdb1.count("row", "power_w") == 1234
    series = influxdb1.query('SELECT last("power_w") FROM "row"')
    assert series[0]["values"][0][1] == 1233.0


async def test_batch_goes_out_when_full(victoria_metrics: VictoriaMetricsProcess) -> None:
    """A full batch is written at once, a partial one waits for the flush interval."""
    sink = InfluxSink(_settings(victoria_metrics.url, batch_size=100, flush_interval_s=30.0))
    async with _running(sink):
        sink.write(_row_points(0, 150))
        await _until(lambda: sink.stats.points_written == 100, timeout_s=5.0)
        await asyncio.sleep(0.3)
        assert sink.stats.points_written == 100
        assert sink.stats.points_buffered == 50
    assert sink.stats.points_written == 150  # close flushed the rest
    assert _vm_count(victoria_metrics) == 150


async def test_partial_batch_goes_out_after_flush_interval(
    victoria_metrics: VictoriaMetricsProcess,
) -> None:
    """A few points are written flush_interval_s after they arrived, not before."""
    sink = InfluxSink(_settings(victoria_metrics.url, batch_size=1000, flush_interval_s=0.5))
    async with _running(sink):
        started = time.monotonic()
        sink.write(_row_points(0, 10))
        await asyncio.sleep(0.25)
        assert sink.stats.points_written == 0
        await _until(lambda: sink.stats.points_written == 10, timeout_s=5.0)
        assert time.monotonic() - started >= 0.45
    assert _vm_count(victoria_metrics) == 10


async def _write_steadily(
    sink: InfluxSink, *, total: int, per_tick: int, tick_s: float, during: Callable[[int], Any]
) -> None:
    """Write ``total`` points, ``per_tick`` every ``tick_s``; call ``during(tick)`` each tick."""
    written = 0
    tick = 0
    while written < total:
        count = min(per_tick, total - written)
        sink.write(_row_points(written, count))
        written += count
        await during(tick)
        tick += 1
        await asyncio.sleep(tick_s)


def _outage_script(
    database: InfluxDB1Process | VictoriaMetricsProcess, *, stop_at: int, start_at: int
) -> Callable[[int], Any]:
    async def during(tick: int) -> None:
        if tick == stop_at:
            await asyncio.to_thread(database.stop)
        elif tick == start_at:
            await asyncio.to_thread(database.start)

    return during


@pytest.mark.parametrize("spool", [True, False], ids=["spool", "memory"])
async def test_outage_loses_nothing_victoria_metrics(
    victoria_metrics: VictoriaMetricsProcess, tmp_path: Path, spool: bool
) -> None:
    """VictoriaMetrics stopped for 2 s under steady writes: every point arrives afterwards."""
    settings = _settings(victoria_metrics.url, spool_dir=tmp_path / "spool" if spool else None)
    total = 1500
    with capture_logs() as logs:
        sink = InfluxSink(settings)
        async with _running(sink):
            await _write_steadily(
                sink,
                total=total,
                per_tick=50,
                tick_s=0.1,
                during=_outage_script(victoria_metrics, stop_at=5, start_at=25),
            )
            await _until(lambda: sink.stats.points_written == total)
    stats = sink.stats
    assert stats.points_dropped == 0
    assert stats.write_errors > 0
    assert (stats.points_spooled > 0) is spool
    assert _vm_count(victoria_metrics) == total
    events = [e["event"] for e in logs]
    assert events.count("influx_unreachable") == 1
    (recovered,) = [e for e in logs if e["event"] == "influx_recovered"]
    assert recovered["outage_s"] > 1.0
    assert recovered["points_replayed"] > 0


async def test_outage_loses_nothing_influxdb1(influxdb1: InfluxDB1Process, tmp_path: Path) -> None:
    """InfluxDB 1.x stopped for 2 s under steady writes: the count matches exactly."""
    settings = _settings(
        influxdb1.url, api="v1", database=influxdb1.database, spool_dir=tmp_path / "spool"
    )
    total = 1500
    sink = InfluxSink(settings)
    async with _running(sink):
        await _write_steadily(
            sink,
            total=total,
            per_tick=50,
            tick_s=0.1,
            during=_outage_script(influxdb1, stop_at=5, start_at=25),
        )
        await _until(lambda: sink.stats.points_written == total)
    assert sink.stats.points_dropped == 0
    assert sink.stats.points_spooled > 0
    assert influxdb1.count("row", "power_w") == total


async def test_spool_survives_a_sink_restart(
    victoria_metrics: VictoriaMetricsProcess, tmp_path: Path
) -> None:
    """Points spooled at close while the database is down arrive from the next sink."""
    settings = _settings(victoria_metrics.url, spool_dir=tmp_path / "spool")
    await asyncio.to_thread(victoria_metrics.stop)
    first = InfluxSink(settings)
    async with _running(first, close_timeout_s=2.0):
        first.write(_row_points(0, 250))
        await _until(lambda: first.in_outage)
        first.write(_row_points(250, 30))
    assert first.stats.spool_points == 280
    assert first.stats.points_written == 0
    assert sorted(p.name for p in (tmp_path / "spool").iterdir() if p.suffix == ".lpc")

    await asyncio.to_thread(victoria_metrics.start)
    with capture_logs() as logs:
        second = InfluxSink(settings)
        async with _running(second):
            await _until(lambda: second.stats.points_written == 280)
    assert second.stats.spool_points == 0
    assert not [p for p in (tmp_path / "spool").iterdir() if p.suffix == ".lpc"]
    assert _vm_count(victoria_metrics) == 280
    assert any(e["event"] == "influx_spool_found" for e in logs)


async def test_spool_start_skips_debris_and_unreadable_segments(
    victoria_metrics: VictoriaMetricsProcess, tmp_path: Path
) -> None:
    """A crash's .tmp file is deleted, an unreadable segment counted, the rest replayed."""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    body = b"\n".join(p.to_line().encode() for p in _row_points(0, 40)) + b"\n"
    (spool_dir / "0000000000000001-40.lp").write_bytes(body)
    (spool_dir / "0000000000000002-40.lp.tmp").write_bytes(body[:100])
    (spool_dir / "0000000000000000-5.lp").mkdir()  # cannot be read as a file
    with capture_logs() as logs:
        sink = InfluxSink(_settings(victoria_metrics.url, spool_dir=spool_dir))
        async with _running(sink):
            await _until(lambda: sink.stats.points_written == 40)
    assert sink.stats.dropped == {"spool_unreadable": 5}
    assert not (spool_dir / "0000000000000002-40.lp.tmp").exists()
    assert _vm_count(victoria_metrics) == 40
    assert any(e["event"] == "influx_points_dropped" for e in logs)


async def test_spool_bound_drops_oldest_and_keeps_newest(
    victoria_metrics: VictoriaMetricsProcess, tmp_path: Path
) -> None:
    """Past spool_max_mb the oldest segments go (counted); the newest are delivered."""
    batch = 100
    segment_bytes = len(spool.encode_segment(_lines(1000, batch)))  # all of the same size
    settings = _settings(
        _dead_url(),
        batch_size=batch,
        spool_dir=tmp_path / "spool",
        spool_max_mb=3.5 * segment_bytes / 2**20,  # room for three segments
    )
    with capture_logs() as logs:
        sink = InfluxSink(settings)
        async with _running(sink, close_timeout_s=2.0):
            for start in range(0, 1000, batch):  # ten segments, 1000..1099 style indices
                sink.write(_row_points(1000 + start, batch))
                await _until(lambda: sink.stats.points_buffered == 0)
    stats = sink.stats
    assert stats.spool_points == 300
    assert stats.dropped == {"spool_full": 700}
    assert stats.points_dropped == 700
    assert any(e["event"] == "influx_points_dropped" and e["reason"] == "spool_full" for e in logs)

    replay = InfluxSink(_settings(victoria_metrics.url, spool_dir=tmp_path / "spool"))
    async with _running(replay):
        await _until(lambda: replay.stats.points_written == 300)
    (row,) = victoria_metrics.export('{__name__="row_power_w"}')
    assert row["values"] == [float(i) for i in range(1700, 2000)]


async def test_bad_data_is_dropped_not_retried(influxdb1: InfluxDB1Process) -> None:
    """A 400 (field type conflict) drops that batch once, logged once; later data flows."""
    settings = _settings(influxdb1.url, api="v1", database=influxdb1.database, batch_size=10)
    as_float = Point("m", {"site": "s"}, {"value": 1.5}, BASE_NS)
    with capture_logs() as logs:
        sink = InfluxSink(settings)
        async with _running(sink):
            sink.write([as_float])
            await _until(lambda: sink.stats.points_written == 1)
            for count in (1, 2):  # the same field as an integer: InfluxDB refuses it
                sink.write([Point("m", {"site": "s"}, {"value": 7}, BASE_NS + count * 10**6)])
                await _until(lambda: sink.stats.points_rejected == count)  # noqa: B023
            sink.write(_row_points(0, 5))
            await _until(lambda: sink.stats.points_written == 6)
            await asyncio.sleep(0.3)
    stats = sink.stats
    assert stats.points_rejected == 2
    assert stats.dropped == {"rejected": 2}
    assert stats.write_errors == 2
    assert not sink.in_outage
    assert influxdb1.count("m", "value") == 1
    assert influxdb1.count("row", "power_w") == 5
    rejected = [e for e in logs if e["event"] == "influx_batch_rejected"]
    assert len(rejected) == 1
    assert rejected[0]["status"] == 400


async def test_partial_write_counts_a_field_type_conflict_per_point(
    influxdb1: InfluxDB1Process,
) -> None:
    """InfluxDB 1.6 keeps 4 of 6 points and says dropped=2: 4 written, 2 rejected."""
    influxdb1.write(b"m,site=s value=1.5 %d" % BASE_MS)  # the field is a float from now on
    settings = _settings(influxdb1.url, api="v1", database=influxdb1.database, batch_size=6)
    sink = InfluxSink(settings)
    async with _running(sink):
        sink.write(
            [
                Point("m", {"site": "s"}, {"value": 7 if i in (2, 4) else 1.5}, BASE_NS + i * 10**6)
                for i in range(1, 7)
            ]
        )
        await _until(lambda: sink.stats.points_written + sink.stats.points_rejected == 6)
    assert (sink.stats.points_written, sink.stats.points_rejected) == (4, 2)
    assert sink.stats.dropped == {"rejected": 2}
    assert influxdb1.count("m", "value") == 1 + 4


async def test_partial_write_counts_the_lines_influxdb_could_not_parse(
    influxdb1: InfluxDB1Process, tmp_path: Path
) -> None:
    """InfluxDB 1.6 says dropped=0 for lines it cannot parse; they count as rejected anyway."""
    lines = _lines(0, 10)
    lines[3] = b"row,row=r1,site=s1 power_w= %d" % (BASE_MS + 3)  # no value
    lines[7] = b"row,row=r1,site=s1 power_w=7.0.0 %d" % (BASE_MS + 7)  # no number
    _legacy_segment(tmp_path / "spool", 1, lines)  # the one way such lines reach the sink
    settings = _settings(
        influxdb1.url, api="v1", database=influxdb1.database, spool_dir=tmp_path / "spool"
    )
    with capture_logs() as logs:
        sink = InfluxSink(settings)
        async with _running(sink):
            await _until(_settled(sink, 10))
    assert influxdb1.count("row", "power_w") == 8
    assert (sink.stats.points_written, sink.stats.points_rejected) == (8, 2)
    assert sink.stats.dropped == {"rejected": 2}
    (rejected,) = [e for e in logs if e["event"] == "influx_batch_rejected"]
    assert rejected["points"] == 2
    assert rejected["kind"] == "400:partial write: unable to parse"


def _influx_error(body: bytes) -> str:
    message: str = json.loads(body)["error"]
    return message


def test_influxdb_1_6_partial_write_answers_name_what_was_lost(
    influxdb1: InfluxDB1Process,
) -> None:
    """What InfluxDB 1.6.7 answers to partly bad batches, and what the sink makes of it."""
    influxdb1.write(b"typed value=1.5 %d" % BASE_MS)
    good = [b"m value=%d.5 %d" % (i, BASE_MS + i) for i in range(5)]
    conflict = [b"typed value=%di %d" % (i, BASE_MS + i) for i in range(5)]  # same shard
    cases = [  # lines; the answer's dropped=N; points the sink counts as lost; points stored
        ([good[0], b"m value= 2", good[2]], 0, 1, 2),
        ([b"m value=", good[1], b"m =1.0 2", b"m value=1.0 x"], 0, 3, 1),
        ([good[0], conflict[1], conflict[2], good[3]], 2, 2, 2),
        # A type conflict hides the unparsable line: the answer names one point, two are lost.
        ([good[0], conflict[3], b"m value= 5"], 1, 1, 1),
    ]
    for index, (lines, dropped, counted, stored) in enumerate(cases):
        measurement = b"p%d " % index
        status, answer = influxdb1.post(b"\n".join(x.replace(b"m ", measurement) for x in lines))
        message = _influx_error(answer)
        assert status == 400, message
        assert message.startswith("partial write: "), message
        assert message.endswith(f" dropped={dropped}"), message
        error = classify_status(status, message)
        assert isinstance(error, BatchRejectedError)
        assert error.dropped_points == counted, message
        assert influxdb1.count(f"p{index}", "value") == stored
    status, answer = influxdb1.post(b"q value= 1\nq value= 2")  # nothing parses
    assert status == 400
    nothing = classify_status(status, _influx_error(answer))
    assert isinstance(nothing, BatchRejectedError)
    assert nothing.dropped_points is None  # the whole batch


async def test_victoria_metrics_skips_a_bad_line_and_still_says_204(
    victoria_metrics: VictoriaMetricsProcess, tmp_path: Path
) -> None:
    """VictoriaMetrics logs an unparsable line and answers 204: the sink cannot count it."""
    lines = _lines(0, 10)
    lines[5] = b"row,row=r1,site=s1 power_w= %d" % (BASE_MS + 5)
    _legacy_segment(tmp_path / "spool", 1, lines)
    sink = InfluxSink(_settings(victoria_metrics.url, spool_dir=tmp_path / "spool"))
    async with _running(sink):
        await _until(_settled(sink, 10))
    assert sink.stats.points_written == 10  # what the answer said
    assert sink.stats.points_dropped == 0
    assert _vm_count(victoria_metrics) == 9  # what arrived
    assert "cannot unmarshal InfluxDB line" in victoria_metrics.log_tail()


async def test_torn_spool_segments_replay_their_good_records_with_their_own_times(
    influxdb1: InfluxDB1Process, tmp_path: Path
) -> None:
    """A segment cut mid-record and one with a flipped bit: the rest replays, 2 are counted."""
    spool_dir = tmp_path / "spool"
    v1 = {"api": "v1", "database": influxdb1.database, "spool_dir": spool_dir}
    first = InfluxSink(_settings(_dead_url(), **v1))
    async with _running(first, close_timeout_s=1.0):
        first.write(_row_points(0, 250))  # three segments: 100, 100 and 50 points
        await _until(lambda: first.stats.spool_points == 250)
    segments = sorted(spool_dir.glob("*.lpc"))
    assert [s.name.split("-")[1] for s in segments] == ["100.lpc", "100.lpc", "50.lpc"]
    middle = bytearray(segments[1].read_bytes())
    middle[middle.index(b"power_w=150.0") + len(b"power_w=")] ^= 0x01  # "150" -> "050"
    segments[1].write_bytes(middle)
    last = segments[2].read_bytes()
    segments[2].write_bytes(last[: len(last) - 12])  # into the last record's timestamp

    with capture_logs() as logs:
        second = InfluxSink(_settings(influxdb1.url, **v1))
        async with _running(second):
            await _until(_settled(second, 250))
    assert second.stats.points_written == 248
    assert second.stats.dropped == {"spool_corrupt": 2}
    (series,) = influxdb1.query('SELECT "power_w" FROM "row"')
    assert [row[0] for row in series["values"]] == [
        BASE_MS + i for i in range(250) if i not in (150, 249)
    ]
    assert [row[1] for row in series["values"]] == [
        float(i) for i in range(250) if i not in (150, 249)
    ]
    dropped = [e for e in logs if e["event"] == "influx_points_dropped"]
    assert [(e["reason"], e["points"]) for e in dropped] == [("spool_corrupt", 1)]  # a minute


async def test_old_format_segment_cut_mid_line_is_counted_not_stamped_now(
    influxdb1: InfluxDB1Process, tmp_path: Path
) -> None:
    """A plain .lp segment cut before its last timestamp: that line is counted, never sent."""
    path = _legacy_segment(tmp_path / "spool", 1, _lines(0, 20))
    data = path.read_bytes()
    path.write_bytes(data[: data.rindex(b" ")])  # "... power_w=19.0" without its time
    settings = _settings(
        influxdb1.url, api="v1", database=influxdb1.database, spool_dir=tmp_path / "spool"
    )
    sink = InfluxSink(settings)
    async with _running(sink):
        await _until(_settled(sink, 20))
    assert sink.stats.points_written == 19
    assert sink.stats.dropped == {"spool_corrupt": 1}
    (series,) = influxdb1.query('SELECT "power_w" FROM "row"')
    assert [row[0] for row in series["values"]] == [BASE_MS + i for i in range(19)]


async def test_stray_and_broken_spool_entries_never_stop_the_sink(
    victoria_metrics: VictoriaMetricsProcess, tmp_path: Path
) -> None:
    """Entries that only look like segments are counted, leftovers removed, the rest kept."""
    spool_dir = tmp_path / "spool"
    _legacy_segment(spool_dir, 5, _lines(0, 30))  # a good segment of the old format
    (spool_dir / "0000000000000001-7.lp").symlink_to(spool_dir / "gone")  # dangling
    (spool_dir / "0000000000000002-6.lp").mkdir()
    (spool_dir / "0000000000000003-5.lpc").write_bytes(b"")
    (spool_dir / "0000000000000004-4.lpc").write_bytes(b"not a segment\n" * 10)
    (spool_dir / "0000000000000006-3.lpc.tmp").write_bytes(b"half a segment")
    (spool_dir / "notes.txt").write_text("the operator's\n", encoding="utf-8")
    with capture_logs() as logs:
        sink = InfluxSink(_settings(victoria_metrics.url, spool_dir=spool_dir))
        async with _running(sink):
            await _until(lambda: sink.stats.points_written == 30)
            sink.write(_row_points(30, 10))
            await _until(lambda: sink.stats.points_written == 40)
    assert sink.stats.dropped == {"spool_unreadable": 7 + 6, "spool_corrupt": 5 + 4}
    assert sink.stats.points_dropped == 22
    assert _vm_count(victoria_metrics) == 40
    (debris,) = [e for e in logs if e["event"] == "influx_spool_debris"]
    assert debris["tmp_removed"] == 1
    assert debris["unreadable"] == ["0000000000000001-7.lp", "0000000000000002-6.lp"]
    assert debris["unreadable_points"] == 13
    assert debris["stray"] == ["notes.txt"]
    assert sorted(p.name for p in spool_dir.iterdir()) == [
        ".lock",
        "0000000000000002-6.lp.stray",
        "notes.txt",
    ]


def test_full_disk_leaves_no_tmp_file_and_keeps_the_points(tmp_path: Path) -> None:
    """A disk that refuses a segment halfway (EFBIG, as ENOSPC): no .tmp, points kept, counted."""
    spool_dir = tmp_path / "spool"
    argv = [sys.executable, "-B", "-m", "tests.export.fsize_child"]
    argv += [_dead_url(), str(spool_dir), "500", "16384"]  # points, bytes a file may have
    # RLIMIT_FSIZE limits a whole process: a child's, not the test runner's.
    child = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout)
    assert "File too large" in report["spool_error"]
    assert report["buffered_before_close"] == 500
    assert report["files_before_close"] == [".lock"]
    assert report["files"] == [".lock"]
    assert report["spool_points"] == 0
    assert report["dropped"] == {"closed": 500}  # close could neither send nor spool them


def test_write_never_raises_on_text_utf8_cannot_carry() -> None:
    """A lone surrogate in an event's detail is written as U+FFFD; write() does not raise."""
    event = Event(ts_ns=BASE_NS, seq=1, node="n01", event="cap_changed", detail={"e": "\ud800"})
    sink = InfluxSink(_settings(_dead_url()))
    sink.write([points.event_point(event, site="s", row="r", rack="k")])
    assert sink.stats.points_buffered == 1
    assert sink.stats.dropped == {}


async def test_v2_against_influxdb_1_6_is_an_outage_not_a_rejection(
    influxdb1: InfluxDB1Process, tmp_path: Path
) -> None:
    """A 404 (v2 API on InfluxDB 1.6) keeps the points and says how to fix it."""
    with capture_logs() as logs:
        sink = InfluxSink(_settings(influxdb1.url, spool_dir=tmp_path / "spool"))
        async with _running(sink, close_timeout_s=1.0):
            sink.write(_row_points(0, 20))
            await _until(lambda: sink.in_outage)
    assert sink.stats.points_dropped == 0
    assert sink.stats.spool_points == 20
    (unreachable,) = [e for e in logs if e["event"] == "influx_unreachable"]
    assert unreachable["status"] == 404
    assert "api: v1" in unreachable["error"]


async def test_close_is_bounded_when_database_refuses(tmp_path: Path) -> None:
    """With nothing listening, close() returns in time and the points stay spooled."""
    sink = InfluxSink(_settings(_dead_url(), retry_min_s=5.0, spool_dir=tmp_path / "spool"))
    task = asyncio.create_task(sink.run())
    sink.write(_row_points(0, 40))
    await _until(lambda: sink.in_outage)
    sink.write(_row_points(40, 40))
    started = time.monotonic()
    await sink.close(1.0)
    assert time.monotonic() - started < 4.0  # the 1 s bound, on a loaded machine; retry is 5 s
    await asyncio.wait_for(task, 10.0)
    assert sink.stats.spool_points == 80
    assert sink.stats.points_dropped == 0


async def test_close_is_bounded_when_database_hangs(tmp_path: Path) -> None:
    """A database that accepts but never answers cannot hold close() past its timeout."""
    connections: list[asyncio.StreamWriter] = []

    async def swallow(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)  # read nothing, answer nothing

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        settings = _settings(
            f"http://127.0.0.1:{port}", timeout_s=30.0, spool_dir=tmp_path / "spool"
        )
        sink = InfluxSink(settings)
        task = asyncio.create_task(sink.run())
        sink.write(_row_points(0, 100))
        await _until(lambda: bool(connections))
        started = time.monotonic()
        await sink.close(1.0)
        assert time.monotonic() - started < 4.0  # the 1 s bound (loaded machine); timeout 30 s
        await asyncio.wait_for(task, 10.0)
        assert sink.stats.spool_points == 100
        assert sink.stats.points_dropped == 0
    finally:
        for writer in connections:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_memory_bound_without_spool_drops_oldest() -> None:
    """Without a spool, memory keeps max_buffer_points and counts what it drops."""
    sink: Sink = InfluxSink(_settings(_dead_url(), max_buffer_points=150, batch_size=50))
    sink.write(_row_points(0, 200))
    assert sink.stats.points_buffered == 150
    assert sink.stats.dropped == {"memory_full": 50}
    await sink.close(0.5)
    assert sink.stats.dropped == {"memory_full": 50, "closed": 150}
    sink.write(_row_points(0, 3))
    assert sink.stats.dropped["closed"] == 153


def test_write_never_raises_on_a_bad_value() -> None:
    """A value line protocol cannot carry is dropped and counted, the rest is kept."""
    sink = InfluxSink(_settings(_dead_url()))
    bad = Point("m", {}, {"value": object()}, 1)  # type: ignore[dict-item]
    sink.write([bad, *_row_points(0, 2)])
    assert sink.stats.points_buffered == 2
    assert sink.stats.dropped == {"invalid": 1}


async def test_spool_dir_is_locked(tmp_path: Path) -> None:
    """Two sinks cannot share one spool directory."""
    settings = _settings(_dead_url(), spool_dir=tmp_path / "spool")
    first = InfluxSink(settings)
    task = asyncio.create_task(first.run())
    await _until((tmp_path / "spool" / ".lock").exists)
    second = InfluxSink(settings)
    with pytest.raises(FatalError, match="in use"):
        await second.run()
    await first.close(0.5)
    await task


async def test_cancelled_run_then_close_spools_memory(tmp_path: Path) -> None:
    """When run() is cancelled first, close() still saves what memory holds."""
    sink = InfluxSink(_settings(_dead_url(), flush_interval_s=60.0, spool_dir=tmp_path / "s"))
    task = asyncio.create_task(sink.run())
    sink.write(_row_points(0, 30))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await sink.close(1.0)
    assert sink.stats.spool_points == 30


def test_classify_status() -> None:
    """5xx, 429, 404 and auth errors mean retry; other 4xx mean bad data, maybe partial."""
    assert isinstance(classify_status(503, "busy"), InfluxUnavailableError)
    throttled = classify_status(429, "slow down", retry_after="7")
    assert isinstance(throttled, InfluxUnavailableError)
    assert throttled.delay_s == 7.0
    assert isinstance(classify_status(401, "unauthorized"), InfluxUnavailableError)
    partial = classify_status(400, 'partial write: field type conflict: "x" dropped=3')
    assert isinstance(partial, BatchRejectedError)
    assert partial.dropped_points == 3
    assert partial.kind == "400:partial write: field type conflict:"
    other = classify_status(400, "unable to parse 'm x=1 2': bad timestamp")
    assert isinstance(other, BatchRejectedError)
    assert other.dropped_points is None
    quoted = "partial write: unable to parse 'm s=\"dropped=9\" x': bad timestamp dropped=0"
    named = classify_status(400, quoted)  # only the count at the end is the database's
    assert isinstance(named, BatchRejectedError)
    assert named.dropped_points == 1
    many = "partial write: " + "\n".join(
        f"unable to parse 'm v= {i}': no value" for i in range(999)
    )
    long = classify_status(400, many + " dropped=0")
    assert isinstance(long, BatchRejectedError)
    assert long.dropped_points == 999
    assert len(str(long)) < 600  # the log line stays short


def test_resolve_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token: the setting, else token_file, else the systemd credential; else none."""
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    assert resolve_token(_settings("http://x")) is None
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "influx_token").write_text("from-credential\n", encoding="utf-8")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    assert resolve_token(_settings("http://x")) == "from-credential"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\nignored\n", encoding="utf-8")
    assert resolve_token(_settings("http://x", token_file=token_file)) == "from-file"
    direct = _settings("http://x", token="direct", token_file=token_file)  # noqa: S106 - test
    assert resolve_token(direct) == "direct"
    with pytest.raises(ConfigError, match="token_file"):
        resolve_token(_settings("http://x", token_file=tmp_path / "missing"))


def test_sink_needs_a_url() -> None:
    """A sink without influx.url is a configuration error."""
    with pytest.raises(ConfigError, match=r"influx\.url"):
        InfluxSink(InfluxSettings())


async def test_memory_sink_records_until_closed() -> None:
    """MemorySink keeps points for inspection and counts writes after close."""
    sink = MemorySink(max_points=3)
    as_protocol: Sink = sink  # mypy checks that MemorySink is a Sink
    task = asyncio.create_task(as_protocol.run())
    sink.write(_row_points(0, 4))
    assert [p.fields["power_w"] for p in sink.measurement("row")] == [1.0, 2.0, 3.0]
    await sink.close(1.0)
    await task
    sink.write(_row_points(0, 2))
    assert sink.stats.dropped == {"memory_full": 1, "closed": 2}
    assert sink.stats.points_written == 4


# --- essential points outlive bulk ones (a node must not crowd the database out) ---------


def _step_ns(step: int) -> int:
    return BASE_NS + step * 1_000_000


def _essential_step(step: int, *, nodes: int = 4, control: bool = True) -> list[AnyPoint]:
    """One control step's essential points: a row point, ``nodes`` node points, a control."""
    ts_ns = _step_ns(step)
    out: list[AnyPoint] = [
        points.row_point(ts_ns=ts_ns, site="s1", row="r1", power_w=float(step), level=1)
    ]
    out.extend(
        points.node_point(
            ts_ns=ts_ns, site="s1", row="r1", rack="k1", node=f"n{n:02d}", power_w=float(step)
        )
        for n in range(nodes)
    )
    if control:
        out.append(
            points.control_point(ts_ns=ts_ns, site="s1", row="r1", scope="row", level=1, seq=step)
        )
    return out


def _big_node(gpus: int, *, with_health: int = 0) -> Telemetry:
    """A schema-valid telemetry message of one node listing ``gpus`` GPUs."""
    return Telemetry(
        ts_ns=BASE_NS,
        seq=1,
        node="n99",
        interval_s=1.0,
        node_gpu_power_w=300.0 * gpus,
        node_energy_delta_j=300.0 * gpus,
        gpus=tuple(
            GpuTelemetry(
                index=i,
                uuid=f"GPU-{i}",
                name="NVIDIA H100 80GB HBM3",
                power_mean_w=300.0,
                gpu_temp_c=60.0,
                health=GpuHealthReport(xid_errors=0, pcie_replays=1) if i < with_health else None,
            )
            for i in range(gpus)
        ),
    )


def _bulk_step(telemetry: Telemetry, step: int, *, events: int = 0) -> list[AnyPoint]:
    """One message's bulk points: a ``gpu`` point per GPU, ``gpu_health`` ones, and events
    with names never seen before."""
    t = telemetry.model_copy(update={"ts_ns": _step_ns(step)})
    out: list[AnyPoint] = [*gpu_points(t, site="s1", row="r1", rack="k9")]
    out.extend(gpu_health_points(t, site="s1", row="r1", rack="k9"))
    for i in range(events):
        event = Event(ts_ns=_step_ns(step), seq=1, node="n99", event=f"flood_{step}_{i}")
        out.append(points.event_point(event, site="s1", row="r1", rack="k9"))
    return out


def _essential_counts(vm: VictoriaMetricsProcess) -> tuple[int, int, int]:
    return (
        _vm_count(vm, "row_power_w"),
        _vm_count(vm, "node_power_w"),
        _vm_count(vm, "control_level"),
    )


async def test_memory_bound_evicts_bulk_points_before_essential_ones(
    victoria_metrics: VictoriaMetricsProcess,
) -> None:
    """Database down, no spool: a flood of gpu, gpu_health and event points beyond
    max_buffer_points drops only bulk points (oldest first); the rows, nodes and controls
    arrive once the database is back."""
    await asyncio.to_thread(victoria_metrics.stop)
    # No retry (0.5 to 1 s away) takes a batch out of memory while the flood is checked.
    settings = _settings(
        victoria_metrics.url,
        max_buffer_points=3000,
        batch_size=500,
        retry_min_s=1.0,
        retry_max_s=1.0,
    )
    telemetry = _big_node(64, with_health=16)
    essential = [p for step in range(20) for p in _essential_step(step)]
    bulk = [p for step in range(100) for p in _bulk_step(telemetry, step, events=5)]
    assert len(essential) == 120
    assert len(bulk) == 100 * (64 + 16 + 5)
    with capture_logs() as logs:
        sink = InfluxSink(settings)
        async with _running(sink):
            sink.write(essential)
            await _until(lambda: sink.in_outage)  # the batch that failed is back in memory
            for step in range(100):  # as the intake hands them over: message by message
                sink.write(bulk[step * 85 : (step + 1) * 85])
            stats = sink.stats
            assert stats.points_buffered == 3000
            assert stats.dropped == {"memory_full_bulk": len(essential) + len(bulk) - 3000}
            await asyncio.to_thread(victoria_metrics.start)
            await _until(_settled(sink, len(essential) + len(bulk)))
    assert sink.stats.dropped == {"memory_full_bulk": len(essential) + len(bulk) - 3000}
    assert sink.stats.points_written == 3000
    assert _essential_counts(victoria_metrics) == (20, 80, 20)
    survivors = bulk[len(bulk) - (3000 - len(essential)) :]  # the newest bulk points
    gpu_survivors = sum(1 for p in survivors if p.measurement == "gpu")
    assert _vm_count(victoria_metrics, "gpu_power_w") == gpu_survivors
    assert _vm_count(victoria_metrics, "gpu_health_pcie_replays") == sum(
        1 for p in survivors if p.measurement == "gpu_health"
    )
    dropped = [e for e in logs if e["event"] == "influx_points_dropped"]
    assert {e["reason"] for e in dropped} == {"memory_full_bulk"}


async def test_spool_bound_evicts_bulk_segments_before_essential_ones(
    victoria_metrics: VictoriaMetricsProcess, tmp_path: Path
) -> None:
    """A small spool under a stalled database: bulk segments are evicted first, essential
    segments written before and after them all survive and are replayed first."""
    await asyncio.to_thread(victoria_metrics.stop)
    spool_dir = tmp_path / "spool"
    telemetry = _big_node(100)
    first_rows: list[AnyPoint] = [*_row_points(0, 100)]
    nodes = [p for step in range(25) for p in _essential_step(step, control=False)[1:]]
    last_rows: list[AnyPoint] = [*_row_points(100, 100)]
    bulk = [_bulk_step(telemetry, step) for step in range(10)]  # 10 segments of 100
    assert len(nodes) == 100
    assert all(len(chunk) == 100 for chunk in bulk)

    def size(batch: Sequence[AnyPoint]) -> int:
        return len(spool.encode_segment([p.encode() for p in batch]))

    essential_bytes = size(first_rows) + size(nodes) + size(last_rows)
    room = essential_bytes + 2.5 * max(size(chunk) for chunk in bulk)
    settings = _settings(
        victoria_metrics.url, batch_size=100, spool_dir=spool_dir, spool_max_mb=room / 2**20
    )
    with capture_logs() as logs:
        sink = InfluxSink(settings)
        async with _running(sink, close_timeout_s=1.0):
            written = 0
            for batch in [first_rows, *bulk, nodes, last_rows]:
                sink.write(batch)
                written += len(batch)
                # Every point on disk or dropped: none in memory or in a spill under way.
                await _until(
                    lambda: sink.stats.spool_points + sink.stats.points_dropped == written  # noqa: B023
                )
            stats = sink.stats
            assert stats.dropped == {"spool_full_bulk": 800}
            assert stats.spool_points == 300 + 200
            essential_files = sorted(p.name for p in spool_dir.glob("*[0-9].lpc"))
            bulk_files = sorted(p.name for p in spool_dir.glob("*.bulk.lpc"))
            assert [name.split("-")[1] for name in essential_files] == ["100.lpc"] * 3
            assert len(bulk_files) == 2  # the newest two
            await asyncio.to_thread(victoria_metrics.start)
            await _until(_settled(sink, 300 + 1000))
    assert sink.stats.points_written == 500
    assert sink.stats.dropped == {"spool_full_bulk": 800}
    assert _essential_counts(victoria_metrics) == (200, 100, 0)
    (row,) = victoria_metrics.export('{__name__="row_power_w"}')
    assert row["values"] == [float(i) for i in range(200)]
    gpu_times = {
        t for s in victoria_metrics.export('{__name__="gpu_power_w"}') for t in s["timestamps"]
    }
    assert gpu_times == {_step_ns(8) // 1_000_000, _step_ns(9) // 1_000_000}
    dropped = [e for e in logs if e["event"] == "influx_points_dropped"]
    assert {e["reason"] for e in dropped} == {"spool_full_bulk"}


async def test_a_node_flooding_gpu_points_cannot_evict_row_and_node_points(
    victoria_metrics: VictoriaMetricsProcess,
) -> None:
    """The issue, reproduced: a node lists 1,024 GPUs (1,099 lines per message) while the
    sink is stalled; 250 such messages among 250 control steps (a row point and 4 node
    points each) used to evict every early row and node point. All of them survive now."""
    telemetry = _big_node(1024, with_health=75)
    sink = InfluxSink(_settings(victoria_metrics.url, batch_size=5000))  # 200,000 in memory
    for step in range(250):  # stalled: nothing is sent meanwhile
        sink.write(_essential_step(step, control=False))
        flood = _bulk_step(telemetry, step)
        assert len(flood) == 1099
        sink.write(flood)
    total = 250 * (1099 + 5)
    assert sink.stats.points_buffered == 200_000
    assert sink.stats.dropped == {"memory_full_bulk": total - 200_000}
    async with _running(sink, close_timeout_s=0.5):  # the database answers again
        await _until(lambda: sink.stats.points_written >= 5000)  # essential ones go first
        assert _essential_counts(victoria_metrics) == (250, 1000, 0)
    assert "memory_full" not in sink.stats.dropped
    assert sink.stats.points_written + sink.stats.points_dropped == total
