"""Workers of a shared CPU region killed at random: nothing is left in /dev/shm.

Each seeded cycle starts three workers on one region name and SIGKILLs them in
random order at random moments, sometimes before all have attached. Once all
are gone: if all had attached, no file may remain; if not, the next workers
with that name must get a fresh region (and leave nothing when they finish).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

WORKER = Path(__file__).parents[1] / "region" / "_worker.py"
WORLD = 3
CYCLES = 10


def leftovers(name: str) -> list[Path]:
    return sorted(Path("/dev/shm").glob(f"kvtier-{name}*"))


def spawn(name: str, rank: int, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), name, str(WORLD), str(rank), str(1 << 20), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_random_kills_leave_no_shared_memory(report: dict[str, object]) -> None:
    rng = random.Random(4242)
    killed_before_attach = killed_after_attach = recreated = 0
    for _ in range(CYCLES):
        name = f"rel-{uuid.uuid4().hex[:12]}"
        procs = [spawn(name, r, "hold") for r in range(WORLD)]
        lines = [""] * WORLD  # what was read of each worker's output before the kill
        try:
            if rng.random() < 0.5:
                # Kill once all have attached (each prints its report then), at
                # a random moment after: on a loaded machine a fixed delay
                # could end every cycle before the attach and test only half.
                lines = [p.stdout.readline() if p.stdout else "" for p in procs]
                assert all(line.startswith("{") for line in lines), lines
                time.sleep(rng.uniform(0.0, 0.3))
            else:
                time.sleep(rng.choice([0.0, rng.uniform(0.0, 0.3)]))
            order = list(range(WORLD))
            rng.shuffle(order)
            for r in order:
                procs[r].send_signal(signal.SIGKILL)
                time.sleep(rng.uniform(0, 0.05))
        finally:
            for p in procs:
                p.kill()
                p.wait(timeout=30)
        attached = 0
        for p, first in zip(procs, lines, strict=True):
            out = first + (p.stdout.read() if p.stdout else "")
            attached += any(
                line.startswith("{") and "error" not in line for line in out.splitlines()
            )
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()
        if attached == WORLD:
            killed_after_attach += 1
            assert leftovers(name) == [], "a file survived although every worker had attached"
            continue
        killed_before_attach += 1
        # Whatever was left, the next workers of that name must get a working region.
        fresh = [spawn(name, r, "exchange") for r in range(WORLD)]
        for p in fresh:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            result = json.loads(out.splitlines()[-1])
            assert result.get("saw_all") is True, result
        recreated += 1
        assert leftovers(name) == []
    assert killed_after_attach > 0
    assert killed_before_attach > 0
    report.update(
        shm_cycles=CYCLES,
        killed_after_all_attached=killed_after_attach,
        killed_before_all_attached=killed_before_attach,
        regions_recreated_after_a_crash=recreated,
        shm_files_left=0,
    )
