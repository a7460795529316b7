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
