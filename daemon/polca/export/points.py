"""Time-series points and their line-protocol encoding, checked against ``SCHEMA``.

Why this module exists: every point polca writes to InfluxDB (and compatible stores) goes
through here, as a general ``Point`` or, on the hot path, a ``SeriesPoint`` of a
``LineTemplate``. The builders (``make_point``, ``LineTemplate``) check names against the
export schema (``schema.py``: measurements, tags and typed fields) and coerce every value
to the type it declares; the encoders turn points into line protocol.

The encoder is total over text: any ``str`` in a name, tag or string field becomes one line
of valid UTF-8 line protocol that InfluxDB 1.x and VictoriaMetrics both parse (what neither
can carry becomes U+FFFD, see ``Point.to_line``), because one unparsable line costs more
than itself: InfluxDB 1.x leaves it out of a partial write's count when the batch also had
another error, and VictoriaMetrics drops it without a word.

This module does no I/O and imports no database client (``transport.py`` owns that); the
builders that make points from the aggregator's results live in ``aggregator/points.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterable, Mapping
from typing import Final, NamedTuple

import orjson

from polca.export.schema import SCHEMA, FieldType
from polca.telemetry.messages import BusStats

FieldValue = float | int | bool | str

_PRECISION_DIVISOR: Final = {"ns": 1, "us": 1_000, "ms": 1_000_000, "s": 1_000_000_000}

# Line-protocol escaping, as the reference clients do it. Newlines would end the line, so
# they are written as the two characters ``\n`` everywhere (a human-readable, lossy choice:
# VictoriaMetrics drops a whole request whose string field holds a raw newline).
# Backslashes in names and tag values are not escaped (InfluxDB 1.x would keep both of a
# doubled one), but one that ends the text or stands before a delimiter cannot be written
# at all: neither parser accepts a name or tag value ending in a backslash, and they read
# a backslash before an escaped delimiter differently. That one becomes U+FFFD. Field keys
# also escape a double quote (VictoriaMetrics would take it for the start of a string).
_ESCAPE_MEASUREMENT: Final = str.maketrans(
    {",": r"\,", " ": r"\ ", "\n": r"\n", "\r": r"\r", "\t": r"\t"}
)
_ESCAPE_KEY: Final = str.maketrans(
    {",": r"\,", "=": r"\=", " ": r"\ ", "\n": r"\n", "\r": r"\r", "\t": r"\t"}
)
_ESCAPE_FIELD_KEY: Final = str.maketrans(
    {",": r"\,", "=": r"\=", " ": r"\ ", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}
)
_ESCAPE_STRING: Final = str.maketrans({'"': r"\"", "\\": "\\\\", "\n": r"\n", "\r": r"\r"})

_DANGLING_BACKSLASH: Final = re.compile(r"\\(?=[,= ]|\Z)")
_DANGLING_FIELD_BACKSLASH: Final = re.compile(r"\\(?=[,= \"]|\Z)")
_SURROGATE: Final = re.compile("[\ud800-\udfff]")
_REPLACEMENT: Final = "\ufffd"
_CACHED_MAX_CHARS: Final = 256  # longer names are escaped every time, never cached
_STRING_MAX_CHARS: Final = 16_384  # ≤ 64 KiB of UTF-8: well within a line's limits
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**63 - 1
# InfluxDB's time range, in ns (VictoriaMetrics keeps only what its retention covers).
_TIME_MIN_NS: Final = -9_223_372_036_854_775_806
_TIME_MAX_NS: Final = 9_223_372_036_854_775_806


@dataclasses.dataclass(frozen=True, slots=True)
class Point:
    """One line of line protocol: a measurement, tags, fields and a timestamp (Unix ns).

    ``None`` field values are left out; a point left without fields is not written at all
    (``to_line`` returns an empty string). Tags with an empty key or value and fields with
    an empty key are left out too (line protocol cannot carry them).
    """

    measurement: str
    tags: Mapping[str, str]
    fields: Mapping[str, FieldValue | None]
    ts_ns: int

    def to_line(self, precision: str = "ms") -> str:
        """The point as one line of line protocol, timestamp in ``precision`` (ns/us/ms/s).

        Any text encodes: a lone surrogate (which UTF-8 cannot carry) and a backslash that
        would escape a delimiter or end a name or tag value become U+FFFD, a newline, tab
        or carriage return the two characters ``\\n``, ``\\t``, ``\\r``, and a string field
        is cut to 16,384 characters (ending in "…"). Tag keys that become equal keep the
        first (InfluxDB refuses a line with a tag twice; for fields the last one counts).
        Raises ``ValueError`` only for what no line can carry: an empty measurement or one
        starting with ``#`` (a comment), an integer outside int64, a time outside
        InfluxDB's range.
        """
        cached_field = _FIELD_KEYS.get
        field_parts: list[str] = []
        for key, value in self.fields.items():
            text = _field_text(value)
            if text is not None and key:
                field_parts.append(f"{cached_field(key) or _escape_field_key(key)}={text}")
        if not field_parts:
            return ""
        head = _head(self.measurement, self.tags.items())
        return f"{head} {','.join(field_parts)} {_timestamp(self.ts_ns, precision)}"

    def encode(self, precision: str = "ms") -> bytes:
        """``to_line`` as UTF-8 bytes, what a sink sends (``b""`` for no line)."""
        return self.to_line(precision).encode()


def _head(measurement: str, tags: Iterable[tuple[str, str]]) -> str:
    """The escaped measurement and tags of a line (tags sorted, empty ones left out)."""
    escaped_measurement = _escape_measurement(measurement)
    if not escaped_measurement or escaped_measurement.startswith("#"):
        msg = f"measurement {measurement!r} cannot start a line of line protocol"
        raise ValueError(msg)
    cached = _KEYS.get  # the hot path: most names and tag values were seen before
    head = [escaped_measurement]
    tag_keys: set[str] = set()
    for key, value in sorted(tags):
        if value and key:
            escaped = cached(key) or _escape_key(key)
            if escaped not in tag_keys:
                tag_keys.add(escaped)
                head.append(f"{escaped}={cached(value) or _escape_key(value)}")
    return ",".join(head)


def _timestamp(ts_ns: int, precision: str) -> int:
    divisor = _PRECISION_DIVISOR[precision]
    ts = ts_ns // divisor
    if not _TIME_MIN_NS <= ts * divisor <= _TIME_MAX_NS:
        msg = f"time {ts_ns} ns is outside what InfluxDB stores"
        raise ValueError(msg)
    return ts


def _utf8(text: str) -> str:
    """The text with every lone surrogate (no UTF-8 for it) replaced by U+FFFD."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return _SURROGATE.sub(_REPLACEMENT, text)
    return text


def _escape_name(
    text: str, table: dict[int, str], dangling: re.Pattern[str] = _DANGLING_BACKSLASH
) -> str:
    text = _utf8(text)
    if "\\" in text:
        text = dangling.sub(_REPLACEMENT, text)
    return text.translate(table)


# Names and tag values repeat from point to point (site, rack, node, GPU UUID, field names),
# so their escaped form is cached: this is the hot path of the sink. Short ones only, and
# a bounded number (emptied when full).
_KEYS: Final[dict[str, str]] = {}
_FIELD_KEYS: Final[dict[str, str]] = {}
_CACHE_MAX: Final = 1 << 16
_dumps: Final = orjson.dumps
_JSON_NUMBERS: Final = b"0123456789.e+-,nul"
"""What ``orjson.dumps`` of a tuple of numbers and nulls is made of, besides ``[]``."""


def _remember(cache: dict[str, str], text: str, escaped: str) -> str:
    if len(text) <= _CACHED_MAX_CHARS:
        if len(cache) >= _CACHE_MAX:
            cache.clear()
        cache[text] = escaped
    return escaped


def _escape_key(text: str) -> str:
    """A tag key or value."""
    return _remember(_KEYS, text, _escape_name(text, _ESCAPE_KEY))


def _escape_field_key(text: str) -> str:
    return _remember(
        _FIELD_KEYS, text, _escape_name(text, _ESCAPE_FIELD_KEY, _DANGLING_FIELD_BACKSLASH)
    )


@functools.lru_cache(maxsize=256)
def _escape_measurement(text: str) -> str:
    return _escape_name(text, _ESCAPE_MEASUREMENT)


def _field_text(value: FieldValue | None) -> str | None:
    """A field value in line protocol; None for what cannot be written (None, NaN, inf)."""
    kind = type(value)
    if kind is float:
        return repr(value) if math.isfinite(value) else None  # type: ignore[arg-type]
    if value is None:
        return None
    if kind is bool or isinstance(value, bool):  # before int: bool is an int subclass
        return "true" if value else "false"
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            msg = f"integer {value} does not fit line protocol's int64"
            raise ValueError(msg)
        return f"{value}i"
    if isinstance(value, float):
        return repr(float(value)) if math.isfinite(value) else None
    if len(value) > _STRING_MAX_CHARS:
        value = value[: _STRING_MAX_CHARS - 1] + "…"
    return f'"{_utf8(value).translate(_ESCAPE_STRING)}"'


def encode_lines(points: list[Point], precision: str = "ms") -> bytes:
    """Points as a line-protocol body (newline separated), skipping points without fields.

    Raises ``ValueError`` as ``Point.to_line`` does; never for text.
    """
    return "\n".join(line for p in points if (line := p.to_line(precision))).encode()


def make_point(
    measurement: str,
    *,
    ts_ns: int,
    tags: Mapping[str, str],
    fields: Mapping[str, FieldValue | None],
) -> Point:
    """A point of a ``SCHEMA`` measurement, each field coerced to its declared type.

    Raises ``ValueError`` for an unknown measurement, tag or field name (a programming
    error: the schema and its documentation must change first). ``None`` values are left out.
    """
    schema = SCHEMA.get(measurement)
    if schema is None:
        msg = f"unknown measurement {measurement!r}; known: {sorted(SCHEMA)}"
        raise ValueError(msg)
    unknown_tags = set(tags) - set(schema.tags)
    if unknown_tags:
        msg = f"measurement {measurement!r} has no tags {sorted(unknown_tags)}"
        raise ValueError(msg)
    coerced: dict[str, FieldValue] = {}
    for name, value in fields.items():
        kind = schema.field_type(name)
        if kind is None:
            msg = f"measurement {measurement!r} has no field {name!r}"
            raise ValueError(msg)
        if value is not None:
            coerced[name] = kind(value)
    return Point(measurement, dict(tags), coerced, ts_ns)


class LineTemplate:
    """The line-protocol template of one numeric measurement: fixed tag keys and fields.

    Why: per-GPU points are most of what a site writes (8 per node message), and building
    a ``Point`` (two dicts) and encoding it field by field costs several times more than
    filling a template. A template escapes each series' measurement and tags once (``head``,
    cached per tag-value tuple, bounded) and writes the fields present with one format
    string per pattern of missing fields. The fields are checked against ``SCHEMA`` when
    the template is made; string fields are not supported (they need per-value escaping).
    The values' text comes from one ``orjson.dumps`` of the tuple: the same shortest
    round-trip digits as ``repr`` (``1e-07`` is written ``1e-7``), in compiled code,
    where ``repr`` of a full-precision float was most of the cost (about 4 µs a point).

    Values must be of their declared type (``float`` fields also take ``int``, never
    ``bool``); ``None`` is left out, and a non-finite float or an out-of-range integer
    takes the general path of ``Point`` (left out, or ``ValueError``), so a template writes
    exactly what the equivalent ``Point`` would.
    """

    __slots__ = (
        "_formats",
        "_heads",
        "_int_positions",
        "_kinds",
        "field_names",
        "measurement",
        "tag_keys",
    )

    def __init__(self, measurement: str, *, tag_keys: Iterable[str], fields: Iterable[str]) -> None:
        schema = SCHEMA.get(measurement)
        if schema is None:
            msg = f"unknown measurement {measurement!r}; known: {sorted(SCHEMA)}"
            raise ValueError(msg)
        self.measurement = measurement
        self.tag_keys = tuple(tag_keys)
        self.field_names = tuple(fields)
        unknown = set(self.tag_keys) - set(schema.tags)
        if unknown or len(set(self.tag_keys)) != len(self.tag_keys):
            msg = f"measurement {measurement!r}: tags {self.tag_keys} (unknown: {sorted(unknown)})"
            raise ValueError(msg)
        kinds: list[FieldType] = []
        for name in self.field_names:
            kind = schema.field_type(name)
            if kind not in (float, int):
                msg = f"measurement {measurement!r}: {name!r} is not a numeric field"
                raise ValueError(msg)
            kinds.append(kind)
        self._kinds = tuple(kinds)
        self._int_positions = tuple(i for i, k in enumerate(kinds) if k is int)
        self._heads: dict[tuple[str, ...], bytes] = {}
        self._formats: dict[tuple[int, ...], bytes] = {}

    def point(
        self, tag_values: tuple[str, ...], values: tuple[float | int | None, ...], ts_ns: int
    ) -> SeriesPoint:
        """A point of this template (``tag_values`` in ``tag_keys`` order)."""
        return SeriesPoint(self, tag_values, values, ts_ns)

    def head(self, tag_values: tuple[str, ...]) -> bytes:
        """The escaped measurement and tags of one series, UTF-8 (cached, bounded)."""
        head = self._heads.get(tag_values)
        if head is None:
            head = _head(self.measurement, zip(self.tag_keys, tag_values, strict=True)).encode()
            if len(self._heads) >= _CACHE_MAX:
                self._heads.clear()
            self._heads[tag_values] = head
        return head

    def line(
        self,
        tag_values: tuple[str, ...],
        values: tuple[float | int | None, ...],
        ts_ns: int,
        precision: str = "ms",
    ) -> str:
        """One line of line protocol ("" when no field can be written); as ``Point.to_line``."""
        return self.encode(tag_values, values, ts_ns, precision).decode()

    def encode(
        self,
        tag_values: tuple[str, ...],
        values: tuple[float | int | None, ...],
        ts_ns: int,
        precision: str = "ms",
    ) -> bytes:
        """``line`` as UTF-8 bytes (``b""`` when no field can be written).

        The hot path of the sink, so in few steps, most of them in C: one ``orjson.dumps``
        of the values, which writes what line protocol leaves out (None, NaN, ±inf) as
        ``null``; a check that it wrote nothing but numbers and nulls; the missing fields
        (usually none or one) and the format of their line; one ``%`` with the head and
        the time. Anything else (an integer outside int64, a value of another type) takes
        the general path.
        """
        try:
            raw = _dumps(values)
        except orjson.JSONEncodeError:  # a float subclass, an int beyond 64 bits, ...
            raw = b""
        fits = raw.translate(None, _JSON_NUMBERS) == b"[]"
        for i in self._int_positions:  # every integer an int within int64
            value = values[i]
            if value is not None and (type(value) is not int or not _INT_MIN <= value <= _INT_MAX):
                fits = False
        if fits:
            parts: list[bytes | int] = raw[1:-1].split(b",")  # type: ignore[assignment]
            try:
                at = parts.index(b"null")
            except ValueError:
                gaps: tuple[int, ...] = ()
            else:
                del parts[at]
                gaps = (at,)
                if b"null" in parts:
                    gaps = tuple(i for i, v in enumerate(raw[1:-1].split(b",")) if v == b"null")
                    parts = [v for v in parts if v != b"null"]
            if not parts:
                return b""
            text = self._formats.get(gaps) or self._format_for(gaps)
        else:
            fields = self._general_fields(values)
            if not fields:
                return b""
            parts, text = [fields], b"%s %s %d"
        divisor = _PRECISION_DIVISOR[precision]
        ts = ts_ns // divisor
        if not _TIME_MIN_NS <= ts * divisor <= _TIME_MAX_NS:
            msg = f"time {ts_ns} ns is outside what InfluxDB stores"
            raise ValueError(msg)
        parts.insert(0, self._heads.get(tag_values) or self.head(tag_values))
        parts.append(ts)
        return text % tuple(parts)

    def _general_fields(self, values: tuple[float | int | None, ...]) -> bytes:
        """The field set as ``Point.to_line`` writes it, value by value."""
        parts = []
        for name, kind, value in zip(self.field_names, self._kinds, values, strict=True):
            if value is not None:
                field = _field_text(kind(value))
                if field is not None:
                    parts.append(f"{_FIELD_KEYS.get(name) or _escape_field_key(name)}={field}")
        return ",".join(parts).encode()

    def _format_for(self, gaps: tuple[int, ...]) -> bytes:
        parts = [
            f"{_escape_field_key(name).replace('%', '%%')}=%s" + ("i" if kind is int else "")
            for i, (name, kind) in enumerate(zip(self.field_names, self._kinds, strict=True))
            if i not in gaps
        ]
        text = b"%s " + ",".join(parts).encode() + b" %d"  # the head, the fields, the time
        if len(self._formats) < 4096:  # one per pattern of missing fields; few occur
            self._formats[gaps] = text
        return text


class SeriesPoint(NamedTuple):
    """A point made from a ``LineTemplate``: tag values and field values as tuples.

    Encodes as the equivalent ``Point`` would (``to_line``); ``tags`` and ``fields`` show
    it as one, for readers such as ``MemorySink`` and the tests (built on each access).
    A named tuple: made once per GPU per message, it must be cheap to make.
    """

    template: LineTemplate
    tag_values: tuple[str, ...]
    values: tuple[float | int | None, ...]
    ts_ns: int

    @property
    def measurement(self) -> str:
        """The template's measurement."""
        return self.template.measurement

    @property
    def tags(self) -> dict[str, str]:
        """Tag key -> value."""
        return dict(zip(self.template.tag_keys, self.tag_values, strict=True))

    @property
    def fields(self) -> dict[str, FieldValue]:
        """Field name -> value, each of its declared type; missing ones left out."""
        t = self.template
        return {
            name: kind(value)
            for name, kind, value in zip(t.field_names, t._kinds, self.values, strict=True)
            if value is not None
        }

    def to_line(self, precision: str = "ms") -> str:
        """One line of line protocol, as ``Point.to_line`` (same errors)."""
        template, tag_values, values, ts_ns = self
        return template.line(tag_values, values, ts_ns, precision)

    def encode(self, precision: str = "ms") -> bytes:
        """``to_line`` as UTF-8 bytes, what a sink sends (``b""`` for no line)."""
        template, tag_values, values, ts_ns = self
        return template.encode(tag_values, values, ts_ns, precision)


AnyPoint = Point | SeriesPoint
"""What a sink takes: a general point or a templated one."""


def mqtt_points(
    connections: Mapping[str, BusStats], *, ts_ns: int, site: str, role: str, name: str
) -> list[Point]:
    """One ``mqtt`` point per connection of a process: whether it is connected, to which
    broker endpoint (``none`` between connections), and its connects and failovers."""
    return [
        make_point(
            "mqtt",
            ts_ns=ts_ns,
            tags={
                "site": site,
                "role": role,
                "name": name,
                "connection": connection,
                "endpoint": stats.endpoint or "none",
            },
            fields={
                "connected": 1.0 if stats.endpoint is not None else 0.0,
                "connects": stats.connects,
                "failovers": stats.failovers,
                "disconnects": stats.disconnects,
            },
        )
        for connection, stats in connections.items()
    ]
