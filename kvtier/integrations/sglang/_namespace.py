"""The namespace of a host pool's pages: the :class:`~kvtier.layout.KVLayout` every
key of the pool is made in (:func:`page_layout`)."""

from __future__ import annotations

import json
from typing import Any

from kvtier.integrations.sglang._pool import PageGeometry
from kvtier.layout import KVLayout, TensorSpec

__all__ = ["page_layout"]

_GEOMETRY = ("head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim")


def page_layout(storage_config: Any, pool: Any, geometry: PageGeometry) -> KVLayout:
    """What a page's bytes mean: the namespace every key of this pool is made in.

    The served model's name (with the pool's storage format tag), the host
    pool's class, KV dtype, layout, page size and segments, layers and head
    geometry, SGLang's release (major.minor), and the shard: TP rank and
    size for MHA (an MLA page is the same on every rank), PP, attention CP
    and DCP rank and size. Not the DP rank: replicas share their pages.
    """
    cfg = storage_config
    mla = bool(cfg.is_mla_model)
    desc = {
        "integration": "sglang-hicache",
        "sglang": _sglang_release(),
        "model_name": cfg.model_name or "",
        "pool": type(pool).__name__,
        "dtype": str(pool.dtype).removeprefix("torch."),
        "layout": geometry.layout,
        "page_size": int(pool.page_size),
        "logical_page_size": cfg.logical_page_size,
        "segments": list(geometry.segment_sizes),
        "layer_num": int(pool.layer_num),
        "geometry": {
            name: int(value)
            for name in _GEOMETRY
            if isinstance(value := getattr(pool, name, None), int)
        },
        "is_mla_model": mla,
        "tp": None if mla else [int(cfg.tp_rank), int(cfg.tp_size)],
        "pp": [int(cfg.pp_rank), int(cfg.pp_size)],
        "attn_cp": [int(cfg.attn_cp_rank), int(cfg.attn_cp_size)],
        "dcp": [int(cfg.dcp_rank), int(cfg.dcp_size)],
    }
    spec = TensorSpec("sglang_page", (1, geometry.stride), "int8", 1, False)
    return KVLayout(
        tensors=(spec,), model_id=json.dumps(desc, sort_keys=True), block_tokens=geometry.step
    )


def _sglang_release() -> str:
    """SGLang's major.minor: a page's byte order is the release's (a patch keeps it)."""
    try:
        import sglang  # type: ignore[import-not-found]

        return ".".join(str(sglang.__version__).split(".")[:2])
    except Exception:  # pragma: no cover - SGLang is imported already
        return "unknown"
