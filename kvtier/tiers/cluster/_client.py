"""The cluster tier's connection side: pipelines per node, faults, backoff.

Blocks are grouped by the node that serves their key (its hash slot, in
cluster mode), and each node's blocks go in pipelines of at most
``max_inflight_bytes`` of values, ``pipelines_per_node`` at once, each on its
own connection: pipelines above about 8 MiB per connection slowed SET by 2-4x
on Python 3.11, and a fault on one node fails only that node's blocks.

Every lower-layer error becomes a :class:`~kvtier.errors.TierIOError` with an
errno (``ETIMEDOUT``, ``ECONNREFUSED``, ``EAGAIN`` for MOVED/ASK/TRYAGAIN
left after redis-py's own redirection, ``EHOSTDOWN`` for CLUSTERDOWN and
uncovered slots, ``EACCES`` for a command the ACL refuses, ``EIO``
otherwise) or a :class:`~kvtier.errors.CapacityError` (the server is out
of memory with ``noeviction``), the redis error chained as
``__cause__``. A node that failed at the connection level is left alone for a
backoff that doubles per failure (``backoff_initial_s`` to ``backoff_max_s``):
its blocks fail at once meanwhile, without I/O, so a dead node costs the
serving loop nothing; the first pipeline after the wait reconnects (and, in
cluster mode, refreshes the slot map first, so a failover is followed).
Credentials go to the client only; nothing here logs them.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis import exceptions as rx
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvtier.config import ClusterTierConfig
from kvtier.errors import CapacityError, KVTierError, TierIOError
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.cluster._reader import DirectReader, Reply, direct_ssl_context

__all__ = [
    "ClusterClient",
    "Faults",
    "Parts",
    "PartsConnection",
    "PartsSSLConnection",
    "make_client",
    "open_client",
]

log = logging.getLogger("kvtier.cluster_tier")

Command = tuple[Any, ...]


class Parts:
    """A value sent as its parts, never joined here: a block's header, then its row.

    redis-py sends one argument as one buffer, so a value of header and
    payload would have to be copied into one buffer first: that copy, of
    a cold 2 MiB row into a cold value buffer, cost more client CPU than the
    rest of a store together (``benchmarks/cluster_tier.py``). The
    connections of the tier's client (:class:`_PartsPacking`) write the parts
    one after the other as one RESP bulk string.
    """

    __slots__ = ("nbytes", "parts")

    def __init__(self, *parts: memoryview) -> None:
        self.parts = parts
        self.nbytes = sum(p.nbytes for p in parts)

    def __repr__(self) -> str:
        return f"Parts({self.nbytes} bytes)"


class _PartsPacking:
    """Connection mixin: packs a :class:`Parts` argument without copying its payload."""

    encoder: Any

    def pack_command(self, *args: Any) -> list[Any]:
        if not any(isinstance(a, Parts) for a in args):
            return super().pack_command(*args)  # type: ignore[misc, no-any-return]
        out: list[Any] = []
        buff = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, Parts):
                out.append(buff + b"$%d\r\n" % arg.nbytes)
                # memoryviews: redis-py's pack_commands keeps each as its own chunk.
                out.extend(arg.parts)
                buff = b"\r\n"
            else:
                data = self.encoder.encode(arg)
                buff += b"$%d\r\n" % len(data) + bytes(data) + b"\r\n"
        out.append(buff)
        return out


class PartsConnection(_PartsPacking, Connection):
    """redis-py's connection, packing :class:`Parts`."""


class PartsSSLConnection(_PartsPacking, SSLConnection):
    """redis-py's TLS connection, packing :class:`Parts`."""


@dataclass(slots=True)
class Faults:
    """Counters of failed transfers by kind (each a block's typed failure)."""

    timeouts: int = 0
    connection_errors: int = 0
    redirections: int = 0
    cluster_down: int = 0
    other: int = 0
    refused_in_backoff: int = 0
    """Blocks failed at once because their node was in its backoff wait."""
    reconnects: int = 0
    """Tries to talk again to a node after its backoff wait."""
    round_trips: int = 0
    """Pipelines sent (each one round trip to one node)."""


def map_error(exc: BaseException, node: str, faults: Faults) -> KVTierError:
    """The public error for ``exc`` raised while talking to ``node``; counted."""
    if isinstance(exc, KVTierError):
        return exc
    if isinstance(exc, (rx.TimeoutError, TimeoutError, asyncio.TimeoutError)):
        faults.timeouts += 1
        err, what = errno.ETIMEDOUT, "timed out"
    elif isinstance(exc, (rx.MovedError, rx.AskError, rx.TryAgainError)):
        faults.redirections += 1
        err, what = errno.EAGAIN, "redirected (slot moving)"
    elif isinstance(exc, (rx.ClusterDownError, rx.SlotNotCoveredError)):
        faults.cluster_down += 1
        err, what = errno.EHOSTDOWN, "cluster down for this slot"
    elif isinstance(exc, (rx.ConnectionError, ConnectionError, OSError)):
        faults.connection_errors += 1
        err, what = errno.ECONNREFUSED, "connection failed"
    elif isinstance(exc, rx.NoPermissionError):
        faults.other += 1
        err, what = errno.EACCES, "command refused by the user's ACL (NOPERM)"
    elif isinstance(exc, rx.ResponseError) and str(exc).startswith("OOM"):
        return CapacityError(f"node {node} is out of memory (maxmemory, noeviction)")
    else:
        faults.other += 1
        err, what = errno.EIO, f"failed ({type(exc).__name__})"
    out = TierIOError(err, f"cluster node {node}: {what}")
    out.__cause__ = exc
    return out


def _is_connection_fault(exc: BaseException) -> bool:
    return isinstance(
        exc,
        (
            rx.ConnectionError,
            rx.TimeoutError,
            ConnectionError,
            TimeoutError,
            OSError,
            rx.ClusterDownError,
        ),
    )


class ClusterClient:
    """Pipelines of commands to the nodes of a cluster, or to one server."""

    def __init__(
        self,
        config: ClusterTierConfig,
        client: Redis | RedisCluster,
        reader: DirectReader | None = None,
    ) -> None:
        self._config = config
        self._client = client
        self._reader = reader
        self._cluster = isinstance(client, RedisCluster)
        self._max_bytes = int(config.max_inflight_bytes)
        self._timeout = config.timeout_s
        self._gates: dict[str, asyncio.Semaphore] = {}
        self._down_until: dict[str, float] = {}
        self._delay: dict[str, float] = {}
        self.faults = Faults()
        self._single_name = config.nodes[0]

    @property
    def raw(self) -> Redis | RedisCluster:
        """The redis-py client (tests and benchmarks use it as a peer would)."""
        return self._client

    def node_of(self, rkey: bytes) -> str:
        """Name of the node serving ``rkey`` (``SlotNotCoveredError`` if none)."""
        if not self._cluster:
            return self._single_name
        assert isinstance(self._client, RedisCluster)
        node = self._client.get_node_from_key(rkey)  # type: ignore[arg-type]
        if node is None:
            raise rx.SlotNotCoveredError(f"no node for key {rkey!r}")
        return str(node.name)

    def node_count(self) -> int:
        """Primary nodes known (1 for a single server)."""
        if isinstance(self._client, RedisCluster):
            return len(self._client.get_primaries())
        return 1

    def error(self, exc: BaseException, node: str) -> KVTierError:
        """The public error for a command's own failure on ``node``; counted."""
        return map_error(exc, node, self.faults)

    def plan(
        self, rkeys: Sequence[bytes], value_bytes: int
    ) -> tuple[list[tuple[str, list[int]]], dict[int, KVTierError]]:
        """Group the indices of ``rkeys`` by node, in pipelines of bounded bytes.

        Returns the pipelines (node name, indices) and the indices that fail at
        once (no node for their slot, or their node in its backoff wait).
        """
        per_node: dict[str, list[int]] = {}
        failed: dict[int, KVTierError] = {}
        now = time.monotonic()
        for i, rkey in enumerate(rkeys):
            try:
                node = self.node_of(rkey)
            except rx.RedisError as exc:
                failed[i] = map_error(exc, "?", self.faults)
                continue
            if self._down_until.get(node, 0.0) > now:
                self.faults.refused_in_backoff += 1
                wait = self._down_until[node] - now
                failed[i] = TierIOError(
                    errno.ECONNREFUSED, f"cluster node {node} failed; next try in {wait:.2f} s"
                )
                continue
            per_node.setdefault(node, []).append(i)
        per_pipe = max(1, self._max_bytes // max(1, value_bytes))
        plans = [
            (node, idx[s : s + per_pipe])
            for node, idx in per_node.items()
            for s in range(0, len(idx), per_pipe)
        ]
        return plans, failed

    async def run(
        self, node: str, commands: Sequence[Command] | Callable[[], Sequence[Command]]
    ) -> list[Any]:
        """Send ``commands`` to ``node`` as one pipeline; one result or exception each.

        ``commands`` may be a function that makes them: it is called once the
        pipeline may go (its node's bound on pipelines in flight allows it),
        so that the values of a large store are not all built at once.

        Raises
        ------
        KVTierError
            When the whole pipeline failed (connection, timeout): every command's
            block fails with it.
        """

        async def send() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for cmd in commands() if callable(commands) else commands:
                pipe.execute_command(*cmd)
            results: list[Any] = await pipe.execute(raise_on_error=False)
            return results

        return await self._guarded(node, send)

    @property
    def direct(self) -> bool:
        """True when loads read replies straight into rows (:meth:`get_into`)."""
        return self._reader is not None

    async def get_into(
        self, node: str, rkeys: Sequence[bytes], rows: Sequence[memoryview]
    ) -> list[Reply]:
        """GET ``rkeys`` from ``node`` in one pipeline, each payload straight into its row.

        One :data:`~kvtier.tiers.cluster._reader.Reply` per key; an error
        reply (MOVED, ASK, ...) is returned, not followed.

        Raises
        ------
        KVTierError
            When the whole pipeline failed (connection, timeout): the rows
            hold no valid data, and none is written after this returns.
        """
        reader = self._reader
        if reader is None:
            raise RuntimeError("direct reads are off")
        return await self._guarded(node, lambda: reader.get_into(node, rkeys, rows))

    async def _guarded(self, node: str, send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        """``send()`` under ``node``'s bound on pipelines in flight, its timeout and backoff."""
        gate = self._gates.get(node)
        if gate is None:
            gate = self._gates[node] = asyncio.Semaphore(self._config.pipelines_per_node)
        async with gate:
            if node in self._delay:
                self.faults.reconnects += 1
                if self._cluster:
                    await self._refresh_slots()
            self.faults.round_trips += 1
            try:
                async with asyncio.timeout(self._timeout):
                    results = await send()
            except Exception as exc:
                if _is_connection_fault(exc):
                    self._failed(node)
                raise map_error(exc, node, self.faults) from exc
            self._down_until.pop(node, None)
            self._delay.pop(node, None)
            return results

    def _failed(self, node: str) -> None:
        delay = self._delay.get(node)
        delay = self._config.backoff_initial_s if delay is None else delay * 2
        delay = min(delay, self._config.backoff_max_s)
        self._delay[node] = delay
        self._down_until[node] = time.monotonic() + delay
        if self._reader is not None:
            self._reader.drop(node)
        log.warning("cluster node %s failed; next try in %.2f s", node, delay)

    async def _refresh_slots(self) -> None:
        assert isinstance(self._client, RedisCluster)
        try:
            async with asyncio.timeout(self._timeout):
                await self._client.nodes_manager.initialize()
        except Exception as exc:  # the pipeline that follows reports the node's state
            log.debug("slot map refresh failed: %s", type(exc).__name__)

    async def aclose(self) -> None:
        """Close every connection."""
        if self._reader is not None:
            await self._reader.aclose()
        await self._client.aclose()


_AUTH_REPLIES = ("NOAUTH", "WRONGPASS", "NOPERM", "HELLO must be called with the client already")


def _open_error(exc: Exception, config: ClusterTierConfig) -> KVTierError:
    """The public error for a failed open: the deepest redis error decides.

    ``RedisCluster.initialize`` wraps what went wrong with its last startup
    node in a ``RedisClusterException`` ("cannot be connected"): a refused
    password and a dead node must not both read as the wrong mode. No
    message here repeats a credential (redis-py's and the server's do not
    either; the cause stays chained).
    """
    root: BaseException = exc
    while isinstance(root, rx.RedisClusterException) and root.__cause__ is not None:
        root = root.__cause__
    text = str(root)
    if isinstance(root, rx.AuthenticationError | rx.AuthorizationError) or (
        isinstance(root, rx.ResponseError) and text.startswith(_AUTH_REPLIES)
    ):
        user = "the default user" if config.username is None else f"user {config.username!r}"
        return TierIOError(errno.EACCES, f"cluster tier: authentication as {user} refused")
    tls = _ssl_error(root)
    if tls is not None:
        why = getattr(tls, "verify_message", None) or getattr(tls, "reason", None) or tls
        return TierIOError(errno.EPROTO, f"cluster tier: TLS handshake refused: {why}")
    if isinstance(root, rx.ResponseError | rx.RedisClusterException):
        return TierIOError(
            errno.EPROTO, f"cluster tier: servers refuse {config.mode!r} mode: {text}"
        )
    return map_error(root, ",".join(config.nodes), Faults())


def _ssl_error(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind ``exc`` (redis-py raises its ConnectionError from it)."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if isinstance(at, ssl.SSLError):
            return at
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return None


async def open_client(config: ClusterTierConfig) -> ClusterClient:
    """Connect to the cluster (or server) of ``config`` and check that it answers.

    Raises
    ------
    TierIOError
        When no node answers (``ECONNREFUSED``, ``ETIMEDOUT``), authentication
        fails (``EACCES``), the TLS handshake fails (``EPROTO``: certificate
        not verified, hostname mismatch), or the servers are not in the mode
        configured (``EPROTO``).
    """
    client = make_client(config)
    try:
        async with asyncio.timeout(config.connect_timeout_s + config.timeout_s):
            if isinstance(client, RedisCluster):
                await client.initialize()
            else:
                await client.ping()
    except BaseException as exc:
        await client.aclose()
        if isinstance(exc, Exception):
            raise _open_error(exc, config) from exc
        raise
    reader = None
    if config.direct_reads:
        reader = DirectReader(
            header_bytes=HEADER_BYTES,
            username=config.username,
            password=None if config.password is None else config.password.get_secret_value(),
            ssl_context=None
            if not config.tls
            else direct_ssl_context(
                None if config.tls_ca_file is None else str(config.tls_ca_file),
                None if config.tls_cert_file is None else str(config.tls_cert_file),
                None if config.tls_key_file is None else str(config.tls_key_file),
                config.tls_check_hostname,
            ),
            connect_timeout_s=config.connect_timeout_s,
        )
    return ClusterClient(config, client, reader)


def make_client(config: ClusterTierConfig) -> Redis | RedisCluster:
    """The redis-py client for ``config``, not yet connected (credentials and TLS in it)."""
    kwargs: dict[str, Any] = {
        "username": config.username,
        "password": None if config.password is None else config.password.get_secret_value(),
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        # The tier bounds and counts failures itself (backoff per node): a
        # client-side retry would stall the serving loop on a dead node.
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": False,
    }
    if config.tls:
        kwargs.update(
            ssl=True,
            ssl_ca_certs=None if config.tls_ca_file is None else str(config.tls_ca_file),
            ssl_certfile=None if config.tls_cert_file is None else str(config.tls_cert_file),
            ssl_keyfile=None if config.tls_key_file is None else str(config.tls_key_file),
            ssl_check_hostname=config.tls_check_hostname,
            ssl_cert_reqs=ssl.CERT_REQUIRED,
        )
    conn_class = PartsSSLConnection if config.tls else PartsConnection
    addrs = config.addresses()
    client: Redis | RedisCluster
    if config.mode == "cluster":
        client = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in addrs],
            require_full_coverage=False,
            # Every 5th MOVED, redis-py would otherwise close every connection
            # to rebuild its slot map, failing the pipelines in flight on the
            # other nodes too (thousands of blocks per reshard, measured in
            # tests/cluster/test_resharding.py); with 0 it patches the map
            # from each MOVED, and a failed node refreshes it (_refresh_slots).
            reinitialize_steps=0,
            max_connections=max(8, 2 * config.pipelines_per_node),
            **kwargs,
        )
        # RedisCluster takes no connection class: set it where its nodes,
        # the startup ones and those it discovers, get theirs.
        for node in client.nodes_manager.startup_nodes.values():
            node.connection_class = conn_class
        client.nodes_manager.connection_kwargs["connection_class"] = conn_class
    else:
        host, port = addrs[0]
        client = Redis(host=host, port=port, **kwargs)
        client.connection_pool.connection_class = conn_class
    return client
