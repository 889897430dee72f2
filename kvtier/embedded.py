"""kvtier's configuration as another engine's JSON carries it: the checks every front shares.

vLLM's ``kv_connector_extra_config`` and SGLang's
``--hicache-storage-backend-extra-config`` both carry kvtier's tier tables;
the rules that differ from a TOML file kvtier reads itself (no password in
JSON an engine logs, a lookup deadline) are checked here once. ``where`` names
the engine's setting in every message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigurationError

__all__ = ["cluster_secrets", "lookup_deadline", "written_through"]


def lookup_deadline(table: Mapping[str, object], default: float, where: str) -> float:
    """``lookup_deadline_s`` of ``table`` (or ``default``): seconds in (0, 600].

    Raises
    ------
    ConfigurationError
        Not a number of seconds in that range (the key named).
    """
    deadline = table.get("lookup_deadline_s", default)
    if (
        isinstance(deadline, bool)
        or not isinstance(deadline, int | float)
        or not 0 < deadline <= 600
    ):
        raise ConfigurationError(
            f"{where}: lookup_deadline_s must be a number of seconds in (0, 600], got {deadline!r}",
            (("lookup_deadline_s", "not a number of seconds in (0, 600]"),),
        )
    return float(deadline)


def cluster_secrets(table: object, where: str) -> object:
    """``cluster_tier`` with its password read from the environment or a file.

    The engines log their configuration whole at start-up (vLLM its
    ``kv_connector_extra_config``, SGLang its server arguments): a password
    there would land in every log. ``password_env`` names an environment
    variable, ``password_file`` a file (its first line); ``password`` itself
    is refused.
    """
    if not isinstance(table, Mapping):
        return table  # KVTierConfig names the problem
    out = dict(table)
    if "password" in out:
        raise ConfigurationError(
            f"{where}: cluster_tier.password would be logged by the engine with the "
            "rest of its configuration: give password_env (an environment variable's "
            "name) or password_file instead",
            (
                (
                    "cluster_tier.password",
                    "not accepted in an engine's configuration: use password_env or password_file",
                ),
            ),
        )
    env, path = out.pop("password_env", None), out.pop("password_file", None)
    if env is not None and path is not None:
        raise ConfigurationError(
            f"{where}: cluster_tier takes password_env or password_file, not both",
            (("cluster_tier.password_env", "given with password_file"),),
        )
    if env is not None:
        if not isinstance(env, str) or env not in os.environ:
            raise ConfigurationError(
                f"{where}: cluster_tier.password_env names {env!r}, which is "
                "not set in this process's environment",
                (("cluster_tier.password_env", "not set"),),
            )
        out["password"] = os.environ[env]
    elif path is not None:
        try:
            out["password"] = Path(str(path)).read_text().splitlines()[0]
        except (OSError, IndexError) as exc:
            raise ConfigurationError(
                f"{where}: cluster_tier.password_file {path!r} cannot be read: {exc}",
                (("cluster_tier.password_file", "unreadable or empty"),),
            ) from exc
    return out


def written_through(config: KVTierConfig, where: str, why: str) -> None:
    """Refuse a ``write_back`` tier in ``config``: the front cannot wait for it (``why``).

    Raises
    ------
    ConfigurationError
        Naming the first such tier's ``write_policy``.
    """
    for name, spec in config.chain:
        if spec.write_policy != "write_through":
            raise ConfigurationError(
                f'{where}: {name}_tier.write_policy must be "write_through" {why}',
                ((f"{name}_tier.write_policy", "write_back is not supported here"),),
            )
