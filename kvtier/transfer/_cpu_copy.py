"""The CPU backend of :mod:`kvtier.transfer.device`: memcpy on worker threads.

The "device" tensors are CPU tensors (tests, CI, machines without a GPU). The
transfer's worker thread plans a request (every piece contiguous on both
sides) and copies it in one call of the compiled loop, which releases the GIL;
large requests are shared, by bytes, with a helper thread per direction.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any

from kvtier.transfer import _copier
from kvtier.transfer._copier import CopyPlan, _Copier, copy_pieces

__all__ = ["CpuCopier"]


_SPLIT_BYTES = 4 << 20
"""Requests smaller than this are copied by the worker thread alone."""


def _assign(dst: Any, src: Any) -> None:
    dst[...] = src


class CpuCopier(_Copier):
    """Copies with memcpy on the worker thread, and on helper threads when large.

    The compiled loop (``kvtier.transfer._copy.copy_host``) runs a request's
    pieces without the GIL at what memcpy costs per piece; the Python loop,
    used where it is not built (or with ``native=False``), costs a few
    microseconds per piece (the numpy copies per strided run it replaced held
    scattered block ids to 0.26-0.71x a contiguous copy). For a request of at
    least ``split_bytes``, helper threads (one per direction by default) each
    copy an equal share of its bytes while the worker copies the first.
    """

    name = "cpu"
    numpy_views = True

    def __init__(
        self, threads: int | None = None, split_bytes: int = _SPLIT_BYTES, *, native: bool = True
    ) -> None:
        self._threads = threads or min(2, os.cpu_count() or 1)
        self._split_bytes = split_bytes
        compiled = _copier.native
        self._copy_host = compiled.copy_host if native and compiled is not None else None
        # One pool per direction: a long store must not hold up a load's helper.
        self._pools: dict[bool, concurrent.futures.ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    @property
    def compiled(self) -> bool:
        """Whether requests run through the compiled loop (else one slice per piece)."""
        return self._copy_host is not None

    def mark(self) -> object:
        return None

    def run(self, plan: CopyPlan, marker: object) -> tuple[int, Callable[[], None] | None]:
        parts = self._threads if plan.nbytes >= self._split_bytes else 1
        if parts < 2:
            self._copy_part(plan, 0, 1)
            return plan.copies, None
        with self._lock:
            pool = self._pools.get(plan.store)
            if pool is None:
                pool = self._pools[plan.store] = concurrent.futures.ThreadPoolExecutor(
                    parts - 1, thread_name_prefix=f"kvtier-cpu-copy-{plan.store:d}"
                )
        helpers = [pool.submit(self._copy_part, plan, i, parts) for i in range(1, parts)]
        try:
            self._copy_part(plan, 0, parts)
        finally:
            # Whatever happens, every share handed out is finished before the
            # request completes: the rows and blocks are the caller's again then.
            concurrent.futures.wait(helpers)
        for h in helpers:
            h.result()
        return plan.copies, None

    def _copy_part(self, plan: CopyPlan, part: int, parts: int) -> None:
        """Copy share ``part`` of ``parts`` of the plan (the seam tests inject faults at)."""
        if self._copy_host is not None:
            self._copy_host(plan.tensors.table, plan.pieces, plan.spans, plan.store, part, parts)
        else:
            copy_pieces(plan, _assign, part, parts)

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)
