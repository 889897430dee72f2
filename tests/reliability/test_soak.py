"""Soak: a serving-loop workload with random cancellations, watched for leaks.

Marked ``slow``: run it with ``make soak`` (``KVTIER_SOAK_SECONDS``, default
120). Every round serves a batch of requests with cancellations, then samples
RSS, open file descriptors, pinned and being-written blocks, and the /dev/shm
files this process maps or holds. After a warm-up quarter, they must stay flat.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from workload import open_engine, serve

SECONDS = float(os.environ.get("KVTIER_SOAK_SECONDS", "120"))


def rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shm_mapped_bytes() -> int:
    """Bytes of /dev/shm files this process maps or holds open.

    Not the filesystem's usage: other processes on the machine (other test
    runs) create and remove their own files there meanwhile.
    """
    total = 0
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                total += hi - lo
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/dev/shm/"):
                total += os.stat(f"/proc/self/fd/{fd}").st_size
        except OSError:
            continue  # closed meanwhile
    return total


@pytest.mark.slow
@pytest.mark.timeout(SECONDS + 300)
async def test_soak_keeps_memory_fds_pins_and_shm_flat(
    tmp_path: Path, report: dict[str, object]
) -> None:
    samples: list[tuple[int, int, int]] = []
    rounds = requests = wrong = cancelled = 0
    started = time.monotonic()
    async with open_engine(tmp_path / "tier", cpu_rows=32, file_rows=400) as (engine, kv):
        while time.monotonic() - started < SECONDS:
            tally = await serve(engine, kv, requests=150, seed=rounds, cancel_rate=0.1)
            await engine.flush()
            assert tally.untyped == [], tally.untyped[:3]
            wrong += tally.wrong_blocks
            cancelled += tally.cancelled
            requests += 150
            rounds += 1
            st = engine.statistics()
            assert st.tiers["cpu"].statistics.pinned == 0
            assert st.tiers["cpu"].statistics.being_written == 0
            assert st.front.in_flight == 0
            shm = shm_mapped_bytes()
            samples.append((rss_bytes(), open_fds(), shm))
            await asyncio.sleep(0)
    assert wrong == 0
    assert rounds >= 8, "the soak ran too few rounds to judge a trend"
    warm = samples[len(samples) // 4 :]
    half = len(warm) // 2
    first, last = warm[:half], warm[half:]
    rss_growth = statistics.median(s[0] for s in last) / statistics.median(s[0] for s in first)
    assert rss_growth < 1.10, f"RSS grew {rss_growth:.2f}x"
    assert max(s[1] for s in warm) - min(s[1] for s in warm) <= 2, "file descriptors leak"
    assert max(s[2] for s in warm) - min(s[2] for s in warm) <= 1 << 20, "/dev/shm grows"
    report.update(
        seconds=round(time.monotonic() - started),
        rounds=rounds,
        requests=requests,
        cancelled=cancelled,
        wrong_blocks_served=wrong,
        rss_growth=round(rss_growth, 3),
        fds=[min(s[1] for s in warm), max(s[1] for s in warm)],
    )
