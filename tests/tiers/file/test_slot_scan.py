"""How the file tier finds the slots to read at open: data ranges and read batches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file._recovery import _SCAN_BUFFER, _SCAN_READS, _scan_batches, _slots_with_data

SPAN = HEADER_BYTES + 8192


def test_never_written_slots_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "blocks.dat"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, 100 * SPAN)
        for slot in (3, 50, 99):
            os.pwrite(fd, b"x" * HEADER_BYTES, slot * SPAN)
        os.fsync(fd)
        found = _slots_with_data(fd, 100, SPAN)
        assert found == sorted(set(found))
        assert {3, 50, 99} <= set(found)
        # Where the filesystem reports unwritten ranges as holes (ext4, xfs, tmpfs),
        # only the written neighbourhoods are read.
        if os.lseek(fd, 0, os.SEEK_DATA) > 0:
            assert len(found) < 10, found
    finally:
        os.close(fd)


def test_an_empty_file_has_no_slots_to_read(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "blocks.dat", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 10 * SPAN)
        assert _slots_with_data(fd, 10, SPAN) == []
    finally:
        os.close(fd)


@pytest.mark.parametrize("span", [HEADER_BYTES + 4096, SPAN, HEADER_BYTES + (2 << 20)])
def test_batches_cover_every_slot_once_within_the_buffer(span: int) -> None:
    slots = [*range(0, 5000), *range(7000, 7003), 9000]
    batches = _scan_batches(slots, span)
    covered = [first + i for batch in batches for first, count in batch for i in range(count)]
    assert covered == slots
    for batch in batches:
        assert len(batch) <= _SCAN_READS
        assert sum((count - 1) * span + HEADER_BYTES for _, count in batch) <= _SCAN_BUFFER
    if span > 64 << 10:
        assert all(count == 1 for batch in batches for _, count in batch)  # headers only
    else:
        assert batches[0][0][1] > 1  # runs of whole slots
