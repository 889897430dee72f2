"""The chain's reads from its lower tiers: made, issued, settled, falling through.

A :class:`Reads` is the part of the chain (:class:`~kvtier.chain.Chain`) that
owns every read in flight: the :class:`Read` intents it makes (one per tier),
when each block's first read began (one deadline per block, whichever tier
reads it), which reads lookups started (their blocks are lookup hits), and
the reads that carry a failed read's blocks on to the tiers below
(:meth:`Reads.follow_ups`). A read into the chain's CPU rows makes its
blocks ready there (or frees their rows); a read into a front's own slots
(``given``) only counts. No I/O: the intents go out through the chain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.chain._decision import LoadDecision
from kvtier.chain._lookups import Lookups
from kvtier.chain._lower import Lower
from kvtier.chain._messages import Intent, Read, ReadDone
from kvtier.chain._write_back import WriteBack
from kvtier.manager import ResidencyManager

__all__ = ["Reads"]


class Reads:
    """The reads in flight of one chain (see the module docstring).

    Parameters
    ----------
    cpu, lower
        The chain's CPU residency and its records of the lower tiers.
    lookups, decision, write_back
        The chain's other parts: who waits on a read, how fast each tier
        reads, which rows are still being written back.
    intents
        The chain's outgoing intents: issued reads are appended to it.
    next_seq
        The chain's intent numbering.
    deadline_s, clock
        ``lookup_deadline_s`` and the chain's clock.
    hold_s, keep_s
        How long a block a lookup's read delivered stays pinned for the request
        that waits on it (until it loads it), whatever else needs its row; and
        how long it is kept for that request after that, while a placement can
        still find a row elsewhere (:meth:`yield_holds`). Other requests' stores
        and reads evict what no waiting request needs first, and a request that
        the engine revisits seconds later still finds its blocks.
    """

    def __init__(
        self,
        cpu: ResidencyManager,
        lower: Sequence[Lower],
        lookups: Lookups,
        decision: LoadDecision,
        write_back: WriteBack,
        intents: list[Intent],
        next_seq: Callable[[], int],
        *,
        deadline_s: float,
        hold_s: float,
        keep_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._cpu = cpu
        self._lower = lower
        self._lookups = lookups
        self._decision = decision
        self._write_back = write_back
        self._intents = intents
        self._next = next_seq
        self._deadline = deadline_s
        self._clock = clock
        self._since: dict[int, float] = {}
        """Reads in flight: when the first read of their blocks was issued (a
        read that follows another keeps that one's time: one deadline per block)."""
        self._follow_ups: dict[int, tuple[Read, ...]] = {}
        """Reads whose undelivered blocks went on to lower tiers, and those reads
        (:meth:`follow_ups`), until one of those settles."""
        self._for_lookups: set[int] = set()
        """Reads that lookups started (vLLM's): a block they deliver is a lookup hit."""
        self._held: dict[bytes, float] = {}
        """Blocks a lookup's read delivered, pinned until their request loads them
        (:meth:`loaded`), ``keep_s`` passes (:meth:`expire`) or, past ``hold_s``,
        a placement needs their row (:meth:`yield_holds`): oldest first."""
        self._hold_s = hold_s
        self._keep_s = max(keep_s, hold_s)

    def make(
        self,
        keys: Sequence[bytes],
        rows: Sequence[int],
        tier_of: Callable[[bytes], int | None],
        follows: int = 0,
        *,
        given: bool = False,
    ) -> list[Read]:
        """One :class:`Read` per tier (in tier order) of ``keys`` into ``rows``."""
        by_tier: dict[int, list[tuple[bytes, int]]] = {}
        for k, slot in zip(keys, rows, strict=True):
            tier = tier_of(k)
            assert tier is not None  # placed just now, known just before
            by_tier.setdefault(tier, []).append((k, slot))
        return [
            Read(
                i,
                tuple(k for k, _s in by_tier[i]),
                tuple(s for _k, s in by_tier[i]),
                self._next(),
                follows=follows,
                given=given,
            )
            for i in sorted(by_tier)
        ]

    def start(
        self,
        keys: Sequence[bytes],
        rows: Sequence[int],
        tier_of: Callable[[bytes], int | None],
        *,
        given: bool = False,
        for_lookup: bool = False,
    ) -> list[Read]:
        """Make and issue the reads of ``keys`` into ``rows`` (:meth:`make`, :meth:`issue`)."""
        reads = self.make(keys, rows, tier_of, given=given)
        for read in reads:
            self.issue(read, for_lookup=for_lookup)
        return reads

    def issue(self, read: Read, since: float | None = None, *, for_lookup: bool = False) -> None:
        """Issue ``read``, or hold it while one of its rows is still being written back.

        ``since``: when its blocks' first read was issued (a read that follows
        another), else now. ``for_lookup``: a lookup waits on its blocks.
        """
        if for_lookup:
            self._for_lookups.add(read.seq)
        self._since.setdefault(read.seq, self._clock() if since is None else since)
        if not read.given and self._write_back.hold(read):
            return
        self._intents.append(read)
        self._decision.read_started(read.tier, len(read.keys))

    def loaded(self, keys: Sequence[bytes]) -> None:
        """``keys`` are pinned for their copy to the device: their holds end."""
        held = self._held
        if held:
            done = [k for k in keys if held.pop(k, None) is not None]
            if done:
                self._cpu.complete_load(done)

    def expire(self) -> None:
        """End the holds older than ``keep_s`` (their request never came back)."""
        self._end(self._keep_s, len(self._held))

    def yield_holds(self, n: int) -> int:
        """End up to ``n`` of the oldest holds older than ``hold_s``, for a placement
        that finds no other row; how many ended."""
        return self._end(self._hold_s, n)

    def _end(self, older_than: float, n: int) -> int:
        held, now = self._held, self._clock()
        done: list[bytes] = []
        while held and len(done) < n:
            k, since = next(iter(held.items()))
            if now - since < older_than:
                break
            del held[k]
            done.append(k)
        if done:
            self._cpu.complete_load(done)
        return len(done)

    def release(self) -> None:
        """End every hold (before a reset of the CPU tier)."""
        held, self._held = self._held, {}
        if held:
            self._cpu.complete_load(list(held))

    def follow_ups(self, read: Read) -> tuple[Read, ...]:
        """The reads carrying on ``read``'s undelivered blocks (see
        :meth:`Chain.follow_ups <kvtier.chain.Chain.follow_ups>`)."""
        return self._follow_ups.get(read.seq, ())

    def settle(self, done: ReadDone) -> list[bytes]:
        """Apply a read's outcome; the blocks it delivered into CPU rows from a tier
        that promotes up (the chain writes them to the tiers above)."""
        read = done.intent
        tier = self._lower[read.tier]
        good = [k for k in read.keys if k in done.loaded]
        self._decision.read_ended(read.tier, len(read.keys), len(good))
        bad = [k for k in read.keys if k not in done.loaded]
        since = self._since.pop(read.seq, None)
        if read.follows:
            self._follow_ups.pop(read.follows, None)  # its front has asked by now
        lookup = read.seq in self._for_lookups
        self._for_lookups.discard(read.seq)
        cpu = not read.given
        tier.counts.read_blocks += len(good)
        if good and cpu:
            self._cpu.complete_store(good, True)
            self._lookups.delivered(good)
            if lookup and self._hold_s > 0:
                self._cpu.prepare_load(good)  # held for the request that waits on them
                now = self._clock()
                for k in good:
                    if k in self._held:  # held already: one pin per block
                        self._cpu.complete_load((k,))
                    self._held[k] = now
        if lookup:  # (a front's own promotions were counted by prefix)
            tier.counts.lookup_hits += len(good)
        again: set[bytes] = set()
        if bad:
            tier.counts.read_failures += len(bad)
            tier.forget(bad)  # vanished, damaged or unreachable
            again = self._fall_through(read, bad, since, lookup)
            lost = [k for k in bad if k not in again]
            if lost and cpu:
                self._cpu.complete_store(lost, False)
        self._lookups.ended([k for k in read.keys if k not in again])
        return good if cpu and tier.spec.promote_up and read.tier else []

    def _fall_through(
        self, read: Read, bad: Sequence[bytes], since: float | None, lookup: bool
    ) -> set[bytes]:
        """Read the blocks ``read`` did not deliver from the tiers below its own that
        hold them, into the same rows (still reserved); the keys read again.

        Only tiers below: each block falls through the chain at most once per
        tier, so it ends. A block whose wait (its lookup's, else its first
        read's) is past the deadline is a miss instead: its lookup answers
        MISS by now, and a stalled tier must not hold its row longer.
        """
        now = self._clock()
        lower, lookups = self._lower, self._lookups
        failed = set(bad)
        below_of: dict[bytes, int] = {}
        keys, rows = [], []
        for k, slot in zip(read.keys, read.rows, strict=True):
            if k not in failed:
                continue
            began = lookups.began(k)
            if began is None:
                began = since
            if began is not None and now - began >= self._deadline:
                continue
            below = next((j for j in range(read.tier + 1, len(lower)) if k in lower[j].known), -1)
            if below < 0:
                continue
            below_of[k] = below
            keys.append(k)
            rows.append(slot)
            lookups.moved(k, below)
        if not keys:
            return set()
        reads = self.make(keys, rows, below_of.__getitem__, follows=read.seq, given=read.given)
        for again in reads:
            self.issue(again, since, for_lookup=lookup)
        self._follow_ups[read.seq] = tuple(reads)
        return set(keys)
