"""What the demo checks of every request: what kvtier guarantees, on any CPU.

kvtier moves bytes: a block it loads must be, byte for byte, the block that was
stored under its key. :class:`BlockLedger` keeps a digest of every block the
demo computed and stored, and each loaded block is compared with it while the
request still holds it. Then the outputs: the greedy tokens must be those of a
full recompute, and the first token's logits must agree with the recompute's
within :data:`LOGITS_RTOL` of its largest logit. That the logits are equal bit
for bit is reported, not required: it is a property of the model's arithmetic
(see :mod:`kvtier.demo.model`), which the same blocks give on one CPU and may
not on another, where kvtier is no less correct.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["LOGITS_RTOL", "BlockLedger", "Verdict", "block_digest", "judge"]

LOGITS_RTOL = 1e-4
"""Largest difference of the first token's logits from the recompute's, as a
share of the recompute's largest logit (in absolute value).

Rounding differences of float32 grow with the magnitude of the values, so the
tolerance is relative. This model's logits run to a few hundred; a forward
pass that is not chunking invariant moved them by up to 9e-3 on an AVX-512
Xeon (3e-5 of the largest), a zeroed KV block by far more."""


def block_digest(kv: Sequence[torch.Tensor], ids: Sequence[int]) -> bytes:
    """Digest of the bytes of device blocks ``ids`` in every layer's KV tensor.

    Parameters
    ----------
    kv
        The paged KV tensors, ``(2, num_blocks, ...)`` per layer.
    ids
        The device blocks of one offloaded block, in order.

    Returns
    -------
    bytes
        A 16-byte BLAKE2b digest; equal bytes give equal digests.
    """
    h = hashlib.blake2b(digest_size=16)
    index = torch.as_tensor(list(ids), dtype=torch.long)
    for t in kv:
        h.update(t[:, index].contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


class BlockLedger:
    """The digests of the blocks stored under each key.

    A key may be stored more than once (two requests sharing a prefix both
    compute it); every digest stored under it is kept, and a loaded block
    must match one of them.
    """

    def __init__(self) -> None:
        self._digests: dict[bytes, set[bytes]] = {}

    def record(self, key: bytes, digest: bytes) -> None:
        """Note that a block with ``digest`` was stored under ``key``."""
        self._digests.setdefault(key, set()).add(digest)

    def matches(self, key: bytes, digest: bytes) -> bool:
        """Whether a block loaded under ``key`` with ``digest`` is one that was stored."""
        return digest in self._digests.get(key, ())


@dataclass(frozen=True, slots=True)
class Verdict:
    """A served request against its recompute."""

    tokens_identical: bool
    """The greedy tokens are the recompute's."""
    blocks_loaded: int
    """Offloaded blocks loaded and checked against the ledger."""
    blocks_wrong: int
    """Loaded blocks whose bytes were not those stored under their key."""
    logits_difference: float
    """Largest absolute difference of the first token's logits from the recompute's."""
    logits_scale: float
    """Largest absolute logit of the recompute: the tolerance is :data:`LOGITS_RTOL` of it."""
    logits_identical: bool
    """The first token's logits equal the recompute's bit for bit (reported, not required)."""

    @property
    def logits_within(self) -> bool:
        """The logits agree within the tolerance."""
        return self.logits_difference <= LOGITS_RTOL * self.logits_scale

    @property
    def correct(self) -> bool:
        """Every loaded block was the stored one, the tokens and, within the tolerance,
        the logits are the recompute's."""
        return self.tokens_identical and not self.blocks_wrong and self.logits_within


def judge(
    tokens: Sequence[int],
    logits: torch.Tensor,
    ref_tokens: Sequence[int],
    ref_logits: torch.Tensor,
    blocks_loaded: int = 0,
    blocks_wrong: int = 0,
) -> Verdict:
    """Compare a served request with its recompute.

    Parameters
    ----------
    tokens, logits
        The served request's greedy tokens and first-token logits.
    ref_tokens, ref_logits
        The same from the full recompute.
    blocks_loaded, blocks_wrong
        Loaded blocks checked against the :class:`BlockLedger`, and how many
        of them did not match.

    Returns
    -------
    Verdict
        The comparison; :attr:`Verdict.correct` is the demo's pass.

    Raises
    ------
    ValueError
        When the logits' shapes differ.
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits shaped {tuple(logits.shape)} against {tuple(ref_logits.shape)}")
    diff = (logits.double() - ref_logits.double()).abs().max()
    return Verdict(
        tokens_identical=list(tokens) == list(ref_tokens),
        blocks_loaded=blocks_loaded,
        blocks_wrong=blocks_wrong,
        # A NaN anywhere makes the difference infinite: never within any tolerance.
        logits_difference=float(diff) if not diff.isnan() else float("inf"),
        logits_scale=float(ref_logits.abs().max()),
        logits_identical=torch.equal(logits, ref_logits),
    )
