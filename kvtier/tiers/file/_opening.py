"""Opening the file tier: the namespace made ready on disk, the I/O engine, and undoing both.

:meth:`FileTier.open <kvtier.tiers.file.FileTier.open>` is a sequence of steps
each of which may fail or be cancelled, and an open that fails leaves the disk
as it found it. This module holds the steps that come before the tier exists
(:func:`open_namespace`: the arguments checked, the root made and locked, the
namespace prepared and its share reserved by
:func:`~kvtier.tiers.file._namespace.prepare`, the engine opened at a measured
queue depth, the residency manager made) and the undoing of them
(:meth:`Opened.unwind`), kept apart from the tier so that the facade shows
what a tier does once open, not how a root is locked and put back.

The steps that touch the disk run in worker threads and are awaited to their
end even when the caller is cancelled (:func:`_finish`): what a step did is
undone only once it is known.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kvtier._sizes import format_size
from kvtier.config import FileTierConfig
from kvtier.errors import CapacityError, InvalidArgumentError, KVTierError, TierIOError
from kvtier.layout import KVLayout
from kvtier.manager import ResidencyManager
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file._namespace import Prepared, Undo, prepare, undo_under_root_lock
from kvtier.tiers.file._root_lock import lock_root, release_root
from kvtier.tiers.file._slots import probe_range
from kvtier.transfer.io_engine import (
    DepthProbe,
    IOEngine,
    measure_queue_depth,
    open_io_engine,
    probe_depths,
)

__all__ = ["AUTO_DEPTH_FALLBACK", "Opened", "open_namespace"]

_T = TypeVar("_T")

log = logging.getLogger("kvtier.file_tier")

AUTO_DEPTH_FALLBACK = 32
"""The depth of ``queue_depth="auto"`` where nothing is measured (see :func:`_measure_depth`)."""

_PROBE_BYTES = 64 << 20
"""Fewest bytes of slots the depth probe runs on (and at least 16 slots)."""


class _Closable(Protocol):
    """A tier made over an :class:`Opened` namespace, as :meth:`Opened.unwind` closes it."""

    async def aclose(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Opened:
    """A namespace made ready for a tier by :func:`open_namespace`; the tier takes it over."""

    root: Path
    """The tier root (``config.root``)."""
    prepared: Prepared
    """What :func:`~kvtier.tiers.file._namespace.prepare` opened (the descriptors) and
    how to undo it."""
    created_root: bool
    """Whether this open created the root (an undone open removes it again)."""
    engine: IOEngine
    """The I/O engine: the caller's, or one opened for the tier."""
    owns_engine: bool
    """True when :attr:`engine` was opened for the tier (closed with it)."""
    manager: ResidencyManager
    """The residency, empty, one manager slot per slot of ``blocks.dat``."""
    block_bytes: int
    """Payload bytes of every block."""
    alignment: int
    """O_DIRECT alignment of buffers, offsets and lengths."""

    async def unwind(self, tier: _Closable | None) -> None:
        """Put everything back as it was before the open, which failed after this.

        ``tier`` is closed when it was made (with the engine it owns), else
        the descriptors and the engine the open opened; then, under the root
        lock, the disk is undone. Awaited to its end even when the caller is
        cancelled.
        """
        owned = self.engine if self.owns_engine else None
        await _unwind_open(self.root, self.prepared, self.created_root, tier, owned)


async def open_namespace(
    config: FileTierConfig,
    layout: KVLayout,
    *,
    block_bytes: int,
    alignment: int,
    io_engine: IOEngine | None,
    enable_events: bool,
) -> Opened:
    """Every step of :meth:`FileTier.open <kvtier.tiers.file.FileTier.open>` before the tier.

    Checks the arguments, prepares the namespace and reserves its share under
    the root lock, opens the engine (unless ``io_engine`` is given; at the
    measured depth with ``queue_depth="auto"``) and makes the residency
    manager. Raises what ``FileTier.open`` documents; a step that fails or is
    cancelled leaves the disk as it found it. Once this returns, what fails
    later is undone with :meth:`Opened.unwind`.
    """
    _check_arguments(config, block_bytes, alignment)
    root = Path(config.root)
    prepared, created_root = await _prepare_under_root_lock(config, layout, block_bytes, alignment)
    engine = io_engine
    try:
        if engine is None:
            engine = await _open_engine(config, prepared, HEADER_BYTES + block_bytes, alignment)
        manager = ResidencyManager(
            prepared.slots,
            policy=config.eviction_policy,
            enable_events=enable_events,
            tier="file",
        )
    except BaseException:
        # Whatever failed (the engine, a cancellation), the disk goes back to
        # what it was before this open.
        owned = engine if io_engine is None else None
        await _unwind_open(root, prepared, created_root, None, owned)
        raise
    return Opened(
        root=root,
        prepared=prepared,
        created_root=created_root,
        engine=engine,
        owns_engine=io_engine is None,
        manager=manager,
        block_bytes=block_bytes,
        alignment=alignment,
    )


def _check_arguments(config: FileTierConfig, block_bytes: int, alignment: int) -> None:
    """Refuse what no root could hold, before anything is created (see :func:`open_namespace`)."""
    if not 512 <= alignment <= HEADER_BYTES or alignment & (alignment - 1):
        raise InvalidArgumentError(
            f"alignment must be a power of two from 512 to {HEADER_BYTES}, got {alignment}"
        )
    if block_bytes <= 0 or block_bytes % alignment:
        raise InvalidArgumentError(
            f"block_bytes must be a positive multiple of {alignment}, got {block_bytes}"
        )
    file_bytes = HEADER_BYTES + block_bytes
    if int(config.bytes_to_use) < file_bytes:
        raise CapacityError(
            f"bytes_to_use ({format_size(int(config.bytes_to_use))}) holds no slot of "
            f"{format_size(file_bytes)}"
        )


async def _prepare_under_root_lock(
    config: FileTierConfig, layout: KVLayout, block_bytes: int, alignment: int
) -> tuple[Prepared, bool]:
    """The namespace made ready and its share reserved, under the root lock.

    Returns what :func:`~kvtier.tiers.file._namespace.prepare` opened and
    whether this open created the root. The root lock is released on return;
    a refused or cancelled open leaves the disk as it found it.
    """
    root = Path(config.root)
    root_lock, created_root = await _make_and_lock_root(root)
    try:
        # One thread does every disk step of the open under the root lock,
        # and undoes them itself when one fails.
        prepared, cancelled = await _run_to_end(prepare, config, layout, block_bytes, alignment)
        if cancelled:
            # Cancelled while the thread ran: it finished, so undo what it did.
            await _run_to_end(_abandon, prepared)
            raise asyncio.CancelledError
    except BaseException:
        # Refused: a root the open left with nothing but its lock goes back
        # to what it was (no lock file; no root if the open made it).
        release_root(root, root_lock, created_root=created_root)
        raise
    os.close(root_lock)
    return prepared, created_root


async def _make_and_lock_root(root: Path) -> tuple[int, bool]:
    """The root lock, held, of a root made if missing; and whether this call made the root."""
    while True:
        created_root = await asyncio.to_thread(_make_root, root)
        try:
            return await lock_root(root), created_root
        except TierIOError as exc:
            if exc.errno != errno.ENOENT:
                raise
            # Removed meanwhile by another process's refused open of the
            # empty root it had made (see release_root): make it again.


async def _open_engine(
    config: FileTierConfig, prepared: Prepared, slot_bytes: int, alignment: int
) -> IOEngine:
    """The tier's own I/O engine: at ``config.queue_depth``, or at the depth measured."""
    depth = config.queue_depth
    if depth == "auto":
        probe = await _measure_depth(config, prepared, slot_bytes, alignment)
        depth = probe.depth if probe is not None else AUTO_DEPTH_FALLBACK
    return await open_io_engine(config.io_engine, queue_depth=depth)


async def _unwind_open(
    root: Path,
    prepared: Prepared,
    created_root: bool,
    tier: _Closable | None,
    engine: IOEngine | None,
) -> None:
    """Put everything back as it was before an open that failed after its disk steps.

    ``tier`` is closed when it was made (with the engine it owns), else the
    descriptors of ``prepared`` and ``engine`` (the open's own, None when the
    caller gave one). Then, under the root lock, the disk is undone.
    """
    if tier is not None:
        await _finish(tier.aclose())
    else:
        _close_prepared(prepared)
        if engine is not None:
            await _finish(engine.aclose())
    await _run_to_end(_undo, root, prepared.undo, created_root)


def _make_root(root: Path) -> bool:
    """Create the root (0700) unless it exists; whether this call created it."""
    try:
        try:
            root.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            # There already, or made by another process opening the root at the
            # same moment (a test-then-create would race it): what it is gets
            # checked when it is opened.
            return False
        os.chmod(root, 0o700)
        return True
    except OSError as exc:
        raise TierIOError(
            exc.errno or 0, f"cannot create the tier root: {exc.strerror}", exc.filename or root
        ) from exc


async def _measure_depth(
    config: FileTierConfig, prepared: Prepared, slot_bytes: int, alignment: int
) -> DepthProbe | None:
    """Time the queue depths on the slot file itself; None where nothing can be measured.

    Requests of one slot at slot offsets, on a never-written run of slots
    (zeros, written once untimed first: a thin-provisioned disk pays for the
    first write of a block) or else on slots holding data (read); see
    :func:`~kvtier.transfer.io_engine.measure_queue_depth`. Nothing is
    measured with buffered I/O (the page cache would be timed), or on a file
    with no run of ``max(64 MiB, 16 slots)`` of one kind. A probe that fails
    is logged and the fallback depth used: the blocks' own I/O reports errors.
    """
    if prepared.fallback is not None:
        return None
    want = max(_PROBE_BYTES, 16 * slot_bytes)
    where = probe_range(prepared.data_fd, prepared.slots, slot_bytes, want)
    if where is None:
        return None
    offset, length, write = where
    # Writes: only the first ``want`` bytes of the run, written once untimed
    # then rewritten at each depth (what the open costs stays bounded on a
    # large file). Reads: up to six times as much, so that each depth reads
    # other slots than the one before (a cache under the disk would time
    # itself, not the device).
    length = min(length, want if write else 6 * want) // slot_bytes * slot_bytes
    engine = await open_io_engine(config.io_engine, queue_depth=max(probe_depths(slot_bytes)))
    depths = probe_depths(slot_bytes, engine.name)
    try:
        probe = await measure_queue_depth(
            engine,
            prepared.data_fd,
            offset=offset,
            length=length,
            request_bytes=slot_bytes,
            write=write,
            alignment=alignment,
            depths=depths,
            warm_up=write,
        )
    except (OSError, KVTierError) as exc:
        log.warning(
            "file tier: cannot measure the queue depth (%s); using %d", exc, AUTO_DEPTH_FALLBACK
        )
        return None
    finally:
        await engine.aclose()
    log.info(
        "file tier: queue depth %d, measured %s %d-byte slots in %.2f s (GB/s by depth: %s)",
        probe.depth,
        "writing" if write else "reading",
        slot_bytes,
        probe.seconds,
        ", ".join(f"{d}: {r:.2f}" for d, r in probe.gbps),
    )
    return probe


def _undo(root: Path, undo: Undo, created_root: bool) -> None:
    undo_under_root_lock(root, undo, created_root=created_root)


def _close_prepared(prepared: Prepared) -> None:
    for fd in (prepared.data_fd, prepared.ns_fd, prepared.lock_fd):
        os.close(fd)


def _abandon(prepared: Prepared) -> None:
    """Undo a prepared namespace the caller no longer wants (still under the root lock)."""
    try:
        prepared.undo.rollback()
    finally:
        _close_prepared(prepared)


async def _finish(aw: Awaitable[_T]) -> tuple[_T, bool]:
    """Await ``aw`` to its end even when the caller is cancelled meanwhile.

    Returns its result and whether the caller was cancelled (the caller then
    raises ``CancelledError`` itself). A step of an open that changes the
    disk must not go on behind the caller's back: what it did is undone only
    once it is known.
    """
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = cancelled or not task.done()
        except BaseException:
            break  # the task's own error, raised by result() below
    return task.result(), cancelled


async def _run_to_end(fn: Callable[..., _T], *args: Any) -> tuple[_T, bool]:
    """:func:`_finish` of ``fn(*args)`` run in a worker thread."""
    return await _finish(asyncio.to_thread(fn, *args))
