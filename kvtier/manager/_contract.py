"""The residency protocol, documented once: what every residency manager promises, call by call.

:class:`ResidencyContract` holds the docstrings of the two-phase store / load
protocol (:meth:`~ResidencyContract.lookup`, :meth:`~ResidencyContract.prepare_store`,
:meth:`~ResidencyContract.complete_store`, :meth:`~ResidencyContract.prepare_load`,
:meth:`~ResidencyContract.complete_load`, :meth:`~ResidencyContract.touch`,
:meth:`~ResidencyContract.remove`, :meth:`~ResidencyContract.reset`) and no code.
:class:`~kvtier.manager.ResidencyManager` (pure Python) and its compiled twin
:class:`~kvtier.manager.native.NativeResidencyManager` implement it and inherit
these docstrings (``help()``, :func:`inspect.getdoc`). They live apart so that
the managers' modules hold what the calls do, the way a tier implements the
contract of :mod:`kvtier.tiers.base`; ``docs/manager.md`` tells the same for
users.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvtier.manager.plans import LoadPlan, StorePlan

__all__ = ["ResidencyContract"]


class ResidencyContract(ABC):
    """The calls of a residency manager; see :class:`~kvtier.manager.ResidencyManager`."""

    __slots__ = ()

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` that is resident and ready.

        Parameters
        ----------
        keys
            Block keys of one sequence, in chain order.

        Returns
        -------
        int
            ``n`` such that ``keys[:n]`` can be loaded now.

        Raises
        ------
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        A block being written is not a hit. Counts ``n`` hits and
        ``len(keys) - n`` misses in :meth:`statistics`; changes nothing else
        (not even recency: call :meth:`touch` for that). The result may be stale
        by the next call that evicts: pin with :meth:`prepare_load` before use.
        """

    @abstractmethod
    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Reserve slots for the keys not yet resident, evicting as needed.

        Parameters
        ----------
        keys
            Keys of the blocks to store. Keys already resident in any state are
            skipped (their data is, or is about to be, there).

        Returns
        -------
        StorePlan or None
            The keys to write and their slots (in the order of ``keys``), and
            the blocks evicted to make room with the slots they held; an empty
            plan when every key is resident. None when the new blocks cannot
            all be placed: then nothing changed.

        Raises
        ------
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        The new blocks are *being written*: not hits, not loadable, not
        evictable, until :meth:`complete_store`. Eviction takes just enough
        ready, unpinned blocks, as the policy orders them, and never one of
        ``keys``. Evicted blocks are gone on return (a :class:`BlockRemoved`
        event records them); a write-back tier copies each victim's row out of
        ``evicted_slots`` before it writes the new block into that slot.
        """

    @abstractmethod
    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """Finish stores: the blocks become ready, or (on failure) are forgotten.

        Parameters
        ----------
        keys
            Keys from one or more :class:`StorePlan` s, each completed once.
        success
            Whether the data reached the slots. On failure the blocks are freed
            as if never stored.

        Raises
        ------
        ProtocolError
            When a key is not being written (never prepared, or completed
            already); nothing changes.
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        Ready blocks enter the policy as most recently used, the first key most
        recent of all. A block removed (:meth:`remove`) while being written is
        freed here whatever ``success`` says and never becomes ready.
        """

    @abstractmethod
    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        """Pin ready blocks for reading and return their slots.

        Parameters
        ----------
        keys
            Keys of resident, ready blocks.

        Returns
        -------
        LoadPlan
            The keys and their slots, in the order of ``keys``.

        Raises
        ------
        BlockNotFoundError
            When a key is not resident, or not ready; nothing is pinned.
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        Each call adds one pin per block; a pinned block is not evicted and its
        slot not reused until as many :meth:`complete_load` calls released it.
        Pinning is also how a tier holds a block still while it copies it
        elsewhere (a CPU row being written to the file tier). Recency is not
        changed: call :meth:`touch`.
        """

    @abstractmethod
    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Release one pin of each block (its load finished, or failed).

        Raises
        ------
        ProtocolError
            When a key is not pinned (more completions than prepares); nothing
            changes.
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        A block whose last pin goes becomes evictable again; a block removed
        while pinned is freed now.
        """

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks used: the first key ends up the most recently used.

        Raises
        ------
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        Keys that are not resident are ignored, and so are blocks being
        written (they enter the order when they become ready). Prefixes should
        outlive their tails, hence the order: ``touch(keys)`` leaves
        ``keys[0]`` the last to go. Under ARC a touch is a second use: a block
        in T1 moves to T2. A block that was just stored has had its first use;
        touch the blocks a request *hit*.
        """

    @abstractmethod
    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        """Forget blocks known to be bad (failed verification); absent keys are ignored.

        Returns
        -------
        list[bytes]
            The keys this call removed, in the order of ``keys``.

        Raises
        ------
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        A removed block is at once no hit and not loadable, and a
        :class:`BlockRemoved` event records it if it was ready. Its slot stays
        taken while the hardware may still use it: a block pinned by loads is
        freed by its last :meth:`complete_load`, a block being written by its
        :meth:`complete_store` (which then never makes it ready). So a load that
        fails verification may call ``complete_load`` and ``remove`` in either
        order. Until the slot is freed the key stays resident (``key in
        manager``) and :meth:`prepare_store` skips it.
        """

    @abstractmethod
    def reset(self) -> None:
        """Forget every block and zero the counters.

        Raises
        ------
        BusyError
            While a block is pinned or being written: its slot is in the
            hardware's hands, and forgetting it would let a new block reuse it.

        Notes
        -----
        A :class:`BlockRemoved` event records the ready blocks, in slot order.
        """
