"""The scheduler side alone, with vLLM's own types: what no engine run reaches cheaply.

The spec is built from a real ``OffloadingConfig`` and its manager driven as
vLLM's scheduler drives it, in this process (no model, no worker).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigurationError
from tests_vllm._harness import offloading_config, offloading_config_of_vllm


def _manager(events: bool) -> Iterator[Any]:
    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    manager = KVTierOffloadingSpec(offloading_config(events=events)).get_manager()
    try:
        yield manager
    finally:
        manager.shutdown()


@pytest.fixture
def with_events() -> Iterator[Any]:
    yield from _manager(True)


@pytest.fixture
def without_events() -> Iterator[Any]:
    yield from _manager(False)


def _store(manager: Any, n: int) -> list[bytes]:
    """Store ``n`` blocks one by one into 8 rows, as vLLM would: each evicts one."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    ctx = ReqContext(req_id="r")
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(n)]
    for key in keys:
        out = manager.prepare_store([key], ctx)
        assert out is not None
        assert out.keys_to_store == [key]
        manager.complete_store([key], ctx)
    return keys


def test_events_follow_the_cpu_tier(with_events: Any) -> None:
    from vllm.v1.kv_offload.base import Medium

    keys = _store(with_events, 10)
    events = list(with_events.take_events())
    assert all(ev.medium is Medium.CPU for ev in events)
    stored = [k for ev in events if not ev.removed for k in ev.keys]
    removed = [k for ev in events if ev.removed for k in ev.keys]
    assert stored == keys  # vLLM's own keys, in order
    assert removed == keys[:2]  # 8 rows: the two oldest were evicted
    assert list(with_events.take_events()) == []  # taken once
    with_events.reset_cache()
    (reset,) = with_events.take_events()
    assert reset.removed
    assert sorted(reset.keys) == sorted(keys[2:])


def test_events_nobody_takes_are_bounded(with_events: Any) -> None:
    from kvtier.integrations.vllm.spec import MAX_PENDING_EVENT_KEYS

    n = MAX_PENDING_EVENT_KEYS // 2 + 100  # each store announces 2 keys once full
    keys = _store(with_events, n)
    events = list(with_events.take_events())
    kept = sum(len(ev.keys) for ev in events)
    st = with_events.statistics()
    assert kept <= MAX_PENDING_EVENT_KEYS
    assert st.front.events_dropped > 0
    assert kept + st.front.events_dropped == st.front.events_published
    # The newest are kept: the last store is the last event.
    assert events[-1].keys == [keys[-1]]
    assert not events[-1].removed


def test_no_events_unless_vllm_enables_them(without_events: Any) -> None:
    _store(without_events, 10)
    assert list(without_events.take_events()) == []
    assert without_events.statistics().front.events_published == 0


def test_several_groups_need_one_block_per_chunk() -> None:
    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    with pytest.raises(ConfigurationError, match="blocks_per_chunk = 1"):
        KVTierOffloadingSpec(offloading_config(events=False, groups=2, blocks_per_chunk=2))


def test_a_transfer_is_cut_per_group() -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier.errors import LayoutError
    from kvtier.integrations.vllm.spec import RowsSpec, group_segments

    # Group 0: 3 blocks from logical block 0; group 1 empty; group 2: 2 blocks.
    gpu = GPULoadStoreSpec([7, 8, 9, 4, 5], group_sizes=[3, 0, 2], block_indices=[0, 0, 6])
    parts = group_segments(gpu, RowsSpec([10, 11, 12, 13, 14]), 1, store=True)
    assert [(list(ids), rows, skip) for ids, rows, skip in parts] == [
        ([7, 8, 9], [10, 11, 12], 0),
        ([4, 5], [13, 14], 0),
    ]
    # Two blocks a row: group 2 starts in the middle of its first row (a load).
    gpu = GPULoadStoreSpec([7, 8, 9, 4, 5], group_sizes=[3, 0, 2], block_indices=[0, 0, 5])
    with pytest.raises(LayoutError, match="cover"):
        group_segments(gpu, RowsSpec([10, 11, 12, 13, 14]), 2, store=False)
    parts = group_segments(gpu, RowsSpec([10, 11, 12, 13]), 2, store=False)
    assert [(list(ids), rows, skip) for ids, rows, skip in parts] == [
        ([7, 8, 9], [10, 11], 0),
        ([4, 5], [12, 13], 1),
    ]
    with pytest.raises(LayoutError, match="whole rows"):
        group_segments(gpu, RowsSpec([10, 11, 12, 13]), 2, store=True)


def _keys(n: int, start: int = 0) -> list[Any]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + n)]


def test_a_step_larger_than_the_cpu_tier_stores_its_leading_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """4 rows, 23 blocks a step: the 4 leading blocks are stored and reach the file tier."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    file_tier = {"root": str(tmp_path / "kv"), "bytes_to_use": "8MiB"}
    config = offloading_config(rows=4, extra={"file_tier": file_tier})
    manager = KVTierOffloadingSpec(config).get_manager()
    ctx = ReqContext(req_id="r")
    try:
        keys = _keys(23)
        with caplog.at_level(logging.WARNING, logger="kvtier"):
            out = manager.prepare_store(keys, ctx)
            assert out is not None
            assert out.keys_to_store == keys[:4]
            manager.complete_store(out.keys_to_store, ctx)
            # Rows held by their file writes are not reusable: while every one
            # is, the answer is None (vLLM asks again next step), else a prefix.
            new = _keys(5, start=100)
            more = manager.prepare_store(new, ctx)
        taken = 0 if more is None else len(more.keys_to_store)
        assert more is None or more.keys_to_store == new[:taken]
        if more is not None:
            manager.complete_store(more.keys_to_store, ctx)
        st = manager.statistics()
        assert st.tiers["cpu"].written_blocks == 4 + taken
        assert st.store_refusals == 19 + 5 - taken
        warned = [r for r in caplog.records if "Sizing the CPU tier" in r.getMessage()]
        assert len(warned) == 1  # once, with the rule
        deadline = time.monotonic() + 10
        while manager.statistics().tiers["file"].written_blocks < 4 + taken:
            assert time.monotonic() < deadline
            manager.on_schedule_end(None)
            time.sleep(0.01)
        file = manager.statistics().tiers["file"]
        assert (file.written_blocks, file.statistics.blocks) == (4 + taken, 4 + taken)
        # The written rows are evictable again: the next step stores.
        out = manager.prepare_store(_keys(2, start=200), ctx)
        assert out is not None
        assert len(out.keys_to_store) == 2
    finally:
        manager.shutdown()


def test_cpu_hits_and_misses_count_what_vllm_asked(without_events: Any) -> None:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    keys = _store(without_events, 3)
    ctx = ReqContext(req_id="r2")
    assert [without_events.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 3
    assert without_events.lookup(_keys(1, start=999)[0], ctx) == LookupResult.MISS
    st = without_events.statistics()
    assert (st.tiers["cpu"].statistics.hits, st.tiers["cpu"].statistics.misses) == (3, 1)
    assert (st.lookups, st.tiers["cpu"].lookup_hits, st.lookup_misses) == (4, 3, 1)


def test_the_namespace_follows_the_model_not_its_path(model_dir: Path, tmp_path: Path) -> None:
    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    link = tmp_path / "another-name"
    link.symlink_to(model_dir)

    def namespace(model: Path, **extra: Any) -> bytes:
        spec = KVTierOffloadingSpec(offloading_config(model=str(model), extra=extra))
        return bytes(spec.layout.namespace)

    assert namespace(model_dir) == namespace(link)
    assert namespace(model_dir, model_revision="v1") == namespace(tmp_path, model_revision="v1")
    assert namespace(model_dir) != namespace(model_dir, model_revision="v1")


def _namespace_of(config: Any) -> bytes:
    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    return bytes(KVTierOffloadingSpec(config).layout.namespace)


def test_the_namespace_follows_what_the_bytes_mean(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built by vLLM from a real VllmConfig: equal shapes, another meaning, another namespace."""
    import vllm

    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    fp8 = offloading_config_of_vllm(model_dir, cache_dtype="fp8_e4m3")
    base = _namespace_of(fp8)
    # A restart (another engine id), and a patch upgrade of vLLM: the same cache.
    assert _namespace_of(offloading_config_of_vllm(model_dir, cache_dtype="fp8_e4m3")) == base
    monkeypatch.setattr(vllm, "__version__", "0.32.1")
    assert _namespace_of(fp8) == base
    others = {
        # The other fp8: one byte per element too, other values in it.
        "fp8_e5m2": offloading_config_of_vllm(model_dir, cache_dtype="fp8_e5m2"),
        # The page order another attention backend asks for.
        "LBHNC": offloading_config_of_vllm(
            model_dir, cache_dtype="fp8_e4m3", kv_cache_layout="LBHNC"
        ),
    }
    for config in others.values():
        assert config.worker_kv_bytes_per_block == fp8.worker_kv_bytes_per_block
    namespaces = {name: _namespace_of(config) for name, config in others.items()}
    # vLLM's next release, same shapes (LMCache #4463).
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    namespaces["0.33"] = _namespace_of(fp8)
    assert len({base, *namespaces.values()}) == 1 + len(namespaces), namespaces
    # What the namespace took, as the file tier records it (`kvtier inspect --json`).
    encoding = KVTierOffloadingSpec(fp8).layout.describe()["encoding"]
    assert encoding == {
        "format_version": "vllm 0.33",
        "attention_backend": None,
        "kv_cache_layout": "LBNHC",
        "cache_dtype": "fp8_e4m3",
        "scales": "per-tensor from the model",
        "sharding": "tp1 pp1 pcp1 dcp1",
    }


def test_the_namespace_names_the_vllm_release_it_runs_under() -> None:
    """Under each interface ``make test-vllm`` runs, the release that decides the bytes."""
    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    encoding = KVTierOffloadingSpec(offloading_config()).layout.encoding
    assert encoding is not None
    wanted = os.environ.get("KVTIER_VLLM_INTERFACE", "0.32")
    assert encoding.format_version == f"vllm {wanted}"
    assert (encoding.cache_dtype, encoding.sharding) == ("float32", "tp1 pp1 pcp1 dcp1")


def _lookup(manager: Any, keys: list[Any]) -> list[Any]:
    """vLLM's answers for ``keys``, asked again each step while kvtier says RETRY."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    ctx = ReqContext(req_id="lookup")
    answers = []
    for key in keys:
        deadline = time.monotonic() + 10
        while (answer := manager.lookup(key, ctx)) is LookupResult.RETRY:
            assert time.monotonic() < deadline
            manager.on_schedule_end(None)
            time.sleep(0.01)
        answers.append(answer)
    return answers


def test_a_root_written_under_one_meaning_is_a_miss_under_another(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks on file survive a restart of the same configuration, never another meaning."""
    import vllm
    from vllm.v1.kv_offload.base import LookupResult

    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    extra = {"file_tier": {"root": str(tmp_path / "kv"), "bytes_to_use": "64MiB"}}

    def manager(version: str, cache_dtype: str = "fp8_e4m3") -> Any:
        monkeypatch.setattr(vllm, "__version__", version)
        config = offloading_config_of_vllm(model_dir, cache_dtype=cache_dtype, extra=extra)
        return KVTierOffloadingSpec(config).get_manager()

    def write() -> list[Any]:
        writer = manager("0.32.0")
        try:
            keys = _store(writer, 3)
            deadline = time.monotonic() + 10
            # Written through, or already there (recovered at open).
            while writer.statistics().tiers["file"].statistics.blocks < 3:
                assert time.monotonic() < deadline
                writer.on_schedule_end(None)
                time.sleep(0.01)
            return keys
        finally:
            writer.shutdown()

    keys = write()
    # The same configuration restarted after a patch upgrade finds every block.
    again = manager("0.32.1")
    try:
        assert _lookup(again, keys) == [LookupResult.HIT] * 3
        assert again.statistics().tiers["file"].lookup_hits == 3
    finally:
        again.shutdown()
    # Another vLLM release, another fp8: the same bytes per block, never read.
    for version, dtype in (("0.33.0", "fp8_e4m3"), ("0.32.1", "fp8_e5m2")):
        # Written again each time: an open of another namespace may reclaim this one.
        assert write() == keys
        other = manager(version, dtype)
        try:
            assert _lookup(other, keys) == [LookupResult.MISS] * 3, (version, dtype)
            assert other.statistics().tiers["file"].lookup_hits == 0
        finally:
            other.shutdown()


def test_config_info_fills_the_labels_the_spec_declares(tmp_path: Path) -> None:
    """``vllm:kv_offload_config_info`` (vLLM 0.33): one series, every label declared."""
    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    extra = {"file_tier": {"root": str(tmp_path / "kv"), "bytes_to_use": "8MiB"}}
    spec = KVTierOffloadingSpec(offloading_config(extra=extra))
    manager = spec.get_manager()
    try:
        (info,) = manager.config_info()
    finally:
        manager.shutdown()
    assert set(info) == set(KVTierOffloadingSpec.config_info_keys(dict(spec.config.extra_config)))
    assert info["kvtier_cpu_rows"] == 8
    assert info["kvtier_tiers"] == "cpu,file"
    assert info["kvtier_file_io_engine"] in ("io_uring", "threads")


def test_the_interface_under_test_is_the_one_asked_for() -> None:
    """``make test-vllm`` runs this file again over vLLM 0.33's ``kv_offload`` classes."""
    from vllm.v1.kv_offload.base import OffloadingManager, OffloadingWorker

    wanted = os.environ.get("KVTIER_VLLM_INTERFACE", "0.32")
    # 0.33 added the manager's lock and the worker's expedited loads.
    newer = "lock" in OffloadingManager.__dict__
    assert newer == (wanted == "0.33"), (wanted, OffloadingManager.__module__)
    if newer:
        assert "expedited" in OffloadingWorker.submit_load.__code__.co_varnames
