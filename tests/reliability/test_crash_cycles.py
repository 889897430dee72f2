"""Crash consistency: a writer killed with SIGKILL at random moments, 24 times.

After every kill a new file tier opens the same root and must show: no
temporary left behind, no torn block (no torn slot, nothing quarantined, every
block it serves has the bytes stored for its key), every block whose store
completed still there (less at most the victims of the one store that was in
flight), and usage accounting equal to the blocks in the slot file.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from support.slots import block_offsets

from kvtier.config import FileTierConfig
from kvtier.tiers.file import FileTier

sys.path.insert(0, str(Path(__file__).parent))
from crash_child import BLOCK, BUDGET, layout, payload

CYCLES = 24
SEED = 20261122
CHILD = Path(__file__).parent / "crash_child.py"


@dataclass
class Journal:
    attempted: set[bytes] = field(default_factory=set)
    stored: set[bytes] = field(default_factory=set)
    in_flight: set[bytes] = field(default_factory=set)
    """Keys of the last store that had not reported when the child died."""


def read_journal(path: Path, journal: Journal) -> Journal:
    journal.in_flight = set()
    data = path.read_bytes() if path.exists() else b""  # killed before it opened the journal
    for line in data.split(b"\n"):
        kind, _, rest = line.partition(b" ")
        if len(rest) != 32:
            continue  # "R ready", or a line cut by the kill
        key = bytes.fromhex(rest.decode())
        if kind == b"A":
            journal.attempted.add(key)
            journal.in_flight.add(key)
        elif kind == b"S":
            journal.stored.add(key)
            journal.in_flight.discard(key)
        elif kind == b"E":
            journal.stored.discard(key)
    path.write_bytes(b"")
    return journal


def run_child_until_killed(root: Path, journal: Path, seed: int, rng: random.Random) -> float:
    """Start the writer, let it store for a random while, SIGKILL it; returns the delay."""
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(root), str(journal), str(seed)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        # Some cycles kill it while it is still opening (recovering) the tier.
        delay = rng.choice([0.0, rng.uniform(0.02, 0.6)])
        while delay and not (journal.exists() and journal.read_bytes().startswith(b"R ready")):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the writer never became ready"
            time.sleep(0.01)
        time.sleep(delay)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    return delay


async def check_root(root: Path, journal: Journal) -> tuple[int, int]:
    """Open the root after a crash and check everything; returns (blocks served, lost)."""
    tier = await FileTier.open(
        FileTierConfig(root=root, bytes_to_use=BUDGET), layout(), block_bytes=BLOCK
    )
    try:
        stats = tier.statistics()
        ns_dir = tier.path
        assert list((ns_dir / "tmp").iterdir()) == [], "a temporary survived the reopen"
        assert stats.torn_slots == 0, "a torn block was found"
        assert stats.quarantined == 0, "a foreign block was found"
        on_disk = block_offsets(ns_dir)
        assert stats.blocks == stats.recovered_blocks == len(on_disk)
        assert stats.used_bytes == len(on_disk) * stats.file_bytes
        assert (ns_dir / "blocks.dat").stat().st_size == stats.capacity_bytes
        assert set(on_disk) <= journal.attempted
        missing = {k for k in journal.stored if not tier.is_ready(k)}
        # The store in flight may have evicted up to its own size before it
        # could report the victims; nothing else may be missing.
        assert len(missing) <= len(journal.in_flight), (len(missing), len(journal.in_flight))
        journal.stored -= missing
        present = sorted(k for k in journal.attempted if tier.is_ready(k))
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        bufs = [mmap.mmap(-1, BLOCK, flags=flags) for _ in range(16)]
        served = 0
        for i in range(0, len(present), len(bufs)):
            keys = present[i : i + len(bufs)]
            result = await tier.load(keys, [memoryview(b) for b in bufs[: len(keys)]])
            assert not result.missing, result.missing
            for key, buf in zip(keys, bufs, strict=False):
                assert buf[:] == payload(key), f"block {key.hex()} has wrong bytes"
            served += len(keys)
        for b in bufs:
            b.close()
        journal.stored |= {k for k in present if k in journal.in_flight}
        return served, len(missing)
    finally:
        await tier.aclose()


def test_sigkilled_writer_never_leaves_a_torn_or_lost_block(
    tmp_path: Path, report: dict[str, object]
) -> None:
    rng = random.Random(SEED)
    root, log = tmp_path / "root", tmp_path / "journal"
    journal = Journal()
    served_total = evicted_in_flight = killed_mid_store = 0
    for cycle in range(CYCLES):
        run_child_until_killed(root, log, SEED + cycle, rng)
        read_journal(log, journal)
        killed_mid_store += bool(journal.in_flight)
        served, lost = asyncio.run(check_root(root, journal))
        served_total += served
        evicted_in_flight += lost
    assert len(journal.attempted) > CYCLES  # the writer really wrote
    assert served_total > 0
    report.update(
        crash_cycles=CYCLES,
        killed_with_a_store_in_flight=killed_mid_store,
        blocks_attempted=len(journal.attempted),
        blocks_verified=served_total,
        evicted_by_the_store_in_flight=evicted_in_flight,
        blocks_lost=0,
        wrong_blocks_served=0,
    )
