"""The tier's side of a shared root: other partitions' blocks in its lookups, loads and listeners.

Several instances can open one root, each its own partition of a namespace
(:mod:`kvtier.tiers.file._peers` reads the others'). What the tier does with
them is here, in :class:`Sharing`: a lookup that goes on past the tier's own
blocks into theirs, a load split between the tier's pipeline and theirs and
joined into one result, the ``watch`` listeners told every ``peer_poll_s`` as
their blocks come and go, and the timer that polls them.

Apart from the facade because it is one concern with its own state (the
listeners, the timer, the split loads in flight); the facade makes one call
into it per call, never per block, and a root nobody shares costs a lookup
and a load one ``if`` each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from kvtier.errors import KVTierError
from kvtier.manager import ResidencyManager
from kvtier.tiers.base import LoadResult
from kvtier.tiers.file._peers import RESCAN_S, Peers
from kvtier.tiers.file._pipeline import Pipeline
from kvtier.transfer.completion import Completion

__all__ = ["Listener", "Sharing"]

log = logging.getLogger("kvtier.file_tier")

Listener = Callable[[Sequence[bytes], Sequence[bytes]], None]
"""Called with the keys that became loadable from other partitions and those that stopped."""


class Sharing:
    """Lookups, loads and listeners over the tier's own blocks and other partitions'.

    Made at open: it takes what other partitions hold now (``watch`` hands
    it over whole) and polls them from then on, until :meth:`stop`.

    Parameters
    ----------
    loop
        The tier's loop: the polling runs on it.
    peers
        The other partitions of the namespace on the root.
    manager
        The tier's own residency: a key it holds is read from its own slots.
    pipeline
        The tier's own loads.
    poll_s
        How often what the other partitions publish is picked up (``peer_poll_s``).
    on_settled
        Called on the loop when a load split with other partitions ends.
    """

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        peers: Peers,
        manager: ResidencyManager,
        pipeline: Pipeline,
        poll_s: float,
        on_settled: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._peers = peers
        self._manager = manager
        self._pipeline = pipeline
        self._poll_s = poll_s
        self._on_settled = on_settled
        self._watchers: list[Listener] = []
        self._next_scan = 0.0
        self._stopped = False
        self.reads = 0
        """Loads split with other partitions in flight."""
        self.misses = 0
        """Blocks asked of other partitions and not loaded from them."""
        peers.scan()
        peers.poll()
        peers.take_changes()  # what is there now: watch() hands it over whole
        self._tick_handle = loop.call_later(poll_s, self._tick)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` ready here or in another partition."""
        n = self._manager.lookup(keys)
        peers, ready = self._peers, self._manager.is_ready
        if n < len(keys) and peers.blocks:
            for key in keys[n:]:
                if key not in peers and not ready(key):
                    break
                n += 1
        return n

    def watch(self, listener: Listener) -> None:
        """Tell ``listener`` what other partitions hold now, then every change."""
        self._watchers.append(listener)
        listener(self._peers.keys(), ())

    def load(
        self, keys: Sequence[bytes], views: list[memoryview], where: str
    ) -> Completion[LoadResult]:
        """Load ``keys`` into ``views``: the tier's own blocks, then other partitions'.

        ``where`` names the tier in the error of a key that is not ready.
        """
        peers, own = self._peers, self._manager
        theirs = (
            [i for i, k in enumerate(keys) if k in peers and k not in own] if peers.blocks else []
        )
        if not theirs:
            return self._pipeline.load(keys, views, where)
        # Blocks of other instances' partitions: read and verified beside ours.
        mine = sorted(set(range(len(keys))) - set(theirs))
        parts = [
            self._pipeline.load([keys[i] for i in mine], [views[i] for i in mine], where),
            peers.load([keys[i] for i in theirs], [views[i] for i in theirs]),
        ]
        done: Completion[LoadResult] = Completion(self._loop)
        self.reads += 1
        order = tuple(keys)

        def ended(_c: Completion[LoadResult]) -> None:
            if not all(p.done() for p in parts):
                return
            self.reads -= 1
            loaded: set[bytes] = set()
            missing: dict[bytes, KVTierError] = {}
            for p in parts:
                result = p.result()
                loaded.update(result.loaded)
                missing.update(result.missing)
            self.misses += len(parts[1].result().missing)
            done.set_result(
                LoadResult(loaded=tuple(k for k in order if k in loaded), missing=missing)
            )
            self._on_settled()

        for p in parts:
            p.add_done_callback(ended)
        return done

    def stop(self) -> None:
        """Stop polling (the tier is closing); the peers stay readable until closed."""
        self._stopped = True
        self._tick_handle.cancel()

    def _tick(self) -> None:
        """Pick up what other instances published (every ``peer_poll_s``; rescans every second)."""
        peers = self._peers
        now = self._loop.time()
        if now >= self._next_scan:
            self._next_scan = now + RESCAN_S
            peers.scan()
        peers.poll()
        added, removed = peers.take_changes()
        if (added or removed) and self._watchers:
            ready = self._manager.is_ready
            removed = [k for k in removed if not ready(k)]
            for listener in self._watchers:
                try:
                    listener(added, removed)
                except Exception:  # a listener's bug must not stop the polling
                    log.exception("file tier: a watch listener failed")
        if not self._stopped:
            self._tick_handle = self._loop.call_later(self._poll_s, self._tick)
