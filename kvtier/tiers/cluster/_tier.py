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
other nodes meanwhile (see :mod:`kvtier.tiers.cluster._client`). The open
waits on no node longer than ``connect_timeout_s``, and opens with nodes
down, or none answering, unless ``require_at_open``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvtier.config import ClusterTierConfig
from kvtier.errors import (
    BlockNotFoundError,
    ClosedError,
    ConfigurationError,
    IntegrityError,
    InvalidArgumentError,
    KVTierError,
    NamespaceMismatchError,
)
from kvtier.keys import KEY_BYTES, check_keys
from kvtier.layout import KVLayout
from kvtier.tiers import block_format
from kvtier.tiers.base import LoadResult, StoreResult, Tier
from kvtier.tiers.block_format import (
    HEADER_BYTES,
    VERIFY_OK,
    HeaderError,
    decode_header_fields,
)
from kvtier.tiers.cluster._reader import BulkError
from kvtier.transfer.completion import Completion

if TYPE_CHECKING:
    # The client module imports redis (the optional ``cluster`` extra): loaded
    # only when a tier opens, so the engine imports without it.
    from kvtier.tiers.cluster._client import ClusterClient, Value

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


@dataclass(frozen=True, slots=True)
class ClusterTierStatistics:
    """State and counters of one :class:`ClusterTier` instance (not of the cluster)."""

    mode: Literal["cluster", "single"]
    """``cluster`` or ``single`` (one server)."""
    nodes: int
    """Primary nodes known (1 with ``mode="single"``)."""
    blocks: int
    """Keys in this instance's presence set (stored, loaded or refreshed here)."""
    block_bytes: int
    """Payload bytes per block."""
    value_bytes: int
    """Bytes of one value on the server (header + payload)."""
    hits: int
    """Blocks loaded and verified."""
    misses: int
    """Blocks asked for and not loaded (absent, vanished, damaged or failed)."""
    vanished: int
    """Misses of blocks the presence set held (evicted by the server, removed by a peer)."""
    verification_failures: int
    """Values read back and refused: truncated, foreign, of another namespace or
    key, or failing their checksum."""
    stores: int
    """Blocks written."""
    skipped: int
    """Blocks not written because this instance knew them present."""
    store_failures: int
    """Blocks whose write failed (a fault, or the server out of memory)."""
    load_failures: int
    """Blocks whose read failed on a fault (counted in ``misses`` too)."""
    bytes_read: int
    """Payload bytes of successful loads."""
    bytes_written: int
    """Payload bytes of successful stores."""
    read_gbps: float
    """``bytes_read`` over the time loads were in flight, in GB/s (1e9 B/s)."""
    write_gbps: float
    """``bytes_written`` over the time stores were in flight, in GB/s."""
    round_trips: int
    """Pipelines sent (one round trip to one node each)."""
    exists_queries: int
    """Keys asked about with ``EXISTS`` by :meth:`ClusterTier.refresh`."""
    timeouts: int
    """Pipelines that timed out."""
    connection_errors: int
    """Pipelines that lost or could not open their connection."""
    redirections: int
    """Commands left failing with MOVED/ASK/TRYAGAIN after redis-py's own redirection."""
    cluster_down: int
    """Commands refused with CLUSTERDOWN, or keys of a slot no node serves."""
    refused_in_backoff: int
    """Blocks failed at once, without I/O, because their node was down."""
    reconnects: int
    """Tries to reach a node again during its outage (background probes)."""
    outages: int
    """Node outages begun: a node found not answering, at open or by a fault of
    a pipeline (one WARNING each, naming the node); when no node answered at
    open, one for the whole cluster."""
    recoveries: int
    """Outages ended: the node answered again, or serves no slot any more."""
    nodes_down: int
    """Nodes in an outage now: their blocks are misses, without I/O."""

    def metric_figures(self) -> dict[str, int | float | str]:
        """The cluster tier's own figures (:data:`kvtier.metrics.OWN_FIGURES`)."""
        return {
            "integrity_failures_total": self.verification_failures,
            "vanished_blocks_total": self.vanished,
            "node_outages_total": self.outages,
            "nodes_down": self.nodes_down,
        }


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    vanished: int = 0
    verify_failed: int = 0
    stores: int = 0
    skipped: int = 0
    store_failures: int = 0
    load_failures: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    exists: int = 0
    read_busy: float = 0.0
    write_busy: float = 0.0


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
        self._namespace = namespace
        self._block_bytes = block_bytes
        self._value_bytes = HEADER_BYTES + block_bytes
        self._key_prefix = f"{config.tenant_prefix}:{namespace.hex()}:".encode()
        self._present: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._writing: set[bytes] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._counts = _Counters()

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
        return self._block_bytes

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
        return self._key_prefix + key.hex().encode()

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` in the presence set; no I/O.

        A hint: a block counted may be gone at load time (a miss then), and a
        block a peer stored is not counted until :meth:`refresh` or a load
        found it.
        """
        present = self._present
        n = 0
        for k in keys:
            if k not in present:
                break
            n += 1
        return n

    def is_ready(self, key: bytes) -> bool:
        """True when ``key`` is in the presence set (a hint, as for :meth:`lookup`)."""
        return key in self._present

    def __contains__(self, key: object) -> bool:
        return key in self._present or key in self._writing

    def touch(self, keys: Sequence[bytes]) -> None:
        """Keep ``keys`` in the presence set longest; absent keys are ignored.

        The server's own LRU sees every GET; a touch does no I/O.
        """
        present = self._present
        for k in keys:
            if k in present:
                present.move_to_end(k)

    def statistics(self) -> ClusterTierStatistics:
        """A snapshot of this instance's state and counters."""
        c, f = self._counts, self._client.faults
        return ClusterTierStatistics(
            mode=self._config.mode,
            nodes=self._client.node_count(),
            blocks=len(self._present),
            block_bytes=self._block_bytes,
            value_bytes=self._value_bytes,
            hits=c.hits,
            misses=c.misses,
            vanished=c.vanished,
            verification_failures=c.verify_failed,
            stores=c.stores,
            skipped=c.skipped,
            store_failures=c.store_failures,
            load_failures=c.load_failures,
            bytes_read=c.bytes_read,
            bytes_written=c.bytes_written,
            read_gbps=c.bytes_read / c.read_busy / 1e9 if c.read_busy else 0.0,
            write_gbps=c.bytes_written / c.write_busy / 1e9 if c.write_busy else 0.0,
            round_trips=f.round_trips,
            exists_queries=c.exists,
            timeouts=f.timeouts,
            connection_errors=f.connection_errors,
            redirections=f.redirections,
            cluster_down=f.cluster_down,
            refused_in_backoff=f.refused_in_backoff,
            reconnects=f.reconnects,
            outages=f.outages,
            recoveries=f.recoveries,
            nodes_down=self._client.nodes_down,
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
        unknown = [k for k in keys if k not in self._present]
        if not unknown:
            return len(keys)
        rkeys = [self.key_of(k) for k in unknown]
        plans, _failed = self._client.plan(rkeys, 64)
        self._counts.exists += len(unknown)

        async def one(node: str, idx: list[int]) -> None:
            try:
                res = await self._client.run(node, [("EXISTS", rkeys[i]) for i in idx])
            except KVTierError:
                return
            for i, r in zip(idx, res, strict=True):
                if r == 1:
                    self._remember(unknown[i])

        await asyncio.gather(*(one(node, idx) for node, idx in plans))
        return self.lookup(keys)

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
        busy = self._writing
        todo = [i for i, k in enumerate(keys) if k not in self._present and k not in busy]
        skipped = tuple(k for k in keys if k in self._present or k in busy)
        self._counts.skipped += len(skipped)
        for i in todo:
            self._writing.add(keys[i])
        self._spawn(self._store([keys[i] for i in todo], [views[i] for i in todo], skipped), done)
        return done

    async def _store(
        self, keys: list[bytes], views: list[memoryview], skipped: tuple[bytes, ...]
    ) -> StoreResult:
        c = self._counts
        failed: dict[bytes, KVTierError] = {}
        stored: list[bytes] = []
        try:
            rkeys = [self.key_of(k) for k in keys]
            plans, early = self._client.plan(rkeys, self._value_bytes)
            for i, exc in early.items():
                failed[keys[i]] = exc
            stamp = int(time.time())

            async def one(node: str, idx: list[int]) -> None:
                def values() -> list[Value]:
                    # Made when the pipeline may go: the headers (the payloads'
                    # checksums) are computed just before they are sent.
                    payloads = [views[i] for i in idx]
                    heads = self._headers([keys[i] for i in idx], payloads, stamp)
                    return [(rkeys[i], h, v) for i, h, v in zip(idx, heads, payloads, strict=True)]

                try:
                    res = await self._client.set_values(node, values)
                except KVTierError as exc:
                    for i in idx:
                        failed[keys[i]] = exc
                    return
                for i, r in zip(idx, res, strict=True):
                    if isinstance(r, BaseException):
                        failed[keys[i]] = self._client.error(r, node)
                    else:
                        stored.append(keys[i])

            t0 = time.perf_counter()
            await asyncio.gather(*(one(node, idx) for node, idx in plans))
            c.write_busy += time.perf_counter() - t0
        finally:
            for k in keys:
                self._writing.discard(k)
        order = {k: i for i, k in enumerate(keys)}
        stored.sort(key=order.__getitem__)
        for k in stored:
            self._remember(k)
        c.stores += len(stored)
        c.store_failures += len(failed)
        c.bytes_written += len(stored) * self._block_bytes
        return StoreResult(stored=tuple(stored), skipped=skipped, failed=failed)

    def _headers(
        self, keys: list[bytes], payloads: list[memoryview], stamp: int
    ) -> list[memoryview]:
        """The sealed headers of ``payloads``: two compiled calls for a pipeline's blocks."""
        heads = [memoryview(bytearray(HEADER_BYTES)) for _ in keys]
        sums = block_format.checksums(payloads)  # the GIL released once for all
        block_format.seal_headers(heads, keys, self._namespace, self._block_bytes, sums, stamp)
        return heads

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
        self._spawn(self._load(list(keys), views), done)
        return done

    async def _load(self, keys: list[bytes], views: list[memoryview]) -> LoadResult:
        c = self._counts
        missing: dict[bytes, KVTierError] = {}
        loaded: set[bytes] = set()
        rkeys = [self.key_of(k) for k in keys]
        plans, early = self._client.plan(rkeys, self._value_bytes)
        for i, exc in early.items():
            missing[keys[i]] = exc
        faults = len(early)

        def settle(key: bytes, problem: KVTierError | None) -> None:
            if problem is None:
                loaded.add(key)
                return
            missing[key] = problem
            if isinstance(problem, BlockNotFoundError):
                if key in self._present:
                    c.vanished += 1
            else:
                c.verify_failed += 1
            self._present.pop(key, None)

        async def via_redis(node: str, idx: list[int]) -> None:
            nonlocal faults
            try:
                res = await self._client.run(node, [("GET", rkeys[i]) for i in idx])
            except KVTierError as exc:
                faults += len(idx)
                for i in idx:
                    missing[keys[i]] = exc
                return
            for i, value in zip(idx, res, strict=True):
                if isinstance(value, BaseException):
                    faults += 1
                    missing[keys[i]] = self._client.error(value, node)
                else:
                    settle(keys[i], self._verify_into(keys[i], value, views[i]))

        async def one(node: str, idx: list[int]) -> None:
            nonlocal faults
            if not self._client.direct:
                await via_redis(node, idx)
                return
            try:
                res = await self._client.get_into(
                    node, [rkeys[i] for i in idx], [views[i] for i in idx]
                )
            except KVTierError as exc:
                faults += len(idx)
                for i in idx:
                    missing[keys[i]] = exc
                return
            again = []
            for i, reply in zip(idx, res, strict=True):
                if isinstance(reply, BulkError):
                    again.append(i)  # MOVED, ASK, ...: redis-py follows them
                else:
                    settle(keys[i], self._verify_reply(keys[i], reply, views[i]))
            if again:
                await via_redis(node, again)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(node, idx) for node, idx in plans))
        c.read_busy += time.perf_counter() - t0
        for k in keys:
            if k in loaded:
                self._remember(k)
        c.hits += len(loaded)
        c.misses += len(missing)
        c.load_failures += faults
        c.bytes_read += len(loaded) * self._block_bytes
        return LoadResult(loaded=tuple(k for k in keys if k in loaded), missing=missing)

    def _verify_reply(
        self, key: bytes, reply: bytearray | int | None, row: memoryview
    ) -> KVTierError | None:
        """Check a direct reply as ``key``'s block, its payload already in ``row``; why not."""
        if reply is None:
            return BlockNotFoundError(f"block {key.hex()} is not in the cluster tier")
        if isinstance(reply, int):
            return IntegrityError(
                f"value has {reply} bytes, a block has {self._value_bytes} (truncated or foreign)",
                self.key_of(key).decode(),
            )
        return self._verify(key, memoryview(reply), row)

    def _verify(self, key: bytes, header: memoryview, payload: memoryview) -> KVTierError | None:
        """Check ``header`` and ``payload`` as ``key``'s block; why not."""
        # One compiled call for a sound block; the reasons below for the others.
        if block_format.verify_block(header, key, self._namespace, payload) == VERIFY_OK:
            return None
        problem = self._refusal(key, header, payload)
        if problem is None:  # refused all the same: never served
            problem = IntegrityError("block failed verification", self.key_of(key).decode())
        return problem

    def _refusal(self, key: bytes, header: memoryview, payload: memoryview) -> KVTierError | None:
        """Why ``header`` and ``payload`` are not ``key``'s block (None: no reason found)."""
        where = self.key_of(key).decode()
        try:
            hkey, ns, nbytes, _at, pcheck = decode_header_fields(header)
        except HeaderError as exc:
            return IntegrityError(f"not a kvtier block: {exc}", where)
        if ns != self._namespace:
            return NamespaceMismatchError(
                f"{where}: value of namespace {ns.hex()}, expected {self._namespace.hex()}"
            )
        if hkey != key or nbytes != self._block_bytes:
            return IntegrityError("header names another block or size", where)
        if block_format.checksum(payload) != pcheck:
            return IntegrityError("payload checksum mismatch", where)
        return None

    def _verify_into(self, key: bytes, value: object, into: memoryview) -> KVTierError | None:
        """Check ``value`` as ``key``'s block and copy its payload into ``into``; why not."""
        where = self.key_of(key).decode()
        if value is None:
            return BlockNotFoundError(f"block {key.hex()} is not in the cluster tier")
        if not isinstance(value, bytes):
            return IntegrityError(f"value is a {type(value).__name__}, not a block", where)
        if len(value) != self._value_bytes:
            return IntegrityError(
                f"value has {len(value)} bytes, a block has {self._value_bytes} (truncated "
                "or foreign)",
                where,
            )
        view = memoryview(value)
        payload = view[HEADER_BYTES:]
        problem = self._verify(key, view[:HEADER_BYTES], payload)
        if problem is not None:
            return problem
        into[:] = payload
        return None

    # -- removal and closing ------------------------------------------------------------

    def remove(self, keys: Sequence[bytes]) -> None:
        """Forget blocks here and delete them from the cluster in the background.

        The deletion is for every instance (the cluster is shared); a GET
        already sent still gets the value or nothing, never a part. Only keys
        in the presence set are deleted.
        """
        self._check_open()
        check_keys(keys)
        gone = [k for k in keys if k in self._present]
        for k in gone:
            del self._present[k]
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

    def _remember(self, key: bytes) -> None:
        present = self._present
        present[key] = None
        present.move_to_end(key)
        if len(present) > self._config.presence_capacity:
            present.popitem(last=False)

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
        for i, b in enumerate(buffers):
            try:
                v = b if isinstance(b, memoryview) else memoryview(b)
            except TypeError as exc:
                raise InvalidArgumentError(f"buffer {i} is not a buffer: {exc}") from exc
            if v.nbytes != self._block_bytes:
                raise InvalidArgumentError(
                    f"buffer {i} has {v.nbytes} bytes, blocks have {self._block_bytes}"
                )
            if not v.c_contiguous:
                raise InvalidArgumentError(f"buffer {i} is not contiguous")
            if writable and v.readonly:
                raise InvalidArgumentError("load buffers must be writable")
            views.append(v if v.format == "B" and v.ndim == 1 else v.cast("B"))
        return views
