"""The CPU region's mapping and its rows: :class:`CPURegion`, its statistics, the
reaper of shared regions no process holds (the package's face re-exports them)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Literal

from kvtier import shm
from kvtier.errors import (
    AlignmentError,
    CapacityError,
    ClosedError,
    ConfigurationError,
    InvalidArgumentError,
    SharedRegionError,
    TierIOError,
    TransferError,
    UnsafeSharedFileError,
)
from kvtier.layout import KVLayout
from kvtier.region import _shm

if TYPE_CHECKING:
    import torch

__all__ = ["CPURegion", "RegionStatistics", "reap_shared_regions"]

PinMode = Literal["auto", "on", "off"]
Backing = Literal["anonymous", "shm", "hugetlbfs"]
Populated = Literal["populate_write", "touch"]

PIN_CHUNK_BYTES = 1 << 30
"""Target size of one ``cudaHostRegister`` call (rounded down to whole rows)."""


@dataclass(frozen=True, slots=True)
class RegionStatistics:
    """What a :class:`CPURegion` got from the system when it was created."""

    rows: int
    """Rows in the region."""
    row_stride: int
    """Bytes from one row to the next: a multiple of the alignment."""
    mapped_bytes: int
    """Bytes of the rows (``rows * row_stride``), never above the budget."""
    backing: Backing
    """``"anonymous"`` (one process), ``"shm"`` (a /dev/shm file) or ``"hugetlbfs"``."""
    page_size: int
    """Page size of the backing (the hugetlbfs page size, else the base page)."""
    transparent_huge_pages: bool
    """True when ``madvise(MADV_HUGEPAGE)`` was applied before the first touch and the
    kernel's THP setting for this backing (``enabled``, or ``shmem_enabled`` for
    /dev/shm) honours it; whether huge pages were granted shows in /proc smaps."""
    pinned: bool
    """True when the rows are registered with CUDA (page-locked)."""
    pin_reason: str
    """Why the rows are, or are not, pinned (e.g. ``"no CUDA"``)."""
    shared_name: str | None
    """The name the workers share the region under, or None."""
    populated: Populated
    """How pages were faulted in up front: ``MADV_POPULATE_WRITE`` or touching."""
    created: bool
    """True in the process that created the memory (always, unless it joined a shared one)."""


def _release(addr: int, length: int, pins: list[int], unpin: Callable[[int], None]) -> None:
    """Unpin and unmap; runs when the region and all its views are gone."""
    for chunk in reversed(pins):
        unpin(chunk)  # pragma: no cover - needs a GPU
    pins.clear()
    shm.munmap(addr, length)


def _no_unpin(_addr: int) -> None:  # pragma: no cover - only called with pins
    raise AssertionError("unreachable: nothing was pinned")


class CPURegion:
    """``rows`` page-aligned rows of ``row_stride`` bytes, optionally shared by workers.

    Create it with :meth:`create`; use it as a context manager or call
    :meth:`close`.

    Notes
    -----
    **Alignment.** ``alignment = max(page size, requested alignment)`` and must
    be a power of two; pass the file tier's direct-I/O alignment when it is
    larger than a page. The mapping starts on a multiple of ``alignment`` (and
    on a 2 MiB boundary when it is at least that large, so that transparent huge
    pages can back it), and ``row_stride = round_up(world_size * slice_bytes,
    alignment)``, so every row address and every row length meets the
    alignment. Padding is only at the end of a row.

    **Budget.** ``rows = cpu_bytes_to_use // row_stride`` and the rows take
    ``rows * row_stride <= cpu_bytes_to_use`` bytes of memory. A shared region
    adds a 4 KiB header to its file (one huge page on hugetlbfs, whose rows are
    also rounded up to whole huge pages).

    **Pinning.** With ``pin="auto"`` the rows are registered with
    ``cudaHostRegister`` when ``torch.cuda.is_available()``, in calls of about
    1 GiB of whole rows (so no row straddles two registrations); a failure
    unregisters what was registered and leaves the region pageable, saying why
    in :meth:`statistics`. ``pin="on"`` raises instead, and without CUDA raises
    :class:`~kvtier.errors.ConfigurationError`; ``pin="off"`` never pins.
    Registrations are undone when the memory is unmapped.

    **Lifetime.** :meth:`close` ends the region for its owner at once (further
    calls raise :class:`~kvtier.errors.ClosedError`; a shared region's file is
    removed if no other process holds it). Views handed out earlier
    (memoryviews, tensors) keep the memory mapped, and pinned, until the last
    of them is garbage collected: a view never points at unmapped memory.
    Creation blocks (it faults in every page); call it from a worker thread in
    async code. A region is not thread-safe against concurrent :meth:`close`.
    """

    rows: int
    """Rows in the region: ``cpu_bytes_to_use // row_stride``."""
    row_stride: int
    """Bytes from one row to the next: ``round_up(world_size * slice_bytes, alignment)``."""
    slice_bytes: int
    """Bytes of one worker's slice of a row: ``layout.bytes_per_chunk``."""
    alignment: int
    """Alignment of every row address and of ``row_stride``: a power of two >= the page size."""
    world_size: int
    """Worker processes sharing each row."""
    rank: int | None
    """This process's worker index: its slice starts at ``rank * slice_bytes``;
    None for the scheduler's whole-row mapping (every slice, no rank)."""

    _layout: KVLayout
    _closed: bool
    _attachment: _shm.Attachment | None
    _shared_name: str | None
    _addr: int
    _length: int
    _backing: Backing
    _page_size: int
    _thp: bool
    _populated: Populated
    _pinned: bool
    _created: bool
    _pin_reason: str
    _pins: list[int]
    _array: ctypes.Array[ctypes.c_uint8] | None
    _mv: memoryview | None
    _release: weakref.finalize[..., ctypes.Array[ctypes.c_uint8]]

    def __init__(self) -> None:
        raise TypeError("use CPURegion.create(...)")

    # -- creation -----------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        layout: KVLayout,
        cpu_bytes_to_use: int,
        *,
        world_size: int = 1,
        rank: int | None = 0,
        shared_name: str | None = None,
        instance: bytes | None = None,
        holder: bool = False,
        alignment: int | None = None,
        join_timeout: float = 30.0,
        pin: PinMode = "auto",
    ) -> CPURegion:
        """Map, populate and (where CUDA is) pin a region for ``layout``.

        Parameters
        ----------
        layout
            One worker's KV layout; its ``bytes_per_chunk`` is the slice size.
        cpu_bytes_to_use
            Byte budget for all rows of all workers; never exceeded.
        world_size, rank
            Worker processes sharing each row, and this process's index.
            ``rank=None`` maps every slice of each row (the scheduler of a
            split instance, the *holder*): it needs ``shared_name``, creates
            the file (or joins ranks that said ``holder=True``) and is one more
            party besides the ``world_size`` ranks.
        shared_name
            Name of the shared region (``[A-Za-z0-9._-]``, up to 200 characters);
            required when ``world_size > 1``. With a name, the region is a file
            ``/dev/shm/kvtier-<name>`` even for one process.
        instance
            16 bytes naming the serving instance; a process passing other bytes
            than the creator cannot join (default: zeros).
        holder
            Ranks only: the instance also has a holder (``rank=None``) that may
            attach after the ranks, as vLLM's scheduler does after its workers.
            The file keeps its name until the holder has joined; without this
            the last rank removes the name and a late holder would create a
            second, separate region. Every rank of the instance passes the same.
        alignment
            Required alignment of rows (a power of two); default the page size.
        join_timeout
            Seconds a joining process waits for the creator to finish.
        pin
            ``"auto"``, ``"on"`` or ``"off"``; see Notes of :class:`CPURegion`.

        Returns
        -------
        CPURegion
            A region whose every page is faulted in.

        Raises
        ------
        InvalidArgumentError
            A bad layout, budget, world_size, rank, name, timeout, pin mode or
            alignment (not a power of two).
        CapacityError
            The budget is below one row (the message says how many bytes one
            row needs), or memory / ``/dev/shm`` lacks the room.
        SharedRegionError
            A shared region could not be joined: its creator died part way,
            did not finish in ``join_timeout``, or made it for another geometry.
        ConfigurationError
            ``pin="on"`` without CUDA.
        TransferError
            ``pin="on"`` and ``cudaHostRegister`` failed (nothing stays registered).
        TierIOError
            The kernel refused the mapping for another reason.
        """
        align, instance = _checked_arguments(
            layout,
            cpu_bytes_to_use,
            world_size,
            rank,
            shared_name,
            instance,
            holder,
            alignment,
            join_timeout,
            pin,
        )
        slice_bytes = layout.bytes_per_chunk
        row_stride = shm.round_up(world_size * slice_bytes, align)
        rows = cpu_bytes_to_use // row_stride
        if rows == 0:
            raise CapacityError(
                f"cpu_bytes_to_use={cpu_bytes_to_use} is below one row: a row needs "
                f"{row_stride} bytes ({world_size} x {slice_bytes} bytes per worker slice, "
                f"rounded up to the {align}-byte alignment)"
            )

        if shared_name is None:  # a shared one is checked against /dev/shm's room
            _check_memory(rows * row_stride, rows, row_stride)

        self = object.__new__(cls)
        self.rows, self.row_stride, self.slice_bytes = rows, row_stride, slice_bytes
        self.alignment, self.world_size, self.rank = align, world_size, rank
        self._layout = layout
        self._closed = False
        self._attachment = None
        self._shared_name = shared_name
        length = rows * row_stride
        addr, map_length, page_size, backing = self._map(
            length, align, layout, instance, holder, float(join_timeout)
        )
        array, unpin = self._fault_in(addr, map_length, length, align, backing, pin)
        self._addr, self._length = addr, length
        self._backing = backing
        self._created = self._attachment is None or self._attachment.created
        self._page_size = page_size
        self._array = array
        self._mv = memoryview(array).cast("B")[:length]
        # Unmap when the last view is gone, not when close() is called: a view
        # must never point at unmapped memory. Not at exit: the OS unmaps then,
        # and other finalizers may still read through views.
        self._release = weakref.finalize(array, _release, addr, map_length, self._pins, unpin)
        self._release.atexit = False
        return self

    def _map(
        self,
        length: int,
        align: int,
        layout: KVLayout,
        instance: bytes,
        holder: bool,
        join_timeout: float,
    ) -> tuple[int, int, int, Backing]:
        """Map the rows: anonymous memory, or the shared file made or joined here.

        Returns the address, the mapped length, the page size and the backing.
        What failed is undone (the shared file detached) before it raises.
        """
        rows, row_stride, slice_bytes = self.rows, self.row_stride, self.slice_bytes
        world_size, rank, shared_name = self.world_size, self.rank, self._shared_name
        # Large regions start on a huge page boundary so THP can back them from
        # the first byte; the extra address space is reserved only to find it.
        map_align = max(align, shm.PMD_SIZE) if length >= shm.PMD_SIZE else align
        try:
            if shared_name is None:
                addr = shm.map_aligned(length, map_align)
                map_length, page_size = length, shm.PAGE_SIZE
                backing: Backing = "anonymous"
            else:
                geometry = _shm.Geometry(
                    rows, row_stride, slice_bytes, align, world_size, layout.namespace, instance
                )
                try:
                    att = _shm.attach(shared_name, geometry, rank, join_timeout, holder=holder)
                except UnsafeSharedFileError:
                    raise  # already names the file, its mode and its owner
                except OSError as exc:
                    raise SharedRegionError(
                        f"cannot create or join shared region {shared_name!r}: {exc}"
                    ) from exc
                self._attachment = att
                map_length, page_size = att.map_length, att.page_size
                backing = "shm" if att.backing == "shm" else "hugetlbfs"
                map_align = max(map_align, page_size)
                addr = shm.map_aligned(
                    map_length, map_align, fd=att.data_fd, offset=att.data_offset
                )
        except UnsafeSharedFileError:
            self._detach()
            raise
        except OSError as exc:
            self._detach()
            if exc.errno == errno.ENOMEM:
                raise CapacityError(
                    f"the system refused to map a {length}-byte CPU region ({rows} rows of "
                    f"{row_stride} bytes): not enough memory"
                ) from exc
            raise TierIOError(exc.errno or 0, f"mapping a {length}-byte CPU region") from exc
        except BaseException:
            self._detach()
            raise
        return addr, map_length, page_size, backing

    def _fault_in(
        self, addr: int, map_length: int, length: int, align: int, backing: Backing, pin: PinMode
    ) -> tuple[ctypes.Array[ctypes.c_uint8], Callable[[int], None]]:
        """Fault every page in (huge pages advised where they help) and pin the rows.

        Returns the mapping as a ctypes array and how to unpin it. What failed
        is undone (unmapped, detached) before it raises.
        """
        row_stride, shared_name = self.row_stride, self._shared_name
        self._pins = []
        try:
            if addr % align:  # pragma: no cover - map_aligned guarantees it
                raise AlignmentError(addr, length, align)
            shared = shared_name is not None
            self._thp = (
                backing != "hugetlbfs"
                and shm.thp_honours_madvise(shmem=shared)
                and shm.madvise(addr, map_length, shm.MADV_HUGEPAGE) == 0
            )
            how = shm.populate(addr, map_length, shared=shared)
            self._populated = "populate_write" if how == "populate_write" else "touch"
            self._pinned, self._pin_reason, unpin = _pin(
                addr, map_length, row_stride, pin, self._pins
            )
            array = (ctypes.c_uint8 * map_length).from_address(addr)
        except BaseException as exc:
            shm.munmap(addr, map_length)
            self._detach()
            if isinstance(exc, OSError):
                raise CapacityError(
                    f"could not fault in the {length}-byte CPU region: {exc}"
                ) from exc
            raise
        return array, unpin

    # -- access -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def _view(self) -> memoryview:
        if self._mv is None:
            raise ClosedError("the CPU region is closed")
        return self._mv

    def _check_row(self, i: int) -> int:
        # operator.index: numpy integers from vectorized row arithmetic are fine.
        try:
            index = operator.index(i)
        except TypeError:
            index = -1
        if isinstance(i, bool) or not 0 <= index < self.rows:
            raise InvalidArgumentError(f"row index must be an int in [0, {self.rows}), got {i!r}")
        return index

    def row(self, i: int) -> memoryview:
        """Row ``i``: a writable, zero-copy memoryview of ``row_stride`` bytes.

        Raises
        ------
        InvalidArgumentError
            ``i`` is not in ``[0, rows)``.
        ClosedError
            The region is closed.
        """
        mv = self._view()
        i = self._check_row(i)
        return mv[i * self.row_stride : (i + 1) * self.row_stride]

    def buffer(self) -> memoryview:
        """Every row as one writable memoryview of ``rows * row_stride`` bytes, zero-copy.

        What a file tier registers with its I/O engine
        (:meth:`~kvtier.tiers.file.FileTier.register_memory`).

        Raises
        ------
        ClosedError
            The region is closed.
        """
        return self._view()[: self.rows * self.row_stride]

    def row_address(self, i: int) -> int:
        """Address of row ``i``: a multiple of :attr:`alignment`.

        Valid while the region is open (or a view keeps it mapped).

        Raises
        ------
        InvalidArgumentError, ClosedError
            As :meth:`row`.
        """
        self._view()
        return self._addr + self._check_row(i) * self.row_stride

    def rows_view(self) -> torch.Tensor:
        """All rows as one ``(rows, row_stride)`` uint8 tensor, zero-copy.

        Raises
        ------
        ClosedError
            The region is closed.
        """
        return self._base().view(self.rows, self.row_stride)

    def tensor_views(self, rank: int | None = None) -> list[torch.Tensor]:
        """Per KV tensor of worker ``rank`` (default: this process), a zero-copy view.

        Returns
        -------
        list of torch.Tensor
            One uint8 tensor per ``layout.tensors`` entry, of shape
            ``(rows, bytes_per_block * blocks_per_chunk)`` and stride
            ``(row_stride, 1)``, starting at byte ``rank * slice_bytes +
            layout.tensor_offset(i)`` of row 0.

        Raises
        ------
        InvalidArgumentError
            ``rank`` is not in ``[0, world_size)``, or is None in the whole-row
            mapping (which has no rank of its own).
        ClosedError
            The region is closed.
        """
        try:
            own = -1 if self.rank is None else self.rank
            r = own if rank is None else operator.index(rank)
        except TypeError:
            r = -1
        if isinstance(rank, bool) or not 0 <= r < self.world_size:
            raise InvalidArgumentError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        base = self._base()
        bpc = self._layout.blocks_per_chunk
        return [
            base.as_strided(
                (self.rows, t.bytes_per_block * bpc),
                (self.row_stride, 1),
                r * self.slice_bytes + self._layout.tensor_offset(i),
            )
            for i, t in enumerate(self._layout.tensors)
        ]

    def _base(self) -> torch.Tensor:
        import torch

        return torch.frombuffer(self._view(), dtype=torch.uint8)

    def statistics(self) -> RegionStatistics:
        """What the region got: backing, page size, huge pages, pinning (also after close)."""
        return RegionStatistics(
            rows=self.rows,
            row_stride=self.row_stride,
            mapped_bytes=self._length,
            backing=self._backing,
            page_size=self._page_size,
            transparent_huge_pages=self._thp,
            pinned=self._pinned,
            pin_reason=self._pin_reason,
            shared_name=self._shared_name,
            populated=self._populated,
            created=self._created,
        )

    # -- closing ------------------------------------------------------------------------

    def close(self) -> None:
        """End the region for this owner; idempotent.

        Further calls to :meth:`row`, :meth:`row_address`, :meth:`rows_view` and
        :meth:`tensor_views` raise :class:`~kvtier.errors.ClosedError`. A shared
        region's file is removed if no other process holds it. The memory is
        unpinned and unmapped now if no view of it is alive, otherwise when the
        last view is garbage collected (never under a live view).
        """
        if self._closed:
            return
        self._closed = True
        self._mv = None
        self._array = None  # the finalizer runs now, or with the last view
        self._detach()

    def _detach(self) -> None:
        att, self._attachment = self._attachment, None
        if att is not None:
            try:
                _shm.detach(att)
            except OSError as exc:  # pragma: no cover - fcntl on an open fd
                raise SharedRegionError(f"leaving shared region {att.path}: {exc}") from exc

    @property
    def _released(self) -> bool:
        """True once the memory is unmapped (tests use it)."""
        return not self._release.alive

    def __enter__(self) -> CPURegion:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # An unclosed shared region still gives up its hold (and maybe the file).
        if getattr(self, "_attachment", None) is not None:
            with contextlib.suppress(Exception):
                self._detach()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<CPURegion {state} rows={self.rows} row_stride={self.row_stride} "
            f"world_size={self.world_size} rank={self.rank} backing={self._backing}>"
        )


def reap_shared_regions(older_than: float = 0.0, *, dry_run: bool = False) -> list[str]:
    """Remove this user's shared region files in ``/dev/shm`` that no live process holds.

    A shared region's file loses its name once every party attached, so a
    crash leaves nothing; an instance killed whole before that (or ranks
    attached with ``holder=True`` killed before their holder joined) leaves
    the file. Every :meth:`CPURegion.create` of a shared region reaps files
    stale for a minute; call this to reap them now (a serving integration
    at start-up, or by hand: ``kvtier gc --shm``).

    Parameters
    ----------
    older_than
        Only files not written for this many seconds; 0 reaps every stale one.
    dry_run
        Name the stale files; remove nothing.

    Returns
    -------
    list[str]
        The paths removed (or that would be, with ``dry_run``).

    Notes
    -----
    Safe beside running instances, this user's or others': a file is removed
    only if no process holds it (each attached process holds a lock on the
    file that the kernel drops when the process detaches or dies, SIGKILL
    included) and nobody is creating or joining it at that moment.
    """
    if isinstance(older_than, bool) or not isinstance(older_than, int | float) or older_than < 0:
        raise InvalidArgumentError(f"older_than must be seconds >= 0, got {older_than!r}")
    return _shm.reap(float(older_than), dry_run=dry_run)


def _checked_arguments(
    layout: object,
    cpu_bytes_to_use: object,
    world_size: int,
    rank: int | None,
    shared_name: str | None,
    instance: bytes | None,
    holder: object,
    alignment: int | None,
    join_timeout: object,
    pin: object,
) -> tuple[int, bytes]:
    """:meth:`CPURegion.create`'s arguments checked: the rows' alignment and the instance."""
    if not isinstance(layout, KVLayout):
        raise InvalidArgumentError(f"layout must be a KVLayout, got {type(layout).__name__}")
    _check_int("cpu_bytes_to_use", cpu_bytes_to_use, 1)
    _check_int("world_size", world_size, 1)
    if world_size > _shm.MAX_WORLD_SIZE:
        raise InvalidArgumentError(
            f"world_size must be at most {_shm.MAX_WORLD_SIZE}, got {world_size}"
        )
    if rank is None:
        if shared_name is None:
            raise InvalidArgumentError(
                "rank=None maps every worker's slice of a shared region: pass shared_name="
            )
    else:
        _check_int("rank", rank, 0)
        if rank >= world_size:
            raise InvalidArgumentError(f"rank {rank} is not below world_size {world_size}")
    if not isinstance(holder, bool):
        raise InvalidArgumentError(f"holder must be a bool, got {holder!r}")
    if holder and (rank is None or shared_name is None):
        raise InvalidArgumentError(
            "holder=True is for the ranks of a shared region (a rank and shared_name=) "
            "whose holder (rank=None) may attach after them"
        )
    if instance is None:
        instance = bytes(16)
    if not isinstance(instance, bytes) or len(instance) != 16:
        raise InvalidArgumentError(f"instance must be 16 bytes, got {instance!r}")
    if isinstance(join_timeout, bool) or not isinstance(join_timeout, int | float):
        raise InvalidArgumentError(f"join_timeout must be a number, got {join_timeout!r}")
    if not (math.isfinite(join_timeout) and join_timeout >= 0):
        raise InvalidArgumentError(f"join_timeout must be >= 0 and finite, got {join_timeout}")
    if pin not in ("auto", "on", "off"):
        raise InvalidArgumentError(f"pin must be 'auto', 'on' or 'off', got {pin!r}")
    if alignment is None:
        align = shm.PAGE_SIZE
    else:
        _check_int("alignment", alignment, 1)
        if alignment & (alignment - 1):
            raise InvalidArgumentError(f"alignment must be a power of two, got {alignment}")
        align = max(alignment, shm.PAGE_SIZE)
    if shared_name is None and world_size > 1:
        raise InvalidArgumentError(
            f"world_size={world_size} shares the region between processes: pass "
            "shared_name= (the same for every worker of this instance)"
        )
    if shared_name is not None:
        _shm.region_path(shared_name)  # validates before any work
    return align, instance


def _check_memory(length: int, rows: int, row_stride: int) -> None:
    """Refuse a private region larger than the memory available, before mapping it.

    Faulting in more than there is would not fail cleanly: the OOM killer would
    pick a process instead.
    """
    total, available = shm.memory_bytes()
    if length > available:
        raise CapacityError(
            f"a CPU region of {length} bytes ({rows} rows of {row_stride} bytes) exceeds "
            f"this machine's available memory ({available} bytes of {total}): lower "
            "cpu_bytes_to_use"
        )


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")


def _pin(
    addr: int, length: int, row_stride: int, mode: PinMode, pins: list[int]
) -> tuple[bool, str, Callable[[int], None]]:
    """Register ``[addr, addr + length)`` with CUDA per ``mode``; fill ``pins``."""
    if mode == "off":
        return False, "pin='off'", _no_unpin
    import torch

    if not torch.cuda.is_available():
        if mode == "on":
            raise ConfigurationError(
                "pin='on' but CUDA is not available (torch.cuda.is_available() is False)"
            )
        return False, "no CUDA (torch.cuda.is_available() is False)", _no_unpin
    return _cuda_pin(addr, length, row_stride, mode, pins)  # pragma: no cover - needs a GPU


def _cuda_pin(  # pragma: no cover - needs a GPU
    addr: int, length: int, row_stride: int, mode: PinMode, pins: list[int]
) -> tuple[bool, str, Callable[[int], None]]:
    import torch

    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]

    def unpin(chunk_addr: int) -> None:
        cudart.cudaHostUnregister(chunk_addr)

    chunk = max(PIN_CHUNK_BYTES // row_stride, 1) * row_stride
    for start in range(addr, addr + length, chunk):
        size = min(chunk, addr + length - start)
        err = cudart.cudaHostRegister(start, size, 0)
        if int(err) != 0:
            for done in reversed(pins):
                unpin(done)
            pins.clear()
            why = f"cudaHostRegister of {size} bytes at 0x{start:x} failed with error {err}"
            if mode == "on":
                raise TransferError(why)
            return False, f"{why}; left pageable", _no_unpin
        pins.append(start)
    return True, f"cudaHostRegister in {len(pins)} chunk(s) of up to {chunk} bytes", unpin
