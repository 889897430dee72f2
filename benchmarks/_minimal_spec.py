"""A minimal in-memory ``OffloadingSpec`` for vLLM 0.32: a perfect tier behind vLLM's machinery.

``benchmarks/vllm_ttft.py`` serves the same requests through it as through
kvtier, so that what vLLM's offloading machinery costs (the connector, the
scheduler's steps, a load's job handed to the worker and noticed when done)
is measured apart from what a tier costs. It holds nothing but what that
needs:

- the manager (scheduler side) maps each offloaded key to a slot number, in
  a dict; every block it was asked to store is kept (no capacity, no
  eviction), a lookup is a dict lookup;
- the worker (the process that holds vLLM's KV tensors) keeps each slot's
  bytes as a dict of tensors, one per KV tensor, and copies one block per
  tensor with ``Tensor.copy_``, synchronously in ``submit_*``; the job is
  reported done at the next ``get_finished``.

The bytes live only in the worker, so the spec works whether vLLM runs its
scheduler and worker in one process or in two: the manager hands the worker
slot numbers, never bytes. One KV cache group and one vLLM block per
offloaded block (``blocks_per_chunk`` 1), as the benchmark's Llama has.

Enable it with ``kv_connector="OffloadingConnector"`` and
``kv_connector_extra_config={"spec_name": "MinimalSpec", "spec_module_path":
"_minimal_spec"}``, with ``benchmarks/`` on ``PYTHONPATH`` in vLLM's
processes.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

import torch
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)


class SlotsSpec(BlockIDsLoadStoreSpec):  # type: ignore[misc]
    """The worker's slot of each offloaded block of a job."""


class DictManager(OffloadingManager):  # type: ignore[misc]
    """Scheduler side: which keys have a slot, and which slots are written."""

    def __init__(self) -> None:
        self._slots: dict[OffloadKey, int] = {}
        self._ready: set[OffloadKey] = set()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self._ready else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> SlotsSpec:
        return SlotsSpec([self._slots[k] for k in keys])

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput:
        new = [k for k in keys if k not in self._slots]
        for k in new:
            self._slots[k] = len(self._slots)
        return PrepareStoreOutput(new, SlotsSpec([self._slots[k] for k in new]), [])

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        if success:
            self._ready.update(keys)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()


class DictWorker(OffloadingWorker):  # type: ignore[misc]
    """Worker side: a dict of tensors per slot; one ``copy_`` per block and tensor."""

    def __init__(self, kv_caches: CanonicalKVCaches) -> None:
        self._tensors: list[torch.Tensor] = [t.tensor for t in kv_caches.tensors]
        self._store: dict[int, list[torch.Tensor]] = {}
        self._finished: list[TransferResult] = []

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        t0 = time.perf_counter()
        nbytes = 0
        for block, slot in zip(
            src_spec.block_ids.tolist(), dst_spec.block_ids.tolist(), strict=True
        ):
            saved = [t[block].clone() for t in self._tensors]
            self._store[slot] = saved
            nbytes += sum(s.nbytes for s in saved)
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        t0 = time.perf_counter()
        nbytes = 0
        for slot, block in zip(
            src_spec.block_ids.tolist(), dst_spec.block_ids.tolist(), strict=True
        ):
            for t, saved in zip(self._tensors, self._store[slot], strict=True):
                t[block].copy_(saved)
                nbytes += saved.nbytes
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def get_finished(self) -> list[TransferResult]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Every job is done when ``submit_*`` returns."""


class MinimalSpec(OffloadingSpec):  # type: ignore[misc]
    """vLLM's ``OffloadingSpec``: :class:`DictManager` and :class:`DictWorker`."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if self.blocks_per_chunk != 1 or len(config.groups) != 1:
            raise ValueError("MinimalSpec serves one KV cache group, one vLLM block per key")
        self._manager: DictManager | None = None
        self._worker: DictWorker | None = None

    def get_manager(self) -> DictManager:
        if self._manager is None:
            self._manager = DictManager()
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> DictWorker:
        if self._worker is None:
            self._worker = DictWorker(kv_caches)
        return self._worker
