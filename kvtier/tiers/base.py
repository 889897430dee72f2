"""The contract of every tier below the CPU region.

A tier holds whole blocks (one CPU-region row each) under 16-byte block keys,
and moves them between its own storage and caller buffers. The file tier
(:class:`~kvtier.tiers.file.FileTier`) and the cluster tier
(:class:`~kvtier.tiers.cluster.ClusterTier`) are two implementations of
:class:`Tier`; :class:`kvtier.testing.tier.TierSuite` is the one conformance
suite both pass. The engine (also as the scheduler side of the process
split) drives an ordered chain of them through this contract alone.

Two kinds of method::

    no I/O, answer now                   I/O, return a Completion at once
    ------------------                   -------------------------------
    lookup(keys) -> int                  store(keys, buffers) -> Completion[StoreResult]
    is_ready(key) / key in tier          load(keys, buffers)  -> Completion[LoadResult]
    touch(keys), remove(keys)            aclose()  (a coroutine: waits for what is in flight)
    statistics(), capabilities

Per-key outcomes are values, never raised: a block that could not be stored
is in :attr:`StoreResult.failed`, one that could not be loaded (absent,
vanished, damaged, a fault) is in :attr:`LoadResult.missing`, each with a
typed :class:`~kvtier.errors.KVTierError`. Only misuse raises: bad arguments
(:class:`~kvtier.errors.InvalidArgumentError`,
:class:`~kvtier.errors.AlignmentError`) before any I/O, and calls on a closed
tier (:class:`~kvtier.errors.ClosedError`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvtier.errors import KVTierError
from kvtier.manager.events import ManagerEvent
from kvtier.transfer.completion import Completion

__all__ = [
    "Announces",
    "HasMetrics",
    "LoadResult",
    "Recovers",
    "Refreshable",
    "StoreResult",
    "Tier",
    "TierStatistics",
    "Watched",
]


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Outcome of one :meth:`Tier.store`, per key."""

    stored: tuple[bytes, ...]
    """Keys written and now ready."""
    skipped: tuple[bytes, ...]
    """Keys already present (ready or being written): nothing was written."""
    failed: Mapping[bytes, KVTierError]
    """Keys not stored, with why (:class:`~kvtier.errors.TierIOError` with errno and
    path, or :class:`~kvtier.errors.CapacityError`); their slots were freed."""
    evicted: tuple[bytes, ...] = ()
    """Keys evicted to make room (their slots now hold the new blocks)."""


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Outcome of one :meth:`Tier.load`, per key."""

    loaded: tuple[bytes, ...]
    """Keys whose bytes are now in their buffers, verified."""
    missing: Mapping[bytes, KVTierError]
    """Keys whose buffers hold no valid data, with why:
    :class:`~kvtier.errors.BlockNotFoundError` (not resident),
    :class:`~kvtier.errors.IntegrityError` or
    :class:`~kvtier.errors.NamespaceMismatchError` (block quarantined), or
    :class:`~kvtier.errors.TierIOError` (errno and path)."""


@runtime_checkable
class TierStatistics(Protocol):
    """What every tier's ``statistics()`` snapshot reports, whatever else it adds.

    Each tier returns its own frozen dataclass (the file tier's slot geometry,
    the cluster tier's round trips); these fields are common to all.
    """

    @property
    def blocks(self) -> int:
        """Blocks this tier instance knows to be present (ready or being written)."""
        ...

    @property
    def block_bytes(self) -> int:
        """Payload bytes per block."""
        ...

    @property
    def hits(self) -> int:
        """Blocks loaded and verified."""
        ...

    @property
    def misses(self) -> int:
        """Blocks asked for and not loaded (absent, vanished, damaged or failed)."""
        ...

    @property
    def stores(self) -> int:
        """Blocks written."""
        ...

    @property
    def store_failures(self) -> int:
        """Blocks whose write failed."""
        ...

    @property
    def bytes_read(self) -> int:
        """Payload bytes of successful loads."""
        ...

    @property
    def bytes_written(self) -> int:
        """Payload bytes of successful stores."""
        ...


@runtime_checkable
class Refreshable(Protocol):
    """A tier whose :meth:`Tier.lookup` answers from local knowledge that I/O can renew.

    A shared tier (the cluster tier) does not see what peers store until it
    asks; the engine's :meth:`~kvtier.engine.Engine.refresh` asks every tier
    of its chain that has this ability.
    """

    async def refresh(self, keys: Sequence[bytes]) -> int:
        """Learn which of ``keys`` the tier holds; return :meth:`Tier.lookup` of them.

        A failure to ask leaves keys unknown (a hint is not worth failing a
        request for); only misuse raises (bad keys, a closed tier).
        """
        ...


@runtime_checkable
class Announces(Protocol):
    """A tier that records its residency events (opened with ``enable_events``)."""

    def take_events(self) -> list[ManagerEvent]:
        """Residency events since the last call (blocks stored, evicted, quarantined)."""
        ...


@runtime_checkable
class HasMetrics(Protocol):
    """A tier's statistics record that adds figures of its own to kvtier's metrics."""

    def metric_figures(self) -> dict[str, int | float | str]:
        """Figures by series name without ``kvtier_`` (:data:`kvtier.metrics.OWN_FIGURES`)."""
        ...


@runtime_checkable
class Watched(Protocol):
    """A tier whose blocks change without this instance's doing, and that says so.

    The file tier on a root shared by live instances: the other instances'
    blocks become loadable (and stop being so) as they store and evict. A
    scheduler side that mirrors the tier's residency on another thread
    (:class:`~kvtier.chain.Chain`) follows them through a listener.
    """

    def watch(self, listener: Callable[[Sequence[bytes], Sequence[bytes]], None]) -> None:
        """Call ``listener(added, removed)`` on the tier's loop as such blocks come and go,
        first with every such block known now."""
        ...


@runtime_checkable
class Recovers(Protocol):
    """A tier that finds its blocks again at open (the file tier's slot file).

    A scheduler side that mirrors the tier's residency on another thread
    (:class:`~kvtier.chain.Chain`) seeds itself with what was found.
    """

    async def wait_recovered(self) -> None:
        """Return once the blocks found at open are known (at once if they are)."""
        ...

    def take_recovered_keys(self) -> list[bytes]:
        """The keys found at open and still held; once (later calls: ``[]``)."""
        ...


class Tier(ABC):
    """A store of whole blocks below the CPU region, staged through CPU-region rows.

    Implementations open with an async classmethod and close with
    :meth:`aclose`; every method is called from the event loop the tier was
    opened on.

    Notes
    -----
    **Buffers and cancellation.** :meth:`store` and :meth:`load` return a
    :class:`~kvtier.transfer.completion.Completion` as soon as the work is
    submitted. Cancelling a task that awaits it does not cancel the work: the
    buffers are read (store) or written (load) until the completion is done,
    so they stay reserved until then; release rows from
    :meth:`~kvtier.transfer.completion.Completion.add_done_callback`, not
    after an ``await`` that may never return.

    **Visibility.** A block being written is not ready (:meth:`lookup` does
    not count it) until its write completed. A block :meth:`lookup` counted
    may still be gone when it is loaded (evicted by the tier, or, for a
    shared tier, by its server): it is then in ``missing``, never an error.

    **Verification.** Every value read back is verified (header, key,
    namespace, length, payload checksum) before :meth:`load` reports it
    loaded; one that fails is a miss, counted, forgotten, and never served.
    """

    __slots__ = ()

    # -- capabilities -------------------------------------------------------------------

    @property
    @abstractmethod
    def block_bytes(self) -> int:
        """Payload bytes of every block (one CPU-region row)."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once :meth:`aclose` has started."""

    @property
    @abstractmethod
    def recovering(self) -> bool:
        """True while the tier is still learning what it holds.

        Until it is False, lookups may miss blocks the tier has and stores may
        be refused (each key failing with :class:`~kvtier.errors.BusyError`).
        """

    @property
    def shared(self) -> bool:
        """True when other tier instances (other processes, machines) see its blocks.

        A shared tier's contents change behind this instance's back: a
        block may appear (stored by a peer) or vanish (evicted by the server)
        between :meth:`lookup` and :meth:`load`. False by default.
        """
        return False

    # -- queries (no I/O) ---------------------------------------------------------------

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` that is ready here; no I/O.

        Parameters
        ----------
        keys
            Block keys in chain order.

        Returns
        -------
        int
            How many leading keys a :meth:`load` may find. A hint for a shared
            tier: what it returns may be gone at load time.
        """

    @abstractmethod
    def is_ready(self, key: bytes) -> bool:
        """True when ``key``'s block is complete here and may be loaded; no I/O."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """True when ``key`` is present (ready or being written); no I/O."""

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks used, as a hit would, without loading them; absent keys are ignored."""

    @abstractmethod
    def statistics(self) -> TierStatistics:
        """A snapshot of the tier's state and counters (a frozen dataclass)."""

    # -- moving bytes -------------------------------------------------------------------

    @abstractmethod
    def store(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Completion[StoreResult]:
        """Write one block from each buffer; keys already present are skipped.

        Parameters
        ----------
        keys
            Distinct 16-byte block keys.
        buffers
            One buffer of exactly :attr:`block_bytes` per key (a CPU-region row).

        Returns
        -------
        Completion[StoreResult]
            Resolves once every block is written or has failed; per-key
            outcomes in the result (``stored``, ``skipped``, ``failed`` with a
            typed error, ``evicted``), never raised.

        Raises
        ------
        InvalidArgumentError
            For bad or duplicate keys, a count mismatch, or a buffer of the
            wrong size or layout; nothing is written and nothing stored is lost.
        AlignmentError
            For a buffer that breaks the tier's alignment (before any I/O).
        ClosedError
            When the tier is closed.

        Notes
        -----
        The buffers are read until the completion is done; cancelling an
        awaiter does not stop the write (see the class Notes). A block whose
        write fails is not visible and its key may be stored again.
        """

    @abstractmethod
    def load(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> Completion[LoadResult]:
        """Read blocks into ``buffers`` and verify them.

        Parameters
        ----------
        keys
            Distinct 16-byte block keys.
        buffers
            One writable buffer of exactly :attr:`block_bytes` per key.

        Returns
        -------
        Completion[LoadResult]
            Resolves once every block is read and verified or has failed.
            ``loaded`` keys' buffers hold their verified bytes; ``missing``
            keys' buffers hold no valid data, with why:
            :class:`~kvtier.errors.BlockNotFoundError` (absent or vanished),
            :class:`~kvtier.errors.IntegrityError` or
            :class:`~kvtier.errors.NamespaceMismatchError` (the stored value
            failed verification: counted and forgotten), or
            :class:`~kvtier.errors.TierIOError` (an I/O or network fault).

        Raises
        ------
        InvalidArgumentError
            For bad or duplicate keys, a count mismatch, or a buffer of the
            wrong size or read-only.
        AlignmentError
            For a buffer that breaks the tier's alignment (before any I/O).
        ClosedError
            When the tier is closed.

        Notes
        -----
        The buffers are written until the completion is done; cancelling an
        awaiter does not stop the read (see the class Notes).
        """

    @abstractmethod
    def remove(self, keys: Sequence[bytes]) -> None:
        """Forget ready blocks (and drop their bytes); absent keys are ignored.

        Returns at once; a tier may drop the bytes in the background. A block
        being loaded keeps its bytes until that load finishes.

        Raises
        ------
        InvalidArgumentError
            For bad keys.
        ClosedError
            When the tier is closed.
        """

    # -- closing ------------------------------------------------------------------------

    @abstractmethod
    async def aclose(self) -> None:
        """Wait for every transfer in flight, then release everything; idempotent.

        Calls made after ``aclose`` started raise
        :class:`~kvtier.errors.ClosedError`. Every completion handed out is
        done when it returns. Cancelling the caller does not stop the close
        from completing.
        """
