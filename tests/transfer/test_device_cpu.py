"""The CPU backend of the device copier runs the whole conformance suite.

It runs it three ways: the compiled loop (``kvtier.transfer._copy``), the same
split over helper threads, and the Python loop used where the module is not
built; the CUDA backend's fallback (one ``Tensor.copy_`` per piece) runs it on
CPU tensors too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from kvtier.errors import InvalidArgumentError, TransferError
from kvtier.layout import KVLayout
from kvtier.testing.device import DeviceTransferSuite, HostRows, reference_row
from kvtier.transfer._copier import CopyPlan, _Copier, native
from kvtier.transfer._cpu_copy import CpuCopier
from kvtier.transfer._cuda_copy import CudaCopier, TorchGatherCopier, TorchPiecesCopier
from kvtier.transfer.device import (
    DeviceTransfer,
    _ThreadedTransfer,
    open_device_transfer,
)


class TestCpuBackend(DeviceTransferSuite):
    backend = "cpu"
    device = "cpu"
    contiguous_pieces_only = True

    def test_the_compiled_loop_is_built(self) -> None:
        assert native is not None, "kvtier.transfer._copy is not built (make builds it)"
        assert CpuCopier().compiled


class _ConfiguredCopier(DeviceTransferSuite):
    """The suite over a copier of the class's making."""

    backend = "cpu"
    device = "cpu"
    contiguous_pieces_only = True
    copier: ClassVar[Callable[[], _Copier]]

    def open_transfer(
        self, layout: KVLayout, kv: list[torch.Tensor], views: list[torch.Tensor]
    ) -> DeviceTransfer:
        return _ThreadedTransfer(layout, kv, views, type(self).copier())


class TestCpuBackendOverHelperThreads(_ConfiguredCopier):
    """Every request, however small, dealt out over the worker and two helpers."""

    copier = staticmethod(lambda: CpuCopier(threads=3, split_bytes=1))


class TestCpuBackendPythonLoop(_ConfiguredCopier):
    """What runs where the compiled module is not built: a slice per piece, with helpers."""

    copier = staticmethod(lambda: CpuCopier(threads=2, split_bytes=1, native=False))


class TestTorchViewsInContiguousPieces(_ConfiguredCopier):
    """What the CUDA backend falls back to (torch views, a copy per piece), run on CPU."""

    copier = TorchPiecesCopier


class _GatherCounts:
    """A gathering copier counts a copy per row and per tensor per round of staging rows."""

    gather_rounds: ClassVar[int]
    """Rounds of staging rows the five rows of the store below take."""

    async def test_consecutive_blocks_coalesce_into_one_copy_per_tensor(self, opened: Any) -> None:
        xfer, layout, _kv, _host = opened("kv-first", 2)
        await xfer.store(np.arange(2, 12), [3, 4, 5, 6, 7])
        assert xfer.statistics().copies_issued == 5 + len(layout.tensors) * self.gather_rounds
        await xfer.aclose()


class TestGatherThroughStagingRows(_GatherCounts, _ConfiguredCopier):
    """The CUDA backend's gather mode on CPU: one row of staging, so a round per row."""

    copier = staticmethod(lambda: TorchGatherCopier(staging_bytes=1))
    gather_rounds = 5


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the cuda backend needs one"
)


@pytest.mark.gpu
@needs_cuda
class TestCudaBackend(_GatherCounts, DeviceTransferSuite):  # pragma: no cover - needs a GPU
    """The default (auto): the suite's pieces are small, so it gathers through staging."""

    backend = "cuda"
    device = "cuda"
    gather_rounds = 1


@pytest.mark.gpu
@needs_cuda
class TestCudaBackendBatch(_ConfiguredCopier):  # pragma: no cover - needs a GPU
    """Every piece queued as it is, in cudaMemcpyBatchAsync calls."""

    backend = "cuda"
    device = "cuda"
    copier = staticmethod(lambda: CudaCopier("cuda", mode="batch"))


class _BrokenCopier(CpuCopier):
    """A copier whose hardware fails half way (the seam every backend plugs into)."""

    def run(self, plan: CopyPlan, marker: object) -> tuple[int, Callable[[], None] | None]:
        spans = plan.spans.copy()
        spans[len(spans) // 2 :] = 0  # the first half of the tensors only
        super().run(dataclasses.replace(plan, spans=spans), marker)
        raise RuntimeError("simulated device fault")


async def test_a_failing_copy_is_a_typed_error_with_its_cause() -> None:
    kv = [torch.zeros(2, 8, 64, dtype=torch.float16)]
    layout = KVLayout.from_tensors(kv, model_id="m", block_tokens=4, num_blocks=8)
    host = HostRows.for_layout(layout, rows=4)
    xfer = _ThreadedTransfer(layout, kv, host.views, _BrokenCopier())
    with pytest.raises(TransferError, match="simulated device fault") as info:
        await xfer.store([0, 1, 2], [0, 1, 2])
    assert isinstance(info.value.__cause__, RuntimeError)
    st = xfer.statistics()
    assert (st.failures, st.stores, st.in_flight) == (1, 0, 0)
    with pytest.raises(TransferError):  # every later request fails typed too, no hang
        await xfer.load([0], [5])
    assert xfer.statistics().failures == 2
    await xfer.aclose()


class _DeferredCopier(CpuCopier):
    """Copies like the CPU backend but reports completion later, the way a stream
    and its event do: exercises the waiter thread the CUDA backend relies on."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.release = threading.Event()

    def run(self, plan: CopyPlan, marker: object) -> tuple[int, Callable[[], None] | None]:
        copies, _ = super().run(plan, marker)

        def wait() -> None:
            self.release.wait(timeout=10)
            if self.fail:
                raise RuntimeError("simulated event error")

        return copies, wait


@pytest.mark.parametrize("fail", [False, True], ids=["ok", "event-error"])
async def test_completion_waits_for_the_copier_to_report_done(fail: bool) -> None:
    kv = [torch.arange(8 * 64, dtype=torch.float16).reshape(8, 64)]
    layout = KVLayout.from_tensors(kv, model_id="m", block_tokens=4, num_blocks=8)
    host = HostRows.for_layout(layout, rows=4)
    copier = _DeferredCopier(fail)
    xfer = _ThreadedTransfer(layout, kv, host.views, copier)
    first, second = xfer.store([0], [0]), xfer.store([1], [1])
    await asyncio.sleep(0.05)
    assert not first.done(), "resolved before the copier said done"
    assert not second.done()
    assert xfer.statistics().in_flight == 2
    copier.release.set()
    for done in (first, second):
        if fail:
            with pytest.raises(TransferError, match="simulated event error") as info:
                await done
            assert isinstance(info.value.__cause__, RuntimeError)
        else:
            await done
    st = xfer.statistics()
    assert (st.stores, st.failures, st.in_flight) == ((0, 2, 0) if fail else (2, 0, 0))
    await xfer.aclose()


def test_a_copy_finishing_after_its_loop_closed_is_harmless() -> None:
    kv = [torch.zeros(8, 64, dtype=torch.float16)]
    layout = KVLayout.from_tensors(kv, model_id="m", block_tokens=4, num_blocks=8)
    host = HostRows.for_layout(layout, rows=4)
    copier = _DeferredCopier()
    xfer = _ThreadedTransfer(layout, kv, host.views, copier)

    async def submit() -> None:
        xfer.store([0], [0])  # never awaited: its loop goes away first

    errors: list[threading.ExceptHookArgs] = []
    previous, threading.excepthook = threading.excepthook, errors.append
    try:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(submit())
        loop.close()
        copier.release.set()
        # No loop is left to close it: stop its threads the way aclose does,
        # once the waiter has finished the store (it runs the queue in order).
        for q in xfer._queues.values():
            q.put(None)
        for t in xfer._threads:
            t.join(timeout=10)
            assert not t.is_alive()
    finally:
        threading.excepthook = previous
    assert not errors


async def test_tensors_by_name_and_backend_choice() -> None:
    kv = {"k": torch.zeros(2, 8, 16, dtype=torch.float16), "b": torch.ones(8, 4)}
    layout = KVLayout.from_tensors(kv, model_id="m", block_tokens=4, num_blocks=8)
    host = HostRows.for_layout(layout, rows=4)
    xfer = open_device_transfer(layout, dict(reversed(kv.items())), host.views)
    assert xfer.backend == "cpu"
    assert xfer.statistics().backend == "cpu"
    await xfer.store([1, 2], [3, 0])
    assert bytes(host.row(0)[: layout.bytes_per_chunk].numpy()) == reference_row(
        layout, list(kv.values()), [2]
    )
    await xfer.aclose()
    with pytest.raises(InvalidArgumentError, match="cannot copy"):
        open_device_transfer(layout, kv, host.views, backend="cuda")
    with pytest.raises(InvalidArgumentError, match="backend must be"):
        open_device_transfer(layout, kv, host.views, backend="tpu")  # type: ignore[arg-type]


class _PoisonedCopier(CpuCopier):
    """Splits every request over helpers; the share of helper 1 fails."""

    def __init__(self) -> None:
        super().__init__(threads=3, split_bytes=1)

    def _copy_part(self, plan: CopyPlan, part: int, parts: int) -> None:
        if part == 1:
            raise ValueError("assignment destination is read-only (simulated)")
        super()._copy_part(plan, part, parts)


async def test_a_piece_failing_on_a_helper_fails_the_request_typed() -> None:
    kv = [torch.ones(2, 8, 64, dtype=torch.float16), torch.ones(8, 32, dtype=torch.float16)]
    layout = KVLayout.from_tensors(kv, model_id="m", block_tokens=4, num_blocks=8)
    host = HostRows.for_layout(layout, rows=4)
    xfer = _ThreadedTransfer(layout, kv, host.views, _PoisonedCopier())
    for _ in range(3):  # and the helpers are still there for the next request
        with pytest.raises(TransferError, match="read-only") as info:
            await xfer.store([0, 1, 2], [0, 1, 2])
        assert isinstance(info.value.__cause__, ValueError)
    assert xfer.statistics().failures == 3
    assert xfer.statistics().in_flight == 0
    await xfer.aclose()


class _StrayCopier(CpuCopier):
    """Moves the last piece of every plan one row past the end of the rows."""

    def run(self, plan: CopyPlan, marker: object) -> tuple[int, Callable[[], None] | None]:
        pieces = plan.pieces.copy()
        pieces[-1, 0] = plan.tensors.table[0, 6]
        return super().run(dataclasses.replace(plan, pieces=pieces), marker)


@pytest.mark.skipif(native is None, reason="kvtier.transfer._copy is not built")
async def test_a_plan_outside_its_rows_is_refused_before_a_byte_moves() -> None:
    kv = [torch.ones(2, 8, 64, dtype=torch.float16)]
    layout = KVLayout.from_tensors(kv, model_id="m", block_tokens=4, num_blocks=8)
    host = HostRows.for_layout(layout, rows=4)
    xfer = _ThreadedTransfer(layout, kv, host.views, _StrayCopier())
    with pytest.raises(TransferError, match="outside the tensor or its rows") as info:
        await xfer.store([0, 1, 2], [0, 1, 2])
    assert isinstance(info.value.__cause__, ValueError)
    assert not host.buffer.any(), "a byte moved"
    await xfer.aclose()
