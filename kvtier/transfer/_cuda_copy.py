"""The CUDA backend of :mod:`kvtier.transfer.device`: streams, events, pinned rows.

Two ways to move a request, both on the direction's stream:

``batch`` (and ``loop``)
    Every piece (contiguous on both sides, so one DMA between device memory
    and the pinned region) queued by the compiled loop
    ``kvtier.transfer._copy.cuda_copy``: one ``cudaMemcpyBatchAsync`` per
    8192 pieces where the CUDA runtime has it (12.8 and later), else one
    ``cudaMemcpyAsync`` per piece, either way without the GIL and without
    Python per piece.
``gather``
    Whole rows through a device staging buffer: a store gathers the pieces
    of up to ``staging_bytes`` of rows into it on the GPU (one indexing
    kernel per tensor), then copies each row out in one DMA; a load copies
    rows in, then scatters. Small pieces cost the copy engines and the
    runtime about a microsecond each; a row of a real layout is 64 of them.

The runtime is loaded at run time, so kvtier installs and imports without
CUDA; where the compiled module or a runtime is missing, one ``Tensor.copy_``
per piece is the fallback (``torch``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvtier.errors import ConfigurationError
from kvtier.transfer import _copier
from kvtier.transfer._copier import CopyPlan, _Copier, copy_pieces

__all__ = [
    "GATHER_BELOW",
    "STAGING_BYTES",
    "CudaCopier",
    "Mode",
    "TorchGatherCopier",
    "TorchPiecesCopier",
    "copy_pieces_torch",
    "cudart_candidates",
    "gather_copy",
    "load_cudart",
    "row_slices",
]

Mode = Literal["auto", "batch", "loop", "gather", "torch"]
"""How :class:`CudaCopier` issues a plan: ``batch`` (``cudaMemcpyBatchAsync``,
the loop where the runtime lacks it), ``loop`` (``cudaMemcpyAsync`` per piece),
``gather`` (whole rows through a device staging buffer), ``torch``
(``Tensor.copy_`` per piece, from Python), ``auto`` (per request: ``gather``
where its pieces average under :data:`GATHER_BELOW` and each row's slice is
one run of bytes, else ``batch``; ``torch`` where the compiled module or a
runtime does not load)."""

STAGING_BYTES = 128 << 20
"""Device staging buffer of the ``gather`` mode, per direction."""

GATHER_BELOW = 256 << 10
"""``auto`` gathers requests whose pieces average fewer bytes than this."""


def _non_blocking(dst: Any, src: Any) -> None:
    dst.copy_(src, non_blocking=True)


def copy_pieces_torch(plan: CopyPlan) -> None:
    """Queue a plan's pieces one ``Tensor.copy_`` each (torch views of the plan's tensors).

    The fallback of :class:`CudaCopier`: on the current stream, ``non_blocking``,
    each piece contiguous on both sides, so each is a single ``cudaMemcpyAsync``
    between device memory and the pinned region (a strided copy would stage
    through pageable memory and turn synchronous).
    """
    copy_pieces(plan, _non_blocking)


class TorchPiecesCopier(_Copier):
    """:func:`copy_pieces_torch` on the calling thread, without streams or events.

    The loop of :class:`CudaCopier`'s ``torch`` mode alone, for CPU tensors:
    tests and ``benchmarks/gpu/check.py`` check its bytes where there is no GPU.
    """

    name = "torch-pieces"

    def mark(self) -> object:
        return None

    def run(self, plan: CopyPlan, marker: object) -> tuple[int, Callable[[], None] | None]:
        copy_pieces_torch(plan)
        return plan.copies, None


RowCopy = Callable[[np.ndarray, np.ndarray, np.ndarray], object]
"""Queues whole-row copies between the staging buffer and the rows, given as a plan
of one "tensor" (the staging buffer) in units of a row slice: table, pieces, spans."""


def row_slices(table: np.ndarray) -> tuple[int, np.ndarray] | None:
    """The bytes of a row's slice and each tensor's offset in it, if they tile it.

    ``gather`` copies a row's slice (every tensor's part of it) in one piece,
    so the parts must follow each other with no gap; None where they do not.
    """
    host, row_bytes = table[:, 1], table[:, 5]
    offsets = host - host[0]
    starts = np.concatenate(([0], np.cumsum(row_bytes)[:-1]))
    same_rows = (table[:, 3] == table[0, 3]).all() and (table[:, 6] == table[0, 6]).all()
    if not same_rows or not np.array_equal(offsets, starts):
        return None
    return int(row_bytes.sum()), offsets


def _units(pieces: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """Pieces expanded into one (slot, host unit, device unit) row per unit."""
    n = pieces[:, 3]
    which = np.repeat(np.arange(len(pieces)), n)
    within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    return np.stack([slot[which], pieces[which, 1] + within, pieces[which, 2] + within], axis=0)


def _word(table: np.ndarray, staging: Any, slice_bytes: int, offsets: np.ndarray) -> int:
    """The widest element (8 or 1 bytes) every unit, offset and base address allows.

    The indexing kernels move one element per thread: 8-byte ones move a unit
    with an eighth of the threads of bytes.
    """
    values = [*table[:, 0].tolist(), *table[:, 2].tolist(), *offsets.tolist()]
    values += [staging.data_ptr(), slice_bytes, len(staging)]
    return 8 if all(v % 8 == 0 for v in values) else 1


def gather_copy(plan: CopyPlan, staging: Any, slices: tuple[int, np.ndarray], rows: RowCopy) -> int:
    """Run ``plan`` through ``staging``, ``len(staging) // slice`` rows at a time.

    On the current stream: a store gathers each tensor's pieces into the
    staging rows with one indexing kernel per tensor, then ``rows`` copies the
    rows out; a load copies rows in, then scatters. The indices of every round
    go to the device in one copy from pinned memory, before the first round:
    a copy from pageable memory would wait for the stream to drain, and the
    rounds would no longer queue ahead of the GPU. Returns the copies queued
    (rows, and one gather or scatter per tensor, per round).
    """
    import torch

    t = plan.tensors
    slice_bytes, offsets = slices
    cap = len(staging) // slice_bytes
    pieces = plan.pieces
    request_rows = np.unique(pieces[:, 0])
    one = t.table[:1].copy()  # the staging buffer as the device side, rows as they are
    one[0, [0, 2, 4, 5]] = (staging.data_ptr(), slice_bytes, len(staging), slice_bytes)
    rounds = [request_rows[i : i + cap] for i in range(0, len(request_rows), cap)]
    # Units of every round and distinct span, in one array: (round, span) -> columns.
    spans = plan.spans.tolist()
    where: dict[tuple[int, int, int], tuple[int, int]] = {}
    parts = []
    at = 0
    for r, chunk in enumerate(rounds):
        for a, b in dict.fromkeys(map(tuple, spans)):
            p = pieces[a:b]
            p = p[(p[:, 0] >= chunk[0]) & (p[:, 0] <= chunk[-1])]
            u = _units(p, np.searchsorted(chunk, p[:, 0]))
            where[(r, a, b)] = (at, at + u.shape[1])
            parts.append(u)
            at += u.shape[1]
    host_idx = torch.from_numpy(np.concatenate(parts, axis=1))
    if staging.device.type == "cuda":  # pragma: no cover - needs a GPU
        host_idx = host_idx.pin_memory()  # torch's pinned cache keeps it until the copy ran
    idx = host_idx.to(staging.device, non_blocking=True)
    w = _word(t.table, staging, slice_bytes, offsets)
    kind = torch.int64 if w == 8 else torch.uint8
    words = staging.view(kind)
    copies = 0
    for r, chunk in enumerate(rounds):
        k = len(chunk)
        row_plan = np.stack([chunk, np.zeros(k, np.int64), np.arange(k), np.ones(k, np.int64)], 1)
        row_span = np.array([[0, k]], dtype=np.int64)
        if not plan.store:
            rows(one, row_plan, row_span)
        for i, (a, b) in enumerate(spans):
            lo, hi = where[(r, a, b)]
            slot_i, host_i, dev_i = idx[:, lo:hi]
            unit, row_bytes = int(t.table[i, 2]), int(t.table[i, 5])
            dev = t.dev[i].view(kind).view(-1, unit // w)
            rows_i = torch.as_strided(
                words,
                (k, row_bytes // unit, unit // w),
                (slice_bytes // w, unit // w, 1),
                int(offsets[i]) // w,
            )
            if plan.store:
                rows_i[slot_i, host_i] = dev[dev_i]
            else:
                dev[dev_i] = rows_i[slot_i, host_i]
            copies += 1
        if plan.store:
            rows(one, row_plan, row_span)
        copies += k
    return copies


class TorchGatherCopier(_Copier):
    """:func:`gather_copy` on CPU tensors, rows copied with memcpy (tests, the GPU check)."""

    name = "torch-gather"

    def __init__(self, staging_bytes: int = STAGING_BYTES) -> None:
        self._staging_bytes = staging_bytes

    def mark(self) -> object:
        return None

    def run(self, plan: CopyPlan, marker: object) -> tuple[int, Callable[[], None] | None]:
        import torch

        compiled = _copier.native
        slices = row_slices(plan.tensors.table)
        if compiled is None or slices is None:
            copy_pieces_torch(plan)
            return plan.copies, None
        staging = torch.empty(max(self._staging_bytes, slices[0]), dtype=torch.uint8)

        def rows(table: np.ndarray, pieces: np.ndarray, spans: np.ndarray) -> None:
            compiled.copy_host(table, pieces, spans, plan.store, 0, 1)

        return gather_copy(plan, staging, slices, rows), None


def cudart_candidates() -> list[str]:
    """CUDA runtime libraries to try, best first.

    The one this process already mapped comes first (torch links one: copies
    then go through the same runtime as torch's streams and events), then the
    ones torch ships beside itself, then the loader's usual names.
    """
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart.so" in path:
                    found.append(path)
    except OSError:  # pragma: no cover - /proc is always there on Linux
        pass
    try:
        import torch

        root = Path(torch.__file__).parent
        found += sorted(str(p) for p in (root / "lib").glob("libcudart.so*"))
        found += sorted(str(p) for p in root.parent.glob("nvidia/*/lib/libcudart.so*"))
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    found += ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    return list(dict.fromkeys(found))


def load_cudart() -> tuple[str, int]:
    """Load a CUDA runtime into the compiled module once: its path and version.

    Raises
    ------
    ConfigurationError
        The compiled module is not built, or no candidate loads (every
        ``dlopen`` error is in the message; the last is the cause).
    """
    compiled = _copier.native
    if compiled is None:
        raise ConfigurationError("kvtier.transfer._copy is not built (no C compiler at install)")
    status = compiled.cuda_status()
    if status:
        return str(status["path"]), int(str(status["version"]))
    errors: list[str] = []
    last: OSError | None = None
    for path in cudart_candidates():
        try:
            version = compiled.cuda_load(path)
        except OSError as exc:
            errors.append(str(exc))
            last = exc
            continue
        return path, version
    raise ConfigurationError("no CUDA runtime could be loaded: " + "; ".join(errors)) from last


class CudaCopier(_Copier):  # pragma: no cover - needs a GPU
    """Copies on one dedicated stream per direction; completion is a CUDA event.

    The request's worker thread queues the copies and records an event; a
    waiter thread per direction blocks in ``Event.synchronize`` and then
    resolves the completion. Blocking a thread that does nothing else costs no
    CPU and adds no polling latency, keeps the event loop free, and lets the
    worker issue the next request while the copy engine is still busy.

    Parameters
    ----------
    device
        The torch device of the KV tensors.
    mode
        How the pieces are queued (:data:`Mode`).
    staging_bytes
        Size of each direction's device staging buffer in ``gather`` mode
        (at least one row's slice).

    Raises
    ------
    ConfigurationError
        ``mode`` is ``batch`` or ``loop`` and the compiled module or a CUDA
        runtime cannot be loaded.
    """

    name = "cuda"

    def __init__(
        self, device: Any, mode: Mode = "auto", staging_bytes: int = STAGING_BYTES
    ) -> None:
        import torch

        self._torch = torch
        self._device = torch.device(device)
        self._index = (
            self._device.index if self._device.index is not None else torch.cuda.current_device()
        )
        self._streams = {
            True: torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
            False: torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
        }
        self.mode: Mode = mode
        self.runtime = "none"
        self._staging_bytes = staging_bytes
        # Per direction: its stream's staging buffer (gather), allocated at first use.
        self._staging: dict[bool, Any] = {}
        if mode != "torch":
            try:
                path, version = load_cudart()
            except ConfigurationError as exc:
                if mode != "auto":
                    raise
                self.mode, self.runtime = "torch", f"none ({exc})"
            else:
                self.mode = mode
                self.runtime = f"{os.path.basename(path)} {version // 1000}.{version % 1000 // 10}"
        self._cuda_copy = _copier.native.cuda_copy if _copier.native is not None else None

    def describe(self) -> str:
        """The mode in use and the runtime it calls (for logs and benchmarks)."""
        status = _copier.native.cuda_status() if _copier.native is not None else {}
        batch = "" if self.mode == "torch" else f", runtime batches: {status.get('batch')}"
        if self.mode == "auto":
            batch += f", gathers pieces under {GATHER_BELOW >> 10} KiB"
        failed = status.get("batch_error")
        return f"{self.mode} via {self.runtime}{batch}" + (
            f" (batch refused with error {failed}: looping)" if failed else ""
        )

    def _slices(self, plan: CopyPlan) -> tuple[int, np.ndarray] | None:
        """Row slices to gather through, where this request goes through staging."""
        if self.mode not in ("gather", "auto"):
            return None
        if self.mode == "auto" and plan.nbytes >= GATHER_BELOW * plan.copies:
            return None  # pieces large enough for the copy engines as they are
        return row_slices(plan.tensors.table)

    def mark(self) -> object:
        # Recorded where the caller submits, on the caller's current (compute)
        # stream: everything the model queued before this request (its writes
        # to these blocks) is before the event. ``stream.wait_stream`` called
        # later on the worker thread would see that thread's current stream.
        event = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._torch.cuda.current_stream(self._device))
        return event

    def run(self, plan: CopyPlan, marker: object) -> tuple[int, Callable[[], None] | None]:
        torch = self._torch
        stream = self._streams[plan.store]
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            # A store must not read blocks before the model's writes to them;
            # a load must not overwrite blocks that work queued before it may
            # still read (the blocks it was handed were free a moment ago).
            stream.wait_event(marker)  # type: ignore[arg-type]
            slices = self._slices(plan)
            if self.mode == "torch" or self._cuda_copy is None:
                copy_pieces_torch(plan)
                copies = plan.copies
            elif slices is not None:
                cuda_copy, handle, index = self._cuda_copy, stream.cuda_stream, self._index

                def rows(table: np.ndarray, pieces: np.ndarray, spans: np.ndarray) -> None:
                    cuda_copy(table, pieces, spans, plan.store, handle, index, True)

                # As many rows as the request has, up to staging_bytes (one at least).
                rows_needed = len(np.unique(plan.pieces[:, 0]))
                size = min(max(self._staging_bytes, slices[0]), rows_needed * slices[0])
                staging = self._staging.get(plan.store)
                if staging is None or len(staging) < size:
                    staging = torch.empty(size, dtype=torch.uint8, device=self._device)
                    self._staging[plan.store] = staging
                copies = gather_copy(plan, staging, slices, rows)
            else:
                t = plan.tensors
                copies = self._cuda_copy(
                    t.table,
                    plan.pieces,
                    plan.spans,
                    plan.store,
                    stream.cuda_stream,
                    self._index,
                    self.mode != "loop",
                )
            done = torch.cuda.Event()
            done.record(stream)
        return copies, done.synchronize

    def close(self) -> None:
        self._staging.clear()
