"""``kvtier inspect --cluster``: what a Valkey/Redis cluster holds of kvtier's blocks.

Every primary node is walked with ``SCAN`` (``MATCH <prefix>:*``, or every
key without a prefix), at most ``max_keys`` keys in all, and each key's value
length asked with ``STRLEN`` in one pipeline per ``SCAN`` page. Keys of the
cluster tier's layout, ``<tenant prefix>:<namespace hex>:<block key hex>``
(:mod:`kvtier.tiers.cluster`), are counted per tenant prefix and namespace,
with their bytes; other keys are counted as ``other_keys``. Each node's
memory figures (``INFO memory``, ``INFO stats``: used memory, ``maxmemory``
and its policy, keys evicted) say how full the cluster is.

Read only: nothing is written or deleted, and values are not read (no
verification: a value's header is checked by the tier on every load). The
counts are of the moment each node was scanned; ``SCAN`` may return a key
twice while the cluster rehashes, and ``truncated`` says when ``max_keys``
stopped the walk. The configuration's password is never part of a report.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.config import ClusterTierConfig
from kvtier.errors import InvalidArgumentError
from kvtier.tiers.block_format import HEADER_BYTES

__all__ = [
    "ClusterNamespaceReport",
    "ClusterNodeReport",
    "ClusterReport",
    "config_from_cli",
    "inspect_cluster",
    "render",
]

_KEY = re.compile(rb"^([A-Za-z0-9_.\-]{1,64}):([0-9a-f]{32}):([0-9a-f]{32})$")
_SCAN_COUNT = 1000


@dataclass(slots=True)
class ClusterNamespaceReport:
    """The blocks of one tenant prefix and namespace."""

    prefix: str
    """Tenant prefix (first part of the keys)."""
    namespace: str
    """Layout fingerprint, 32 hex characters."""
    blocks: int = 0
    """Keys of this prefix and namespace."""
    value_bytes: int = 0
    """Sum of their values' lengths (header and payload)."""
    block_bytes: list[int] = field(default_factory=list)
    """Payload sizes seen (value length minus the 4096-byte header); more
    than one means foreign or truncated values."""


@dataclass(frozen=True, slots=True)
class ClusterNodeReport:
    """One primary node: what was scanned, and its memory."""

    node: str
    """``host:port``."""
    keys_scanned: int
    """Keys ``SCAN`` returned on this node (matching the prefix)."""
    used_memory: int | None
    """``used_memory`` of ``INFO memory``, bytes."""
    maxmemory: int | None
    """``maxmemory`` (0: no limit)."""
    maxmemory_policy: str | None
    """``maxmemory_policy``; a cache wants an LRU or LFU policy."""
    evicted_keys: int | None
    """``evicted_keys`` of ``INFO stats`` since the server started."""


@dataclass(slots=True)
class ClusterReport:
    """What :func:`inspect_cluster` found."""

    mode: str
    """``cluster`` or ``single``."""
    prefix: str | None
    """The tenant prefix scanned, or None for every key."""
    nodes: list[ClusterNodeReport]
    """Each primary node."""
    namespaces: list[ClusterNamespaceReport]
    """Per tenant prefix and namespace, most blocks first."""
    other_keys: int
    """Keys scanned that are not of the cluster tier's layout."""
    truncated: bool
    """True when ``max_keys`` stopped the scan before every node was walked."""

    @property
    def blocks(self) -> int:
        """Blocks of every namespace."""
        return sum(n.blocks for n in self.namespaces)

    @property
    def value_bytes(self) -> int:
        """Bytes of their values."""
        return sum(n.value_bytes for n in self.namespaces)

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        out = asdict(self)
        out["blocks"], out["value_bytes"] = self.blocks, self.value_bytes
        return out


async def inspect_cluster(
    config: ClusterTierConfig, *, prefix: str | None = None, max_keys: int = 1_000_000
) -> ClusterReport:
    """Scan the cluster (or server) of ``config`` for kvtier blocks; read only.

    Parameters
    ----------
    config
        Nodes, mode, credentials and TLS (its ``tenant_prefix`` is not used:
        ``prefix`` chooses).
    prefix
        Only keys ``<prefix>:*``; None scans every key.
    max_keys
        Stop after this many keys in all (``truncated`` is then True).

    Returns
    -------
    ClusterReport

    Raises
    ------
    InvalidArgumentError
        For a prefix with characters a tenant prefix cannot have, or a
        non-positive ``max_keys``.
    TierIOError
        When the cluster cannot be reached or refuses the credentials
        (as :meth:`kvtier.tiers.cluster.ClusterTier.open`).
    ConfigurationError
        When the ``redis`` client is not installed.
    """
    if prefix is not None and not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", prefix):
        raise InvalidArgumentError(f"prefix {prefix!r}: letters, digits, _ . - only (1-64)")
    if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
        raise InvalidArgumentError(f"max_keys must be a positive int, got {max_keys!r}")
    from kvtier.tiers.cluster import open_cluster_client

    client = await open_cluster_client(config)
    try:
        raw: Any = client.raw
        cluster = config.mode == "cluster"
        targets: list[Any] = list(raw.get_primaries()) if cluster else [None]
        match = "*" if prefix is None else f"{prefix}:*"
        groups: dict[tuple[str, str], ClusterNamespaceReport] = {}
        nodes: list[ClusterNodeReport] = []
        other = seen = 0
        truncated = False
        for target in targets:
            name = config.nodes[0] if target is None else str(target.name)
            on = {} if target is None else {"target_nodes": target}
            cursor: Any = 0
            scanned = 0
            while True:
                if seen >= max_keys:
                    truncated = True
                    break
                cursor, keys = await raw.execute_command(
                    "SCAN", cursor, "MATCH", match, "COUNT", _SCAN_COUNT, **on
                )
                if isinstance(cursor, dict):  # RedisCluster answers per node
                    cursor = next(iter(cursor.values()))
                keys = keys[: max_keys - seen]
                seen += len(keys)
                scanned += len(keys)
                pipe = raw.pipeline(transaction=False)
                for k in keys:
                    pipe.execute_command("STRLEN", k)
                lengths = await pipe.execute() if keys else []
                for k, n in zip(keys, lengths, strict=True):
                    m = _KEY.match(k)
                    if m is None:
                        other += 1
                        continue
                    g = (m.group(1).decode(), m.group(2).decode())
                    report = groups.get(g)
                    if report is None:
                        report = groups[g] = ClusterNamespaceReport(*g)
                    report.blocks += 1
                    report.value_bytes += int(n)
                    size = int(n) - HEADER_BYTES
                    if size not in report.block_bytes:
                        report.block_bytes.append(size)
                if int(cursor) == 0:
                    break
            nodes.append(await _node_report(raw, name, on, scanned))
        return ClusterReport(
            mode=config.mode,
            prefix=prefix,
            nodes=nodes,
            namespaces=sorted(groups.values(), key=lambda r: (-r.blocks, r.prefix, r.namespace)),
            other_keys=other,
            truncated=truncated,
        )
    finally:
        await client.aclose()


async def _node_report(raw: Any, name: str, on: dict[str, Any], scanned: int) -> ClusterNodeReport:
    info: dict[str, Any] = {}
    for section in ("memory", "stats"):
        answer = await raw.execute_command("INFO", section, **on)
        if isinstance(answer, dict) and name in answer and isinstance(answer[name], dict):
            answer = answer[name]  # some versions answer per node
        if isinstance(answer, dict):
            info.update(answer)

    def num(key: str) -> int | None:
        value = info.get(key)
        return int(value) if isinstance(value, int | float | str) and str(value).isdigit() else None

    policy = info.get("maxmemory_policy")
    return ClusterNodeReport(
        node=name,
        keys_scanned=scanned,
        used_memory=num("used_memory"),
        maxmemory=num("maxmemory"),
        maxmemory_policy=None if policy is None else str(policy),
        evicted_keys=num("evicted_keys"),
    )


# -- the command line ---------------------------------------------------------------------

PASSWORD_ENV = "KVTIER_CLUSTER_PASSWORD"
USERNAME_ENV = "KVTIER_CLUSTER_USERNAME"


def config_from_cli(
    where: str,
    *,
    mode: str,
    username: str | None,
    password_file: str | None,
    tls_ca_file: str | None,
    environ: Mapping[str, str],
) -> ClusterTierConfig:
    """The configuration ``kvtier inspect --cluster`` connects with.

    ``where`` is ``redis://host:port[,host:port...]`` (``rediss://`` for
    TLS) or bare ``host:port[,...]``. The password comes from
    ``password_file`` (its first line) or the ``KVTIER_CLUSTER_PASSWORD``
    environment variable, never from the command line, where every user of
    the machine could read it (``ps``): a password in the URL is refused.

    Raises
    ------
    InvalidArgumentError
        For a malformed address or a password in the URL.
    ConfigurationError
        For a configuration the cluster tier would refuse (names the field).
    """
    from urllib.parse import urlsplit

    tls = False
    hosts = where
    if "://" in where:
        url = urlsplit(where)
        if url.scheme not in ("redis", "rediss", "valkey", "valkeys"):
            raise InvalidArgumentError(f"--cluster: unknown scheme {url.scheme!r}")
        if url.password is not None:
            raise InvalidArgumentError(
                f"--cluster: no password in the URL (the command line is visible to every "
                f"user of the machine); use {PASSWORD_ENV} or --password-file"
            )
        tls = url.scheme in ("rediss", "valkeys")
        username = username or url.username
        hosts = url.netloc.rpartition("@")[2] + url.path.rstrip("/")
    nodes = [h for h in hosts.split(",") if h]
    if not nodes:
        raise InvalidArgumentError("--cluster: no host:port")
    password = environ.get(PASSWORD_ENV)
    if password_file is not None:
        try:
            with open(password_file, encoding="utf-8") as f:
                password = f.readline().rstrip("\r\n")
        except OSError as exc:
            raise InvalidArgumentError(f"--password-file {password_file}: {exc.strerror}") from exc
    username = username or environ.get(USERNAME_ENV)
    from pydantic import ValidationError

    from kvtier.errors import ConfigurationError

    try:
        return ClusterTierConfig(
            nodes=tuple(nodes),
            mode=mode,
            username=username,
            password=password,
            tls=tls or tls_ca_file is not None,
            tls_ca_file=tls_ca_file,
        )
    except ValidationError as exc:
        # input=... of pydantic's message would repeat the password: name the fields only.
        fields = ", ".join(".".join(str(p) for p in e["loc"]) or "?" for e in exc.errors())
        raise ConfigurationError(f"--cluster: invalid {fields}") from None


def render(report: ClusterReport, where: str, print_: Callable[[str], None]) -> None:
    """The report as text lines for a terminal."""
    scope = "every key" if report.prefix is None else f"keys {report.prefix}:*"
    print_(f"kvtier cluster tier at {where} ({report.mode}), {scope}")
    print_(f"{'prefix':<20} {'namespace':<32} {'blocks':>10} {'bytes':>14}  block bytes")
    for n in report.namespaces:
        sizes = ",".join(str(b) for b in sorted(n.block_bytes))
        print_(f"{n.prefix:<20} {n.namespace:<32} {n.blocks:>10} {n.value_bytes:>14}  {sizes}")
    print_(f"{'total':<53} {report.blocks:>10} {report.value_bytes:>14}")
    if report.other_keys:
        print_(f"other keys (not kvtier blocks): {report.other_keys}")
    for node in report.nodes:
        print_(
            f"node {node.node}: {node.keys_scanned} keys scanned, used_memory "
            f"{node.used_memory}, maxmemory {node.maxmemory} ({node.maxmemory_policy}), "
            f"evicted_keys {node.evicted_keys}"
        )
    if report.truncated:
        print_("truncated: --max-keys reached before every node was scanned")
