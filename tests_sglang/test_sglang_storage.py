"""kvtier as SGLang 0.5.23's HiCache L3 backend, against SGLang's real classes (CPU).

The pools are SGLang's own (``MHATokenToKVPool`` / ``MLATokenToKVPool`` on
``device="cpu"``, their host pools ``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost`` in each layout), the backend is built by SGLang's
``StorageBackendFactory`` from the documented JSON, and the page functions are
a real ``HiCacheController``'s (attached as SGLang's own unit tests attach it:
no threads, no process groups). Keys come from SGLang's ``get_hash_str`` (its
native page hash: compiled on first use into ~/.cache/torch_extensions).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.managers.cache_controller import (
    HiCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.runtime_context import get_parallel

from kvtier.errors import ConfigurationError
from kvtier.integrations.sglang import KVTierHiCacheStorage

PAGE = 64
TOKENS = 768
PAGES = TOKENS // PAGE

DOC = Path(__file__).resolve().parents[1] / "docs" / "sglang.md"
MARKER = "<!-- tested: tests_sglang/test_sglang_storage.py -->"


def documented() -> dict[str, Any]:
    """The extra config of docs/sglang.md, as its JSON block shows it."""
    block = DOC.read_text().split(MARKER, 1)[1].split("```json", 1)[1].split("```", 1)[0]
    extra: dict[str, Any] = json.loads(block)
    return extra


# A fixed queue depth: "auto" measures the depths at every open (about 1 s each).
FAST = {"queue_depth": 32}


# -- SGLang's objects ----------------------------------------------------------------------


def mha_pools(
    layout: str, *, dtype: torch.dtype = torch.bfloat16, layers: int = 2, ratio: float = 1.0
) -> tuple[Any, Any]:
    dev = MHATokenToKVPool(
        size=2048,
        page_size=PAGE,
        dtype=dtype,
        head_num=2,
        head_dim=64,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    host = MHATokenToKVPoolHost(
        dev._mha_buffer_info(),
        host_to_device_ratio=ratio,
        host_size=0,
        page_size=PAGE,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=2048,
        start_layer=0,
        end_layer=layers - 1,
    )
    return dev, host


def mla_pools(layout: str, *, layers: int = 2, ratio: float = 1.0) -> tuple[Any, Any]:
    dev = MLATokenToKVPool(
        size=2048,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    host = MLATokenToKVPoolHost(
        dev._mla_buffer_info(),
        host_to_device_ratio=ratio,
        host_size=0,
        page_size=PAGE,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=2048,
        start_layer=0,
        end_layer=layers - 1,
        target_layer_num=layers,
    )
    return dev, host


POOLS = {"mha": mha_pools, "mla": mla_pools}


def storage_config(
    host: Any,
    extra: dict[str, Any] | None,
    *,
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str = "lab/tiny",
    metrics: bool = False,
) -> Any:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=host.layout == "page_first",
        model_name=model,
        extra_config=extra,
    )


def extra_config(root: Path, **kvtier: Any) -> dict[str, Any]:
    """The documented extra config, for a small file tier under ``root`` (and ``kvtier`` keys)."""
    extra = documented()
    extra["kvtier"]["file_tier"].update(root=str(root), bytes_to_use="256MiB", **FAST)
    extra["kvtier"].update(kvtier)
    return extra


def backend_for(host: Any, extra: dict[str, Any], **config: Any) -> KVTierHiCacheStorage:
    """What SGLang's controller does: the factory, then the host pool's registration."""
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(host, extra, **config), host
    )
    backend.register_mem_pool_host(host)
    assert isinstance(backend, KVTierHiCacheStorage)
    return backend


def controller_for(host: Any, extra: dict[str, Any], *, mla: bool = False) -> Any:
    """A real HiCacheController, attached as SGLang's own unit tests do (no threads)."""
    c = object.__new__(HiCacheController)
    c.enable_storage = False
    c.storage_stop_event = threading.Event()
    c.storage_host_pool = c.mem_pool_host = host
    c.host_memory_mode = "cache"
    c.page_size = host.page_size
    c._stop_storage_threads = c._start_storage_threads = lambda: None
    c._create_sync_groups = lambda: []
    c._destroy_sync_groups = lambda groups: None
    c._registers_host_pools_after_super_attach = False
    c._generate_storage_config = lambda model_name, extra_config: storage_config(
        host, extra_config, mla=mla, model=model_name
    )
    with get_parallel().override(attn_dcp_size=1):
        c.attach_storage_backend(
            "dynamic",
            prefetch_threshold=PAGE,
            model_name="lab/tiny",
            storage_backend_extra_config=extra,
        )
    return c


# -- pages ---------------------------------------------------------------------------------


def prompt_keys(first_token: int) -> list[str]:
    """SGLang's 12 page keys of a 768-token prompt (64-char hex, chained)."""
    keys: list[str] = get_hash_str(list(range(first_token, first_token + TOKENS)), None, PAGE)
    assert len(keys) == PAGES
    assert all(len(k) == 64 for k in keys)
    return keys


def page_bytes(host: Any) -> int:
    return int(host.get_data_page(0).numel() * host.dtype.itemsize)


def random_pages(host: Any, seed: int, n: int = PAGES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (page_bytes(host),), generator=g, dtype=torch.uint8) for _ in range(n)
    ]


def fill(host: Any, indices: torch.Tensor, pages: list[torch.Tensor]) -> None:
    for i, want in enumerate(pages):
        page = host.get_data_page(int(indices[i * PAGE]), flat=False)
        page.copy_(want.view(host.dtype).view(page.shape))


def zero(host: Any, indices: torch.Tensor) -> None:
    for i in range(len(indices) // PAGE):
        host.get_data_page(int(indices[i * PAGE]), flat=False).zero_()


def read(host: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    return [
        host.get_data_page(int(indices[i * PAGE])).view(torch.uint8)
        for i in range(len(indices) // PAGE)
    ]


def same(host: Any, indices: torch.Tensor, pages: list[torch.Tensor]) -> bool:
    got = read(host, indices)
    return len(got) == len(pages) and all(
        torch.equal(a, b) for a, b in zip(got, pages, strict=True)
    )


def roundtrip(
    ctl: Any, host: Any, keys: list[str], want: list[torch.Tensor]
) -> tuple[int, int, bool]:
    """SGLang's storage test at the controller's level: back the pages up, drop the
    host copy, prefetch into fresh host slots; (tokens backed up, pages read, equal)."""
    tokens = list(range(TOKENS))
    hi = host.alloc(TOKENS)
    fill(host, hi, want)
    op = StorageOperation(hi, tokens, hash_value=list(keys))
    ctl._page_backup(op)  # -> batch_set_v1
    host.free(hi)
    hi2 = host.alloc(TOKENS)
    zero(host, hi2)
    pop = PrefetchOperation("r", tokens)
    pop.hash_value = list(keys)
    pop.host_indices = hi2
    ctl.prefetch_sync_queue = queue.Queue()
    n = ctl._page_transfer(pop)  # -> batch_get_v1
    equal = same(host, hi2, want)
    host.free(hi2)
    return op.completed_tokens, n, equal


@pytest.fixture(scope="module")
def keys() -> list[str]:
    return prompt_keys(1000)


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Backends to close at the end of the test, whatever happens."""
    backends: list[Any] = []
    yield backends
    for b in backends:
        b.close()


# -- 1. the factory and the controller -----------------------------------------------------


def test_the_dynamic_factory_builds_kvtier_from_the_documented_json(
    tmp_path: Path, closing: list[Any]
) -> None:
    # The command line of docs/sglang.md passes the same JSON as its laid-out block.
    text = DOC.read_text()
    flag = "--hicache-storage-backend-extra-config '"
    assert json.loads(text.split(flag, 1)[1].split("'", 1)[0]) == documented()
    assert documented()["interface_v1"] == 1

    _dev, host = mha_pools("page_first")
    extra = extra_config(tmp_path)
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(host, dict(extra)), host
    )
    closing.append(backend)
    assert type(backend) is KVTierHiCacheStorage
    assert backend.direct is None  # no host pool yet: every call a miss
    assert backend.batch_exists(["0" * 64]) == 0
    backend.register_mem_pool_host(host)
    assert backend.direct is False
    assert backend.batch_exists(["0" * 64]) == 0

    ctl = controller_for(host, extra_config(tmp_path / "ctl"))
    closing.append(ctl.storage_backend)
    assert isinstance(ctl.storage_backend, KVTierHiCacheStorage)
    assert ctl.page_get_func.__name__ == "_page_get_zero_copy"
    assert ctl.page_set_func.__name__ == "_page_set_zero_copy"
    assert ctl.storage_backend.mem_pool_host is host


# -- 2. SGLang's storage test through the controller, per layout ----------------------------


@pytest.mark.parametrize(
    ("kind", "layout", "direct"),
    [
        ("mha", "page_first", False),
        ("mha", "layer_first", False),
        ("mha", "page_first_direct", False),
        ("mla", "page_first_direct", True),
        ("mla", "page_first", True),
        ("mla", "layer_first", False),
    ],
)
def test_pages_go_down_and_come_back_through_the_controller(
    kind: str, layout: str, direct: bool, keys: list[str], tmp_path: Path, closing: list[Any]
) -> None:
    _dev, host = POOLS[kind](layout)
    ctl = controller_for(host, extra_config(tmp_path), mla=kind == "mla")
    backend = ctl.storage_backend
    closing.append(backend)
    assert backend.direct is direct
    want = random_pages(host, seed=len(layout))
    assert roundtrip(ctl, host, keys, want) == (TOKENS, PAGES, True)
    assert backend.counts["pages_stored"] == PAGES
    assert backend.counts["pages_loaded"] == PAGES
    # A second backup of the same pages: held already, stored again by no tier.
    hi = host.alloc(TOKENS)
    fill(host, hi, want)
    assert backend.batch_set_v1(keys, hi) == [True] * PAGES
    host.free(hi)
    file = backend.front.statistics().tiers["file"]
    assert file.written_blocks == PAGES


# -- 3. namespaces: leading hits only, nothing across shards, models, layouts, dtypes ---------


def test_batch_exists_counts_leading_hits_in_its_own_namespace_only(
    keys: list[str], tmp_path: Path, closing: list[Any]
) -> None:
    shared = {"instances": 8}  # several namespaces open on one root at once

    def extra() -> dict[str, Any]:
        e = extra_config(tmp_path)
        e["kvtier"]["file_tier"].update(shared)
        return e

    _dev, host = mha_pools("page_first")
    backend = backend_for(host, extra())
    closing.append(backend)
    hi = host.alloc(TOKENS)
    fill(host, hi, random_pages(host, 3))
    assert backend.batch_set_v1(keys, hi) == [True] * PAGES
    other = prompt_keys(5000)
    assert backend.batch_exists(keys) == PAGES
    assert backend.batch_exists(keys[:5] + other[:1] + keys[5:]) == 5
    assert backend.batch_exists(other) == 0
    assert backend.batch_exists([]) == 0
    assert backend.exists(keys[3])
    assert not backend.exists(other[3])

    _dev16, host16 = mha_pools("page_first", dtype=torch.float16)
    _devl, host_layer = mha_pools("layer_first")
    strangers = {
        "tp_rank 1 of 2": backend_for(host, extra(), tp_rank=1, tp_size=2),
        "another model": backend_for(host, extra(), model="lab/other"),
        "another layout": backend_for(host_layer, extra()),
        "another dtype": backend_for(host16, extra()),
    }
    closing.extend(strangers.values())
    assert {name: b.batch_exists(keys) for name, b in strangers.items()} == dict.fromkeys(
        strangers, 0
    )

    # MLA pages are the same on every rank: one writer, every rank reads.
    _devm, mla_host = mla_pools("page_first_direct")
    writer = backend_for(mla_host, extra(), mla=True)
    reader = backend_for(mla_host, extra(), mla=True, tp_rank=1, tp_size=2)
    closing.extend([writer, reader])
    mi = mla_host.alloc(TOKENS)
    want = random_pages(mla_host, 4)
    fill(mla_host, mi, want)
    assert reader.batch_set_v1(keys, mi) == [True] * PAGES  # not the writer: stores nothing
    assert "pages_stored" not in reader.counts
    assert reader.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys, mi) == [True] * PAGES
    deadline = time.monotonic() + 10  # another instance's blocks: seen within peer_poll_s
    while reader.batch_exists(keys) < PAGES and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reader.batch_exists(keys) == PAGES
    zero(mla_host, mi)
    assert reader.batch_get_v1(keys, mi) == [True] * PAGES
    assert same(mla_host, mi, want)


# -- 4. bad inputs ------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "layout"), [("mha", "page_first"), ("mla", "page_first_direct")])
def test_bad_inputs_are_false_and_store_nothing_wrong(
    kind: str, layout: str, keys: list[str], tmp_path: Path, closing: list[Any]
) -> None:
    _dev, host = POOLS[kind](layout)
    backend = backend_for(host, extra_config(tmp_path), mla=kind == "mla")
    closing.append(backend)
    hi = host.alloc(TOKENS)
    want = random_pages(host, 5)
    fill(host, hi, want)
    assert backend.batch_set_v1(keys, hi) == [True] * PAGES

    fresh = prompt_keys(9000)
    size = host.size
    bad_indices = {
        "out of range": torch.arange(size, size + TOKENS, dtype=torch.int64),
        "negative": torch.arange(-TOKENS, 0, dtype=torch.int64),
        "float": hi.to(torch.float32),
        "one short": hi[:-1],
        "one page short": hi[:-PAGE],
        "not from a page boundary": hi + 1,
        "a page out of order": torch.cat([hi[1:PAGE], hi[:1], hi[PAGE:]]),
        "two-dimensional": hi.view(PAGES, PAGE),
        "not a tensor": hi.tolist(),
        "none": None,
    }
    for name, indices in bad_indices.items():
        assert backend.batch_set_v1(fresh, indices) == [False] * PAGES, name
        assert backend.batch_get_v1(keys, indices) == [False] * PAGES, name
    assert backend.batch_exists(fresh) == 0  # nothing was stored under them

    # Keys that are not SGLang's: each False, the others go ahead.
    mixed: list[Any] = ["not-a-key", fresh[1], "g" * 64, fresh[3].upper()[:63], 17, *fresh[5:]]
    got = backend.batch_set_v1(mixed, hi)
    assert got == [False, True, False, False, False] + [True] * (PAGES - 5)
    assert backend.batch_exists(["zz" * 32, *keys]) == 0
    assert backend.batch_exists([keys[0], "nope", keys[1]]) == 1
    assert backend.batch_set_v1([], torch.empty(0, dtype=torch.int64)) == []
    assert backend.batch_set_v1(None, hi) == []  # type: ignore[arg-type]

    # The stored pages are intact and a good call still works.
    zero(host, hi)
    out = host.alloc(TOKENS)
    zero(host, out)
    assert backend.batch_get_v1(keys, out) == [True] * PAGES
    assert same(host, out, want)
    got = backend.batch_get_v1(mixed, out)
    assert got == [False, True, False, False, False] + [True] * (PAGES - 5)
    assert read(host, out)[1].equal(want[1])  # fresh[1] was stored from want[1]'s slot
    refused = {k for k in backend.counts if k.startswith("refused_")}
    assert refused == {"refused_indices", "refused_key", "refused_keys"}
    assert not any(k.startswith("failed_") for k in backend.counts)


# -- 5. a restart --------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "layout"), [("mha", "layer_first"), ("mla", "page_first")])
def test_a_restart_finds_and_loads_the_pages(
    kind: str, layout: str, keys: list[str], tmp_path: Path
) -> None:
    _dev, host = POOLS[kind](layout)
    mla = kind == "mla"
    first = backend_for(host, extra_config(tmp_path), mla=mla)
    hi = host.alloc(TOKENS)
    want = random_pages(host, 6)
    fill(host, hi, want)
    assert first.batch_set_v1(keys, hi) == [True] * PAGES
    first.close()
    first.close()  # idempotent
    assert first.batch_exists(keys) == 0  # closed: a miss, no exception
    assert first.batch_get_v1(keys, hi) == [False] * PAGES

    _dev2, host2 = POOLS[kind](layout)  # a new process's pool
    second = backend_for(host2, extra_config(tmp_path), mla=mla)
    try:
        assert second.batch_exists(keys) == PAGES
        out = host2.alloc(TOKENS)
        zero(host2, out)
        assert second.batch_get_v1(keys, out) == [True] * PAGES
        assert same(host2, out, want)
    finally:
        second.close()


# -- 6. three of SGLang's threads at once --------------------------------------------------


@pytest.mark.parametrize(("kind", "layout"), [("mha", "page_first"), ("mla", "page_first_direct")])
def test_three_threads_at_once(kind: str, layout: str, tmp_path: Path, closing: list[Any]) -> None:
    _dev, host = POOLS[kind](layout, ratio=3.0)  # room for 4 prompts
    # Few staging slots: a staged call waits for others' slots and splits its pages.
    backend = backend_for(host, extra_config(tmp_path, staging_slots=8), mla=kind == "mla")
    closing.append(backend)
    prompts = [prompt_keys(20_000 + 1000 * p) for p in range(3)]
    wants = [random_pages(host, 100 + p) for p in range(3)]
    sources = [host.alloc(TOKENS) for _ in prompts]
    for src, want in zip(sources, wants, strict=True):
        fill(host, src, want)
    scratch = host.alloc(TOKENS)
    stop = threading.Event()
    errors: list[BaseException] = []
    lengths: list[bool] = []

    def loop(call: Any) -> None:
        try:
            p = 0
            while not stop.is_set():
                call(p % len(prompts))
                p += 1
        except BaseException as exc:
            errors.append(exc)

    def backup(p: int) -> None:
        lengths.append(len(backend.batch_set_v1(prompts[p], sources[p])) == PAGES)

    def prefetch(p: int) -> None:
        got = backend.batch_get_v1(prompts[p], scratch)
        lengths.append(len(got) == PAGES and all(isinstance(x, bool) for x in got))

    def query(p: int) -> None:
        n = backend.batch_exists(prompts[p])
        lengths.append(isinstance(n, int) and 0 <= n <= PAGES)

    threads = [threading.Thread(target=loop, args=(f,)) for f in (backup, prefetch, query)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(lengths) > 30
    assert all(lengths)
    for keys, want in zip(prompts, wants, strict=True):
        zero(host, scratch)
        assert backend.batch_get_v1(keys, scratch) == [True] * PAGES
        assert same(host, scratch, want)
    assert not any(k.startswith(("failed_", "refused_")) for k in backend.counts)


# -- 7. a tier that fails ------------------------------------------------------------------


def test_an_unreachable_cluster_tier_is_a_quick_miss(keys: list[str], closing: list[Any]) -> None:
    _dev, host = mla_pools("page_first_direct")
    extra = extra_config(Path("/nonexistent"))
    extra["kvtier"] = {
        # Nothing listens on port 1: refused at once.
        "cluster_tier": {
            "nodes": ["127.0.0.1:1"],
            "mode": "single",
            "connect_timeout_s": 0.2,
            "timeout_s": 0.2,
        },
        "lookup_deadline_s": 0.5,
    }
    t0 = time.monotonic()
    backend = backend_for(host, extra, mla=True)
    closing.append(backend)
    hi = host.alloc(TOKENS)
    fill(host, hi, random_pages(host, 7))
    assert backend.batch_set_v1(keys, hi) == [False] * PAGES
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, hi) == [False] * PAGES
    assert time.monotonic() - t0 < 15
    assert not any(k.startswith("failed_") for k in backend.counts)


# -- 8. configuration refused by name ------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "words"),
    [
        pytest.param(
            lambda e: e["kvtier"].update(bogus=1), r"unknown key\(s\) \['bogus'\]", id="key"
        ),
        pytest.param(lambda e: e.pop("kvtier"), 'no "kvtier" table', id="no-table"),
        pytest.param(lambda e: e.update(kvtier=[1]), '"kvtier" must be a table', id="not-table"),
        pytest.param(lambda e: e["kvtier"].pop("file_tier"), "at least one of", id="no-tier"),
        pytest.param(
            lambda e: e["kvtier"]["file_tier"].pop("bytes_to_use"), "bytes_to_use", id="budget"
        ),
        pytest.param(lambda e: e["kvtier"].update(staging_slots=0), "staging_slots", id="slots"),
        pytest.param(lambda e: e.pop("interface_v1"), "interface_v1", id="interface"),
        pytest.param(lambda e: e.update(tp_lcm_size=4), "tp_lcm_size", id="tp-lcm"),
    ],
)
def test_the_factory_refuses_bad_kvtier_config(change: Any, words: str, tmp_path: Path) -> None:
    _dev, host = mha_pools("page_first")
    extra = extra_config(tmp_path)
    change(extra)
    config = storage_config(host, extra)
    if "tp_lcm_size" in extra:  # SGLang's controller moves it to the storage config
        config.tp_lcm_size = extra.pop("tp_lcm_size")
    with pytest.raises(ConfigurationError, match=words):
        StorageBackendFactory.create_backend("dynamic", config, host)


# -- the rest of SGLang's interface ---------------------------------------------------------


def test_a_pool_kvtier_cannot_name_is_a_miss_everywhere(
    keys: list[str], tmp_path: Path, closing: list[Any]
) -> None:
    _dev, host = mha_pools("page_head")
    backend = backend_for(host, extra_config(tmp_path))
    closing.append(backend)
    assert backend.direct is None
    hi = host.alloc(TOKENS)
    assert backend.batch_set_v1(keys, hi) == [False] * PAGES
    assert backend.batch_get_v1(keys, hi) == [False] * PAGES
    assert backend.batch_exists(keys) == 0
    assert backend.counts["refused_pool"] == 3


def test_storage_metrics_and_the_legacy_calls(
    keys: list[str], tmp_path: Path, closing: list[Any]
) -> None:
    from sglang.srt.observability.metrics_collector import StorageMetrics

    _dev, host = mla_pools("page_first_direct")
    quiet = backend_for(host, extra_config(tmp_path / "a"), mla=True)
    closing.append(quiet)
    assert quiet.get_stats() is None  # without --enable-storage-metrics

    backend = backend_for(host, extra_config(tmp_path / "b"), mla=True, metrics=True)
    closing.append(backend)
    hi = host.alloc(TOKENS)
    fill(host, hi, random_pages(host, 8))
    assert backend.batch_set_v1(keys, hi) == [True] * PAGES
    assert backend.batch_get_v1(keys[:4], hi[: 4 * PAGE]) == [True] * 4
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [PAGES]
    assert stats.prefetch_pgs == [4]
    assert len(stats.backup_bandwidth) == 1
    assert stats.backup_bandwidth[0] > 0
    assert len(stats.prefetch_bandwidth) == 1
    empty = backend.get_stats()
    assert isinstance(empty, StorageMetrics)
    assert empty.backup_pgs == []

    # The legacy calls (SGLang makes them only without "interface_v1"): a miss.
    page = host.get_data_page(int(hi[0]))
    assert backend.get(keys[0], page) is None
    assert backend.batch_get(keys[:2], [page, page]) == [None, None]
    assert backend.set(keys[0], page) is False
    assert backend.batch_set(keys[:2], [page, page]) is False
    backend.clear()  # kvtier keeps its blocks
    assert backend.batch_exists(keys) == PAGES
