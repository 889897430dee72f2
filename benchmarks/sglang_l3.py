"""kvtier as SGLang 0.5.23 HiCache's L3 backend against SGLang's own ``file`` backend.

Run from the repository root, over the SGLang venv that ``make test-sglang`` builds::

    .venv-sglang/bin/python benchmarks/sglang_l3.py
    .venv-sglang/bin/python benchmarks/sglang_l3.py --quick

(The script puts ``tests_sglang/shims`` on ``sys.path`` itself when no
torchvision imports, as ``tests_sglang/conftest.py`` does.) No server and no
GPU: SGLang's real CPU pools (``MLATokenToKVPool`` / ``MHATokenToKVPool`` and
their host pools ``MLATokenToKVPoolHost`` / ``MHATokenToKVPoolHost``, layout
``page_first``, pages of 64 tokens), and per backend a real
``HiCacheController`` attached through its own ``attach_storage_backend`` (as
SGLang's unit tests attach one: no threads, no process groups), which builds
the backend with SGLang's ``StorageBackendFactory``:

``kvtier``
    ``kvtier.integrations.sglang.KVTierHiCacheStorage`` through the
    ``dynamic`` backend, the documented extra config with a ``file_tier``
    (its defaults: O_DIRECT, the I/O engine and queue depth chosen at open).
    The controller picks its zero-copy page functions (``batch_get_v1`` /
    ``batch_set_v1``). An MLA ``page_first`` page is read and written in place
    (O_DIRECT into SGLang's host pool); an MHA ``page_first`` page (K and V
    apart) is staged through kvtier's page-aligned slots. Every read is
    verified (XXH3 checksum of each block) before SGLang is told it loaded.
``file``
    SGLang's ``HiCacheFile`` (``--hicache-storage-backend file``): one file per
    page, buffered I/O, no checksum; the controller drives it through its
    generic page functions (``batch_get`` into a fresh flat page, then
    ``set_from_flat_data_page``; ``batch_set`` of ``get_data_page``).

Both are driven by the controller's own page functions exactly as SGLang's
threads call them: the backup thread's ``_page_backup(StorageOperation)`` for
the store phase (one operation of every page; the controller batches it by
``STORAGE_BATCH_SIZE`` = 128 pages) and the prefetch I/O thread's
``_page_transfer(PrefetchOperation)`` for a load (every page into freshly
allocated host slots, batched the same way). Same host pool, same page keys
(SGLang's ``get_hash_str`` of one long synthetic prompt), same run.

Phases per backend: ``sync; drop_caches``, **store**, an fsync of every file
and directory of the backend's root (timed apart: ``sync s``; HiCacheFile's
pages are then still in the page cache, kvtier's on disk), ``drop_caches``,
**cold load**, **warm load** (the same loads again at once). ``drop_caches``
writes 3 (page cache, dentries and inodes: ``HiCacheFile`` opens one file per
page). kvtier's file tier reads
with O_DIRECT, so its warm load is cold too; ``HiCacheFile``'s warm load is
served from the page cache. Timed: the controller call only (wall, and
``time.process_time()``: every thread of this process, kvtier's loop and I/O
threads included). Not timed: filling the pages with random bytes, zeroing the
load's host slots, and comparing every loaded page byte for byte with what was
stored. GB is 1e9 bytes of SGLang pages (kvtier adds a 4 KiB header per page on
disk). The goal reported against (issue 50): kvtier >= 1.3x the file backend's
GB/s at <= 0.5x its CPU seconds per GB, per phase; printed, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib
import json
import logging
import os
import queue
import shlex
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from _bench_env import commit, drop_caches, f2, filesystem, loadavg, machine, med, ratio

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))
SHIMS = _REPO / "tests_sglang" / "shims"

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE_TOKENS = 64
DEVICE_TOKENS = 2048
"""The device pool's tokens (it only gives the host pool its buffer description)."""
SCRATCH = Path("/tmp/bench_sglang")
MODEL = "bench/sglang-l3"
GOAL_SPEED, GOAL_CPU = 1.3, 0.5
KVTIER_EXTRA: dict[str, Any] = {
    "backend_name": "kvtier",
    "module_path": "kvtier.integrations.sglang",
    "class_name": "KVTierHiCacheStorage",
    "interface_v1": 1,
}
BACKENDS = ("kvtier", "file")


def _sg(name: str) -> Any:
    """A module of SGLang (not installed where mypy runs: typed as Any)."""
    return importlib.import_module(name)


def sglang_or_exit() -> str:
    """SGLang's version, its modules imported (the torchvision shim where needed)."""
    try:
        import torchvision  # type: ignore[import-not-found,import-untyped,unused-ignore]  # noqa: F401
    except Exception:  # absent, or a CUDA build that cannot load here
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.path.insert(0, str(SHIMS))
    try:
        import sglang  # type: ignore[import-not-found]

        for module in (
            "sglang.srt.managers.cache_controller",
            "sglang.srt.mem_cache.hicache_storage",
            "sglang.srt.mem_cache.memory_pool",
            "sglang.srt.mem_cache.pool_host.mha",
            "sglang.srt.mem_cache.pool_host.mla",
            "sglang.srt.mem_cache.storage",
            "sglang.srt.mem_cache.utils",
            "sglang.srt.runtime_context",
            "kvtier.integrations.sglang",
        ):
            _sg(module)
    except ImportError as exc:
        sys.exit(
            f"needs SGLang 0.5.23 ({type(exc).__name__}: {exc}): run `make test-sglang` once "
            "(it builds .venv-sglang), then .venv-sglang/bin/python benchmarks/sglang_l3.py"
        )
    return str(sglang.__version__)


# -- SGLang's objects ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Kind:
    """One row group of the output: a pool kind, its geometry, pages per phase."""

    name: str
    mla: bool
    layers: int
    heads: int
    head_dim: int
    pages: int

    @property
    def tag(self) -> str:
        return "mla" if self.mla else "mha"

    @property
    def page_bytes(self) -> int:
        per_token = (512 + 64) if self.mla else 2 * self.heads * self.head_dim
        return PAGE_TOKENS * self.layers * per_token * 2  # bf16

    def describe(self) -> str:
        if self.mla:
            geom = f"{self.layers} layers, kv_lora_rank 512 + qk_rope_head_dim 64"
        else:
            geom = f"{self.layers} layers, {self.heads} KV heads x {self.head_dim}"
        return (
            f"{self.name}: {geom}, bf16, page_first; pages of {PAGE_TOKENS} tokens = "
            f"{self.page_bytes} bytes ({self.page_bytes / MiB:.2f} MiB); {self.pages} pages = "
            f"{self.pages * self.page_bytes / GiB:.2f} GiB per phase"
        )


def pools(kind: Kind) -> tuple[Any, Any]:
    """SGLang's device pool (for its buffer description) and a host pool of
    2 x ``kind.pages`` pages (+ SGLang's padding page): a load goes to fresh slots."""
    memory_pool = _sg("sglang.srt.mem_cache.memory_pool")
    ratio = 2 * kind.pages * PAGE_TOKENS / DEVICE_TOKENS
    common = {
        "host_to_device_ratio": ratio,
        "host_size": 0,
        "page_size": PAGE_TOKENS,
        "layout": "page_first",
        "pin_memory": False,
        "device": "cpu",
        "device_capacity_tokens": DEVICE_TOKENS,
        "start_layer": 0,
        "end_layer": kind.layers - 1,
    }
    if kind.mla:
        dev = memory_pool.MLATokenToKVPool(
            size=DEVICE_TOKENS,
            page_size=PAGE_TOKENS,
            dtype=torch.bfloat16,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            layer_num=kind.layers,
            device="cpu",
            enable_memory_saver=False,
        )
        host_cls = _sg("sglang.srt.mem_cache.pool_host.mla").MLATokenToKVPoolHost
        host = host_cls(dev._mla_buffer_info(), target_layer_num=kind.layers, **common)
    else:
        dev = memory_pool.MHATokenToKVPool(
            size=DEVICE_TOKENS,
            page_size=PAGE_TOKENS,
            dtype=torch.bfloat16,
            head_num=kind.heads,
            head_dim=kind.head_dim,
            layer_num=kind.layers,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        host_cls = _sg("sglang.srt.mem_cache.pool_host.mha").MHATokenToKVPoolHost
        host = host_cls(dev._mha_buffer_info(), **common)
    got = int(host.get_data_page(0).numel() * host.dtype.itemsize)
    if got != kind.page_bytes:
        raise RuntimeError(f"SGLang's page is {got} bytes, expected {kind.page_bytes}")
    return dev, host


def storage_config(host: Any, extra: dict[str, Any] | None, *, mla: bool, model: str) -> Any:
    """SGLang's ``HiCacheStorageConfig`` of one rank (TP 1, PP 1, no CP)."""
    config_cls = _sg("sglang.srt.mem_cache.hicache_storage").HiCacheStorageConfig
    return config_cls(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=host.layout == "page_first",
        model_name=model,
        extra_config=extra,
    )


def controller_for(host: Any, backend: str, extra: dict[str, Any], *, mla: bool) -> Any:
    """A real HiCacheController with ``backend`` attached by its own
    ``attach_storage_backend`` (SGLang's unit tests' way: no threads, no groups)."""
    controller_cls = _sg("sglang.srt.managers.cache_controller").HiCacheController
    get_parallel = _sg("sglang.srt.runtime_context").get_parallel
    c = object.__new__(controller_cls)
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
            backend,
            prefetch_threshold=PAGE_TOKENS,
            model_name=MODEL,
            storage_backend_extra_config=extra,
        )
    return c


# -- keys and pages --------------------------------------------------------------------------


def page_keys(pages: int) -> tuple[list[str], str]:
    """SGLang's page keys of one ``pages``-page prompt, and where they came from."""
    tokens = list(range(1000, 1000 + pages * PAGE_TOKENS))
    try:
        get_hash_str = _sg("sglang.srt.mem_cache.utils").get_hash_str
        keys: list[str] = list(get_hash_str(tokens, None, PAGE_TOKENS))
        if len(keys) == pages and all(len(k) == 64 for k in keys):
            return keys, "SGLang's get_hash_str (its native SHA-256 page chain)"
        why = f"it gave {len(keys)} keys"
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    keys, prior = [], b""
    for p in range(pages):
        chunk = tokens[p * PAGE_TOKENS : (p + 1) * PAGE_TOKENS]
        digest = hashlib.sha256(prior + b"".join(t.to_bytes(4, "little") for t in chunk))
        prior = digest.digest()
        keys.append(digest.hexdigest())
    return keys, f"sha256-chained hex (SGLang's get_hash_str unavailable: {why})"


def random_pages(kind: Kind, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (kind.pages, kind.page_bytes), generator=g, dtype=torch.uint8)


def fill(host: Any, indices: torch.Tensor, want: torch.Tensor) -> None:
    for i in range(want.shape[0]):
        page = host.get_data_page(int(indices[i * PAGE_TOKENS]), flat=False)
        page.copy_(want[i].view(host.dtype).view(page.shape))


def zero(host: Any, indices: torch.Tensor) -> None:
    for i in range(len(indices) // PAGE_TOKENS):
        host.get_data_page(int(indices[i * PAGE_TOKENS]), flat=False).zero_()


def matching(host: Any, indices: torch.Tensor, want: torch.Tensor) -> int:
    """How many pages at ``indices`` hold ``want``'s bytes exactly."""
    ok = 0
    for i in range(want.shape[0]):
        got = host.get_data_page(int(indices[i * PAGE_TOKENS])).view(torch.uint8)
        ok += bool(torch.equal(got, want[i]))
    return ok


# -- phases ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Phase:
    """Wall and process CPU seconds of one phase's controller call."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    bytes: int = 0
    pages_done: int = 0
    """Pages the controller reported stored or loaded."""
    verified: int = 0
    """Of the pages loaded, those equal byte for byte to what was stored."""

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        c0, t0 = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            self.wall_s += time.perf_counter() - t0
            self.cpu_s += time.process_time() - c0

    @property
    def gbps(self) -> float:
        return self.bytes / 1e9 / self.wall_s if self.wall_s else float("nan")

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.bytes / 1e9) if self.bytes else float("nan")

    def as_dict(self) -> dict[str, float | int]:
        return {
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            "bytes": self.bytes,
            "pages_done": self.pages_done,
            "verified": self.verified,
            "gb_per_s": self.gbps,
            "cpu_s_per_gb": self.cpu_s_per_gb,
        }


@dataclass(slots=True)
class Result:
    """One backend over one pool kind, one repeat."""

    backend: str
    kind: str
    page_bytes: int
    pages: int
    repeat: int
    path: str = ""
    store: Phase = field(default_factory=Phase)
    sync_s: float = 0.0
    """fsync of the backend's files right after the store phase (not in the store's GB/s)."""
    cold: Phase | None = None
    warm: Phase = field(default_factory=Phase)
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def store_synced_gbps(self) -> float:
        wall = self.store.wall_s + self.sync_s
        return self.store.bytes / 1e9 / wall if wall else float("nan")


def fsync_tree(root: Path) -> float:
    """fsync every file and directory under ``root`` (this backend's only, unlike a
    global ``sync``, which would also flush another process's writes); seconds taken."""
    t0 = time.perf_counter()
    for dirpath, _dirs, files in os.walk(root):
        for name in [*files, "."]:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.perf_counter() - t0


def extra_for(backend: str, kind: Kind, root: Path) -> dict[str, Any]:
    if backend == "kvtier":
        budget = kind.pages * (kind.page_bytes + 4 * KiB) * 5 // 4 + 256 * MiB
        return {
            **KVTIER_EXTRA,
            "kvtier": {"file_tier": {"root": str(root), "bytes_to_use": budget}},
        }
    return {"file_storage_path": str(root)}


def describe(backend: str, ctl: Any) -> dict[str, Any]:
    b = ctl.storage_backend
    info: dict[str, Any] = {
        "class": type(b).__name__,
        "page_get": ctl.page_get_func.__name__,
        "page_set": ctl.page_set_func.__name__,
    }
    if backend == "kvtier":
        st = b.front.tier_statistics()["file"]
        info.update(
            direct=b.direct,
            io_engine=st.io_engine,
            queue_depth=st.queue_depth,
            direct_io=st.direct_io,
            registered_bytes=st.registered_bytes,
            verified_reads=True,
        )
    else:
        ev = b._evictor
        info.update(
            file_path=b.file_path,
            suffix=b.config_suffix,
            metadata_cache=b.enable_metadata_cache,
            max_size_bytes=ev.max_size_bytes,
            min_free_bytes=ev.min_free_bytes,
            eviction_ratio=ev.eviction_ratio,
            eviction=ev.enabled,
            verified_reads=False,
        )
    return info


def path_of(backend: str, ctl: Any) -> str:
    if backend == "kvtier":
        direct = ctl.storage_backend.direct
        return "in place" if direct else "staged" if direct is False else "unusable"
    return "generic get/set"


def close_backend(ctl: Any) -> None:
    close = getattr(ctl.storage_backend, "close", None)
    if callable(close):
        close()


def run_backend(
    backend: str, kind: Kind, host: Any, keys: list[str], want: torch.Tensor, args: Any, rep: int
) -> Result:
    """``backend`` below a fresh controller over ``host``: store, cold load, warm load."""
    cc = _sg("sglang.srt.managers.cache_controller")
    res = Result(backend, kind.name, kind.page_bytes, kind.pages, rep)
    root = Path(args.scratch) / f"{kind.tag}-{backend}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    extra = extra_for(backend, kind, root)
    res.info["extra_config"] = extra
    n_tokens = kind.pages * PAGE_TOKENS
    tokens = list(range(n_tokens))
    nbytes = kind.pages * kind.page_bytes
    ctl: Any = None
    try:
        ctl = controller_for(
            host, "dynamic" if backend == "kvtier" else "file", extra, mla=kind.mla
        )
        res.path = path_of(backend, ctl)
        res.info.update(describe(backend, ctl))

        hi = host.alloc(n_tokens)
        if hi is None:
            raise RuntimeError("the host pool has no room for a phase's pages")
        fill(host, hi, want)
        gc.collect()
        drop_caches()
        op = cc.StorageOperation(hi, tokens, hash_value=list(keys))
        with res.store.timed():
            ctl._page_backup(op)
        res.store.bytes = nbytes
        res.store.pages_done = op.completed_tokens // PAGE_TOKENS
        res.sync_s = fsync_tree(root)
        host.free(hi)
        if res.store.pages_done != kind.pages:
            raise RuntimeError(f"backed up {res.store.pages_done} of {kind.pages} pages")

        phases: list[tuple[str, Phase]] = []
        refused = drop_caches()
        if refused is None:
            res.cold = Phase()
            phases.append(("cold", res.cold))
        else:
            res.info["drop_caches"] = f"refused: {refused}"
        phases.append(("warm", res.warm))
        for name, phase in phases:
            hi2 = host.alloc(n_tokens)
            if hi2 is None:
                raise RuntimeError("the host pool has no room for a phase's pages")
            zero(host, hi2)
            pop = cc.PrefetchOperation(f"bench-{name}", tokens)
            pop.hash_value = list(keys)
            pop.host_indices = hi2
            ctl.prefetch_sync_queue = queue.Queue()
            gc.collect()
            with phase.timed():
                got = ctl._page_transfer(pop)
            phase.bytes = nbytes
            phase.pages_done = int(got)
            phase.verified = matching(host, hi2, want)
            host.free(hi2)
        if backend == "kvtier":
            b = ctl.storage_backend
            st = b.front.tier_statistics()["file"]
            res.info.update(
                counts=b.counts,
                file_hits=st.hits,
                file_stores=st.stores,
                quarantined=st.quarantined,
            )
    except Exception as exc:  # reported in the table; the other backend still runs
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        if ctl is not None:
            with contextlib.suppress(Exception):
                close_backend(ctl)
        shutil.rmtree(root, ignore_errors=True)
    return res


# -- output ----------------------------------------------------------------------------------


PHASES = ("store", "store+sync", "cold", "warm")


def figures(r: Result, name: str) -> tuple[float, float, float]:
    """(wall s, GB/s, CPU s/GB) of phase ``name``; NaN where it did not run."""
    nan = float("nan")
    if name == "store+sync":
        return r.store.wall_s + r.sync_s, r.store_synced_gbps, r.store.cpu_s_per_gb
    p = r.store if name == "store" else r.cold if name == "cold" else r.warm
    if p is None:
        return nan, nan, nan
    return p.wall_s, p.gbps, p.cpu_s_per_gb


def print_kind(kind: Kind, runs: dict[str, list[Result]]) -> None:
    repeats = max((len(rs) for rs in runs.values()), default=0)
    print(f"\n{kind.describe()}; medians of {repeats} repeat(s)")
    head = (
        f"{'backend':<7} {'path':<15} | {'store s':>7} {'GB/s':>5} {'cpu s/GB':>8} "
        f"{'sync s':>6} {'+sync GB/s':>10} | {'cold s':>6} {'GB/s':>5} {'cpu s/GB':>8} | "
        f"{'warm s':>6} {'GB/s':>5} {'cpu s/GB':>8} | {'verified':>9}"
    )
    print(head)
    print("-" * len(head))
    for backend, rs in runs.items():
        for r in rs:
            if r.error is not None:
                print(f"{backend:<7} repeat {r.repeat}: ERROR {r.error}")
        ok = [r for r in rs if r.error is None]
        if not ok:
            continue

        def m(name: str, i: int, rows: list[Result] = ok) -> float:
            return med([figures(r, name)[i] for r in rows])

        loaded = sum(
            (r.cold.verified if r.cold else 0) + r.warm.verified for r in ok
        )  # pages equal byte for byte
        asked = sum((r.pages if r.cold else 0) + r.pages for r in ok)
        print(
            f"{backend:<7} {ok[0].path:<15} | {m('store', 0):>7.2f} {f2(m('store', 1)):>5} "
            f"{f2(m('store', 2)):>8} {med([r.sync_s for r in ok]):>6.2f} "
            f"{f2(m('store+sync', 1)):>10} | {m('cold', 0):>6.2f} {f2(m('cold', 1)):>5} "
            f"{f2(m('cold', 2)):>8} | {m('warm', 0):>6.2f} {f2(m('warm', 1)):>5} "
            f"{f2(m('warm', 2)):>8} | {loaded:>4}/{asked:<4}"
        )
    kv = {r.repeat: r for r in runs.get("kvtier", []) if r.error is None}
    other = {r.repeat: r for r in runs.get("file", []) if r.error is None}
    both = sorted(set(kv) & set(other))
    if not both:
        return
    parts: list[str] = []
    for name in PHASES:
        speeds = [ratio(figures(kv[k], name)[1], figures(other[k], name)[1]) for k in both]
        cpus = [ratio(figures(kv[k], name)[2], figures(other[k], name)[2]) for k in both]
        speed, cpu = med(speeds), med(cpus)
        if speed != speed:
            continue
        met = "met" if speed >= GOAL_SPEED and cpu <= GOAL_CPU else "not met"
        spread = ""
        if len(both) > 1:
            spread = f" [{f2(min(speeds))}-{f2(max(speeds))}x, {f2(min(cpus))}-{f2(max(cpus))}x]"
        label = name if name.startswith("store") else f"load {name}"
        parts.append(f"{label} {f2(speed)}x GB/s, {f2(cpu)}x CPU/GB{spread} ({met})")
    print("kvtier / file:\n  " + "\n  ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about 0.1 GiB per phase")
    parser.add_argument("--gib", type=float, help="GiB of pages per phase per kind (1.0)")
    parser.add_argument("--repeats", type=int, default=1, help="repeats, order alternating")
    parser.add_argument("--mla-layers", type=int, default=32)
    parser.add_argument("--mha-layers", type=int, default=16)
    parser.add_argument("--mha-heads", type=int, default=8)
    parser.add_argument("--mha-head-dim", type=int, default=128)
    parser.add_argument("--kinds", default="mla,mha", help="comma-separated: mla, mha")
    parser.add_argument("--scratch", default=str(SCRATCH), help="directory for the backends")
    parser.add_argument("--json", help="write the results there")
    args = parser.parse_args()

    logging.basicConfig(level=logging.WARNING, format="  [log] %(name)s: %(message)s")
    t_start = time.perf_counter()
    version = sglang_or_exit()
    gib = args.gib if args.gib is not None else (0.1 if args.quick else 1.0)
    kinds: list[Kind] = []
    for tag in [k for k in args.kinds.split(",") if k]:
        if tag == "mla":
            k = Kind("MLA", True, args.mla_layers, 1, 576, 1)
        elif tag == "mha":
            k = Kind("MHA", False, args.mha_layers, args.mha_heads, args.mha_head_dim, 1)
        else:
            parser.error(f"unknown kind {tag!r}")
        pages = max(1, round(gib * GiB / k.page_bytes))
        kinds.append(Kind(k.name, k.mla, k.layers, k.heads, k.head_dim, pages))
    keys, key_source = page_keys(max(k.pages for k in kinds))

    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    pp = os.environ.get("PYTHONPATH")
    shim = "torchvision shim" if str(SHIMS) in sys.path else "real torchvision"
    print(f"command: {'PYTHONPATH=' + pp + ' ' if pp else ''}{cmd}")
    print(f"commit {commit()}; SGLang {version} ({shim}); torch {torch.__version__}")
    print(f"machine: {machine()}; load average {loadavg()}")
    print(f"backends' files: {scratch}, {filesystem(scratch.resolve())}")
    print(f"page keys: {key_source}")
    print(
        "driven by a real HiCacheController per backend (its attach_storage_backend and "
        "SGLang's StorageBackendFactory): store = _page_backup(StorageOperation of every page), "
        "load = _page_transfer(PrefetchOperation of every page into fresh host slots); the "
        "controller batches both by 128 pages (STORAGE_BATCH_SIZE)"
    )
    print(
        "kvtier: KVTierHiCacheStorage via the 'dynamic' backend, interface_v1 (zero-copy "
        "batch_get_v1/batch_set_v1), file_tier with kvtier's defaults (O_DIRECT); verifies "
        "every read (XXH3 checksum per page) before reporting it loaded. path: in place = O_DIRECT "
        "straight into/out of SGLang's host pool, staged = through kvtier's page-aligned slots"
    )
    print(
        "file: SGLang's HiCacheFile via the 'file' backend, extra config only "
        "file_storage_path (its defaults otherwise, printed below); the controller's generic "
        "page functions (batch_get into a fresh flat page + set_from_flat_data_page; batch_set "
        "of get_data_page); one file per page, buffered I/O, no checksum"
    )
    print(
        "timed: the controller call only (wall; CPU = time.process_time(), all threads of this "
        "process). Not timed: filling pages, zeroing the load's slots, comparing every loaded page "
        "byte for byte with what was stored ('verified')"
    )
    print(
        "store: after sync + drop_caches=3; sync s = fsync of every file and directory of the "
        "backend's root right after it (HiCacheFile's writes are still in the page cache; "
        "kvtier's are on disk), +sync GB/s counts it. "
        "cold: after sync + drop_caches=3 (page cache, dentries, inodes); warm: the same loads "
        "again at once (HiCacheFile from the page cache; kvtier reads with O_DIRECT, so cold "
        "again). GB = 1e9 bytes of SGLang pages"
    )
    print(
        f"{args.repeats} repeat(s); each backend once per repeat, the order alternating per "
        "kind and repeat; ratios within a repeat, then their median [min-max]"
    )
    all_results: list[Result] = []
    for n, kind in enumerate(kinds):
        dev, host = pools(kind)
        want = random_pages(kind, seed=n + 1)
        kind_keys = keys[: kind.pages]
        runs: dict[str, list[Result]] = {b: [] for b in BACKENDS}
        orders: list[str] = []
        for rep in range(args.repeats):
            order = list(BACKENDS) if (n + rep) % 2 == 0 else list(BACKENDS)[::-1]
            orders.append(",".join(order))
            for b in order:
                r = run_backend(b, kind, host, kind_keys, want, args, rep)
                runs[b].append(r)
                all_results.append(r)
        print_kind(kind, runs)
        for b, rs in runs.items():
            info = {k: v for k, v in rs[0].info.items() if k != "extra_config"}
            print(f"  {b}: {info}")
        for b, rs in runs.items():
            per = "; ".join(
                f"{f2(r.store.gbps)}/{f2(r.cold.gbps if r.cold else float('nan'))}/"
                f"{f2(r.warm.gbps)}"
                for r in rs
            )
            print(f"  {b} GB/s store/cold/warm per repeat: {per}")
        print(f"  orders: {' | '.join(orders)}; load average {loadavg()}")
        del want, host, dev
        gc.collect()
    print(
        f"\ngoal: kvtier >= {GOAL_SPEED}x the file backend's GB/s at <= {GOAL_CPU}x its CPU s/GB, "
        "per phase (reported, not asserted)"
    )
    print(f"load average at the end {loadavg()}; whole run {time.perf_counter() - t_start:.0f} s")
    if args.json:
        out = {
            "command": cmd,
            "commit": commit(),
            "sglang": version,
            "machine": machine(),
            "page_keys": key_source,
            "kinds": [asdict(k) | {"page_bytes": k.page_bytes} for k in kinds],
            "results": [
                {
                    **{k: v for k, v in asdict(r).items() if k not in ("store", "cold", "warm")},
                    "store": r.store.as_dict(),
                    "store_synced_gb_per_s": r.store_synced_gbps,
                    "cold": None if r.cold is None else r.cold.as_dict(),
                    "warm": r.warm.as_dict(),
                }
                for r in all_results
            ],
        }
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
