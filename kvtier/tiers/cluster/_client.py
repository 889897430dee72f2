"""The cluster tier's connection side: pipelines per node, faults, outages.

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
``__cause__``. Credentials go to the client only; nothing here logs them.

**Outages.** A node that does not answer (refused, reset, or silent: a hung
or SIGSTOPped server accepts connections and answers nothing) is *down*:
found so at open (every node is probed, each within ``connect_timeout_s``)
or by a pipeline's connection fault or timeout. One WARNING names it; its
blocks fail at once meanwhile, without I/O (misses for the serving loop),
and a background task of the client probes it (``PING`` on a connection of
its own, within ``connect_timeout_s``) after a wait that doubles from
``backoff_initial_s`` to ``backoff_max_s``, refreshing the slot map first in
cluster mode (from nodes that are up) so that a failover ends the outage
too. When no node answers at open (or the slot map cannot be had), the
whole tier is down the same way: every block fails at once until a node
answers. ``require_at_open`` makes the open fail instead, unless every node
answers. A refused password, a TLS handshake refused, or servers in the
other mode fail the open whatever the setting: waiting does not mend them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis import exceptions as rx
from redis._parsers import AsyncCommandsParser
from redis._parsers.base import BaseParser
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvtier.config import ClusterTierConfig
from kvtier.errors import CapacityError, KVTierError, TierIOError
from kvtier.tiers.block_format import HEADER_BYTES
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

log = logging.getLogger("kvtier.cluster_tier")

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


@dataclass(slots=True)
class Faults:
    """Counters of failed transfers by kind (each a block's typed failure), and of outages."""

    timeouts: int = 0
    connection_errors: int = 0
    redirections: int = 0
    cluster_down: int = 0
    other: int = 0
    refused_in_backoff: int = 0
    """Blocks failed at once, without I/O, because their node was down."""
    reconnects: int = 0
    """Tries to reach a node again during its outage (background probes)."""
    round_trips: int = 0
    """Pipelines sent (each one round trip to one node)."""
    outages: int = 0
    """Outages begun: a node found not answering (at open or by a pipeline's
    fault), or, when no node answered at open, the whole cluster."""
    recoveries: int = 0
    """Outages ended: the node answered again (or, after a failover, serves no
    slot any more)."""


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
    elif isinstance(exc, rx.OutOfMemoryError) or (
        # redis-py's parser strips the "OOM " of the reply from the message
        isinstance(exc, rx.ResponseError) and str(exc).startswith("OOM")
    ):
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


_MISCONFIGURED = (errno.EACCES, errno.EPROTO)
"""Errnos of an open that waiting does not mend (credentials, TLS, mode)."""


@dataclass(slots=True)
class _Outage:
    """A node (or, before any answered, the whole cluster) not answering."""

    reason: str
    since: float = field(default_factory=time.monotonic)


class _Parser(AsyncCommandsParser):
    """redis-py's command table, asked of a node that answers.

    ``RedisCluster.initialize`` asks ``COMMAND`` of its default node, the
    first primary of the slot map: a node down (a hung server answers
    nothing) would stall the open until it timed out, and fail it.
    """

    def __init__(self, pick: Callable[[ClusterNode | None], ClusterNode | None]) -> None:
        super().__init__()
        self._pick = pick

    async def initialize(self, node: ClusterNode | None = None) -> None:
        await super().initialize(self._pick(node))


class ClusterClient:
    """Pipelines of commands to the nodes of a cluster, or to one server.

    Made by :func:`open_client`, which probes the nodes; the nodes that did
    not answer are down (see the module's notes) until a background task of
    this client finds them answering again.
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
        self._down: dict[str, _Outage] = {}
        self._answered: set[str] = set()
        self._closed = False
        self.faults = Faults()
        self._single_name = config.nodes[0]
        # The key of the whole cluster's outage (no slot map: no node answered);
        # no node's name ("host:port") has a "*".
        self._everyone = "*"
        self._tasks: set[asyncio.Task[None]] = set()
        self._mapped = not self._cluster
        if isinstance(client, RedisCluster):
            self._startup = dict(client.nodes_manager.startup_nodes)
            client.commands_parser = _Parser(self._answering)

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
            return len(self._client.get_primaries()) if self._mapped else 0
        return 1

    @property
    def nodes_down(self) -> int:
        """Nodes down now (the startup nodes while none has answered)."""
        if self._everyone in self._down:
            return len(self._config.nodes)
        return len(self._down)

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
        if not self._mapped:
            self.faults.refused_in_backoff += len(rkeys)
            err = self._down_error(self._everyone)
            return [], dict.fromkeys(range(len(rkeys)), err)
        down: dict[str, KVTierError] = {}
        for i, rkey in enumerate(rkeys):
            try:
                node = self.node_of(rkey)
            except rx.RedisError as exc:
                failed[i] = map_error(exc, "?", self.faults)
                continue
            if node in self._down:
                self.faults.refused_in_backoff += 1
                why = down.get(node)
                if why is None:
                    why = down[node] = self._down_error(node)
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

    def _label(self, node: str) -> str:
        """``node x`` in messages; the whole cluster's outage is of ``nodes a,b,c``."""
        if node == self._everyone:
            return f"nodes {','.join(self._config.nodes)}"
        return f"node {node}"

    def _down_error(self, node: str) -> TierIOError:
        outage = self._down.get(node)
        if outage is None:  # pragma: no cover - callers check
            return TierIOError(errno.ECONNREFUSED, f"cluster {self._label(node)} down")
        since = time.monotonic() - outage.since
        return TierIOError(
            errno.ECONNREFUSED,
            f"cluster {self._label(node)} down ({outage.reason}, for {since:.1f} s); "
            "reconnecting in the background",
        )

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
            if node in self._down:  # it went down while this pipeline waited
                raise self._down_error(node)
            self.faults.round_trips += 1
            try:
                async with asyncio.timeout(self._timeout):
                    return await send()
            except Exception as exc:
                if _is_connection_fault(exc):
                    self._node_down(node, _reason(exc))
                raise map_error(exc, node, self.faults) from exc

    # -- outages --------------------------------------------------------------------------

    def _node_down(self, node: str, reason: str) -> None:
        """Begin ``node``'s outage (once): warn, fail its blocks at once, probe it."""
        if self._closed or node in self._down:
            return
        outage = self._down[node] = _Outage(reason)
        self.faults.outages += 1
        if self._direct is not None:
            self._direct.drop(node)
        c = self._config
        if node == self._everyone:
            log.warning(
                "cluster tier: no node of %s answers (%s): every block is a miss until one "
                "does; reconnecting in the background (every %.2f-%.2f s)",
                ",".join(c.nodes), reason, c.backoff_initial_s, c.backoff_max_s,
            )  # fmt: skip
        else:
            log.warning(
                "cluster tier: node %s is down (%s): its blocks are misses until it answers; "
                "reconnecting in the background (every %.2f-%.2f s)",
                node, reason, c.backoff_initial_s, c.backoff_max_s,
            )  # fmt: skip
        task = asyncio.get_running_loop().create_task(
            self._reconnect(node, outage), name=f"kvtier-cluster-reconnect-{node}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reconnect(self, node: str, outage: _Outage) -> None:
        """Probe ``node`` with backoff until it answers (or serves no slot); end its outage."""
        c = self._config
        delay = c.backoff_initial_s
        ended = ""
        silent: dict[str, TierIOError] = {}
        while not ended:
            await asyncio.sleep(delay)
            delay = min(delay * 2, c.backoff_max_s)
            self.faults.reconnects += 1
            try:
                ended, silent = await self._try_again(node)
            except Exception as exc:  # credentials or mode changed meanwhile, or a bug
                log.debug("cluster tier: node %s still down: %r", node, exc)
        if self._down.get(node) is outage:
            del self._down[node]
        self.faults.recoveries += 1
        took = time.monotonic() - outage.since
        log.warning("cluster tier: %s back after %.1f s: %s", self._label(node), took, ended)
        if node == self._everyone:
            try:
                await self._settle_primaries(silent, strict=False)
            except Exception as exc:  # credentials or mode changed meanwhile
                log.warning("cluster tier: probing the nodes of the slot map failed: %r", exc)

    async def _try_again(self, node: str) -> tuple[str, dict[str, TierIOError]]:
        """One try of an outage: why it ended ("" while it goes on), the nodes still silent."""
        if node == self._everyone:
            failure, silent = await self._map()
            if failure is None:
                return "a node answers", silent
            log.debug("cluster tier: still no node answers: %s", failure)
            return "", {}
        if self._cluster:
            await self._refresh_slots()
            assert isinstance(self._client, RedisCluster)
            if all(p.name != node for p in self._client.get_primaries()):
                return "it serves no slot any more", {}
        failure = await probe(self._config, node)
        if failure is None:
            return "it answers again", {}
        log.debug("cluster tier: node %s still down: %s", node, failure)
        return "", {}

    def _answering(self, node: ClusterNode | None) -> ClusterNode | None:
        """``node`` if it answered the latest probe, else a node that did (``COMMAND``'s)."""
        if node is not None and node.name in self._answered and node.name not in self._down:
            return node
        assert isinstance(self._client, RedisCluster)
        for other in self._client.nodes_manager.nodes_cache.values():
            if other.name in self._answered and other.name not in self._down:
                with contextlib.suppress(rx.DataError):
                    self._client.set_default_node(other)
                return other
        for name in self._answered:  # startup nodes named otherwise ("localhost:...")
            if name in self._startup and name not in self._down:
                return self._startup[name]
        return node

    async def _map(self) -> tuple[TierIOError | None, dict[str, TierIOError]]:
        """Probe the startup nodes and read the slot map from those that answer.

        Returns the error when none answered or the map could not be had
        (else None), and the startup nodes that did not answer, with why.

        Raises
        ------
        TierIOError
            When a node refuses the credentials, the TLS handshake, or the mode.
        """
        assert isinstance(self._client, RedisCluster)
        names = list(self._startup)
        answers = await asyncio.gather(*(probe(self._config, name) for name in names))
        silent: dict[str, TierIOError] = {}
        for name, failure in zip(names, answers, strict=True):
            if failure is not None:
                if failure.errno in _MISCONFIGURED:
                    raise failure
                silent[name] = failure
        self._answered = {name for name in names if name not in silent}
        if not self._answered:
            return next(iter(silent.values())), silent
        manager = self._client.nodes_manager
        manager.startup_nodes = {n: self._startup[n] for n in names if n in self._answered}
        try:
            async with asyncio.timeout(self._config.connect_timeout_s + self._timeout):
                await self._client.initialize()
        except Exception as exc:
            failure = _open_error(exc, self._config)
            if failure.errno in _MISCONFIGURED:
                raise failure from exc
            return failure, silent
        self._mapped = True
        return None, silent

    async def _settle_primaries(self, silent: dict[str, TierIOError], strict: bool) -> None:
        """Probe the primaries of the slot map not probed yet; those silent are down.

        ``silent``: the nodes that did not answer already. With ``strict``, the
        first primary silent fails this; a startup node that is no primary
        (replaced after a failover) fails nothing.
        """
        assert isinstance(self._client, RedisCluster)
        names = [str(p.name) for p in self._client.get_primaries()]
        todo = [n for n in names if n not in self._answered and n not in silent]
        todo = [n for n in todo if n not in self._down]
        answers = await asyncio.gather(*(probe(self._config, n) for n in todo))
        for name, failure in zip(todo, answers, strict=True):
            if failure is None:
                self._answered.add(name)
            elif failure.errno in _MISCONFIGURED:
                raise failure
            else:
                silent[name] = failure
        for name in names:
            failure = silent.get(name)
            if failure is None:
                continue
            if strict:
                raise failure
            self._node_down(name, _reason(failure))
        for name in set(silent) - set(names):
            log.info("cluster tier: startup node %s does not answer; it is no primary", name)

    async def start(self, strict: bool) -> None:
        """Probe the nodes (each within ``connect_timeout_s``); learn the slot map.

        With ``strict``, any node that does not answer fails this; otherwise it
        is down (a WARNING; its blocks miss until a background probe finds it).

        Raises
        ------
        TierIOError
            A node refused the credentials (``EACCES``), the TLS handshake or
            the mode (``EPROTO``); with ``strict``, a node did not answer
            (``ETIMEDOUT``, ``ECONNREFUSED``).
        """
        if not self._cluster:
            failure = await probe(self._config, self._single_name)
            if failure is not None:
                if strict or failure.errno in _MISCONFIGURED:
                    raise failure
                self._node_down(self._single_name, _reason(failure))
            return
        failure, silent = await self._map()
        if failure is not None:
            if strict:
                raise failure
            self._node_down(self._everyone, _reason(failure))
            return
        await self._settle_primaries(silent, strict)

    async def _refresh_slots(self) -> None:
        """Read the slot map again, from nodes that are not down."""
        assert isinstance(self._client, RedisCluster)
        manager = self._client.nodes_manager
        up = {n: node for n, node in manager.startup_nodes.items() if n not in self._down}
        if up:
            manager.startup_nodes = up
        try:
            async with asyncio.timeout(self._timeout):
                await manager.initialize()
        except Exception as exc:  # the probe that follows reports the node's state
            log.debug("slot map refresh failed: %s", type(exc).__name__)

    async def aclose(self) -> None:
        """Stop the background probes; close every connection."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._direct is not None:
            await self._direct.aclose()
        await self._client.aclose()


def _reason(exc: BaseException) -> str:
    """A few words on why a node failed: its error's message, without the node's name."""
    if isinstance(exc, TierIOError):
        return (exc.strerror or str(exc)).rsplit(": ", 1)[-1]
    if isinstance(exc, (rx.TimeoutError, TimeoutError)):
        return "timed out"
    if isinstance(exc, rx.ClusterDownError):
        return "cluster down"
    return "connection failed"


_AUTH_REPLIES = ("NOAUTH", "WRONGPASS", "NOPERM", "HELLO must be called with the client already")


def _open_error(exc: Exception, config: ClusterTierConfig, node: str | None = None) -> TierIOError:
    """The public error for a failed open or probe: the deepest redis error decides.

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
    out = map_error(root, node or ",".join(config.nodes), Faults())
    if isinstance(out, TierIOError):
        return out
    return TierIOError(errno.EIO, str(out))  # pragma: no cover - not for a PING


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


async def probe(config: ClusterTierConfig, node: str) -> TierIOError | None:
    """``PING`` ``node`` on a connection of its own (TLS, AUTH) within ``connect_timeout_s``.

    Returns None when it answers, else why not (``EACCES``, ``EPROTO`` for
    credentials and TLS; ``ETIMEDOUT``, ``ECONNREFUSED`` for a node down).
    """
    host, _, port = node.rpartition(":")
    conn = Redis(
        host=host.strip("[]"), port=int(port), single_connection_client=True, **_kwargs(config)
    )
    try:
        async with asyncio.timeout(config.connect_timeout_s):
            await conn.ping()
    except Exception as exc:
        return _open_error(exc, config, node)
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(config.connect_timeout_s):
                await conn.aclose()
    return None


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


def _kwargs(config: ClusterTierConfig) -> dict[str, Any]:
    """redis-py's connection options for ``config`` (credentials, TLS, bounds)."""
    kwargs: dict[str, Any] = {
        "username": config.username,
        "password": None if config.password is None else config.password.get_secret_value(),
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        # The tier bounds and counts failures itself (outages per node): a
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
    return kwargs


def make_client(config: ClusterTierConfig) -> Redis | RedisCluster:
    """The redis-py client for ``config``, not yet connected (credentials and TLS in it)."""
    kwargs = _kwargs(config)
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
