"""The CUDA backend of :mod:`kvtier.transfer.device`: streams, events, pinned rows."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvtier.transfer._copier import _Copier

__all__ = ["CudaCopier", "contiguous_parts"]


def contiguous_parts(dst: Any, src: Any, out: list[tuple[Any, Any]]) -> None:
    """Split a strided copy into copies contiguous on both sides (appended to ``out``).

    ``Tensor.copy_`` between a CUDA tensor and a non-contiguous CPU tensor
    stages through a contiguous temporary in pageable memory, which makes a
    ``non_blocking`` copy synchronous and costs an extra pass. Pieces that are
    contiguous on both sides are single ``cudaMemcpyAsync`` calls between device
    memory and the pinned region.
    """
    if dst.is_contiguous() and src.is_contiguous():
        out.append((dst, src))
        return
    for i in range(dst.shape[0]):
        contiguous_parts(dst[i], src[i], out)


class CudaCopier(_Copier):  # pragma: no cover - needs a GPU
    """Copies on one dedicated stream per direction; completion is a CUDA event.

    The request's worker thread issues the copies and records an event; a
    waiter thread per direction blocks in ``Event.synchronize`` and then
    resolves the completion. Blocking a thread that does nothing else costs no
    CPU and adds no polling latency, keeps the event loop free, and lets the
    worker issue the next request while the copy engine is still busy.
    """

    name = "cuda"

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self._device = device
        self._streams = {
            True: torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
            False: torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
        }

    def mark(self) -> object:
        # Recorded where the caller submits, on the caller's current (compute)
        # stream: everything the model queued before this request (its writes
        # to these blocks) is before the event. ``stream.wait_stream`` called
        # later on the worker thread would see that thread's current stream.
        event = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._torch.cuda.current_stream(self._device))
        return event

    def run(
        self, store: bool, batches: Iterable[list[tuple[Any, Any]]], marker: object, nbytes: int
    ) -> tuple[int, Callable[[], None] | None]:
        torch = self._torch
        stream = self._streams[store]
        parts: list[tuple[Any, Any]] = []
        for batch in batches:
            for dst, src in batch:
                contiguous_parts(dst, src, parts)
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            # A store must not read blocks before the model's writes to them;
            # a load must not overwrite blocks that work queued before it may
            # still read (the blocks it was handed were free a moment ago).
            stream.wait_event(marker)  # type: ignore[arg-type]
            for dst, src in parts:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return len(parts), done.synchronize
