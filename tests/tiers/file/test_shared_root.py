"""One file-tier root shared by live tiers: partitions, the index, verified reads of peers.

Each tier here stands for one instance (in one process: what crosses
processes, and SIGKILLs, are in ``tests/reliability/test_shared_root_kills.py``).
Everything is real: O_DIRECT slot files, the mapped index files, io_uring.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from kvtier._sizes import format_size
from kvtier.config import FileTierConfig
from kvtier.errors import (
    BlockNotFoundError,
    CapacityError,
    ConfigurationError,
    NamespaceMismatchError,
)
from kvtier.layout import KVLayout, TensorSpec
from kvtier.testing.io_engine import aligned_buffer
from kvtier.tiers.base import Watched
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file import FileTier, FileTierStatistics
from kvtier.tiers.file._description import partition_dir_name, split_dir_name
from kvtier.tiers.file._index import IndexReader, SlotIndex
from kvtier.tiers.file._sizing import allocated, disk_usage

BLOCK = 8192
POLL = 0.01


def make_layout(model: str = "m") -> KVLayout:
    spec = TensorSpec(name="kv", shape=(8, 2048), dtype="float16", itemsize=2, kv_first=False)
    return KVLayout(tensors=(spec,), model_id=model, block_tokens=16)


NS = make_layout().namespace.hex()


def keys(n: int, salt: int = 1) -> list[bytes]:
    return [bytes([salt, i]) * 8 for i in range(n)]


class Rows:
    def __init__(self, n: int) -> None:
        self.map = aligned_buffer(n * BLOCK)
        self.n = n

    def rows(self) -> list[memoryview]:
        return [memoryview(self.map)[i * BLOCK : (i + 1) * BLOCK] for i in range(self.n)]

    def block(self, i: int) -> bytes:
        return bytes(self.map[i * BLOCK : (i + 1) * BLOCK])


def pattern_rows(ks: Sequence[bytes]) -> Rows:
    rows = Rows(len(ks))
    for i, k in enumerate(ks):
        rows.map[i * BLOCK : (i + 1) * BLOCK] = k * (BLOCK // len(k))
    return rows


OpenTier = Callable[..., Any]


@pytest_asyncio.fixture
async def open_tier(tmp_path: Path) -> AsyncIterator[OpenTier]:
    opened: list[FileTier] = []

    async def _open(*, blocks: int = 16, instances: int = 2, **cfg: Any) -> FileTier:
        config = FileTierConfig(
            root=tmp_path / "tier",
            bytes_to_use=cfg.pop("budget", None) or instances * FileTier.budget_for(blocks, BLOCK),
            queue_depth=4,
            instances=instances,
            peer_poll_s=cfg.pop("peer_poll_s", POLL),
            **cfg,
        )
        tier = await FileTier.open(config, make_layout(), block_bytes=BLOCK)
        opened.append(tier)
        return tier

    yield _open
    for tier in opened:
        await tier.aclose()


async def until(check: Callable[[], bool], seconds: float = 5.0) -> float:
    """Wait until ``check()``; how long it took."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not check():
        if loop.time() - start > seconds:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)
    return loop.time() - start


# -- the names and the index ------------------------------------------------------------


def test_partition_names_round_trip() -> None:
    assert partition_dir_name(NS, 0) == NS
    assert split_dir_name(NS) == (NS, 0)
    assert split_dir_name(partition_dir_name(NS, 7)) == (NS, 7)
    for bad in (f"{NS}.0", f"{NS}.07", f"{NS}.x", f"{NS}.", f"{NS}.256", NS[:-1], "kvtier.lock"):
        assert split_dir_name(bad) is None, bad


def test_index_publishes_and_withdraws(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    index = SlotIndex(tmp_path, 8)
    reader = IndexReader(tmp_path / "index")
    assert reader.changes() == []
    k1, k2 = keys(2)
    index.publish(3, k1)
    index.publish(5, k2)
    assert sorted(reader.changes()) == [(3, k1), (5, k2)]
    assert reader.changes() == []
    index.withdraw(3)
    index.withdraw(4)  # empty already: no change
    assert reader.changes() == [(3, None)]
    index.rebuild({5: k2, 6: k1})
    assert reader.changes() == [(6, k1)]
    # A new owner replaces the file: an old reader's mapping stays valid.
    again = SlotIndex(tmp_path, 4)
    assert reader.changes() == []
    fresh = IndexReader(tmp_path / "index")
    assert fresh.slots == 4
    assert fresh.inode != reader.inode
    again.publish(0, k1)
    assert fresh.changes() == [(0, k1)]
    for closable in (index, again, reader, fresh):
        closable.close()


def test_index_refuses_what_is_not_one(tmp_path: Path) -> None:
    (tmp_path / "index").write_bytes(b"not an index" * 10)
    with pytest.raises(ValueError, match="not a kvtier index"):
        IndexReader(tmp_path / "index")


# -- two tiers, one root --------------------------------------------------------------


async def test_second_tier_gets_its_own_partition_and_reads_the_first(
    open_tier: OpenTier,
) -> None:
    a = await open_tier()
    b = await open_tier()
    assert a.statistics().partition == NS
    assert b.statistics().partition == f"{NS}.1"
    ks = keys(6)
    rows = pattern_rows(ks)
    assert (await a.store(ks, rows.rows())).stored == tuple(ks)
    took = await until(lambda: b.lookup(ks) == len(ks))
    assert took < 1.0
    assert all(b.is_ready(k) and k in b for k in ks)
    out = Rows(len(ks))
    result = await b.load(ks, out.rows())
    assert result.loaded == tuple(ks)
    assert not result.missing
    for i in range(len(ks)):
        assert out.block(i) == rows.block(i)
    stats = b.statistics()
    assert stats.peer_partitions == 1
    assert stats.peer_blocks == len(ks)
    assert stats.peer_hits == len(ks)
    assert stats.hits == len(ks)
    assert stats.blocks == 0  # nothing of its own
    # And the other way round, in one call mixing its own blocks with the peer's.
    mine = keys(3, salt=9)
    await b.store(mine, pattern_rows(mine).rows())
    await until(lambda: a.lookup(mine) == len(mine))
    both = [*ks[:2], *mine]
    out = Rows(len(both))
    result = await b.load(both, out.rows())
    assert result.loaded == tuple(both)
    expected = pattern_rows(both)
    assert all(out.block(i) == expected.block(i) for i in range(len(both)))


async def test_watch_reports_peers_blocks_coming_and_going(open_tier: OpenTier) -> None:
    a = await open_tier()
    early = keys(2)
    await a.store(early, pattern_rows(early).rows())
    b = await open_tier()
    assert isinstance(b, Watched)  # the Protocol the vLLM front follows it through
    assert isinstance(b, FileTier)
    seen: dict[bytes, bool] = {}

    def listener(added: Sequence[bytes], removed: Sequence[bytes]) -> None:
        seen.update(dict.fromkeys(removed, False))
        seen.update(dict.fromkeys(added, True))

    b.watch(listener)
    assert seen == dict.fromkeys(early, True)  # what the root held at once
    later = keys(3, salt=2)
    await a.store(later, pattern_rows(later).rows())
    await until(lambda: all(seen.get(k) for k in later))
    a.remove(early)
    await until(lambda: not any(seen.get(k) for k in early))
    assert b.lookup(early) == 0


async def test_a_slot_rewritten_under_a_reader_is_a_counted_miss(open_tier: OpenTier) -> None:
    a = await open_tier(blocks=4)
    ks = keys(4)
    await a.store(ks, pattern_rows(ks).rows())
    # b never polls again after its open: its view of a's slots goes stale.
    b = await open_tier(blocks=4, peer_poll_s=10)
    assert b.lookup(ks) == 4
    # a evicts every block and reuses the slots for others (it owns them).
    others = keys(4, salt=3)
    assert len((await a.store(others, pattern_rows(others).rows())).evicted) == 4
    out = Rows(4)
    result = await b.load(ks, out.rows())
    assert result.loaded == ()
    assert all(isinstance(e, BlockNotFoundError) for e in result.missing.values())
    stats = b.statistics()
    assert stats.peer_stale == 4
    assert stats.misses == 4
    assert stats.quarantined == 0
    assert a.statistics().quarantined == 0
    assert not any((a.path / "quarantine").iterdir())
    # Not wrong bytes, and not damage: a serves its new blocks as before.
    again = Rows(4)
    assert (await a.load(others, again.rows())).loaded == tuple(others)
    assert b.lookup(ks) == 0  # forgotten until the index says otherwise


async def test_instances_split_the_budget(open_tier: OpenTier, tmp_path: Path) -> None:
    budget = 4 * FileTier.budget_for(16, BLOCK)
    tiers = [await open_tier(budget=budget, instances=4) for _ in range(4)]
    assert [t.statistics().partition for t in tiers] == [
        partition_dir_name(NS, n) for n in range(4)
    ]
    slots = [t.statistics().capacity_bytes // (HEADER_BYTES + BLOCK) for t in tiers]
    assert min(slots) >= 14
    assert max(slots) <= 16
    for n, t in enumerate(tiers):  # every slot written: the most the root can take
        ks = keys(slots[n], salt=10 + n)
        assert len((await t.store(ks, pattern_rows(ks).rows())).stored) == len(ks)
    assert disk_usage(tmp_path / "tier") <= budget
    # A fifth finds no room, and says how the budget is split.
    with pytest.raises(CapacityError, match="instances"):
        await open_tier(budget=budget, instances=4)
    assert sorted(os.listdir(tmp_path / "tier")) == sorted(
        ["kvtier.lock", *(partition_dir_name(NS, n) for n in range(4))]
    )


async def test_a_closed_partition_is_adopted_and_stays_readable(
    open_tier: OpenTier,
) -> None:
    a = await open_tier()
    b = await open_tier()
    ks = keys(5)
    rows = pattern_rows(ks)
    await b.store(ks, rows.rows())
    await b.aclose()
    # Its blocks stay readable by a with nobody owning them (once a's poll has seen
    # them: a fixed sleep of a few polls lost the race on a loaded machine).
    await until(lambda: a.lookup(ks) == 5)
    out = Rows(5)
    assert (await a.load(ks, out.rows())).loaded == tuple(ks)
    # The next tier to open adopts partition 1 (not a new one) and its blocks.
    c = await open_tier()
    assert c.statistics().partition == f"{NS}.1"
    assert c.statistics().recovered_blocks == 5
    out = Rows(5)
    assert (await c.load(ks, out.rows())).loaded == tuple(ks)
    assert all(out.block(i) == rows.block(i) for i in range(5))
    await until(lambda: a.lookup(ks) == 5)


# -- what every instance must agree on ------------------------------------------------


async def test_an_instance_with_another_block_size_is_refused(
    open_tier: OpenTier, tmp_path: Path
) -> None:
    root = tmp_path / "tier"
    a = await open_tier()
    ks = keys(4)
    await a.store(ks, pattern_rows(ks).rows())
    config = FileTierConfig(
        root=root,
        bytes_to_use=2 * FileTier.budget_for(16, BLOCK),
        queue_depth=4,
        instances=2,
        peer_poll_s=POLL,
    )
    # The same layout (so the same namespace) with rows of another size:
    # refused, not given a partition whose keys a would count and never load.
    with pytest.raises(NamespaceMismatchError) as info:
        await FileTier.open(config, make_layout(), block_bytes=2 * BLOCK)
    message = str(info.value)
    assert str(a.path) in message
    assert "open in a live file tier" in message
    assert f"{BLOCK} bytes" in message
    assert f"{2 * BLOCK}-byte blocks" in message
    assert sorted(os.listdir(root)) == sorted(["kvtier.lock", NS])
    # A partition of another block size left by a kvtier that did not check
    # (made here on another root, then moved in) is never read by a.
    elsewhere = tmp_path / "elsewhere"
    other = await FileTier.open(
        FileTierConfig(root=elsewhere, bytes_to_use=FileTier.budget_for(4, 2 * BLOCK)),
        make_layout(),
        block_bytes=2 * BLOCK,
    )
    theirs = keys(3, salt=7)
    wide = aligned_buffer(3 * 2 * BLOCK)
    views = [memoryview(wide)[i * 2 * BLOCK : (i + 1) * 2 * BLOCK] for i in range(3)]
    assert (await other.store(theirs, views)).stored == tuple(theirs)
    await other.aclose()
    os.rename(elsewhere / NS, root / f"{NS}.1")
    a._peers.scan()  # what a's next listing of the root does
    a._peers.poll()
    assert a.statistics().peer_partitions == 0
    assert a.lookup(theirs) == 0
    assert a.lookup(ks) == len(ks)  # its own, as before


async def test_an_instance_with_another_budget_is_refused_naming_both(
    open_tier: OpenTier, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "tier"
    budget = 2 * FileTier.budget_for(16, BLOCK)
    a = await open_tier(budget=budget)
    for wrong in (2 * budget, budget - 4096):
        with pytest.raises(ConfigurationError) as info:
            await open_tier(budget=wrong)
        message = str(info.value)
        assert f"bytes_to_use ({format_size(wrong)})" in message
        assert f"{format_size(budget)} ({NS})" in message
    assert sorted(os.listdir(root)) == sorted(["kvtier.lock", NS])
    # Another model on the root with another budget is warned of, naming both.
    with caplog.at_level(logging.WARNING, logger="kvtier.file_tier"):
        other = await FileTier.open(
            FileTierConfig(root=root, bytes_to_use=2 * budget, instances=4),
            make_layout("other model"),
            block_bytes=BLOCK,
        )
    await other.aclose()
    (said,) = [r.getMessage() for r in caplog.records if "differs" in r.getMessage()]
    assert f"bytes_to_use ({format_size(2 * budget)})" in said
    assert f"{format_size(budget)} ({NS})" in said
    # The same budget is welcome; once nobody is open, so is another one.
    b = await open_tier(budget=budget)
    assert b.statistics().partition == f"{NS}.1"
    await a.aclose()
    await b.aclose()
    c = await open_tier(budget=2 * budget)
    assert c.statistics().partition == NS
    assert json.loads((c.path / "namespace.json").read_text())["bytes_to_use"] == 2 * budget


async def test_reclaiming_a_partition_a_live_peer_reads_frees_its_blocks_at_once(
    open_tier: OpenTier, tmp_path: Path
) -> None:
    root = tmp_path / "tier"
    budget = 2 * FileTier.budget_for(16, BLOCK)
    # Neither lists the root on its own during the test (every 10 s).
    a = await open_tier(budget=budget, peer_poll_s=10)
    b = await open_tier(budget=budget, peer_poll_s=10)
    n = b.statistics().capacity_bytes // (HEADER_BYTES + BLOCK)
    ks = keys(n, salt=5)
    await b.store(ks, pattern_rows(ks).rows())
    await b.aclose()
    a._peers.scan()
    a._peers.poll()
    assert a.lookup(ks) == n
    (part,) = a._peers._parts.values()
    assert os.fstat(part.fd).st_blocks * 512 >= n * (HEADER_BYTES + BLOCK)
    index = allocated(b.path / "index")
    # Another model opens on the root and reclaims b's partition (nobody has
    # it open) for room, while a still holds its slot file and maps its index.
    other = await FileTier.open(
        FileTierConfig(root=root, bytes_to_use=budget, instances=2, queue_depth=4),
        make_layout("other model"),
        block_bytes=BLOCK,
    )
    try:
        assert not b.path.exists()
        # The slot file's blocks are freed though a holds it open; its index
        # stays allocated under a's mapping, and counted.
        assert os.fstat(part.fd).st_blocks == 0
        assert disk_usage(root) + index <= budget
        # a's reads of it are misses (short reads), never wrong bytes.
        out = Rows(n)
        result = await a.load(ks, out.rows())
        assert result.loaded == ()
        assert all(isinstance(e, BlockNotFoundError) for e in result.missing.values())
        assert a.statistics().peer_stale == n
        assert a.lookup(ks) == 0
        a._peers.scan()  # its next listing lets go of the partition
        assert a.statistics().peer_partitions == 0
    finally:
        await other.aclose()


# -- the Engine front -----------------------------------------------------------------


async def test_two_engines_on_one_root_serve_each_others_prefixes(tmp_path: Path) -> None:
    import torch

    from kvtier import Engine, KVTierConfig, chain_keys

    def kv() -> list[torch.Tensor]:
        return [torch.zeros(2, 32, 4, 64, dtype=torch.float16) for _ in range(2)]

    kv_a, kv_b = kv(), kv()
    layout = KVLayout.from_tensors(kv_a, model_id="shared", block_tokens=4, num_blocks=32)
    row = -(-layout.bytes_per_chunk // 4096) * 4096

    def config() -> KVTierConfig:
        return KVTierConfig(
            cpu_bytes_to_use=8 * row,
            file_tier=FileTierConfig(
                root=tmp_path / "kv",
                bytes_to_use=2 * FileTier.budget_for(64, row),
                instances=2,
                peer_poll_s=POLL,
            ),
        )

    async with (
        await Engine.open(config(), layout, kv_a) as a,
        await Engine.open(config(), layout, kv_b) as b,
    ):
        ks = chain_keys(list(range(6 * 4)), 4, a.namespace)
        for t in kv_a:
            t[:, :6].copy_(torch.randn(2, 6, 4, 64, dtype=torch.float16))
        await a.store(ks, list(range(6)))
        await a.flush()  # written through to a's partition
        await until(lambda: b.lookup(ks) == len(ks))
        assert await b.load(ks, list(range(10, 16))) == len(ks)
        for x, y in zip(kv_a, kv_b, strict=True):
            assert torch.equal(x[:, :6], y[:, 10:16])
        own = b.statistics().tiers["file"].statistics
        assert isinstance(own, FileTierStatistics)
        assert own.peer_hits == len(ks)
        assert own.partition.endswith(".1")


async def test_a_partition_dropped_under_a_read_keeps_its_descriptor_until_the_read_ends(
    open_tier: OpenTier,
) -> None:
    # Neither tier polls or lists the root on its own during the test (every
    # 10 s): the descriptors counted are those the test's steps open and close.
    a = await open_tier(peer_poll_s=10)
    ks = keys(6)
    rows = pattern_rows(ks)
    await a.store(ks, rows.rows())
    b = await open_tier(peer_poll_s=10)  # b's view changes only where the test says
    assert b.lookup(ks) == len(ks)
    fds_before = len(os.listdir("/proc/self/fd"))
    (old,) = b._peers._parts.values()
    out = Rows(len(ks))
    pending = b.load(ks, out.rows())  # submitted: reads in flight on a's slot file
    # A new owner replaced a's index meanwhile: b drops the partition and maps it again.
    index = a.path / "index"
    copy = a.path / "tmp" / "index.copy"
    copy.write_bytes(index.read_bytes())
    os.replace(copy, index)
    b._peers.scan()  # what b's next listing of the root does
    # Nothing has yielded since the load: its reads are in flight, so the old
    # descriptor stays open beside the new one (closed at once, its number
    # could name another file under the reads still queued).
    assert old.dropped
    assert old.reads == 1
    assert os.fstat(old.fd).st_ino == (a.path / "blocks.dat").stat().st_ino
    (new,) = b._peers._parts.values()
    assert new is not old
    assert new.fd != old.fd
    result = await pending
    assert result.loaded == tuple(ks)  # the reads finished on the descriptor they began on
    assert all(out.block(i) == rows.block(i) for i in range(len(ks)))
    await asyncio.sleep(0)
    # The dropped partition's descriptor is closed once its read ended: one
    # descriptor and one mapping for a's partition, as before.
    assert old.reads == 0
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert b.statistics().peer_partitions == 1
