"""A small Llama-shaped decoder in plain torch, with a paged KV cache.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP,
with deterministic random weights drawn from a seed: nothing is downloaded, and
the same seed gives the same model on every machine. The KV cache is paged the
way vLLM lays it out, one tensor per layer shaped
``(2, num_blocks, block_tokens, kv_heads, head_dim)``, so that kvtier moves the
same kind of bytes it moves for a real serving engine.

The demo checks that a prompt served from loaded KV blocks gives exactly what a
full recompute gives, so the forward pass is written to be *batch invariant*:
a token's keys, values and logits do not depend on how many other tokens were
computed in the same call, nor on how long the context was when its KV was
written. Three rules give that on CPU:

* every matrix product has at least :data:`MIN_ROWS` rows (fewer rows switch
  BLAS to other kernels, whose sums round differently), so short inputs are
  padded with rows that are computed and thrown away;
* attention reads keys and values only from the cache (after writing the new
  ones), in their storage dtype, so loaded and recomputed KV enter it alike;
* attention runs over fixed blocks of :data:`KEY_BLOCK` keys aligned at
  position 0 with a fixed summation order, so keys past a query's position
  add exact zeros whatever the context length.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["KEY_BLOCK", "MIN_ROWS", "QUERY_CHUNK", "DemoModel", "Generation", "ModelConfig"]

MIN_ROWS = 16
"""Fewest rows a matrix product is computed with (see the module docstring)."""

KEY_BLOCK = 256
"""Keys per attention block: every key-side product has this shape."""

QUERY_CHUNK = 256
"""Query rows per attention chunk (bounds the memory of the scores)."""


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

        Notes
        -----
        Writes the keys and values of ``tokens`` into their cache slots.
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
        pos = torch.arange(start, end)
        rows = max(n, MIN_ROWS)
        # Padding rows repeat the last position: they attend like it, and are dropped.
        qpos = torch.cat([pos, pos[-1:].expand(rows - n)])
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        x = self.embed[torch.cat([ids, ids[-1:].expand(rows - n)])]
        slots = table[pos // block_tokens] * block_tokens + pos % block_tokens
        ctx = torch.arange(end)
        ctx_slots = table[ctx // block_tokens] * block_tokens + ctx % block_tokens
        cos, sin = self._cos[qpos], self._sin[qpos]
        chunks = _causal_bias(qpos, end)
        q_width, kv_width = c.heads * c.head_dim, c.kv_heads * c.head_dim
        for layer in range(c.layers):
            h = _rms_norm(x, self.attn_norm[layer], c.norm_eps)
            qkv = F.linear(h, self.qkv[layer])
            q = qkv[:, :q_width].reshape(rows, c.heads, c.head_dim)
            k = qkv[:, q_width : q_width + kv_width].reshape(rows, c.kv_heads, c.head_dim)
            v = qkv[:, q_width + kv_width :].reshape(rows, c.kv_heads, c.head_dim)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            flat = cache[layer].view(2, -1, c.kv_heads, c.head_dim)
            flat[0, slots] = k[:n].to(c.kv_dtype)
            flat[1, slots] = v[:n].to(c.kv_dtype)
            keys, values = flat[0, ctx_slots].float(), flat[1, ctx_slots].float()
            attn = _attention(q, keys, values, chunks)
            x = x + F.linear(attn, self.out[layer])
            h = _rms_norm(x, self.mlp_norm[layer], c.norm_eps)
            gate, up = F.linear(h, self.gate_up[layer]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, self.down[layer])
        # Only the last position's logits are used: sampling needs no others.
        last = _rms_norm(x[n - 1 : n].expand(MIN_ROWS, -1), self.final_norm, c.norm_eps)
        return F.linear(last, self.embed)[0].clone()

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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _causal_bias(qpos: torch.Tensor, total: int) -> list[tuple[int, int, int, torch.Tensor]]:
    """Per query chunk of :func:`_attention`: its rows, key limit and additive mask.

    The mask is 0 where a query may see a key and -inf elsewhere (a key past
    its position, or a padding key past ``total``); adding 0 is exact, so the
    mask changes nothing it lets through. One mask serves every layer.
    """
    rows = qpos.shape[0]
    padded = -(-total // KEY_BLOCK) * KEY_BLOCK
    key_pos = torch.arange(padded)
    chunks = []
    for start in range(0, rows, QUERY_CHUNK):
        # A short last chunk takes rows from before it: products keep MIN_ROWS rows.
        lo = max(0, min(start, rows - MIN_ROWS))
        hi = min(start + QUERY_CHUNK, rows)
        limit = min(padded, (int(qpos[lo:hi].max()) // KEY_BLOCK + 1) * KEY_BLOCK)
        keys = key_pos[None, :limit]
        seen = (keys <= qpos[lo:hi, None]) & (keys < total)
        bias = torch.zeros(hi - lo, limit).masked_fill_(~seen, -math.inf)
        chunks.append((lo, hi, limit, bias))
    return chunks


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: list[tuple[int, int, int, torch.Tensor]],
) -> torch.Tensor:
    """Causal grouped-query attention of ``q`` over the context's ``k`` and ``v``.

    ``q`` is ``(rows, heads, dim)``, ``k`` and ``v`` are ``(T, kv_heads, dim)``.

    Queries go in the chunks of :func:`_causal_bias`; each reads the key blocks
    of :data:`KEY_BLOCK` keys (from position 0, zero-padded to whole blocks) up
    to its last position. A first pass takes the row maxima; a second sums, per
    key block and in block order, the exponentials times the values and (through
    a column of ones beside the values) the exponentials themselves, so every
    key-side product has the same shape whatever ``T``. Keys past a query's
    position give exactly 0 in both sums, so its result does not depend on how
    many keys lie past it, nor on which blocks its chunk skipped.
    """
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    total = k.shape[0]
    padded = -(-total // KEY_BLOCK) * KEY_BLOCK
    kt = torch.zeros(kv_heads, dim, padded)
    kt[:, :, :total] = k.permute(1, 2, 0)
    # The values with a column of ones: one product gives the sum of e @ v and of e.
    vt = torch.zeros(kv_heads, padded, dim + 1)
    vt[:, :total, :dim] = v.permute(1, 0, 2)
    vt[:, :total, dim] = 1.0
    # (kv_heads, group, rows, dim): the queries sharing a key head form one product.
    qg = (q * (1.0 / math.sqrt(dim))).view(rows, kv_heads, group, dim).permute(1, 2, 0, 3)
    out = torch.empty(kv_heads, group, rows, dim)
    for lo, hi, limit, bias in chunks:
        n = hi - lo
        qc = qg[:, :, lo:hi].reshape(kv_heads, group * n, dim)
        scores = torch.bmm(qc, kt[:, :, :limit])
        scores.view(kv_heads, group, n, limit).add_(bias)
        scores.sub_(scores.amax(-1, keepdim=True)).exp_()
        acc = torch.zeros(kv_heads, group * n, dim + 1)
        for b in range(0, limit, KEY_BLOCK):
            acc.baddbmm_(scores[:, :, b : b + KEY_BLOCK], vt[:, b : b + KEY_BLOCK])
        acc = acc.view(kv_heads, group, n, dim + 1)
        out[:, :, lo:hi] = acc[..., :dim] / acc[..., dim:]
    return out.permute(2, 0, 1, 3).reshape(rows, heads * dim)
