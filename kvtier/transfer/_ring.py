"""A minimal io_uring ring: the three system calls through ctypes, the rings through mmap.

Why not a binding: the PyPI ``liburing`` wheels (2026.3) are compiled with
AVX-512 instructions and kill their process with SIGILL on CPUs without them,
and their ``Iovec`` keeps buffer exports forever; what kvtier needs from
io_uring is small (vectored reads and writes, fsync, an eventfd for
completions), so it talks to the kernel directly. The kernel ABI used here is
stable since Linux 5.1 (``IORING_FEAT_SINGLE_MMAP`` 5.4 is used when offered).

Layout, from ``include/uapi/linux/io_uring.h``:

* ``io_uring_setup(entries, params)`` returns a descriptor and fills the
  offsets of the fields of the submission (SQ) and completion (CQ) rings.
* The SQ ring's ``array`` maps ring positions to SQE indexes. It is filled once
  with the identity, so the SQE for position ``p`` is ``sqes[p & mask]``.
* An SQE is 64 bytes, a CQE 16 bytes; both are packed with :mod:`struct`.

Memory ordering: the submitter writes SQEs, then the SQ tail, then enters the
kernel, which reads them inside that system call on the same CPU, so program
order is enough. Completions are read after the ``eventfd`` says there are
some; on CPUs that may reorder loads (anything but x86), :meth:`Ring.reap`
also enters the kernel between reading the CQ tail and reading the entries,
since a plain Python load has no acquire semantics.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
from collections.abc import Iterator

from kvtier.transfer._io_base import buffer_address

try:
    # A run of requests prepared, or every completion reaped, in one call (see
    # prep_rw and reap_runs): a few microseconds of Python per request less.
    from kvtier.transfer import _address as _native
except ImportError:  # not built (no C compiler at install): the Python below
    _native = None  # type: ignore[assignment]

__all__ = [
    "ACC_BYTES",
    "FIXED_CAPABLE",
    "MAX_FIXED_BUFFERS",
    "MAX_FIXED_BYTES",
    "OP_FSYNC",
    "OP_NOP",
    "OP_READV",
    "OP_WRITEV",
    "SETUP_FLAGS",
    "SPLIT_MIN",
    "Ring",
]

# The io_uring system calls have these numbers on every architecture (they came
# after the syscall tables were unified, in Linux 5.1).
_SYS_SETUP, _SYS_ENTER, _SYS_REGISTER = 425, 426, 427

OP_NOP, OP_READV, OP_WRITEV, OP_FSYNC = 0, 1, 2, 3
_ENTER_GETEVENTS = 1
_REGISTER_BUFFERS, _UNREGISTER_BUFFERS = 0, 1
_REGISTER_EVENTFD, _UNREGISTER_EVENTFD = 4, 5
MAX_FIXED_BYTES = 1 << 30
"""The most one registered buffer may span (the kernel refuses more, EFAULT)."""
MAX_FIXED_BUFFERS = 1 << 14
"""The most buffers one ring may have registered (``IORING_MAX_REG_BUFFERS``)."""
_FEAT_SINGLE_MMAP = 1
_SETUP_COOP_TASKRUN = 1 << 8
SETUP_FLAGS = _SETUP_COOP_TASKRUN
"""Asked of ``io_uring_setup`` first (a kernel that refuses them gets a plain ring).

``IORING_SETUP_COOP_TASKRUN`` (Linux 5.19): a completion is posted when the
ring's thread next enters the kernel (the ``io_uring_enter`` that submits, the
event loop's ``epoll_wait``, which it also wakes) instead of an interrupt
stopping that thread wherever it is. The event loop cannot act on a completion
before it is back in ``epoll_wait`` anyway, and the interrupts that no longer
land in the middle of the hashing and the Python of a reap are what it saves:
0.95-0.97x the CPU per GB of 64 KiB verified loads, 0.98x at 256 KiB and
0.995x at 2 MiB (``benchmarks/paired_loads.py``, docs/lab/file-tier-runs.md run 15)."""
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000

FIXED_CAPABLE = _native is not None
"""Whether fixed buffers can be used (:meth:`Ring.prep_rw` needs the compiled helper)."""

SPLIT_MIN = 1 << 20
"""Least bytes of the second buffer of a two-buffer request sent as two fixed-buffer
entries (``_address.c``): below, the second entry costs more than pinning saves."""

ACC_BYTES = 32
"""Bytes per request of the accumulator a batch of split requests needs (see prep_rw)."""

_SQE = struct.Struct("<BBHiQQIIQ24x")  # opcode flags ioprio fd off addr len rw_flags user_data
_CQE = struct.Struct("<QiI")  # user_data res flags
_SQE_BYTES, _CQE_BYTES = 64, 16

# x86 keeps loads in order (TSO); elsewhere reap() inserts a system call.
_ORDERED_LOADS = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class _SqOffsets(ctypes.Structure):
    _fields_ = (
        ("head", ctypes.c_uint32),
        ("tail", ctypes.c_uint32),
        ("ring_mask", ctypes.c_uint32),
        ("ring_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("dropped", ctypes.c_uint32),
        ("array", ctypes.c_uint32),
        ("resv1", ctypes.c_uint32),
        ("user_addr", ctypes.c_uint64),
    )


class _CqOffsets(ctypes.Structure):
    _fields_ = (
        ("head", ctypes.c_uint32),
        ("tail", ctypes.c_uint32),
        ("ring_mask", ctypes.c_uint32),
        ("ring_entries", ctypes.c_uint32),
        ("overflow", ctypes.c_uint32),
        ("cqes", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("resv1", ctypes.c_uint32),
        ("user_addr", ctypes.c_uint64),
    )


class _Params(ctypes.Structure):
    _fields_ = (
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", _SqOffsets),
        ("cq_off", _CqOffsets),
    )


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _address_of(buf: bytearray | memoryview) -> int:
    """A writable or read-only buffer's address (the fallback path only)."""
    return buffer_address(memoryview(buf))


class Ring:
    """One io_uring instance: submission and completion queues of ``entries``.

    Parameters
    ----------
    entries
        Submission queue size (the kernel rounds it up to a power of two);
        the completion queue gets twice as many, as the kernel chooses.

    Raises
    ------
    OSError
        When the kernel refuses the ring (ENOSYS: built without io_uring;
        EPERM: seccomp or ``kernel.io_uring_disabled``; ENOMEM).

    Notes
    -----
    Not thread-safe: one thread (the event loop's) prepares, submits and reaps.
    The caller keeps at most ``entries`` requests in flight, so the
    completion queue (twice as deep) can never overflow.
    """

    def __init__(self, entries: int) -> None:
        params = _Params()
        params.flags = SETUP_FLAGS
        fd = _syscall(ctypes.c_long(_SYS_SETUP), ctypes.c_long(entries), ctypes.byref(params))
        self.cooperative = fd >= 0 and bool(SETUP_FLAGS & _SETUP_COOP_TASKRUN)
        """Whether completions wait for this thread's next system call (``SETUP_FLAGS``)."""
        if fd < 0 and ctypes.get_errno() == errno.EINVAL:
            params = _Params()  # a kernel before 5.19: a plain ring does the same work
            fd = _syscall(ctypes.c_long(_SYS_SETUP), ctypes.c_long(entries), ctypes.byref(params))
        self.fd = _check(fd, "io_uring_setup")
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self.fixed = 0
        """Buffers registered (:meth:`register_buffers`)."""
        try:
            self._map_rings(params)
        except BaseException:
            self.close()
            raise

    def _map_rings(self, p: _Params) -> None:
        sq, cq = p.sq_off, p.cq_off
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_POPULATE
        sq_bytes = sq.array + p.sq_entries * 4
        cq_bytes = cq.cqes + p.cq_entries * _CQE_BYTES
        if p.features & _FEAT_SINGLE_MMAP:
            sq_bytes = cq_bytes = max(sq_bytes, cq_bytes)
        sq_map = mmap.mmap(self.fd, sq_bytes, flags, prot, offset=_OFF_SQ_RING)
        self._maps.append(sq_map)
        if p.features & _FEAT_SINGLE_MMAP:
            cq_map = sq_map
        else:
            cq_map = mmap.mmap(self.fd, cq_bytes, flags, prot, offset=_OFF_CQ_RING)
            self._maps.append(cq_map)
        sqes = mmap.mmap(self.fd, p.sq_entries * _SQE_BYTES, flags, prot, offset=_OFF_SQES)
        self._maps.append(sqes)
        self._sq_words = memoryview(sq_map).cast("I")
        self._cq_words = memoryview(cq_map).cast("I")
        self._cq_bytes = memoryview(cq_map)
        self._sqes = memoryview(sqes)
        self._views += [self._sq_words, self._cq_words, self._cq_bytes, self._sqes]
        self.sq_entries: int = p.sq_entries
        self.cq_entries: int = p.cq_entries
        self._sq_head, self._sq_tail = sq.head // 4, sq.tail // 4
        self._sq_mask: int = self._sq_words[sq.ring_mask // 4]
        self._cq_head, self._cq_tail = cq.head // 4, cq.tail // 4
        self._cq_mask: int = self._cq_words[cq.ring_mask // 4]
        self._cqes = cq.cqes
        # Position p of the SQ ring always uses SQE p & mask: fill the
        # indirection array once with the identity.
        first = sq.array // 4
        for i in range(p.sq_entries):
            self._sq_words[first + i] = i
        self._tail: int = self._sq_words[self._sq_tail]

    # -- submission ------------------------------------------------------------------------

    def space(self) -> int:
        """Submission entries free now."""
        return self.sq_entries - self.pending()

    def prep(self, opcode: int, fd: int, addr: int, length: int, offset: int, tag: int) -> None:
        """Write one submission entry (not yet visible to the kernel: see :meth:`submit`).

        The caller checks :meth:`space` first. ``tag`` comes back with the completion.
        """
        index = self._tail & self._sq_mask
        _SQE.pack_into(
            self._sqes, index * _SQE_BYTES, opcode, 0, 0, fd, offset, addr, length, 0, tag
        )
        self._tail = (self._tail + 1) & 0xFFFFFFFF

    def prep_rw(
        self,
        opcode: int,
        fd: int,
        iovecs: bytearray,
        stride: int,
        requests: list[list[memoryview]],
        offsets: list[int],
        start: int,
        count: int,
        batch: int,
        table: bytes | None = None,
        acc: bytearray | None = None,
    ) -> int:
        """Write the entries of ``requests[start:start + count]`` (checked, contiguous buffers).

        Request ``i``'s ``struct iovec`` array is written at ``iovecs[i * stride * 16:]``
        and its tag is ``batch << 32 | i`` (see :meth:`reap_runs`). The caller
        checks that :meth:`space` holds two entries per request and keeps
        ``iovecs`` and the buffers alive until the requests are reaped.

        ``table`` (from :meth:`fixed_table`) lists the registered buffers: a
        request whose one buffer lies in one of them is sent as one
        fixed-buffer entry (the kernel then pins no pages for it); a request
        of two whose second has at least :data:`SPLIT_MIN` bytes, as one
        fixed-buffer entry each, which needs ``acc`` (:data:`ACC_BYTES` per
        request of the batch, passed to :meth:`reap_runs` in ``split``),
        where its two results meet. Without the compiled helper ``table``
        must be None. Returns how many requests went with fixed buffers.
        """
        if _native is not None:
            self._tail, fixed = _native.prep_rw(
                self._sqes,
                self._sq_mask,
                self._tail,
                opcode,
                fd,
                iovecs,
                stride,
                requests,
                offsets,
                start,
                count,
                batch,
                table,
                acc,
            )
            return fixed
        if table is not None:
            raise RuntimeError("fixed buffers need the compiled helper kvtier.transfer._address")
        base = _address_of(iovecs)
        for i in range(start, start + count):
            at = i * stride * 16
            for view in requests[i]:
                struct.pack_into("@PN", iovecs, at, _address_of(view), view.nbytes)
                at += 16
            self.prep(
                opcode,
                fd,
                base + i * stride * 16,
                len(requests[i]),
                offsets[i],
                (batch << 32) | i,
            )
        return 0

    def pending(self) -> int:
        """Entries prepared or published that the kernel has not consumed yet."""
        head: int = self._sq_words[self._sq_head]
        return (self._tail - head) % (1 << 32)

    def submit(self) -> int:
        """Publish prepared entries and hand them to the kernel; returns how many it took.

        Raises
        ------
        OSError
            From ``io_uring_enter`` (EAGAIN, EBUSY: retry later; the entries
            stay in the ring).
        """
        self._sq_words[self._sq_tail] = self._tail
        n = self.pending()
        if not n:
            return 0
        return self._enter(n, 0, 0)

    def _enter(self, to_submit: int, min_complete: int, flags: int) -> int:
        return _check(
            _syscall(
                ctypes.c_long(_SYS_ENTER),
                ctypes.c_long(self.fd),
                ctypes.c_long(to_submit),
                ctypes.c_long(min_complete),
                ctypes.c_long(flags),
                None,
                ctypes.c_long(0),
            ),
            "io_uring_enter",
        )

    # -- completion ------------------------------------------------------------------------

    def reap(self) -> Iterator[tuple[int, int]]:
        """Yield ``(tag, result)`` of every completion posted so far, oldest first.

        A negative result is ``-errno``. Entries are released to the kernel as
        they are read, so the iterator may be abandoned part way.
        """
        words = self._cq_words
        head = words[self._cq_head]
        while True:
            tail = words[self._cq_tail]
            if tail == head:
                return
            if not _ORDERED_LOADS:
                self._enter(0, 0, _ENTER_GETEVENTS)  # a barrier between the tail and the entries
            while head != tail:
                offset = self._cqes + (head & self._cq_mask) * _CQE_BYTES
                tag, res, _ = _CQE.unpack_from(self._cq_bytes, offset)
                head = (head + 1) & 0xFFFFFFFF
                words[self._cq_head] = head
                yield tag, res

    def completions_waiting(self) -> bool:
        """True when a completion is posted and not reaped yet."""
        words = self._cq_words
        return bool(words[self._cq_tail] != words[self._cq_head])

    def reap_runs(
        self, split: dict[int, bytearray] | None = None
    ) -> list[tuple[int, list[tuple[int, int, BaseException | None]], int, int]]:
        """:meth:`reap` in one call, in runs of one batch (tags as :meth:`prep_rw` makes them).

        Each run is ``(batch, outcomes, moved, failed)``: ``outcomes`` holds
        ``(index, result, None)`` for consecutive completions of ``batch`` (the
        shape a ``submit_many`` callback takes, so a run without failures is
        handed on as it is), ``moved`` the sum of the results that are not
        negative, ``failed`` how many are negative (``-errno``). A batch may
        have several runs in one reap. A request :meth:`prep_rw` split in two
        is reported once, when both parts are in (``split`` maps its batch to
        its ``acc``), with the result one vectored transfer would have had.
        """
        if _native is not None:
            return _native.reap(
                self._cq_bytes,
                self._cq_head * 4,
                self._cq_tail * 4,
                self._cq_mask,
                self._cqes,
                split,
            )
        runs: list[tuple[int, list[tuple[int, int, BaseException | None]], int, int]] = []
        for tag, res in self.reap():
            batch = tag >> 32
            if not runs or runs[-1][0] != batch:
                runs.append((batch, [], 0, 0))
            _, outcomes, moved, failed = runs[-1]
            outcomes.append((tag & 0xFFFFFFFF, res, None))
            runs[-1] = (batch, outcomes, moved + max(res, 0), failed + (res < 0))
        return runs

    def wait(self) -> None:
        """Block until at least one completion is posted (for probes and tests)."""
        self._enter(0, 1, _ENTER_GETEVENTS)

    # -- set-up ----------------------------------------------------------------------------

    def register_eventfd(self, efd: int) -> None:
        """Have the kernel signal ``efd`` for every completion posted."""
        arg = ctypes.c_int32(efd)
        _check(
            _syscall(
                ctypes.c_long(_SYS_REGISTER),
                ctypes.c_long(self.fd),
                ctypes.c_long(_REGISTER_EVENTFD),
                ctypes.byref(arg),
                ctypes.c_long(1),
            ),
            "io_uring_register(EVENTFD)",
        )

    def register_buffers(self, spans: list[tuple[int, int]]) -> None:
        """Register ``(address, length)`` spans as the ring's fixed buffers 0, 1, ...

        Replaces any registered before. The kernel pins their pages (counted
        against ``RLIMIT_MEMLOCK`` without ``CAP_IPC_LOCK``) until
        :meth:`unregister_buffers` or :meth:`close`; requests already in flight
        keep the pages they use. An empty list only unregisters.

        Raises
        ------
        OSError
            ENOMEM (the memlock limit), EFAULT (a span over 1 GiB or not
            mapped), EOPNOTSUPP (memory the kernel will not pin for long), ...
        """
        self.unregister_buffers()
        if not spans:
            return
        iov = (ctypes.c_uint64 * (2 * len(spans)))()
        for i, (addr, length) in enumerate(spans):
            iov[2 * i], iov[2 * i + 1] = addr, length
        _check(
            _syscall(
                ctypes.c_long(_SYS_REGISTER),
                ctypes.c_long(self.fd),
                ctypes.c_long(_REGISTER_BUFFERS),
                ctypes.byref(iov),
                ctypes.c_long(len(spans)),
            ),
            "io_uring_register(BUFFERS)",
        )
        self.fixed = len(spans)

    def unregister_buffers(self) -> None:
        """Drop the registered buffers, if any."""
        if not self.fixed:
            return
        self.fixed = 0
        _check(
            _syscall(
                ctypes.c_long(_SYS_REGISTER),
                ctypes.c_long(self.fd),
                ctypes.c_long(_UNREGISTER_BUFFERS),
                None,
                ctypes.c_long(0),
            ),
            "io_uring_register(UNREGISTER_BUFFERS)",
        )

    @staticmethod
    def fixed_table(spans: list[tuple[int, int]]) -> bytes:
        """The lookup :meth:`prep_rw` takes for buffers registered as ``spans``:
        ``(start, end, index)`` triples, sorted by start."""
        rows = sorted((addr, addr + length, i) for i, (addr, length) in enumerate(spans))
        return struct.pack(f"<{3 * len(rows)}Q", *(v for row in rows for v in row))

    def unregister_eventfd(self) -> None:
        """Stop signalling the eventfd."""
        _check(
            _syscall(
                ctypes.c_long(_SYS_REGISTER),
                ctypes.c_long(self.fd),
                ctypes.c_long(_UNREGISTER_EVENTFD),
                None,
                ctypes.c_long(0),
            ),
            "io_uring_register(UNREGISTER_EVENTFD)",
        )

    def close(self) -> None:
        """Unmap the rings and close the descriptor (requests still in flight are cancelled)."""
        for v in self._views:
            v.release()
        self._views.clear()
        for m in self._maps:
            m.close()
        self._maps.clear()
        self.fixed = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
