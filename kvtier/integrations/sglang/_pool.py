"""Where a page of SGLang's host pool is, and how kvtier reaches it (no SGLang import).

A host pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) says where one
page's bytes are with ``get_page_buffer_meta(indices)``: one to 2·layers
segments per page, per layout. kvtier reads into and writes from a page in one
of two ways, decided once per pool (:func:`describe_pool`):

* **direct**: one segment per page, its length a multiple of 4096, every page
  at ``base + i * page_bytes`` of a 4096-aligned buffer (MLA ``page_first`` and
  ``page_first_direct``): the pool's buffer is the rows (slot = page index),
  O_DIRECT straight into SGLang's memory, no copy.
* **staged**: anything else (MHA's separate K and V halves, ``layer_first``, a
  segment not a multiple of 4096): a page is gathered into a slot of kvtier's
  own arena (:class:`Staging`) before a store, and scattered out of it after a
  verified load (one ``memcpy`` of the page each way).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.region import ForeignRows

__all__ = [
    "LAYOUTS",
    "PageGeometry",
    "Staging",
    "check_indices",
    "describe_pool",
    "direct_slot",
    "page_segments",
    "pool_view",
    "round_up",
]

ALIGNMENT = 4096
"""What O_DIRECT needs of an address and a length."""

LAYOUTS = frozenset({"layer_first", "page_first", "page_first_direct"})
"""The host layouts whose pages kvtier knows how to name (see the namespace)."""

Segments = list[tuple[int, int]]
"""One page: ``(address, bytes)`` of each segment, in SGLang's order."""


def round_up(n: int, to: int = ALIGNMENT) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """One host pool's pages, as kvtier sees them (decided at registration)."""

    layout: str
    """The pool's layout (``layer_first``, ``page_first``, ``page_first_direct``)."""
    step: int
    """Host indices per page in SGLang's calls (the pool's logical page size)."""
    capacity: int
    """Host indices of the pool (its logical size): every index is below it."""
    segment_sizes: tuple[int, ...]
    """Bytes of each segment of one page, in SGLang's order."""
    base: int
    """Address of the pool's buffer."""
    nbytes: int
    """Bytes of the pool's buffer: every segment lies in ``[base, base + nbytes)``."""
    direct: bool
    """Pages are read into and written from the pool's buffer in place."""

    @property
    def page_bytes(self) -> int:
        """Payload bytes of one page."""
        return sum(self.segment_sizes)

    @property
    def stride(self) -> int:
        """Bytes of one kvtier block: the page, padded to 4096 when staged."""
        return self.page_bytes if self.direct else round_up(self.page_bytes)

    @property
    def rows(self) -> int:
        """Pages of the pool's buffer (direct slots)."""
        return self.nbytes // self.page_bytes


def describe_pool(pool: Any) -> PageGeometry | str:
    """The geometry of ``pool``'s pages, or why kvtier cannot take them (a sentence)."""
    layout = getattr(pool, "layout", None)
    if layout not in LAYOUTS:
        return f"host layout {layout!r} is not one of {sorted(LAYOUTS)}"
    buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor):
        return "the host pool has no kv_buffer tensor"
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        return "the host pool's kv_buffer is not a contiguous CPU tensor"
    step = int(getattr(pool, "logical_page_size", pool.page_size))
    capacity = int(getattr(pool, "logical_size", pool.size))
    if step < 1 or capacity < step:
        return f"the host pool has {capacity} slots of pages of {step}"
    base, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    first = pool.get_page_buffer_meta(torch.arange(step, dtype=torch.int64))
    if not first or not first[0]:
        return "the host pool gives no buffer addresses (get_page_buffer_meta)"
    ptrs, sizes = [int(p) for p in first[0]], tuple(int(s) for s in first[1])
    if len(ptrs) != len(sizes) or any(s <= 0 for s in sizes):
        return "the host pool's page segments are malformed"
    direct = (
        len(ptrs) == 1
        and sizes[0] % ALIGNMENT == 0
        and base % ALIGNMENT == 0
        and ptrs[0] == base
        and nbytes >= sizes[0]
    )
    if direct and capacity >= 2 * step:
        second = pool.get_page_buffer_meta(torch.arange(step, 2 * step, dtype=torch.int64))
        direct = bool(second) and [int(p) for p in second[0]] == [base + sizes[0]]
    geometry = PageGeometry(layout, step, capacity, sizes, base, nbytes, direct)
    if any(not base <= p or p + s > base + nbytes for p, s in zip(ptrs, sizes, strict=True)):
        return "the host pool's page segments lie outside its kv_buffer"
    return geometry


def pool_view(pool: Any) -> memoryview:
    """A writable byte view of the whole of ``pool``'s buffer (it keeps the tensor alive)."""
    flat = pool.kv_buffer.view(torch.uint8).reshape(-1)
    return memoryview(flat.numpy())


def check_indices(host_indices: Any, pages: int, geometry: PageGeometry) -> bool:
    """Whether ``host_indices`` names ``pages`` whole pages of the pool, as SGLang's
    ``_v1`` calls do: a 1-D CPU integer tensor of ``pages * step`` indices, each page
    ``start, start + 1, ...`` from a page boundary, all inside the pool."""
    if not isinstance(host_indices, torch.Tensor):
        return False
    if host_indices.dtype not in (torch.int64, torch.int32) or host_indices.device.type != "cpu":
        return False
    step = geometry.step
    if host_indices.dim() != 1 or host_indices.numel() != pages * step or pages == 0:
        return pages == 0 and host_indices.numel() == 0
    idx = host_indices.to(torch.int64).view(pages, step)
    starts = idx[:, :1]
    if bool((starts < 0).any()) or bool((starts + step > geometry.capacity).any()):
        return False
    if bool((starts % step != 0).any()):
        return False
    return bool((idx - starts == torch.arange(step, dtype=torch.int64)).all())


def page_segments(
    pool: Any, host_indices: torch.Tensor, pages: int, geometry: PageGeometry
) -> list[Segments] | None:
    """Each page's segments (checked against the pool's buffer), or None when the
    pool answers other than at registration."""
    meta = pool.get_page_buffer_meta(host_indices)
    if not meta:
        return None
    ptrs, sizes = list(meta[0]), list(meta[1])
    per = len(geometry.segment_sizes)
    if len(ptrs) != pages * per or len(sizes) != len(ptrs):
        return None
    low, high = geometry.base, geometry.base + geometry.nbytes
    out: list[Segments] = []
    for i in range(pages):
        chunk = slice(i * per, (i + 1) * per)
        page = [(int(p), int(s)) for p, s in zip(ptrs[chunk], sizes[chunk], strict=True)]
        for (p, s), want in zip(page, geometry.segment_sizes, strict=True):
            if s != want or p < low or p + s > high:
                return None
        out.append(page)
    return out


def direct_slot(page: Segments, geometry: PageGeometry) -> int | None:
    """The slot of a page of a direct pool (its index in the buffer), or None."""
    if len(page) != 1:
        return None
    offset = page[0][0] - geometry.base
    slot, rest = divmod(offset, geometry.page_bytes)
    return slot if not rest and 0 <= slot < geometry.rows else None


class Staging:
    """kvtier's own page-aligned slots for pages it cannot reach in place.

    An anonymous mapping of ``slots * stride`` bytes; callers take slots all at
    once (:meth:`take`, blocking while others hold them) and give them back
    (:meth:`give`). Thread-safe.
    """

    def __init__(self, slots: int, stride: int) -> None:
        self._arena: mmap.mmap | None = mmap.mmap(-1, slots * stride)
        self._view: memoryview | None = memoryview(self._arena)
        self.rows = ForeignRows(self._view, stride)
        self.stride = stride
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))  # LIFO: the same few pages stay warm
        self._cond = threading.Condition()
        self._closing = False

    def take(self, n: int, timeout: float) -> list[int] | None:
        """``n`` free slots (``n`` at most :attr:`slots`), or None past ``timeout`` (or
        once :meth:`close` began)."""
        with self._cond:
            ready = self._cond.wait_for(lambda: self._closing or len(self._free) >= n, timeout)
            if not ready or self._closing:
                return None
            return [self._free.pop() for _ in range(n)]

    def give(self, slots: Sequence[int]) -> None:
        """Give ``slots`` back."""
        if not slots:
            return
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def gather(self, slot: int, page: Segments) -> None:
        """Copy a page's segments, back to back, into ``slot``."""
        dst = self.rows.address + slot * self.stride
        for ptr, size in page:
            ctypes.memmove(dst, ptr, size)
            dst += size

    def scatter(self, slot: int, page: Segments) -> None:
        """Copy ``slot``'s bytes out into a page's segments."""
        src = self.rows.address + slot * self.stride
        for ptr, size in page:
            ctypes.memmove(ptr, src, size)
            src += size

    def close(self, released: bool, timeout: float = 30.0) -> bool:
        """Unmap the arena once every slot is back (no copy in flight: ``timeout`` at
        most), if the lower front ``released`` its rows (it keeps them while I/O is
        in flight: :meth:`LowerFront.close <kvtier.below.LowerFront.close>` says);
        whether it was unmapped. Left mapped otherwise."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            idle = self._cond.wait_for(lambda: len(self._free) == self.slots, timeout)
        if not idle or not released:
            return False
        view, self._view = self._view, None
        if view is not None:
            view.release()
        arena, self._arena = self._arena, None
        if arena is not None:
            try:
                arena.close()
            except BufferError:  # a view of it lives on: unmapped when that goes
                return False
        return True
