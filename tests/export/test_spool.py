"""The spool's format and directory handling: torn, altered and foreign files, full disks."""

from __future__ import annotations

import errno
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polca.export.spool import (
    HEADER,
    Spool,
    decode_legacy,
    decode_segment,
    encode_segment,
)

PROPS = settings(max_examples=300, deadline=None)

# Lines as the sink spools them: non-empty, no newline (points.py escapes newlines).
_LINE = st.binary(min_size=1, max_size=80).filter(lambda b: b"\n" not in b)
_LINES = st.lists(_LINE, min_size=1, max_size=30)


def _lines(count: int, start: int = 0) -> list[bytes]:
    return [
        b"row,site=s1 power_w=%d.0 %d" % (i, 1_700_000_000_000 + i)
        for i in range(start, start + count)
    ]


def _is_subsequence(found: tuple[bytes, ...], written: list[bytes]) -> bool:
    remaining = iter(written)
    return all(any(record == line for line in remaining) for record in found)


def test_segment_round_trip_has_header_and_one_checksummed_record_per_line() -> None:
    """A segment is the header plus '<crc32 hex> <line>' per line, and decodes to its lines."""
    lines = _lines(3)
    data = encode_segment(lines)
    assert data.startswith(HEADER)
    assert data.splitlines()[1] == b"%08x %s" % (zlib.crc32(lines[0]), lines[0])
    decoded = decode_segment(data)
    assert decoded.records == tuple(lines)
    assert decoded.damaged == 0
    assert decoded.header


@PROPS
@given(st.binary(max_size=2000))
def test_any_bytes_decode_without_raising(data: bytes) -> None:
    """Random bytes never raise, in either format; each line is a record or damaged."""
    lines = [line for line in data.split(b"\n") if line]
    header = data.startswith(HEADER)
    for decoded in (decode_segment(data), decode_legacy(data)):
        assert decoded.header is header
        assert len(decoded.records) + decoded.damaged == len(lines) - header
        assert all(record in lines for record in decoded.records)


@PROPS
@given(st.binary(max_size=2000))
def test_bytes_after_a_header_decode_without_raising(tail: bytes) -> None:
    """Whatever follows a valid header decodes without raising, also as the old format."""
    data = HEADER + tail
    lines = [line for line in tail.split(b"\n") if line]
    for decoded in (decode_segment(data), decode_legacy(data)):
        assert decoded.header
        assert len(decoded.records) + decoded.damaged == len(lines)


@PROPS
@given(_LINES, st.data())
def test_cut_segment_yields_the_whole_records_before_the_cut(
    lines: list[bytes], data: st.DataObject
) -> None:
    """A segment cut anywhere yields exactly the records written whole before the cut."""
    encoded = encode_segment(lines)
    cut = data.draw(st.integers(0, len(encoded)), label="cut")
    decoded = decode_segment(encoded[:cut])
    whole = 0
    end = len(HEADER)
    for line in lines:
        end += 9 + len(line)  # a record without its newline is whole too
        if end <= cut:
            whole += 1
        end += 1
    assert decoded.records == tuple(lines[:whole])


@PROPS
@given(_LINES, st.data())
def test_flipped_bits_never_yield_a_record_that_was_not_written(
    lines: list[bytes], data: st.DataObject
) -> None:
    """Bit flips lose whole records only (a single flip at most two), never alter one."""
    encoded = bytearray(encode_segment(lines))
    flips = data.draw(st.lists(st.integers(0, len(encoded) * 8 - 1), min_size=1, max_size=4))
    for bit in flips:
        encoded[bit // 8] ^= 1 << (bit % 8)
    decoded = decode_segment(bytes(encoded))
    assert _is_subsequence(decoded.records, lines)
    if len(set(flips)) == 1:
        assert len(decoded.records) >= len(lines) - 2


def test_legacy_segment_counts_its_cut_line_and_lines_without_a_timestamp() -> None:
    """Version 1: the text after the last newline and a line without a time are not records."""
    lines = _lines(4)
    data = b"\n".join([*lines[:2], b"row,site=s1 power_w=5.0", lines[2]]) + b"\n" + lines[3][:30]
    decoded = decode_legacy(data)
    assert decoded.records == (lines[0], lines[1], lines[2])
    assert decoded.damaged == 2
    assert not decoded.header
    assert decode_legacy(encode_segment(lines)).records == tuple(lines)


def _spool(directory: Path, *, sync: Callable[[int], None] = os.fsync) -> Spool:
    spool = Spool(directory, max_bytes=1 << 20, sync=sync)
    spool.open()
    return spool


def test_full_disk_on_fsync_leaves_no_tmp_and_no_segment(tmp_path: Path) -> None:
    """ENOSPC from fsync: append raises, the .tmp file is gone, nothing is counted as spooled."""

    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    spool = _spool(tmp_path, sync=full)
    with pytest.raises(OSError, match="No space left"):
        spool.append(_lines(10))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
    assert spool.empty
    assert (spool.points, spool.size_bytes, spool.appended_points) == (0, 0, 0)


def test_failed_directory_fsync_takes_the_renamed_segment_back(tmp_path: Path) -> None:
    """A segment that could not be made durable is removed again: the caller keeps the lines."""
    calls: list[int] = []

    def directory_fails(_fd: int) -> None:
        calls.append(_fd)
        if len(calls) == 2:  # the file's fsync passes, the directory's fails
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    spool = _spool(tmp_path, sync=directory_fails)
    with pytest.raises(OSError, match="Input/output error"):
        spool.append(_lines(10))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
    spool.append(_lines(5))  # the next one gets a new number and works
    assert [p.name for p in tmp_path.glob("*.lpc")] == ["0000000000000001-5.lpc"]


def test_open_tidies_and_reports_what_is_not_a_segment(tmp_path: Path) -> None:
    """Leftovers, foreign entries and non-files named like segments never make open fail."""
    good = tmp_path / "0000000000000009-3.lpc"
    good.write_bytes(encode_segment(_lines(3)))
    (tmp_path / "0000000000000001-7.lpc").symlink_to(tmp_path / "nowhere")
    (tmp_path / "0000000000000002-6.lpc").mkdir()
    os.mkfifo(tmp_path / "0000000000000003-5.lp")
    loop = tmp_path / "0000000000000004-4.lpc"
    loop.symlink_to(loop)
    (tmp_path / "0000000000000010-2.lpc.tmp").write_bytes(b"half")
    (tmp_path / "debris.tmp").mkdir()
    (tmp_path / "README").write_text("operator notes\n", encoding="utf-8")
    (tmp_path / "99999999999999999999999-1.lpc").write_bytes(b"")  # too long a number
    spool = Spool(tmp_path, max_bytes=1 << 20)
    report = spool.open()
    assert report.tmp_removed == 1
    assert sorted(report.unreadable) == [
        "0000000000000001-7.lpc",
        "0000000000000002-6.lpc",
        "0000000000000003-5.lp",
        "0000000000000004-4.lpc",
    ]
    assert report.unreadable_points == 22
    assert spool.unreadable_points == 22
    assert sorted(report.stray) == ["99999999999999999999999-1.lpc", "README", "debris.tmp"]
    assert spool.points == 3
    remaining = sorted(p.name for p in tmp_path.iterdir())
    assert remaining == [
        ".lock",
        "0000000000000002-6.lpc.stray",  # a directory is kept, under a name that is no segment
        "0000000000000009-3.lpc",
        "99999999999999999999999-1.lpc",
        "README",
        "debris.tmp",
    ]
    batch = spool.read_oldest(100)
    assert batch.points == 3
    spool.append(_lines(1))
    assert (tmp_path / "0000000000000010-1.lpc").exists()  # after every number seen
    spool.close()
    assert not Spool(tmp_path, max_bytes=1 << 20).open().unreadable  # counted once


def test_damaged_segments_replay_their_good_records_and_count_the_rest(tmp_path: Path) -> None:
    """Cut, emptied, foreign and vanished segments: good records replay, the rest is counted."""
    cut = encode_segment(_lines(10))
    (tmp_path / "0000000000000001-10.lpc").write_bytes(cut[: len(cut) - 20])
    (tmp_path / "0000000000000002-4.lpc").write_bytes(b"")
    (tmp_path / "0000000000000003-6.lpc").write_bytes(b"\x00\xff not a segment\n" * 20)
    (tmp_path / "0000000000000004-2.lpc").write_bytes(encode_segment(_lines(2, start=20)))
    (tmp_path / "0000000000000005-8.lpc").write_bytes(encode_segment(_lines(8)))
    spool = _spool(tmp_path)
    (tmp_path / "0000000000000005-8.lpc").unlink()  # gone between open and read
    replayed: list[bytes] = []
    while not spool.empty:
        batch = spool.read_oldest(100)
        replayed.extend(batch.body.split(b"\n") if batch.body else [])
        assert batch.points == (len(batch.body.split(b"\n")) if batch.body else 0)
        spool.remove(batch.segments)
    assert replayed == _lines(9) + _lines(2, start=20)
    assert spool.corrupt_points == 1 + 4 + 6
    assert spool.unreadable_points == 8
    assert spool.points == 0
    assert spool.size_bytes == 0


def test_a_cut_segment_is_counted_once_across_restarts(tmp_path: Path) -> None:
    """The name of a damaged segment is corrected, so that a restart does not count it again."""
    cut = encode_segment(_lines(10))
    (tmp_path / "0000000000000001-10.lpc").write_bytes(cut[: len(cut) - 20])
    spool = _spool(tmp_path)
    assert spool.read_oldest(100).points == 9
    assert spool.corrupt_points == 1
    assert spool.points == 9
    spool.close()  # a restart before the segment was sent
    assert [p.name for p in tmp_path.glob("*.lpc")] == ["0000000000000001-9.lpc"]
    again = _spool(tmp_path)
    assert again.points == 9
    assert again.read_oldest(100).points == 9
    assert again.corrupt_points == 0


# --- two classes: essential segments outlive bulk ones -----------------------------------


def _gpu_lines(count: int, start: int = 0) -> list[bytes]:
    """Bulk lines (``gpu``), as long as ``_lines`` of the same count so segments match."""
    return [
        b"gpu,site=s1 power_w=%d.0 %d" % (i, 1_700_000_000_000 + i)
        for i in range(start, start + count)
    ]


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != ".lock")


def _bounded(directory: Path, *, segments: float) -> Spool:
    """A spool with room for ``segments`` segments of 10 lines (essential or bulk)."""
    size = len(encode_segment(_lines(10)))
    assert len(encode_segment(_gpu_lines(10))) == size
    spool = Spool(directory, max_bytes=int(segments * size))
    spool.open()
    return spool


def _drain(spool: Spool) -> list[bytes]:
    replayed: list[bytes] = []
    while not spool.empty:
        batch = spool.read_oldest(10)
        replayed.extend(batch.body.split(b"\n"))
        spool.remove(batch.segments)
    return replayed


def test_bulk_segments_are_evicted_before_essential_ones(tmp_path: Path) -> None:
    """Past the bound the oldest bulk segment goes, never an older essential one."""
    spool = _bounded(tmp_path, segments=3.5)
    spool.append(_lines(10))  # essential, the oldest of all
    spool.append(_gpu_lines(10), bulk=True)
    spool.append(_gpu_lines(10, start=10), bulk=True)
    assert _names(tmp_path) == [
        "0000000000000000-10.lpc",
        "0000000000000001-10.bulk.lpc",
        "0000000000000002-10.bulk.lpc",
    ]
    spool.append(_gpu_lines(10, start=20), bulk=True)  # a bulk one makes room: bulk goes
    spool.append(_lines(10, start=10))  # so does an essential one
    assert _names(tmp_path) == [
        "0000000000000000-10.lpc",
        "0000000000000003-10.bulk.lpc",
        "0000000000000004-10.lpc",
    ]
    assert (spool.evicted_points, spool.evicted_bulk_points) == (0, 20)
    assert (spool.points, spool.bulk_points) == (30, 10)
    assert spool.bulk_bytes == len(encode_segment(_gpu_lines(10, start=20)))
    assert spool.size_bytes == sum(p.stat().st_size for p in tmp_path.glob("*.lpc"))


def test_a_bulk_segment_never_displaces_essential_ones(tmp_path: Path) -> None:
    """Essential segments alone hold the bound: a bulk segment is refused, counted, not written."""
    spool = _bounded(tmp_path, segments=2.5)
    spool.append(_gpu_lines(10), bulk=True)
    spool.append(_lines(10))
    spool.append(_lines(10, start=10))  # evicts the bulk one
    spool.append(_gpu_lines(10, start=10), bulk=True)  # no room beside the essential ones
    assert _names(tmp_path) == ["0000000000000001-10.lpc", "0000000000000002-10.lpc"]
    assert (spool.evicted_points, spool.evicted_bulk_points) == (0, 20)
    assert spool.appended_points == 30  # the refused segment was never spooled
    assert _drain(spool) == _lines(20)


def test_essential_segments_are_evicted_only_when_no_bulk_one_is_left(tmp_path: Path) -> None:
    """Essential points alone beyond the bound: the oldest essential segment goes."""
    spool = _bounded(tmp_path, segments=2.5)
    spool.append(_lines(10))
    spool.append(_gpu_lines(10), bulk=True)
    spool.append(_lines(10, start=10))  # the bulk one goes
    spool.append(_lines(10, start=20))  # now the oldest essential one
    assert _names(tmp_path) == ["0000000000000002-10.lpc", "0000000000000003-10.lpc"]
    assert (spool.evicted_points, spool.evicted_bulk_points) == (10, 10)
    assert _drain(spool) == _lines(20, start=10)


def test_reads_give_essential_segments_first_each_class_oldest_first(tmp_path: Path) -> None:
    """Replay order: every essential segment, then bulk ones; also after a restart."""
    spool = _spool(tmp_path)
    spool.append(_gpu_lines(10), bulk=True)
    spool.append(_lines(10))
    spool.append(_gpu_lines(10, start=10), bulk=True)
    spool.append(_lines(10, start=10))
    spool.close()
    again = _spool(tmp_path)
    assert (again.points, again.bulk_points) == (40, 20)
    first = again.read_oldest(25)  # whole segments: two essential ones
    assert first.body.split(b"\n") == _lines(20)
    assert [s.bulk for s in first.segments] == [False, False]
    again.remove(first.segments)
    assert _drain(again) == _gpu_lines(20)
    assert (again.points, again.bulk_points, again.size_bytes, again.bulk_bytes) == (0, 0, 0, 0)


def test_a_batch_may_end_with_bulk_segments_after_the_essential_ones(tmp_path: Path) -> None:
    """One read can take the last essential segment and the first bulk ones; remove takes each."""
    spool = _spool(tmp_path)
    spool.append(_gpu_lines(10), bulk=True)
    spool.append(_lines(10))
    batch = spool.read_oldest(100)
    assert batch.body.split(b"\n") == _lines(10) + _gpu_lines(10)
    spool.remove(batch.segments)
    assert spool.empty
    assert _names(tmp_path) == []


def test_segments_of_older_versions_are_replayed_as_essential(tmp_path: Path) -> None:
    """.lpc and .lp segments written before the classes are kept from bulk eviction."""
    (tmp_path / "0000000000000001-10.lp").write_bytes(b"\n".join(_gpu_lines(10)) + b"\n")
    (tmp_path / "0000000000000002-10.lpc").write_bytes(encode_segment(_gpu_lines(10, start=10)))
    size = len(encode_segment(_lines(10)))
    spool = Spool(tmp_path, max_bytes=2 * size)  # the .lp one is smaller: no checksums
    spool.open()
    assert (spool.points, spool.bulk_points) == (20, 0)
    spool.append(_gpu_lines(10, start=20), bulk=True)  # no room beside them: refused
    assert spool.evicted_bulk_points == 10
    assert _drain(spool) == _gpu_lines(20)


def test_a_damaged_bulk_segment_is_counted_once_and_keeps_its_class(tmp_path: Path) -> None:
    """A cut bulk segment is renamed with its good count and stays bulk across a restart."""
    cut = encode_segment(_gpu_lines(10))
    (tmp_path / "0000000000000001-10.bulk.lpc").write_bytes(cut[: len(cut) - 20])
    spool = _spool(tmp_path)
    assert spool.read_oldest(100).points == 9
    assert (spool.corrupt_points, spool.points, spool.bulk_points) == (1, 9, 9)
    spool.close()
    assert _names(tmp_path) == ["0000000000000001-9.bulk.lpc"]
    again = _spool(tmp_path)
    assert (again.points, again.bulk_points, again.corrupt_points) == (9, 9, 0)
