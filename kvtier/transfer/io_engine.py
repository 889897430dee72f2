"""Asynchronous vectored file I/O behind one interface: io_uring or a thread pool.

An :class:`IOEngine` reads and writes lists of buffers at a file offset and
hands back a :class:`~kvtier.transfer.completion.Completion` at once. Two
implementations exist:

* :class:`~kvtier.transfer.uring.UringEngine` (``"io_uring"``): one ring whose
  completions are announced on an eventfd that the running event loop watches;
  submissions are batched, one ``io_uring_enter`` per loop iteration.
* :class:`~kvtier.transfer.threads.ThreadEngine` (``"threads"``):
  ``os.preadv`` / ``os.pwritev`` in a pool of ``queue_depth`` threads, for
  where io_uring is unavailable (containers often forbid it with seccomp, and
  ``/proc/sys/kernel/io_uring_disabled`` can switch it off).

:func:`open_io_engine` picks one; ``"auto"`` probes io_uring once per process
and logs the choice.

This module is the factory, above both engines; the contract they implement
(:class:`IOEngine`, its statistics, :func:`buffer_address`) is in
:mod:`kvtier.transfer._io_base`, below them, and importable from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvtier.errors import InvalidArgumentError, TierIOError
from kvtier.transfer._io_base import (
    DEFAULT_DIRECT_ALIGNMENT,
    IOV_MAX,
    IOEngine,
    IOEngineStatistics,
    buffer_address,
)
from kvtier.transfer._ring import OP_NOP, Ring
from kvtier.transfer.threads import ThreadEngine
from kvtier.transfer.uring import UringEngine, _IovecPool

__all__ = [
    "DEFAULT_DIRECT_ALIGNMENT",
    "IOV_MAX",
    "QUEUE_DEPTHS",
    "DepthProbe",
    "EngineKind",
    "IOEngine",
    "IOEngineStatistics",
    "buffer_address",
    "choose_depth",
    "measure_queue_depth",
    "open_io_engine",
    "probe_depths",
    "probe_io_uring",
]

log = logging.getLogger("kvtier.io")

EngineKind = Literal["auto", "io_uring", "threads"]


QUEUE_DEPTHS = (1, 4, 8, 16, 32)
"""The depths :func:`measure_queue_depth` tries by default."""

DEEP_DEPTH = 64
"""The depth :func:`probe_depths` adds for mid-sized requests."""

_DEEP_QUEUE_BYTES = (8 << 20, 64 << 20)
"""Bytes a queue of 32 holds, from (inclusive) and below, where DEEP_DEPTH is tried."""


def probe_depths(request_bytes: int, engine: str = "io_uring") -> tuple[int, ...]:
    """The depths worth timing for requests of ``request_bytes`` on ``engine``.

    :data:`QUEUE_DEPTHS`, and on io_uring :data:`DEEP_DEPTH` where a queue of
    32 holds 8 to 64 MiB (requests of 256 KiB up to 2 MiB). On this project's
    virtio disk the requests of a queue complete in one burst, so the event
    loop wakes once per queue, and each wake-up costs CPU whatever it reaps
    (the caches it finds cold). There, 64 in flight against 32 read 256 KiB
    blocks through the tier at 0.90-1.12x the CPU per GB and wrote them at
    0.87-0.96x, 1 MiB blocks at 0.91x and 0.88x, at the same rate or faster
    (docs/lab/file-tier-runs.md, run 16). Not below: at 64 KiB a reap's per-block work
    outweighs the wake-up, and 64 cost 1.17x the CPU of 32. Not from 2 MiB: a
    queue of 32 there already wakes the loop a few times per GB, and a probe
    step at 64 would move 256 MiB. Not on the thread engine, where each
    request is a thread's system call: 64 threads wrote 256 KiB blocks at
    0.91x the rate of 32 and 1.08x the CPU per GB.

    Parameters
    ----------
    request_bytes
        Bytes per request (a tier's slot).
    engine
        The engine's :attr:`IOEngine.name`.

    Returns
    -------
    tuple[int, ...]
        Depths, ascending.
    """
    low, high = _DEEP_QUEUE_BYTES
    if engine == "io_uring" and low <= 32 * request_bytes < high:
        return (*QUEUE_DEPTHS, DEEP_DEPTH)
    return QUEUE_DEPTHS


_STEP_BYTES = 32 << 20
"""Bytes moved at each depth tried, per round, at least (two full queues where that is more)."""


@dataclass(frozen=True, slots=True)
class DepthProbe:
    """What :func:`measure_queue_depth` measured, and the depth it chose."""

    depth: int
    """The depth chosen (:func:`choose_depth`)."""
    gbps: tuple[tuple[int, float], ...]
    """``(depth, GB/s)`` for each depth tried, its best round, in the order of ``depths``."""
    write: bool
    """True when the probe wrote (zeros), False when it read."""
    seconds: float
    """Wall time of the whole probe."""


async def measure_queue_depth(
    engine: IOEngine,
    fd: int,
    *,
    offset: int,
    length: int,
    request_bytes: int,
    write: bool,
    alignment: int = DEFAULT_DIRECT_ALIGNMENT,
    depths: Sequence[int] = QUEUE_DEPTHS,
    tolerance: float = 0.10,
    warm_up: bool = False,
    rounds: int = 2,
    confirm: int = 2,
) -> DepthProbe:
    """Time requests of ``request_bytes`` at each of ``depths`` and choose one.

    At each depth, ``depth`` chains of requests run side by side (so exactly
    ``depth`` are in flight) over ``[offset, offset + length)``, request after
    request, wrapping at the end; each depth moves at least 32 MiB and two
    full queues, on its own part of the range where the range is long enough
    (so that no depth reads what a cache kept from the one before). The
    depths are timed in ``rounds`` rounds, in turn ascending and descending
    (a drift of the device favours no depth), and :func:`choose_depth` weighs
    each depth's best round (other work on a shared machine only ever slows a
    step down) against the typical rate of the fastest.

    Parameters
    ----------
    engine
        Opened with a queue depth of at least ``max(depths)``.
    fd
        The file, opened for reading and writing (``O_DIRECT`` for the figures
        to be the device's).
    offset, length
        The range used: multiples of ``request_bytes`` apart from the end,
        which is not used past the last whole request.
    request_bytes
        Bytes per request, a multiple of ``alignment``.
    write
        Write zeros (only where the file already reads as zeros, or holds
        nothing anyone will read: the caller's promise), or read.
    alignment
        O_DIRECT alignment of the offsets.
    depths
        Depths to try, each from 1 to ``engine.queue_depth``.
    tolerance
        A deeper queue is chosen unless its best round is slower than the
        typically fastest depth by more than this fraction
        (:func:`choose_depth`): the deeper queue costs nothing the device
        shows, and it serves callers that submit in bursts. At 0.05, probes
        on this project's shared VM chose 16 where 32 was as fast in 5 of 24
        opens (run-to-run noise of 10-40% there); 0.10 keeps the deeper one.
    warm_up
        Write the whole range once, untimed, before the depths are timed: the
        first write of a never-written block can cost the device more than
        the next ones (a thin-provisioned virtual disk allocates it), which
        the first depth tried would pay alone.
    rounds
        Times each depth is timed (at least 1).
    confirm
        Extra rounds, at most, where a shallower depth than the deepest won:
        the winner and the depths deeper than it are timed once more (in
        turn) and the choice made again, until the deepest is chosen or these
        rounds are spent. A burst of other work that slowed a deep queue's
        every round (on this project's shared VM, two rounds alone chose 8 at
        256 KiB in 1 of 24 opens of the benchmark, and 4 at 8 MiB in 1 of 36
        opens, where 32 was faster in the same runs) seldom slows it again in
        the confirmation, which costs nothing where the deepest depth wins.

    Returns
    -------
    DepthProbe
        The depth chosen and the rate of each depth.

    Raises
    ------
    InvalidArgumentError
        For a range holding no request, or a depth outside ``1..engine.queue_depth``.
    TierIOError
        When a request fails or transfers fewer bytes (nothing is chosen then).
    """
    count = length // request_bytes if request_bytes > 0 else 0
    if count < 1 or offset < 0 or request_bytes % alignment or offset % alignment:
        raise InvalidArgumentError(
            f"no aligned request of {request_bytes} bytes fits in {length} bytes at {offset}"
        )
    if not depths or any(not 1 <= d <= engine.queue_depth for d in depths):
        raise InvalidArgumentError(f"depths {tuple(depths)} must be in 1..{engine.queue_depth}")
    buffer = mmap.mmap(-1, request_bytes)
    view = memoryview(buffer)
    call = engine.writev if write else engine.readv
    started = time.perf_counter()
    at = 0  # the next request's index in the range, advancing across depths

    async def chain(first: int, step: int, n: int) -> None:
        for i in range(first, n, step):
            where = offset + ((at + i) % count) * request_bytes
            got = await call(fd, [view], where, alignment=alignment)
            if got != request_bytes:
                raise TierIOError(0, f"short probe request: {got} of {request_bytes} bytes")

    async def run(depth: int, n: int) -> None:
        """``n`` requests, ``depth`` in flight."""
        try:
            # A failing chain cancels the others: no request starts after it.
            async with asyncio.TaskGroup() as group:
                for k in range(depth):
                    group.create_task(chain(k, depth, n))
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None

    rates: dict[int, list[float]] = {d: [] for d in depths}

    async def timed(round_depths: Sequence[int]) -> None:
        nonlocal at
        for depth in round_depths:
            n = max(2 * depth, -(-_STEP_BYTES // request_bytes))
            t0 = time.perf_counter()
            await run(depth, n)
            rates[depth].append(n * request_bytes / (time.perf_counter() - t0) / 1e9)
            at += n

    def choice() -> int:
        return choose_depth(rates, tolerance)

    try:
        if warm_up:
            await run(max(depths), count)
        for r in range(max(1, rounds)):
            await timed(depths if r % 2 == 0 else list(reversed(depths)))
        for r in range(max(0, confirm)):
            chosen = choice()
            if chosen == max(depths):
                break
            # Deepest first: it was the one slowed, if one was.
            await timed(sorted((d for d in depths if d >= chosen), reverse=r % 2 == 0))
    finally:
        # A request of a failed chain may still be in the kernel: the mapping
        # then stays until its views are gone.
        with contextlib.suppress(BufferError):
            view.release()
            buffer.close()
    best = tuple((d, max(r)) for d, r in rates.items())
    return DepthProbe(choice(), best, write, time.perf_counter() - started)


def choose_depth(rates: Mapping[int, Sequence[float]], tolerance: float) -> int:
    """The deepest depth whose best round comes within ``tolerance`` of the best typical rate.

    Parameters
    ----------
    rates
        GB/s of each round, by depth (at least one round each).
    tolerance
        Fraction below the best typical rate a depth's best round may fall.

    Returns
    -------
    int
        The depth chosen.

    Notes
    -----
    The typical rate of a depth is the median of its rounds; the best typical
    rate is that of the depth typically fastest. A depth qualifies when its
    best round reaches ``1 - tolerance`` of it, so one lucky round of a
    shallow depth cannot push the deeper ones out, while a shallow depth that
    is faster round after round still wins. The two mistakes cost unequally:
    on this project's virtio disk a shallow choice lost up to a fifth of the
    throughput where deep queues pay off (depth 8 against 32 at 2 MiB, a probe
    taken while both cores were busy), a deep one a few percent where they
    do not.
    """
    typical = max(statistics.median(r) for r in rates.values())
    return max(d for d, r in rates.items() if max(r) >= (1 - tolerance) * typical)


_probe_result: list[str | None] = []


# Run in a child interpreter by probe_io_uring, with the path of
# kvtier/transfer/_ring.py as argv[1] (loaded alone: it needs only the standard
# library, so the child starts in ~50 ms): a ring, an eventfd, one writev and
# one readv on a real file. Whatever kills a process here (a seccomp profile
# whose action is to kill, as some sandboxes use for io_uring_setup; a binding
# built for another CPU, as the liburing 2026.3 wheels are, which die with
# SIGILL without AVX-512) kills only the child. Prints "ok" or why not.
_CHILD_PROBE = r"""
import ctypes, importlib.util, os, struct, sys, tempfile
spec = importlib.util.spec_from_file_location("kvtier_ring_probe", sys.argv[1])
R = importlib.util.module_from_spec(spec)
spec.loader.exec_module(R)
try:
    ring = R.Ring(4)
except OSError as exc:
    # EPERM: seccomp or io_uring_disabled; ENOSYS: kernel built without it.
    sys.stdout.write(f"io_uring setup failed: {exc}")
    raise SystemExit(0)
efd = os.eventfd(0)
fd, path = tempfile.mkstemp(prefix="kvtier-probe-")
try:
    ring.register_eventfd(efd)
    os.unlink(path)
    out = ctypes.create_string_buffer(b"kvtier" * 100, 600)
    back = ctypes.create_string_buffer(600)
    for op, buf in ((R.OP_WRITEV, out), (R.OP_READV, back)):
        iov = ctypes.create_string_buffer(struct.pack("@PN", ctypes.addressof(buf), 600))
        ring.prep(op, fd, ctypes.addressof(iov), 1, 0, 7)
        ring.submit()
        os.eventfd_read(efd)
        done = list(ring.reap())
        if done != [(7, 600)]:
            sys.stdout.write(f"io_uring probe transfer gave {done}, not [(7, 600)]")
            raise SystemExit(0)
    if back.raw != out.raw:
        sys.stdout.write("io_uring probe read back other bytes than it wrote")
        raise SystemExit(0)
except OSError as exc:
    sys.stdout.write(f"io_uring probe failed: {exc}")
    raise SystemExit(0)
finally:
    os.close(fd)
    os.close(efd)
    ring.close()
sys.stdout.write("ok")
"""


def _probe_child() -> str | None:
    """Exercise io_uring in a child interpreter; None when it worked, else why not."""
    import signal
    import subprocess
    import sys

    if not sys.executable:
        # Embedded without an interpreter to start: probe in this process.
        return _probe_in_process()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD_PROBE, str(Path(__file__).with_name("_ring.py"))],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the io_uring probe process failed: {exc}"
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return f"the io_uring probe process was killed by {name} (a seccomp profile?)"
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"the io_uring probe process failed: {tail}"
    return None if proc.stdout == "ok" else (proc.stdout or "the io_uring probe said nothing")


def probe_io_uring() -> str | None:
    """Whether io_uring works here: ``None`` if it does, else the reason it does not.

    In a child interpreter (whatever kills a process there, such as a seccomp
    profile that kills on ``io_uring_setup``, must not take the caller's down
    with it; seccomp filters are inherited, so the child's answer holds for
    the caller), or in this process where no interpreter can be started; and
    the ``struct iovec`` layout the zero-copy path relies on. The answer is
    computed once per process.
    """
    if _probe_result:
        return _probe_result[0]
    try:
        _IovecPool()  # the struct iovec layout the zero-copy path relies on
        reason = _probe_child()
    except RuntimeError as exc:
        reason = str(exc)
    _probe_result.append(reason)
    return reason


def _probe_in_process() -> str | None:
    try:
        ring = Ring(2)
        try:
            ring.prep(OP_NOP, -1, 0, 0, 0, 1)
            ring.submit()
            ring.wait()
            done = list(ring.reap())
        finally:
            ring.close()
        if done != [(1, 0)]:
            return f"io_uring no-op gave {done}, not [(1, 0)]"
    except OSError as exc:
        # EPERM: seccomp or io_uring_disabled; ENOSYS: kernel built without it.
        return f"io_uring setup failed: {exc}"
    return None


async def open_io_engine(kind: EngineKind = "auto", *, queue_depth: int = 32) -> IOEngine:
    """Open an I/O engine bound to the running event loop.

    Parameters
    ----------
    kind
        ``"io_uring"`` (fail if unavailable), ``"threads"``, or ``"auto"``:
        io_uring where it works, else threads; the choice is logged.
    queue_depth
        Most requests in flight at once (1 to 4096).

    Raises
    ------
    InvalidArgumentError
        For an unknown kind or a queue depth out of range.
    TierIOError
        When ``kind="io_uring"`` and io_uring cannot be set up here.
    """
    if isinstance(queue_depth, bool) or not isinstance(queue_depth, int):
        raise InvalidArgumentError(f"queue_depth must be an int, got {queue_depth!r}")
    if not 1 <= queue_depth <= 4096:
        raise InvalidArgumentError(f"queue_depth must be in 1..4096, got {queue_depth}")
    if kind not in ("auto", "io_uring", "threads"):
        raise InvalidArgumentError(f"unknown io engine {kind!r}")
    if kind in ("auto", "io_uring"):
        reason = probe_io_uring()
        if reason is None:
            engine: IOEngine = UringEngine(queue_depth=queue_depth)
            if kind == "auto":
                log.info("io engine: io_uring (queue depth %d)", queue_depth)
            return engine
        if kind == "io_uring":
            raise TierIOError(0, f"io_uring is unavailable: {reason}")
        log.warning("io engine: threads, because io_uring is unavailable: %s", reason)
    return ThreadEngine(queue_depth=queue_depth)
