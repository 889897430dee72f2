"""The parts of one open file tier, wired together, and what concerns them all.

:class:`~kvtier.tiers.file.FileTier` is a facade: it checks a call and hands it
to one part. The parts themselves (the slot file, the pipeline, the recovery,
the quarantine, the worker thread, the other partitions and the tier's side of
them) are made here, over a namespace :func:`~kvtier.tiers.file._opening.open_namespace`
made ready, and :class:`Parts` keeps what no single part owns:

* whether anything is in flight (every part reports on the loop when
  something of its own ends), which the recovery at open and ``aclose``
  wait for;
* the memory registered with the I/O engine (the caller's rows and the
  pipeline's header pages, under one owner);
* releasing them all, in order, once nothing is in flight.

Apart from the facade so that the tier's class holds its contract (checks,
delegation, documentation) and this one its wiring and lifetime.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvtier.config import FileTierConfig
from kvtier.layout import KVLayout
from kvtier.tiers.file._buffers import registration_pieces
from kvtier.tiers.file._opening import Opened
from kvtier.tiers.file._peers import Peers
from kvtier.tiers.file._pipeline import Pipeline
from kvtier.tiers.file._quarantine import Quarantine
from kvtier.tiers.file._recovery import Recovery
from kvtier.tiers.file._sharing import Sharing
from kvtier.tiers.file._slots import SlotFile
from kvtier.tiers.file._worker import Worker

__all__ = ["Parts"]


class Parts:
    """One open tier's parts, wired, with their idleness, registered memory and release.

    Call on the loop the tier was opened on.

    Parameters
    ----------
    config
        The tier's configuration (durability, the peer poll period).
    layout
        The KV layout: its namespace goes into, and is checked against, every block.
    opened
        The namespace made ready (its descriptors, the engine, the residency manager).
    """

    def __init__(self, config: FileTierConfig, layout: KVLayout, opened: Opened) -> None:
        self.loop = loop = asyncio.get_running_loop()
        self.config = config
        self.engine = engine = opened.engine
        self.owns_engine = opened.owns_engine
        """True when the engine was opened for the tier: :meth:`release` closes it."""
        self.manager = manager = opened.manager
        self.registered = 0
        """Bytes registered with the engine by :meth:`register_memory`."""
        self._idle: asyncio.Future[None] | None = None
        prepared, block_bytes, alignment = opened.prepared, opened.block_bytes, opened.alignment
        ns_dir = prepared.undo.ns_dir
        # Each part reports on the loop when something of its own ends
        # (check_idle), so that what waits for nothing in flight wakes then.
        self.worker = Worker(loop)
        self.slots = SlotFile(
            ns_dir=ns_dir,
            ns_fd=prepared.ns_fd,
            data_fd=prepared.data_fd,
            lock_fd=prepared.lock_fd,
            block_bytes=block_bytes,
            alignment=alignment,
            direct_fallback=prepared.fallback,
            engine=engine,
            manager=manager,
            on_settled=self.check_idle,
        )
        self.quarantine = Quarantine(ns_dir, manager.capacity, self.worker, self.check_idle)
        self.pipeline = Pipeline(
            loop=loop,
            engine=engine,
            slots=self.slots,
            manager=manager,
            namespace=layout.namespace,
            worker=self.worker,
            quarantine=self.quarantine,
            fsync=config.durability == "fsync",
            on_settled=self.check_idle,
        )
        self.recovery = Recovery(
            slots=self.slots,
            engine=engine,
            manager=manager,
            namespace=layout.namespace,
            settle=self.settle,
        )
        self.peers = Peers(
            root=ns_dir.parent,
            namespace=layout.namespace,
            own=ns_dir.name,
            block_bytes=block_bytes,
            alignment=alignment if prepared.fallback is None else None,
            engine=engine,
        )
        self.sharing = Sharing(
            loop=loop,
            peers=self.peers,
            manager=manager,
            pipeline=self.pipeline,
            poll_s=config.peer_poll_s,
            on_settled=self.check_idle,
        )

    # -- in flight ----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """True while a block, a slot's zeroing, a quarantine copy or a peer read is in flight."""
        return (
            self.pipeline.busy
            or self.slots.clearing
            or self.quarantine.busy
            or bool(self.sharing.reads)
        )

    def check_idle(self) -> None:
        """Wake what waits for nothing in flight, once nothing is (each part's ``on_settled``)."""
        idle = self._idle
        if idle is not None and not idle.done() and not self.busy:
            idle.set_result(None)

    async def settle(self) -> None:
        """Wait until nothing is in flight (the recovery's slot zeroing, at open)."""
        self._idle = self.loop.create_future()
        self.check_idle()
        await self._idle
        self._idle = None

    async def wait_idle(self) -> None:
        """Wait until nothing is in flight (``aclose``); cancelling the caller stops no part."""
        if self.busy:
            if self._idle is None:
                self._idle = self.loop.create_future()
            await asyncio.shield(self._idle)

    # -- registered memory and release --------------------------------------------------

    def register_memory(self, buffers: Sequence[object]) -> int:
        """Register ``buffers`` and the header pages with the engine (see
        :meth:`FileTier.register_memory <kvtier.tiers.file.FileTier.register_memory>`)."""
        pieces = registration_pieces(buffers, self.slots.block_bytes)
        if not pieces:
            self.engine.unregister_memory(self)
            self.registered = 0
            return 0
        self.registered = self.engine.register_memory(self, [self.pipeline.header_memory, *pieces])
        return self.registered

    async def release(self) -> None:
        """Release every part, the engine with them if the tier owns it; once nothing is in
        flight (:meth:`wait_idle`)."""
        self.worker.close()
        if self.owns_engine:
            await self.engine.aclose()
        else:
            self.engine.unregister_memory(self)
        self.registered = 0
        self.pipeline.close()
        self.peers.close()
        self.slots.close()
