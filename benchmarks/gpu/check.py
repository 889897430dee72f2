"""kvtier's CUDA path, checked and measured in one run (``check.sh`` beside it runs this).

Run from the repository root::

    python3 benchmarks/gpu/check.py             # every section
    python3 benchmarks/gpu/check.py --quick     # smaller sizes (the test suite runs this)
    python3 benchmarks/gpu/check.py env sweep   # some sections only

Sections, in order; each has a part that runs on CPU and a part that needs
CUDA, which says it was skipped, and why, where there is no CUDA device:

``env``
    What is here: Python, torch and its CUDA, the card, the compiled modules,
    the packages kvtier imports, the gather kernel compiled by NVRTC (its
    log where it does not compile: a failure, and the other sections go on,
    gathering with the indexing kernels). Fails when kvtier itself cannot be
    imported.
``sweep``
    Device <-> CPU-region copies over private and shared regions, consecutive
    and scattered ids, ``blocks_per_chunk`` 1 and 4, a skip into the first
    chunk, K/V-first and block-first layouts, fp16 and bf16: each copier's
    rows after a store and tensors after a load, byte for byte against the
    CPU backend's (the compiled loop), which is itself checked against a
    plain-Python reference of the row layout. On CPU the candidates are the
    CPU backend's Python loop and the CUDA backend's fallback (a
    ``Tensor.copy_`` per piece) on CPU tensors; on CUDA, the CUDA backend in
    each mode (``batch``, ``loop``, ``gather`` through the indexing kernels
    and through the compiled gather kernel, each also a round per row,
    ``torch``).
``engine``
    An :class:`~kvtier.engine.Engine` end to end through a CPU tier smaller
    than the data and a file tier: store, flush, load everything back.
``cancel``
    A load cancelled while its copy runs: afterwards no pinned row, nothing
    in flight, the copy streams idle, every block the load named holds what
    was stored and no other block changed.
``bench``
    Store and load throughput of a realistic layout (32 per-layer K/V-first
    fp16 tensors, 16-token blocks of 8 heads x 128: 2 MiB rows of 32 KiB
    pieces) and of single big blocks (one block-first tensor, 2 MiB blocks),
    consecutive and scattered ids, one way and both ways at once, against one
    contiguous copy of the same bytes between the same region and a device
    buffer in the same run; ratios printed. On CPU, the CPU backend against
    ``Tensor.copy_`` (smaller).

Results go to ``$OUT/check.json`` when ``OUT`` is set. The exit status is
non-zero when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch

SECTIONS = ("env", "sweep", "engine", "cancel", "bench")
DEPENDENCIES = {  # module: distribution, for what kvtier and its tests import
    "pydantic": "pydantic",
    "zmq": "pyzmq",
    "xxhash": "xxhash",
    "rich": "rich",
    "pytest": "pytest",
    "pytest_asyncio": "pytest-asyncio",
    "hypothesis": "hypothesis",
}
CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


@dataclass
class Report:
    """What every section found: printed as it goes, written to $OUT at the end."""

    failures: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)

    def ok(self, what: str, detail: str = "") -> None:
        print(f"  ok       {what}{': ' + detail if detail else ''}", flush=True)

    def fail(self, what: str, detail: str) -> None:
        self.failures.append(f"{what}: {detail}")
        print(f"  FAILED   {what}: {detail}", flush=True)

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        print(f"  SKIPPED  {what}: {why}", flush=True)


def _section(name: str) -> None:
    print(f"\n== {name} ==", flush=True)


# -- env ------------------------------------------------------------------------------


def check_env(rep: Report) -> bool:
    """Say what is here and what is missing; False when kvtier cannot run at all."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": np.__version__,
        "cuda_available": CUDA,
        "gcc": shutil.which("gcc"),
    }
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        info["device"] = props.name
        info["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["multiprocessors"] = props.multi_processor_count
    for key, value in info.items():
        print(f"  {key:<18} {value}")
    missing = []
    for module, dist in DEPENDENCIES.items():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append(dist)
            print(f"  {dist:<18} MISSING ({exc})")
        else:
            print(f"  {dist:<18} {importlib.metadata.version(dist)}")
    info["missing"] = missing
    compiled = {}
    for name in (
        "kvtier.manager._native",
        "kvtier.transfer._address",
        "kvtier.transfer._copy",
        "kvtier.transfer._gather",
        "kvtier.tiers._blocks",
    ):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            compiled[name] = f"not built ({exc})"
        else:
            compiled[name] = "built"
        print(f"  {name:<26} {compiled[name]}")
    info["compiled"] = compiled
    rep.results["env"] = info
    try:
        import kvtier  # noqa: F401 - importable at all: every other section needs it
    except ImportError as exc:
        rep.fail("import kvtier", f"{exc} (missing: {missing})")
        return False
    if compiled["kvtier.transfer._copy"] != "built":
        rep.fail("kvtier.transfer._copy", "not built: the compiled copy loops are what is checked")
    if CUDA:
        from kvtier.transfer._cuda_copy import load_cudart

        try:
            path, version = load_cudart()
        except Exception as exc:
            rep.fail("CUDA runtime", str(exc))
        else:
            from kvtier.transfer import _copy

            status = _copy.cuda_status()
            info["cudart"] = {"path": path, "version": version, **status}
            rep.ok("CUDA runtime", f"{path} ({version}), cudaMemcpyBatchAsync: {status['batch']}")
            nm = shutil.which("nm")
            if nm is not None:  # which batch entry points it has, for the record
                found = subprocess.run(
                    [nm, "-D", "--defined-only", path], capture_output=True, text=True, check=False
                ).stdout
                names = sorted({ln.split()[-1] for ln in found.splitlines() if "Batch" in ln})
                info["cudart_batch_symbols"] = names
                print(f"  {'batch symbols':<18} {' '.join(names) or 'none'}")
    else:
        rep.skip("CUDA runtime", NO_CUDA)
    _check_gather_kernel(rep, info)
    return True


def _check_gather_kernel(rep: Report, info: dict[str, Any]) -> None:
    """Compile and load the gather kernel (on CUDA), or compile it alone (NVRTC, no GPU)."""
    from kvtier.errors import ConfigurationError
    from kvtier.transfer._cuda_copy import gather_native, load_gather_kernel, nvrtc_candidates

    if gather_native is None:
        rep.fail("gather kernel", "kvtier.transfer._gather is not built")
        return
    if CUDA:
        try:
            built = load_gather_kernel(torch.cuda.current_device())
        except ConfigurationError as exc:
            # The whole message: NVRTC's log is in it. The sweep and bench go on, the
            # kernel's modes gathering with the indexing kernels.
            info["gather_kernel"] = f"unavailable: {exc}"
            rep.fail("gather kernel", str(exc))
        else:
            info["gather_kernel"] = {"built": built, **gather_native.status()}
            rep.ok("gather kernel", built)
        return
    errors = []
    for path in nvrtc_candidates():
        try:
            version = gather_native.load_nvrtc(path)
        except OSError as exc:
            errors.append(str(exc))
            continue
        try:
            size = len(gather_native.compile(90))
        except RuntimeError as exc:
            info["gather_kernel"] = f"does not compile: {exc}"
            rep.fail("gather kernel (NVRTC alone)", str(exc))
        else:
            info["gather_kernel"] = f"compiles for sm_90 ({size} bytes) with NVRTC {version}"
            rep.ok("gather kernel (NVRTC alone)", f"{info['gather_kernel']} at {path}")
        return
    # Not a skip of its own: without CUDA, "CUDA runtime" above says the CUDA parts are.
    info["gather_kernel"] = "no NVRTC"
    print(f"  -        gather kernel not compiled: no NVRTC loads ({'; '.join(errors[-2:])})")


# -- shared helpers -------------------------------------------------------------------


def _tensors(
    kv_first: bool, dtype: torch.dtype, layers: int, blocks: int, inner: tuple[int, ...]
) -> list[torch.Tensor]:
    """Random bits (NaNs included: compared as bytes), the same for a given shape."""
    g = torch.Generator().manual_seed(layers * 1000 + blocks)
    shape = (2, blocks, *inner) if kv_first else (blocks, *inner)
    out = []
    for _ in range(layers):
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        out.append(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype))
    return [t.reshape(shape) for t in out]


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.uint8).cpu().numpy().reshape(-1)


@contextmanager
def _region(layout: Any, rows: int, shared: bool, pin: str) -> Iterator[list[torch.Tensor]]:
    """Rank 0's views of a private region, or of a region shared with a rank 1."""
    from kvtier.region import CPURegion

    row = -(-layout.bytes_per_chunk // 4096) * 4096
    regions = []
    try:
        if shared:
            name = f"kvtier-check-{os.getpid()}-{time.monotonic_ns()}"
            for rank in (0, 1):
                regions.append(
                    CPURegion.create(
                        layout,
                        rows * 2 * row,
                        world_size=2,
                        rank=rank,
                        shared_name=name,
                        pin=pin,  # type: ignore[arg-type]
                    )
                )
        else:
            regions.append(CPURegion.create(layout, rows * row, pin=pin))  # type: ignore[arg-type]
        yield regions[0].tensor_views()
    finally:
        for r in regions:
            r.close()


def _transfer(layout: Any, kv: list[torch.Tensor], views: list[torch.Tensor], how: str) -> Any:
    from kvtier.transfer._cpu_copy import CpuCopier
    from kvtier.transfer.device import _match_tensors, _match_views, _ThreadedTransfer

    tensors, host = _match_tensors(layout, kv), _match_views(layout, views, torch)
    if how.startswith("cuda-"):
        from kvtier.transfer._cuda_copy import CudaCopier

        mode: Any = how.removeprefix("cuda-")
        if mode == "gather-128m":  # less staging than the default, for the record
            copier: Any = CudaCopier(kv[0].device, mode="gather", staging_bytes=128 << 20)
        elif mode == "gather-rows":  # a round per row: every round's stream handoffs
            copier = CudaCopier(kv[0].device, mode="gather", staging_bytes=1)
        elif mode == "gather-kernel":  # the compiled kernel (the indexing ones if it fails)
            copier = CudaCopier(kv[0].device, mode="gather", gather_kernel=True)
        elif mode == "gather-kernel-rows":
            copier = CudaCopier(kv[0].device, mode="gather", staging_bytes=1, gather_kernel=True)
        else:
            copier = CudaCopier(kv[0].device, mode=mode)
    elif how == "cpu":
        copier = CpuCopier()
    elif how == "cpu-python":
        copier = CpuCopier(native=False)
    elif how == "torch-pieces":
        from kvtier.transfer._cuda_copy import TorchPiecesCopier

        copier = TorchPiecesCopier()
    elif how == "torch-gather":
        from kvtier.transfer._cuda_copy import TorchGatherCopier

        copier = TorchGatherCopier(staging_bytes=1)  # a round per row: every round's path
    else:  # pragma: no cover - the names are this file's own
        raise ValueError(how)
    return _ThreadedTransfer(layout, tensors, host, copier)


# -- sweep ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    shared: bool
    kv_first: bool
    dtype: torch.dtype
    bpc: int
    scattered: bool
    skip: int

    def __str__(self) -> str:
        return (
            f"{'shared' if self.shared else 'private'} "
            f"{'kv-first' if self.kv_first else 'block-first'} "
            f"{str(self.dtype).removeprefix('torch.')} bpc={self.bpc} "
            f"{'scattered' if self.scattered else 'consecutive'} skip={self.skip}"
        )


def _cases() -> list[Case]:
    out = []
    for shared in (False, True):
        for kv_first in (True, False):
            for dtype in (torch.float16, torch.bfloat16):
                for bpc in (1, 4):
                    for scattered in (False, True):
                        for skip in (0, bpc - 1) if bpc > 1 else (0,):
                            out.append(Case(shared, kv_first, dtype, bpc, scattered, skip))
    return out


SWEEP_LAYERS, SWEEP_BLOCKS, SWEEP_ROWS = 3, 48, 6
SWEEP_INNER = (16, 2, 32)  # tokens, heads, head dim: 2 KiB halves in fp16


def _run_case(case: Case, how: str, device: str) -> tuple[np.ndarray, list[np.ndarray], Any]:
    """Store then load one case with one copier: the rows' bytes, the tensors' bytes."""
    from kvtier.layout import KVLayout

    kv = [
        t.to(device)
        for t in _tensors(case.kv_first, case.dtype, SWEEP_LAYERS, SWEEP_BLOCKS, SWEEP_INNER)
    ]
    layout = KVLayout.from_tensors(
        kv, model_id="check", block_tokens=16, blocks_per_chunk=case.bpc, kv_first=case.kv_first
    )
    n = SWEEP_ROWS - 1
    rng = np.random.default_rng(case.bpc * 10 + case.skip)
    if case.scattered:
        rows = rng.permutation(SWEEP_ROWS)[:n]
        src = rng.permutation(SWEEP_BLOCKS)[: n * case.bpc]
        dst = rng.permutation(SWEEP_BLOCKS)[: n * case.bpc - case.skip]
    else:
        rows = np.arange(1, 1 + n)
        src = np.arange(n * case.bpc)
        dst = np.arange(SWEEP_BLOCKS - (n * case.bpc - case.skip), SWEEP_BLOCKS)
    pin = "auto" if device == "cuda" else "off"
    with _region(layout, SWEEP_ROWS, case.shared, pin) as views:
        xfer = _transfer(layout, kv, views, how)
        try:
            xfer.run_now(True, rows, src)
            stored = np.concatenate([_bytes(v[rows]) for v in views])
            xfer.run_now(False, rows, dst, case.skip)
            loaded = [_bytes(t) for t in kv]
            copies = xfer.statistics().copies_issued
        finally:
            asyncio.run(xfer.aclose())
    return stored, loaded, (layout, kv, rows, src, dst, copies)


def _reference(case: Case, layout: Any, rows: np.ndarray, src: np.ndarray, dst: np.ndarray) -> Any:
    """The rows and tensors a store then load must leave, from the layout alone."""
    from kvtier.testing.device import reference_row

    kv = _tensors(case.kv_first, case.dtype, SWEEP_LAYERS, SWEEP_BLOCKS, SWEEP_INNER)
    bpc = case.bpc
    per_row = [
        reference_row(layout, kv, src[i * bpc : (i + 1) * bpc].tolist()) for i in range(len(rows))
    ]
    # Rows as the store leaves them, tensor by tensor (the views' order).
    stored = []
    for i, spec in enumerate(layout.tensors):
        lo = layout.tensor_offset(i)
        hi = lo + spec.bytes_per_block * bpc
        stored += [np.frombuffer(r[lo:hi], dtype=np.uint8) for r in per_row]
    # Tensors after the load: sub-block skip + i of the rows goes to dst[i].
    after = [t.clone() for t in kv]
    for i, d in enumerate(dst.tolist()):
        s = int(src[case.skip + i])
        for a, o in zip(after, kv, strict=True):
            if case.kv_first:
                a[:, d] = o[:, s]
            else:
                a[d] = o[s]
    return np.concatenate(stored), [_bytes(a) for a in after]


def check_sweep(rep: Report, quick: bool) -> None:
    cases = _cases()
    if quick:
        cases = cases[:: max(1, len(cases) // 12)]
    candidates = ["cpu-python", "torch-pieces", "torch-gather"]
    cuda_modes = ["cuda-batch", "cuda-loop", "cuda-gather", "cuda-gather-rows"]
    cuda_modes += ["cuda-gather-kernel", "cuda-gather-kernel-rows", "cuda-torch"]
    t0 = time.perf_counter()
    for case in cases:
        stored, loaded, (layout, _kv, rows, src, dst, _n) = _run_case(case, "cpu", "cpu")
        want_rows, want_kv = _reference(case, layout, rows, src, dst)
        if not np.array_equal(stored, want_rows) or any(
            not np.array_equal(a, b) for a, b in zip(loaded, want_kv, strict=True)
        ):
            rep.fail(f"sweep cpu {case}", "differs from the layout's reference")
            continue
        runs = [(c, "cpu") for c in candidates] + (
            [(c, "cuda") for c in cuda_modes] if CUDA else []
        )
        for how, device in runs:
            try:
                got_rows, got_kv, _ = _run_case(case, how, device)
            except Exception as exc:
                rep.fail(f"sweep {how} {case}", f"{type(exc).__name__}: {exc}")
                continue
            same_rows = np.array_equal(got_rows, stored)
            same_kv = all(np.array_equal(a, b) for a, b in zip(got_kv, loaded, strict=True))
            if not (same_rows and same_kv):
                bad = int((got_rows != stored).sum()) if got_rows.shape == stored.shape else -1
                rep.fail(
                    f"sweep {how} {case}",
                    f"rows equal {same_rows} ({bad} bytes differ), tensors equal {same_kv}",
                )
    seconds = time.perf_counter() - t0
    checked = [*candidates, *(cuda_modes if CUDA else [])]
    rep.results["sweep"] = {
        "cases": len(cases),
        "copiers": checked,
        "seconds": seconds,
        "failures": [f for f in rep.failures if f.startswith("sweep")],
    }
    if not rep.results["sweep"]["failures"]:
        rep.ok(
            f"sweep of {len(cases)} cases",
            f"cpu (compiled) equals the reference; {', '.join(checked)} equal cpu byte for byte "
            f"({seconds:.1f} s)",
        )
    if not CUDA:
        rep.skip("sweep on CUDA (batch, loop, gather, gather-kernel, torch)", NO_CUDA)


# -- engine ---------------------------------------------------------------------------


def _engine_layout(device: str, layers: int, blocks: int) -> tuple[Any, list[torch.Tensor]]:
    from kvtier.layout import KVLayout

    kv = [
        t.to(device)
        for t in _tensors(True, torch.float16, layers, blocks, (16, 8, 128))  # 64 KiB halves
    ]
    return KVLayout.from_tensors(kv, model_id="check", block_tokens=16, kv_first=True), kv


async def _engine_round_trip(device: str, root: Path, blocks: int) -> str:
    from kvtier import FileTierConfig, KVTierConfig, chain_keys
    from kvtier.engine import Engine

    layout, kv = _engine_layout(device, 2, 2 * blocks)
    row = -(-layout.bytes_per_chunk // 4096) * 4096
    config = KVTierConfig(
        cpu_bytes_to_use=8 * row,  # fewer rows than blocks: they stream through the file tier
        file_tier=FileTierConfig(root=root, bytes_to_use=4 * blocks * (row + 4096) + (1 << 20)),
    )
    want = [_bytes(t[:, :blocks]) for t in kv]
    async with await Engine.open(config, layout, kv) as engine:
        keys = chain_keys(list(range(blocks * 16)), engine.block_tokens, engine.namespace)
        summary = await engine.store(keys, list(range(blocks)))
        await engine.flush()
        if summary.stored != blocks:
            raise AssertionError(f"stored {summary.stored} of {blocks}")
        hits = engine.lookup(keys)
        loaded = await engine.load(keys[:hits], list(range(blocks, 2 * blocks)))
        await engine.flush()
        got = [_bytes(t[:, blocks:]) for t in kv]
        st = engine.statistics()
        if loaded != blocks or any(
            not np.array_equal(a, b) for a, b in zip(got, want, strict=True)
        ):
            raise AssertionError(f"loaded {loaded} of {blocks} ({hits} hits); bytes differ")
        pinned = st.tiers["cpu"].statistics.pinned
        if pinned or st.front.in_flight:
            raise AssertionError(f"pinned {pinned}, in flight {st.front.in_flight}")
        promoted = st.tiers["file"].read_blocks
    size = layout.bytes_per_chunk >> 10
    return f"{blocks} blocks of {size} KiB stored and loaded back, {promoted} promoted from file"


def check_engine(rep: Report, quick: bool) -> None:
    blocks = 16 if quick else 48
    for device in ("cpu", "cuda"):
        if device == "cuda" and not CUDA:
            rep.skip("engine on CUDA tensors", NO_CUDA)
            continue
        root = Path(tempfile.mkdtemp(prefix="kvtier-check-"))
        try:
            detail = asyncio.run(_engine_round_trip(device, root / "tier", blocks))
        except Exception as exc:
            rep.fail(f"engine on {device}", f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
        else:
            rep.ok(f"engine on {device} through CPU and file tiers", detail)
            rep.results[f"engine_{device}"] = detail
        finally:
            shutil.rmtree(root, ignore_errors=True)


# -- cancel ---------------------------------------------------------------------------


async def _cancelled_load(device: str, blocks: int) -> str:
    from kvtier import KVTierConfig, chain_keys
    from kvtier.engine import Engine

    layout, kv = _engine_layout(device, 32, 3 * blocks)  # 2 MiB blocks: the copy takes a while
    row = -(-layout.bytes_per_chunk // 4096) * 4096
    config = KVTierConfig(cpu_bytes_to_use=(blocks + 1) * row)
    before = [t.clone() for t in kv]
    async with await Engine.open(config, layout, kv) as engine:
        keys = chain_keys(list(range(blocks * 16)), engine.block_tokens, engine.namespace)
        await engine.store(keys, list(range(blocks)))
        target = list(range(2 * blocks, 3 * blocks))
        task = asyncio.ensure_future(engine.load(keys, target))
        await asyncio.sleep(0)  # the load's copy is queued now
        copier = engine._xfer._copier  # type: ignore[attr-defined]
        streams = getattr(copier, "_streams", None)
        # Queued or running, not complete: the transfer has not reported it done.
        mid_copy = engine._xfer.statistics().in_flight > 0
        cancelled = task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:
            cancelled = False
        await engine.flush()
        st = engine.statistics()
        pinned = st.tiers["cpu"].statistics.pinned
        if pinned or st.front.in_flight:
            raise AssertionError(
                f"after the cancel: pinned {pinned}, in flight {st.front.in_flight}"
            )
        if streams is not None and not all(s.query() for s in streams.values()):
            raise AssertionError("a copy stream still has work queued")
        for t, b in zip(kv, before, strict=True):
            # The cancelled load ran to its end: its blocks hold the stored ones...
            if not torch.equal(
                t[:, 2 * blocks :].view(torch.uint8), b[:, :blocks].view(torch.uint8)
            ):
                raise AssertionError("a block the cancelled load named holds other bytes")
            # ...and no other block changed.
            if not torch.equal(
                t[:, : 2 * blocks].view(torch.uint8), b[:, : 2 * blocks].view(torch.uint8)
            ):
                raise AssertionError("a block the cancelled load did not name changed")
        # The CPU tier's copies are intact: load them again elsewhere.
        again = await engine.load(keys, list(range(blocks, 2 * blocks)))
        if again != blocks or not all(
            torch.equal(
                t[:, blocks : 2 * blocks].view(torch.uint8), b[:, :blocks].view(torch.uint8)
            )
            for t, b in zip(kv, before, strict=True)
        ):
            raise AssertionError("the CPU tier's blocks changed under the cancelled load")
    if not cancelled:
        when = "not cancelled: it finished first"
    elif streams is None:
        when = "cancelled (CPU backend: its copy runs on a thread)"
    else:
        when = "cancelled " + ("while its copy was in flight" if mid_copy else "after its copy")
    return f"{blocks} blocks of {layout.bytes_per_chunk >> 20} MiB, {when}"


def check_cancel(rep: Report, quick: bool) -> None:
    for device in ("cpu", "cuda"):
        if device == "cuda" and not CUDA:
            rep.skip("cancellation of a load mid-copy on CUDA", NO_CUDA)
            continue
        blocks = 4 if quick or device == "cpu" else 64
        try:
            detail = asyncio.run(_cancelled_load(device, blocks))
        except Exception as exc:
            rep.fail(f"cancel on {device}", f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
        else:
            rep.ok(
                f"cancelled load on {device}: no pinned row, no stream busy, no block corrupted",
                detail,
            )
            rep.results[f"cancel_{device}"] = detail


# -- bench ----------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _timed(xfer: Any, store: bool, rows: np.ndarray, ids: np.ndarray) -> tuple[float, float, int]:
    """One request through the transfer's own path: seconds to issue and to finish, pieces."""
    from kvtier.transfer.device import _Request

    _st, r, skip, per_group = xfer._plan(store, rows, ids, 0)
    nbytes = int(ids.size) * xfer._layout.bytes_per_block
    per_tensor = [per_group[g] for g in xfer._tensor_groups]
    t0 = time.perf_counter()
    req = _Request(store, r, skip, per_tensor, None, nbytes, xfer._copier.mark())
    plan = xfer._plan_copies(req)
    copies, wait = xfer._copier.run(plan, req.marker)
    t1 = time.perf_counter()
    if wait is not None:
        wait()
    return t1 - t0, time.perf_counter() - t0, copies


def _request(xfer: Any, store: bool, rows: np.ndarray, ids: np.ndarray) -> Callable[[], object]:
    return lambda: _timed(xfer, store, rows, ids)


def _both(fns: list[Callable[[], object]]) -> float:
    """Run callables on threads started together; the seconds until the last ends."""
    barrier = threading.Barrier(len(fns) + 1)
    errors: list[BaseException] = []

    def go(fn: Callable[[], object]) -> None:
        barrier.wait()
        try:
            fn()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(fn,)) for fn in fns]
    for th in threads:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


@dataclass
class Shape:
    name: str
    kv_first: bool
    layers: int
    inner: tuple[int, ...]


REALISTIC = Shape("32 layers K/V-first, 2 MiB rows of 32 KiB pieces", True, 32, (16, 8, 128))
BIG = Shape("one block-first tensor, 2 MiB blocks", False, 1, (16, 8, 8192))


def _bench_shape(
    rep: Report, shape: Shape, device: str, hows: list[str], chunk_rows: int, repeat: int
) -> list[dict[str, Any]]:
    from kvtier.layout import KVLayout

    blocks = 2 * chunk_rows  # room for a store and a load at once on disjoint blocks
    kv = [
        torch.empty(
            (2, blocks, *shape.inner) if shape.kv_first else (blocks, *shape.inner),
            dtype=torch.float16,
            device=device,
        ).uniform_()
        for _ in range(shape.layers)
    ]
    layout = KVLayout.from_tensors(kv, model_id="bench", block_tokens=16, kv_first=shape.kv_first)
    nbytes = chunk_rows * layout.bytes_per_chunk
    out = []
    pin = "auto" if device == "cuda" else "off"
    with _region(layout, 2 * chunk_rows, False, pin) as views:
        # The baseline: one contiguous copy of the same bytes between the same
        # region (rows 0..n, contiguous from the first row) and a device buffer.
        host_all = torch.as_strided(views[0], (2 * nbytes,), (1,))  # rows are contiguous
        host_a, host_b = host_all[:nbytes], host_all[nbytes : 2 * nbytes]
        dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
        base = _baseline(device, host_a, host_b, dev_a, dev_b, repeat)
        for order in ("consecutive", "scattered"):
            rng = np.random.default_rng(7)
            if order == "consecutive":
                rows_s, rows_l = np.arange(chunk_rows), np.arange(chunk_rows, 2 * chunk_rows)
                ids_s, ids_l = np.arange(chunk_rows), np.arange(chunk_rows, 2 * chunk_rows)
            else:
                perm_r, perm_i = rng.permutation(2 * chunk_rows), rng.permutation(blocks)
                rows_s, rows_l = perm_r[:chunk_rows], perm_r[chunk_rows:]
                ids_s, ids_l = perm_i[:chunk_rows], perm_i[chunk_rows:]
            for how in hows:
                xfer = _transfer(layout, kv, views, how)
                try:
                    describe = getattr(xfer._copier, "describe", lambda: "")() or how
                    _timed(xfer, True, rows_l, ids_l)  # the rows a load reads hold bytes
                    st, ld, both, issue_s, issue_l = [], [], [], [], []
                    pieces = 0
                    for _ in range(repeat + 1):
                        i_s, t_s, pieces = _timed(xfer, True, rows_s, ids_s)
                        i_l, t_l, _ = _timed(xfer, False, rows_l, ids_l)
                        t_b = _both(
                            [
                                _request(xfer, True, rows_s, ids_s),
                                _request(xfer, False, rows_l, ids_l),
                            ]
                        )
                        st.append(t_s)
                        ld.append(t_l)
                        both.append(t_b)
                        issue_s.append(i_s)
                        issue_l.append(i_l)
                    st, ld, both = st[1:], ld[1:], both[1:]  # the first round warms up
                    row = {
                        "shape": shape.name,
                        "order": order,
                        "copier": how,
                        "describe": describe,
                        "bytes": nbytes,
                        "pieces": pieces,
                        "store_gbps": nbytes / _median(st) / 1e9,
                        "load_gbps": nbytes / _median(ld) / 1e9,
                        "both_gbps": 2 * nbytes / _median(both) / 1e9,
                        "store_ratio": base["d2h"] / _median(st),
                        "load_ratio": base["h2d"] / _median(ld),
                        "both_ratio": base["both"] / _median(both),
                        "store_issue_us": _median(issue_s[1:]) * 1e6,
                        "load_issue_us": _median(issue_l[1:]) * 1e6,
                        "baseline_gbps": {
                            k: nbytes * (2 if k == "both" else 1) / v / 1e9 for k, v in base.items()
                        },
                    }
                    out.append(row)
                finally:
                    asyncio.run(xfer.aclose())
    return out


def _baseline(
    device: str,
    host_a: torch.Tensor,
    host_b: torch.Tensor,
    dev_a: torch.Tensor,
    dev_b: torch.Tensor,
    repeat: int,
) -> dict[str, float]:
    """Median seconds of one contiguous copy each way and of both at once."""
    if device == "cuda":
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]  # type: ignore[no-untyped-call]

        def copy(dst: torch.Tensor, src: torch.Tensor, i: int) -> Callable[[], None]:
            def run() -> None:
                with torch.cuda.stream(streams[i]):
                    dst.copy_(src, non_blocking=True)
                streams[i].synchronize()

            return run
    else:

        def copy(dst: torch.Tensor, src: torch.Tensor, i: int) -> Callable[[], None]:
            def run() -> None:
                dst.copy_(src)

            return run

    d2h, h2d = copy(host_a, dev_a, 0), copy(dev_b, host_b, 1)
    out: dict[str, list[float]] = {"d2h": [], "h2d": [], "both": []}
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        d2h()
        t1 = time.perf_counter()
        h2d()
        t2 = time.perf_counter()
        both = _both([d2h, h2d])
        if i:
            out["d2h"].append(t1 - t0)
            out["h2d"].append(t2 - t1)
            out["both"].append(both)
    return {k: _median(v) for k, v in out.items()}


def check_bench(rep: Report, quick: bool) -> None:
    table: list[dict[str, Any]] = []
    if CUDA:
        hows = ["cuda-auto", "cuda-batch", "cuda-gather", "cuda-gather-kernel"]
        hows += ["cuda-gather-128m", "cuda-loop", "cuda-torch"]
        rows = 32 if quick else 256  # 512 MiB requests
        for shape in (REALISTIC, BIG):
            table += _bench_shape(rep, shape, "cuda", hows, rows, 3 if quick else 7)
    else:
        rep.skip("throughput on CUDA", NO_CUDA)
        rows = 8 if quick else 64
        for shape in (REALISTIC, BIG):
            table += _bench_shape(rep, shape, "cpu", ["cpu"], rows, 2 if quick else 5)
    rep.results["bench"] = table
    base = table[0]["baseline_gbps"] if table else {}
    print(
        f"\n  {'layout':<50} {'ids':<11} {'copier':<19} {'pieces':>6} "
        f"{'store GB/s (x)':>15} {'load GB/s (x)':>15} {'both GB/s (x)':>15} {'issue us s/l':>13}"
    )
    for r in table:
        cells = " ".join(
            f"{r[f'{w}_gbps']:7.2f} ({r[f'{w}_ratio']:.2f})" for w in ("store", "load", "both")
        )
        issue = f"{r['store_issue_us']:6.0f}/{r['load_issue_us']:<6.0f}"
        head = f"{r['shape']:<50} {r['order']:<11} {r['copier']:<19} {r['pieces']:>6}"
        print(f"  {head} {cells} {issue}")
    if table:
        shown = {k: round(v, 2) for k, v in base.items()}
        print(f"  one contiguous copy of the same bytes (GB/s), first layout: {shown}")
        for how in dict.fromkeys(r["copier"] for r in table):
            r = next(r for r in table if r["copier"] == how)
            print(f"  {how}: {r['describe']}")
    rep.ok("bench", f"{len(table)} rows")


# -- main -----------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("sections", nargs="*", help=f"any of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer cases")
    args = parser.parse_args()
    sections = args.sections or list(SECTIONS)
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}: choose from {', '.join(SECTIONS)}")
    rep = Report()
    t0 = time.perf_counter()
    print(
        f"kvtier CUDA check: {'CUDA device ' + torch.cuda.get_device_name(0) if CUDA else NO_CUDA}"
    )
    for name in SECTIONS:
        if name not in sections:
            continue
        _section(name)
        t = time.perf_counter()
        try:
            if name == "env":
                if not check_env(rep):
                    break
            else:
                {
                    "sweep": check_sweep,
                    "engine": check_engine,
                    "cancel": check_cancel,
                    "bench": check_bench,
                }[name](rep, args.quick)
        except Exception as exc:
            rep.fail(name, f"{type(exc).__name__}: {exc}")
            traceback.print_exc()
        print(f"  ({time.perf_counter() - t:.1f} s)", flush=True)
    rep.results["seconds"] = time.perf_counter() - t0
    rep.results["failures"] = rep.failures
    rep.results["skipped"] = rep.skipped
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "check.json").write_text(json.dumps(rep.results, indent=2, default=str))
    failed = ": " + "; ".join(rep.failures) if rep.failures else ""
    print(
        f"\n{len(rep.failures)} failed, {len(rep.skipped)} skipped "
        f"({time.perf_counter() - t0:.0f} s){failed}"
    )
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
