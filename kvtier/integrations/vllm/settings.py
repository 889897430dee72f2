"""The adapter's configuration: ``kv_connector_extra_config`` in kvtier's own names.

No vLLM import here: the main test suite checks the validation without vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.embedded import cluster_secrets, lookup_deadline, written_through
from kvtier.errors import ConfigurationError

__all__ = ["VLLM_KEYS", "VLLMSettings", "parse_extra_config"]

VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "offload_prompt_only",
        "self_describing_kv_events",
        "canonical_layout",
    }
)
"""Keys of ``kv_connector_extra_config`` that vLLM's connector itself reads."""

_OWN_KEYS = frozenset(
    {
        "cpu_bytes_to_use",
        "eviction_policy",
        "host_tier",
        "file_tier",
        "cluster_tier",
        "statistics_file",
        "model_revision",
        "lookup_deadline_s",
        "decline_slow_loads",
        "recompute_s_per_block",
    }
)

_WHERE = "kv_connector_extra_config"

DEFAULT_LOOKUP_DEADLINE_S = 2.0
"""How long a lookup may wait on a lower tier's read or probe before it is a miss."""


@dataclass(frozen=True, slots=True)
class VLLMSettings:
    """What the adapter takes from ``kv_connector_extra_config``."""

    config: KVTierConfig
    """kvtier's configuration (``blocks_per_chunk`` and ``world_size`` from vLLM's)."""
    statistics_file: Path | None
    """Where the scheduler side writes its statistics as JSON, or None."""
    model_revision: str | None = None
    """A name for the model's weights that replaces the fingerprint of its files
    in the namespace (see :func:`~kvtier.integrations.vllm.identity.model_identity`)."""
    lookup_deadline_s: float = DEFAULT_LOOKUP_DEADLINE_S
    """How long a lookup may answer "retry" while a lower tier is read or asked
    before it answers "miss" (vLLM recomputes)."""


def parse_extra_config(
    extra: Mapping[str, Any], *, blocks_per_chunk: int = 1, world_size: int = 1
) -> VLLMSettings:
    """Validate ``kv_connector_extra_config`` and build kvtier's configuration.

    Parameters
    ----------
    extra
        vLLM's ``kv_connector_extra_config``. kvtier's keys:
        ``cpu_bytes_to_use`` (required), ``eviction_policy``, ``host_tier``
        (:class:`~kvtier.config.HostTierConfig` fields), ``file_tier``
        (a table of :class:`~kvtier.config.FileTierConfig` fields: ``root``,
        ``bytes_to_use``, ``write_policy``, ``eviction_policy``, ...),
        ``cluster_tier`` (:class:`~kvtier.config.ClusterTierConfig` fields, the
        password from ``password_env`` or ``password_file``),
        ``statistics_file``, ``model_revision`` and ``lookup_deadline_s``;
        vLLM's own keys (:data:`VLLM_KEYS`) are left to it.
    blocks_per_chunk, world_size
        vLLM's values (device blocks per offloaded block, worker processes).

    Raises
    ------
    ConfigurationError
        For an unknown key, a bad value, a missing ``cpu_bytes_to_use``,
        ``write_policy = "write_back"`` (see Notes), or a cluster password in
        the JSON.

    Notes
    -----
    Only ``write_through`` is offered inside vLLM: under write-back a CPU row
    chosen for eviction must first be written to disk, and vLLM's
    ``prepare_store`` is synchronous and must not wait for I/O.
    """
    if not isinstance(extra, Mapping):
        raise ConfigurationError(
            f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}"
        )
    unknown = sorted(set(extra) - VLLM_KEYS - _OWN_KEYS)
    if unknown:
        raise ConfigurationError(
            f"kv_connector_extra_config: unknown key(s) {unknown} for kvtier; kvtier's keys "
            f"are {sorted(_OWN_KEYS)} (vLLM's own: {sorted(VLLM_KEYS)})",
            tuple((k, "unknown key") for k in unknown),
        )
    if "cpu_bytes_to_use" not in extra:
        raise ConfigurationError(
            'kv_connector_extra_config: cpu_bytes_to_use is required (e.g. "4GiB")',
            (("cpu_bytes_to_use", "required"),),
        )
    if extra.get("canonical_layout"):
        raise ConfigurationError(
            "kv_connector_extra_config: canonical_layout is not supported by kvtier",
            (("canonical_layout", "not supported"),),
        )
    fields = {
        k: extra[k]
        for k in (
            "cpu_bytes_to_use",
            "eviction_policy",
            "host_tier",
            "file_tier",
            "cluster_tier",
            "decline_slow_loads",
            "recompute_s_per_block",
        )
        if k in extra
    }
    if "cluster_tier" in fields:
        fields["cluster_tier"] = cluster_secrets(fields["cluster_tier"], _WHERE)
    config = KVTierConfig.from_dict(
        {**fields, "blocks_per_chunk": blocks_per_chunk, "world_size": world_size}
    )
    written_through(
        config,
        _WHERE,
        "inside vLLM (write-back would make vLLM's synchronous prepare_store wait for "
        "the tier's writes)",
    )
    deadline = lookup_deadline(extra, DEFAULT_LOOKUP_DEADLINE_S, _WHERE)
    stats = extra.get("statistics_file")
    if stats is not None and not isinstance(stats, str):
        raise ConfigurationError(
            f"kv_connector_extra_config: statistics_file must be a path string, got {stats!r}",
            (("statistics_file", "not a string"),),
        )
    revision = extra.get("model_revision")
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ConfigurationError(
            f"kv_connector_extra_config: model_revision must be a non-empty string, got "
            f"{revision!r}",
            (("model_revision", "not a non-empty string"),),
        )
    return VLLMSettings(
        config, None if stats is None else _statistics_path(stats), revision, deadline
    )


def _statistics_path(value: str) -> Path:
    """``statistics_file`` checked at start-up: a bad path would warn after every step."""
    path = Path(value)
    problem = None
    if not value.strip():
        problem = "is empty"
    elif path.is_dir():
        problem = f"{path} is a directory"
    elif not path.parent.is_dir():
        problem = f"its directory {path.parent} does not exist"
    elif not os.access(path.parent, os.W_OK | os.X_OK):
        problem = f"its directory {path.parent} is not writable"
    if problem is not None:
        raise ConfigurationError(
            f"kv_connector_extra_config: statistics_file {problem}",
            (("statistics_file", problem),),
        )
    return path
