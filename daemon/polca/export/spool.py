"""The sink's on-disk spool: line protocol waiting for the database, in checksummed segments.

Why this module exists: during a database outage the sink moves its lines here and replays
them later, also after a restart or a crash. Crashes and disks cut files short and flip bits,
and people leave things in directories. None of that may stop the sink, send a damaged line
(the database stamps a line cut before its timestamp with the time of the replay), or lose
points without counting them. So the format carries a checksum per record and its reader is
total: any bytes decode to the records that were written whole, and the rest is counted.

What it must not do: talk to the database (no ``influxdb_client``, no ``aiohttp``: the sink
owns that), log (it reports what it found and counted; the sink logs, rate-limited), or run
on the event loop (every method blocks on file I/O; the sink calls one at a time from a
worker thread).

The format, version 2: one file per segment, named ``<seq>-<points>.lpc`` (a segment of
essential points) or ``<seq>-<points>.bulk.lpc`` (bulk points)::

    #polca-spool 2 precision=ms                      the header: magic, version, precision
    <CRC-32 of the line, 8 hex digits> <line>        one record per point, each ending in \\n

A line is one line of line protocol with a millisecond timestamp and no newline inside
(``points.py`` escapes them). A record whose checksum does not match (cut short, a flipped
bit, a missing newline that glued two records together) is skipped and the next one is read:
a record can only be lost whole, and never be read wrong. Segments of version 1,
``<seq>-<points>.lp`` (plain line protocol, no header), are still replayed: their last line
without a newline (cut by a crash) and any line without a timestamp are counted instead of
sent; a flipped bit inside such a line goes unnoticed, as it did before.

A segment is written to ``<name>.tmp``, fsync'ed, renamed into place and the directory
fsync'ed; whatever fails on the way, the ``.tmp`` file is removed and the caller keeps the
lines. The ``<points>`` in the name is how many records a segment was written with: what it
lacks when read is counted as ``corrupt_points`` (and the name corrected, so that a restart
does not count it again); a segment that cannot be read at all, or is no file, as
``unreadable_points``. Other files in the directory are left alone and reported.

Two classes share the directory and its byte bound (``polca.export.schema``
``ESSENTIAL_MEASUREMENTS``): a segment holds lines of one class, and the class is in its
name. To stay within ``max_bytes`` the oldest *bulk* segments are evicted first; an
essential segment is evicted only when no bulk one is left, and a bulk segment that does not
fit beside the essential ones is refused (counted, never written) rather than evict one.
Reads return essential segments first, each class oldest first. Segments that older
versions wrote (``.lpc`` and ``.lp``, classes mixed) are read as essential: they are
replayed, and never evicted for the sake of bulk points.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import re
import stat
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from polca.errors import ConfigError, FatalError

HEADER: Final = b"#polca-spool 2 precision=ms\n"
"""The first line of every segment of this format."""
SUFFIX: Final = ".lpc"
"""Segments of this format: ``<seq>-<points>.lpc`` (essential points)."""
BULK_SUFFIX: Final = ".bulk.lpc"
"""Segments of this format holding bulk points: ``<seq>-<points>.bulk.lpc``."""
LEGACY_SUFFIX: Final = ".lp"
"""Segments of version 1 (plain line protocol), still replayed."""
LOCK_NAME: Final = ".lock"

_TMP_SUFFIX: Final = ".tmp"
_STRAY_SUFFIX: Final = ".stray"
_SEGMENT_NAME: Final = re.compile(r"([0-9]{1,20})-([0-9]{1,20})(\.bulk\.lpc|\.lpc|\.lp)", re.ASCII)
_CRC_DIGITS: Final = 8
_LEGACY_TIMESTAMP: Final = re.compile(rb" -?[0-9]+\Z")
_NAMES_REPORTED: Final = 20


@dataclasses.dataclass(frozen=True, slots=True)
class Decoded:
    """What a segment's bytes hold: the records that were written whole, and the rest."""

    records: tuple[bytes, ...]
    """Lines of line protocol, in the order they were written."""
    damaged: int
    """Non-empty lines that failed their check (a cut or altered record, a bad header)."""
    header: bool
    """Whether the bytes start with this format's header (False: legacy or foreign)."""


def encode_segment(lines: Sequence[bytes]) -> bytes:
    """A segment holding ``lines`` (non-empty, without newlines), header first."""
    parts = [HEADER]
    parts.extend(b"%08x %s\n" % (zlib.crc32(line), line) for line in lines)
    return b"".join(parts)


def decode_segment(data: bytes) -> Decoded:
    """The records of a segment of this format; never raises, whatever the bytes.

    Each line is checked on its own, so a damaged header or record costs only itself.
    """
    header = data.startswith(HEADER)
    records: list[bytes] = []
    damaged = 0
    for line in (data[len(HEADER) :] if header else data).split(b"\n"):
        if not line:
            continue
        payload = line[_CRC_DIGITS + 1 :]
        if (
            payload
            and line[_CRC_DIGITS : _CRC_DIGITS + 1] == b" "
            and line[:_CRC_DIGITS] == b"%08x" % zlib.crc32(payload)
        ):
            records.append(payload)
        else:
            damaged += 1
    return Decoded(tuple(records), damaged, header)


def decode_legacy(data: bytes) -> Decoded:
    """The lines of a version-1 segment (plain line protocol); never raises.

    Version 1 wrote a newline after every line, so text after the last newline was cut
    short; it is counted, as is a line without a timestamp (the database would stamp it
    with the time of the replay). Bytes that start with this format's header are decoded
    as this format.
    """
    if data.startswith(HEADER):
        return decode_segment(data)
    lines = data.split(b"\n")
    damaged = 1 if lines.pop() else 0
    records: list[bytes] = []
    for line in lines:
        if not line:
            continue
        if _LEGACY_TIMESTAMP.search(line):
            records.append(line)
        else:
            damaged += 1
    return Decoded(tuple(records), damaged, header=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """One segment file and the number of records it was written with."""

    path: Path
    seq: int
    points: int
    size_bytes: int
    legacy: bool = False
    bulk: bool = False
    """Whether it holds bulk points (evicted first), not essential ones."""


@dataclasses.dataclass(frozen=True, slots=True)
class OpenReport:
    """What ``Spool.open`` found besides whole segments (for one log line)."""

    tmp_removed: int = 0
    """``.tmp`` files of interrupted writes, deleted (their lines were never committed)."""
    unreadable: tuple[str, ...] = ()
    """Entries named like segments that are no readable file (counted, moved away)."""
    unreadable_points: int = 0
    """The points their names promised, counted in ``Spool.unreadable_points``."""
    stray: tuple[str, ...] = ()
    """Other entries, left alone (the first few names)."""
    stray_count: int = 0
    """How many other entries there are."""

    @property
    def debris(self) -> bool:
        """Whether anything besides segments and the lock was there."""
        return bool(self.tmp_removed or self.unreadable or self.stray_count)


@dataclasses.dataclass(frozen=True, slots=True)
class SpoolBatch:
    """The oldest segments' good records, as one line-protocol body."""

    segments: tuple[Segment, ...]
    body: bytes
    points: int
    """Records in ``body``."""


class Spool:
    """Segment files in one directory, oldest first, locked by one process at a time.

    Synchronous file I/O: run every method in a worker thread, one call at a time.
    ``max_bytes`` bounds the directory (bulk segments are evicted first, the oldest of a
    class first, and counted); ``sync`` is ``os.fsync``, a seam for tests of a failing disk.
    """

    def __init__(
        self, directory: Path, *, max_bytes: int, sync: Callable[[int], None] = os.fsync
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._sync = sync
        self._essential: deque[Segment] = deque()
        self._bulk: deque[Segment] = deque()
        self._next_seq = 0
        self._lock_fd: int | None = None
        self.points = 0
        """Points waiting now (as the segments' names count them), of both classes."""
        self.size_bytes = 0
        """Bytes of the segments now, of both classes."""
        self.bulk_points = 0
        """Of ``points``, those in bulk segments."""
        self.bulk_bytes = 0
        """Of ``size_bytes``, those of bulk segments."""
        self.appended_points = 0
        """Points written to the spool since start."""
        self.evicted_points = 0
        """Essential points of segments deleted to stay within ``max_bytes``."""
        self.evicted_bulk_points = 0
        """Bulk points of segments deleted, or refused, to stay within ``max_bytes``."""
        self.unreadable_points = 0
        """Points of segments that could not be read, or were no file."""
        self.corrupt_points = 0
        """Points a segment lacked when read: cut, altered or foreign records."""

    @property
    def empty(self) -> bool:
        """Whether no segment waits."""
        return not self._essential and not self._bulk

    def open(self) -> OpenReport:
        """Lock the directory and index what a previous run left; tidy and report the rest.

        Raises ``ConfigError`` when the directory cannot be used and ``FatalError`` when
        another process holds it; nothing inside the directory makes it fail.
        """
        if self._lock_fd is not None:
            return OpenReport()
        self._lock()
        try:
            paths = sorted(self.directory.iterdir())
        except OSError as exc:
            self.close()
            msg = f"cannot list influx spool directory {self.directory}: {exc}"
            raise ConfigError(msg) from exc
        found: list[Segment] = []
        tmp_removed = 0
        unreadable: list[str] = []
        unreadable_points = 0
        stray: list[str] = []
        last_seq = -1
        for path in paths:
            name = path.name
            if name == LOCK_NAME:
                continue
            if name.endswith(_TMP_SUFFIX):
                try:
                    path.unlink()  # a write that a crash or a full disk interrupted
                    tmp_removed += 1
                except OSError:
                    stray.append(name)  # a directory, say: not ours to delete
                continue
            match = _SEGMENT_NAME.fullmatch(name)
            if match is None:
                stray.append(name)
                continue
            seq, points = int(match.group(1)), int(match.group(2))
            last_seq = max(last_seq, seq)  # never reuse a number, even a broken one's
            try:
                info = path.stat()
            except OSError:
                info = None  # a dangling symlink, a loop, a file gone meanwhile
            if info is None or not stat.S_ISREG(info.st_mode):
                unreadable.append(name)
                unreadable_points += points
                self._move_away(path)
                continue
            suffix = match.group(3)
            found.append(
                Segment(
                    path,
                    seq,
                    points,
                    info.st_size,
                    legacy=suffix == LEGACY_SUFFIX,
                    bulk=suffix == BULK_SUFFIX,
                )
            )
        self._index(found)
        self._next_seq = last_seq + 1
        self.unreadable_points += unreadable_points
        return OpenReport(
            tmp_removed=tmp_removed,
            unreadable=tuple(unreadable[:_NAMES_REPORTED]),
            unreadable_points=unreadable_points,
            stray=tuple(stray[:_NAMES_REPORTED]),
            stray_count=len(stray),
        )

    def _index(self, found: list[Segment]) -> None:
        """Take ``found`` as the segments waiting, each class oldest first."""
        found.sort(key=lambda s: (s.seq, s.path.name))
        self._essential = deque(s for s in found if not s.bulk)
        self._bulk = deque(s for s in found if s.bulk)
        self.points = sum(s.points for s in found)
        self.size_bytes = sum(s.size_bytes for s in found)
        self.bulk_points = sum(s.points for s in self._bulk)
        self.bulk_bytes = sum(s.size_bytes for s in self._bulk)

    def _lock(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            msg = f"cannot use influx spool directory {self.directory}: {exc}"
            raise ConfigError(msg) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            msg = f"influx spool {self.directory} is in use by another process"
            raise FatalError(msg) from exc
        self._lock_fd = fd

    def close(self) -> None:
        """Release the directory lock (the segments stay for the next run)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def append(self, lines: Sequence[bytes], *, bulk: bool = False) -> None:
        """Write one segment of one class durably, first evicting segments beyond the bound.

        Room is made by evicting the oldest bulk segments, then (for an essential segment
        only) the oldest essential ones; a bulk segment that cannot fit beside the essential
        segments is refused: counted in ``evicted_bulk_points``, not written, nothing
        evicted for it. Raises ``OSError`` when the disk fails (full, read-only, I/O
        error): then nothing of this segment is left in the directory and the caller still
        owns the lines.
        """
        body = encode_segment(lines)
        essential_bytes = self.size_bytes - self.bulk_bytes
        if bulk and self._essential and essential_bytes + len(body) > self.max_bytes:
            self.evicted_bulk_points += len(lines)  # essential points alone hold the bound
            return
        # Make room first, but never evict to nothing: one segment may exceed a tiny bound.
        while self.size_bytes + len(body) > self.max_bytes:
            if self._bulk:
                self.evicted_bulk_points += self._pop_oldest(bulk=True).points
            elif self._essential:
                self.evicted_points += self._pop_oldest(bulk=False).points
            else:
                break
        seq = self._next_seq
        self._next_seq += 1  # not reused even if this write fails: its name may linger
        name = f"{seq:016d}-{len(lines)}{BULK_SUFFIX if bulk else SUFFIX}"
        path = self.directory / name
        tmp = self.directory / f"{name}{_TMP_SUFFIX}"
        placed = False
        done = False
        try:
            self._write_synced(tmp, body)
            tmp.replace(path)
            placed = True
            self._sync_directory()
            done = True
        finally:
            if not done:
                # A full disk, an I/O error or a cancellation: leave nothing half-written.
                # A segment renamed but not made durable goes too: the caller keeps its lines.
                with contextlib.suppress(OSError):
                    (path if placed else tmp).unlink(missing_ok=True)
        segment = Segment(path, seq, len(lines), len(body), bulk=bulk)
        self._queue(segment).append(segment)
        self.points += len(lines)
        self.size_bytes += len(body)
        if bulk:
            self.bulk_points += len(lines)
            self.bulk_bytes += len(body)
        self.appended_points += len(lines)

    def _write_synced(self, path: Path, body: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view) :]
            self._sync(fd)
        finally:
            os.close(fd)

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._sync(fd)
        finally:
            os.close(fd)

    def _queue(self, segment: Segment) -> deque[Segment]:
        """The segments of ``segment``'s class, oldest first."""
        return self._bulk if segment.bulk else self._essential

    def _at(self, index: int) -> Segment | None:
        """The segment at ``index`` in reading order: essential ones, then bulk ones."""
        if index < len(self._essential):
            return self._essential[index]
        index -= len(self._essential)
        return self._bulk[index] if index < len(self._bulk) else None

    def _pop_oldest(self, *, bulk: bool) -> Segment:
        segment = (self._bulk if bulk else self._essential).popleft()
        # A segment that cannot be deleted is replayed again at the next start: a duplicate
        # the database absorbs, never a loss.
        with contextlib.suppress(OSError):
            segment.path.unlink(missing_ok=True)
        self.points -= segment.points
        self.size_bytes -= segment.size_bytes
        if segment.bulk:
            self.bulk_points -= segment.points
            self.bulk_bytes -= segment.size_bytes
        return segment

    def _move_away(self, path: Path) -> None:
        """Take an entry that only looks like a segment out of the index for good."""
        try:
            path.unlink()  # a symlink, a FIFO, a socket
        except OSError:
            with contextlib.suppress(OSError):  # a directory: keep it, under another name
                path.rename(path.with_name(path.name + _STRAY_SUFFIX))

    def _shrink_oldest(self, segment: Segment, points: int) -> Segment:
        """The oldest segment of its class holds only ``points`` good records: say so in
        its name too."""
        queue = self._queue(segment)
        suffix = LEGACY_SUFFIX if segment.legacy else BULK_SUFFIX if segment.bulk else SUFFIX
        renamed = segment.path.with_name(f"{segment.seq:016d}-{points}{suffix}")
        path = segment.path
        with contextlib.suppress(OSError):
            if not renamed.exists():
                segment.path.rename(renamed)
                path = renamed
        shrunk = dataclasses.replace(segment, path=path, points=points)
        queue[0] = shrunk
        self.points -= segment.points - points
        if segment.bulk:
            self.bulk_points -= segment.points - points
        return shrunk

    def read_oldest(self, max_points: int) -> SpoolBatch:
        """The good records of the next segments, at most ``max_points`` (at least one).

        Essential segments come first, then bulk ones, each class oldest first. A segment
        that cannot be read is taken out (``unreadable_points``); one that holds fewer good
        records than it was written with keeps those and counts the rest
        (``corrupt_points``), or is taken out when none is left. A damaged segment is dealt
        with only once it is the first to read, so that it is counted once.
        """
        taken: list[Segment] = []
        bodies: list[bytes] = []
        total = 0
        while (segment := self._at(len(taken))) is not None:
            if taken and total + segment.points > max_points:
                break
            try:
                data = _read_regular_file(segment.path)
            except OSError:
                if taken:
                    break  # send what was read; this one is dealt with next time
                self.unreadable_points += self._pop_oldest(bulk=segment.bulk).points
                continue
            decoded = decode_legacy(data) if segment.legacy else decode_segment(data)
            good = len(decoded.records)
            if good < segment.points:
                if taken:
                    break
                self.corrupt_points += segment.points - good
                if not good:
                    self._pop_oldest(bulk=segment.bulk)
                    continue
                segment = self._shrink_oldest(segment, good)
            taken.append(segment)
            bodies.append(b"\n".join(decoded.records))
            total += good
        return SpoolBatch(tuple(taken), b"\n".join(bodies), total)

    def remove(self, segments: Sequence[Segment]) -> None:
        """Delete segments that were sent (or rejected): the oldest ones of their class."""
        for segment in segments:
            queue = self._queue(segment)
            if queue and queue[0] == segment:
                self._pop_oldest(bulk=segment.bulk)


def _read_regular_file(path: Path) -> bytes:
    """The bytes of a regular file; ``OSError`` for anything else (a FIFO never blocks)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb", closefd=True) as stream:  # noqa: PTH123 - a descriptor, not a path
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return stream.read()
