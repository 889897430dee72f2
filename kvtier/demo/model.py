"""A small Llama-shaped decoder in plain torch, with a paged KV cache.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP,
with deterministic random weights drawn from a seed: nothing is downloaded, and
the same seed gives the same model on every machine. The KV cache is paged the
way vLLM lays it out, one tensor per layer shaped
``(2, num_blocks, block_tokens, kv_heads, head_dim)``, so that kvtier moves the
same kind of bytes it moves for a real serving engine.

The demo serves prompts on top of KV blocks that kvtier loaded and compares
them with a full recompute. kvtier guarantees the blocks' bytes; whether the
logits are then equal bit for bit depends on the model's arithmetic. A BLAS
picks its kernel by the shape of a product, so a token computed in a call of
300 rows and in one of 1,400 may be rounded differently (on a 16-core Xeon,
with products of whole calls, the first token's logits moved by up to 9e-3
that way, and the KV bytes too). So the forward pass is
written to be *chunking invariant*: every value of a position comes from the
same operations, on tensors of the same shapes, whatever call computes it.

* Positions go in tiles of :data:`TILE`, aligned at position 0, and every
  operation works on one tile's rows: every product has ``TILE`` rows, and a
  position is always at the same row of the same tile. A call computes each
  tile that holds one of its positions whole, and throws away the rows of
  positions it does not own.
* A tile's attention reads the keys and values of positions 0 to the tile's
  end from the cache, in their storage dtype, so loaded and computed KV enter
  it alike. Keys past a row's position are masked with -inf and so weigh
  exactly 0, whether they exist yet or not.

This rests on each kernel giving the same bits for the same shapes, strides
and inputs within one process, and on a row of a product depending on that
row alone: true of BLAS kernels, which have no data-dependent paths, but
promised by none. The demo therefore does not rest its verdict on it (see
:mod:`kvtier.demo.serving`): it reports how many logits came out bit for bit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["TILE", "WEIGHT_BLOCK_BYTES", "DemoModel", "Generation", "ModelConfig"]

TILE = 32
"""Positions per tile: every product has this many rows (see the module docstring).

Fewer rows use the CPU less well, more make every decode step compute more
rows for its one. On two cores of a Xeon, against products of whole calls, a
1,400-token prefill took 1.4x the time in tiles of 16, a decode step 1.7x in
tiles of 64, and both about the same in tiles of 32 (1.3x for the prefill on
the project's 2-core EPYC VM)."""

WEIGHT_BLOCK_BYTES = 3 << 20
"""Bytes of weight rows one product reads: products of few rows read their
weights again for every tile, so they go in blocks of rows that stay in the
cache from one tile to the next."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the demo model.

    The default is a 6-layer decoder of about 37M parameters outside the
    (tied) embedding, whose bfloat16 KV is 3 KiB per token for 73 MFLOP of
    weight products: 42 bytes of KV per MFLOP, the proportion of a 7B model
    with full multi-head attention (Llama-2-7B: 512 KiB per token for 13
    GFLOP, 40 B/MFLOP), four times that of grouped-query 8B models
    (Llama-3-8B: 128 KiB for 14 GFLOP, 9 B/MFLOP).
    """

    vocab: int = 32000
    """Vocabulary size (token ids are below it)."""
    hidden: int = 768
    """Width of the residual stream."""
    layers: int = 6
    """Decoder layers."""
    heads: int = 12
    """Query heads."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention: ``heads // kv_heads`` queries share one)."""
    head_dim: int = 64
    """Width of one head."""
    intermediate: int = 2048
    """Width of the SwiGLU MLP."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    max_positions: int = 16384
    """Longest sequence the rotary table covers."""
    kv_dtype: torch.dtype = torch.bfloat16
    """Storage dtype of the KV cache (compute is float32)."""

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype.itemsize

    def flops_per_token(self) -> int:
        """Multiply-add FLOPs of the weight products per token (attention scores excluded)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        ff = self.intermediate
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * ff
        return 2 * self.layers * per_layer


@dataclass(frozen=True, slots=True)
class Generation:
    """What :meth:`DemoModel.generate` produced."""

    first_logits: torch.Tensor
    """Float32 logits of the first generated token, ``(vocab,)``."""
    tokens: list[int]
    """The greedy tokens, the first one included."""
    prefill_s: float
    """Seconds from the start of the prefill to the first token (its argmax)."""


class DemoModel:
    """The decoder with random weights from ``seed``; one forward at a time.

    Parameters
    ----------
    config
        The model's shape.
    seed
        Seed of the weights: equal seeds give bit-identical weights.

    Notes
    -----
    Not thread-safe: the serving loop runs every forward on one worker
    thread, the way one GPU runs one batch at a time.
    """

    def __init__(self, config: ModelConfig | None = None, seed: int = 0) -> None:
        self.config = c = config or ModelConfig()
        if c.heads % c.kv_heads:
            raise ValueError(f"heads ({c.heads}) must be a multiple of kv_heads ({c.kv_heads})")
        gen = torch.Generator().manual_seed(seed)

        def weight(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) / math.sqrt(fan_in)

        q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
        self.embed = torch.randn(c.vocab, c.hidden, generator=gen)
        self.qkv = [weight(q + 2 * kv, c.hidden, fan_in=c.hidden) for _ in range(c.layers)]
        self.out = [weight(c.hidden, q, fan_in=q) for _ in range(c.layers)]
        self.gate_up = [
            weight(2 * c.intermediate, c.hidden, fan_in=c.hidden) for _ in range(c.layers)
        ]
        self.down = [
            weight(c.hidden, c.intermediate, fan_in=c.intermediate) for _ in range(c.layers)
        ]
        # Norm weights near 1, not exactly 1, so that they take part in the numerics.
        self.attn_norm = [1 + 0.1 * torch.randn(c.hidden, generator=gen) for _ in range(c.layers)]
        self.mlp_norm = [1 + 0.1 * torch.randn(c.hidden, generator=gen) for _ in range(c.layers)]
        self.final_norm = 1 + 0.1 * torch.randn(c.hidden, generator=gen)
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).double() / c.head_dim)
        angles = torch.arange(c.max_positions).double()[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=1)
        self._cos = angles.cos().float()
        self._sin = angles.sin().float()

    def new_cache(self, num_blocks: int, block_tokens: int) -> list[torch.Tensor]:
        """Zeroed paged KV tensors, one per layer, in vLLM's K/V-first layout.

        Returns
        -------
        list[torch.Tensor]
            ``layers`` tensors shaped ``(2, num_blocks, block_tokens, kv_heads,
            head_dim)`` of ``kv_dtype``.
        """
        c = self.config
        shape = (2, num_blocks, block_tokens, c.kv_heads, c.head_dim)
        return [torch.zeros(shape, dtype=c.kv_dtype) for _ in range(c.layers)]

    @torch.inference_mode()
    def forward(
        self,
        cache: Sequence[torch.Tensor],
        block_table: Sequence[int],
        tokens: Sequence[int],
        start: int,
    ) -> torch.Tensor:
        """Compute ``tokens`` at positions ``start, start + 1, ...`` on top of the cache.

        Parameters
        ----------
        cache
            The paged KV tensors (:meth:`new_cache`).
        block_table
            Device block ids of the sequence, in position order; it must cover
            position ``start + len(tokens) - 1``.
        tokens
            Token ids to compute (at least one).
        start
            Position of the first of ``tokens``: the KV of positions below it
            must already be in the blocks of ``block_table`` (computed by an
            earlier call, or loaded).

        Returns
        -------
        torch.Tensor
            The float32 logits after the last token, shaped ``(vocab,)``.

        Raises
        ------
        ValueError
            When ``tokens`` is empty, or its positions exceed the block table
            or the rotary table.

        Notes
        -----
        Writes the keys and values of ``tokens`` into their cache slots, and
        nothing else. Computes whole tiles of :data:`TILE` positions (see the
        module docstring): the rows of a tile's positions outside
        ``[start, start + len(tokens))`` are computed and thrown away.
        """
        c = self.config
        n = len(tokens)
        if n < 1:
            raise ValueError("forward needs at least one token")
        block_tokens = cache[0].shape[2]
        end = start + n
        if end > c.max_positions or len(block_table) * block_tokens < end:
            raise ValueError(f"positions up to {end} exceed the block table or the model")
        table = torch.as_tensor(list(block_table), dtype=torch.long)
        first = start - start % TILE
        last = -(-end // TILE) * TILE
        # A row of a position this call does not compute repeats the nearest
        # one it does: it stays finite, and is thrown away.
        qpos = torch.arange(first, last).clamp(start, end - 1)
        ids = torch.as_tensor(list(tokens), dtype=torch.long)[qpos - start]
        slots = table[qpos // block_tokens] * block_tokens + qpos % block_tokens
        tiles = [
            _Tile(first + lo, qpos[lo : lo + TILE], start, end, (self._cos, self._sin))
            for lo in range(0, last - first, TILE)
        ]
        xs = [self.embed[ids[lo : lo + TILE]] for lo in range(0, last - first, TILE)]
        ctx = torch.arange(start)
        ctx_slots = table[ctx // block_tokens] * block_tokens + ctx % block_tokens
        # The context's keys and values as attention reads them: float32 from
        # the storage dtype, so loaded and computed KV enter alike. Values carry
        # a column of ones: one product sums e @ v and e. The buffers span every
        # position the model has, so that a tile's products see the same strides
        # in every call; positions past the call's are zero (and masked).
        capacity = -(-c.max_positions // TILE) * TILE
        keys = torch.empty(c.kv_heads, capacity, c.head_dim)
        values = torch.empty(c.kv_heads, capacity, c.head_dim + 1)
        keys[:, end:last] = 0.0
        values[:, end:last] = 0.0
        values[:, :end, c.head_dim] = 1.0
        for layer in range(c.layers):
            flat = cache[layer].view(2, -1, c.kv_heads, c.head_dim)
            keys[:, :start] = flat[0, ctx_slots].float().transpose(0, 1)
            values[:, :start, : c.head_dim] = flat[1, ctx_slots].float().transpose(0, 1)
            xs = self._layer(layer, xs, tiles, flat, slots, keys, values)
        row = end - 1 - tiles[-1].base
        logits = F.linear(_rms_norm(xs[-1], self.final_norm, c.norm_eps), self.embed)
        return logits[row].clone()

    def _layer(
        self,
        layer: int,
        xs: list[torch.Tensor],
        tiles: list[_Tile],
        flat: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> list[torch.Tensor]:
        """One decoder layer over the tiles' rows ``xs``; writes the tiles' own KV.

        ``flat`` is the layer's cache viewed as ``(2, slots, kv_heads, dim)``,
        ``slots`` the cache slots of the rows of every tile, ``keys`` and
        ``values`` the float context of :meth:`forward`. Each step runs over
        every tile before the next (a tile's attention needs only the keys up
        to its own end), so that consecutive products share their weights.
        """
        c = self.config
        q_width, kv_width = c.heads * c.head_dim, c.kv_heads * c.head_dim
        queries = []
        normed = [_rms_norm(x, self.attn_norm[layer], c.norm_eps) for x in xs]
        for i, (qkv, tile) in enumerate(zip(_linear(normed, self.qkv[layer]), tiles, strict=True)):
            qk = qkv[:, : q_width + kv_width].reshape(TILE, c.heads + c.kv_heads, c.head_dim)
            qk = _rope(qk, tile.cos, tile.sin)
            v = qkv[:, q_width + kv_width :].reshape(TILE, c.kv_heads, c.head_dim)
            lo, hi = tile.own
            k_own, v_own = qk[lo:hi, c.heads :].to(c.kv_dtype), v[lo:hi].to(c.kv_dtype)
            flat[0, slots[i * TILE + lo : i * TILE + hi]] = k_own
            flat[1, slots[i * TILE + lo : i * TILE + hi]] = v_own
            keys[:, tile.base + lo : tile.base + hi] = k_own.float().transpose(0, 1)
            values[:, tile.base + lo : tile.base + hi, : c.head_dim] = v_own.float().transpose(0, 1)
            queries.append(qk[:, : c.heads])
        attended = [_attention(q, keys, values, t) for q, t in zip(queries, tiles, strict=True)]
        xs = [x + a for x, a in zip(xs, _linear(attended, self.out[layer]), strict=True)]
        normed = [_rms_norm(x, self.mlp_norm[layer], c.norm_eps) for x in xs]
        acts = []
        for h in _linear(normed, self.gate_up[layer]):
            gate, up = h.chunk(2, dim=-1)
            acts.append(F.silu(gate) * up)
        return [x + m for x, m in zip(xs, _linear(acts, self.down[layer]), strict=True)]

    def generate(
        self,
        cache: Sequence[torch.Tensor],
        block_table: Sequence[int],
        prompt: Sequence[int],
        start: int,
        new_tokens: int,
    ) -> Generation:
        """Prefill ``prompt[start:]`` on top of cached KV, then decode greedily.

        Parameters
        ----------
        cache, block_table
            As for :meth:`forward`; the table must cover
            ``len(prompt) + new_tokens - 1`` positions.
        prompt
            The whole prompt; the KV of ``prompt[:start]`` must be in the cache.
        start
            Tokens already in the cache, below ``len(prompt)``.
        new_tokens
            Tokens to generate (at least one).

        Returns
        -------
        Generation
            The first token's logits, the generated tokens and the prefill time.
        """
        if not 0 <= start < len(prompt):
            raise ValueError(f"start must be in [0, {len(prompt)}), got {start}")
        began = time.perf_counter()
        first = self.forward(cache, block_table, prompt[start:], start)
        out = [int(first.argmax())]
        prefill_s = time.perf_counter() - began
        pos = len(prompt)
        while len(out) < new_tokens:
            logits = self.forward(cache, block_table, out[-1:], pos)
            out.append(int(logits.argmax()))
            pos += 1
        return Generation(first, out, prefill_s)


def _linear(xs: list[torch.Tensor], weight: torch.Tensor) -> list[torch.Tensor]:
    """``F.linear(x, weight)`` of every tile in ``xs``, in blocks of weight rows.

    Every tile meets the same blocks, so the products keep their shapes.
    """
    n, k = weight.shape
    rows = max(64, WEIGHT_BLOCK_BYTES // (k * weight.itemsize) // 64 * 64)
    if rows >= n:
        return [F.linear(x, weight) for x in xs]
    out = [x.new_empty(x.shape[0], n) for x in xs]
    for lo in range(0, n, rows):
        block = weight[lo : lo + rows]
        for x, o in zip(xs, out, strict=True):
            o[:, lo : lo + rows] = F.linear(x, block)
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class _Tile:
    """The rows of one tile in one call of :meth:`DemoModel.forward`."""

    __slots__ = ("base", "bias", "cos", "own", "sin")

    def __init__(
        self,
        base: int,
        qpos: torch.Tensor,
        start: int,
        end: int,
        rotary: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        self.base = base
        """Position of the tile's first row (a multiple of :data:`TILE`)."""
        self.own = (max(start - base, 0), min(end - base, TILE))
        """The rows ``[lo, hi)`` whose positions the call computes."""
        self.cos, self.sin = rotary[0][qpos], rotary[1][qpos]
        """The rotary tables at each row's position."""
        key_pos = torch.arange(base + TILE)
        # Adding 0 is exact: the mask changes nothing that it lets through.
        self.bias = torch.zeros(TILE, base + TILE).masked_fill_(
            key_pos[None, :] > qpos[:, None], -math.inf
        )
        """Additive mask ``(TILE, base + TILE)``: 0 where a row sees a key, -inf past it."""


def _attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tile: _Tile
) -> torch.Tensor:
    """Causal grouped-query attention of one tile's queries over the keys up to its end.

    ``q`` is ``(TILE, heads, dim)``; ``keys`` ``(kv_heads, P, dim)`` and
    ``values`` ``(kv_heads, P, dim + 1)`` (the last column ones) hold the
    context from position 0, ``P`` the model's positions. Every product has
    the shape and the strides that the tile's position gives it, whatever the
    call: keys past a row's position enter with weight exactly 0.
    """
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    limit = tile.base + TILE
    # (kv_heads, group * TILE, dim): the queries sharing a key head form one product.
    qg = (q * (1.0 / math.sqrt(dim))).view(TILE, kv_heads, group, dim).permute(1, 2, 0, 3)
    scores = torch.bmm(qg.reshape(kv_heads, group * TILE, dim), keys[:, :limit].transpose(1, 2))
    scores.view(kv_heads, group, TILE, limit).add_(tile.bias)
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()
    acc = torch.bmm(scores, values[:, :limit]).view(kv_heads, group, TILE, dim + 1)
    out = acc[..., :dim] / acc[..., dim:]
    return out.permute(2, 0, 1, 3).reshape(TILE, heads * dim)
