"""The engine: what a serving loop embeds.

It is the asyncio front of the chain of tiers (:class:`~kvtier.chain.Chain`,
the same one the vLLM front drives: which key lives where, which copy is
ready, which row is pinned, the cascade), and of the data plane: the device
copies it runs itself, the tiers below the CPU region (file, cluster) through
the front runtime (:class:`~kvtier.chain.Runtime`, inline: the chain's
intents carried out and their outcomes settled on this loop). Decisions are made
synchronously, before the first ``await`` of a call, so a ``lookup`` followed
at once by a ``load`` cannot lose a block in between; the bytes move afterwards,
and every state change that depends on the hardware happens in a completion
callback, never after an ``await`` that a cancelled task would skip.

The package: :class:`Engine` (``_engine``) holds the public calls and mixes in
its parts, each over the engine's state (``_state``: the opened parts, the
chain's intents carried out, device copies): ``_open`` (opening and closing),
``_store`` (stores streaming through the CPU rows) and ``_load`` (loads, their
claims on the jobs in flight, promotion windows); ``_jobs`` holds the small
types and helpers they share; ``_statistics`` the engine's own statistics
record (:class:`EngineCounts`).
"""

from kvtier.engine._engine import Engine
from kvtier.engine._jobs import BlockIds as BlockIds
from kvtier.engine._state import INLINE_COPY_BYTES as INLINE_COPY_BYTES
from kvtier.engine._statistics import EngineCounts
from kvtier.engine._store import StoreSummary

__all__ = ["Engine", "EngineCounts", "StoreSummary"]
