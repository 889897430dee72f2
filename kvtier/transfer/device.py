"""Copies between the serving engine's KV tensors and CPU-region rows.

A row holds one offloaded block: ``blocks_per_chunk`` consecutive device blocks
of every KV tensor (see the Notes of :class:`~kvtier.layout.KVLayout` for the
byte layout). :meth:`DeviceTransfer.store` copies device blocks into rows,
:meth:`DeviceTransfer.load` copies rows back into device blocks. Both validate
their arguments at once, on the caller's thread, and return a
:class:`~kvtier.transfer.completion.Completion` that resolves when the bytes
have really moved.

Two backends share one design, a worker thread per direction that plans and
issues the copies, so the event loop never waits on a copy. A request is
planned once, with numpy, for either backend (:class:`~kvtier.transfer._copier.CopyPlan`):
every piece contiguous on both sides (a K or V half of sub-blocks consecutive
in one row and on the device), counted in units that the tensors of one KV
group and kind share, so there are as many piece lists as (group, kind)
pairs, not as tensors; sources in address order. The compiled module
``kvtier.transfer._copy`` runs a plan in one call (a Python loop where it is
not built):

``cpu``
    The "device" tensors are CPU tensors; ``memcpy`` without the GIL
    (non-temporal stores for requests of 4 MiB or more), a request of 4 MiB
    or more shared by bytes with a helper thread per direction.
``cuda``
    On a dedicated stream per direction: requests of small pieces gather
    whole rows through device staging buffers (one DMA per row), others go
    as they are in ``cudaMemcpyBatchAsync`` calls (:mod:`kvtier.transfer._cuda_copy`);
    a CUDA event marks the end, and a waiter thread per direction blocks in
    ``Event.synchronize`` and then resolves the completion. A store's stream
    first waits on an event recorded on the caller's current stream at submit
    time, so the model's writes to those blocks are finished before they are
    read; a load's stream waits on it too, so work queued before the load
    that still reads the blocks it overwrites goes first. A blocked waiter
    thread costs no CPU and no polling latency, keeps the loop free, and lets
    the worker issue the next request while the copy engine is still busy
    (docs/lab/gpu.md has the figures).

The backends are :mod:`kvtier.transfer._cpu_copy` and
:mod:`kvtier.transfer._cuda_copy`; the contract they implement (``_Copier``) is
in :mod:`kvtier.transfer._copier`, below them and this module, which picks one.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from kvtier.errors import ClosedError, InvalidArgumentError, LayoutError, TransferError
from kvtier.layout import KVLayout
from kvtier.transfer._copier import COLUMNS, CopyPlan, CopyTable, _Copier, native
from kvtier.transfer._cpu_copy import CpuCopier
from kvtier.transfer._cuda_copy import CudaCopier
from kvtier.transfer.completion import Completion

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlockIds",
    "DeviceTransfer",
    "RunsNow",
    "TransferStatistics",
    "check_block_ids",
    "check_rows",
    "open_device_transfer",
]

BlockIds = Sequence[int] | np.ndarray | Mapping[int, Sequence[int] | np.ndarray]
"""Device block ids: one sequence for every KV group, or one per group id."""


@dataclass(frozen=True, slots=True)
class TransferStatistics:
    """Counters of a :class:`DeviceTransfer` since it was opened."""

    backend: str
    """``"cpu"`` or ``"cuda"``."""
    stores: int
    """Store requests completed successfully."""
    loads: int
    """Load requests completed successfully."""
    bytes_stored: int
    """Bytes copied device -> CPU by successful stores."""
    bytes_loaded: int
    """Bytes copied CPU -> device by successful loads."""
    copies_issued: int
    """Tensor copies issued after coalescing (fewer is better)."""
    failures: int
    """Requests that failed."""
    in_flight: int
    """Requests submitted and not yet complete."""


class DeviceTransfer(abc.ABC):
    """Moves whole offloaded blocks between device KV tensors and CPU rows.

    Notes
    -----
    **Ownership.** Rows and device blocks named in a request belong to the
    copy until its completion is done: the caller must not reuse the rows of
    a store, nor read the device blocks of a load, before then. Cancelling a
    task that awaits a completion does not cancel the copy.

    **Ordering.** Requests of one direction run in submission order; stores
    and loads run concurrently with each other. On CUDA, every request is also
    ordered after the work queued on the caller's current stream when it was
    submitted (the model's writes to the blocks a store reads; reads of the
    blocks a load overwrites); nothing later on that stream waits for it:
    await the completion before the model reads loaded blocks.

    **Pinning.** CUDA copies are asynchronous DMAs of pieces (or whole rows)
    contiguous on both sides, which the driver runs asynchronously only from
    and to page-locked memory: give views of a pinned region
    (:class:`~kvtier.region.CPURegion` pins itself where CUDA is). Pageable
    rows still give the right bytes, but each copy then blocks the worker.
    """

    @property
    @abc.abstractmethod
    def backend(self) -> str:
        """``"cpu"`` or ``"cuda"``."""

    @abc.abstractmethod
    def store(
        self, device_block_ids: BlockIds, rows: Sequence[int] | np.ndarray
    ) -> Completion[None]:
        """Copy device blocks into rows.

        Parameters
        ----------
        device_block_ids
            ``len(rows) * blocks_per_chunk`` device block ids, in order: row
            ``rows[i]`` receives ids ``[i * bpc, (i + 1) * bpc)``. One sequence
            for every KV group, or a mapping from group id to its sequence.
        rows
            Distinct CPU-region row indices.

        Returns
        -------
        Completion[None]
            Resolves once every byte is in the rows; fails with
            :class:`~kvtier.errors.TransferError` if the copy failed (the
            rows then hold garbage).

        Raises
        ------
        InvalidArgumentError
            For counts that do not match, ids or rows out of range, duplicate
            rows. Nothing is queued.
        ClosedError
            After :meth:`aclose`.
        """

    @abc.abstractmethod
    def load(
        self, rows: Sequence[int] | np.ndarray, device_block_ids: BlockIds, skip: int = 0
    ) -> Completion[None]:
        """Copy rows into device blocks, starting ``skip`` sub-blocks into the first row.

        Parameters
        ----------
        rows
            CPU-region row indices.
        device_block_ids
            ``len(rows) * blocks_per_chunk - skip`` device block ids, in order
            (per group, as for :meth:`store`).
        skip
            Sub-blocks of the first row not copied, ``0 <= skip < bpc``.

        Returns
        -------
        Completion[None]
            Resolves once every byte is in the device blocks.

        Raises
        ------
        InvalidArgumentError
            For counts that do not match, ids or rows out of range, duplicate
            device ids, ``skip`` out of range. Nothing is queued.
        ClosedError
            After :meth:`aclose`.
        """

    @abc.abstractmethod
    def statistics(self) -> TransferStatistics:
        """Counters since the copier was opened."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Wait for every copy in flight, then stop; idempotent.

        Later :meth:`store` and :meth:`load` calls raise
        :class:`~kvtier.errors.ClosedError`.
        """


@runtime_checkable
class RunsNow(Protocol):
    """A :class:`DeviceTransfer` that can also copy on the calling thread.

    The copiers :func:`open_device_transfer` returns can; a worker process
    runs its jobs through it on the threads that receive them.
    """

    def run_now(
        self,
        store: bool,
        rows: Sequence[int] | np.ndarray,
        device_block_ids: BlockIds,
        skip: int = 0,
    ) -> None:
        """Validate and copy (a store if ``store``, else a load); return once done."""


def open_device_transfer(
    layout: KVLayout,
    kv_tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    host_views: Sequence[torch.Tensor],
    *,
    backend: Literal["auto", "cpu", "cuda"] = "auto",
) -> DeviceTransfer:
    """Open a copier between ``kv_tensors`` and CPU rows seen through ``host_views``.

    Parameters
    ----------
    layout
        The layout ``kv_tensors`` follow.
    kv_tensors
        The serving engine's KV tensors, in layout order (or by name).
    host_views
        One uint8 tensor per layout tensor, ``(rows, bytes_per_block *
        blocks_per_chunk)`` with inner stride 1 (any row stride):
        :meth:`kvtier.region.CPURegion.tensor_views`.
    backend
        ``"cuda"`` for tensors on a CUDA device, ``"cpu"`` for CPU tensors,
        ``"auto"`` to choose by the tensors' device.

    Raises
    ------
    LayoutError
        When the tensors do not match the layout (count, name, shape, dtype,
        contiguity, device), or the views do not match it.
    InvalidArgumentError
        For an unknown backend, or one that does not fit the tensors' device.
    """
    import torch

    tensors = _match_tensors(layout, kv_tensors)
    # One copier serves one device: its streams belong to that device.
    devices = {str(t.device) for t in tensors}
    if len(devices) != 1:
        raise LayoutError(f"KV tensors are on several devices: {sorted(devices)}")
    kind = tensors[0].device.type
    if backend == "auto":
        backend = "cuda" if kind == "cuda" else "cpu"
    if backend not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"backend must be 'auto', 'cpu' or 'cuda', got {backend!r}")
    if backend != kind:
        raise InvalidArgumentError(f"backend {backend!r} cannot copy tensors on {kind!r}")
    views = _match_views(layout, host_views, torch)
    if backend == "cuda":  # pragma: no cover - needs a GPU
        return _ThreadedTransfer(layout, tensors, views, CudaCopier(tensors[0].device))
    return _ThreadedTransfer(layout, tensors, views, CpuCopier())


# -- validation -------------------------------------------------------------------------


def _match_tensors(
    layout: KVLayout, kv: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
) -> list[torch.Tensor]:
    import torch

    specs = layout.tensors
    if isinstance(kv, Mapping):
        missing = [s.name for s in specs if s.name not in kv]
        extra = [n for n in kv if n not in {s.name for s in specs}]
        if missing or extra:
            raise LayoutError(f"KV tensors by name: missing {missing}, unexpected {extra}")
        items = [(s.name, kv[s.name]) for s in specs]
    else:
        if len(kv) != len(specs):
            raise LayoutError(f"the layout has {len(specs)} tensors, got {len(kv)}")
        items = [(s.name, t) for s, t in zip(specs, kv, strict=True)]
    out = []
    for spec, (name, t) in zip(specs, items, strict=True):
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if tuple(t.shape) != spec.shape:
            raise LayoutError(
                f"tensor {name!r} has shape {tuple(t.shape)}, the layout says {spec.shape}"
            )
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype != spec.dtype:
            raise LayoutError(f"tensor {name!r} has dtype {dtype}, layout says {spec.dtype}")
        if not t.is_contiguous():
            raise LayoutError(f"tensor {name!r} is not contiguous (strides {t.stride()})")
        if t.device.type == "meta":
            raise LayoutError(f"tensor {name!r} is on the meta device: it has no memory")
        out.append(t)
    return out


def _match_views(layout: KVLayout, views: Sequence[Any], torch: Any) -> list[torch.Tensor]:
    if len(views) != len(layout.tensors):
        raise LayoutError(f"expected {len(layout.tensors)} host views, got {len(views)}")
    rows = None
    for spec, v in zip(layout.tensors, views, strict=True):
        want = spec.bytes_per_block * layout.blocks_per_chunk
        if not isinstance(v, torch.Tensor) or v.dtype != torch.uint8 or v.dim() != 2:
            raise LayoutError(f"host view of {spec.name!r} must be a 2-D uint8 tensor")
        if v.shape[1] != want or v.stride(1) != 1:
            raise LayoutError(
                f"host view of {spec.name!r} must be (rows, {want}) with inner stride 1, got "
                f"shape {tuple(v.shape)} strides {v.stride()}"
            )
        if v.shape[0] > 1 and v.stride(0) < want:
            raise LayoutError(
                f"host view of {spec.name!r} has row stride {v.stride(0)} < {want}: rows overlap"
            )
        if v.device.type != "cpu":
            raise LayoutError(f"host view of {spec.name!r} is on {v.device}, not in CPU memory")
        if rows is not None and v.shape[0] != rows:
            raise LayoutError("host views must all have the same number of rows")
        rows = v.shape[0]
    return list(views)


def check_block_ids(
    layout: KVLayout, ids: BlockIds, count: int, *, unique: bool
) -> dict[int, np.ndarray]:
    """Validate device block ids for ``layout``: the one check every caller uses.

    Parameters
    ----------
    layout
        The layout the ids index into.
    ids
        One sequence for every KV group, or a mapping naming every group once.
    count
        How many ids each group must have.
    unique
        Whether an id may appear only once per group.

    Returns
    -------
    dict[int, numpy.ndarray]
        The ids of each group of the layout, as ``int64`` arrays.

    Raises
    ------
    InvalidArgumentError
        For ids that are not flat integer sequences, of another count, out of
        ``[0, num_blocks)``, repeated (with ``unique``), or a mapping that
        misses a group of the layout or names one it lacks.
    """
    groups = layout.groups
    if isinstance(ids, Mapping):
        unknown = [g for g in ids if g not in groups]
        missing = [g for g in groups if g not in ids]
        if unknown or missing:
            raise InvalidArgumentError(
                f"device block ids per group: unknown groups {unknown}, missing {missing} "
                f"(the layout has groups {list(groups)})"
            )
        raw = {g: ids[g] for g in groups}
    else:
        raw = dict.fromkeys(groups, ids)
    num_blocks = layout.num_blocks
    out = {}
    for g, seq in raw.items():
        arr = _as_index(seq, f"device block ids of group {g}")
        if arr.size != count:
            raise InvalidArgumentError(
                f"expected {count} device block ids for group {g}, got {arr.size}"
            )
        bad = _index_problem(arr, num_blocks, unique)
        if bad == 1:
            raise InvalidArgumentError(f"device block ids must be in [0, {num_blocks})")
        if bad == 2:
            raise InvalidArgumentError(f"duplicate device block ids in group {g}")
        out[g] = arr
    return out


def check_rows(rows: Sequence[int] | np.ndarray, count: int, *, unique: bool) -> np.ndarray:
    """Validate CPU-region rows: in ``[0, count)``, and named once each with ``unique``
    (a store); as an ``int64`` array.

    Raises
    ------
    InvalidArgumentError
        For rows that are not flat integers, out of range, or repeated.
    """
    r = _as_index(rows, "rows")
    bad = _index_problem(r, count, unique)
    if bad == 1:
        raise InvalidArgumentError(f"rows must be in [0, {count}), got {r.tolist()[:8]}")
    if bad == 2:
        raise InvalidArgumentError("a store names the same row twice")
    return r


def _index_problem(arr: np.ndarray, bound: int, unique: bool) -> int:
    """0 when every value of ``arr`` is in ``[0, bound)`` (and, with ``unique``,
    none repeats); 1 for one out of range, 2 for a repeat."""
    if native is not None:
        return int(native.check_index(arr, bound, unique))
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= bound):
        return 1
    return 2 if unique and np.unique(arr).size != arr.size else 0


def _as_index(values: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    """``values`` as the compiled checks and planners take them: a C-contiguous
    ``int64`` array; the array itself when it is one (no copy), else a copy.

    Any flat integer sequence or array is accepted: lists, tuples, ranges, numpy
    arrays of any integer dtype, CPU tensors, strided views (a column of a block
    table, ``ids[::2]``). Other dtypes (float, bool, strings) are an
    :class:`InvalidArgumentError` naming the dtype.
    """
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(f"{what} must be integers: {exc}") from exc
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise InvalidArgumentError(
            f"{what} must be a flat sequence of integers, got shape {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"{what} must be a flat sequence of integers, got dtype {arr.dtype}"
        )
    return np.ascontiguousarray(arr, dtype=np.int64)


# -- planning: pieces contiguous on both sides -----------------------------------------


def _unit_pieces(
    rows: np.ndarray,
    subs: np.ndarray,
    ids: np.ndarray,
    bpc: int,
    num_blocks: int,
    kv_first: bool,
    store: bool,
) -> np.ndarray:
    """The pieces of one request for tensors of one kind, in units (vectorized).

    Sub-blocks that follow each other in one host row and on the device are one
    piece (a host row's sub-blocks are contiguous; rows are not). A K/V-first
    tensor's sub-block is two halves, a unit each: K at host unit ``sub`` and
    device unit ``id``, V ``bpc`` units further in the row and ``num_blocks``
    units further on the device; its pieces alternate K and V, run by run.
    Columns: host row, host unit in the row, device unit, units.
    """
    n = ids.size
    breaks = (np.diff(ids) != 1) | (np.diff(rows) != 0) | (np.diff(subs) != 1)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    counts = np.diff(np.append(starts, n))
    first = np.stack([rows[starts], subs[starts], ids[starts], counts], axis=1)
    # Reads in address order: a copy waits on its reads, not on its writes (they
    # are buffered), and reads in ascending addresses keep the prefetchers and
    # the TLB ahead. On CPU, scattered ids read at random cost up to 0.6x a
    # contiguous copy of 8 KiB pieces on 4 KiB pages; the writes land anywhere.
    key = first[:, 2] if store else first[:, 0] * (2 * bpc) + first[:, 1]
    first = first[np.argsort(key, kind="stable")]
    if not kv_first:
        return first
    out = np.empty((2 * starts.size, 4), dtype=np.int64)
    out[0::2] = first
    out[1::2] = first + np.array([0, bpc, num_blocks, 0], dtype=np.int64)
    return out


def _copy_table(
    layout: KVLayout, tensors: list[torch.Tensor], views: list[torch.Tensor], numpy_views: bool
) -> CopyTable:
    """Each tensor's addresses and flat byte views, for every plan of a transfer."""
    import torch

    table = np.zeros((len(tensors), len(COLUMNS)), dtype=np.int64)
    dev: list[Any] = []
    host: list[Any] = []
    for i, (spec, t, v) in enumerate(zip(layout.tensors, tensors, views, strict=True)):
        rows, row_bytes = int(v.shape[0]), int(v.shape[1])
        stride = int(v.stride(0))
        raw = t.detach().reshape(-1).view(torch.uint8)
        # Row 0 of the slice to the end of the last row's: offsets index it directly.
        flat = torch.as_strided(v, ((rows - 1) * stride + row_bytes if rows else 0,), (1,))
        unit = spec.bytes_per_half
        table[i] = (raw.data_ptr(), v.data_ptr(), unit, stride, raw.numel(), row_bytes, rows)
        # Zero-copy numpy views of the same memory keep the tensors alive too.
        dev.append(raw.numpy() if numpy_views else raw)
        host.append(flat.numpy() if numpy_views else flat)
    return CopyTable(table, dev, host)


# -- the shared engine: a worker thread per direction -----------------------------------


@dataclass(slots=True)
class _Request:
    store: bool
    rows: np.ndarray
    """Host row of every offloaded block copied (``blocks_per_chunk`` sub-blocks each)."""
    skip: int
    """Sub-blocks of the first row not copied (loads)."""
    ids: list[np.ndarray]
    """Device block id of every sub-block copied, per layout tensor (by its group)."""
    done: Completion[None] | None
    """None for :meth:`_ThreadedTransfer.run_now` (the caller waits)."""
    nbytes: int
    marker: object


def _failure(req: _Request, exc: BaseException) -> TransferError:
    err = TransferError(f"{'store' if req.store else 'load'} of {req.nbytes} bytes failed: {exc}")
    err.__cause__ = exc
    return err


class _ThreadedTransfer(DeviceTransfer):
    def __init__(
        self,
        layout: KVLayout,
        tensors: list[torch.Tensor],
        views: list[torch.Tensor],
        copier: _Copier,
    ) -> None:
        self._layout = layout
        self._bpc = layout.blocks_per_chunk
        self._copier = copier
        self._rows = int(views[0].shape[0])
        self._groups = layout.groups
        self._tensor_groups = [s.group for s in layout.tensors]
        self._num_blocks = layout.num_blocks
        self._table = _copy_table(layout, tensors, views, copier.numpy_views)
        # Tensors of one group and kind share their pieces: one list per pair.
        keys: dict[tuple[int, bool], int] = {}
        self._plan_keys: list[tuple[int, bool]] = []
        key_of = []
        for i, spec in enumerate(layout.tensors):
            k = keys.setdefault((spec.group, spec.kv_first), len(keys))
            if k == len(self._plan_keys):
                self._plan_keys.append((i, spec.kv_first))
            key_of.append(k)
        self._key_of = np.array(key_of, dtype=np.int64)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[bool, queue.SimpleQueue[_Request | None]] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._in_flight = 0
        self._idle: asyncio.Future[None] | None = None
        self._n = {"stores": 0, "loads": 0, "bs": 0, "bl": 0, "copies": 0, "fail": 0}
        self._count_lock = threading.Lock()
        """Counters change on the loop and on :meth:`run_now`'s threads."""

    @property
    def backend(self) -> str:
        return self._copier.name

    # -- submission (event loop thread) -------------------------------------------------

    def store(
        self, device_block_ids: BlockIds, rows: Sequence[int] | np.ndarray
    ) -> Completion[None]:
        self._check_open()
        return self._submit(*self._plan(True, rows, device_block_ids, 0))

    def load(
        self, rows: Sequence[int] | np.ndarray, device_block_ids: BlockIds, skip: int = 0
    ) -> Completion[None]:
        self._check_open()
        return self._submit(*self._plan(False, rows, device_block_ids, skip))

    def run_now(
        self,
        store: bool,
        rows: Sequence[int] | np.ndarray,
        device_block_ids: BlockIds,
        skip: int = 0,
    ) -> None:
        """Validate and copy on the calling thread; return once the bytes moved.

        A worker process's job threads run each job this way: the copy starts
        on the thread that received the job and its answer leaves from there,
        with no hop through an event loop and a copy thread (see
        docs/architecture.md). Arguments as for :meth:`store` and :meth:`load`.
        On CUDA, at most one thread per direction: copies of one direction
        share a stream. On the CPU backend a second caller is safe beside the
        copier's own threads (the Engine copies requests of at most
        :data:`kvtier.engine.INLINE_COPY_BYTES` on its loop's thread): only
        requests of 4 MiB or more use a direction's helper pool, a thread
        pool that queues the shares of concurrent requests.

        Raises
        ------
        InvalidArgumentError
            As :meth:`store` and :meth:`load`; nothing was copied.
        ClosedError
            After :meth:`aclose`.
        TransferError
            The copy failed (the destination holds garbage).
        """
        self._check_open()
        store, r, skip, ids = self._plan(store, rows, device_block_ids, skip)
        per_tensor = [ids[g] for g in self._tensor_groups]
        nbytes = int(ids[self._groups[0]].size) * self._layout.bytes_per_block
        if not nbytes:
            return
        req = _Request(store, r, skip, per_tensor, None, nbytes, self._copier.mark())
        try:
            copies, wait = self._copier.run(self._plan_copies(req), req.marker)
            if wait is not None:
                wait()
        except Exception as exc:
            with self._count_lock:
                self._n["fail"] += 1
            raise _failure(req, exc) from exc
        with self._count_lock:
            self._count(req, copies)

    def _plan(
        self, store: bool, rows: Sequence[int] | np.ndarray, device_block_ids: BlockIds, skip: int
    ) -> tuple[bool, np.ndarray, int, dict[int, np.ndarray]]:
        """Validate a request: its rows, the sub-blocks skipped, the ids per group."""
        r = self._check_rows(rows, unique=store)
        if store:
            ids = self._check_ids(device_block_ids, r.size * self._bpc, unique=False)
            return True, r, 0, ids
        if isinstance(skip, bool) or not isinstance(skip, int | np.integer):
            raise InvalidArgumentError(f"skip must be an int, got {skip!r}")
        skip = int(skip)
        if not 0 <= skip < self._bpc or (skip and r.size == 0):
            raise InvalidArgumentError(f"skip must be in [0, {self._bpc}) with rows, got {skip}")
        ids = self._check_ids(device_block_ids, r.size * self._bpc - skip, unique=True)
        return False, r, skip, ids

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the device transfer is closed")

    def _check_rows(self, rows: Sequence[int] | np.ndarray, *, unique: bool) -> np.ndarray:
        return check_rows(rows, self._rows, unique=unique)

    def _check_ids(self, ids: BlockIds, count: int, *, unique: bool) -> dict[int, np.ndarray]:
        return check_block_ids(self._layout, ids, count, unique=unique)

    def _submit(
        self, store: bool, rows: np.ndarray, skip: int, ids: dict[int, np.ndarray]
    ) -> Completion[None]:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._start(loop)
        done: Completion[None] = Completion(loop)
        # Planning the copies costs a little per run: it happens on the worker,
        # so the event loop's share of a request is O(1) Python calls.
        per_tensor = [ids[g] for g in self._tensor_groups]
        nbytes = int(ids[self._groups[0]].size) * self._layout.bytes_per_block
        if not ids[self._groups[0]].size:
            done.set_result(None)
            return done
        self._in_flight += 1
        req = _Request(store, rows, skip, per_tensor, done, nbytes, self._copier.mark())
        self._queues[store].put(req)
        return done

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for store in (True, False):
            q: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
            self._queues[store] = q
            self._spawn(self._worker, (q, store), "store" if store else "load")

    def _spawn(self, target: Callable[..., None], args: tuple[Any, ...], what: str) -> None:
        th = threading.Thread(
            target=target, args=args, name=f"kvtier-{self._copier.name}-{what}", daemon=True
        )
        th.start()
        self._threads.append(th)

    # -- the workers --------------------------------------------------------------------

    def _worker(self, q: queue.SimpleQueue[_Request | None], store: bool) -> None:
        waiting: queue.SimpleQueue[tuple[_Request, Callable[[], None], int] | None] | None = None
        while (req := q.get()) is not None:
            try:
                copies, wait = self._copier.run(self._plan_copies(req), req.marker)
            except Exception as exc:  # handed to the awaiting side, typed
                self._finish_threadsafe(req, _failure(req, exc), 0)
                continue
            if wait is None:
                self._finish_threadsafe(req, None, copies)
                continue
            if waiting is None:  # the first asynchronous copy of this direction
                waiting = queue.SimpleQueue()
                self._spawn(self._waiter, (waiting,), f"{'store' if store else 'load'}-waiter")
            waiting.put((req, wait, copies))
        if waiting is not None:
            waiting.put(None)

    def _waiter(
        self, q: queue.SimpleQueue[tuple[_Request, Callable[[], None], int] | None]
    ) -> None:
        # Copies of one direction share a stream, so they finish in the order
        # they were issued: waiting on them first in, first out loses nothing.
        while (item := q.get()) is not None:
            req, wait, copies = item
            try:
                wait()
            except Exception as exc:
                self._finish_threadsafe(req, _failure(req, exc), 0)
            else:
                self._finish_threadsafe(req, None, copies)

    def _plan_copies(self, req: _Request) -> CopyPlan:
        """Every piece of ``req``, contiguous on both sides, for every tensor.

        Planned once per request with numpy, for either backend: the pieces of
        tensors of one kind and group are the same in units, so there are as
        many piece lists as (group, kind) pairs, not as tensors.
        """
        bounds = np.empty((len(self._plan_keys), 2), dtype=np.int64)
        if native is not None:
            # One buffer for every (group, kind) pair, planned in place by the
            # compiled loop: a handful of numpy calls per request, not dozens.
            n = int(req.ids[self._plan_keys[0][0]].size)
            buf = np.empty(8 * n * len(self._plan_keys), dtype=np.int64)
            at = 0
            for k, (tensor, kv_first) in enumerate(self._plan_keys):
                got = native.plan_units(
                    req.rows,
                    req.ids[tensor],
                    self._bpc,
                    req.skip,
                    self._num_blocks,
                    kv_first,
                    req.store,
                    buf[4 * at :],
                )
                bounds[k] = (at, at + got)
                at += got
            pieces = buf[: 4 * at].reshape(-1, 4)
        else:
            per_row = np.repeat(req.rows, self._bpc)[req.skip :]
            subs = np.tile(np.arange(self._bpc, dtype=np.int64), req.rows.size)[req.skip :]
            lists = []
            start = 0
            for k, (tensor, kv_first) in enumerate(self._plan_keys):
                p = _unit_pieces(
                    per_row, subs, req.ids[tensor], self._bpc, self._num_blocks, kv_first, req.store
                )
                lists.append(p)
                bounds[k] = (start, start + len(p))
                start += len(p)
            pieces = lists[0] if len(lists) == 1 else np.concatenate(lists)
        spans = bounds[self._key_of]
        copies = int((spans[:, 1] - spans[:, 0]).sum())
        return CopyPlan(req.store, self._table, pieces, spans, copies, req.nbytes)

    def _finish_threadsafe(self, req: _Request, err: BaseException | None, copies: int) -> None:
        loop = self._loop
        if loop is None:  # pragma: no cover - a request implies a started loop
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            loop.call_soon_threadsafe(self._finish, req, err, copies)

    def _finish(self, req: _Request, err: BaseException | None, copies: int) -> None:
        self._in_flight -= 1
        assert req.done is not None
        with self._count_lock:
            if err is None:
                self._count(req, copies)
            else:
                self._n["copies"] += copies
                self._n["fail"] += 1
        if err is None:
            req.done.set_result(None)
        else:
            req.done.set_exception(err)
        if self._in_flight == 0 and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _count(self, req: _Request, copies: int) -> None:
        self._n["copies"] += copies
        if req.store:
            self._n["stores"] += 1
            self._n["bs"] += req.nbytes
        else:
            self._n["loads"] += 1
            self._n["bl"] += req.nbytes

    # -- statistics and closing ---------------------------------------------------------

    def statistics(self) -> TransferStatistics:
        n = self._n
        return TransferStatistics(
            backend=self._copier.name,
            stores=n["stores"],
            loads=n["loads"],
            bytes_stored=n["bs"],
            bytes_loaded=n["bl"],
            copies_issued=n["copies"],
            failures=n["fail"],
            in_flight=self._in_flight,
        )

    async def aclose(self) -> None:
        self._closed = True
        if self._in_flight:
            if self._idle is None:
                self._idle = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._idle)
        for q in self._queues.values():
            q.put(None)
        threads, self._threads = self._threads, []
        for th in threads:
            await asyncio.to_thread(th.join)
        await asyncio.to_thread(self._copier.close)
