"""The worker side of kvtier's vLLM front: copies between vLLM's KV tensors and CPU rows.

See :mod:`kvtier.integrations.vllm.spec` for how the two sides meet.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier.chain import LoopThread
from kvtier.errors import LayoutError
from kvtier.layout import KVLayout
from kvtier.region import CPURegion
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import DeviceTransfer, open_device_transfer

__all__ = [
    "KVTierOffloadingWorker",
    "group_segments",
]

log = logging.getLogger("kvtier.integrations.vllm")


def group_segments(
    gpu: GPULoadStoreSpec, rows: LoadStoreSpec, bpc: int, *, store: bool
) -> list[tuple[np.ndarray, list[int], int]]:
    """Cut one vLLM transfer into ``(device block ids, rows, skip)``, one per KV cache group.

    vLLM lists the device blocks group after group (``group_sizes``), with the
    logical index of each group's first block (``block_indices``), and the
    rows in the same order: a group of ``n`` blocks starting ``skip = index %
    bpc`` blocks into its first row spans ``ceil((n + skip) / bpc)`` rows.

    Raises
    ------
    LayoutError
        When the counts do not add up, or a store would fill part of a row
        (kvtier's copier stores whole rows).
    """
    ids = np.asarray(gpu.block_ids, dtype=np.int64)
    row_ids = [int(r) for r in np.asarray(rows.block_ids)]
    out: list[tuple[np.ndarray, list[int], int]] = []
    at = row = 0
    for n, first in zip(gpu.group_sizes, gpu.block_indices, strict=True):
        if not n:
            continue
        skip = int(first) % bpc
        count = -(-(int(n) + skip) // bpc)
        if store and (skip or int(n) != count * bpc):
            raise LayoutError(
                f"vLLM stores {n} blocks from logical block {first} into {count} rows of "
                f"{bpc} blocks: kvtier stores whole rows only"
            )
        out.append((ids[at : at + n], row_ids[row : row + count], skip))
        at += int(n)
        row += count
    if at != len(ids) or row != len(row_ids):
        raise LayoutError(
            f"vLLM's transfer names {len(ids)} device blocks and {len(row_ids)} rows; its "
            f"groups ({list(gpu.group_sizes)} blocks) cover {at} and {row}"
        )
    return out


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    """Make ``stream`` this thread's current CUDA stream (None: leave it)."""
    if stream is None:
        yield
        return
    import torch  # pragma: no cover - needs a GPU

    with torch.cuda.stream(stream):  # pragma: no cover
        yield


class KVTierOffloadingWorker(OffloadingWorker):  # type: ignore[misc]
    """One worker's data plane: kvtier's copier between vLLM's KV tensors and its rows.

    ``submit_*`` never blocks: the copy is started on a loop thread of the
    worker's own, and its completion is collected by :meth:`get_finished`.

    On CUDA (KV tensors on a GPU) the copier is kvtier's CUDA backend
    (:func:`~kvtier.transfer.device.open_device_transfer` chooses it by the
    tensors' device). It orders each copy after the work queued on the
    submitting thread's current stream; the copy is submitted from the loop
    thread, so that thread is given the stream that was current in vLLM's
    thread at ``submit_*`` (where vLLM's own CPU offloading worker waits).
    """

    def __init__(
        self, layout: KVLayout, region: CPURegion, transfer: DeviceTransfer, loop: LoopThread
    ) -> None:
        """Use :meth:`open`."""
        self._layout = layout
        self._region = region
        self._xfer = transfer
        self._loop = loop
        self._bpc = layout.blocks_per_chunk
        self._lock = threading.Condition()
        self._finished: list[TransferResult] = []
        self._done_ids: set[int] = set()
        self._closed = False
        self._cuda = transfer.backend == "cuda"

    @classmethod
    def open(
        cls, row: KVLayout, region: CPURegion, kv_caches: CanonicalKVCaches
    ) -> KVTierOffloadingWorker:
        """Describe vLLM's canonical tensors, check they fill a row slice, start the copier.

        Raises
        ------
        LayoutError
            The tensors' pages do not add up to vLLM's ``worker_kv_bytes_per_block``
            (e.g. packed layouts), or a tensor is not contiguous.
        """
        loop: LoopThread | None = None
        try:
            tensors = [t.tensor for t in kv_caches.tensors]
            layout = KVLayout.from_tensors(
                tensors,
                model_id=row.model_id,
                block_tokens=row.block_tokens,
                blocks_per_chunk=row.blocks_per_chunk,
                kv_first=False,
                tp_rank=row.tp_rank,
                tp_size=row.tp_size,
                encoding=row.encoding,
            )
            if layout.bytes_per_chunk != row.bytes_per_chunk:
                raise LayoutError(
                    f"vLLM's KV tensors hold {layout.bytes_per_block} bytes per block, but its "
                    f"offloading config says {row.bytes_per_block}: this KV layout is not "
                    "supported by kvtier"
                )
            (whole,) = region.tensor_views()
            views = []
            for i, t in enumerate(layout.tensors):
                off = layout.tensor_offset(i)
                views.append(whole[:, off : off + t.bytes_per_block * layout.blocks_per_chunk])
            transfer = open_device_transfer(layout, tensors, views)
            loop = LoopThread(f"kvtier-vllm-worker-{row.tp_rank}")
        except BaseException:
            region.close()
            raise
        return cls(layout, region, transfer, loop)

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._submit(job_id, True, src_spec, dst_spec)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        # ``expedited`` is vLLM 0.33's (a load it wants ahead of others); 0.32
        # never passes it. kvtier's loads run in submission order on a thread
        # and stream of their own, never behind stores, so there is no queue
        # to jump: accepted so that one code path serves both.
        self._submit(job_id, False, dst_spec, src_spec)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            self._lock.wait_for(lambda: job_ids <= self._done_ids or self._closed)

    def shutdown(self) -> None:
        if self._closed:
            return
        try:
            self._loop.run(self._xfer.aclose(), timeout=60.0)
        finally:
            self._loop.stop()
            self._region.close()
            with self._lock:
                self._closed = True
                self._lock.notify_all()

    def _submit(self, job: int, store: bool, gpu: GPULoadStoreSpec, rows: LoadStoreSpec) -> None:
        t0 = time.perf_counter()
        ids = np.asarray(gpu.block_ids, dtype=np.int64)
        nbytes = len(ids) * self._layout.bytes_per_block
        stream = None
        if self._cuda:  # pragma: no cover - needs a GPU
            import torch

            stream = torch.cuda.current_stream()
        self._loop.soon(self._start, job, store, gpu, rows, stream, nbytes, t0)

    def _start(
        self,
        job: int,
        store: bool,
        gpu: GPULoadStoreSpec,
        rows: LoadStoreSpec,
        stream: Any,
        nbytes: int,
        t0: float,
    ) -> None:
        try:
            parts = group_segments(gpu, rows, self._bpc, store=store)
            comps = []
            with _on_stream(stream):
                for ids, part_rows, skip in parts:
                    group = {g: ids for g in self._layout.groups}
                    comps.append(
                        self._xfer.store(group, part_rows)
                        if store
                        else self._xfer.load(part_rows, group, skip)
                    )
        except Exception:
            # Segments already queued still copy; the job fails (vLLM then
            # treats its blocks as lost) and nothing reuses them meanwhile.
            log.exception("kvtier could not start job %d", job)
            self._finish(job, False, nbytes, t0)
            return
        if not comps:
            self._finish(job, True, nbytes, t0)
            return
        left = [len(comps)]
        failed: list[BaseException] = []

        def done(c: Completion[None]) -> None:
            if (exc := c.exception()) is not None:
                failed.append(exc)
            left[0] -= 1
            if left[0]:
                return
            if failed:
                log.error("kvtier job %d failed: %s", job, failed[0])
            self._finish(job, not failed, nbytes, t0)

        for comp in comps:
            comp.add_done_callback(done)

    def _finish(self, job: int, ok: bool, nbytes: int, t0: float) -> None:
        with self._lock:
            self._finished.append(TransferResult(job, ok, nbytes, time.perf_counter() - t0))
            self._done_ids.add(job)
            self._lock.notify_all()
