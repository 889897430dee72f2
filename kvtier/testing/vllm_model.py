"""Tiny randomly initialised models saved with ``transformers``, for vLLM tests and benchmarks.

No download and no tokenizer: vLLM runs them with ``skip_tokenizer_init=True``
and prompt token ids. ``torch`` and ``transformers`` are imported inside the
functions, so importing this module (or :mod:`kvtier.testing`) needs neither.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["build_tiny_gemma2", "build_tiny_llama"]


def build_tiny_llama(
    path: Path,
    *,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 1024,
    max_positions: int = 8192,
    seed: int = 0,
) -> Path:
    """Save a random float32 Llama under ``path`` and return ``path``.

    Parameters
    ----------
    path
        The directory to write (``config.json`` and the weights).
    hidden, layers, heads, kv_heads
        The model's width, depth and attention heads (``kv_heads`` < ``heads``
        gives grouped-query attention, as most served models use).
    intermediate
        The MLP width; ``2 * hidden`` when None.
    vocab, max_positions
        Vocabulary size (prompts are token ids below it) and the longest context.
    seed
        Seeds torch, so two calls build the same weights.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found,unused-ignore]

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def build_tiny_gemma2(
    path: Path,
    *,
    hidden: int = 256,
    layers: int = 4,
    sliding_window: int = 256,
    vocab: int = 1024,
    seed: int = 0,
) -> Path:
    """Save a random float32 Gemma2 under ``path``: a hybrid model.

    Gemma2 alternates sliding-window and full-attention layers, so vLLM's
    hybrid KV cache manager gives it two KV cache groups (one per attention
    kind), each with its own block table and its own offload keys.
    """
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM  # type: ignore[import-not-found,unused-ignore]

    torch.manual_seed(seed)
    config = Gemma2Config(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=vocab,
        max_position_embeddings=8192,
        sliding_window=sliding_window,
        torch_dtype="float32",
    )
    Gemma2ForCausalLM(config).save_pretrained(path)
    return path
