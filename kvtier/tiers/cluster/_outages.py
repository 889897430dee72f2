"""The cluster client's outages: which nodes are down, probing them back, the slot map.

A node that does not answer (refused, reset, or silent: a hung or SIGSTOPped
server accepts connections and answers nothing) is *down*: found so at open
(every node is probed, each within ``connect_timeout_s``) or by a pipeline's
connection fault or timeout. One WARNING names it; its blocks fail at once
meanwhile, without I/O (misses for the serving loop), and a background task
probes it (``PING`` on a connection of its own, within ``connect_timeout_s``)
after a wait that doubles from ``backoff_initial_s`` to ``backoff_max_s``,
refreshing the slot map first in cluster mode (from nodes that are up) so
that a failover ends the outage too. When no node answers at open (or the
slot map cannot be had), the whole tier is down the same way (the outage of
:data:`EVERYONE`): every block fails at once until a node answers.
``require_at_open`` makes the open fail instead, unless every node answers.
A refused password, a TLS handshake refused, or servers in the other mode
fail the open whatever the setting: waiting does not mend them.

:class:`Outages` is owned by :class:`~kvtier.tiers.cluster._client.ClusterClient`,
which asks it, per pipeline, whether a node is down and tells it of faults;
it is kept apart so that the client holds the data path and this the state
of the nodes, their probes and the slot map reading that goes with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redis import exceptions as rx
from redis._parsers import AsyncCommandsParser
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from kvtier.config import ClusterTierConfig
from kvtier.errors import TierIOError
from kvtier.tiers.cluster._connect import MISCONFIGURED, Faults, open_error, probe, reason_of
from kvtier.tiers.cluster._reader import DirectConnections

__all__ = ["EVERYONE", "Outage", "Outages"]

log = logging.getLogger("kvtier.cluster_tier")

EVERYONE = "*"
"""The key of the whole cluster's outage (no slot map: no node answered); no
node's name (``host:port``) has a ``*``."""


@dataclass(slots=True)
class Outage:
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


class Outages:
    """The nodes down now, the probes that bring them back, and the slot map they read.

    Made by the client with the redis-py client it wraps; :meth:`start`
    probes every node once, then outages begin by :meth:`node_down` (the
    client's pipelines report their faults) and end in background probes.
    """

    def __init__(
        self,
        config: ClusterTierConfig,
        client: Redis | RedisCluster,
        direct: DirectConnections | None,
        faults: Faults,
    ) -> None:
        self._config = config
        self._client = client
        self._direct = direct
        self._faults = faults
        self._cluster = isinstance(client, RedisCluster)
        self._timeout = config.timeout_s
        self._single_name = config.nodes[0]
        # The outages now, by node name (or EVERYONE): the client's per-pipeline check.
        self.down: dict[str, Outage] = {}
        # False while no slot map was read (no node answered yet): every block fails.
        self.mapped = not self._cluster
        self._answered: set[str] = set()
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        if isinstance(client, RedisCluster):
            self._startup = dict(client.nodes_manager.startup_nodes)
            client.commands_parser = _Parser(self._answering)

    @property
    def nodes_down(self) -> int:
        """Nodes down now (the startup nodes while none has answered)."""
        if EVERYONE in self.down:
            return len(self._config.nodes)
        return len(self.down)

    def _label(self, node: str) -> str:
        """``node x`` in messages; the whole cluster's outage is of ``nodes a,b,c``."""
        if node == EVERYONE:
            return f"nodes {','.join(self._config.nodes)}"
        return f"node {node}"

    def down_error(self, node: str) -> TierIOError:
        """The error of a block refused, without I/O, because ``node`` is down."""
        outage = self.down.get(node)
        if outage is None:  # pragma: no cover - callers check
            return TierIOError(errno.ECONNREFUSED, f"cluster {self._label(node)} down")
        since = time.monotonic() - outage.since
        return TierIOError(
            errno.ECONNREFUSED,
            f"cluster {self._label(node)} down ({outage.reason}, for {since:.1f} s); "
            "reconnecting in the background",
        )

    def node_down(self, node: str, reason: str) -> None:
        """Begin ``node``'s outage (once): warn, fail its blocks at once, probe it."""
        if self._closed or node in self.down:
            return
        outage = self.down[node] = Outage(reason)
        self._faults.outages += 1
        if self._direct is not None:
            self._direct.drop(node)
        c = self._config
        if node == EVERYONE:
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

    async def _reconnect(self, node: str, outage: Outage) -> None:
        """Probe ``node`` with backoff until it answers (or serves no slot); end its outage."""
        c = self._config
        delay = c.backoff_initial_s
        ended = ""
        silent: dict[str, TierIOError] = {}
        while not ended:
            await asyncio.sleep(delay)
            delay = min(delay * 2, c.backoff_max_s)
            self._faults.reconnects += 1
            try:
                ended, silent = await self._try_again(node)
            except Exception as exc:  # credentials or mode changed meanwhile, or a bug
                log.debug("cluster tier: node %s still down: %r", node, exc)
        if self.down.get(node) is outage:
            del self.down[node]
        self._faults.recoveries += 1
        took = time.monotonic() - outage.since
        log.warning("cluster tier: %s back after %.1f s: %s", self._label(node), took, ended)
        if node == EVERYONE:
            try:
                await self._settle_primaries(silent, strict=False)
            except Exception as exc:  # credentials or mode changed meanwhile
                log.warning("cluster tier: probing the nodes of the slot map failed: %r", exc)

    async def _try_again(self, node: str) -> tuple[str, dict[str, TierIOError]]:
        """One try of an outage: why it ended ("" while it goes on), the nodes still silent."""
        if node == EVERYONE:
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
        if node is not None and node.name in self._answered and node.name not in self.down:
            return node
        assert isinstance(self._client, RedisCluster)
        for other in self._client.nodes_manager.nodes_cache.values():
            if other.name in self._answered and other.name not in self.down:
                with contextlib.suppress(rx.DataError):
                    self._client.set_default_node(other)
                return other
        for name in self._answered:  # startup nodes named otherwise ("localhost:...")
            if name in self._startup and name not in self.down:
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
                if failure.errno in MISCONFIGURED:
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
            failure = open_error(exc, self._config)
            if failure.errno in MISCONFIGURED:
                raise failure from exc
            return failure, silent
        self.mapped = True
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
        todo = [n for n in todo if n not in self.down]
        answers = await asyncio.gather(*(probe(self._config, n) for n in todo))
        for name, failure in zip(todo, answers, strict=True):
            if failure is None:
                self._answered.add(name)
            elif failure.errno in MISCONFIGURED:
                raise failure
            else:
                silent[name] = failure
        for name in names:
            failure = silent.get(name)
            if failure is None:
                continue
            if strict:
                raise failure
            self.node_down(name, reason_of(failure))
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
                if strict or failure.errno in MISCONFIGURED:
                    raise failure
                self.node_down(self._single_name, reason_of(failure))
            return
        failure, silent = await self._map()
        if failure is not None:
            if strict:
                raise failure
            self.node_down(EVERYONE, reason_of(failure))
            return
        await self._settle_primaries(silent, strict)

    async def _refresh_slots(self) -> None:
        """Read the slot map again, from nodes that are not down."""
        assert isinstance(self._client, RedisCluster)
        manager = self._client.nodes_manager
        up = {n: node for n, node in manager.startup_nodes.items() if n not in self.down}
        if up:
            manager.startup_nodes = up
        try:
            async with asyncio.timeout(self._timeout):
                await manager.initialize()
        except Exception as exc:  # the probe that follows reports the node's state
            log.debug("slot map refresh failed: %s", type(exc).__name__)

    async def aclose(self) -> None:
        """Stop the background probes (no outage begins after this)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
