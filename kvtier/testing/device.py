"""Conformance suite for :class:`~kvtier.transfer.device.DeviceTransfer` backends.

Subclass :class:`DeviceTransferSuite` once per backend and set ``backend`` and
``device``; pytest collects every test for it::

    class TestCpu(DeviceTransferSuite):
        backend = "cpu"
        device = "cpu"

Host rows are views of one padded buffer, exactly as a CPU region provides
them (:meth:`kvtier.region.CPURegion.tensor_views`); every byte that lands is
checked against a plain-Python reference of the row layout documented in
:class:`~kvtier.layout.KVLayout`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from kvtier.errors import ClosedError, InvalidArgumentError, LayoutError
from kvtier.layout import KVLayout
from kvtier.transfer.device import DeviceTransfer, open_device_transfer

__all__ = ["DeviceTransferSuite", "HostRows", "reference_row"]

NUM_BLOCKS = 24
ROWS = 10
PAD = 4096

SHAPES: dict[str, list[tuple[tuple[int, ...], torch.dtype, int]]] = {
    # name -> [(shape, dtype, group)]
    "block-first": [((NUM_BLOCKS, 4, 16), torch.float16, 0)],
    "kv-first": [((2, NUM_BLOCKS, 3, 8), torch.float32, 0), ((2, NUM_BLOCKS, 5), torch.int16, 0)],
    "mixed": [((2, NUM_BLOCKS, 4, 4), torch.bfloat16, 0), ((NUM_BLOCKS, 7), torch.uint8, 0)],
    "two-groups": [((2, NUM_BLOCKS, 8), torch.float16, 0), ((NUM_BLOCKS, 6, 2), torch.float16, 1)],
}


@dataclass
class HostRows:
    """A padded row buffer and its per-tensor views, like a CPU region's."""

    buffer: torch.Tensor
    stride: int
    views: list[torch.Tensor]

    @classmethod
    def for_layout(cls, layout: KVLayout, rows: int = ROWS, *, pin: bool = False) -> HostRows:
        """Rows padded past ``bytes_per_chunk``; ``pin`` page-locks them, as for CUDA."""
        stride = -(-layout.bytes_per_chunk // PAD) * PAD + PAD  # room for padding to check
        buffer = torch.zeros(rows * stride, dtype=torch.uint8, pin_memory=pin)
        views = [
            torch.as_strided(
                buffer,
                (rows, t.bytes_per_block * layout.blocks_per_chunk),
                (stride, 1),
                layout.tensor_offset(i),
            )
            for i, t in enumerate(layout.tensors)
        ]
        return cls(buffer, stride, views)

    def row(self, i: int) -> torch.Tensor:
        return self.buffer[i * self.stride : (i + 1) * self.stride]


def reference_row(layout: KVLayout, kv: list[torch.Tensor], ids: list[int]) -> bytes:
    """One worker's slice of a row holding device blocks ``ids``, built byte by byte."""
    out = bytearray()
    for spec, t in zip(layout.tensors, kv, strict=True):
        raw = t.detach().cpu().view(torch.uint8)
        if spec.kv_first:
            for half in (0, 1):
                for b in ids:
                    out += raw[half, b].contiguous().numpy().tobytes()
        else:
            for b in ids:
                out += raw[b].contiguous().numpy().tobytes()
    return bytes(out)


def _random_kv(name: str, seed: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype, _group in SHAPES[name]:
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        out.append(raw.view(dtype).reshape(shape).to(device))
    return out


def _layout(name: str, kv: list[torch.Tensor], bpc: int) -> KVLayout:
    return KVLayout.from_tensors(
        kv,
        model_id="suite",
        block_tokens=4,
        blocks_per_chunk=bpc,
        num_blocks=NUM_BLOCKS,
        groups=[g for _s, _d, g in SHAPES[name]],
    )


class DeviceTransferSuite:
    """Every backend must pass these (real tensors, real threads or streams)."""

    backend: ClassVar[str]
    """What :func:`open_device_transfer` is asked for."""
    device: ClassVar[str]
    """Where the suite allocates the KV tensors."""
    contiguous_pieces_only: ClassVar[bool] = False
    """The backend cuts strided copies into pieces contiguous on both sides (CUDA)."""

    def open_transfer(
        self, layout: KVLayout, kv: list[torch.Tensor], views: list[torch.Tensor]
    ) -> DeviceTransfer:
        """Open the implementation under test; override to test a configured one."""
        backend: Any = self.backend
        return open_device_transfer(layout, kv, views, backend=backend)

    @pytest.fixture
    def opened(self) -> Any:
        def make(
            name: str = "mixed", bpc: int = 1, seed: int = 0
        ) -> tuple[DeviceTransfer, KVLayout, list[torch.Tensor], HostRows]:
            kv = _random_kv(name, seed, self.device)
            layout = _layout(name, kv, bpc)
            host = HostRows.for_layout(layout, pin=self.device == "cuda")
            return self.open_transfer(layout, kv, host.views), layout, kv, host

        return make  # each test closes what it opened (its worker threads are daemons)

    @pytest.mark.parametrize("name", sorted(SHAPES))
    @pytest.mark.parametrize("bpc", [1, 3])
    async def test_store_places_bytes_exactly_as_the_layout_says(
        self, opened: Any, name: str, bpc: int
    ) -> None:
        xfer, layout, kv, host = opened(name, bpc)
        rng = np.random.default_rng(1)
        rows = [7, 2, 3, 9][: min(4, NUM_BLOCKS // bpc)]
        ids = rng.permutation(NUM_BLOCKS)[: len(rows) * bpc]
        ids[:bpc] = np.arange(bpc)  # one run that is consecutive on both sides
        await xfer.store(ids, rows)
        for i, r in enumerate(rows):
            want = reference_row(
                layout, [t.cpu() for t in kv], ids[i * bpc : (i + 1) * bpc].tolist()
            )
            row = host.row(r)
            assert bytes(row[: len(want)].numpy()) == want
            assert not row[len(want) :].any(), "padding was written"
        untouched = set(range(ROWS)) - set(rows)
        assert all(not host.row(r).any() for r in untouched)
        await xfer.aclose()

    @pytest.mark.parametrize("name", sorted(SHAPES))
    @pytest.mark.parametrize("bpc", [1, 3])
    async def test_round_trip_with_every_skip(self, opened: Any, name: str, bpc: int) -> None:
        xfer, layout, kv, _ = opened(name, bpc)
        n = 3
        src = np.arange(n * bpc)
        await xfer.store(src, [4, 5, 6])
        originals = [t.clone() for t in kv]
        for skip in range(bpc):
            dst = np.arange(NUM_BLOCKS - (n * bpc - skip), NUM_BLOCKS)[::-1].copy()
            for t in kv:
                t.zero_()
            await xfer.load([4, 5, 6], dst, skip=skip)
            for spec, t, o in zip(layout.tensors, kv, originals, strict=True):
                for pos, d in enumerate(dst):
                    s = src[skip + pos]
                    got = _bytes(t[:, d] if spec.kv_first else t[d])
                    want = _bytes(o[:, s] if spec.kv_first else o[s])
                    assert got == want, (spec.name, skip, pos)
                untouched = sorted(set(range(NUM_BLOCKS)) - set(dst.tolist()))
                rest = t[:, untouched] if spec.kv_first else t[untouched]
                assert not rest.any(), "a load wrote device blocks it was not given"
        await xfer.aclose()

    async def test_groups_take_their_own_ids(self, opened: Any) -> None:
        xfer, layout, kv, host = opened("two-groups", 2)
        await xfer.store({0: [0, 1, 2, 3], 1: [10, 11, 20, 21]}, [0, 1])
        for row, (ids0, ids1) in enumerate((([0, 1], [10, 11]), ([2, 3], [20, 21]))):
            # Tensor 0 is in group 0, tensor 1 in group 1: each took its own ids.
            want = reference_row(layout, kv, ids0)[: layout.tensor_offset(1)]
            want += reference_row(layout, kv, ids1)[layout.tensor_offset(1) :]
            assert bytes(host.row(row)[: layout.bytes_per_chunk].numpy()) == want
        await xfer.aclose()

    async def test_consecutive_blocks_coalesce_into_one_copy_per_tensor(self, opened: Any) -> None:
        xfer, layout, _kv, _host = opened("kv-first", 2)
        n = len(layout.tensors)  # both K/V-first
        await xfer.store(np.arange(2, 12), [3, 4, 5, 6, 7])
        # Strided: one copy per tensor. Contiguous pieces: one per row and half.
        first = n * 5 * 2 if self.contiguous_pieces_only else n
        assert xfer.statistics().copies_issued == first
        await xfer.load([3, 4, 5, 6, 7], np.arange(12, 21), skip=1)
        # A skip makes a partial first row: one copy for it, one for the rest.
        second = n * (1 + 4) * 2 if self.contiguous_pieces_only else 2 * n
        assert xfer.statistics().copies_issued == first + second
        await xfer.aclose()

    @pytest.mark.parametrize(
        ("call", "message"),
        [
            (lambda x: x.store([0, 1, 2], [0, 1]), "expected 4"),
            (lambda x: x.store([0, 1, 2, 3], [0, 0]), "same row twice"),
            (lambda x: x.store([0, 1, 2, NUM_BLOCKS], [0, 1]), "in \\[0, 24\\)"),
            (lambda x: x.store([-1, 1, 2, 3], [0, 1]), "in \\[0, 24\\)"),
            (lambda x: x.store([0, 1, 2, 3], [0, ROWS]), "rows must be in"),
            (lambda x: x.store([0.5, 1, 2, 3], [0, 1]), "integers"),
            (lambda x: x.store({7: [0, 1]}, [0]), "unknown groups"),
            (lambda x: x.load([0, 1], [0, 1, 2], skip=2), "skip"),
            (lambda x: x.load([0, 1], [0, 1, 2], skip=-1), "skip"),
            (lambda x: x.load([0, 1], [0, 1, 2, 2]), "duplicate"),
            (lambda x: x.load([0, 1], [0, 1, 2]), "expected 4"),
            (lambda x: x.load([], [], skip=1), "skip"),
        ],
        ids=[
            "count",
            "dup-rows",
            "id-range",
            "negative",
            "row-range",
            "float",
            "group",
            "skip-big",
            "skip-neg",
            "dup-ids",
            "load-count",
            "skip-without-rows",
        ],
    )
    async def test_bad_requests_raise_before_anything_is_queued(
        self, opened: Any, call: Any, message: str
    ) -> None:
        xfer, _, _kv, host = opened("mixed", 2)
        with pytest.raises(InvalidArgumentError, match=message):
            call(xfer)
        assert xfer.statistics().in_flight == 0
        assert not host.buffer.any()
        await xfer.aclose()

    def test_mismatched_tensors_and_views_are_layout_errors(self) -> None:
        kv = _random_kv("mixed", 0, self.device)
        layout = _layout("mixed", kv, 1)
        host = HostRows.for_layout(layout, pin=self.device == "cuda")
        bad_kv: list[list[torch.Tensor]] = [
            kv[:1],
            [kv[0].float(), kv[1]],
            [kv[0], kv[1][:-1]],
            [kv[0].transpose(-1, -2), kv[1]],
            [kv[0], kv[1].to("meta")],
        ]
        for tensors in bad_kv:
            with pytest.raises(LayoutError):
                open_device_transfer(layout, tensors, host.views, backend=self.backend)  # type: ignore[arg-type]
        with pytest.raises(LayoutError):
            open_device_transfer(layout, kv, host.views[:1], backend=self.backend)  # type: ignore[arg-type]
        with pytest.raises(LayoutError):
            open_device_transfer(layout, kv, [v[:, 1:] for v in host.views], backend=self.backend)  # type: ignore[arg-type]
        with pytest.raises(LayoutError):
            open_device_transfer(layout, {"nope": kv[0]}, host.views, backend=self.backend)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        "spoil",
        [
            lambda v: v.view(torch.int8),
            lambda v: v.to(torch.float16),
            lambda v: v[0],
            lambda v: v[:, ::2],
            lambda v: v[:-1],
            lambda v: v[:1].expand(ROWS, -1),
        ],
        ids=["int8", "float16", "one-dim", "inner-stride", "fewer-rows", "rows-overlap"],
    )
    def test_host_views_of_the_wrong_kind_are_layout_errors(self, spoil: Any) -> None:
        kv = _random_kv("mixed", 0, self.device)
        layout = _layout("mixed", kv, 1)
        host = HostRows.for_layout(layout, pin=self.device == "cuda")
        views = [host.views[0], spoil(host.views[1])]
        with pytest.raises(LayoutError, match="host view"):
            open_device_transfer(layout, kv, views, backend=self.backend)  # type: ignore[arg-type]

    async def test_empty_requests_complete_at_once(self, opened: Any) -> None:
        xfer, _, _kv, host = opened("two-groups", 2)
        for done in (
            xfer.store([], []),
            xfer.store({0: [], 1: []}, np.zeros(0, dtype=np.int64)),
            xfer.load([], []),
        ):
            assert done.done()
            await done
        st = xfer.statistics()
        assert (st.stores, st.loads, st.copies_issued, st.in_flight) == (0, 0, 0, 0)
        assert not host.buffer.any()
        await xfer.aclose()

    async def test_a_store_and_a_load_in_flight_together(self, opened: Any) -> None:
        xfer, layout, kv, host = opened("kv-first", 2)
        await xfer.store(np.arange(8), [0, 1, 2, 3])
        before = [t.clone() for t in kv]
        # Rows 4..7 receive blocks 8..15 while rows 0..3 go back to blocks
        # 23..16 (disjoint: the caller owns what a request names until it is done).
        store = xfer.store(np.arange(8, 16), [4, 5, 6, 7])
        load = xfer.load([0, 1, 2, 3], np.arange(23, 15, -1))
        assert xfer.statistics().in_flight == 2
        await asyncio.gather(_wait(store), _wait(load))
        for r in range(4, 8):
            ids = list(range(8 + 2 * (r - 4), 10 + 2 * (r - 4)))
            want = reference_row(layout, [t.cpu() for t in before], ids)
            assert bytes(host.row(r)[: len(want)].numpy()) == want
        for spec, t, o in zip(layout.tensors, kv, before, strict=True):
            for pos, d in enumerate(range(23, 15, -1)):
                got = _bytes(t[:, d] if spec.kv_first else t[d])
                assert got == _bytes(o[:, pos] if spec.kv_first else o[pos]), (spec.name, d)
        await xfer.aclose()

    async def test_cancelled_awaiter_does_not_cancel_the_copy(self, opened: Any) -> None:
        xfer, layout, kv, host = opened("kv-first", 1)
        done = xfer.store(np.arange(ROWS), np.arange(ROWS))
        waiter = asyncio.ensure_future(_wait(done))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await _wait(done)
        assert bytes(host.row(9)[: layout.bytes_per_chunk].numpy()) == reference_row(
            layout, kv, [9]
        )
        await xfer.aclose()

    async def test_stores_and_loads_run_concurrently_and_in_order(self, opened: Any) -> None:
        xfer, layout, kv, _ = opened("block-first", 1)
        stores = [xfer.store([i], [i]) for i in range(ROWS)]
        await asyncio.gather(*(_wait(s) for s in stores))
        snapshot = kv[0].clone()
        loads = [xfer.load([i], [NUM_BLOCKS - 1 - i]) for i in range(ROWS)]
        await asyncio.gather(*(_wait(x) for x in loads))
        for i in range(ROWS):
            assert _bytes(kv[0][NUM_BLOCKS - 1 - i]) == _bytes(snapshot[i])
        st = xfer.statistics()
        assert (st.stores, st.loads, st.failures, st.in_flight) == (ROWS, ROWS, 0, 0)
        assert st.bytes_stored == st.bytes_loaded == ROWS * layout.bytes_per_chunk
        await xfer.aclose()

    async def test_aclose_waits_then_refuses(self, opened: Any) -> None:
        xfer, _, _kv, _host = opened("mixed", 1)
        pending = xfer.store(np.arange(ROWS), np.arange(ROWS))
        await asyncio.gather(xfer.aclose(), xfer.aclose())
        assert pending.done()
        assert xfer.statistics().in_flight == 0
        with pytest.raises(ClosedError):
            xfer.store([0], [0])
        with pytest.raises(ClosedError):
            xfer.load([0], [0])


def _bytes(t: torch.Tensor) -> bytes:
    """Raw bytes: random bit patterns include NaNs, which compare unequal as floats."""
    return bytes(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())


async def _wait(done: Any) -> None:
    await done
