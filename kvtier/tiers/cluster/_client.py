"""The cluster tier's connection side: pipelines per node, and values sent without a copy.

Blocks are grouped by the node that serves their key (its hash slot, in
cluster mode), and each node's blocks go in pipelines of at most
``max_inflight_bytes`` of values, ``pipelines_per_node`` at once, each on its
own connection: pipelines above about 8 MiB per connection slowed SET by 2-4x
on Python 3.11, and a fault on one node fails only that node's blocks.

What a failure becomes (a typed error with an errno, the redis error as its
``__cause__``) is :mod:`~kvtier.tiers.cluster._connect`'s; which nodes are
down, and probing them back, :mod:`~kvtier.tiers.cluster._outages`' (an
:class:`~kvtier.tiers.cluster._outages.Outages` the client owns and asks
before each pipeline). Credentials go to the client only; nothing here logs
them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis import exceptions as rx
from redis._parsers.base import BaseParser
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection

from kvtier.config import ClusterTierConfig
from kvtier.errors import KVTierError
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.cluster._connect import (
    Faults,
    connection_options,
    is_connection_fault,
    map_error,
    reason_of,
)
from kvtier.tiers.cluster._outages import EVERYONE, Outages
from kvtier.tiers.cluster._reader import BulkError, DirectConnections, Reply, direct_ssl_context

__all__ = [
    "ClusterClient",
    "Faults",
    "Parts",
    "PartsConnection",
    "PartsSSLConnection",
    "make_client",
    "open_client",
]

Command = tuple[Any, ...]
Value = tuple[bytes, memoryview, memoryview]
"""A value to SET: the server key, the block's header, its payload (a row)."""
_REDIRECTS = (rx.MovedError, rx.AskError, rx.TryAgainError)


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


class ClusterClient:
    """Pipelines of commands to the nodes of a cluster, or to one server.

    Made by :func:`open_client`, which probes the nodes; the nodes that did
    not answer are down (see :mod:`~kvtier.tiers.cluster._outages`) until a
    background task of this client finds them answering again.
    """

    def __init__(
        self,
        config: ClusterTierConfig,
        client: Redis | RedisCluster,
        direct: DirectConnections | None = None,
    ) -> None:
        self._config = config
        self._client = client
        self._direct = direct
        self._cluster = isinstance(client, RedisCluster)
        self._max_bytes = int(config.max_inflight_bytes)
        self._timeout = config.timeout_s
        self._gates: dict[str, asyncio.Semaphore] = {}
        self.faults = Faults()
        self._single_name = config.nodes[0]
        # The nodes' state (down, probed back, the slot map) is its own object:
        # this class sends pipelines and asks it, per pipeline, whether to.
        self._outages = Outages(config, client, direct, self.faults)

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
        """Primary nodes known (1 for a single server; 0 before any node answered)."""
        if isinstance(self._client, RedisCluster):
            return len(self._client.get_primaries()) if self._outages.mapped else 0
        return 1

    @property
    def nodes_down(self) -> int:
        """Nodes down now (the startup nodes while none has answered)."""
        return self._outages.nodes_down

    def error(self, exc: BaseException, node: str) -> KVTierError:
        """The public error for a command's own failure on ``node``; counted."""
        return map_error(exc, node, self.faults)

    def plan(
        self, rkeys: Sequence[bytes], value_bytes: int
    ) -> tuple[list[tuple[str, list[int]]], dict[int, KVTierError]]:
        """Group the indices of ``rkeys`` by node, in pipelines of bounded bytes.

        Returns the pipelines (node name, indices) and the indices that fail at
        once (no node for their slot, or their node down).
        """
        per_node: dict[str, list[int]] = {}
        failed: dict[int, KVTierError] = {}
        outages = self._outages
        if not outages.mapped:
            self.faults.refused_in_backoff += len(rkeys)
            err = outages.down_error(EVERYONE)
            return [], dict.fromkeys(range(len(rkeys)), err)
        now_down = outages.down
        down: dict[str, KVTierError] = {}
        for i, rkey in enumerate(rkeys):
            try:
                node = self.node_of(rkey)
            except rx.RedisError as exc:
                failed[i] = map_error(exc, "?", self.faults)
                continue
            if node in now_down:
                self.faults.refused_in_backoff += 1
                why = down.get(node)
                if why is None:
                    why = down[node] = outages.down_error(node)
                failed[i] = why
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
            When the whole pipeline failed (connection, timeout, the node
            down): every command's block fails with it.
        """

        async def send() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for cmd in commands() if callable(commands) else commands:
                pipe.execute_command(*cmd)
            results: list[Any] = await pipe.execute(raise_on_error=False)
            return results

        return await self._guarded(node, send)

    async def set_values(self, node: str, make: Callable[[], Sequence[Value]]) -> list[Any]:
        """SET the values ``make()`` returns on ``node`` in one pipeline; one result each.

        ``make`` is called once the pipeline may go (as for :meth:`run`). With
        ``direct_writes`` the values go out on the tier's own connection,
        header then row, sent from where they lie; the keys answered with
        MOVED, ASK or TRYAGAIN are sent again through redis-py, which follows
        them. Otherwise through redis-py, each value as :class:`Parts`.

        Returns
        -------
        list
            Per value, in order: True (stored), or the error of its command
            (for :meth:`error`; a redirected value's is its second try's).

        Raises
        ------
        KVTierError
            When the whole pipeline failed (connection, timeout, the node
            down): any value may or may not be stored, and no buffer is read
            after this returns.
        """
        direct = self._direct
        if direct is None or not self._config.direct_writes:
            return await self.run(
                node, lambda: [("SET", key, Parts(head, row)) for key, head, row in make()]
            )
        values: list[Value] = []

        async def send() -> list[Reply]:
            values.extend(make())
            return await direct.set_from(node, values)

        replies = await self._guarded(node, send)
        out: list[Any] = []
        again: list[int] = []
        for i, reply in enumerate(replies):
            if reply is None:
                out.append(True)
                continue
            if isinstance(reply, BulkError):
                # The exception redis-py's own parser makes of the reply, as
                # a pipeline through redis-py would have returned it.
                exc: BaseException = BaseParser.parse_error(reply.text)  # type: ignore[no-untyped-call]
                if isinstance(exc, _REDIRECTS):
                    again.append(i)
            else:  # a SET answers +OK or an error, nothing else
                exc = rx.ResponseError(f"unexpected reply to SET: {type(reply).__name__}")
            out.append(exc)
        if again:
            try:
                redone: list[Any] = await self.run(
                    node, [("SET", values[i][0], Parts(*values[i][1:])) for i in again]
                )
            except KVTierError as exc:  # only these keys failed; the others stand
                redone = [exc] * len(again)
            for i, result in zip(again, redone, strict=True):
                out[i] = result
        return out

    @property
    def direct(self) -> bool:
        """True when loads read replies straight into rows (:meth:`get_into`)."""
        return self._direct is not None and self._config.direct_reads

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
        direct = self._direct
        if direct is None:
            raise RuntimeError("direct reads are off")
        return await self._guarded(node, lambda: direct.get_into(node, rkeys, rows))

    async def _guarded(self, node: str, send: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
        """``send()`` under ``node``'s bound on pipelines in flight and its timeout."""
        gate = self._gates.get(node)
        if gate is None:
            gate = self._gates[node] = asyncio.Semaphore(self._config.pipelines_per_node)
        async with gate:
            if node in self._outages.down:  # it went down while this pipeline waited
                raise self._outages.down_error(node)
            self.faults.round_trips += 1
            try:
                async with asyncio.timeout(self._timeout):
                    return await send()
            except Exception as exc:
                if is_connection_fault(exc):
                    self._outages.node_down(node, reason_of(exc))
                raise map_error(exc, node, self.faults) from exc

    async def start(self, strict: bool) -> None:
        """Probe the nodes (each within ``connect_timeout_s``); learn the slot map.

        See :meth:`Outages.start <kvtier.tiers.cluster._outages.Outages.start>`.
        """
        await self._outages.start(strict)

    async def aclose(self) -> None:
        """Stop the background probes; close every connection."""
        await self._outages.aclose()
        if self._direct is not None:
            await self._direct.aclose()
        await self._client.aclose()


async def open_client(config: ClusterTierConfig, *, strict: bool = True) -> ClusterClient:
    """Connect to the cluster (or server) of ``config``; probe every node.

    Each node is probed (a connection of its own, TLS and AUTH, ``PING``)
    within ``connect_timeout_s``, all at once: the open takes about that
    long when a node is silent, ``connect_timeout_s + timeout_s`` more at
    worst to read the slot map from a node that answered.

    Parameters
    ----------
    config
        The tier's configuration.
    strict
        Fail unless every node answers (``require_at_open``, and ``kvtier
        inspect``). Otherwise a node that does not answer is down: a WARNING,
        its blocks fail at once, a background task probes it until it answers;
        with no node answering, the whole cluster is down the same way.

    Raises
    ------
    TierIOError
        Authentication fails (``EACCES``), the TLS handshake fails (``EPROTO``:
        certificate not verified, hostname mismatch), or the servers are not
        in the mode configured (``EPROTO``); with ``strict``, a node does not
        answer (``ECONNREFUSED``, ``ETIMEDOUT``).
    """
    client = make_client(config)
    direct = None
    if config.direct_reads or config.direct_writes:
        direct = DirectConnections(
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
    out = ClusterClient(config, client, direct)
    try:
        await out.start(strict)
    except BaseException:
        await out.aclose()
        raise
    return out


def make_client(config: ClusterTierConfig) -> Redis | RedisCluster:
    """The redis-py client for ``config``, not yet connected (credentials and TLS in it)."""
    kwargs = connection_options(config)
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
            # tests/tiers/cluster/test_resharding.py); with 0 it patches the map
            # from each MOVED, and an outage's probes refresh it (_refresh_slots).
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
