"""SGLang HiCache's L3 backend: :class:`KVTierHiCacheStorage`, the calls SGLang makes,
its host pool's registration and the transfers over kvtier's lower front."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheStorage,
)

from kvtier.below import LowerFront, parse_lower_settings
from kvtier.integrations.sglang._config import WHERE, backend_table
from kvtier.integrations.sglang._keys import page_key
from kvtier.integrations.sglang._namespace import page_layout
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
from kvtier.integrations.sglang._report import Report, log
from kvtier.region import ForeignRows

__all__ = ["KVTierHiCacheStorage"]

_STAGING_WAIT_S = 60.0
"""How long a call waits for free staging slots before its pages fail."""


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
        self._table, self._staging_slots = backend_table(storage_config)
        self._writer = bool(getattr(storage_config, "is_storage_writer", True))
        self._report = Report(bool(getattr(storage_config, "enable_storage_metrics", False)))
        self._lock = threading.Lock()
        self._job_ids = itertools.count(1)
        self._attached: _Attached | None = None
        self._unusable = "no host pool registered"
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
                self._table, where=WHERE, buffer_bytes=rows.rows * rows.row_stride
            )
            layout = page_layout(self.storage_config, mem_pool_host, geometry)
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
        return self._report.counts

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
                    self._report.refused("key", "a key is not 64 hexadecimal characters")
                    break
                wanted.append(kv)
            return attached.front.prefix(wanted) if wanted else 0
        except Exception as exc:
            self._report.failed("batch_exists", exc)
            return 0

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Load each key's page into the host pool at ``host_indices`` (page ``i``
        from ``host_indices[i * page_size]``), verified; one bool per key."""
        try:
            return self._transfer(keys, host_indices, load=True)
        except Exception as exc:
            self._report.failed("batch_get_v1", exc)
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
            self._report.failed("batch_set_v1", exc)
            return [False] * _length(keys)

    def exists(self, key: str) -> bool:
        """Whether kvtier can load ``key``'s page now."""
        return self.batch_exists([key]) == 1

    # The legacy calls: SGLang makes them only without "interface_v1", which the
    # constructor refuses. Defined (they are abstract), answering a miss.

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Not supported (kvtier needs ``"interface_v1": 1``): None."""
        self._report.legacy("get")
        return None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """Not supported (kvtier needs ``"interface_v1": 1``): None per key."""
        self._report.legacy("batch_get")
        return [None] * _length(keys)

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Not supported (kvtier needs ``"interface_v1": 1``): False."""
        self._report.legacy("set")
        return False

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Not supported (kvtier needs ``"interface_v1": 1``): False."""
        self._report.legacy("batch_set")
        return False

    def clear(self) -> None:
        """Nothing: kvtier keeps its blocks (each verified when read, every tier
        bounded by its ``bytes_to_use``); SGLang's ``clear_storage_backend`` logs so."""
        self._report.once(
            "clear",
            logging.INFO,
            "kvtier: clear_storage_backend keeps kvtier's blocks (verified on every read, "
            "bounded by each tier's bytes_to_use); remove a file tier root by hand to drop them",
        )

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s of each
        backup and prefetch call) with ``--enable-storage-metrics``; else None."""
        return self._report.metrics()

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
            self._report.failed("close", exc)

    # -- inside ----------------------------------------------------------------------------

    def _usable(self) -> _Attached | None:
        attached = self._attached
        if self._closed:
            self._report.refused("closed", "the backend is closed")
            return None
        if attached is None:
            self._report.refused("pool", f"kvtier stores nothing: {self._unusable}")
        return attached

    def _transfer(self, keys: Sequence[str], host_indices: Any, *, load: bool) -> list[bool]:
        if not isinstance(keys, Sequence) or isinstance(keys, str | bytes):
            self._report.refused("keys", "keys is not a list of SGLang's page keys")
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
            self._report.refused("indices", "host_indices do not name whole pages of the host pool")
            return [False] * n
        pages = page_segments(attached.pool, host_indices, n, geometry)
        if pages is None:
            self._report.refused("segments", "the host pool's page addresses changed")
            return [False] * n
        kv = [page_key(k, attached.namespace) for k in keys]
        if None in kv:
            self._report.refused("key", "a key is not 64 hexadecimal characters")
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
                self._report.refused("segments", "a page lies outside the host pool's pages")
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
        self._report.record(load, sum(results), geometry.page_bytes, time.monotonic() - started)
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
                self._report.refused("staging", "no staging slot came free in time")
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
            self._report.count("pages_failed", len(keys) - len(done))
        return done

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


def _length(keys: Any) -> int:
    try:
        return len(keys)
    except TypeError:
        return 0
