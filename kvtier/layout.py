"""How the serving engine's KV cache tensors are shaped, seen as bytes per block.

kvtier views every KV tensor as ``num_blocks x bytes_per_block``. Two shapes are
supported:

* **block-first** ``(num_blocks, ...)``: one block's bytes are contiguous;
* **K/V-first** ``(2, num_blocks, ...)``: one block is two contiguous pieces,
  its K half at ``[0, b]`` and its V half at ``[1, b]``.

Tensors may belong to several KV cache groups (hybrid models); each group gets
its own device block ids at transfer time. The layout's :attr:`KVLayout.namespace`
salts every block key, so a key made under one model, dtype, shape, block size
or parallel layout never hits under another; a :class:`KVEncoding` adds what the
shapes do not tell (the attention backend's packing, the page order, a quantized
cache's format and scales), so that bytes of one meaning are never read as another.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from kvtier.errors import LayoutError

if TYPE_CHECKING:
    import torch

__all__ = ["KVEncoding", "KVLayout", "TensorSpec"]

_FINGERPRINT_VERSION = 1


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One KV cache tensor of the serving engine."""

    name: str
    """Name used in errors and in the namespace description."""
    shape: tuple[int, ...]
    """Full shape, including the block (and K/V) dimensions."""
    dtype: str
    """Element type, as torch names it without the prefix (``"float16"``)."""
    itemsize: int
    """Bytes per element."""
    kv_first: bool
    """True for ``(2, num_blocks, ...)``, False for ``(num_blocks, ...)``."""
    group: int = 0
    """KV cache group this tensor belongs to."""

    @property
    def num_blocks(self) -> int:
        """Device blocks in the tensor."""
        return self.shape[1] if self.kv_first else self.shape[0]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one device block (both halves for K/V-first)."""
        inner = self.shape[2:] if self.kv_first else self.shape[1:]
        return (2 if self.kv_first else 1) * math.prod(inner) * self.itemsize

    @property
    def bytes_per_half(self) -> int:
        """Bytes of one contiguous piece of a block: the block, or its K (or V) half."""
        return self.bytes_per_block // 2 if self.kv_first else self.bytes_per_block


@dataclass(frozen=True, slots=True)
class KVEncoding:
    """What a block's bytes mean beyond the shapes and dtypes of its tensors.

    Two caches of the same shapes may hold other values in the same bytes: an
    attention backend packs K and V, heads and tokens in a page in its own
    order; an engine release may change that order under the same shapes
    (LMCache #4463: silent wrong KV after a vLLM upgrade); a one-byte cache is
    ``fp8_e4m3`` or ``fp8_e5m2`` with scales of some origin. A layout that
    carries an encoding (:attr:`KVLayout.encoding`) puts it in its namespace,
    so bytes written under one encoding are never read under another: a miss,
    never wrong KV. Equal encodings give equal namespaces, in any process.

    Every field is the engine's own name for the fact, or None where it does
    not apply or the engine does not say; say what you know, and keep it
    stable across restarts (no process ids, no addresses, no paths), or a
    restart finds nothing.

    Raises
    ------
    LayoutError
        For a field that is neither None nor a non-empty string.
    """

    format_version: str | None = None
    """The engine's version of its KV format, where it has nothing finer: the
    release whose code decides the bytes (vLLM's front gives ``"vllm 0.32"``,
    major.minor, so a patch upgrade keeps the cache)."""
    attention_backend: str | None = None
    """The attention backend that writes and reads the pages (``"FLASH_ATTN"``,
    ``"FLASHINFER"``): backends pack K/V, heads and tokens differently."""
    kv_cache_layout: str | None = None
    """The physical order of a page as the engine names it (vLLM's resolved
    ``KVCacheLayout``: ``"LBNHC"``, ``"LBHNC"``; the older ``"NHD"``/``"HND"``)."""
    cache_dtype: str | None = None
    """The KV cache's element type as the engine names it (``"bfloat16"``,
    ``"fp8_e4m3"``, ``"fp8_e5m2"``): tensors viewed as bytes do not tell it."""
    scales: str | None = None
    """Where a quantized cache's scales come from and how they are applied
    (``"per-tensor from the model"``): values stored under one scale are
    wrong under another."""
    sharding: str | None = None
    """How the KV is split over the ranks that share a row, beyond their number
    (vLLM's front: ``"tp2 pp1 pcp1 dcp1"``): the same bytes per rank hold other
    heads or layers under another split."""

    def __post_init__(self) -> None:
        for f in fields(self):
            name, value = f.name, getattr(self, f.name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise LayoutError(
                    f"KVEncoding.{name} must be None or a non-empty string, got {value!r}"
                )

    def describe(self) -> dict[str, str | None]:
        """Every field by name (None included), as it enters the namespace."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The serving engine's KV tensors of one worker, and how blocks are grouped.

    Build it with :meth:`from_tensors` (from live tensors) or directly from
    :class:`TensorSpec` values (e.g. to open a file tier without tensors).

    Notes
    -----
    A CPU row holds one offloaded block: ``blocks_per_chunk`` consecutive device
    blocks of every tensor, for every worker. Inside a worker's slice, the bytes
    are laid out tensor by tensor (in :attr:`tensors` order), each tensor's
    ``blocks_per_chunk`` blocks back to back; a K/V-first tensor stores its K
    halves then its V halves.
    """

    tensors: tuple[TensorSpec, ...]
    """The tensors, in the order their bytes are laid out in a row."""
    model_id: str
    """Identifies the model weights (e.g. a Hugging Face repo id and revision)."""
    block_tokens: int
    """Tokens per device block."""
    blocks_per_chunk: int = 1
    """Device blocks per offloaded block."""
    tp_rank: int = 0
    """This worker's tensor-parallel rank."""
    tp_size: int = 1
    """Tensor-parallel world size (workers sharing each row)."""
    device: str = "cpu"
    """Device of the tensors (``"cpu"``, ``"cuda:0"``)."""
    encoding: KVEncoding | None = None
    """What the bytes mean beyond the tensors' shapes and dtypes (the attention
    backend, the page order, a quantized cache's format and scales): part of
    the namespace when set. None (the default) leaves the namespace as it was
    before encodings existed, so a cache written without one is found again."""
    _offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tensors:
            raise LayoutError("a KV layout needs at least one tensor")
        for name, value, low in (
            ("block_tokens", self.block_tokens, 1),
            ("blocks_per_chunk", self.blocks_per_chunk, 1),
            ("tp_size", self.tp_size, 1),
            ("tp_rank", self.tp_rank, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise LayoutError(f"{name} must be an int >= {low}, got {value!r}")
        if self.tp_rank >= self.tp_size:
            raise LayoutError(f"tp_rank {self.tp_rank} is not below tp_size {self.tp_size}")
        if self.encoding is not None and not isinstance(self.encoding, KVEncoding):
            raise LayoutError(
                f"encoding must be a KVEncoding or None, got {type(self.encoding).__name__}"
            )
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise LayoutError(f"tensor names must be unique, got {names}")
        first = self.tensors[0]
        for t in self.tensors:
            if t.kv_first and (len(t.shape) < 2 or t.shape[0] != 2):
                raise LayoutError(
                    f"tensor {t.name!r}: K/V-first shape must start with 2, got {t.shape}"
                )
            if len(t.shape) < (3 if t.kv_first else 2):
                raise LayoutError(f"tensor {t.name!r}: shape {t.shape} has no per-block data")
            if t.num_blocks == 0:
                raise LayoutError(f"tensor {t.name!r}: shape {t.shape} has zero blocks")
            if any(d <= 0 for d in t.shape):
                raise LayoutError(f"tensor {t.name!r}: shape {t.shape} has an empty dimension")
            if t.itemsize <= 0:
                raise LayoutError(f"tensor {t.name!r}: itemsize must be positive")
            if t.group < 0:
                raise LayoutError(f"tensor {t.name!r}: group must be >= 0, got {t.group}")
            if t.num_blocks != first.num_blocks:
                raise LayoutError(
                    f"tensor {t.name!r} has {t.num_blocks} blocks but {first.name!r} has "
                    f"{first.num_blocks}: every KV tensor must have the same num_blocks"
                )
        if self.blocks_per_chunk > first.num_blocks:
            raise LayoutError(
                f"blocks_per_chunk {self.blocks_per_chunk} exceeds the {first.num_blocks} "
                "device blocks of the cache"
            )
        offsets, pos = [], 0
        for t in self.tensors:
            offsets.append(pos)
            pos += t.bytes_per_block * self.blocks_per_chunk
        object.__setattr__(self, "_offsets", tuple(offsets))

    # -- construction from live tensors -------------------------------------------------

    @classmethod
    def from_tensors(
        cls,
        tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        *,
        model_id: str,
        block_tokens: int,
        blocks_per_chunk: int = 1,
        num_blocks: int | None = None,
        kv_first: bool | Sequence[bool] | None = None,
        groups: Sequence[int] | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        encoding: KVEncoding | None = None,
    ) -> KVLayout:
        """Describe live KV tensors, detecting block-first or K/V-first per tensor.

        Parameters
        ----------
        tensors
            The KV tensors (a list, or a mapping from name to tensor).
        model_id, block_tokens, blocks_per_chunk, tp_rank, tp_size, encoding
            As the fields of the same names.
        num_blocks
            Device blocks per tensor. Resolves shapes that read both ways, such as
            ``(2, 2, ...)`` or a lone ``(2, N, ...)`` tensor.
        kv_first
            State the shape kind instead of detecting it: one bool for all
            tensors, or one per tensor.
        groups
            KV cache group of each tensor (default: all in group 0).

        Raises
        ------
        LayoutError
            For no tensors, a non-contiguous tensor, mixed devices, tensors with
            different block counts, zero blocks, or a shape that reads both ways
            and is not resolved by ``num_blocks`` or ``kv_first``. The message
            names the tensor.
        """
        import torch

        items = (
            list(tensors.items())
            if isinstance(tensors, Mapping)
            else [(f"kv[{i}]", t) for i, t in enumerate(tensors)]
        )
        if not items:
            raise LayoutError("a KV layout needs at least one tensor")
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
            if not t.is_contiguous():
                raise LayoutError(f"tensor {name!r} is not contiguous (strides {t.stride()})")
            if t.dim() < 2:
                raise LayoutError(f"tensor {name!r} has shape {tuple(t.shape)}: no block dimension")
        devices = {str(t.device) for _, t in items}
        if len(devices) > 1:
            raise LayoutError(f"KV tensors are on several devices: {sorted(devices)}")
        if groups is not None and len(groups) != len(items):
            raise LayoutError(f"groups has {len(groups)} entries for {len(items)} tensors")
        if isinstance(kv_first, Sequence) and len(kv_first) != len(items):
            raise LayoutError(f"kv_first has {len(kv_first)} entries for {len(items)} tensors")

        kinds = _detect_kinds([(name, tuple(t.shape)) for name, t in items], num_blocks, kv_first)
        specs = tuple(
            TensorSpec(
                name=name,
                shape=tuple(t.shape),
                dtype=str(t.dtype).removeprefix("torch."),
                itemsize=t.element_size(),
                kv_first=kind,
                group=0 if groups is None else int(groups[i]),
            )
            for i, ((name, t), kind) in enumerate(zip(items, kinds, strict=True))
        )
        return cls(
            tensors=specs,
            model_id=model_id,
            block_tokens=block_tokens,
            blocks_per_chunk=blocks_per_chunk,
            tp_rank=tp_rank,
            tp_size=tp_size,
            device=devices.pop(),
            encoding=encoding,
        )

    # -- derived sizes ------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Device blocks per tensor."""
        return self.tensors[0].num_blocks

    @property
    def num_chunks(self) -> int:
        """Whole offloaded blocks the device cache can hold."""
        return self.num_blocks // self.blocks_per_chunk

    @property
    def groups(self) -> tuple[int, ...]:
        """The KV cache group ids, sorted."""
        return tuple(sorted({t.group for t in self.tensors}))

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one device block over all of this worker's tensors."""
        return sum(t.bytes_per_block for t in self.tensors)

    @property
    def bytes_per_chunk(self) -> int:
        """Bytes of one offloaded block for this worker (its slice of a row)."""
        return self.bytes_per_block * self.blocks_per_chunk

    @property
    def offload_block_tokens(self) -> int:
        """Tokens per offloaded block: what :func:`kvtier.chain_keys` groups by."""
        return self.block_tokens * self.blocks_per_chunk

    def tensor_offset(self, index: int) -> int:
        """Byte offset of tensor ``index``'s bytes inside this worker's slice of a row."""
        return self._offsets[index]

    # -- identity -----------------------------------------------------------------------

    def describe(self, *, include_rank: bool = False) -> dict[str, Any]:
        """The facts that make stored bytes compatible, as a JSON-able dict."""
        desc: dict[str, Any] = {
            "version": _FINGERPRINT_VERSION,
            "model_id": self.model_id,
            "block_tokens": self.block_tokens,
            "blocks_per_chunk": self.blocks_per_chunk,
            "tp_size": self.tp_size,
            "tensors": [
                {
                    "name": t.name,
                    "shape": list(t.shape),
                    "dtype": t.dtype,
                    "kv_first": t.kv_first,
                    "group": t.group,
                }
                for t in self.tensors
            ],
        }
        if self.encoding is not None:
            # Only when set: a layout without one keeps the digest it always had.
            desc["encoding"] = self.encoding.describe()
        if include_rank:
            desc["tp_rank"] = self.tp_rank
        return desc

    @property
    def namespace(self) -> bytes:
        """16-byte digest salting every block key of this layout.

        Shared by all tensor-parallel ranks of one model: a row (and a block key)
        carries every rank's slice, so the rank is not part of it; the TP size is.
        """
        return _digest(self.describe(include_rank=False))

    @property
    def fingerprint(self) -> bytes:
        """16-byte digest of everything in :attr:`namespace` plus this worker's rank."""
        return _digest(self.describe(include_rank=True))


def _digest(desc: Mapping[str, Any]) -> bytes:
    text = json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(text, digest_size=16, person=b"kvtier.layout").digest()


def _detect_kinds(
    shapes: Sequence[tuple[str, tuple[int, ...]]],
    num_blocks: int | None,
    kv_first: bool | Sequence[bool] | None,
) -> list[bool]:
    """Decide block-first or K/V-first per tensor; raise where it cannot be told."""
    if kv_first is not None:
        return (
            [bool(kv_first)] * len(shapes)
            if isinstance(kv_first, bool)
            else [bool(k) for k in kv_first]
        )
    # Candidate block counts per tensor: shape[0] as block-first; shape[1] as K/V-first
    # when the leading dimension is 2 and a per-block dimension remains.
    # None marks a (2, 2, ...) tensor, which reads both ways.
    cands: list[dict[int, bool | None]] = []
    for _name, shape in shapes:
        c: dict[int, bool | None] = {shape[0]: False}
        if shape[0] == 2 and len(shape) >= 3:
            c = {2: None} if shape[1] == 2 else {2: False, shape[1]: True}
        cands.append(c)
    if num_blocks is not None:
        if num_blocks <= 0:
            raise LayoutError(f"num_blocks must be positive, got {num_blocks}")
        chosen = num_blocks
    else:
        common = set(cands[0]).intersection(*cands[1:])
        if not common:
            name0, shape0 = shapes[0]
            for (name, shape), c in zip(shapes, cands, strict=True):
                if not set(c) & set(cands[0]):
                    raise LayoutError(
                        f"tensor {name!r} {shape} has a different num_blocks than "
                        f"{name0!r} {shape0}: every KV tensor must have the same num_blocks"
                    )
        if len(common) > 1:
            raise LayoutError(
                f"shapes read both as block-first and as K/V-first (num_blocks could be "
                f"any of {sorted(common)}): pass num_blocks= or kv_first="
            )
        chosen = common.pop()
    kinds = []
    for (name, shape), c in zip(shapes, cands, strict=True):
        if chosen not in c:
            raise LayoutError(
                f"tensor {name!r} {shape} does not have {chosen} blocks as block-first "
                "(num_blocks, ...) or K/V-first (2, num_blocks, ...)"
            )
        kind = c[chosen]
        if kind is None:
            raise LayoutError(f"tensor {name!r} {shape} reads both ways: pass kv_first=")
        kinds.append(kind)
    return kinds
