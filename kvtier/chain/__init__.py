"""The scheduler core: the chain of tiers, and the one runtime every front calls.

What the fronts (the :class:`~kvtier.engine.Engine`, the vLLM front) use, and
only that, is named here; the parts are private modules, each an object the
core owns::

    front ──calls──> Runtime (_runtime) ──values back──> front
                       │  takes intents, settles outcomes
                       ├── Chain (_core): the CPU tier's residency, the cascade
                       │     ├── Reads (_reads): reads in flight, falling through
                       │     ├── Writes (_writes): write-through, write-back, given writes
                       │     ├── Lookups (_lookups): the fronts' lookups and their waits
                       │     ├── LoadDecision (_decision): load or recompute
                       │     ├── Deadlines (_deadlines): per-request deadlines, row limit
                       │     └── WriteBack (_write_back): what write-back tiers are owed
                       └── TierDriver (_driver): intents carried out on the tiers' loop

* :class:`Chain` decides, synchronously and without I/O, where every block
  is and what to do next; it answers lookups (:class:`Answer`) and hands its
  decisions out as intents (:class:`Write`, :class:`Read`, :class:`Probe`),
  each numbered, whose outcomes (:class:`Written`, :class:`ReadDone`,
  :class:`Probed`, :class:`TierChanged`) it settles.
* :class:`Runtime` carries the intents out on the tiers' loop and settles the
  outcomes, inline (the Engine: :class:`Settlement` per intent) or queued
  (vLLM: :meth:`Runtime.drain` returns what it settled, :class:`Settled` and
  :class:`TierEvents`); it never calls into a front. :func:`chain_for` builds
  the chain of a configuration.
* The statistics records, one per level: :class:`TierCounts` and
  :class:`ChainStatistics` (the chain's), :class:`TierReport` and
  :class:`FrontStatistics` (a front's, ``kvtier.FrontStatistics``), with
  :class:`FrontCounts` and :class:`Busy` (what a front counts and times itself).
"""

from kvtier.chain._core import Chain
from kvtier.chain._decision import REMEASURE_S
from kvtier.chain._loop import LoopThread
from kvtier.chain._messages import (
    Answer,
    Intent,
    LowerTier,
    Outcome,
    Probe,
    Probed,
    Read,
    ReadDone,
    TierChanged,
    Write,
    Written,
)
from kvtier.chain._runtime import (
    Arrivals,
    Runtime,
    Settled,
    Settlement,
    TierEvents,
    chain_for,
)
from kvtier.chain._statistics import (
    Busy,
    ChainStatistics,
    FrontCounts,
    FrontStatistics,
    TierCounts,
    TierReport,
)

__all__ = [
    "REMEASURE_S",
    "Answer",
    "Arrivals",
    "Busy",
    "Chain",
    "ChainStatistics",
    "FrontCounts",
    "FrontStatistics",
    "Intent",
    "LoopThread",
    "LowerTier",
    "Outcome",
    "Probe",
    "Probed",
    "Read",
    "ReadDone",
    "Runtime",
    "Settled",
    "Settlement",
    "TierChanged",
    "TierCounts",
    "TierEvents",
    "TierReport",
    "Write",
    "Written",
    "chain_for",
]
