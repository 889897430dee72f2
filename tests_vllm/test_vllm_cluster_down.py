"""vLLM's scheduler side starts with its cluster unreachable; a failed start leaves nothing.

Issue 41: a vLLM instance could not start while a node of its Valkey cluster
did not answer. The cache is optional and serving is not: the manager opens,
its cluster tier down (every block a miss). Where the user asked to fail
fast (``require_at_open``), the failed start releases what it opened: the
tiers, the loop thread, and the CPU region's ``/dev/shm`` file. Built from a
real ``OffloadingConfig``, in this process (no model, no engine).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import TierIOError
from tests_vllm._harness import offloading_config

# Nothing listens on port 1: refused at once.
UNREACHABLE = {"nodes": ["127.0.0.1:1"], "connect_timeout_s": 0.2, "timeout_s": 0.2}


def _spec(cluster: dict[str, Any]) -> Any:
    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    return KVTierOffloadingSpec(offloading_config(extra={"cluster_tier": cluster}))


def _left() -> tuple[set[Path], list[threading.Thread]]:
    files = set(Path("/dev/shm").glob("kvtier-vllm-*"))
    loops = [t for t in threading.enumerate() if t.name == "kvtier-vllm-scheduler"]
    return files, loops


def test_the_scheduler_starts_with_the_cluster_unreachable() -> None:
    t0 = time.monotonic()
    manager = _spec(UNREACHABLE).get_manager()
    try:
        assert time.monotonic() - t0 < 10.0
        cluster = manager.statistics().tiers["cluster"].statistics
        assert (cluster.nodes_down, cluster.outages) == (1, 1)
    finally:
        manager.shutdown()


@pytest.mark.parametrize("where", ["tier", "constructor"])
def test_a_failed_start_releases_what_it_opened(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.integrations.vllm.manager import KVTierOffloadingManager

    files, loops = _left()
    error: type[Exception]
    if where == "constructor":

        def fail(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("a failure after the tiers opened")

        monkeypatch.setattr(KVTierOffloadingManager, "__init__", fail)
        spec, error = _spec(UNREACHABLE), RuntimeError
    else:
        spec, error = _spec({**UNREACHABLE, "require_at_open": True}), TierIOError
    with pytest.raises(error):
        spec.get_manager()
    left_files, left_loops = _left()
    assert left_files <= files, "the region's /dev/shm file was left"
    assert len(left_loops) <= len(loops), "the loop thread was left running"
