"""Device block ids as the docs allow them: any flat integer sequence or array,
strided views included (issue 41); other dtypes are a typed error naming them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvtier import InvalidArgumentError, KVLayout, KVTierConfig, chain_keys
from kvtier.engine import Engine
from kvtier.transfer.device import check_block_ids, check_rows

NUM_BLOCKS = 32


def _layout_and_kv() -> tuple[KVLayout, list[torch.Tensor]]:
    kv = [torch.zeros(2, NUM_BLOCKS, 4, 2, 16, dtype=torch.float16) for _ in range(2)]
    layout = KVLayout.from_tensors(
        kv, model_id="ids", block_tokens=4, blocks_per_chunk=1, num_blocks=NUM_BLOCKS
    )
    return layout, kv


def _fill(kv: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in kv:
        v = t.view(torch.uint8)
        v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, generator=g))


# Every form names the ids 0, 2, 4, 6 (store) / 17, 19, 21, 23 (load), none contiguous.
STRIDED: dict[str, Callable[[int], Any]] = {
    "numpy-step": lambda base: np.arange(base, base + 8)[::2],
    "numpy-reversed": lambda base: np.arange(base, base + 8)[::2][::-1][::-1],
    "torch-step": lambda base: torch.arange(base, base + 8)[::2],
    # A column of a block table (rows of 2 ids).
    "block-table-column": lambda base: np.arange(base, base + 8).reshape(4, 2)[:, 0],
    "numpy-int32-step": lambda base: np.arange(base, base + 8, dtype=np.int32)[::2],
    "numpy-uint16-step": lambda base: np.arange(base, base + 8, dtype=np.uint16)[::2],
    "range": lambda base: range(base, base + 8, 2),
    "tuple": lambda base: tuple(range(base, base + 8, 2)),
    "numpy-scalars": lambda base: [np.int64(i) for i in range(base, base + 8, 2)],
}


@pytest.mark.parametrize("form", list(STRIDED))
async def test_store_and_load_take_strided_ids(form: str) -> None:
    layout, kv = _layout_and_kv()
    config = KVTierConfig(cpu_bytes_to_use=8 * (-(-layout.bytes_per_chunk // 4096) * 4096))
    engine = await Engine.open(config, layout, kv)
    try:
        _fill(kv, seed=7)
        src = STRIDED[form](0)
        want = [t.view(torch.uint8)[:, [0, 2, 4, 6]].clone() for t in kv]
        keys = chain_keys(list(range(16)), engine.block_tokens, engine.namespace)
        summary = await engine.store(keys, src)
        assert summary.stored == 4
        assert await engine.load(keys, STRIDED[form](17)) == 4
        got = [t.view(torch.uint8)[:, [17, 19, 21, 23]] for t in kv]
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    finally:
        await engine.aclose()


@pytest.mark.parametrize(
    ("ids", "named"),
    [
        pytest.param(np.arange(4, dtype=np.float64), "float64", id="float-array"),
        pytest.param([0.0, 1.0, 2.0, 3.0], "float64", id="float-list"),
        pytest.param(np.ones(4, dtype=bool), "bool", id="bool-array"),
        pytest.param([True, False, True, True], "bool", id="bool-list"),
        pytest.param(torch.arange(4, dtype=torch.float32), "float32", id="float-tensor"),
        pytest.param(["0", "1", "2", "3"], "<U1", id="strings"),
    ],
)
def test_wrong_dtype_is_a_typed_error_naming_it(ids: Any, named: str) -> None:
    layout, _ = _layout_and_kv()
    with pytest.raises(InvalidArgumentError, match=f"integers.*{named}"):
        check_block_ids(layout, ids, 4, unique=True)
    with pytest.raises(InvalidArgumentError, match=f"integers.*{named}"):
        check_rows(ids, 8, unique=True)


def test_two_dimensional_ids_are_refused() -> None:
    layout, _ = _layout_and_kv()
    with pytest.raises(InvalidArgumentError, match="flat"):
        check_block_ids(layout, np.arange(4).reshape(2, 2), 4, unique=True)


def test_contiguous_int64_ids_are_not_copied() -> None:
    # The fast path: an array the compiled checks take as it is stays that array.
    layout, _ = _layout_and_kv()
    ids = np.arange(4, dtype=np.int64)
    assert check_block_ids(layout, ids, 4, unique=True)[0] is ids
    strided = np.arange(8, dtype=np.int64)[::2]
    out = check_block_ids(layout, strided, 4, unique=True)[0]
    assert out.flags.c_contiguous
    assert out.tolist() == [0, 2, 4, 6]
    assert check_rows(strided, 8, unique=True).flags.c_contiguous
