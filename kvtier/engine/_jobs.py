"""What the engine's parts share: device ids, the chain's links, jobs and loads in flight.

Small types and functions only, no engine state: a job of bytes on their way into
CPU rows (:class:`_Job`, a store's copy or a promotion) and the loads that claim
its blocks (:class:`_Load`), the waits on completions, the device ids of a window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigurationError
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier
from kvtier.transfer.completion import Completion

log = logging.getLogger("kvtier.engine")

BlockIds = Sequence[int] | np.ndarray | Mapping[int, Sequence[int] | np.ndarray]
"""Device block ids: one sequence used by every KV group, or one per group id."""

_Ids = dict[int, np.ndarray]
"""Validated device block ids, per KV group of the layout."""
_Starter = Callable[[], Completion[None]]


@dataclass(slots=True, eq=False)
class _Link:
    """One tier of the chain below the CPU region (its role: :func:`kvtier.chain.chain_for`)."""

    name: str
    """``file`` or ``cluster``: the name of its statistics."""
    tier: Tier


@dataclass(slots=True, eq=False)
class _Job:
    """Bytes on their way into CPU rows (a device store or a file promotion)."""

    keys: tuple[bytes, ...]
    done: Completion[None]
    ok: set[bytes] = field(default_factory=set)
    claims: list[_Load] = field(default_factory=list)
    """Loads waiting for these blocks. Each takes its own (pins them, starts
    their copy) when the job finishes, before ``done`` resolves: nothing else
    runs in between that could evict them (:meth:`Engine._finish`)."""


@dataclass(slots=True, eq=False)
class _Load:
    """One :meth:`Engine.load` under way."""

    index: dict[bytes, int]
    """Position of each key in the call."""
    ids: _Ids
    skip: int
    end: int
    """Where the prefix ends: the first key known to be a miss (else all keys)."""
    todo: list[bytes]
    """Keys not started yet (waiting for rows to be promoted into), in call order."""
    waits: dict[_Job, list[bytes]] = field(default_factory=dict)
    """Jobs in flight (stores, promotions) and the keys this load takes from each."""
    promoted: set[bytes] = field(default_factory=set)
    """Keys this load promoted itself: if the read fails, they are misses."""
    copies: list[Completion[None]] = field(default_factory=list)
    """Its copies to the device, each done once its rows are unpinned."""
    error: BaseException | None = None
    """The first failed copy's error."""


def _check_chunking(config: KVTierConfig, layout: KVLayout) -> None:
    if config.blocks_per_chunk != layout.blocks_per_chunk:
        raise ConfigurationError(
            f"config.blocks_per_chunk is {config.blocks_per_chunk} but the layout was "
            f"built with blocks_per_chunk={layout.blocks_per_chunk}"
        )


def _guarded(start: _Starter) -> Completion[None]:
    """``start()``, with a synchronous failure turned into a failed completion.

    The callers' done callbacks then roll back state on one path, whether the
    submit or the hardware failed.
    """
    try:
        return start()
    except Exception as exc:
        failed: Completion[None] = Completion()
        failed.set_exception(exc)
        return failed


async def _settle(c: Completion[None]) -> None:
    """Wait for ``c`` without raising its error."""
    with contextlib.suppress(Exception):
        await c


async def _wait(
    pending: list[Completion[None]], *, seconds: float | None = None, first: bool = False
) -> None:
    """Wait until every one (or, with ``first``, any one) of ``pending`` is done,
    or ``seconds``; their errors are not raised."""
    waits = [asyncio.ensure_future(_settle(c)) for c in pending]
    try:
        await asyncio.wait(
            waits,
            timeout=seconds,
            return_when=asyncio.FIRST_COMPLETED if first else asyncio.ALL_COMPLETED,
        )
    finally:
        for w in waits:  # what is left is only a watcher: the work itself goes on
            w.cancel()


def _chunk_ids(ids: _Ids, chunks: list[int], bpc: int) -> _Ids:
    """The device ids of the chosen offloaded blocks, in the chosen order."""
    sel = (np.asarray(chunks, dtype=np.int64)[:, None] * bpc + np.arange(bpc)).ravel()
    return {g: a[sel] for g, a in ids.items()}


def _window_ids(ids: _Ids, where: list[int], bpc: int, skip: int) -> _Ids:
    """The device ids of the offloaded blocks at positions ``where`` (ascending) of a load.

    The first block of the load has ``bpc - skip`` ids, every other ``bpc``.
    """
    at = (np.asarray(where, dtype=np.int64)[:, None] * bpc + np.arange(bpc) - skip).ravel()
    at = at[at >= 0]
    return {g: a[at] for g, a in ids.items()}
