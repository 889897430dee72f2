"""The cluster tier: blocks shared by many serving instances on a Valkey/Redis cluster.

Every block is one string value under a key of three parts::

    <tenant_prefix>:<namespace hex>:<block key hex>      e.g. kvtier:3f0c…:a1b2…
    value = 4096-byte block header (kvtier.tiers.block_format) + payload (one row)

The tenant prefix separates users of one cluster; the namespace (the layout
fingerprint: model, dtype, layout, block size, TP size) separates models and
layouts; the header repeats key and namespace and carries the payload's XXH3,
so every value read back is verified. A value that is truncated, not a kvtier
block, of another namespace or key, or fails its checksum is a miss, counted in
``verification_failures``, never served, and forgotten by this instance.

What this instance knows is a hint. :meth:`ClusterTier.lookup` answers from
a local presence set (the keys this instance stored or loaded, least recently
used dropped past ``presence_capacity``) without any I/O: measured at about
0.1 µs a key, where one pipelined ``EXISTS`` costs a round trip (about
100-200 µs on loopback) per request. Blocks stored by peers enter the set
through :meth:`ClusterTier.refresh` (one pipelined ``EXISTS`` per node for a
request's keys) or through a load that finds them. The server evicts under
``maxmemory`` and peers remove blocks: a block the set holds may be gone at
load time, which is a miss for it (counted in ``vanished``), never an error.

Faults (connection loss, a node down, MOVED/ASK left over, timeouts) fail the
blocks of the pipeline they hit with a typed, counted
:class:`~kvtier.errors.TierIOError`. A node that does not answer, at open or
later, is *down*: one WARNING names it, its blocks fail at once (misses)
while a background task probes it with backoff, and the tier serves the
other nodes meanwhile (see :mod:`kvtier.tiers.cluster._outages`). The open
waits on no node longer than ``connect_timeout_s``, and opens with nodes
down, or none answering, unless ``require_at_open``.

The tier checks calls, runs transfers in its tasks and closes; the work is
done by collaborators it owns, one concern each, sharing one presence set and
one tally: :mod:`~kvtier.tiers.cluster._values` (keys, headers, verification),
:mod:`~kvtier.tiers.cluster._presence` (what is known present; refresh),
:mod:`~kvtier.tiers.cluster._transfers` (the store and load paths),
:mod:`~kvtier.tiers.cluster._statistics` (the record).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.config import ClusterTierConfig
from kvtier.errors import ClosedError, ConfigurationError, InvalidArgumentError, KVTierError
from kvtier.keys import KEY_BYTES, check_keys
from kvtier.layout import KVLayout
from kvtier.tiers.base import LoadResult, StoreResult, Tier
from kvtier.tiers.cluster._presence import Presence
from kvtier.tiers.cluster._statistics import ClusterTierStatistics, Counters, snapshot
from kvtier.tiers.cluster._transfers import LoadPath, StorePath
from kvtier.tiers.cluster._values import ValueFormat
from kvtier.transfer.completion import Completion

if TYPE_CHECKING:
    # The client module imports redis (the optional ``cluster`` extra): loaded
    # only when a tier opens, so the engine imports without it.
    from kvtier.tiers.cluster._client import ClusterClient

__all__ = ["ClusterTier", "ClusterTierConfig", "ClusterTierStatistics"]


async def open_cluster_client(config: ClusterTierConfig, *, strict: bool = True) -> ClusterClient:
    """Connect to the cluster of ``config`` (for the tier and ``kvtier inspect``).

    With ``strict`` (``kvtier inspect``; the tier with ``require_at_open``)
    every node must answer; otherwise the nodes that do not are down (see
    :meth:`ClusterTier.open`).

    Raises
    ------
    ConfigurationError
        When the ``redis`` client is not installed (``kvtier[cluster]``).
    TierIOError
        As :meth:`ClusterTier.open`.
    """
    try:
        from kvtier.tiers.cluster._client import open_client
    except ImportError as exc:
        raise ConfigurationError(
            "the cluster tier needs the redis client: pip install redis"
        ) from exc
    return await open_client(config, strict=strict)


class ClusterTier(Tier):
    """Blocks on a Valkey/Redis cluster (or one server), shared by every instance of a layout.

    The contract, cancellation included, is :class:`~kvtier.tiers.base.Tier`'s;
    open with :meth:`open`. What differs here:

    Notes
    -----
    Stores and loads run in a task of the tier. A store interrupted by
    :meth:`aclose` never leaves a half value: a SET is atomic on the server.

    **Buffers.** Any contiguous buffer of ``block_bytes`` bytes (no alignment
    needed). Stores send the payload from the buffer itself, after its
    header: with ``direct_writes`` the socket takes it from the buffer
    (:meth:`~kvtier.tiers.cluster._reader.DirectConnections.set_from`),
    otherwise redis-py's transport joins what one write sends
    (:class:`~kvtier.tiers.cluster._client.Parts`). Loads receive the payload
    straight into the buffer with ``direct_reads``, otherwise copy the
    verified payload once from redis-py's reply. No buffer is read or written
    after its transfer returned.
    """

    def __init__(
        self,
        config: ClusterTierConfig,
        client: ClusterClient,
        namespace: bytes,
        block_bytes: int,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._config = config
        self._client = client
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        # Collaborators by concern, all over one tally and one presence set:
        # the tier checks calls, runs their coroutines in its tasks and closes.
        self._counts = Counters()
        self._format = ValueFormat(config.tenant_prefix, namespace, block_bytes)
        self._presence = Presence(config.presence_capacity, client, self._format, self._counts)
        self._stores = StorePath(client, self._format, self._presence, self._counts)
        self._loads = LoadPath(client, self._format, self._presence, self._counts)

    # -- opening ------------------------------------------------------------------------

    @classmethod
    async def open(
        cls, config: ClusterTierConfig, layout: KVLayout | bytes, *, block_bytes: int
    ) -> ClusterTier:
        """Connect to the cluster of ``config`` for blocks of ``layout``.

        Parameters
        ----------
        config
            Nodes, mode, tenant prefix, credentials, TLS, bounds.
        layout
            The KV layout (or its 16-byte namespace): part of every key and
            of every value's header.
        block_bytes
            Payload bytes of every block (one CPU-region row).

        Returns
        -------
        ClusterTier
            Connected; its presence set is empty (it learns what peers stored
            through :meth:`refresh` and loads). Nodes that did not answer are
            down: their blocks are misses until a background probe finds them
            answering (``outages`` and ``nodes_down`` in :meth:`statistics`).

        Raises
        ------
        InvalidArgumentError
            For a non-positive ``block_bytes`` or a namespace that is not 16 bytes.
        ConfigurationError
            When the ``redis`` client is not installed (``kvtier[cluster]``).
        TierIOError
            When authentication fails (``EACCES``), the TLS handshake fails or
            the servers are not in the configured mode (``EPROTO``), or, with
            ``require_at_open``, a node does not answer (``ETIMEDOUT``,
            ``ECONNREFUSED``); the cause chained, no secret in the message.

        Notes
        -----
        Every node is probed at once (a connection of its own, ``PING``),
        each within ``connect_timeout_s``: a hung node (connections accepted,
        nothing answered) delays the open by that much, not more. Reading
        the slot map from a node that answered is bounded by
        ``connect_timeout_s + timeout_s``.
        """
        namespace = layout.namespace if isinstance(layout, KVLayout) else layout
        if not isinstance(namespace, bytes) or len(namespace) != KEY_BYTES:
            raise InvalidArgumentError(f"namespace must be {KEY_BYTES} bytes, got {namespace!r}")
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise InvalidArgumentError(f"block_bytes must be a positive int, got {block_bytes!r}")
        client = await open_cluster_client(config, strict=config.require_at_open)
        try:
            return cls(config, client, namespace, block_bytes)
        except BaseException:
            await client.aclose()
            raise

    # -- capabilities and queries (no I/O) ----------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self._format.block_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def recovering(self) -> bool:
        """Always False: the tier has nothing to rebuild (the cluster holds the blocks)."""
        return False

    @property
    def shared(self) -> bool:
        """True: every instance of the same layout and tenant sees the blocks."""
        return True

    @property
    def client(self) -> Any:
        """The redis-py client (``RedisCluster`` or ``Redis``), for tools and tests."""
        return self._client.raw

    def key_of(self, key: bytes) -> bytes:
        """The server key of block ``key``: ``<tenant>:<namespace hex>:<key hex>``."""
        return self._format.key_of(key)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` in the presence set; no I/O.

        A hint: a block counted may be gone at load time (a miss then), and a
        block a peer stored is not counted until :meth:`refresh` or a load
        found it.
        """
        return self._presence.lookup(keys)

    def is_ready(self, key: bytes) -> bool:
        """True when ``key`` is in the presence set (a hint, as for :meth:`lookup`)."""
        return key in self._presence.known

    def __contains__(self, key: object) -> bool:
        return key in self._presence.known or key in self._presence.writing

    def touch(self, keys: Sequence[bytes]) -> None:
        """Keep ``keys`` in the presence set longest; absent keys are ignored.

        The server's own LRU sees every GET; a touch does no I/O.
        """
        self._presence.touch(keys)

    def statistics(self) -> ClusterTierStatistics:
        """A snapshot of this instance's state and counters."""
        return snapshot(
            self._config,
            self._client,
            self._counts,
            blocks=len(self._presence.known),
            block_bytes=self._format.block_bytes,
            value_bytes=self._format.value_bytes,
        )

    # -- refresh (one pipelined EXISTS per node) -----------------------------------------

    async def refresh(self, keys: Sequence[bytes]) -> int:
        """Ask the cluster which of ``keys`` it holds; remember them; the new lookup.

        Parameters
        ----------
        keys
            Block keys in chain order (typically one request's keys that
            :meth:`lookup` did not count).

        Returns
        -------
        int
            :meth:`lookup` of ``keys`` afterwards.

        Raises
        ------
        InvalidArgumentError
            For bad keys.
        ClosedError
            When the tier is closed.

        Notes
        -----
        One pipeline of ``EXISTS`` per node holding any of the keys. A node
        that fails leaves its keys unknown (no error: a hint is not worth
        failing a request for). Cancelling the caller abandons the answer,
        never a transfer.
        """
        self._check_open()
        check_keys(keys)
        return await self._presence.refresh(keys)

    # -- store --------------------------------------------------------------------------

    def store(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Completion[StoreResult]:
        """Write blocks from ``buffers`` (see :meth:`Tier.store`); present keys are skipped.

        Notes
        -----
        A key is skipped when this instance knows it present (stored, loaded
        or refreshed here) or is writing it; a key a peer stored and this
        instance does not know is written again (the same bytes: a key names
        its content). A failed block is in ``failed`` with a
        :class:`~kvtier.errors.TierIOError` (errno ``ETIMEDOUT``,
        ``ECONNREFUSED``, ``EAGAIN``, ``EHOSTDOWN`` or ``EIO``) or a
        :class:`~kvtier.errors.CapacityError` (the server is full with
        ``noeviction``). ``evicted`` is always empty: the server evicts
        without telling.
        """
        views = self._check_call(keys, buffers, writable=False)
        done: Completion[StoreResult] = Completion(self._loop)
        self._spawn(self._stores.begin(keys, views), done)
        return done

    # -- load ---------------------------------------------------------------------------

    def load(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> Completion[LoadResult]:
        """Read blocks into ``buffers`` and verify them (see :meth:`Tier.load`).

        Notes
        -----
        Every key asked for is read (one GET each, pipelined per node), known
        here or not: a block a peer stored loads without a refresh. A value
        that is absent is a :class:`~kvtier.errors.BlockNotFoundError`; one
        that is truncated, foreign, of another key or failing its checksum an
        :class:`~kvtier.errors.IntegrityError`, of another namespace a
        :class:`~kvtier.errors.NamespaceMismatchError`; each is forgotten
        here and counted. A fault is a :class:`~kvtier.errors.TierIOError`.
        """
        views = self._check_call(keys, buffers, writable=True)
        done: Completion[LoadResult] = Completion(self._loop)
        self._spawn(self._loads.load(list(keys), views), done)
        return done

    # -- removal and closing ------------------------------------------------------------

    def remove(self, keys: Sequence[bytes]) -> None:
        """Forget blocks here and delete them from the cluster in the background.

        The deletion is for every instance (the cluster is shared); a GET
        already sent still gets the value or nothing, never a part. Only keys
        in the presence set are deleted.
        """
        self._check_open()
        check_keys(keys)
        present = self._presence.known
        gone = [k for k in keys if k in present]
        for k in gone:
            del present[k]
        if gone:
            self._spawn(self._delete(gone), None)

    async def _delete(self, keys: list[bytes]) -> None:
        rkeys = [self.key_of(k) for k in keys]
        plans, _ = self._client.plan(rkeys, 64)
        for node, idx in plans:
            # A fault leaves the value for the server's LRU to evict: nothing
            # here serves it again, it is forgotten.
            try:
                await self._client.run(node, [("DEL", rkeys[i]) for i in idx])
            except KVTierError:
                continue

    async def aclose(self) -> None:
        """Close the connections once the transfers in flight finished (see :meth:`Tier.aclose`).

        Each transfer still running is bounded by ``timeout_s`` per pipeline.
        """
        first = not self._closed
        self._closed = True
        closing = asyncio.ensure_future(self._close(first))
        await asyncio.shield(closing)

    async def _close(self, first: bool) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if first:
            await self._client.aclose()

    async def __aenter__(self) -> ClusterTier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- helpers ------------------------------------------------------------------------

    def _spawn(
        self,
        coro: Coroutine[Any, Any, Any],
        done: Completion[Any] | None,
    ) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)

        def finished(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if done is None:
                if not t.cancelled():
                    t.exception()  # retrieved: a background delete reports nothing
                return
            if t.cancelled():
                done.set_exception(asyncio.CancelledError())
            elif (exc := t.exception()) is not None:
                done.set_exception(exc)
            else:
                done.set_result(t.result())

        task.add_done_callback(finished)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the cluster tier is closed")

    def _check_call(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview], *, writable: bool
    ) -> list[memoryview]:
        self._check_open()
        check_keys(keys)
        if isinstance(buffers, (bytes, bytearray, memoryview)) or len(buffers) != len(keys):
            raise InvalidArgumentError(
                f"{len(keys)} keys but {len(buffers)} buffers (one buffer per key)"
            )
        views: list[memoryview] = []
        block_bytes = self._format.block_bytes
        for i, b in enumerate(buffers):
            try:
                v = b if isinstance(b, memoryview) else memoryview(b)
            except TypeError as exc:
                raise InvalidArgumentError(f"buffer {i} is not a buffer: {exc}") from exc
            if v.nbytes != block_bytes:
                raise InvalidArgumentError(
                    f"buffer {i} has {v.nbytes} bytes, blocks have {block_bytes}"
                )
            if not v.c_contiguous:
                raise InvalidArgumentError(f"buffer {i} is not contiguous")
            if writable and v.readonly:
                raise InvalidArgumentError("load buffers must be writable")
            views.append(v if v.format == "B" and v.ndim == 1 else v.cast("B"))
        return views
