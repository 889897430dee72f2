"""kvtier as a secondary tier below vLLM 0.33's CPU tier, driven by vLLM's own manager.

No engine and no GPU: vLLM's real ``TieringOffloadingSpec`` builds its real
``TieringOffloadingManager`` over a real primary CPU region (``/dev/shm``), with
kvtier's :class:`~kvtier.integrations.vllm.tier.KVTierSecondaryTier` loaded by
module path; the test plays the scheduler (holding the manager's lock) and
the GPU worker (writing bytes into the slots ``prepare_store`` gave). Needs
vLLM 0.33's Python: ``make test-vllm`` runs this file over the 0.33 wheel.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM: run `make test-vllm`")
if tuple(int(p) for p in vllm.__version__.split(".")[:2]) < (0, 33):
    pytest.skip(
        f"needs vLLM 0.33's tiered offloading (this is {vllm.__version__}): make test-vllm "
        "runs this file over the 0.33 wheel's Python",
        allow_module_level=True,
    )

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from kvtier.errors import ConfigurationError  # noqa: E402
from kvtier.integrations.vllm.tier import KVTierSecondaryTier  # noqa: E402
from tests_vllm._harness import single_rank  # noqa: E402

ROW = 3 * 4096 + 100  # bytes per block per worker: deliberately not page-aligned
SLOTS = 4
KVTIER = {"type": "KVTierSecondaryTier", "module_path": "kvtier.integrations.vllm.tier"}


def _config(tiers: Sequence[dict[str, Any]], model: str = "tiny/secondary") -> OffloadingConfig:
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0.attn",), group_id=0),
        ),
        worker_kv_bytes_per_block=ROW,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": SLOTS * 16384,
            "secondary_tiers": list(tiers),
        },
        engine_id=f"kvtier-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=single_rank(),
    )


def _kvtier(root: Path, **more: Any) -> dict[str, Any]:
    return {**KVTIER, "file_tier": {"root": str(root), "bytes_to_use": "64MiB"}, **more}


class Scheduler:
    """vLLM's manager, driven as its scheduler and GPU worker drive it."""

    def __init__(self, tiers: Sequence[dict[str, Any]]) -> None:
        self.spec = OffloadingSpecFactory.create_spec(_config(tiers))
        self.mgr = self.spec.get_manager()
        view = self.mgr.primary_tier.get_kv_memoryview()
        self.stride = view.strides[0]
        self.flat = view.cast("B")  # (the view itself is the one every tier was given)

    def payload(self, i: int) -> bytes:
        return hashlib.shake_256(b"blk%d" % i).digest(self.stride)

    def step(self) -> None:
        with self.mgr.lock:
            self.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        self.step()
        while time.monotonic() < deadline:
            with self.mgr.lock:
                if not self.mgr.has_pending_work():
                    return
            time.sleep(0.005)
            self.step()
        raise AssertionError("vLLM's manager kept pending work")

    def store(self, rid: str, keys: list[bytes], first: int) -> list[int]:
        ctx = ReqContext(req_id=rid)
        with self.mgr.lock:
            self.mgr.on_new_request(ctx)
            out = self.mgr.prepare_store(keys, ctx)
        chunks = [int(c) for c in out.store_spec.chunk_ids]
        for j, cid in enumerate(chunks):  # the GPU worker's copy into the primary
            i = first + keys.index(out.keys_to_store[j])
            self.flat[cid * self.stride : (cid + 1) * self.stride] = self.payload(i)
        with self.mgr.lock:
            self.mgr.complete_store(out.keys_to_store, ctx)  # cascades to the secondary tiers
        self.settle()
        with self.mgr.lock:
            self.mgr.on_request_finished(ctx)
        return chunks

    def lookup(self, rid: str, keys: list[bytes], rounds: int = 400) -> list[Any]:
        ctx = ReqContext(req_id=rid)
        with self.mgr.lock:
            self.mgr.on_new_request(ctx)
        res: list[Any] = []
        for _ in range(rounds):
            with self.mgr.lock:
                res = [self.mgr.lookup(k, ctx) for k in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
                break
            self.step()
            time.sleep(0.005)
        with self.mgr.lock:
            self.mgr.on_request_finished(ctx)
        return res

    def load(self, rid: str, keys: list[bytes]) -> list[bytes]:
        """Look ``keys`` up until each is a HIT, load them: each slot's bytes."""
        assert self.lookup(rid, keys) == [LookupResult.HIT] * len(keys)
        ctx = ReqContext(req_id=rid + "-load")
        with self.mgr.lock:
            self.mgr.on_new_request(ctx)
            for k in keys:
                assert self.mgr.lookup(k, ctx) is LookupResult.HIT
            spec = self.mgr.prepare_load(keys, ctx)
        got = [
            bytes(self.flat[int(c) * self.stride : (int(c) + 1) * self.stride])
            for c in spec.chunk_ids
        ]
        with self.mgr.lock:
            self.mgr.complete_load(keys, ctx)
            self.mgr.on_request_finished(ctx)
        return got

    def kvtier(self) -> KVTierSecondaryTier:
        return next(t for t in self.mgr.secondary_tiers if isinstance(t, KVTierSecondaryTier))

    def evict_all(self, first: int) -> None:
        """Store SLOTS other blocks: the primary evicts every block it held."""
        self.store(f"evict-{first}", _keys(first, SLOTS), first)

    def close(self) -> None:
        self.flat.release()
        self.mgr.shutdown()


def _keys(first: int, n: int) -> list[bytes]:
    return [
        make_offload_key(hashlib.sha256(b"k%d" % i).digest(), 0) for i in range(first, first + n)
    ]


@contextmanager
def scheduler(tiers: Sequence[dict[str, Any]]) -> Iterator[Scheduler]:
    s = Scheduler(tiers)
    try:
        yield s
    finally:
        s.close()


def test_the_cascade_reaches_kvtier_and_promotions_come_back_byte_for_byte(
    tmp_path: Path,
) -> None:
    with scheduler([_kvtier(tmp_path)]) as s:
        tier = s.kvtier()
        assert tier.front.slots.row_stride == s.stride == 16384
        s.store("r1", _keys(0, SLOTS), 0)
        st = tier.front.statistics()
        assert st.tiers["file"].written_blocks == SLOTS  # every block written through
        s.evict_all(100)
        s.flat[:] = bytes(len(s.flat))
        got = s.load("r3", _keys(0, 2))  # promoted from kvtier's file tier
        assert got == [s.payload(0), s.payload(1)]
        assert tier.front.statistics().tiers["file"].read_blocks == 2
        stats = tier.get_stats()
        assert stats is not None
        assert not stats.is_empty()
        info = s.mgr.config_info()
        assert any(i.get("kvtier_tiers") == "file" for i in info)


def test_a_restart_finds_the_file_tiers_blocks(tmp_path: Path) -> None:
    with scheduler([_kvtier(tmp_path)]) as s:
        s.store("r1", _keys(0, SLOTS), 0)
        payloads = [s.payload(i) for i in range(SLOTS)]
    with scheduler([_kvtier(tmp_path)]) as s:  # a new instance: its primary is empty
        assert s.load("after-restart", _keys(0, SLOTS)) == payloads


def test_a_small_file_tier_evicts_and_never_serves_an_evicted_block(tmp_path: Path) -> None:
    # Room for about 8 blocks (one 4 KiB header + 16 KiB each) in the namespace's slot file.
    tier = {**KVTIER, "file_tier": {"root": str(tmp_path), "bytes_to_use": 8 * 20480}}
    with scheduler([tier]) as s:
        for r in range(6):  # 24 blocks through a tier that holds fewer
            s.store(f"r{r}", _keys(r * SLOTS, SLOTS), r * SLOTS)
        answers = s.lookup("old-and-new", _keys(0, 24))
        hits = [i for i, a in enumerate(answers) if a is LookupResult.HIT]
        assert answers[0] is LookupResult.MISS  # the oldest went
        file_stats = s.kvtier().front.tier_statistics()["file"]
        assert file_stats.used_bytes <= 8 * 20480
        # What it still holds loads back byte for byte.
        held = [k for i, k in enumerate(_keys(0, 24)) if i in hits and i < 20]
        if held:
            s.evict_all(1000)
            first = _keys(0, 24).index(held[0])
            assert s.load("held", [held[0]]) == [s.payload(first)]


def test_kvtier_beside_vllms_own_fs_tier_in_one_manager(tmp_path: Path) -> None:
    fs_root = tmp_path / "vllm-fs"
    tiers = [
        _kvtier(tmp_path / "kvtier"),
        {"type": "fs", "root_dir": str(fs_root), "n_read_threads": 2, "n_write_threads": 2},
    ]
    with scheduler(tiers) as s:
        s.store("r1", _keys(0, SLOTS), 0)
        assert s.kvtier().front.statistics().tiers["file"].written_blocks == SLOTS
        assert len([p for p in fs_root.rglob("*.bin")]) == SLOTS  # the cascade reached both
        s.evict_all(100)
        s.flat[:] = bytes(len(s.flat))
        assert s.load("r3", _keys(0, 2)) == [s.payload(0), s.payload(1)]


def test_a_damaged_block_is_a_failed_promotion_and_then_a_miss(tmp_path: Path) -> None:
    with scheduler([_kvtier(tmp_path)]) as s:
        s.store("r1", _keys(0, 2), 0)
        s.evict_all(100)
        for path in tmp_path.rglob("*"):  # flip a payload byte of every block on disk
            if path.is_file() and path.stat().st_size >= 16384 + 4096:
                with open(path, "r+b") as f:
                    for off in range(4096 + 7, path.stat().st_size, 16384 + 4096):
                        f.seek(off)
                        b = f.read(1)
                        f.seek(off)
                        f.write(bytes([b[0] ^ 0xFF]))
        ctx = ReqContext(req_id="damaged")
        keys = _keys(0, 2)
        with s.mgr.lock:
            s.mgr.on_new_request(ctx)
            first = [s.mgr.lookup(k, ctx) for k in keys]
        s.settle()
        assert LookupResult.MISS in s.lookup("after", keys)  # the damaged ones are forgotten
        assert first  # vLLM saw them before they were read
        st = s.kvtier().front.statistics()
        assert st.tiers["file"].read_failures >= 1


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"bogus": 1}, "bogus"),
        ({"file_tier": None}, "at least one of"),
        ({"lookup_deadline_s": 0}, "lookup_deadline_s"),
        ({"model_revision": ""}, "model_revision"),
        (
            {"file_tier": {"root": "/tmp", "bytes_to_use": "1GiB", "write_policy": "write_back"}},
            "write_policy",
        ),
    ],
)
def test_bad_configuration_is_refused_with_the_key_named(
    tmp_path: Path, entry: dict[str, Any], named: str
) -> None:
    tier = _kvtier(tmp_path)
    tier.update(entry)
    if tier.get("file_tier") is None:
        del tier["file_tier"]
    with pytest.raises(ConfigurationError, match=named):
        Scheduler([tier])


def test_shutdown_releases_vllms_primary_region(tmp_path: Path) -> None:
    s = Scheduler([_kvtier(tmp_path)])
    s.store("r1", _keys(0, 2), 0)
    s.evict_all(100)
    s.load("r2", _keys(0, 1))
    tier = s.kvtier()
    region = s.spec._scheduler_mmap
    assert region.mmap_obj is not None
    s.close()
    assert tier.front.closed
    # vLLM unmapped its region: kvtier kept no view of it ("Keeping ... mapped" otherwise).
    assert region.mmap_obj is None


def test_the_documented_configuration_builds_vllms_manager_with_kvtier(tmp_path: Path) -> None:
    import json
    import re

    text = (Path(__file__).parents[1] / "docs" / "vllm.md").read_text()
    section = text[text.index("## Below vLLM 0.33's CPU tier") :]
    block = re.search(r"```json\n(.*?)```", section, re.S)
    assert block is not None
    doc = json.loads(block.group(1))
    assert doc["kv_connector"] == "OffloadingConnector"
    extra = doc["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    (entry,) = extra["secondary_tiers"]
    entry["file_tier"] = {**entry["file_tier"], "root": str(tmp_path), "bytes_to_use": "64MiB"}
    with scheduler([entry]) as s:  # the doc's entry, on this machine's paths and sizes
        s.store("r1", _keys(0, 2), 0)
        s.evict_all(100)
        assert s.load("r2", _keys(0, 2)) == [s.payload(0), s.payload(1)]
