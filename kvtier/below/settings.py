"""kvtier's keys in another engine's configuration, for the tiers below its CPU tier.

No engine import here: both adapters (vLLM 0.33's secondary tier, SGLang's L3
backend) parse their tables with :func:`parse_lower_settings`, and the main
test suite checks it without either engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.embedded import cluster_secrets, lookup_deadline, written_through
from kvtier.errors import ConfigurationError

__all__ = ["LOWER_KEYS", "LowerSettings", "parse_lower_settings"]

LOWER_KEYS = frozenset(
    {
        "host_tier",
        "file_tier",
        "cluster_tier",
        "lookup_deadline_s",
        "decline_slow_loads",
        "recompute_s_per_block",
    }
)
"""kvtier's keys below another engine's CPU tier."""

DEFAULT_LOOKUP_DEADLINE_S = 2.0
"""How long a lookup may wait on a shared tier's answer before it is a miss."""


@dataclass(frozen=True, slots=True)
class LowerSettings:
    """kvtier's configuration below an engine's CPU tier."""

    config: KVTierConfig
    """The chain of lower tiers (its ``cpu_bytes_to_use`` is the engine's buffer: kvtier
    maps no CPU tier of its own)."""
    lookup_deadline_s: float = DEFAULT_LOOKUP_DEADLINE_S
    """How long a lookup may wait on a shared tier's answer, and a block's reads may
    fall through, before the block is a miss."""


def parse_lower_settings(
    table: Mapping[str, Any], *, where: str, buffer_bytes: int, ignore: frozenset[str] = frozenset()
) -> LowerSettings:
    """Validate kvtier's keys in ``table`` and build the chain's configuration.

    Parameters
    ----------
    table
        kvtier's keys: ``host_tier``, ``file_tier``, ``cluster_tier`` (the
        tables of :class:`~kvtier.config.HostTierConfig`,
        :class:`~kvtier.config.FileTierConfig`,
        :class:`~kvtier.config.ClusterTierConfig`; a cluster password only from
        ``password_env`` or ``password_file``), ``lookup_deadline_s``,
        ``decline_slow_loads``, ``recompute_s_per_block``.
    where
        The engine's name for the setting, for messages.
    buffer_bytes
        The engine's CPU buffer below which the tiers sit.
    ignore
        The engine's own keys in the same table, left to it.

    Raises
    ------
    ConfigurationError
        An unknown key, a bad value, no tier at all, or a ``write_back`` tier
        (the engine's CPU tier evicts without telling kvtier: every block is
        written through).
    """
    if not isinstance(table, Mapping):
        raise ConfigurationError(f"{where} must be a mapping, got {type(table).__name__}")
    unknown = sorted(set(table) - LOWER_KEYS - ignore)
    if unknown:
        raise ConfigurationError(
            f"{where}: unknown key(s) {unknown} for kvtier; kvtier's keys are {sorted(LOWER_KEYS)}",
            tuple((k, "unknown key") for k in unknown),
        )
    fields = {k: table[k] for k in sorted(LOWER_KEYS - {"lookup_deadline_s"}) if k in table}
    if not any(k in fields for k in ("host_tier", "file_tier", "cluster_tier")):
        raise ConfigurationError(
            f"{where}: kvtier needs at least one of host_tier, file_tier, cluster_tier",
            (("file_tier", "no tier configured"),),
        )
    if "cluster_tier" in fields:
        fields["cluster_tier"] = cluster_secrets(fields["cluster_tier"], where)
    try:
        config = KVTierConfig.from_dict({**fields, "cpu_bytes_to_use": buffer_bytes})
    except ConfigurationError as exc:
        raise ConfigurationError(f"{where}: {exc}", exc.problems) from exc
    written_through(
        config,
        where,
        "below another engine's CPU tier (it evicts blocks without telling kvtier, so a "
        "block is written down when it is stored)",
    )
    return LowerSettings(config, lookup_deadline(table, DEFAULT_LOOKUP_DEADLINE_S, where))
