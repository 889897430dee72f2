from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from kvtier import KVEncoding, KVLayout, LayoutError, TensorSpec


def layout(tensors: Any, **kw: Any) -> KVLayout:
    kw.setdefault("model_id", "m")
    kw.setdefault("block_tokens", 16)
    return KVLayout.from_tensors(tensors, **kw)


@pytest.mark.parametrize(
    ("shapes", "kw", "kinds", "num_blocks", "bytes_per_block"),
    [
        pytest.param([(10, 16, 4, 8)], {}, [False], 10, 16 * 4 * 8 * 2, id="block-first"),
        pytest.param(
            [(2, 10, 16, 8)] * 3,
            {"num_blocks": 10},
            [True] * 3,
            10,
            3 * 2 * 16 * 8 * 2,
            id="kv-first-by-num-blocks",
        ),
        pytest.param(
            [(2, 10, 16, 8)], {"kv_first": True}, [True], 10, 2 * 16 * 8 * 2, id="kv-first-stated"
        ),
        pytest.param(
            [(2, 10, 16, 8)],
            {"kv_first": False},
            [False],
            2,
            10 * 16 * 8 * 2,
            id="two-blocks-stated",
        ),
        pytest.param(
            [(2, 10, 16, 8), (10, 2, 16, 8)],
            {},
            [True, False],
            10,
            2 * (2 * 16 * 8 * 2),
            id="mixed-disambiguates",
        ),
        pytest.param([(10, 2, 16, 8)], {}, [False], 10, 2 * 16 * 8 * 2, id="flashinfer-shape"),
        pytest.param([(7, 3)], {}, [False], 7, 3 * 2, id="flat-rows"),
        pytest.param([(2, 7, 3)], {"num_blocks": 7}, [True], 7, 2 * 3 * 2, id="kv-first-flat"),
    ],
)
def test_detection(
    shapes: list[tuple[int, ...]],
    kw: dict[str, Any],
    kinds: list[bool],
    num_blocks: int,
    bytes_per_block: int,
) -> None:
    lay = layout([torch.zeros(s, dtype=torch.float16) for s in shapes], **kw)
    assert [t.kv_first for t in lay.tensors] == kinds
    assert lay.num_blocks == num_blocks
    assert lay.bytes_per_block == bytes_per_block


def test_sizes_and_offsets() -> None:
    tensors = {
        "k0": torch.zeros(2, 12, 4, 8, dtype=torch.bfloat16),
        "s1": torch.zeros(12, 5, dtype=torch.float32),
    }
    lay = layout(tensors, num_blocks=12, blocks_per_chunk=3, groups=[0, 1])
    assert lay.tensors[0].bytes_per_block == 2 * 4 * 8 * 2
    assert lay.tensors[0].bytes_per_half == 4 * 8 * 2
    assert lay.tensors[1].bytes_per_block == 20
    assert lay.bytes_per_chunk == 3 * (128 + 20)
    assert lay.tensor_offset(0) == 0
    assert lay.tensor_offset(1) == 3 * 128
    assert lay.num_chunks == 4
    assert lay.groups == (0, 1)
    assert lay.offload_block_tokens == 48
    assert lay.tensors[0].dtype == "bfloat16"


def _lay(**kw: Any) -> KVLayout:
    base: dict[str, Any] = {
        "model_id": "llama",
        "block_tokens": 16,
        "blocks_per_chunk": 1,
        "tp_rank": 0,
        "tp_size": 2,
    }
    base.update(kw)
    shape = base.pop("shape", (8, 16, 4))
    dtype = base.pop("dtype", "float16")
    spec = TensorSpec("k", shape, dtype, 2, False)
    return KVLayout(tensors=(spec,), **base)


def test_namespace_and_fingerprint() -> None:
    a = _lay()
    assert a.namespace == _lay().namespace
    assert len(a.namespace) == 16
    # All TP ranks share a row, hence the key namespace; the fingerprint tells them apart.
    assert _lay(tp_rank=1).namespace == a.namespace
    assert _lay(tp_rank=1).fingerprint != a.fingerprint
    changes: list[dict[str, Any]] = [
        {"model_id": "other"},
        {"block_tokens": 32},
        {"blocks_per_chunk": 2},
        {"tp_size": 4},
        {"shape": (8, 16, 8)},
        {"dtype": "bfloat16"},
    ]
    for change in changes:
        assert _lay(**change).namespace != a.namespace, change


def test_namespace_golden() -> None:
    # Changing this digest orphans every file tier on disk: bump the format deliberately.
    assert _lay().namespace.hex() == "abc190ec50054514c67b5f4d11db2b79"


# What a vLLM page of float8 means on one machine: every field set.
_MEANING = KVEncoding(
    format_version="vllm 0.32",
    attention_backend="FLASH_ATTN",
    kv_cache_layout="LBNHC",
    cache_dtype="fp8_e4m3",
    scales="per-tensor from the model",
    sharding="tp2 pp1 pcp1 dcp1",
)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"attention_backend": "FLASHINFER"}, id="attention-backend"),
        pytest.param({"attention_backend": None}, id="attention-backend-unsaid"),
        pytest.param({"kv_cache_layout": "LBHNC"}, id="kv-cache-layout"),
        pytest.param({"cache_dtype": "fp8_e5m2"}, id="cache-dtype"),
        pytest.param({"scales": "per-tensor from the model, doubled for fnuz"}, id="scales"),
        pytest.param({"scales": None}, id="scales-unsaid"),
        pytest.param({"format_version": "vllm 0.33"}, id="format-version"),
        pytest.param({"sharding": "tp1 pp2 pcp1 dcp1"}, id="sharding"),
    ],
)
def test_same_shapes_another_meaning_is_another_namespace(change: dict[str, Any]) -> None:
    """Equal shapes and dtypes, bytes that mean something else: never one namespace."""
    a = _lay(encoding=_MEANING)
    b = _lay(encoding=replace(_MEANING, **change))
    assert a.tensors == b.tensors
    assert b.namespace != a.namespace
    assert b.fingerprint != a.fingerprint


def test_the_same_meaning_twice_is_the_same_namespace() -> None:
    # Built anew, as a restart does: equal values, equal digest.
    again = KVEncoding(**_MEANING.describe())
    assert _lay(encoding=again).namespace == _lay(encoding=_MEANING).namespace
    assert _lay(encoding=_MEANING).namespace != _lay().namespace
    # A digest of values only (no id(), no ordering that varies between processes).
    assert _lay(encoding=_MEANING).namespace.hex() == "ca722d79370683c05f2e4472964a31eb"
    assert _lay(encoding=_MEANING).describe()["encoding"] == _MEANING.describe()
    assert "encoding" not in _lay().describe()  # layouts without one keep their digest


def test_from_tensors_carries_the_encoding() -> None:
    lay = layout([torch.zeros(10, 4, dtype=torch.float16)], encoding=_MEANING)
    assert lay.encoding == _MEANING
    assert lay.namespace != layout([torch.zeros(10, 4, dtype=torch.float16)]).namespace


@pytest.mark.parametrize("value", ["", "  ", 3], ids=["empty", "blank", "not-str"])
def test_an_encoding_field_is_a_name_or_none(value: Any) -> None:
    with pytest.raises(LayoutError, match=r"KVEncoding\.cache_dtype"):
        KVEncoding(cache_dtype=value)
    with pytest.raises(LayoutError, match="encoding must be a KVEncoding"):
        _lay(encoding={"cache_dtype": "fp8"})


@pytest.mark.parametrize(
    ("tensors", "kw", "message"),
    [
        pytest.param([], {}, "at least one tensor", id="empty"),
        pytest.param(
            [torch.zeros(10, 4), torch.zeros(11, 4)],
            {},
            r"'kv\[1\]'.*same num_blocks",
            id="num-blocks-differ",
        ),
        pytest.param(
            [torch.zeros(4, 10).t()], {}, r"'kv\[0\]' is not contiguous", id="non-contiguous"
        ),
        pytest.param([torch.zeros(0, 4)], {}, r"'kv\[0\]'.*zero blocks", id="zero-blocks"),
        pytest.param([torch.zeros(10)], {}, "no block dimension", id="1d"),
        pytest.param([torch.zeros(2, 10, 4)], {}, "read both", id="ambiguous"),
        pytest.param(
            [torch.zeros(2, 2, 4)], {"num_blocks": 2}, "reads both ways", id="ambiguous-2x2"
        ),
        pytest.param(
            [torch.zeros(10, 4)], {"num_blocks": 9}, "does not have 9 blocks", id="wrong-num-blocks"
        ),
        pytest.param(
            [torch.zeros(10, 4)], {"groups": [0, 1]}, "groups has 2 entries", id="groups-len"
        ),
        pytest.param([torch.zeros(10, 4)], {"blocks_per_chunk": 11}, "exceeds", id="bpc-too-big"),
        pytest.param([torch.zeros(10, 4)], {"tp_rank": 2, "tp_size": 2}, "tp_rank", id="rank"),
        pytest.param([torch.zeros(10, 4)], {"block_tokens": 0}, "block_tokens", id="block-0"),
        pytest.param([[1, 2]], {}, "not a torch.Tensor", id="not-tensor"),
        pytest.param(
            {"a": torch.zeros(10, 4), "b": torch.zeros(10, 0)},
            {},
            r"'b'.*empty dimension",
            id="empty-dim-named",
        ),
    ],
)
def test_bad_layouts(tensors: Any, kw: dict[str, Any], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        layout(tensors, **kw)


def test_mixed_devices_rejected() -> None:
    meta = torch.empty(10, 4, device="meta")
    with pytest.raises(LayoutError, match="several devices"):
        layout([torch.zeros(10, 4), meta])
