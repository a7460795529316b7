"""An InfluxSink whose spool disk cannot hold a segment, in a process of its own.

``test_sink.py`` runs this module as a child process: ``RLIMIT_FSIZE`` limits every file the
process writes, and the test runner itself must not be limited. With ``SIGXFSZ`` ignored, a
write past the limit fails with ``EFBIG``, as a write to a full disk fails with ``ENOSPC``:
a real refusal by the kernel, halfway through a segment. The database is unreachable, so
the sink tries to spool; the child prints one JSON object with what it saw.

Usage: ``python -B -m tests.export.fsize_child URL SPOOL_DIR POINTS LIMIT_BYTES``
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

from structlog.testing import capture_logs

from polca.aggregator import points
from polca.export.influx import InfluxSink
from polca.settings import InfluxSettings

_WAIT_S = 10.0


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


async def _run(url: str, spool_dir: Path, count: int) -> dict[str, Any]:
    settings = InfluxSettings(
        url=url,
        api="v1",
        batch_size=count,
        flush_interval_s=0.05,
        retry_min_s=0.05,
        retry_max_s=0.1,
        timeout_s=1.0,
        spool_dir=spool_dir,
    )
    base_ns = time.time_ns() - 3600 * 10**9
    with capture_logs() as logs:
        sink = InfluxSink(settings)
        task = asyncio.create_task(sink.run(), name="sink")
        sink.write(
            [
                points.row_point(ts_ns=base_ns + i * 10**6, site="s1", row="r1", power_w=float(i))
                for i in range(count)
            ]
        )
        deadline = time.monotonic() + _WAIT_S
        while not any(e["event"] == "influx_spool_failed" for e in logs):
            if time.monotonic() > deadline or task.done():
                break
            await asyncio.sleep(0.02)
        buffered = sink.stats.points_buffered
        files_before_close = _names(spool_dir)
        await sink.close(1.0)
        await task
    failures = [e for e in logs if e["event"] == "influx_spool_failed"]
    return {
        "spool_error": failures[0]["error"] if failures else None,
        "buffered_before_close": buffered,
        "files_before_close": files_before_close,
        "files": _names(spool_dir),
        "dropped": sink.stats.dropped,
        "spool_points": sink.stats.spool_points,
    }


def main() -> None:
    """Limit file sizes, run the sink, print the report."""
    url, spool_dir, count, limit = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    print(json.dumps(asyncio.run(_run(url, spool_dir, count))))


if __name__ == "__main__":
    main()
