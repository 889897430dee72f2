"""kvtier as the L3 storage backend of SGLang HiCache (below SGLang's host pool).

SGLang 0.5.23 keeps the KV cache of evicted prefixes in its own host pool (L2)
and writes pages below it to an L3 backend, loaded by module path::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KVTierHiCacheStorage", "interface_v1": 1,
        "kvtier": {"file_tier": {"root": "/mnt/nvme/kvtier", "bytes_to_use": "500GiB"}}}'

:class:`KVTierHiCacheStorage` is a thin adapter over kvtier's lower front
(:class:`~kvtier.below.LowerFront`): a page of SGLang's host pool is one
kvtier block, read in place where the pool's layout allows (MLA
``page_first`` / ``page_first_direct``: O_DIRECT into SGLang's memory) and
through kvtier's own page-aligned staging slots otherwise; kvtier's chain
decides as for every front (verified reads, fall-through, deadlines, the load
decision). SGLang calls it from three threads at once, each waiting for its
result; nothing here raises into them: a refused or failed page is ``False``
(a miss). See docs/sglang.md.
"""

from __future__ import annotations

from kvtier.integrations.sglang._config import BACKEND_KEYS, STAGING_SLOTS
from kvtier.integrations.sglang._storage import KVTierHiCacheStorage

__all__ = ["BACKEND_KEYS", "STAGING_SLOTS", "KVTierHiCacheStorage"]
