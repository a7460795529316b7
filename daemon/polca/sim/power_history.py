"""A row's recorded power (``PowerHistory``), read from a CSV or polca's own InfluxDB 1.x.

What ``polca plan --history`` (``history.py``) and the demo's agreement check
(``agreement.py``) replay. Both readers take untrusted input and refuse it loudly: the CSV
is read bounded by the trace's reader (``polca.workload.trace.csv_rows``) and each bad line
is named ``FILE:LINE``; the InfluxDB answer is size-bounded and every name in its queries is
checked first. Readings are then averaged onto a uniform step (``resample``), carrying the
last reading over the beats a meter skipped.

I/O only to read (a file, one HTTP query per series); no replay, no model.
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import numpy as np

from polca.errors import SimConfigError, TraceError
from polca.sim.model import FloatArray
from polca.workload.trace import csv_rows

__all__ = [
    "MAX_HISTORY_BYTES",
    "MAX_HISTORY_ROWS",
    "PowerHistory",
    "load_history_csv",
    "load_history_influx",
    "resample",
]

MAX_HISTORY_BYTES: Final = 512 * 1024 * 1024
"""A CSV or an InfluxDB answer larger than this is refused (six weeks at 1 s is ~200 MB)."""
MAX_HISTORY_ROWS: Final = 10_000_000
_COLUMNS: Final = ("timestamp", "power_w")
_CLASS_COLUMNS: Final = ("hp_power_w", "lp_power_w")


@dataclass(frozen=True, slots=True, eq=False)
class PowerHistory:
    """A row's recorded power on a uniform step (W); per-class GPU power when recorded."""

    source: str
    step_s: float
    power_w: FloatArray
    hp_power_w: FloatArray | None = None
    lp_power_w: FloatArray | None = None
    start_s: float = 0.0  # Unix seconds of the first step (0 when not recorded)

    @property
    def duration_s(self) -> float:
        """The history's length."""
        return len(self.power_w) * self.step_s


def _timestamp(text: str) -> float:
    """Seconds since the epoch from epoch seconds or ISO 8601 (``Z`` allowed)."""
    try:
        return float(text)
    except ValueError:
        pass
    value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return value.timestamp()


def resample(
    t_s: FloatArray, columns: dict[str, FloatArray], *, step_s: float, source: str
) -> PowerHistory:
    """Readings at ``t_s`` (sorted) averaged onto a uniform ``step_s`` grid; an empty bin
    takes the last reading before it (a meter that skipped a beat)."""
    if len(t_s) < 2:
        msg = f"{source}: a history needs at least two readings"
        raise TraceError(msg)
    if not (math.isfinite(step_s) and step_s > 0):
        msg = f"history step must be positive, got {step_s}"
        raise SimConfigError(msg)
    bins = ((t_s - t_s[0]) / step_s).astype(np.int64)
    n = int(bins[-1]) + 1
    if n > MAX_HISTORY_ROWS:
        msg = f"{source}: {n} steps of {step_s:g} s are more than {MAX_HISTORY_ROWS}"
        raise TraceError(msg)
    counts = np.bincount(bins, minlength=n)
    out: dict[str, FloatArray] = {}
    for name, values in columns.items():
        sums = np.bincount(bins, weights=values, minlength=n)
        mean = np.full(n, np.nan)
        np.divide(sums, counts, out=mean, where=counts > 0)
        # Carry the last reading into empty bins.
        idx = np.where(counts > 0, np.arange(n), 0)
        np.maximum.accumulate(idx, out=idx)
        out[name] = mean[idx]
    return PowerHistory(
        source=source,
        step_s=step_s,
        power_w=out["power_w"],
        hp_power_w=out.get("hp_power_w"),
        lp_power_w=out.get("lp_power_w"),
        start_s=float(t_s[0]),
    )


def load_history_csv(path: Path, *, step_s: float) -> PowerHistory:
    """A CSV of ``timestamp,power_w[,hp_power_w,lp_power_w]`` (epoch seconds or ISO 8601,
    increasing; watts, finite, >= 0), read bounded by the trace's reader
    (``polca.workload.trace.csv_rows``); errors name ``FILE:LINE``."""
    rows = csv_rows(path, what="power history", max_bytes=MAX_HISTORY_BYTES)
    try:
        first = next(rows, None)
        header = [h.strip() for h in first[0]] if first else []
        if header[:2] != list(_COLUMNS) or any(h not in _CLASS_COLUMNS for h in header[2:]):
            msg = (
                f"{path}:1: the header must be timestamp,power_w and optionally "
                f"hp_power_w,lp_power_w; got {','.join(header)[:200]}"
            )
            raise TraceError(msg)
        if len(header) == 3:
            msg = f"{path}:1: give both hp_power_w and lp_power_w, or neither"
            raise TraceError(msg)
        times: list[float] = []
        values: list[list[float]] = [[] for _ in header[1:]]
        for row, line in rows:
            if all(not c.strip() for c in row):
                continue
            if len(times) >= MAX_HISTORY_ROWS:
                msg = f"{path}:{line}: more than {MAX_HISTORY_ROWS} readings"
                raise TraceError(msg)
            t, numbers = _reading(row, len(header), f"{path}:{line}")
            if times and not t > times[-1]:
                msg = f"{path}:{line}: timestamps must increase"
                raise TraceError(msg)
            times.append(t)
            for column, v in zip(values, numbers, strict=True):
                column.append(v)
    except OSError as exc:
        msg = f"{path}:0: cannot read the history: {exc.strerror or exc}"
        raise TraceError(msg) from exc
    columns = {
        name: np.array(v, dtype=np.float64) for name, v in zip(header[1:], values, strict=True)
    }
    return resample(np.array(times), columns, step_s=step_s, source=str(path))


def _reading(row: list[str], fields: int, where: str) -> tuple[float, list[float]]:
    """One CSV row's timestamp and powers, or a ``TraceError`` at ``where``."""
    if len(row) != fields:
        msg = f"{where}: {len(row)} fields, expected {fields}"
        raise TraceError(msg)
    try:
        t = _timestamp(row[0])
        numbers = [float(c) for c in row[1:]]
    except ValueError as exc:
        msg = f"{where}: not a timestamp and numbers: {','.join(row)[:120]}"
        raise TraceError(msg) from exc
    if not math.isfinite(t):
        msg = f"{where}: timestamps must increase"
        raise TraceError(msg)
    if not all(math.isfinite(v) and 0.0 <= v <= 1e9 for v in numbers):
        msg = f"{where}: power must be finite watts in [0, 1e9]"
        raise TraceError(msg)
    return t, numbers


def _influx_query(base: str, database: str, query: str) -> list[dict[str, Any]]:
    """The series of one InfluxQL query (``/query``, epoch ms), size-bounded."""
    params = urllib.parse.urlencode({"db": database, "q": query, "epoch": "ms"})
    try:
        with urllib.request.urlopen(f"{base}/query?{params}", timeout=60) as response:  # noqa: S310 - http(s) only
            body = response.read(MAX_HISTORY_BYTES + 1)
    except OSError as exc:
        msg = f"cannot read the history from {base}: {exc}"
        raise SimConfigError(msg) from exc
    if len(body) > MAX_HISTORY_BYTES:
        msg = f"the InfluxDB answer is larger than {MAX_HISTORY_BYTES} bytes"
        raise SimConfigError(msg)
    try:
        result = json.loads(body)["results"][0]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        msg = f"the InfluxDB answer is not a query result: {exc}"
        raise SimConfigError(msg) from exc
    if "error" in result:
        msg = f"InfluxDB: {result['error']}"
        raise SimConfigError(msg)
    series = result.get("series") or []
    if not isinstance(series, list):
        msg = "the InfluxDB answer's series is not a list"
        raise SimConfigError(msg)
    return series


def _readings(series: dict[str, Any]) -> tuple[FloatArray, FloatArray]:
    """(seconds, watts) of one series; refuses what is not finite watts >= 0."""
    try:
        points = series["values"]
        t = np.array([float(p[0]) / 1000.0 for p in points])
        w = np.array([float(p[1]) for p in points])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        msg = f"the InfluxDB answer is not a series of (time, power): {exc}"
        raise SimConfigError(msg) from exc
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        msg = "the InfluxDB history has power readings that are not finite watts >= 0"
        raise SimConfigError(msg)
    return t, w


def _onto(t0: float, n: int, step_s: float, t: FloatArray, w: FloatArray) -> FloatArray | None:
    """Readings ``(t, w)`` averaged onto the grid of ``n`` steps from ``t0``; gaps carry the
    reading before (or, at the start, the first after). None when nothing falls on it."""
    bins = np.floor((t - t0) / step_s).astype(np.int64)
    keep = (bins >= 0) & (bins < n)
    if not keep.any():
        return None
    counts = np.bincount(bins[keep], minlength=n)
    sums = np.bincount(bins[keep], weights=w[keep], minlength=n)
    have = counts > 0
    idx = np.where(have, np.arange(n), -1)
    np.maximum.accumulate(idx, out=idx)
    first = int(np.flatnonzero(have)[0])
    idx[idx < 0] = first
    mean = np.zeros(n)
    np.divide(sums, counts, out=mean, where=have)
    out: FloatArray = mean[idx]
    return out


def load_history_influx(
    url: str,
    *,
    row: str,
    site: str | None = None,
    step_s: float,
    since: str = "60d",
    classes: tuple[str, str] = ("high", "low"),
) -> PowerHistory:
    """A row's recorded power from polca's own InfluxDB 1.x (``/query``): the ``row``
    measurement's ``power_w``, and, where the ``gpu`` measurement has it, the GPU power of
    each of the two ``classes`` (high, low) summed over the row's GPUs. ``url`` is
    ``http://HOST:PORT/DATABASE``."""
    parsed = urllib.parse.urlsplit(url)
    database = parsed.path.strip("/")
    if parsed.scheme not in {"http", "https"} or not database or not parsed.netloc:
        msg = f"--history URL must be http(s)://HOST:PORT/DATABASE, got {url!r}"
        raise SimConfigError(msg)
    names = (row, site or "", *classes)
    if not all(c.isalnum() or c in "_.:-" for c in "".join(names)):
        msg = f"row, site and class names are letters, digits and _.:-; got {names!r}"
        raise SimConfigError(msg)
    if not (since[:-1].isdigit() and since[-1] in "smhdw"):
        msg = f"--history-since is a duration such as 30d, got {since!r}"
        raise SimConfigError(msg)
    base = f"{parsed.scheme}://{parsed.netloc}"
    # Every name in the queries is checked above: no quote gets in.
    where = f"\"row\" = '{row}'" + (f" AND \"site\" = '{site}'" if site else "")
    window = f"time > now() - {since}"
    step_ms = max(1, round(step_s * 1000))
    row_series = _influx_query(
        base,
        database,
        f'SELECT mean("power_w") FROM "row" WHERE {where} AND {window} '  # noqa: S608
        f"GROUP BY time({step_ms}ms) fill(none)",
    )
    t, w = _readings(row_series[0]) if row_series else (np.zeros(0), np.zeros(0))
    history = resample(t, {"power_w": w}, step_s=step_s, source=f"{url} row {row}")
    per_gpu = (
        f'SELECT mean("power_w") AS "power_w" FROM "gpu" WHERE {where} AND {window} '  # noqa: S608
        f'GROUP BY time({step_ms}ms), "gpu_uuid", "class"'
    )
    class_series = _influx_query(
        base,
        database,
        f'SELECT sum("power_w") FROM ({per_gpu}) WHERE {window} '  # noqa: S608
        f'GROUP BY time({step_ms}ms), "class" fill(none)',
    )
    by_class: dict[str, FloatArray] = {}
    n = len(history.power_w)
    for series in class_series:
        name = str((series.get("tags") or {}).get("class", ""))
        if name in classes:
            ct, cw = _readings(series)
            on_grid = _onto(float(t[0]), n, step_s, ct, cw)
            if on_grid is not None:
                by_class[name] = on_grid
    if set(by_class) != set(classes):
        return history
    return PowerHistory(
        source=history.source,
        step_s=step_s,
        power_w=history.power_w,
        hp_power_w=by_class[classes[0]],
        lp_power_w=by_class[classes[1]],
        start_s=history.start_s,
    )
