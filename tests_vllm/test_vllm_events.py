"""kvtier's KV cache events as vLLM publishes them (ZMQ), for KV-aware routers.

One vLLM instance (its own processes) with KV cache events on and tiers small
enough to evict: a subscriber receives vLLM's ``KVEventBatch`` messages and the
test checks what a router would build from them against the tiers' own state.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

from kvtier.tiers.file import FileTier
from tests_vllm._harness import BLOCK_SIZE, generate, instance, prompts, read_statistics

ROW_BYTES = 512 * 1024  # a row of the tiny Llama (see test_vllm_offloading)
# vLLM stores a request's 8 blocks at once (all or nothing): room for one
# request, not three.
CPU_ROWS = 10
FILE_SLOTS = 12


class Subscriber:
    """Collects vLLM's KV event batches from its ZMQ publisher on a thread."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)  # before vLLM binds: zmq connects when it does
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = self._zmq.Poller()
        poller.register(self._sock, self._zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                _topic, _seq, payload = self._sock.recv_multipart()
                self.events.extend(self._decoder.decode(payload).events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close(0)
        self._ctx.term()


def _replay(events: list[Any], medium: str) -> tuple[Counter[Any], int, int]:
    """A router's view of one medium: hashes held, stores and removals seen.

    Raises AssertionError when a hash is removed that was not stored before.
    """
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    held: Counter[Any] = Counter()
    stored = removed = 0
    for ev in events:
        if getattr(ev, "medium", None) != medium:
            continue
        if isinstance(ev, BlockStored):
            held.update(ev.block_hashes)
            stored += len(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                assert held[h] > 0, f"{medium}: {h!r} removed before it was stored"
                held[h] -= 1
            removed += len(ev.block_hashes)
    return +held, stored, removed


def test_events_follow_both_tiers(model_dir: Path, tmp_path: Path) -> None:
    from vllm.config import KVEventsConfig

    endpoint = f"ipc://{tmp_path}/kv-events"
    stats = tmp_path / "stats.json"
    extra = {
        "cpu_bytes_to_use": CPU_ROWS * ROW_BYTES,
        "file_tier": {
            "root": str(tmp_path / "tier"),
            "bytes_to_use": FileTier.budget_for(FILE_SLOTS, ROW_BYTES),
        },
        "statistics_file": str(stats),
        # vLLM then sends each block's tokens: the keys kvtier hands back must
        # map to the blocks vLLM stored.
        "self_describing_kv_events": True,
    }
    a, b = prompts(seed=3)
    _, c = prompts(seed=4)
    sub = Subscriber(endpoint)
    try:
        events_config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint
        )
        with instance(model_dir, extra, kv_events_config=events_config) as llm:
            for p in (a, b, c):
                generate(llm, p)
            generate(llm, a[: BLOCK_SIZE // 2])  # one more step: takes the last events
    finally:
        sub.close()
    st = read_statistics(stats)
    assert st["front"]["events_dropped"] == 0
    assert st["tiers"]["cpu"]["statistics"]["capacity"] == CPU_ROWS

    cpu, cpu_stored, cpu_removed = _replay(sub.events, "CPU")
    disk, disk_stored, disk_removed = _replay(sub.events, "STORAGE")
    blocks = {tuple(p[i : i + BLOCK_SIZE]) for p in (a, b, c) for i in range(0, 1024, BLOCK_SIZE)}
    from vllm.distributed.kv_events import BlockStored

    announced = [ev for ev in sub.events if isinstance(ev, BlockStored) and ev.medium == "CPU"]
    assert announced, f"{len(sub.events)} events received, statistics {st}"
    # Each announced block is one of the prompts' blocks, with its 128 tokens.
    assert all(tuple(ev.token_ids) in blocks for ev in announced)
    assert all(ev.block_size == BLOCK_SIZE for ev in announced)
    # 18 distinct blocks (B shares 6 of A's 8) went through 10 rows and 12
    # slots: each announced once, both tiers evicted, and the router's view of
    # each tier is no larger than the tier.
    assert cpu_stored == len(blocks) == 18
    assert cpu_removed > 0
    assert disk_stored > 0
    assert disk_removed > 0
    assert sum(cpu.values()) <= CPU_ROWS
    assert sum(disk.values()) <= FILE_SLOTS
