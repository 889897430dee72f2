"""What only the CUDA backend promises: stream ordering and DMA-sized pieces.

The conformance suite runs on CUDA from ``test_device_cpu.py``; these tests
need a GPU and skip cleanly without one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.layout import KVLayout
from kvtier.testing.device import HostRows
from kvtier.transfer._cuda_copy import CudaCopier, Mode
from kvtier.transfer.device import DeviceTransfer, _ThreadedTransfer, open_device_transfer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device: the cuda backend needs one"
    ),
]

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time queued ahead of the model's write


def _open(bpc: int = 1, mode: Mode | None = None) -> tuple[DeviceTransfer, torch.Tensor, HostRows]:
    kv = torch.zeros(2, 16, 4, 64, dtype=torch.float16, device="cuda")
    layout = KVLayout.from_tensors(
        [kv], model_id="m", block_tokens=4, blocks_per_chunk=bpc, kv_first=True
    )
    host = HostRows.for_layout(layout, rows=8, pin=True)
    if mode is not None:
        copier = CudaCopier(kv.device, mode=mode)
        return _ThreadedTransfer(layout, [kv], host.views, copier), kv, host
    return open_device_transfer(layout, [kv], host.views, backend="cuda"), kv, host


async def test_a_store_reads_blocks_after_the_model_wrote_them() -> None:  # pragma: no cover
    xfer, kv, host = _open()
    torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]  # the model is busy...
    kv[:, 3].fill_(7.0)  # ...then writes block 3, all on its (current) stream
    await xfer.store([3], [0])
    want = torch.full((2, 4, 64), 7.0, dtype=torch.float16).view(torch.uint8).flatten()
    assert torch.equal(host.views[0][0], want)
    await xfer.aclose()


async def test_a_load_lands_after_work_queued_before_it() -> None:  # pragma: no cover
    xfer, kv, host = _open()
    host.views[0][2].fill_(0x3C)  # 0x3C3C as fp16 is 1.0586
    torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
    kv.zero_()  # queued before the load: must not clobber what the load writes
    await xfer.load([2], [5])
    got = kv[:, 5].contiguous().view(torch.uint8).flatten().cpu()
    assert bool((got == 0x3C).all())
    await xfer.aclose()


async def test_copies_are_contiguous_pieces() -> None:  # pragma: no cover
    xfer, _kv, _host = _open(bpc=2, mode="batch")
    await xfer.store(np.arange(6), [0, 1, 2])
    # Host rows are strided and K and V are apart on the device: one copy per
    # row and half, each a single DMA between pinned and device memory.
    assert xfer.statistics().copies_issued == 3 * 2
    await xfer.aclose()


async def test_small_pieces_go_through_staging_rows() -> None:  # pragma: no cover
    xfer, kv, host = _open(bpc=2)  # auto: 1 KiB pieces, far under GATHER_BELOW
    kv.copy_(torch.arange(kv.numel(), dtype=torch.int64).view_as(kv).to(torch.float16))
    await xfer.store(np.arange(6), [0, 1, 2])
    # A gather of the one tensor into three staging rows, then a DMA per row.
    assert xfer.statistics().copies_issued == 1 + 3
    raw = kv.view(torch.uint8).cpu()
    for row in range(3):
        want = torch.cat([raw[h, 2 * row : 2 * row + 2].flatten() for h in (0, 1)])
        assert torch.equal(host.views[0][row], want)
    await xfer.aclose()
