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

import dataclasses
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheStorage,
)

from kvtier.below import LOWER_KEYS, LowerFront, parse_lower_settings
from kvtier.errors import ConfigurationError
from kvtier.integrations.sglang._keys import page_key
from kvtier.integrations.sglang._pool import (
    PageGeometry,
    Segments,
    Staging,
    check_indices,
    describe_pool,
    direct_slot,
    page_segments,
    pool_view,
)
from kvtier.layout import KVLayout, TensorSpec
from kvtier.region import ForeignRows

__all__ = ["BACKEND_KEYS", "STAGING_SLOTS", "KVTierHiCacheStorage"]

log = logging.getLogger("kvtier.integrations.sglang")

BACKEND_KEYS = LOWER_KEYS | {"staging_slots"}
"""kvtier's keys in the ``"kvtier"`` table of ``--hicache-storage-backend-extra-config``:
the lower front's (:data:`~kvtier.below.LOWER_KEYS`) and ``staging_slots``."""

STAGING_SLOTS = 256
"""Default staging slots (pages) for a pool kvtier cannot read into in place: two
of SGLang's batches of 128 pages, a backup and a prefetch at once."""

_WHERE = "--hicache-storage-backend-extra-config kvtier"
_TOP = "--hicache-storage-backend-extra-config"
_PLACEHOLDER_BYTES = 1 << 30
"""The buffer size the keys are checked with before the host pool is known."""
_STAGING_WAIT_S = 60.0
"""How long a call waits for free staging slots before its pages fail."""
_METRIC_SAMPLES = 4096
"""Per-call samples kept for :meth:`KVTierHiCacheStorage.get_stats` between reads."""
_GEOMETRY = ("head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim")


@dataclasses.dataclass(frozen=True, slots=True)
class _Attached:
    """What a registered host pool gives every call (set once, read by every thread)."""

    pool: Any
    geometry: PageGeometry
    front: LowerFront
    rows: ForeignRows
    namespace: bytes
    staging: Staging | None
    view: memoryview | None


class KVTierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """kvtier's lower tiers (host, file, cluster) as SGLang HiCache's L3 backend.

    Built by SGLang's ``dynamic`` backend factory as ``cls(storage_config,
    kwargs)``; SGLang then registers its host pool
    (:meth:`register_mem_pool_host`), which opens kvtier's tiers.

    Parameters
    ----------
    storage_config
        SGLang's ``HiCacheStorageConfig``. Its ``extra_config`` (the parsed
        ``--hicache-storage-backend-extra-config``) must say ``"interface_v1": 1``
        and hold kvtier's keys in a ``"kvtier"`` table (:data:`BACKEND_KEYS`):
        ``file_tier``, ``host_tier``, ``cluster_tier`` (tables as in kvtier's
        configuration), ``lookup_deadline_s``, ``decline_slow_loads``,
        ``recompute_s_per_block``, ``staging_slots``.
    kwargs
        What the factory passes on (empty from SGLang's controller); not used.

    Raises
    ------
    ConfigurationError
        No ``"kvtier"`` table, an unknown key or a bad value (named), no tier,
        ``interface_v1`` missing, or a sharding kvtier's namespace cannot tell
        apart (``tp_lcm_size``, ``should_split_heads``).
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.storage_config = storage_config
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
        self._table = dict(table)
        self._staging_slots = _staging_slots(self._table.pop("staging_slots", STAGING_SLOTS))
        parse_lower_settings(self._table, where=_WHERE, buffer_bytes=_PLACEHOLDER_BYTES)
        self._writer = bool(getattr(storage_config, "is_storage_writer", True))
        self._metrics_on = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._lock = threading.Lock()
        self._job_ids = itertools.count(1)
        self._attached: _Attached | None = None
        self._unusable = "no host pool registered"
        self._logged: set[str] = set()
        self._counts: dict[str, int] = {}
        self._samples: dict[str, deque[float]] = {
            name: deque(maxlen=_METRIC_SAMPLES)
            for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")
        }
        self._closed = False

    # -- registration ----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool: decide per layout how its pages are reached
        (in place or staged), name them (the namespace), open kvtier's tiers.

        A pool kvtier cannot name or reach (a layout other than ``layer_first``,
        ``page_first``, ``page_first_direct``; no buffer addresses) is logged
        once and every call then answers a miss.

        Raises
        ------
        KVTierError
            A tier failed to open (SGLang's attach fails with it).
        """
        super().register_mem_pool_host(mem_pool_host)
        self._detach()
        if self._closed:
            return
        try:
            geometry = describe_pool(mem_pool_host)
        except Exception as exc:
            geometry = f"its pages could not be described ({type(exc).__name__}: {exc})"
        if isinstance(geometry, str):
            self._unusable = geometry
            log.warning(
                "kvtier: SGLang's host pool cannot be stored below: %s; every page is a miss",
                geometry,
            )
            return
        staging: Staging | None = None
        view: memoryview | None = None
        rows: ForeignRows | None = None
        if geometry.direct:
            try:
                view = pool_view(mem_pool_host)
                rows = ForeignRows(view, geometry.page_bytes)
            except Exception as exc:
                log.info("kvtier: SGLang's host pool is staged: %s", exc)
                if view is not None:
                    view.release()
                view, geometry = None, dataclasses.replace(geometry, direct=False)
        if rows is None:
            staging = Staging(self._staging_slots, geometry.stride)
            rows = staging.rows
        try:
            settings = parse_lower_settings(
                self._table, where=_WHERE, buffer_bytes=rows.rows * rows.row_stride
            )
            layout = self._layout(mem_pool_host, geometry)
            front = LowerFront.open(
                settings,
                layout,
                rows,
                name="kvtier-sglang-l3",
                lookup_limit=max(rows.rows, geometry.capacity // geometry.step),
            )
        except BaseException:
            rows.release()
            if staging is not None:
                staging.close(released=True)  # the front never opened: no I/O
            if view is not None:
                view.release()
            raise
        self._attached = _Attached(
            mem_pool_host, geometry, front, rows, layout.namespace, staging, view
        )
        log.info(
            "kvtier: SGLang host pool %s (%s, pages of %d bytes in %d segment(s)) %s",
            type(mem_pool_host).__name__,
            geometry.layout,
            geometry.page_bytes,
            len(geometry.segment_sizes),
            "read and written in place"
            if geometry.direct
            else f"staged through {rows.rows} slots of {rows.row_stride} bytes",
        )

    @property
    def direct(self) -> bool | None:
        """Pages go to and from SGLang's host pool in place (True), through kvtier's
        staging slots (False), or not at all (None: no usable pool)."""
        attached = self._attached
        return None if attached is None else attached.geometry.direct

    @property
    def front(self) -> LowerFront | None:
        """The lower front (kvtier's statistics, for tests and tools); None before a
        usable pool is registered."""
        attached = self._attached
        return None if attached is None else attached.front

    @property
    def counts(self) -> dict[str, int]:
        """What this backend counted: pages stored, loaded and failed, calls refused
        (``refused_<why>``) and failures (``failed_<call>``)."""
        with self._lock:
            return dict(self._counts)

    # -- the calls SGLang makes -------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` kvtier can load now (a shared tier asked and
        waited for, ``lookup_deadline_s`` at most); a key that is not 64 hex
        characters ends the prefix."""
        try:
            attached = self._usable()
            if attached is None:
                return 0
            wanted: list[bytes] = []
            for key in keys:
                kv = page_key(key, attached.namespace)
                if kv is None:
                    self._refused("key", "a key is not 64 hexadecimal characters")
                    break
                wanted.append(kv)
            return attached.front.prefix(wanted) if wanted else 0
        except Exception as exc:
            self._failed("batch_exists", exc)
            return 0

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Load each key's page into the host pool at ``host_indices`` (page ``i``
        from ``host_indices[i * page_size]``), verified; one bool per key."""
        try:
            return self._transfer(keys, host_indices, load=True)
        except Exception as exc:
            self._failed("batch_get_v1", exc)
            return [False] * _length(keys)

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys`` in every
        tier that lacks them; one bool per key (True: stored, or held already).

        On an MLA rank that is not its shard's storage writer nothing is stored
        and every key is True (the writer rank stores the same bytes).
        """
        try:
            return self._transfer(keys, host_indices, load=False)
        except Exception as exc:
            self._failed("batch_set_v1", exc)
            return [False] * _length(keys)

    def exists(self, key: str) -> bool:
        """Whether kvtier can load ``key``'s page now."""
        return self.batch_exists([key]) == 1

    # The legacy calls: SGLang makes them only without "interface_v1", which the
    # constructor refuses. Defined (they are abstract), answering a miss.

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Not supported (kvtier needs ``"interface_v1": 1``): None."""
        self._legacy("get")
        return None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """Not supported (kvtier needs ``"interface_v1": 1``): None per key."""
        self._legacy("batch_get")
        return [None] * _length(keys)

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Not supported (kvtier needs ``"interface_v1": 1``): False."""
        self._legacy("set")
        return False

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Not supported (kvtier needs ``"interface_v1": 1``): False."""
        self._legacy("batch_set")
        return False

    def clear(self) -> None:
        """Nothing: kvtier keeps its blocks (each verified when read, every tier
        bounded by its ``bytes_to_use``); SGLang's ``clear_storage_backend`` logs so."""
        self._once(
            "clear",
            logging.INFO,
            "kvtier: clear_storage_backend keeps kvtier's blocks (verified on every read, "
            "bounded by each tier's bytes_to_use); remove a file tier root by hand to drop them",
        )

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s of each
        backup and prefetch call) with ``--enable-storage-metrics``; else None."""
        if not self._metrics_on:
            return None
        try:
            from sglang.srt.observability.metrics_collector import (  # type: ignore[import-not-found]
                StorageMetrics,
            )

            metrics = StorageMetrics()
            with self._lock:
                for name, samples in self._samples.items():
                    getattr(metrics, name).extend(samples)
                    samples.clear()
            return metrics
        except Exception as exc:
            self._failed("get_stats", exc)
            return None

    def close(self) -> None:
        """Wait for transfers in flight (30 s at most), close kvtier's tiers, release
        every view of SGLang's host pool and unmap the staging slots."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._detach()
        except Exception as exc:
            self._failed("close", exc)

    # -- inside ----------------------------------------------------------------------------

    def _layout(self, pool: Any, geometry: PageGeometry) -> KVLayout:
        """What a page's bytes mean: the namespace every key of this pool is made in.

        The served model's name (with the pool's storage format tag), the host
        pool's class, KV dtype, layout, page size and segments, layers and head
        geometry, SGLang's release (major.minor), and the shard: TP rank and
        size for MHA (an MLA page is the same on every rank), PP, attention CP
        and DCP rank and size. Not the DP rank: replicas share their pages.
        """
        cfg = self.storage_config
        mla = bool(cfg.is_mla_model)
        desc = {
            "integration": "sglang-hicache",
            "sglang": _sglang_release(),
            "model_name": cfg.model_name or "",
            "pool": type(pool).__name__,
            "dtype": str(pool.dtype).removeprefix("torch."),
            "layout": geometry.layout,
            "page_size": int(pool.page_size),
            "logical_page_size": cfg.logical_page_size,
            "segments": list(geometry.segment_sizes),
            "layer_num": int(pool.layer_num),
            "geometry": {
                name: int(value)
                for name in _GEOMETRY
                if isinstance(value := getattr(pool, name, None), int)
            },
            "is_mla_model": mla,
            "tp": None if mla else [int(cfg.tp_rank), int(cfg.tp_size)],
            "pp": [int(cfg.pp_rank), int(cfg.pp_size)],
            "attn_cp": [int(cfg.attn_cp_rank), int(cfg.attn_cp_size)],
            "dcp": [int(cfg.dcp_rank), int(cfg.dcp_size)],
        }
        spec = TensorSpec("sglang_page", (1, geometry.stride), "int8", 1, False)
        return KVLayout(
            tensors=(spec,), model_id=json.dumps(desc, sort_keys=True), block_tokens=geometry.step
        )

    def _usable(self) -> _Attached | None:
        attached = self._attached
        if self._closed:
            self._refused("closed", "the backend is closed")
            return None
        if attached is None:
            self._refused("pool", f"kvtier stores nothing: {self._unusable}")
        return attached

    def _transfer(self, keys: Sequence[str], host_indices: Any, *, load: bool) -> list[bool]:
        if not isinstance(keys, Sequence) or isinstance(keys, str | bytes):
            self._refused("keys", "keys is not a list of SGLang's page keys")
            return [False] * _length(keys)
        n = len(keys)
        if n == 0:
            return []
        attached = self._usable()
        if attached is None:
            return [False] * n
        if not load and not self._writer:
            return [True] * n  # an MLA page: its shard's writer rank stores it
        geometry = attached.geometry
        if not check_indices(host_indices, n, geometry):
            self._refused("indices", "host_indices do not name whole pages of the host pool")
            return [False] * n
        pages = page_segments(attached.pool, host_indices, n, geometry)
        if pages is None:
            self._refused("segments", "the host pool's page addresses changed")
            return [False] * n
        kv = [page_key(k, attached.namespace) for k in keys]
        if None in kv:
            self._refused("key", "a key is not 64 hexadecimal characters")
        first: dict[bytes, int] = {}
        todo: list[tuple[int, bytes]] = []  # (position, kvtier key), each key once
        for i, k in enumerate(kv):
            if k is not None and k not in first:
                first[k] = i
                todo.append((i, k))
        results = [False] * n
        started = time.monotonic()
        if attached.staging is None:
            placed = [(i, k, direct_slot(pages[i], geometry)) for i, k in todo]
            if any(s is None for _i, _k, s in placed):
                self._refused("segments", "a page lies outside the host pool's pages")
            ready = [(i, k, s) for i, k, s in placed if s is not None]
            done = self._run(
                attached.front, load, [k for _i, k, _s in ready], [s for _i, _k, s in ready]
            )
            for i, k, _s in ready:
                results[i] = k in done
        else:
            self._staged(attached.front, attached.staging, load, todo, pages, results)
        if not load:  # the same page twice in one call: stored once
            for i, k in enumerate(kv):
                if k is not None and first[k] != i:
                    results[i] = results[first[k]]
        self._record(load, sum(results), geometry.page_bytes, time.monotonic() - started)
        return results

    def _staged(
        self,
        front: LowerFront,
        staging: Staging,
        load: bool,
        todo: Sequence[tuple[int, bytes]],
        pages: Sequence[Segments],
        results: list[bool],
    ) -> None:
        for start in range(0, len(todo), staging.slots):
            chunk = todo[start : start + staging.slots]
            slots = staging.take(len(chunk), _STAGING_WAIT_S)
            if slots is None:
                self._refused("staging", "no staging slot came free in time")
                continue
            try:
                if not load:
                    for (i, _k), slot in zip(chunk, slots, strict=True):
                        staging.gather(slot, pages[i])
                done = self._run(front, load, [k for _i, k in chunk], slots)
                for (i, k), slot in zip(chunk, slots, strict=True):
                    if k in done:
                        if load:
                            staging.scatter(slot, pages[i])
                        results[i] = True
            finally:
                staging.give(slots)  # the job ended: no I/O touches them

    def _run(
        self, front: LowerFront, load: bool, keys: Sequence[bytes], slots: Sequence[int]
    ) -> frozenset[bytes]:
        """One job over ``keys`` in ``slots``, waited for; the keys that succeeded."""
        if not keys:
            return frozenset()
        with self._lock:
            job = next(self._job_ids)
        if load:
            front.load(job, keys, slots)
        else:
            front.store(job, keys, slots)
        # No timeout: the front reports a job only when no I/O touches its slots any
        # more (SGLang reuses a page it got False for); each tier bounds its own I/O.
        ended = front.wait(job)
        done = ended.done if ended is not None else frozenset()
        if len(done) < len(keys):
            self._count("pages_failed", len(keys) - len(done))
        return done

    def _record(self, load: bool, pages: int, page_bytes: int, seconds: float) -> None:
        with self._lock:
            name = "pages_loaded" if load else "pages_stored"
            self._counts[name] = self._counts.get(name, 0) + pages
            if self._metrics_on and pages:
                kind = "prefetch" if load else "backup"
                self._samples[f"{kind}_pgs"].append(pages)
                self._samples[f"{kind}_bandwidth"].append(
                    pages * page_bytes / max(seconds, 1e-9) / 1e9
                )

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def _refused(self, why: str, message: str) -> None:
        self._count(f"refused_{why}")
        self._once(f"refused_{why}", logging.WARNING, "kvtier: %s (logged once)", message)

    def _failed(self, call: str, exc: BaseException) -> None:
        self._count(f"failed_{call}")
        self._once(
            f"failed_{call}",
            logging.WARNING,
            "kvtier: %s failed (%s: %s); answered a miss (logged once)",
            call,
            type(exc).__name__,
            exc,
        )

    def _legacy(self, call: str) -> None:
        self._count(f"refused_{call}")
        self._once(
            "legacy",
            logging.WARNING,
            "kvtier: SGLang called %s: kvtier implements only the zero-copy calls and "
            'needs "interface_v1": 1 in --hicache-storage-backend-extra-config; a miss',
            call,
        )

    def _once(self, kind: str, level: int, message: str, *args: object) -> None:
        with self._lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        log.log(level, message, *args)

    def _detach(self) -> None:
        """Close the tiers of the pool registered before, if any; release its views."""
        attached, self._attached = self._attached, None
        if attached is None:
            return
        released = attached.front.close()
        if attached.staging is not None:
            attached.staging.close(released)
        elif attached.view is not None and released:
            attached.view.release()


def _staging_slots(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65536:
        raise ConfigurationError(
            f"{_WHERE}: staging_slots must be an int in [1, 65536], got {value!r}",
            (("staging_slots", "not an int in [1, 65536]"),),
        )
    return value


def _length(keys: Any) -> int:
    try:
        return len(keys)
    except TypeError:
        return 0


def _sglang_release() -> str:
    """SGLang's major.minor: a page's byte order is the release's (a patch keeps it)."""
    try:
        import sglang  # type: ignore[import-not-found]

        return ".".join(str(sglang.__version__).split(".")[:2])
    except Exception:  # pragma: no cover - SGLang is imported already
        return "unknown"
