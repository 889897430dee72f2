"""What the SGLang backend counts and logs: its counts, SGLang's storage metrics, the
warnings logged once per kind (:class:`Report`, one per backend)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

__all__ = ["Report", "log"]

log = logging.getLogger("kvtier.integrations.sglang")

_METRIC_SAMPLES = 4096
"""Per-call samples kept for :meth:`KVTierHiCacheStorage.get_stats` between reads."""


class Report:
    """A backend's counts, per-call metric samples and logged-once kinds; every
    method is safe from SGLang's threads at once.

    Parameters
    ----------
    metrics_on
        SGLang's ``enable_storage_metrics``: keep per-call samples for
        :meth:`metrics`.
    """

    def __init__(self, metrics_on: bool) -> None:
        self._metrics_on = metrics_on
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._counts: dict[str, int] = {}
        self._samples: dict[str, deque[float]] = {
            name: deque(maxlen=_METRIC_SAMPLES)
            for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")
        }

    @property
    def counts(self) -> dict[str, int]:
        """A snapshot of what was counted."""
        with self._lock:
            return dict(self._counts)

    def metrics(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call; None with metrics off or
        when they cannot be built (counted as a ``get_stats`` failure)."""
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
            self.failed("get_stats", exc)
            return None

    def record(self, load: bool, pages: int, page_bytes: int, seconds: float) -> None:
        """Count one call's pages loaded or stored; sample its pages and GB/s."""
        with self._lock:
            name = "pages_loaded" if load else "pages_stored"
            self._counts[name] = self._counts.get(name, 0) + pages
            if self._metrics_on and pages:
                kind = "prefetch" if load else "backup"
                self._samples[f"{kind}_pgs"].append(pages)
                self._samples[f"{kind}_bandwidth"].append(
                    pages * page_bytes / max(seconds, 1e-9) / 1e9
                )

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the count ``name``."""
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def refused(self, why: str, message: str) -> None:
        """Count a call refused (``refused_<why>``); warn once per ``why``."""
        self.count(f"refused_{why}")
        self.once(f"refused_{why}", logging.WARNING, "kvtier: %s (logged once)", message)

    def failed(self, call: str, exc: BaseException) -> None:
        """Count a call that raised (``failed_<call>``); warn once per ``call``."""
        self.count(f"failed_{call}")
        self.once(
            f"failed_{call}",
            logging.WARNING,
            "kvtier: %s failed (%s: %s); answered a miss (logged once)",
            call,
            type(exc).__name__,
            exc,
        )

    def legacy(self, call: str) -> None:
        """Count a legacy call (``refused_<call>``); warn once for all of them."""
        self.count(f"refused_{call}")
        self.once(
            "legacy",
            logging.WARNING,
            "kvtier: SGLang called %s: kvtier implements only the zero-copy calls and "
            'needs "interface_v1": 1 in --hicache-storage-backend-extra-config; a miss',
            call,
        )

    def once(self, kind: str, level: int, message: str, *args: object) -> None:
        """Log ``message`` the first time ``kind`` comes, never again."""
        with self._lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        log.log(level, message, *args)
