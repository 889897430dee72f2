"""A vLLM worker killed before its scheduler joined: its region file is reaped.

vLLM builds its workers before its scheduler, so a worker creates the shared
CPU region and keeps its name for the scheduler (``holder=True``). If the
worker dies (SIGKILL) before the scheduler comes, the file stays in
``/dev/shm``; kvtier's reaper (``kvtier.region.reap_shared_regions``, also run
by every shared region's creation for files stale a minute) removes it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

from kvtier.region import reap_shared_regions
from tests_vllm._harness import offloading_config

ROW = 4096


def _worker(engine_id: str, ready: Any) -> None:
    """vLLM's worker side: the spec, then ``get_worker`` with vLLM's canonical caches."""
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    spec = KVTierOffloadingSpec(offloading_config(engine_id=engine_id, row_bytes=ROW))
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(torch.zeros((16, ROW), dtype=torch.int8), ROW)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=ROW)]],
    )
    spec.get_worker(caches)
    ready.put("attached")
    time.sleep(600)


def _region_files() -> set[Path]:
    return set(Path("/dev/shm").glob("kvtier-vllm-*"))


def test_a_dead_workers_region_is_reaped() -> None:
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    before = _region_files()
    proc = ctx.Process(target=_worker, args=(f"test-{uuid.uuid4()}", ready), daemon=True)
    proc.start()
    try:
        assert ready.get(timeout=120) == "attached"
        (path,) = _region_files() - before  # kept for a scheduler that never comes
        assert str(path) not in reap_shared_regions()  # a live worker holds it
        assert path.exists()
    finally:
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    assert str(path) in reap_shared_regions()
    assert not path.exists()
