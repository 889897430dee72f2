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

import contextlib
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

STAGING_BYTES = 512 << 20
"""Device memory of the ``gather`` mode's two staging buffers, per direction, at most:
they grow to what a request needs. Each round of rows costs about 1.5 ms of Python
issuing two indexing kernels per tensor of 32 (H100, docs/lab/gpu.md): 256 MiB
rounds keep a store and a load at once ahead of the copy engines, 64 MiB ones did
not (0.30x one contiguous copy each way, against 0.70x)."""

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


class Lanes:
    """Where :func:`gather_copy` queues its two kinds of work: row copies, indexing.

    This one runs both on the current stream (CPU tensors, or a single CUDA
    stream); :class:`CudaCopier` passes lanes on two streams, so that one
    buffer's rows are copied while the other's are gathered or scattered.
    """

    def indexing(self) -> contextlib.AbstractContextManager[object]:
        """Make the indexing lane current."""
        return contextlib.nullcontext()

    def mark_copies(self) -> object:
        """A marker after the row copies queued so far."""
        return None

    def mark_indexing(self) -> object:
        """A marker after the indexing queued so far."""
        return None

    def copies_wait(self, marker: object) -> None:
        """Row copies queued from now on run after ``marker``."""

    def indexing_waits(self, marker: object) -> None:
        """Indexing queued from now on runs after ``marker``."""


class _CudaLanes(Lanes):  # pragma: no cover - needs a GPU
    def __init__(self, torch: Any, copies: Any, indexing: Any) -> None:
        self._torch, self._copies, self._indexing = torch, copies, indexing

    def indexing(self) -> contextlib.AbstractContextManager[object]:
        return self._torch.cuda.stream(self._indexing)  # type: ignore[no-any-return]

    def mark_copies(self) -> object:
        return self._copies.record_event()

    def mark_indexing(self) -> object:
        return self._indexing.record_event()

    def copies_wait(self, marker: object) -> None:
        if marker is not None:
            self._copies.wait_event(marker)

    def indexing_waits(self, marker: object) -> None:
        if marker is not None:
            self._indexing.wait_event(marker)


def _word(table: np.ndarray, buffers: list[Any], slice_bytes: int, offsets: np.ndarray) -> int:
    """The widest element (8 or 1 bytes) every unit, offset and base address allows.

    The indexing kernels move one element per thread: 8-byte ones move a unit
    with an eighth of the threads of bytes.
    """
    values = [*table[:, 0].tolist(), *table[:, 2].tolist(), *offsets.tolist(), slice_bytes]
    for b in buffers:
        values += [b.data_ptr(), len(b)]
    return 8 if all(v % 8 == 0 for v in values) else 1


def gather_copy(
    plan: CopyPlan,
    buffers: list[Any],
    slices: tuple[int, np.ndarray],
    rows: RowCopy,
    lanes: Lanes | None = None,
) -> int:
    """Run ``plan`` through staging ``buffers`` in turn, ``len(buffer) // slice`` rows a round.

    A store gathers each tensor's pieces into a buffer's rows (an index_select
    and an index_copy per tensor), then ``rows`` copies the rows out; a load
    copies rows in, then scatters. With two buffers and :class:`Lanes` on two
    streams, a round's indexing overlaps the previous round's row copies. The
    indices of every round go to the device in one copy from pinned memory,
    first: a copy from pageable memory would wait for the stream to drain.
    Returns the copies queued (rows, and a gather or scatter per tensor and
    round).
    """
    import torch

    lanes = lanes or Lanes()
    t = plan.tensors
    slice_bytes, offsets = slices
    cap = len(buffers[0]) // slice_bytes
    pieces = plan.pieces
    request_rows = np.unique(pieces[:, 0])
    rounds = [request_rows[i : i + cap] for i in range(0, len(request_rows), cap)]
    spans = plan.spans.tolist()
    units = [int(u) for u in t.table[:, 2]]
    # Indices of every round, distinct span and unit, in one array: key -> columns.
    where: dict[tuple[int, int, int, int], tuple[int, int]] = {}
    parts = []
    at = 0
    for r, chunk in enumerate(rounds):
        for (a, b), unit in dict.fromkeys(
            (tuple(sp), u) for sp, u in zip(spans, units, strict=True)
        ):
            p = pieces[a:b]
            p = p[(p[:, 0] >= chunk[0]) & (p[:, 0] <= chunk[-1])]
            slot, host, dev = _units(p, np.searchsorted(chunk, p[:, 0]))
            # A unit's place in the round's rows, counted in units from the tensor's part.
            flat = slot * (slice_bytes // unit) + host if slice_bytes % unit == 0 else None
            cols = np.stack([slot, host, dev, flat if flat is not None else host])
            where[(r, a, b, unit)] = (at, at + cols.shape[1])
            parts.append(cols)
            at += cols.shape[1]
    w = _word(t.table, buffers, slice_bytes, offsets)
    kind = torch.int64 if w == 8 else torch.uint8
    words = [b.view(kind) for b in buffers]
    lanes.indexing_waits(lanes.mark_copies())  # after the marker and earlier requests
    with lanes.indexing():
        host_idx = torch.from_numpy(np.concatenate(parts, axis=1))
        if buffers[0].device.type == "cuda":  # pragma: no cover - needs a GPU
            host_idx = host_idx.pin_memory()  # torch's pinned cache keeps it until copied
        idx = host_idx.to(buffers[0].device, non_blocking=True)
    free: list[object] = [None] * len(buffers)
    copies = 0
    for r, chunk in enumerate(rounds):
        k, n = len(chunk), r % len(buffers)
        one = t.table[:1].copy()  # this buffer as the device side, rows as they are
        one[0, [0, 2, 4, 5]] = (buffers[n].data_ptr(), slice_bytes, len(buffers[n]), slice_bytes)
        row_plan = np.stack([chunk, np.zeros(k, np.int64), np.arange(k), np.ones(k, np.int64)], 1)
        row_span = np.array([[0, k]], dtype=np.int64)
        if not plan.store:
            lanes.copies_wait(free[n])  # the last scatter out of this buffer is done
            rows(one, row_plan, row_span)
            lanes.indexing_waits(lanes.mark_copies())
        with lanes.indexing():
            if plan.store:
                lanes.indexing_waits(free[n])  # the last copy out of this buffer is done
            for i, (a, b) in enumerate(spans):
                lo, hi = where[(r, a, b, units[i])]
                slot_i, host_i, dev_i, flat_i = idx[:, lo:hi]
                uw = units[i] // w
                dev = t.dev[i].view(kind).view(-1, uw)
                if slice_bytes % units[i] == 0:
                    start = int(offsets[i]) // w
                    part = torch.as_strided(
                        words[n], ((len(words[n]) - start) // uw, uw), (uw, 1), start
                    )
                    if plan.store:
                        part.index_copy_(0, flat_i, torch.index_select(dev, 0, dev_i))
                    else:
                        dev.index_copy_(0, dev_i, torch.index_select(part, 0, flat_i))
                else:  # rows as (row, unit) pairs: the slice is not a whole number of units
                    part = torch.as_strided(
                        words[n],
                        (k, int(t.table[i, 5]) // units[i], uw),
                        (slice_bytes // w, uw, 1),
                        int(offsets[i]) // w,
                    )
                    if plan.store:
                        part[slot_i, host_i] = dev[dev_i]
                    else:
                        dev[dev_i] = part[slot_i, host_i]
                copies += 1
            if not plan.store:
                free[n] = lanes.mark_indexing()
        if plan.store:
            lanes.copies_wait(lanes.mark_indexing())
            rows(one, row_plan, row_span)
            free[n] = lanes.mark_copies()
        copies += k
    lanes.copies_wait(lanes.mark_indexing())  # the request ends on the copy lane
    return copies


class TorchGatherCopier(_Copier):
    """:func:`gather_copy` on CPU tensors, rows copied with memcpy (tests, the GPU check)."""

    name = "torch-gather"

    def __init__(self, staging_bytes: int = STAGING_BYTES) -> None:
        self._staging_bytes = staging_bytes  # two buffers of half of it (a slice at least)

    def mark(self) -> object:
        return None

    def run(self, plan: CopyPlan, marker: object) -> tuple[int, Callable[[], None] | None]:
        import torch

        compiled = _copier.native
        slices = row_slices(plan.tensors.table)
        if compiled is None or slices is None:
            copy_pieces_torch(plan)
            return plan.copies, None
        size = max(self._staging_bytes // 2, slices[0])
        buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]

        def rows(table: np.ndarray, pieces: np.ndarray, spans: np.ndarray) -> None:
            compiled.copy_host(table, pieces, spans, plan.store, 0, 1)

        return gather_copy(plan, buffers, slices, rows), None


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
        Device memory of each direction's two staging buffers in ``gather``
        mode (each holds a row's slice at least).

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
        # Per direction (gather): a second stream for the indexing kernels, and two
        # staging buffers, allocated at first use.
        self._indexing = {
            True: torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
            False: torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
        }
        self._staging: dict[bool, list[Any]] = {}
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

    def _buffers(self, plan: CopyPlan, slice_bytes: int) -> list[Any]:
        """The direction's two staging buffers, as large as the request needs, up to half
        of ``staging_bytes`` each (a row's slice at least); grown when a request needs more."""
        torch = self._torch
        rows = len(np.unique(plan.pieces[:, 0]))
        size = min(max(self._staging_bytes // 2, slice_bytes), rows * slice_bytes)
        buffers = self._staging.get(plan.store)
        if buffers is None or len(buffers[0]) < size:
            indexing = self._indexing[plan.store]
            buffers = [torch.empty(size, dtype=torch.uint8, device=self._device) for _ in "ab"]
            for b in buffers:  # freed only once the indexing stream is done with it too
                b.record_stream(indexing)
            self._staging[plan.store] = buffers
        return buffers

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

                lanes = _CudaLanes(torch, stream, self._indexing[plan.store])
                copies = gather_copy(plan, self._buffers(plan, slices[0]), slices, rows, lanes)
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
