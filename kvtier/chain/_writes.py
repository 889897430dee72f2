"""The chain's writes to its lower tiers: write-through, handed to write-back, given.

A :class:`Writes` is the part of the chain (:class:`~kvtier.chain.Chain`) that
makes every :class:`Write` intent and settles its :class:`Written` outcome:

* **write-through** of ready CPU blocks (a store, or a promotion that goes up
  to the tiers above its own): the row is pinned *for the write*, not for a
  load, until the write ends, so it is neither evicted nor reused meanwhile;
* **write-back** tiers are not written here but owed the blocks
  (:class:`~kvtier.chain._write_back.WriteBack`), and given them when the CPU
  tier evicts them or at close (:meth:`Writes.at_close`);
* **given** writes, from slots of a front's own CPU tier (:mod:`kvtier.below`):
  the front keeps the slots stable until the write settles; nothing is pinned.

What a write stored is learnt by the tier's record (``known``), and what the
tier evicted to take it is forgotten, so a write-back tier is owed again a
block whose only copy is now a CPU row. No I/O: intents go out through the
chain's list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvtier.chain._lower import Lower
from kvtier.chain._messages import Intent, Read, Write, Written
from kvtier.chain._write_back import WriteBack
from kvtier.manager import ResidencyManager

__all__ = ["Writes"]


class Writes:
    """The writes of one chain (see the module docstring).

    Parameters
    ----------
    cpu, lower
        The chain's CPU residency and its records of the lower tiers.
    write_back
        What write-back tiers are owed, and the rows their writes hold.
    issue_read
        Issues a read that waited for a write-back of its rows (the chain's reads).
    intents, next_seq
        The chain's outgoing intents (writes are appended to it) and their numbering.
    """

    def __init__(
        self,
        cpu: ResidencyManager,
        lower: Sequence[Lower],
        write_back: WriteBack,
        issue_read: Callable[[Read], None],
        intents: list[Intent],
        next_seq: Callable[[], int],
    ) -> None:
        self._cpu = cpu
        self._lower = lower
        self._write_back = write_back
        self._issue_read = issue_read
        self._intents = intents
        self._next = next_seq
        self._pins: dict[bytes, int] = {}
        """CPU rows pinned by writes in flight: their keys, and how many writes each."""

    @property
    def pinned(self) -> int:
        """CPU rows that writes in flight pin now."""
        return len(self._pins)

    def down(self, keys: Sequence[bytes], tiers: Iterable[int], *, store: bool) -> None:
        """Write ready CPU blocks ``keys`` to ``tiers`` that lack them (``store``: only
        those that take stores); a write-back tier is owed them instead."""
        for i in tiers:
            tier = self._lower[i]
            if store and not tier.spec.takes_stores:
                continue
            todo = [k for k in keys if k not in tier.known]
            if not todo:
                continue
            if tier.spec.write_back:
                self._write_back.owe(i, todo)  # written when evicted, or at close
                continue
            self._pin_and_write(i, todo)

    def at_close(self) -> int:
        """Hand every write-back tier the ready blocks it lacks; how many."""
        owed = self._write_back.at_close()
        for index, keys in owed:
            self._pin_and_write(index, keys)
        return sum(len(keys) for _i, keys in owed)

    def given(self, keys: Sequence[bytes], rows: Sequence[int]) -> list[Write]:
        """Writes from a front's own slots ``rows`` (one per key) to every tier below
        that takes stores and lacks them, write-back tiers included (that CPU tier
        evicts without telling the chain)."""
        writes = []
        for i, tier in enumerate(self._lower):
            if not tier.spec.takes_stores:
                continue
            known = tier.known
            todo = [(k, r) for k, r in zip(keys, rows, strict=True) if k not in known]
            if not todo:
                continue
            write = Write(
                i,
                tuple(k for k, _r in todo),
                tuple(r for _k, r in todo),
                seq=self._next(),
                given=True,
            )
            self._intents.append(write)
            writes.append(write)
        return writes

    def settle(self, done: Written) -> None:
        """Learn what a write stored and its tier evicted; free the rows it pinned."""
        write = done.intent
        tier = self._lower[write.tier]
        tier.learn(done.stored)
        tier.forget(done.evicted)
        self._write_back.orphaned(write.tier, done.evicted)
        ok = [k for k in write.keys if k in done.stored]
        tier.counts.written_blocks += len(ok)
        tier.counts.write_failures += len(write.keys) - len(ok)
        if write.given:
            return  # a front's slots: no pin of the chain's
        if not write.evicting:
            self._unpin(write.keys)
            return
        for read in self._write_back.written(write):
            self._issue_read(read)  # held again if another of its rows is still written back

    def _pin_and_write(self, index: int, keys: Sequence[bytes]) -> None:
        plan = self._cpu.prepare_load(keys)  # a pin held for the write, not a load
        pins = self._pins
        for k in keys:
            pins[k] = pins.get(k, 0) + 1
        self._intents.append(Write(index, plan.keys, plan.slots, seq=self._next()))

    def _unpin(self, keys: Sequence[bytes]) -> None:
        self._cpu.complete_load(keys)
        pins = self._pins
        for k in keys:
            left = pins[k] - 1
            if left:
                pins[k] = left
            else:
                del pins[k]
