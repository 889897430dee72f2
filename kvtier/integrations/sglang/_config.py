"""kvtier's keys in SGLang's storage config: the checks made before a host pool is
known (:func:`backend_table`), the key set and the staging default (no SGLang import)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.below import LOWER_KEYS, parse_lower_settings
from kvtier.errors import ConfigurationError

__all__ = ["BACKEND_KEYS", "STAGING_SLOTS", "WHERE", "backend_table"]

BACKEND_KEYS = LOWER_KEYS | {"staging_slots"}
"""kvtier's keys in the ``"kvtier"`` table of ``--hicache-storage-backend-extra-config``:
the lower front's (:data:`~kvtier.below.LOWER_KEYS`) and ``staging_slots``."""

STAGING_SLOTS = 256
"""Default staging slots (pages) for a pool kvtier cannot read into in place: two
of SGLang's batches of 128 pages, a backup and a prefetch at once."""

WHERE = "--hicache-storage-backend-extra-config kvtier"
_TOP = "--hicache-storage-backend-extra-config"
_PLACEHOLDER_BYTES = 1 << 30
"""The buffer size the keys are checked with before the host pool is known."""


def backend_table(storage_config: Any) -> tuple[dict[str, Any], int]:
    """Check SGLang's ``HiCacheStorageConfig`` for kvtier; the ``"kvtier"`` table
    (without ``staging_slots``) and the staging slot count.

    Raises
    ------
    ConfigurationError
        Whatever :class:`~kvtier.integrations.sglang.KVTierHiCacheStorage` refuses
        to be built with (its docstring lists them); each names its key.
    """
    extra = storage_config.extra_config or {}
    if not bool(extra.get("interface_v1", 0)):
        raise ConfigurationError(
            f'{_TOP}: kvtier needs "interface_v1": 1 (SGLang then calls its zero-copy '
            "batch_get_v1 / batch_set_v1; kvtier does not implement the legacy calls)",
            (("interface_v1", "missing or false"),),
        )
    if getattr(storage_config, "tp_lcm_size", None) is not None or getattr(
        storage_config, "should_split_heads", False
    ):
        raise ConfigurationError(
            f"{_TOP}: tp_lcm_size (heterogeneous tensor parallelism, split heads) is not "
            "supported by kvtier: its pages are named per TP size and rank",
            (("tp_lcm_size", "not supported"),),
        )
    table = extra.get("kvtier")
    if table is None:
        raise ConfigurationError(
            f'{_TOP}: no "kvtier" table: kvtier\'s keys go in '
            '"kvtier": {"file_tier": {"root": ..., "bytes_to_use": ...}}',
            (("kvtier", "missing"),),
        )
    if not isinstance(table, Mapping):
        raise ConfigurationError(
            f'{_TOP}: "kvtier" must be a table, got {type(table).__name__}',
            (("kvtier", "not a table"),),
        )
    keys = dict(table)
    slots = _staging_slots(keys.pop("staging_slots", STAGING_SLOTS))
    parse_lower_settings(keys, where=WHERE, buffer_bytes=_PLACEHOLDER_BYTES)
    return keys, slots


def _staging_slots(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65536:
        raise ConfigurationError(
            f"{WHERE}: staging_slots must be an int in [1, 65536], got {value!r}",
            (("staging_slots", "not an int in [1, 65536]"),),
        )
    return value
