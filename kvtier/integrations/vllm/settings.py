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
    {"cpu_bytes_to_use", "eviction_policy", "file_tier", "statistics_file", "model_revision"}
)


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


def parse_extra_config(
    extra: Mapping[str, Any], *, blocks_per_chunk: int = 1, world_size: int = 1
) -> VLLMSettings:
    """Validate ``kv_connector_extra_config`` and build kvtier's configuration.

    Parameters
    ----------
    extra
        vLLM's ``kv_connector_extra_config``. kvtier's keys:
        ``cpu_bytes_to_use`` (required), ``eviction_policy``, ``file_tier``
        (a table of :class:`~kvtier.config.FileTierConfig` fields: ``root``,
        ``bytes_to_use``, ``write_policy``, ``eviction_policy``, ...),
        ``statistics_file`` and ``model_revision``; vLLM's own keys
        (:data:`VLLM_KEYS`) are left to it.
    blocks_per_chunk, world_size
        vLLM's values (device blocks per offloaded block, worker processes).

    Raises
    ------
    ConfigurationError
        For an unknown key, a bad value, a missing ``cpu_bytes_to_use``, or
        ``write_policy = "write_back"`` (see Notes).

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
    if "cluster_tier" in extra:
        # A key of KVTierConfig that this front does not drive yet: not "unknown".
        raise ConfigurationError(
            "kv_connector_extra_config: cluster_tier is not supported inside vLLM yet (the "
            "Engine drives it; see docs/vllm.md). Share KV between vLLM instances through "
            "the CPU and file tiers of each instance for now",
            (("cluster_tier", "not supported inside vLLM yet"),),
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
        k: extra[k] for k in ("cpu_bytes_to_use", "eviction_policy", "file_tier") if k in extra
    }
    config = KVTierConfig.from_dict(
        {**fields, "blocks_per_chunk": blocks_per_chunk, "world_size": world_size}
    )
    if config.file_tier is not None and config.file_tier.write_policy != "write_through":
        raise ConfigurationError(
            'kv_connector_extra_config: file_tier.write_policy must be "write_through" '
            "inside vLLM (write-back would make vLLM's synchronous prepare_store wait for "
            "disk writes)",
            (("file_tier.write_policy", "write_back is not supported inside vLLM"),),
        )
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
    return VLLMSettings(config, None if stats is None else _statistics_path(stats), revision)


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
