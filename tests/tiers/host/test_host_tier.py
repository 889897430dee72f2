"""The host tier's shared-memory core (issue 44): instances in one process and in many.

Several instances in one process are as separate as in separate processes (each
has its own descriptor, so its own locks); the crash tests need real processes,
killed with SIGKILL at moments the test chooses (the tier's hook pauses a store
or a copy half way).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.processes import Children

from kvtier.errors import (
    CapacityError,
    ClosedError,
    ConfigurationError,
    InvalidArgumentError,
    NamespaceMismatchError,
)
from kvtier.tiers.host import HostTier, HostTierStatistics, reap_host_segments, segment_path

from .conftest import ROW_BYTES, budget, pattern

SCRIPT = str(Path(__file__).with_name("_instance.py"))


def keys(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def store(tier: HostTier, ks: list[bytes]) -> list[bool]:
    return tier.store_many(ks, [memoryview(pattern(k)) for k in ks])


def loads_exactly(tier: HostTier, key: bytes) -> bool:
    buf = bytearray(ROW_BYTES)
    return tier.load(key, memoryview(buf)) and bytes(buf) == pattern(key)


def check_rows(stats: HostTierStatistics) -> None:
    """The host budget holds: every row counted once, no instance above its share."""
    assert sum(stats.rows_held) + stats.rows_orphaned + stats.rows_free == stats.rows
    assert all(held <= stats.quota for held in stats.rows_held)


def spawn(
    children: Children, ns: bytes, rows: int, instances: int, ttl: float = 5.0
) -> subprocess.Popen[str]:
    return children.spawn(SCRIPT, ns.hex(), ROW_BYTES, budget(rows, instances), instances, ttl)


def hello(children: Children, proc: subprocess.Popen[str]) -> dict[str, Any]:
    out = children.line(proc)
    assert "slot" in out, out
    return out


def ask(children: Children, proc: subprocess.Popen[str], **cmd: Any) -> dict[str, Any]:
    children.tell(proc, json.dumps(cmd))
    return children.line(proc)


def kill(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()


# -- one process --------------------------------------------------------------------------------


def test_instances_store_their_own_rows_and_load_each_others(namespace: bytes) -> None:
    with (
        HostTier.open(namespace, ROW_BYTES, budget(16, 2), 2) as a,
        HostTier.open(namespace, ROW_BYTES, budget(16, 2), 2) as b,
    ):
        assert (a.slot, b.slot) == (0, 1)
        ka, kb = keys(5, 1), keys(5, 2)
        assert store(a, ka) == [True] * 5
        assert store(b, kb) == [True] * 5
        a.refresh()
        b.refresh()
        assert all(loads_exactly(b, k) for k in ka)
        assert all(loads_exactly(a, k) for k in kb)
        assert all(loads_exactly(a, k) for k in ka)
        sa, sb = a.statistics(), b.statistics()
        assert (sa.peer_hits, sa.own_hits, sb.peer_hits) == (5, 5, 5)
        assert sa.rows_held == (8, 8)
        assert sa.blocks == 10
        assert sa.own_blocks == 5
        assert sa.live_instances == 2
        assert sa.leases_outstanding == 0
        check_rows(sa)
        # no duplicates on the host: b asks before storing a's block, and does not store it
        assert b.held_anywhere(ka[0])
        assert ka[0] in b
        assert store(b, [ka[0], ka[0]]) == [False, False]
        assert b.statistics().duplicates_skipped == 2
        # a key nobody holds: a miss, not a stale read
        assert not b.load(keys(1, 3)[0], memoryview(bytearray(ROW_BYTES)))
        assert b.statistics().misses == 1


def test_an_instance_evicts_only_its_own_rows(namespace: bytes) -> None:
    with (
        HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as a,
        HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as b,
    ):
        kb = keys(4, 2)
        store(b, kb)
        ka = keys(10, 1)
        assert store(a, ka[:6]) == [True] * 4 + [False] * 2  # a batch never evicts itself
        assert store(a, ka[6:]) == [True] * 4  # 4 rows: the oldest 4 evicted
        a.refresh()
        assert a.own_keys() == ka[6:]
        assert all(loads_exactly(a, k) for k in kb)  # b's rows untouched
        assert not a.held_anywhere(ka[0])
        assert a.remove(ka[9])
        assert not a.remove(kb[0])
        b.refresh()
        assert ka[9] not in b
        assert kb[0] in b
        check_rows(a.statistics())
        assert a.statistics().rows_held == (4, 4)


def test_a_row_reused_under_a_reader_is_a_miss_never_wrong_bytes(namespace: bytes) -> None:
    # lease_ttl_s=0: the owner honours no lease, so only the checks after the copy protect
    with (
        HostTier.open(namespace, ROW_BYTES, budget(4, 2), 2, lease_ttl_s=0) as a,
        HostTier.open(namespace, ROW_BYTES, budget(4, 2), 2, lease_ttl_s=0) as b,
    ):
        first = keys(2, 1)
        store(a, first)
        b.refresh()
        later = keys(2, 2)

        def reuse(stage: str) -> None:
            store(a, later)  # a reuses both rows mid-copy

        b.hook = reuse
        buf = bytearray(ROW_BYTES)
        assert not b.load(first[0], memoryview(buf))
        b.hook = None
        assert b.statistics().stale_peer_reads == 1
        assert bytes(buf) != pattern(first[0])  # what it copied was torn: not served
        b.refresh()
        assert all(loads_exactly(b, k) for k in later)
        # bytes changed in place without the seq (memory damage): the checksum catches it
        row = a._lru[later[0]]  # reach the row to damage it
        off = a._table.row_offset(row) + 4096 + 100
        a._seg.map[off] ^= 0xFF
        assert not b.load(later[0], memoryview(buf))
        assert b.statistics().stale_peer_reads == 2
        # the owner's own read finds the damage and drops the block
        assert not a.load(later[0], memoryview(buf))
        assert later[0] not in a.own_keys()


def test_the_owner_does_not_reuse_a_row_a_live_reader_holds(namespace: bytes) -> None:
    with (
        HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as a,
        HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as b,
    ):
        first = keys(4, 1)
        store(a, first)
        b.refresh()
        seen: list[HostTierStatistics] = []

        def mid_copy(stage: str) -> None:
            seen.append(a.statistics())
            # b's row stays; the other three are reused, and one block finds no room
            assert store(a, keys(4, 2)) == [True, True, True, False]
            seen.append(a.statistics())

        b.hook = mid_copy
        assert loads_exactly(b, first[0])  # its row stayed as it was
        assert seen[0].leases_outstanding == 1
        assert seen[1].stores_without_room == 1
        assert a.own_keys() == [first[0], *keys(3, 2)]
        assert a.statistics().leases_outstanding == 0


def test_a_row_seen_being_written_comes_back_when_its_owner_keeps_it(namespace: bytes) -> None:
    # The owner makes a row odd before it checks the leases on it, and puts its seq
    # back when a reader holds it: a peer that looked in between must find it again.
    with (
        HostTier.open(namespace, ROW_BYTES, budget(4, 2), 2) as a,
        HostTier.open(namespace, ROW_BYTES, budget(4, 2), 2) as b,
    ):
        (k,) = keys(1, 1)
        store(a, [k])
        words = a._table.words
        i = a._table.seq_word(a._lru[k])
        seq = words[i]
        words[i] = seq | 1
        b.refresh()
        assert k not in b
        assert not b.load(k, memoryview(bytearray(ROW_BYTES)))
        words[i] = seq
        b.refresh()
        assert k in b
        assert loads_exactly(b, k)


def test_a_different_row_size_or_budget_is_refused_naming_both(namespace: bytes) -> None:
    with HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2):
        with pytest.raises(NamespaceMismatchError, match=rf"{ROW_BYTES} bytes.*4096 bytes"):
            HostTier.open(namespace, 4096, budget(8, 2), 2)
        with pytest.raises(ConfigurationError, match=rf"{budget(8, 2)}.*{budget(9, 2)}") as info:
            HostTier.open(namespace, ROW_BYTES, budget(9, 2), 2)
        assert info.value.problems[0][0] == "budget_bytes"
        with pytest.raises(ConfigurationError, match=r"instances: .* has 2, .* for 3"):
            HostTier.open(namespace, ROW_BYTES, budget(8, 3), 3)


def test_every_slot_live_refuses_one_more_and_a_budget_too_small(namespace: bytes) -> None:
    with (
        HostTier.open(namespace, ROW_BYTES, budget(4, 2), 2),
        HostTier.open(namespace, ROW_BYTES, budget(4, 2), 2),
        pytest.raises(CapacityError, match="all 2 instance slots"),
    ):
        HostTier.open(namespace, ROW_BYTES, budget(4, 2), 2)
    with pytest.raises(CapacityError, match="none for each of 3 instances"):
        HostTier.open(namespace, ROW_BYTES, budget(2, 3), 3)
    with pytest.raises(InvalidArgumentError, match="16 bytes"):
        HostTier.open(b"short", ROW_BYTES, budget(2, 1), 1)


def test_the_segment_goes_with_the_last_instance_and_blocks_outlive_theirs(
    namespace: bytes,
) -> None:
    a = HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2)
    b = HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2)
    path = segment_path(namespace)
    assert a.path == path
    assert os.path.exists(path)
    store(a, keys(3, 1))
    a.close()
    a.close()  # idempotent
    with pytest.raises(ClosedError):
        a.refresh()
    assert os.path.exists(path)
    b.refresh()
    assert all(loads_exactly(b, k) for k in keys(3, 1))  # a's blocks stay readable
    assert b.statistics().rows_orphaned == 4
    # c takes a's rows, blocks and all
    with HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as c:
        s = c.statistics()
        assert s.rows_adopted == 4
        assert s.own_blocks == 3
        assert s.rows_orphaned == 0
        assert all(loads_exactly(c, k) for k in keys(3, 1))
        assert c.statistics().own_hits == 3
    b.close()
    assert not os.path.exists(path)


def test_statistics_are_a_frozen_record(namespace: bytes) -> None:
    with HostTier.open(namespace, ROW_BYTES, budget(4, 1), 1) as a:
        s = a.statistics()
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.stores = 1  # type: ignore[misc]
        assert s.rows == 4
        assert s.quota == 4
        assert s.rows_held == (4,)


# -- several processes ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_processes_store_their_own_blocks_and_load_the_others(
    namespace: bytes, children: Children, n: int
) -> None:
    procs = [spawn(children, namespace, 8 * n, n) for _ in range(n)]
    slots = sorted(hello(children, p)["slot"] for p in procs)
    assert slots == list(range(n))
    mine = [keys(6, i) for i in range(n)]
    for p, ks in zip(procs, mine, strict=True):
        assert ask(children, p, op="store", keys=[k.hex() for k in ks])["stored"] == [True] * 6
    for i, p in enumerate(procs):
        others = [k.hex() for j, ks in enumerate(mine) if j != i for k in ks]
        out = ask(children, p, op="load", keys=others)
        assert out == {"hits": 6 * (n - 1), "wrong": 0, "missed": []}
    stats = ask(children, procs[0], op="stats")
    assert stats["peer_hits"] == 6 * (n - 1)
    assert stats["stale_peer_reads"] == 0
    assert stats["live_instances"] == n
    assert stats["rows_held"] == [8] * n
    for p in procs:
        assert ask(children, p, op="close") == {"closed": True}
        p.wait()
    assert not os.path.exists(segment_path(namespace))


def test_a_writer_killed_mid_store_leaves_nothing_readable_and_is_adopted(
    namespace: bytes, children: Children
) -> None:
    w = spawn(children, namespace, 8, 2)
    hello(children, w)
    done, torn = keys(3, 1), keys(1, 2)[0]
    ask(children, w, op="store", keys=[k.hex() for k in done])
    assert ask(children, w, op="pause", stage="store", at=1) == {"armed": "store"}
    children.tell(w, json.dumps({"op": "store", "keys": [torn.hex()]}))
    assert children.line(w) == {"paused": "store"}
    with HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as p:
        assert p.statistics().rows_writing == 1
        assert torn not in p
        assert not p.load(torn, memoryview(bytearray(ROW_BYTES)))
        assert all(loads_exactly(p, k) for k in done)
        kill(w)
        s = p.statistics()
        assert s.live_instances == 1
        assert s.rows_orphaned == 4
        assert s.rows_held == (0, 4)
        assert all(loads_exactly(p, k) for k in done)  # a dead owner's blocks stay readable
        # the instance restarted: it adopts the dead one's rows, resets the torn one
        r = spawn(children, namespace, 8, 2)
        hello(children, r)
        rs = ask(children, r, op="stats")
        assert (rs["rows_adopted"], rs["rows_reset"], rs["own_blocks"]) == (4, 1, 3)
        assert rs["rows_writing"] == 0
        assert ask(children, r, op="load", keys=[k.hex() for k in done])["hits"] == 3
        assert ask(children, r, op="stats")["own_hits"] == 3
        p.refresh()
        assert torn not in p
        assert all(loads_exactly(p, k) for k in done)
        check_rows(p.statistics())
        assert ask(children, r, op="close") == {"closed": True}


def test_a_reader_killed_mid_copy_leaves_a_lease_that_expires(
    namespace: bytes, children: Children
) -> None:
    with HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as owner:
        held = keys(4, 1)
        store(owner, held)
        r = spawn(children, namespace, 8, 2)
        hello(children, r)
        ask(children, r, op="pause", stage="load", at=1)
        children.tell(r, json.dumps({"op": "load", "keys": [held[0].hex()]}))
        assert children.line(r) == {"paused": "load"}
        assert owner.statistics().leases_outstanding == 1
        store(owner, keys(4, 2))  # a live reader's row is kept: the other three go
        assert held[0] in owner.own_keys()
        assert owner.statistics().stores_without_room == 1
        kill(r)
        s = owner.statistics()
        assert (s.leases_outstanding, s.leases_expired) == (0, 1)
        assert store(owner, keys(1, 3)) == [True]  # the dead reader's lease is not honoured
        assert held[0] not in owner.own_keys()
        assert owner.cleanup() == 1  # its slot and its leases dropped
        s = owner.statistics()
        assert (s.leases_outstanding, s.leases_expired, s.live_instances) == (0, 0, 1)
        check_rows(s)


@pytest.mark.parametrize("seed", [11, 22, 33])
def test_kills_at_seeded_moments_serve_no_wrong_bytes(
    namespace: bytes, children: Children, seed: int
) -> None:
    rng = random.Random(seed)
    rows, n = 16, 4
    writers = [spawn(children, namespace, rows, n, 0.2) for _ in range(2)]
    readers = [spawn(children, namespace, rows, n, 0.2) for _ in range(2)]
    for p in writers + readers:
        hello(children, p)
    victim_w, victim_r = writers[0], readers[0]
    ask(children, victim_w, op="pause", stage="store", at=rng.randrange(5, 60))
    ask(children, victim_r, op="pause", stage="load", at=rng.randrange(5, 200))
    for i, p in enumerate(writers):
        children.tell(
            p, json.dumps({"op": "storm_store", "seed": seed + i, "seconds": 0.8, "space": 12})
        )
    for i, p in enumerate(readers):
        children.tell(p, json.dumps({"op": "storm_load", "seed": seed + 10 + i, "seconds": 0.8}))
    assert children.line(victim_w) == {"paused": "store"}
    assert children.line(victim_r) == {"paused": "load"}
    kill(victim_w)
    kill(victim_r)
    survivor = children.line(writers[1])
    assert survivor["stored"] > 0
    out = children.line(readers[1])
    assert out["wrong"] == 0, out
    assert out["hits"] > 0, out
    with HostTier.open(namespace, ROW_BYTES, budget(rows, n), n) as restarted:
        s = restarted.statistics()
        check_rows(s)
        assert s.live_instances == 3
        # the restarted instance took the dead writer's rows first, the torn one reset
        assert s.rows_adopted == s.quota
        assert s.rows_reset == 1
        assert s.rows_writing == 0
        assert s.leases_expired == 0  # the dead reader's slot swept at its opening
        restarted.refresh()
        buf = bytearray(ROW_BYTES)
        for k in restarted.held_keys():
            if restarted.load(k, memoryview(buf)):
                assert bytes(buf) == pattern(k)
    for q in (writers[1], readers[1]):
        ask(children, q, op="close")


def test_gc_removes_a_dead_segment_and_a_restart_adopts_it(
    namespace: bytes, children: Children
) -> None:
    w = spawn(children, namespace, 8, 2)
    hello(children, w)
    ks = keys(3, 1)
    ask(children, w, op="store", keys=[k.hex() for k in ks])
    kill(w)
    path = segment_path(namespace)
    assert os.path.exists(path)
    # a restart finds it, adopts the dead instance's blocks, and closing removes it
    with HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2) as r:
        assert r.statistics().rows_adopted == 4
        assert all(loads_exactly(r, k) for k in ks)
        assert reap_host_segments(namespace=namespace) == []  # live: kept
    assert not os.path.exists(path)
    w = spawn(children, namespace, 8, 2)
    hello(children, w)
    kill(w)
    assert reap_host_segments(namespace=namespace, dry_run=True) == [path]
    assert os.path.exists(path)
    assert reap_host_segments(namespace=namespace) == [path]
    assert not os.path.exists(path)
    # a dead segment of another configuration is replaced, not refused
    w = spawn(children, namespace, 8, 2)
    hello(children, w)
    kill(w)
    with HostTier.open(namespace, 4096, budget(8, 1), 1) as other:
        assert other.statistics().rows_adopted == 0
        assert other.geometry.row_bytes == 4096
