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
    With ``gather_kernel=True`` the gathers and scatters of a round, every
    tensor's, are one launch of a kernel compiled at run time by NVRTC
    (``kvtier.transfer._gather``) over a table of pieces, issued without the
    GIL; where NVRTC, the driver or the compile fails, the indexing kernels
    (logged once, at INFO, with why).

The runtime is loaded at run time, so kvtier installs and imports without
CUDA; where the compiled module or a runtime is missing, one ``Tensor.copy_``
per piece is the fallback (``torch``).
"""

from __future__ import annotations

import contextlib
import logging
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
    "GATHER_ENTRY",
    "STAGING_BYTES",
    "CudaCopier",
    "Launch",
    "Mode",
    "TorchGatherCopier",
    "TorchPiecesCopier",
    "copy_pieces_torch",
    "cudart_candidates",
    "driver_candidates",
    "gather_copy",
    "kernel_gather_copy",
    "load_cudart",
    "load_gather_kernel",
    "nvrtc_candidates",
    "piece_table",
    "row_slices",
]

log = logging.getLogger("kvtier.transfer")


def _gather_module() -> Any:
    try:
        from kvtier.transfer import _gather
    except ImportError:  # not built (no C compiler): the indexing kernels gather
        return None
    return _gather


gather_native = _gather_module()
"""The compiled gather kernel's loader (``kvtier.transfer._gather``), or None."""

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

GATHER_ENTRY = 64 << 10
"""The gather kernel's pieces are cut into entries of at most this many bytes: one
thread block copies one entry, so the blocks are of a size (a 2 MiB piece would
hold one multiprocessor while the others idle)."""

Launch = Callable[[int, int], object]
"""Queues the gather kernel over ``count`` entries of the device table at ``address``:
``launch(address, count)``, on the indexing lane's stream."""


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


def _to_device(host: Any, like: Any) -> Any:
    """A host tensor copied to ``like``'s device, queued on the current stream.

    From pinned memory where that is CUDA: a copy from pageable memory would wait
    for the stream to drain (torch's pinned cache keeps the copy until it is done).
    """
    if like.device.type == "cuda":  # pragma: no cover - needs a GPU
        host = host.pin_memory()
    return host.to(like.device, non_blocking=True)


def _row_copies(
    table: np.ndarray, buffer: Any, chunk: np.ndarray, slice_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A round's rows as a plan of one "tensor", the staging ``buffer`` (:data:`RowCopy`)."""
    k = len(chunk)
    one = table[:1].copy()  # this buffer as the device side, rows as they are
    one[0, [0, 2, 4, 5]] = (buffer.data_ptr(), slice_bytes, len(buffer), slice_bytes)
    row_plan = np.stack([chunk, np.zeros(k, np.int64), np.arange(k), np.ones(k, np.int64)], 1)
    return one, row_plan, np.array([[0, k]], dtype=np.int64)


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
        idx = _to_device(torch.from_numpy(np.concatenate(parts, axis=1)), buffers[0])

    def move(r: int, n: int, k: int) -> int:
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
        return len(spans)

    return _run_rounds(plan, buffers, slice_bytes, rounds, rows, lanes, move)


def _run_rounds(
    plan: CopyPlan,
    buffers: list[Any],
    slice_bytes: int,
    rounds: list[np.ndarray],
    rows: RowCopy,
    lanes: Lanes,
    move: Callable[[int, int, int], int],
) -> int:
    """The rounds of a gather: ``move(round, buffer, rows)`` queues a round's gathers or
    scatters on the indexing lane (returning how many), ``rows`` its row copies.

    Rounds alternate between ``buffers``: a store gathers into a buffer once the
    previous copy out of it is done, then copies its rows out; a load copies rows
    in once the previous scatter out of the buffer is done, then scatters. The
    request ends on the copy lane. Returns the copies queued.
    """
    free: list[object] = [None] * len(buffers)
    copies = 0
    for r, chunk in enumerate(rounds):
        k, n = len(chunk), r % len(buffers)
        one, row_plan, row_span = _row_copies(plan.tensors.table, buffers[n], chunk, slice_bytes)
        if not plan.store:
            lanes.copies_wait(free[n])  # the last scatter out of this buffer is done
            rows(one, row_plan, row_span)
            lanes.indexing_waits(lanes.mark_copies())
        with lanes.indexing():
            if plan.store:
                lanes.indexing_waits(free[n])  # the last copy out of this buffer is done
            copies += move(r, n, k)
            if not plan.store:
                free[n] = lanes.mark_indexing()
        if plan.store:
            lanes.copies_wait(lanes.mark_indexing())
            rows(one, row_plan, row_span)
            free[n] = lanes.mark_copies()
        copies += k
    lanes.copies_wait(lanes.mark_indexing())  # the request ends on the copy lane
    return copies


def piece_table(
    plan: CopyPlan,
    request_rows: np.ndarray,
    cap: int,
    buffers: list[int],
    slices: tuple[int, np.ndarray],
    entry: int = GATHER_ENTRY,
    compiled: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """The gather kernel's table for a plan: every piece of every round, and each round's.

    Round ``r`` holds ``request_rows[r * cap : (r + 1) * cap]`` in staging buffer
    ``buffers[r % len(buffers)]`` (addresses), a row's slice at ``slot *
    slice_bytes``, each tensor's part at its offset in the slice, as in the
    region's rows. A store copies from the tensors into the staging rows, a load
    the reverse.

    Returns
    -------
    entries
        ``int64 (n, 3)``: source address, destination address, bytes (at most
        ``entry``), round by round.
    bounds
        ``int64 (rounds + 1,)``: round ``r`` is ``entries[bounds[r]:bounds[r + 1]]``.

    Notes
    -----
    Built by ``kvtier.transfer._gather.table`` without the GIL where it is
    built and ``compiled`` (numpy took ~1 ms of the GIL per 16384 pieces, on
    every request), else with numpy; the plan must have been checked against
    its tensors (``kvtier.transfer._copy.check``).
    """
    t = plan.tensors.table
    if compiled and gather_native is not None:
        entries, bounds = gather_native.table(
            t,
            plan.pieces,
            plan.spans,
            plan.store,
            np.ascontiguousarray(request_rows, dtype=np.int64),
            cap,
            np.asarray(buffers, dtype=np.int64),
            np.ascontiguousarray(slices[1], dtype=np.int64),
            slices[0],
            entry,
        )
        return np.frombuffer(entries, np.int64).reshape(-1, 3), np.frombuffer(bounds, np.int64)
    slice_bytes, offsets = slices
    spans = plan.spans
    tensor = np.repeat(np.arange(len(t)), spans[:, 1] - spans[:, 0])
    index = np.concatenate([np.arange(a, b) for a, b in spans.tolist()] or [np.zeros(0, int)])
    p, tt = plan.pieces[index], t[tensor]
    unit = tt[:, 2]
    rnd, slot = np.divmod(np.searchsorted(request_rows, p[:, 0]), cap)
    base = np.asarray(buffers, dtype=np.int64)[rnd % len(buffers)]
    staging = base + slot * slice_bytes + offsets[tensor] + p[:, 1] * unit
    device = tt[:, 0] + p[:, 2] * unit
    length = p[:, 3] * unit
    src, dst = (device, staging) if plan.store else (staging, device)
    cuts = -(-length // entry)
    which = np.repeat(np.arange(len(length)), cuts)
    within = (np.arange(int(cuts.sum())) - np.repeat(np.cumsum(cuts) - cuts, cuts)) * entry
    entries = np.stack(
        [src[which] + within, dst[which] + within, np.minimum(entry, length[which] - within)],
        axis=1,
    )
    order = np.argsort(rnd[which], kind="stable")
    rounds = -(-len(request_rows) // cap)
    bounds = np.searchsorted(rnd[which][order], np.arange(rounds + 1))
    return np.ascontiguousarray(entries[order], dtype=np.int64), bounds.astype(np.int64)


def kernel_gather_copy(
    plan: CopyPlan,
    buffers: list[Any],
    slices: tuple[int, np.ndarray],
    rows: RowCopy,
    launch: Launch,
    lanes: Lanes | None = None,
    entry: int = GATHER_ENTRY,
) -> int:
    """:func:`gather_copy` with one gather or scatter kernel per round, for every tensor.

    The table of every round's pieces (:func:`piece_table`) goes to the device
    once, from pinned memory; each round is then one ``launch`` over its
    entries and one row copy per row, the rounds alternating between buffers
    as in :func:`gather_copy`; pieces are cut into entries of at most
    ``entry`` bytes. Returns the copies queued (rows, and a launch per round).

    Raises
    ------
    ValueError
        A piece of the plan lies outside its tensor or its row's slice
        (checked before anything is queued: the kernel writes where it is told).
    """
    import torch

    compiled = _copier.native
    if compiled is None:
        raise ValueError("the gather kernel needs kvtier.transfer._copy")
    compiled.check(plan.tensors.table, plan.pieces, plan.spans)
    lanes = lanes or Lanes()
    slice_bytes = slices[0]
    cap = len(buffers[0]) // slice_bytes
    request_rows = np.unique(plan.pieces[:, 0])
    addresses = [b.data_ptr() for b in buffers]
    entries, bounds = piece_table(plan, request_rows, cap, addresses, slices, entry)
    lanes.indexing_waits(lanes.mark_copies())  # after the marker and earlier requests
    with lanes.indexing():
        table = _to_device(torch.from_numpy(entries.reshape(-1)), buffers[0])
    address = table.data_ptr()
    rounds = [request_rows[i : i + cap] for i in range(0, len(request_rows), cap)]

    def move(r: int, n: int, k: int) -> int:
        lo, hi = int(bounds[r]), int(bounds[r + 1])
        launch(address + 24 * lo, hi - lo)
        return 1

    copies = _run_rounds(plan, buffers, slice_bytes, rounds, rows, lanes, move)
    del table  # freed on the indexing stream: reused only by work queued after the kernels
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


def _libraries(name: str, names: list[str]) -> list[str]:
    """``name`` (``libnvrtc``) as this process mapped it, as torch ships it, then ``names``."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if f"/{name}.so" in path or (f"/{name}-" in path and ".so" in path):
                    found.append(path)
    except OSError:  # pragma: no cover - /proc is always there on Linux
        pass
    try:
        import torch

        root = Path(torch.__file__).parent
        found += sorted(str(p) for p in (root / "lib").glob(f"{name}*.so*"))
        found += sorted(str(p) for p in root.parent.glob(f"nvidia/*/lib/{name}.so*"))
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    found = [p for p in found if "builtins" not in os.path.basename(p)]
    return list(dict.fromkeys([*found, *names]))


def nvrtc_candidates() -> list[str]:
    """NVRTC libraries to try, best first: the one mapped, torch's, the usual names."""
    return _libraries("libnvrtc", ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"])


def driver_candidates() -> list[str]:
    """CUDA driver libraries to try, best first."""
    return _libraries("libcuda", ["libcuda.so.1", "libcuda.so"])


_kernels: dict[int, str | ConfigurationError] = {}


def load_gather_kernel(device: int) -> str:
    """Compile the gather kernel for ``device`` and load it (once): how it was built.

    NVRTC and the driver come from the first of :func:`nvrtc_candidates` and
    :func:`driver_candidates` that loads. A failure is remembered (the same
    error again, without a second try) and logged once, at INFO.

    Raises
    ------
    ConfigurationError
        ``kvtier.transfer._gather`` is not built, neither library loads (every
        ``dlopen`` error in the message), or the kernel does not compile or
        load (NVRTC's log in the message); the last error is the cause.
    """
    known = _kernels.get(device)
    if isinstance(known, str):
        return known
    if known is not None:
        raise known
    try:
        built = _build_kernel(device)
    except ConfigurationError as exc:
        _kernels[device] = exc
        log.info("gather kernel unavailable on cuda:%d, indexing kernels gather: %s", device, exc)
        raise
    _kernels[device] = built
    return built


def _build_kernel(device: int) -> str:
    compiled = gather_native
    if compiled is None:
        raise ConfigurationError("kvtier.transfer._gather is not built (no C compiler at install)")
    for what, candidates, load in (
        ("NVRTC", nvrtc_candidates(), compiled.load_nvrtc),
        ("CUDA driver", driver_candidates(), compiled.load_driver),
    ):
        errors: list[str] = []
        last: OSError | None = None
        for path in candidates:
            try:
                load(path)
            except OSError as exc:
                errors.append(str(exc))
                last = exc
                continue
            break
        else:
            raise ConfigurationError(f"no {what} could be loaded: " + "; ".join(errors)) from last
    try:
        return str(compiled.build(device))
    except RuntimeError as exc:
        raise ConfigurationError(f"the gather kernel could not be built: {exc}") from exc


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
    gather_kernel
        Gather through the compiled kernel (:func:`kernel_gather_copy`) where
        it builds, else through the indexing kernels (why is logged once). Off
        by default until it is measured on a GPU (docs/lab/gpu.md).

    Raises
    ------
    ConfigurationError
        ``mode`` is ``batch`` or ``loop`` and the compiled module or a CUDA
        runtime cannot be loaded.
    """

    name = "cuda"

    def __init__(
        self,
        device: Any,
        mode: Mode = "auto",
        staging_bytes: int = STAGING_BYTES,
        gather_kernel: bool = False,
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
        self.gather_kernel: str | None = None
        """How the gather kernel was built, where this copier gathers through it."""
        self.gather_kernel_error: str | None = None
        """Why it does not, where it was asked to."""
        if gather_kernel and self.mode in ("gather", "auto"):
            try:
                self.gather_kernel = load_gather_kernel(self._index)
            except ConfigurationError as exc:
                self.gather_kernel_error = str(exc)

    def describe(self) -> str:
        """The mode in use and the runtime it calls (for logs and benchmarks)."""
        status = _copier.native.cuda_status() if _copier.native is not None else {}
        batch = "" if self.mode == "torch" else f", runtime batches: {status.get('batch')}"
        if self.mode == "auto":
            batch += f", gathers pieces under {GATHER_BELOW >> 10} KiB"
        if self.gather_kernel is not None:
            batch += f", gather kernel: {self.gather_kernel}"
        elif self.gather_kernel_error is not None:
            batch += f", gather kernel unavailable: {self.gather_kernel_error.splitlines()[0]}"
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

                indexing = self._indexing[plan.store]
                lanes = _CudaLanes(torch, stream, indexing)
                buffers = self._buffers(plan, slices[0])
                if self.gather_kernel is not None:
                    launch_kernel, on = gather_native.launch, indexing.cuda_stream

                    def launch(address: int, count: int) -> None:
                        launch_kernel(address, count, on, index)

                    copies = kernel_gather_copy(plan, buffers, slices, rows, launch, lanes)
                else:
                    copies = gather_copy(plan, buffers, slices, rows, lanes)
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
