"""Private: memory mappings through libc (through :mod:`kvtier.shm`): the region, the host tier.

Python's :class:`mmap.mmap` cannot choose an address, trim a mapping or map a
file at a fixed place, and the CPU region needs all three: its start must be a
multiple of an alignment that may exceed the page size (2 MiB so that
transparent huge pages can back it), and a shared file must map at such an
address too. So the mapping is made here with ``mmap(2)`` through ctypes and
wrapped, zero-copy, in a ctypes array that exports the buffer protocol.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np

__all__ = [
    "MADV_HUGEPAGE",
    "MADV_POPULATE_READ",
    "MADV_POPULATE_WRITE",
    "PAGE_SIZE",
    "PMD_SIZE",
    "madvise",
    "map_aligned",
    "memory_bytes",
    "munmap",
    "populate",
    "round_up",
    "thp_honours_madvise",
]

PAGE_SIZE = mmap.PAGESIZE
"""Base page size of this machine."""

MADV_HUGEPAGE = 14
"""``madvise`` advice: back this range with transparent huge pages where possible."""

MADV_POPULATE_READ = 22
"""``madvise`` advice (Linux 5.14+): fault every page in for reading, reading nothing."""
MADV_POPULATE_WRITE = 23
"""``madvise`` advice (Linux 5.14+): fault every page in writable, writing nothing."""


def _pmd_size() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


PMD_SIZE = _pmd_size()
"""Size of a transparent huge page (2 MiB on x86-64)."""


def thp_honours_madvise(shmem: bool) -> bool:
    """Whether the kernel's THP setting lets ``MADV_HUGEPAGE`` take effect.

    Anonymous memory follows ``/sys/kernel/mm/transparent_hugepage/enabled``,
    shmem (``/dev/shm``) follows ``shmem_enabled``; ``never`` (and ``deny``)
    turn the advice into a no-op.
    """
    knob = "shmem_enabled" if shmem else "enabled"
    try:
        with open(f"/sys/kernel/mm/transparent_hugepage/{knob}") as f:
            text = f.read()
    except OSError:
        return False
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else ""
    return chosen not in ("", "never", "deny")


_PROT_NONE = 0
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def memory_bytes() -> tuple[int, int]:
    """``(MemTotal, MemAvailable)`` of this machine in bytes, from ``/proc/meminfo``.

    Where it cannot be read, both are the physical memory from ``sysconf``
    (available unknown: assume all of it).
    """
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if name in ("MemTotal", "MemAvailable") and parts and parts[0].isdigit():
                    fields[name] = int(parts[0]) * 1024
    except OSError:
        pass
    total = fields.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * PAGE_SIZE
    return total, fields.get("MemAvailable", total)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


_MAX_LENGTH = 1 << 62
"""Longest mapping asked of the kernel: ctypes passes ``size_t`` modulo 2**64, so
a larger length would silently map its remainder instead of failing."""


def _raw_mmap(addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    if not 0 < length <= _MAX_LENGTH:
        raise OSError(errno.ENOMEM, f"mmap of {length} bytes: not a length any machine maps")
    result = _mmap(addr, length, prot, flags, fd, offset)
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes failed: {os.strerror(err)}")
    return int(result)


def munmap(addr: int, length: int) -> None:
    """Unmap ``[addr, addr + length)``; a zero length does nothing."""
    if length and _munmap(addr, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap of {length} bytes at 0x{addr:x} failed: {os.strerror(err)}")


def madvise(addr: int, length: int, advice: int) -> int:
    """``madvise(2)``; returns 0 or the errno, so callers decide what a refusal means."""
    if _madvise(addr, length, advice) == 0:
        return 0
    return ctypes.get_errno() or errno.EINVAL


def map_aligned(length: int, alignment: int, *, fd: int = -1, offset: int = 0) -> int:
    """Map ``length`` read-write bytes at an address that is a multiple of ``alignment``.

    Parameters
    ----------
    length
        Bytes to map (a positive multiple of the page size).
    alignment
        Power of two, at least the page size.
    fd, offset
        ``-1`` for private anonymous memory; otherwise the file mapped shared
        from ``offset`` (a multiple of the page size).

    Returns
    -------
    int
        The start address. Exactly ``length`` bytes are mapped: the address space
        over-reserved to find an aligned start is given back at once.

    Raises
    ------
    OSError
        ``mmap`` or ``munmap`` failed.
    """
    anonymous = fd < 0
    if alignment <= PAGE_SIZE and anonymous:
        return _raw_mmap(None, length, _PROT_RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    slack = max(alignment - PAGE_SIZE, 0)
    # Reserve address space only (no memory, no commit charge), pick the aligned
    # start inside it, map the real thing there, then hand the rest back.
    base = _raw_mmap(
        None,
        length + slack,
        _PROT_NONE,
        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
        -1,
        0,
    )
    start = round_up(base, alignment)
    try:
        if anonymous:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
            _raw_mmap(start, length, _PROT_RW, flags, -1, 0)
        else:
            _raw_mmap(start, length, _PROT_RW, mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
    except BaseException:
        munmap(base, length + slack)
        raise
    munmap(base, start - base)
    munmap(start + length, base + length + slack - (start + length))
    return start


def populate(addr: int, length: int, *, shared: bool, method: str = "auto") -> str:
    """Fault every page of ``[addr, addr + length)`` in now rather than on first use.

    Parameters
    ----------
    addr, length
        The page-aligned range.
    shared
        The range maps a file other processes write: the fallback must then
        never write, so that it cannot clobber their bytes.
    method
        ``"auto"``: ``MADV_POPULATE_WRITE`` where the kernel has it (it writes
        nothing), touching otherwise; ``"touch"``: always touch.

    Returns
    -------
    str
        ``"populate_write"`` or ``"touch"``: how the pages were faulted in.

    Raises
    ------
    OSError
        The kernel refused for a reason other than not knowing the advice
        (``ENOMEM`` when memory ran out).
    """
    if method == "auto":
        err = madvise(addr, length, MADV_POPULATE_WRITE)
        if err == 0:
            return "populate_write"
        if err != errno.EINVAL:
            raise OSError(err, f"MADV_POPULATE_WRITE of {length} bytes: {os.strerror(err)}")
    pages = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))[::PAGE_SIZE]
    if shared:
        # A read faults in the file's existing page (the creator allocated every
        # page with fallocate); the first write later is a minor fault. Writing
        # here, even the byte just read, could undo another worker's store.
        int(pages.sum(dtype=np.uint64))
    else:
        pages[:] = 0
    return "touch"
