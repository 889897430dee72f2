"""The CPU backend of :mod:`kvtier.transfer.device`: numpy copies on worker threads.

The "device" tensors are CPU tensors (tests, CI, machines without a GPU). The
transfer's worker thread builds numpy views of every piece and copies them;
large requests are shared with a helper thread per direction.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

from kvtier.transfer._copier import _Copier

__all__ = ["CpuCopier"]


_SPLIT_BYTES = 4 << 20
"""Requests smaller than this are copied by the worker thread alone."""


def _copy_all(pairs: list[tuple[Any, Any]]) -> None:
    for dst, src in pairs:
        dst[...] = src


class CpuCopier(_Copier):
    """Copies with numpy on the worker thread, and on a helper thread when large.

    numpy's strided copy releases the GIL and costs about 4.6 us per 64 KiB
    piece here against 9.3 us for ``Tensor.copy_`` (measured with 256 scattered
    pieces), and its slicing is ten times cheaper than torch's, which is what
    dominates when device ids are scattered. For a request of at least
    ``split_bytes``, helper threads (one per direction by default) copy the
    pieces of each tensor while the worker is still building the next
    tensor's, then the worker joins in: building the views is Python (it holds
    the GIL), copying is not, so the two overlap.
    """

    name = "cpu"

    def __init__(self, threads: int | None = None, split_bytes: int = _SPLIT_BYTES) -> None:
        self._threads = threads or min(2, os.cpu_count() or 1)
        self._split_bytes = split_bytes
        # One pool per direction: a long store must not hold up a load's helper.
        self._pools: dict[bool, concurrent.futures.ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def mark(self) -> object:
        return None

    def run(
        self, store: bool, batches: Iterable[list[tuple[Any, Any]]], marker: object, nbytes: int
    ) -> tuple[int, Callable[[], None] | None]:
        copies = 0
        if self._threads < 2 or nbytes < self._split_bytes:
            for batch in batches:
                _copy_all(batch)
                copies += len(batch)
            return copies, None
        with self._lock:
            pool = self._pools.get(store)
            if pool is None:
                pool = self._pools[store] = concurrent.futures.ThreadPoolExecutor(
                    self._threads - 1, thread_name_prefix=f"kvtier-cpu-copy-{store:d}"
                )
        work: queue.SimpleQueue[list[tuple[Any, Any]] | None] = queue.SimpleQueue()
        helpers = [pool.submit(_copy_batches, work) for _ in range(self._threads - 1)]
        try:
            for batch in batches:
                work.put(batch)
                copies += len(batch)
        finally:
            # Whatever happens, every piece handed out is finished before the
            # request completes: the rows and blocks are the caller's again then.
            for _ in range(len(helpers) + 1):  # after every batch: one per consumer
                work.put(None)
            try:
                _copy_batches(work)  # the worker copies what is left too
            finally:
                concurrent.futures.wait(helpers)
        for h in helpers:
            h.result()
        return copies, None

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)


def _copy_batches(work: queue.SimpleQueue[list[tuple[Any, Any]] | None]) -> None:
    """Copy batches from ``work`` until a ``None``: one is queued per consumer."""
    while (batch := work.get()) is not None:
        _copy_all(batch)
