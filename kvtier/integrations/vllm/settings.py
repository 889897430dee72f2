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
        fields["cluster_tier"] = _cluster_secrets(fields["cluster_tier"])
    config = KVTierConfig.from_dict(
        {**fields, "blocks_per_chunk": blocks_per_chunk, "world_size": world_size}
    )
    for name, spec in config.chain:
        if spec.write_policy != "write_through":
            raise ConfigurationError(
                f'kv_connector_extra_config: {name}_tier.write_policy must be "write_through" '
                "inside vLLM (write-back would make vLLM's synchronous prepare_store wait "
                "for the tier's writes)",
                ((f"{name}_tier.write_policy", "write_back is not supported inside vLLM"),),
            )
    deadline = extra.get("lookup_deadline_s", DEFAULT_LOOKUP_DEADLINE_S)
    if (
        isinstance(deadline, bool)
        or not isinstance(deadline, int | float)
        or not 0 < deadline <= 600
    ):
        raise ConfigurationError(
            f"kv_connector_extra_config: lookup_deadline_s must be a number of seconds in "
            f"(0, 600], got {deadline!r}",
            (("lookup_deadline_s", "not a number of seconds in (0, 600]"),),
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
    return VLLMSettings(
        config, None if stats is None else _statistics_path(stats), revision, float(deadline)
    )


def _cluster_secrets(table: object) -> object:
    """``cluster_tier`` with its password read from the environment or a file.

    vLLM logs ``kv_connector_extra_config`` whole at start-up: a password
    there would land in every log. ``password_env`` names an environment
    variable, ``password_file`` a file (its first line); ``password`` itself
    is refused.
    """
    if not isinstance(table, Mapping):
        return table  # KVTierConfig names the problem
    out = dict(table)
    if "password" in out:
        raise ConfigurationError(
            "kv_connector_extra_config: cluster_tier.password would be logged by vLLM "
            "with the rest of kv_connector_extra_config: give password_env (an "
            "environment variable's name) or password_file instead",
            (
                (
                    "cluster_tier.password",
                    "not accepted inside vLLM: use password_env or password_file",
                ),
            ),
        )
    env, path = out.pop("password_env", None), out.pop("password_file", None)
    if env is not None and path is not None:
        raise ConfigurationError(
            "kv_connector_extra_config: cluster_tier takes password_env or password_file, not both",
            (("cluster_tier.password_env", "given with password_file"),),
        )
    if env is not None:
        if not isinstance(env, str) or env not in os.environ:
            raise ConfigurationError(
                f"kv_connector_extra_config: cluster_tier.password_env names {env!r}, which is "
                "not set in this process's environment",
                (("cluster_tier.password_env", "not set"),),
            )
        out["password"] = os.environ[env]
    elif path is not None:
        try:
            out["password"] = Path(str(path)).read_text().splitlines()[0]
        except (OSError, IndexError) as exc:
            raise ConfigurationError(
                f"kv_connector_extra_config: cluster_tier.password_file {path!r} cannot be "
                f"read: {exc}",
                (("cluster_tier.password_file", "unreadable or empty"),),
            ) from exc
    return out


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
