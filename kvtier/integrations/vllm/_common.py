"""What both sides of kvtier's vLLM front share: row layout, keys, logging.

No class here holds state of one side; :mod:`.manager` (the scheduler side) and
:mod:`.worker` (a worker's data plane) build on it, and :mod:`.spec` wires them.
"""

from __future__ import annotations

import hashlib
import json
import logging

import vllm  # type: ignore[import-not-found]
from vllm.platforms import current_platform  # type: ignore[import-not-found]
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    BlockIDsLoadStoreSpec,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # type: ignore[import-not-found]

from kvtier.errors import ConfigurationError
from kvtier.integrations.vllm.encoding import vllm_encoding
from kvtier.integrations.vllm.identity import model_identity
from kvtier.layout import KVEncoding, KVLayout, TensorSpec

__all__ = [
    "RowsSpec",
    "follow_vllm_logging",
    "kv_encoding",
    "model_digest",
    "offload_key_to_kvtier",
    "row_layout",
]

log = logging.getLogger("kvtier.integrations.vllm")

_PERSON = b"kvtier.vllm.v1"


class RowsSpec(BlockIDsLoadStoreSpec):  # type: ignore[misc]
    """Where offloaded blocks are: rows of kvtier's CPU region (``block_ids``)."""


def offload_key_to_kvtier(key: bytes, namespace: bytes) -> bytes:
    """kvtier's 16-byte key for vLLM's ``OffloadKey`` (block hash + group) in ``namespace``.

    The namespace is the layout fingerprint: two models, KV dtypes, page
    orders, block sizes, shardings or vLLM releases sharing a file tier never
    hit each other's blocks.
    """
    h = hashlib.blake2b(namespace, digest_size=16, person=_PERSON)
    h.update(key)
    return h.digest()


def kv_encoding(config: OffloadingConfig) -> KVEncoding:
    """What the bytes of a row mean: vLLM's config and this process's vLLM, in kvtier's terms.

    The same in the scheduler's process and every worker's (one host, one
    vLLM, one config); see :mod:`kvtier.integrations.vllm.encoding` for the
    fields and why each is there.
    """
    parallel = config.parallel
    return vllm_encoding(
        vllm_version=str(vllm.__version__),
        cache_dtype=str(config.model.dtype),
        kv_cache_layout=config.kv_cache_layout,
        fp8_fnuz=bool(current_platform.is_fp8_fnuz()),
        tp_size=int(parallel.tp_size),
        pp_size=int(parallel.pp_size),
        pcp_size=int(parallel.pcp_size),
        dcp_size=int(parallel.dcp_size),
    )


def row_layout(config: OffloadingConfig, rank: int = 0, revision: str | None = None) -> KVLayout:
    """The layout of one worker's slice of a row, computed alike on both sides.

    One row holds ``blocks_per_chunk`` device blocks of every layer of the
    worker (vLLM's ``worker_kv_bytes_per_block`` each). The model id carries
    which model computed the bytes: its identity (its config and weights, or
    the ``revision`` the user names: see
    :func:`~kvtier.integrations.vllm.identity.model_identity`; never the path
    it was loaded from), the layers of each KV cache group, tokens per hash.
    The encoding carries what the bytes mean (:func:`kv_encoding`: KV dtype,
    page order, scales, sharding, vLLM's release).

    Raises
    ------
    ConfigurationError
        For no KV cache group, groups of different block sizes, or several
        groups with ``blocks_per_chunk > 1`` (see Notes).

    Notes
    -----
    With several groups (hybrid models), vLLM stores a sliding-window group's
    chunk without the blocks that left the window, so with ``blocks_per_chunk
    > 1`` a store may fill part of a row; kvtier's copier moves whole rows, so
    several groups need ``blocks_per_chunk == 1`` (vLLM's default).
    """
    groups = config.groups
    bpc = config.cache.blocks_per_chunk
    if not groups:
        raise ConfigurationError("vLLM gave kvtier no KV cache group to offload")
    sizes = sorted({g.tokens_per_block for g in groups})
    if len(sizes) > 1:
        raise ConfigurationError(
            f"kvtier needs one block size for every KV cache group; this model's "
            f"groups have {sizes} tokens per block"
        )
    if len(groups) > 1 and bpc != 1:
        raise ConfigurationError(
            f"this model has {len(groups)} KV cache groups (a hybrid model); kvtier "
            f"offloads it with blocks_per_chunk = 1 only, got {bpc}: vLLM stores a "
            "sliding-window chunk without its freed blocks, a part of a row, and "
            "kvtier copies whole rows (remove block_size / blocks_per_chunk from "
            "kv_connector_extra_config)"
        )
    model_id = json.dumps(
        {
            "integration": "vllm",
            "model": model_digest(config, revision),
            # One group: its layers as a flat list, as before hybrid models.
            "layers": (
                list(groups[0].layer_names)
                if len(groups) == 1
                else [list(g.layer_names) for g in groups]
            ),
            "tokens_per_hash": config.cache.tokens_per_hash,
        },
        sort_keys=True,
    )
    page = TensorSpec(
        name="vllm_page",
        shape=(bpc, config.worker_kv_bytes_per_block),
        dtype="int8",
        itemsize=1,
        kv_first=False,
    )
    return KVLayout(
        tensors=(page,),
        model_id=model_id,
        block_tokens=sizes[0],
        blocks_per_chunk=bpc,
        tp_rank=rank,
        tp_size=config.parallel.world_size,
        encoding=kv_encoding(config),
    )


def model_digest(config: OffloadingConfig, revision: str | None = None) -> str:
    """A digest of the identity of the model vLLM loaded (its files, or ``revision``):
    :func:`~kvtier.integrations.vllm.identity.model_identity`, hashed."""
    identity = json.dumps(model_identity(config.model.name, revision), sort_keys=True)
    return hashlib.blake2b(identity.encode(), digest_size=16).hexdigest()


def follow_vllm_logging() -> None:
    """Send kvtier's log records through vLLM's handlers, at vLLM's level.

    vLLM configures its ``vllm`` logger only (its own handler and format: the
    process name, pid, level and time; ``VLLM_LOGGING_LEVEL``), so kvtier's
    records would otherwise reach Python's last-resort handler: warnings
    bare, INFO (the I/O engine, queue depth, recovery) never. Left alone when
    the user configured the ``kvtier`` logger (handlers or a level of its own)
    or turned vLLM's logging configuration off (no handlers on ``vllm``).
    """
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or ours.level != logging.NOTSET or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False  # as vLLM's own: no second copy through the root logger


def _region_identity(engine_id: str) -> tuple[str, bytes]:
    digest = hashlib.blake2b(engine_id.encode(), digest_size=32, person=_PERSON).digest()
    return f"vllm-{digest[:12].hex()}", digest[16:]
