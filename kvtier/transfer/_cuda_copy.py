"""The CUDA backend of :mod:`kvtier.transfer.device`: streams, events, pinned rows.

A request's pieces (contiguous on both sides, so each is one DMA between
device memory and the pinned region) are queued on the direction's stream by
the compiled loop ``kvtier.transfer._copy.cuda_copy``: one
``cudaMemcpyBatchAsync`` per 8192 pieces where the CUDA runtime has it (12.8
and later), else one ``cudaMemcpyAsync`` per piece, either way without the GIL
and without Python per piece. The runtime is loaded at run time, so kvtier
installs and imports without CUDA; where the compiled module or a runtime is
missing, one ``Tensor.copy_`` per piece is the fallback.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from kvtier.errors import ConfigurationError
from kvtier.transfer import _copier
from kvtier.transfer._copier import CopyPlan, _Copier, copy_pieces

__all__ = [
    "CudaCopier",
    "Mode",
    "TorchPiecesCopier",
    "copy_pieces_torch",
    "cudart_candidates",
    "load_cudart",
]

Mode = Literal["auto", "batch", "loop", "torch"]
"""How :class:`CudaCopier` issues a plan: ``batch`` (``cudaMemcpyBatchAsync``,
the loop where the runtime lacks it), ``loop`` (``cudaMemcpyAsync`` per piece),
``torch`` (``Tensor.copy_`` per piece, from Python), ``auto`` (``batch`` where
the compiled module and a runtime load, else ``torch``)."""


def _non_blocking(dst: Any, src: Any) -> None:
    dst.copy_(src, non_blocking=True)


def copy_pieces_torch(plan: CopyPlan) -> None:
    """Queue a plan's pieces one ``Tensor.copy_`` each (torch views of the plan's tensors).

    The fallback of :class:`CudaCopier`: on the current stream, ``non_blocking``,
    each piece contiguous on both sides, so each is a single ``cudaMemcpyAsync``
    between device memory and the pinned region (a strided copy would stage
    through pageable memory and turn synchronous).
    """
    copy_pieces(plan, _non_blocking)


class TorchPiecesCopier(_Copier):
    """:func:`copy_pieces_torch` on the calling thread, without streams or events.

    The loop of :class:`CudaCopier`'s ``torch`` mode alone, for CPU tensors:
    tests and ``benchmarks/gpu/check.py`` check its bytes where there is no GPU.
    """

    name = "torch-pieces"

    def mark(self) -> object:
        return None

    def run(self, plan: CopyPlan, marker: object) -> tuple[int, Callable[[], None] | None]:
        copy_pieces_torch(plan)
        return plan.copies, None


def cudart_candidates() -> list[str]:
    """CUDA runtime libraries to try, best first.

    The one this process already mapped comes first (torch links one: copies
    then go through the same runtime as torch's streams and events), then the
    ones torch ships beside itself, then the loader's usual names.
    """
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart.so" in path:
                    found.append(path)
    except OSError:  # pragma: no cover - /proc is always there on Linux
        pass
    try:
        import torch

        root = Path(torch.__file__).parent
        found += sorted(str(p) for p in (root / "lib").glob("libcudart.so*"))
        found += sorted(str(p) for p in root.parent.glob("nvidia/*/lib/libcudart.so*"))
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    found += ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    return list(dict.fromkeys(found))


def load_cudart() -> tuple[str, int]:
    """Load a CUDA runtime into the compiled module once: its path and version.

    Raises
    ------
    ConfigurationError
        The compiled module is not built, or no candidate loads (every
        ``dlopen`` error is in the message; the last is the cause).
    """
    compiled = _copier.native
    if compiled is None:
        raise ConfigurationError("kvtier.transfer._copy is not built (no C compiler at install)")
    status = compiled.cuda_status()
    if status:
        return str(status["path"]), int(str(status["version"]))
    errors: list[str] = []
    last: OSError | None = None
    for path in cudart_candidates():
        try:
            version = compiled.cuda_load(path)
        except OSError as exc:
            errors.append(str(exc))
            last = exc
            continue
        return path, version
    raise ConfigurationError("no CUDA runtime could be loaded: " + "; ".join(errors)) from last


class CudaCopier(_Copier):  # pragma: no cover - needs a GPU
    """Copies on one dedicated stream per direction; completion is a CUDA event.

    The request's worker thread queues the copies and records an event; a
    waiter thread per direction blocks in ``Event.synchronize`` and then
    resolves the completion. Blocking a thread that does nothing else costs no
    CPU and adds no polling latency, keeps the event loop free, and lets the
    worker issue the next request while the copy engine is still busy.

    Parameters
    ----------
    device
        The torch device of the KV tensors.
    mode
        How the pieces are queued (:data:`Mode`).

    Raises
    ------
    ConfigurationError
        ``mode`` is ``batch`` or ``loop`` and the compiled module or a CUDA
        runtime cannot be loaded.
    """

    name = "cuda"

    def __init__(self, device: Any, mode: Mode = "auto") -> None:
        import torch

        self._torch = torch
        self._device = torch.device(device)
        self._index = (
            self._device.index if self._device.index is not None else torch.cuda.current_device()
        )
        self._streams = {
            True: torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
            False: torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
        }
        self.mode: Mode = mode
        self.runtime = "none"
        if mode != "torch":
            try:
                path, version = load_cudart()
            except ConfigurationError as exc:
                if mode != "auto":
                    raise
                self.mode, self.runtime = "torch", f"none ({exc})"
            else:
                self.mode = "batch" if mode == "auto" else mode
                self.runtime = f"{os.path.basename(path)} {version // 1000}.{version % 1000 // 10}"
        self._cuda_copy = _copier.native.cuda_copy if _copier.native is not None else None

    def describe(self) -> str:
        """The mode in use and the runtime it calls (for logs and benchmarks)."""
        status = _copier.native.cuda_status() if _copier.native is not None else {}
        batch = "" if self.mode != "batch" else f", runtime batches: {status.get('batch')}"
        failed = status.get("batch_error")
        return f"{self.mode} via {self.runtime}{batch}" + (
            f" (batch refused with error {failed}: looping)" if failed else ""
        )

    def mark(self) -> object:
        # Recorded where the caller submits, on the caller's current (compute)
        # stream: everything the model queued before this request (its writes
        # to these blocks) is before the event. ``stream.wait_stream`` called
        # later on the worker thread would see that thread's current stream.
        event = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._torch.cuda.current_stream(self._device))
        return event

    def run(self, plan: CopyPlan, marker: object) -> tuple[int, Callable[[], None] | None]:
        torch = self._torch
        stream = self._streams[plan.store]
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            # A store must not read blocks before the model's writes to them;
            # a load must not overwrite blocks that work queued before it may
            # still read (the blocks it was handed were free a moment ago).
            stream.wait_event(marker)  # type: ignore[arg-type]
            if self.mode == "torch" or self._cuda_copy is None:
                copy_pieces_torch(plan)
                copies = plan.copies
            else:
                t = plan.tensors
                copies = self._cuda_copy(
                    t.table,
                    plan.pieces,
                    plan.spans,
                    plan.store,
                    stream.cuda_stream,
                    self._index,
                    self.mode == "batch",
                )
            done = torch.cuda.Event()
            done.record(stream)
        return copies, done.synchronize
