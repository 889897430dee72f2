"""What the chain says and hears: answers, lower-tier specs, intents and outcomes.

A front asks the chain (:class:`~kvtier.chain.Chain`) and gets an
:class:`Answer` per key; the chain hands its decisions out as *intents*
(:class:`Write`, :class:`Read`, :class:`Probe`) for a driver to carry out on
the tiers' loop, and takes their *outcomes* back (:class:`Written`,
:class:`ReadDone`, :class:`Probed`, and :class:`TierChanged` for what a tier
changed on its own). Each intent carries the chain's sequence number
(``seq``); its outcome names the intent, and nothing is matched by ``id()``.
All are frozen values: they cross from the chain's thread to the tiers' loop
and back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "Answer",
    "Intent",
    "LowerTier",
    "Outcome",
    "Probe",
    "Probed",
    "Read",
    "ReadDone",
    "TierChanged",
    "Write",
    "Written",
]


class Answer(enum.Enum):
    """What :meth:`~kvtier.chain.Chain.lookup` says of one block."""

    HIT = "hit"
    """Ready in a CPU row: load it now."""
    PENDING = "pending"
    """Its store from the device is in flight: it will be a hit."""
    RETRY = "retry"
    """A lower tier is being read or asked: ask again at a later step."""
    MISS = "miss"
    """No tier can serve it (or not in time): recompute it."""


@dataclass(frozen=True, slots=True)
class LowerTier:
    """A tier below the CPU region, as the chain sees it (no object of the tier itself)."""

    name: str
    """``"file"``, ``"cluster"``: its name in statistics and logs."""
    shared: bool = False
    """Other instances write it too: keys this instance does not know are probed."""
    takes_stores: bool = True
    """Blocks stored from the device are written through to it."""
    promote_up: bool = False
    """A block promoted from it also goes to the tiers above it."""
    write_back: bool = False
    """A block stored from the device reaches it only when the CPU tier evicts
    it (:class:`Write` with ``evicting``) or at close (:meth:`~kvtier.chain.Chain.write_back`),
    not at once. For fronts that can hold a row's reuse until that write ends
    (the Engine); vLLM's synchronous ``prepare_store`` cannot."""


# -- intents and outcomes ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Write:
    """Write the blocks of these CPU rows to a tier; the rows stay pinned until :class:`Written`."""

    tier: int
    """Index of the tier in the chain's lower tiers."""
    keys: tuple[bytes, ...]
    rows: tuple[int, ...]
    """CPU row of each key."""
    evicting: bool = False
    """A write-back of blocks the CPU tier just evicted: their rows already
    belong to the blocks placed in them, which must not be copied in until
    this write ends (:meth:`~kvtier.chain.Chain.evicting_writes`); no pin is held."""
    seq: int = 0
    """The chain's number for this intent (unique per chain): its outcome names
    the intent, and a front matches the two by this number."""
    given: bool = False
    """``rows`` are slots a front's own CPU tier holds stable until this write
    settles (:meth:`~kvtier.chain.Chain.write_from`), not the chain's CPU rows:
    no pin of the chain's is held."""


@dataclass(frozen=True, slots=True)
class Read:
    """Read blocks from a tier into reserved CPU rows (a promotion)."""

    tier: int
    keys: tuple[bytes, ...]
    rows: tuple[int, ...]
    """CPU row of each key."""
    seq: int = 0
    """As :attr:`Write.seq`."""
    follows: int = 0
    """The ``seq`` of the read whose undelivered blocks this one reads from a
    lower tier, into the same rows (see :meth:`~kvtier.chain.Chain.follow_ups`); 0 for a
    first read."""
    given: bool = False
    """``rows`` are slots of a front's own CPU tier (:meth:`~kvtier.chain.Chain.read_into`),
    not the chain's CPU rows: what it delivers is the front's, never a CPU-tier block."""


@dataclass(frozen=True, slots=True)
class Probe:
    """Ask a shared tier which of these keys it holds (no rows involved)."""

    tier: int
    keys: tuple[bytes, ...]
    seq: int = 0
    """As :attr:`Write.seq`."""


Intent = Write | Read | Probe


@dataclass(frozen=True, slots=True)
class Written:
    """The outcome of a :class:`Write`."""

    intent: Write
    stored: frozenset[bytes]
    """Keys the tier now holds (written, or already there)."""
    evicted: tuple[bytes, ...] = ()
    """Keys the tier evicted to make room."""


@dataclass(frozen=True, slots=True)
class ReadDone:
    """The outcome of a :class:`Read`."""

    intent: Read
    loaded: frozenset[bytes]
    """Keys whose rows now hold their verified bytes; the others are misses."""


@dataclass(frozen=True, slots=True)
class Probed:
    """The outcome of a :class:`Probe`."""

    intent: Probe
    present: frozenset[bytes]
    """Keys the tier holds (a hint: one may vanish before it is read)."""


@dataclass(frozen=True, slots=True)
class TierChanged:
    """A tier's residency changed on its own: recovery found blocks, or it dropped some."""

    tier: int
    added: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    recovered: bool = False
    """Its recovery at open ended (``added`` is what it found): it takes writes
    again (see :meth:`~kvtier.chain.Chain.recovering`)."""


Outcome = Written | ReadDone | Probed | TierChanged
