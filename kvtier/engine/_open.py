"""Opening the engine (the region, the copier or the workers, the tiers through
:mod:`kvtier.tiers.factory`) and closing it (draining, write-back, abandoning)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Self

from kvtier._native_status import warn_if_missing
from kvtier.config import KVTierConfig
from kvtier.engine._jobs import _check_chunking, _wait, log
from kvtier.engine._state import _State
from kvtier.errors import ConfigurationError, InvalidArgumentError, LayoutError
from kvtier.layout import KVLayout
from kvtier.region import CPURegion
from kvtier.tiers.factory import aclose_tiers, open_tiers
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import DeviceTransfer, open_device_transfer
from kvtier.transfer.io_engine import IOEngine
from kvtier.workers.group import WorkerGroup

if TYPE_CHECKING:
    import torch


class _Opening(_State):
    """Opening and closing (:meth:`Engine.open <kvtier.engine.Engine.open>`, ``aclose``)."""

    @classmethod
    async def _open(
        cls,
        config: KVTierConfig,
        layout: KVLayout,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | None = None,
        *,
        workers: WorkerGroup | None = None,
        worker_timeout: float = 60.0,
        backend: Literal["auto", "cpu", "cuda"] = "auto",
        io_engine: IOEngine | None = None,
        wrap_transfer: Callable[[DeviceTransfer], DeviceTransfer] | None = None,
    ) -> Self:
        """:meth:`~kvtier.engine.Engine.open`."""
        warn_if_missing()  # slower fallbacks say so at first use, not silently
        _check_chunking(config, layout)
        if workers is not None:
            return await cls._open_split(
                config, layout, kv_caches, workers, worker_timeout, io_engine, wrap_transfer
            )
        if kv_caches is None:
            raise InvalidArgumentError("kv_caches is required (or workers= for a split instance)")
        if config.world_size != 1:
            raise ConfigurationError(
                "Engine drives one worker; for world_size > 1 open a shared CPURegion per "
                "worker (kvtier.region) and drive it directly"
            )
        if layout.tp_size != 1:
            # A block key and the file tier's namespace cover a whole row, every
            # rank's slice: one Engine per rank would store one slice under keys
            # that every rank shares, and serve it to the others.
            raise LayoutError(
                f"the layout is rank {layout.tp_rank} of tp_size={layout.tp_size}, but Engine "
                "holds one worker's whole row: engines of several ranks would share one "
                "namespace and load each other's slices. Open it with the layout of one "
                "worker that holds every rank's KV (tp_size=1)"
            )
        alignment = config.row_alignment
        region = CPURegion.create(layout, int(config.cpu_bytes_to_use), alignment=alignment)
        transfer: DeviceTransfer | None = None
        try:
            transfer = open_device_transfer(
                layout, kv_caches, region.tensor_views(), backend=backend
            )
            if wrap_transfer is not None:
                transfer = wrap_transfer(transfer)
            tiers = await open_tiers(config, layout, region, io_engine=io_engine)
        except BaseException:
            if transfer is not None:
                await transfer.aclose()
            region.close()
            raise
        return cls(config, layout, region, transfer, tiers)

    @classmethod
    async def _open_split(
        cls,
        config: KVTierConfig,
        layout: KVLayout,
        kv_caches: object,
        workers: WorkerGroup,
        worker_timeout: float,
        io_engine: IOEngine | None,
        wrap_transfer: Callable[[DeviceTransfer], DeviceTransfer] | None,
    ) -> Self:
        """The scheduler of a split instance: the region whole, copies by the workers."""
        try:
            if kv_caches is not None:
                raise InvalidArgumentError(
                    "with workers=, the KV tensors live in the worker processes: pass no kv_caches"
                )
            world = workers.world_size
            _check_chunking(config, layout)
            if config.world_size != world or layout.tp_size != world:
                raise ConfigurationError(
                    f"the worker group has {world} ranks, config.world_size is "
                    f"{config.world_size} and the layout's tp_size is {layout.tp_size}: all "
                    "three must agree"
                )
            if isinstance(worker_timeout, bool) or not isinstance(worker_timeout, int | float):
                raise InvalidArgumentError(
                    f"worker_timeout must be a number, got {worker_timeout!r}"
                )
            name = config.shared_region_name or f"i{workers.instance.hex()}"
            alignment = config.row_alignment
            budget = int(config.cpu_bytes_to_use)
            region = await asyncio.to_thread(
                CPURegion.create,
                layout,
                budget,
                world_size=world,
                rank=None,
                shared_name=name,
                instance=workers.instance,
                alignment=alignment,
            )
        except BaseException:
            await workers.aclose()
            raise
        transfer: DeviceTransfer = workers
        try:
            await workers.start(layout, region, budget, float(worker_timeout))
            if wrap_transfer is not None:
                transfer = wrap_transfer(transfer)
            tiers = await open_tiers(config, layout, region, io_engine=io_engine)
        except BaseException:
            await transfer.aclose()
            region.close()
            raise
        return cls(config, layout, region, transfer, tiers)

    async def _close(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        await self._settle_until(deadline)
        if time.monotonic() < deadline:
            # Each write-back tier is given the blocks whose only copy is their row.
            self._chain.write_back()
            self._dispatch()
        await self._settle_until(deadline)
        # From here on nothing new goes to a lower tier: what a copy still
        # running would write through, and what is still dirty, is abandoned.
        self._abandoning = True
        self._runtime.stop_writes()
        if left := self._chain.abandon():
            self._own.abandoned_at_close += left
            log.warning(
                "aclose: %d blocks not written to the lower tiers (timeout reached); "
                "they are lost with the CPU region",
                left,
            )
        writes = set(self._runtime.writes())
        late = [c for c in self._unfinished() if c not in writes]
        if late:
            log.warning("aclose: %d jobs still running after %.1fs", len(late), seconds)
        self._runtime.cancel_seeding()
        self._abandon_count(self._runtime.abandoned)
        try:
            # The copier and the ring wait for what they handed to hardware, so the
            # region is unmapped only after nothing can touch it any more.
            await self._xfer.aclose()
            links = self._links
            await aclose_tiers([link.tier for link in links], [link.name for link in links])
        finally:
            self._region.close()

    def _abandon(self, keys: Sequence[bytes]) -> None:
        """Count and report blocks that aclose will not write to the lower tiers."""
        self._abandon_count(len(keys))

    def _abandon_count(self, count: int) -> None:
        if count:
            self._own.abandoned_at_close += count
            log.warning(
                "aclose: %d blocks not written to the lower tiers (timeout reached); "
                "they are lost with the CPU region",
                count,
            )

    def _unfinished(self) -> list[Completion[None]]:
        """Every tracked completion not done yet (copies, promotions, tier writes)."""
        jobs = {j.done for j in self._inflight.values()}
        return [c for c in (*self._runtime.writes(), *jobs, *self._pending) if not c.done()]

    async def _settle_until(self, deadline: float) -> bool:
        """Wait until nothing tracked is running, or ``deadline``; True when idle.

        Only what is not done yet is awaited: awaiting a done completion does
        not yield, and a done write leaves its set only when its callback has
        run, so waiting on those would spin without letting the callback run.
        Work that ends starts more (a store's copy, its write-through): the
        loop looks again until nothing is left. Every tracked completion
        resolves after the state changes of its step (rows unpinned, blocks
        completed), so nothing is left to run once none is pending.
        """
        while pending := self._unfinished():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await _wait(pending, seconds=None if math.isinf(left) else left)
        return True
