"""The host tier against a hostile neighbour on the same host (issue 48).

``/dev/shm`` is writable by every local user and a segment holds users' prompts
as KV, so only this user's own private files are joined: a segment anyone else
could have written is never adopted nor served (items 1), a row scribbled while
it is written is a miss, never sealed as valid (item 4), and the segment stays
within its budget, tables included (item 5).

We run as root here: "another user" is uid 65534 (``os.chown``).
"""

from __future__ import annotations

import json
import os
import random
import stat
from pathlib import Path

import pytest
from support.processes import Children

from kvtier.errors import CapacityError, UnsafeSharedFileError
from kvtier.tiers.host import Geometry, HostTier, segment_path

from .conftest import ROW_BYTES, budget, pattern

SCRIPT = str(Path(__file__).with_name("_instance.py"))
NOBODY = 65534


def keys(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def loads_exactly(tier: HostTier, key: bytes) -> bool:
    buf = bytearray(ROW_BYTES)
    return tier.load(key, memoryview(buf)) and bytes(buf) == pattern(key)


def left_by_a_killed_instance(children: Children, ns: bytes, ks: list[bytes]) -> str:
    """A segment holding ``ks``, its only instance SIGKILLed: what a crash leaves."""
    proc = children.spawn(SCRIPT, ns.hex(), ROW_BYTES, budget(8, 2), 2)
    assert "slot" in children.line(proc)
    children.tell(proc, json.dumps({"op": "store", "keys": [k.hex() for k in ks]}))
    assert children.line(proc)["stored"] == [True] * len(ks)
    proc.kill()
    proc.wait()
    path = segment_path(ns)
    assert os.path.exists(path)
    return path


# -- item 1: only this user's private files ------------------------------------------------------


def test_a_world_writable_segment_is_replaced_never_adopted(
    namespace: bytes, children: Children
) -> None:
    ks = keys(4, 1)
    path = left_by_a_killed_instance(children, namespace, ks)
    os.chmod(path, 0o666)  # as a neighbour who can write it could have planted its rows
    planted = os.stat(path).st_ino
    with HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as tier:
        st = os.stat(path)
        assert st.st_ino != planted, "the loose segment was joined"
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert not any(k in tier for k in ks)
        assert not any(loads_exactly(tier, k) for k in ks)
        stats = tier.statistics()
        assert stats.blocks == 0
        assert stats.rows_orphaned == 0


def test_a_group_readable_segment_is_not_adopted_either(
    namespace: bytes, children: Children
) -> None:
    ks = keys(2, 2)
    path = left_by_a_killed_instance(children, namespace, ks)
    os.chmod(path, 0o640)  # others could read the prompts: not this user's private file
    with HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as tier:
        assert not any(k in tier for k in ks)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_loose_segment_in_use_is_refused_naming_path_mode_and_owner(
    namespace: bytes,
) -> None:
    with HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as a:
        k = keys(1, 3)
        assert a.store_many(k, [memoryview(pattern(k[0]))]) == [True]
        os.chmod(a.path, 0o666)
        with pytest.raises(UnsafeSharedFileError) as info:
            HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2)
        text = str(info.value)
        assert a.path in text
        assert "0666" in text
        assert "owner 0" in text
        assert info.value.filename == a.path
        assert isinstance(info.value, PermissionError)
        assert loads_exactly(a, k[0])  # nothing stored was lost


def test_another_users_segment_is_refused_and_left_alone(
    namespace: bytes, children: Children
) -> None:
    path = left_by_a_killed_instance(children, namespace, keys(2, 4))
    os.chown(path, NOBODY, NOBODY)
    inode = os.stat(path).st_ino
    with pytest.raises(UnsafeSharedFileError, match=rf"belongs to another user.*owner {NOBODY}"):
        HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2)
    assert os.stat(path).st_ino == inode  # not ours to remove
    os.unlink(path)


def test_a_symlink_or_fifo_under_the_name_is_refused(namespace: bytes, tmp_path: Path) -> None:
    path = segment_path(namespace)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, path)
    try:
        with pytest.raises(UnsafeSharedFileError, match="symbolic link"):
            HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2)
    finally:
        os.unlink(path)
    os.mkfifo(path, 0o600)
    try:
        with pytest.raises(UnsafeSharedFileError, match="not a regular file"):
            HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2, join_timeout=1.0)
    finally:
        os.unlink(path)


def test_a_directory_others_can_write_without_sticky_bit_is_refused(
    namespace: bytes, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeSharedFileError, match="no sticky bit"):
        HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2, directory=str(shared))
    assert not os.listdir(shared)
    os.chmod(shared, 0o1777)  # sticky, as /dev/shm: only a file's owner can replace it
    with HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2, directory=str(shared)) as tier:
        assert stat.S_IMODE(os.stat(tier.path).st_mode) == 0o600


# -- item 4: the checksum is the owner's payload's -----------------------------------------------


def test_a_row_scribbled_while_written_is_a_miss_never_wrong_bytes(namespace: bytes) -> None:
    with (
        HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as owner,
        HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as peer,
    ):
        scribbled: list[int] = []

        def scribble(stage: str) -> None:
            # What anything mapping the segment can do to a row being filled:
            # 8 bytes into the half already copied.
            if stage == "store":
                m = owner._seg.map
                for row in range(owner.geometry.rows):
                    o = owner._table.row_offset(row) + 4096 + 100
                    if m[o : o + 8] != b"\xa5" * 8:
                        m[o : o + 8] = b"\xa5" * 8
                        scribbled.append(row)

        ks = keys(3, 5)
        owner.hook = scribble
        assert owner.store_many(ks, [memoryview(pattern(k)) for k in ks]) == [True] * 3
        owner.hook = None
        assert scribbled
        peer.refresh()
        for tier in (peer, owner):
            for k in ks:
                buf = bytearray(ROW_BYTES)
                assert not tier.load(k, memoryview(buf)), "a scribbled row was served"
        assert peer.statistics().stale_peer_reads == 3
        assert owner.statistics().integrity_failures >= 3


# -- item 5: the segment within its budget ------------------------------------------------------


@pytest.mark.parametrize("instances", [1, 2, 8])
@pytest.mark.parametrize("extra", [0, 1, 3000, 4095, 4096, 40_000])
def test_the_segment_fits_its_budget_tables_included(
    namespace: bytes, instances: int, extra: int
) -> None:
    base = budget(instances, instances)
    geometry = Geometry(namespace, ROW_BYTES, base + extra, instances)
    assert geometry.total_bytes <= base + extra
    assert geometry.rows >= instances
    with HostTier.open(namespace, ROW_BYTES, base + extra, instances) as tier:
        st = os.stat(tier.path)
        assert st.st_size <= base + extra
        assert st.st_blocks * 512 <= base + extra
        assert tier.statistics().rows == geometry.rows


def test_budget_for_is_exact_and_one_byte_less_holds_a_row_less(namespace: bytes) -> None:
    for rows in (1, 7, 32, 129, 1000):
        for instances in (1, 3):
            need = Geometry.budget_for(ROW_BYTES, rows, instances)
            assert Geometry(namespace, ROW_BYTES, need, instances).rows == rows
            assert Geometry(namespace, ROW_BYTES, need, instances).total_bytes == need
            assert Geometry(namespace, ROW_BYTES, need - 1, instances).rows == rows - 1


def test_the_issue_budgets(namespace: bytes) -> None:
    # The issue's figures: a 98,304-byte budget gave a 131,072-byte segment.
    for total in (98_304, 98_304 + 3000):
        g = Geometry(namespace, ROW_BYTES, total, 1)
        assert g.total_bytes <= total
    with pytest.raises(CapacityError, match=str(budget(2, 2))):
        HostTier.open(namespace, ROW_BYTES, budget(2, 2) - 1, 2)
