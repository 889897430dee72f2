"""Write-back: what each write-back tier is owed, and the CPU rows its writes hold.

A lower tier with ``write_back`` is given a block only when the CPU tier
evicts it, or at close. The chain (:class:`~kvtier.chain.Chain`) owns one
:class:`WriteBack` that keeps, per such tier, the ready CPU blocks it has not
been given (*owed*), and, across tiers, the rows whose evicted block is being
written back: such a row already belongs to the block placed in it, whose
bytes must not land in it until that write ends (a read into it is held here;
a front's copy waits on :meth:`WriteBack.waits_for`).

While a tier recovers at open it refuses writes: the blocks it is owed stay
pinned in their CPU rows until its recovery ends (evicted, they would go to a
write the tier refuses, and their only copy would be lost).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.chain._lower import Lower
from kvtier.chain._messages import Read, Write
from kvtier.manager import ResidencyManager, StorePlan

__all__ = ["WriteBack"]


class WriteBack:
    """The write-back tiers' owed blocks and the rows their writes hold (see the module).

    Parameters
    ----------
    cpu
        The CPU tier's residency (the chain's): pins against eviction.
    lower
        The chain's records of its lower tiers (their keys, counts, recovery).
    next_seq
        The chain's intent numbers.
    """

    def __init__(
        self, cpu: ResidencyManager, lower: Sequence[Lower], next_seq: Callable[[], int]
    ) -> None:
        self._cpu = cpu
        self._lower = lower
        self._next = next_seq
        self._owed: list[dict[bytes, None]] = [{} for _ in lower]
        """Per tier: ready CPU blocks it has not been given yet."""
        self._held: list[dict[bytes, None]] = [{} for _ in lower]
        """Per tier, while it recovers: owed blocks pinned in their CPU rows."""
        self._evicting: dict[int, Write] = {}
        """CPU rows whose evicted block is being written back, and that write."""
        self._deferred: list[Read] = []
        """Reads into rows whose evicted block is still being written back."""

    @property
    def busy(self) -> bool:
        """A write-back holds rows, or reads wait for one."""
        return bool(self._evicting or self._deferred)

    def owe(self, index: int, keys: Sequence[bytes]) -> None:
        """Lower tier ``index`` is owed ready CPU blocks ``keys`` (written when evicted)."""
        self._owed[index].update(dict.fromkeys(keys))
        if self._lower[index].recovering:
            held = self._held[index]
            hold = [k for k in dict.fromkeys(keys) if k not in held]
            if hold:
                self._cpu.prepare_load(hold)  # a pin against eviction, not a load
                held.update(dict.fromkeys(hold))

    def orphaned(self, index: int, keys: Sequence[bytes]) -> None:
        """Lower tier ``index`` dropped ``keys`` (evicted, or a peer's partition went):
        a block still ready in a CPU row has its only copy there again, so a
        write-back tier is owed it (written when the CPU tier evicts it, or at close)."""
        tier = self._lower[index]
        if not keys or not tier.spec.write_back:
            return
        is_ready, owed = self._cpu.is_ready, self._owed[index]
        todo = [k for k in keys if k not in tier.known and k not in owed and is_ready(k)]
        if todo:
            self.owe(index, todo)

    def evicted(self, plan: StorePlan) -> list[Write]:
        """The writes of the blocks ``plan`` evicted that a write-back tier lacks: each
        victim whose only copy is its row goes to that tier first, and its row is
        not reused until the write ends."""
        writes: list[Write] = []
        slot_of: dict[bytes, int] | None = None
        for i, owed in enumerate(self._owed):
            if not owed:
                continue
            if slot_of is None:
                slot_of = dict(zip(plan.evicted, plan.evicted_slots, strict=True))
            victims = [k for k in plan.evicted if k in owed]
            for k in victims:
                del owed[k]
            tier = self._lower[i]
            victims = [k for k in victims if k not in tier.known]
            if not victims:
                continue
            tier.counts.write_backs += len(victims)
            w = Write(
                i,
                tuple(victims),
                tuple(slot_of[k] for k in victims),
                evicting=True,
                seq=self._next(),
            )
            writes.append(w)
            for slot in w.rows:
                self._evicting[slot] = w
        return writes

    def waits_for(self, plan: StorePlan) -> tuple[Write, ...]:
        """The write-backs the rows of ``plan`` wait for (their evicted blocks)."""
        if not self._evicting:
            return ()  # the usual case, on every store's path
        out: dict[int, Write] = {}
        for slot in plan.slots:
            w = self._evicting.get(slot)
            if w is not None:
                out[w.seq] = w
        return tuple(out.values())

    def hold(self, read: Read) -> bool:
        """Whether ``read`` must wait: one of its rows is still being written back
        (it is released by the :meth:`written` of that write)."""
        if self._evicting and any(s in self._evicting for s in read.rows):
            self._deferred.append(read)
            return True
        return False

    def written(self, write: Write) -> list[Read]:
        """An evicting ``write`` ended: its rows are free; the reads held until now."""
        for slot in write.rows:
            if self._evicting.get(slot) is write:
                del self._evicting[slot]
        held, self._deferred = self._deferred, []
        return held

    def recovered(self, index: int) -> None:
        """Lower tier ``index``'s recovery ended: the blocks it is owed may be evicted."""
        held = self._held[index]
        if held:
            keys = list(held)
            held.clear()
            self._cpu.complete_load(keys)

    def at_close(self) -> list[tuple[int, list[bytes]]]:
        """What each write-back tier is owed and lacks now (counted): hand it over."""
        out = []
        for i, owed in enumerate(self._owed):
            self.recovered(i)
            if not owed:
                continue
            tier = self._lower[i]
            ready = [k for k in owed if self._cpu.is_ready(k) and k not in tier.known]
            owed.clear()
            if ready:
                tier.counts.write_backs += len(ready)
                out.append((i, ready))
        return out

    def abandon(self) -> int:
        """Forget what the write-back tiers were owed (a close's timeout); how many blocks."""
        left = {k for owed in self._owed for k in owed if self._cpu.is_ready(k)}
        for i, owed in enumerate(self._owed):
            self.recovered(i)
            owed.clear()
        return len(left)
