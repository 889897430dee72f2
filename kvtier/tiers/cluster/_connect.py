"""Reaching a node, and what its failures become: options, the probe, errors, fault counters.

Every lower-layer error becomes a :class:`~kvtier.errors.TierIOError` with an
errno (``ETIMEDOUT``, ``ECONNREFUSED``, ``EAGAIN`` for MOVED/ASK/TRYAGAIN
left after redis-py's own redirection, ``EHOSTDOWN`` for CLUSTERDOWN and
uncovered slots, ``EACCES`` for a command the ACL refuses, ``EIO``
otherwise) or a :class:`~kvtier.errors.CapacityError` (the server is out
of memory with ``noeviction``), the redis error chained as
``__cause__``. Credentials go to the client only; nothing here logs them.

Both the client's data path (:mod:`~kvtier.tiers.cluster._client`) and its
outage handling (:mod:`~kvtier.tiers.cluster._outages`) map errors and reach
nodes with the same options, so these live below both, in one module.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ssl
from dataclasses import dataclass
from typing import Any

from redis import exceptions as rx
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvtier.config import ClusterTierConfig
from kvtier.errors import CapacityError, KVTierError, TierIOError

__all__ = [
    "MISCONFIGURED",
    "Faults",
    "connection_options",
    "is_connection_fault",
    "map_error",
    "open_error",
    "probe",
    "reason_of",
]


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


def is_connection_fault(exc: BaseException) -> bool:
    """True when ``exc`` says the node did not answer (its outage begins)."""
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


MISCONFIGURED = (errno.EACCES, errno.EPROTO)
"""Errnos of an open that waiting does not mend (credentials, TLS, mode)."""


def reason_of(exc: BaseException) -> str:
    """A few words on why a node failed: its error's message, without the node's name."""
    if isinstance(exc, TierIOError):
        return (exc.strerror or str(exc)).rsplit(": ", 1)[-1]
    if isinstance(exc, (rx.TimeoutError, TimeoutError)):
        return "timed out"
    if isinstance(exc, rx.ClusterDownError):
        return "cluster down"
    return "connection failed"


_AUTH_REPLIES = ("NOAUTH", "WRONGPASS", "NOPERM", "HELLO must be called with the client already")


def open_error(exc: Exception, config: ClusterTierConfig, node: str | None = None) -> TierIOError:
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
        host=host.strip("[]"),
        port=int(port),
        single_connection_client=True,
        **connection_options(config),
    )
    try:
        async with asyncio.timeout(config.connect_timeout_s):
            await conn.ping()
    except Exception as exc:
        return open_error(exc, config, node)
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(config.connect_timeout_s):
                await conn.aclose()
    return None


def connection_options(config: ClusterTierConfig) -> dict[str, Any]:
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
