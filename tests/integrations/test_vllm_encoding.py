"""Under vLLM the namespace follows what the bytes mean (no vLLM needed: its config's values)."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.integrations.vllm.encoding import format_version, vllm_encoding
from kvtier.layout import KVLayout, TensorSpec

# One vLLM 0.32 instance on one GPU: what its OffloadingConfig and platform say.
CONFIG: dict[str, Any] = {
    "vllm_version": "0.32.0",
    "cache_dtype": "bfloat16",
    "kv_cache_layout": "LBNHC",
    "fp8_fnuz": False,
    "tp_size": 2,
    "pp_size": 1,
    "pcp_size": 1,
    "dcp_size": 1,
}


def _namespace(**change: Any) -> bytes:
    """The namespace of one vLLM page of 4 KiB (the same shapes whatever ``change`` is)."""
    page = TensorSpec("vllm_page", (1, 4096), "int8", 1, False)
    layout = KVLayout(
        tensors=(page,),
        model_id="m",
        block_tokens=16,
        tp_size=2,
        encoding=vllm_encoding(**{**CONFIG, **change}),
    )
    return layout.namespace


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.32.0", "vllm 0.32"),
        ("0.32.1", "vllm 0.32"),
        ("0.32.0+cpu", "vllm 0.32"),
        ("0.32.1.post1", "vllm 0.32"),
        ("0.33.0", "vllm 0.33"),
        ("1.0.0", "vllm 1.0"),
        ("0.33.0rc1", "vllm 0.33.0rc1"),
        ("0.32.1.dev12+g1a2b3c4", "vllm 0.32.1.dev12+g1a2b3c4"),
        ("", "vllm unknown"),
    ],
)
def test_the_format_version_is_the_release_not_the_patch(version: str, expected: str) -> None:
    assert format_version(version) == expected


def test_a_restart_of_the_same_configuration_keeps_its_namespace() -> None:
    assert _namespace() == _namespace()
    # A patch upgrade, or the CPU build of the same release, is the same format.
    assert _namespace(vllm_version="0.32.1") == _namespace()
    assert _namespace(vllm_version="0.32.0+cpu") == _namespace()
    # fnuz changes nothing for a cache that is not fp8.
    assert _namespace(fp8_fnuz=True) == _namespace()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"vllm_version": "0.33.0"}, id="vllm-minor-release"),
        pytest.param({"vllm_version": "0.33.0rc1"}, id="release-candidate"),
        pytest.param({"kv_cache_layout": "LBHNC"}, id="kv-cache-layout"),
        pytest.param({"kv_cache_layout": None}, id="kv-cache-layout-unresolved"),
        pytest.param({"cache_dtype": "float16"}, id="cache-dtype"),
        pytest.param({"tp_size": 1, "pp_size": 2}, id="tp2-vs-pp2"),
        pytest.param({"dcp_size": 2}, id="decode-context-parallel"),
        pytest.param({"pcp_size": 2}, id="prefill-context-parallel"),
    ],
)
def test_same_bytes_per_block_another_meaning_is_another_namespace(change: dict[str, Any]) -> None:
    assert _namespace(**change) != _namespace()


def test_fp8_variants_and_their_scales_are_told_apart() -> None:
    e4m3, e5m2 = _namespace(cache_dtype="fp8_e4m3"), _namespace(cache_dtype="fp8_e5m2")
    assert len({e4m3, e5m2, _namespace(cache_dtype="fp8"), _namespace()}) == 4
    # On an fnuz platform (MI300) fp8 is another type and the checkpoint's scales double.
    assert _namespace(cache_dtype="fp8_e4m3", fp8_fnuz=True) != e4m3
    per_token = vllm_encoding(**{**CONFIG, "cache_dtype": "int8_per_token_head"})
    assert per_token.scales == "per token and head, in the page"
    assert vllm_encoding(**{**CONFIG, "cache_dtype": "fp8_e5m2"}).scales == (
        "per-tensor from the model"
    )
    assert vllm_encoding(**CONFIG).scales is None


def test_vllm_does_not_name_the_attention_backend_to_the_scheduler() -> None:
    """The backend's choice reaches the namespace as the page order and the release."""
    encoding = vllm_encoding(**CONFIG)
    assert encoding.attention_backend is None
    assert encoding.describe() == {
        "format_version": "vllm 0.32",
        "attention_backend": None,
        "kv_cache_layout": "LBNHC",
        "cache_dtype": "bfloat16",
        "scales": None,
        "sharding": "tp2 pp1 pcp1 dcp1",
    }
