"""A split instance (one scheduler process, two worker processes) killed at random.

Each seeded cycle starts a scheduler process (``tests/workers/_scheduler.py``)
with a write-through file tier on one root kept across cycles, and two worker
processes whose KV bytes differ by rank; once every rank attached, the
scheduler stores and loads chains, and at a random moment either the
scheduler or one worker is SIGKILLed:

* scheduler killed: every worker notices (a pidfd) and exits, reporting
  ``scheduler_gone``, within a bounded time;
* worker killed: the scheduler's job fails with a typed error, it closes, the
  other worker is stopped cleanly.

Either way no ``/dev/shm`` file of the instance remains, and the next instance
(this test's process as the scheduler, two fresh workers on threads of it,
:class:`~kvtier.workers.WorkerThread`, each attaching the shared region with
its rank) opens the same root and loads every chain it finds: each rank checks
that the bytes it got are the ones it stored (0 wrong), and every chain whose
store was flushed is there (0 lost).

What a cycle costs is starting processes: importing torch takes 1.7 s of CPU
a process here (2 cores). So the killed instance's three processes start at
once (the test picks its socket directory, so it knows the address before the
scheduler binds it), the scheduler, which holds no tensor, does not import
torch, and the next instance's workers, which only check bytes, are threads
of this process (19 s for two cycles before, about 9 s now).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from support.processes import Children

from kvtier.engine import Engine
from kvtier.workers import WorkerGroup, WorkerThread

HERE = Path(__file__).parents[1] / "workers"
sys.path.insert(0, str(HERE))
from _scheduler import CHAINS, chain, config  # noqa: E402
from _worker import layout_of, make_kv, rank_layout  # noqa: E402

SCHEDULER = str(HERE / "_scheduler.py")
WORKER = str(HERE / "_worker.py")
WORLD = 2
SEED = 16016
EXIT_BOUND = 10.0
"""Seconds within which the survivors of a kill must have exited."""


def shm_files(instance: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if instance in n]


def flushed(journal: Path) -> tuple[set[int], bool, bool]:
    """Chains whose store was flushed; whether the scheduler got ready; saw a worker die."""
    lines = journal.read_text().splitlines() if journal.exists() else []
    chains = {int(x.split()[1]) for x in lines if x.startswith("S ") and len(x.split()) == 2}
    return chains, "R" in lines, any(x.startswith("X ") for x in lines)


@contextmanager
def socket_dir() -> Iterator[str]:
    """A private directory for an instance's job socket (short: ipc paths are limited)."""
    path = tempfile.mkdtemp(prefix="kvtier-kill-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def address(directory: str) -> str:
    return f"ipc://{directory}/jobs"


def kill_one(
    kids: Children,
    root: Path,
    journal: Path,
    seed: int,
    victim: str,
    delay: float,
    directory: str,
) -> float:
    """Run one instance, SIGKILL ``victim``; returns how long the survivors took to exit."""
    sched = kids.spawn(SCHEDULER, root, WORLD, seed, journal, directory)
    workers = [kids.spawn(WORKER, address(directory), r, WORLD, "serve") for r in range(WORLD)]
    info = Children.line(sched)
    assert info["address"] == address(directory)
    assert [Children.line(w)["attached"] for w in workers] == [True] * WORLD
    deadline = time.monotonic() + 60
    while not flushed(journal)[1]:
        assert sched.poll() is None, sched.stderr.read() if sched.stderr else ""
        assert time.monotonic() < deadline, "the scheduler never got ready"
        time.sleep(0.01)
    time.sleep(delay)
    if victim == "scheduler":
        sched.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        endings = [Children.line(w)["ending"] for w in workers]
        assert endings == ["scheduler_gone"] * WORLD
        assert [w.wait(timeout=EXIT_BOUND) for w in workers] == [0] * WORLD
    else:
        workers[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        assert sched.wait(timeout=EXIT_BOUND) == 0, sched.stderr.read() if sched.stderr else ""
        assert flushed(journal)[2], "the scheduler never saw the worker die"
        assert Children.line(workers[0])["ending"] == "stopped"
        assert workers[0].wait(timeout=EXIT_BOUND) == 0
    took = time.monotonic() - t0
    assert took < EXIT_BOUND
    assert shm_files(info["instance"]) == [], "a /dev/shm file outlived the instance"
    return took


async def reopen_and_check(root: Path, stored: set[int]) -> tuple[int, int, int]:
    """The next instance: every chain found loads each rank's own bytes; returns counts."""
    group = WorkerGroup.bind(WORLD)
    opening = asyncio.ensure_future(
        Engine.open(config(root, WORLD), rank_layout(0, WORLD), workers=group, worker_timeout=60)
    )
    kvs = [make_kv(r) for r in range(WORLD)]
    workers = [
        await asyncio.to_thread(
            WorkerThread.start, group.address, layout_of(kv, r, WORLD), kv, timeout=60
        )
        for r, kv in enumerate(kvs)
    ]
    engine = await opening
    verified = wrong = lost = 0
    try:
        for t in range(CHAINS):
            keys = chain(engine, t)
            hits = engine.lookup(keys)
            lost += t in stored and hits < len(keys)
            if not hits:
                continue
            n = await engine.load(keys[:hits], list(range(8, 8 + hits)))
            src = t % 5  # chain t was stored from blocks t % 5 ..
            wrong += sum(
                n - sum(torch.equal(kv[0][:, 8 + i], kv[0][:, src + i]) for i in range(n))
                for kv in kvs
            )
            verified += n * WORLD
    finally:
        await engine.aclose()
    assert [await asyncio.to_thread(w.join, 10) for w in workers] == ["stopped"] * WORLD
    assert shm_files(group.instance.hex()) == []
    return verified, wrong, lost


def run_cycles(tmp_path: Path, cycles: int, report: dict[str, object]) -> None:
    rng = random.Random(SEED)
    root, journal = tmp_path / "root", tmp_path / "journal"
    victims = ["scheduler", "worker"] * (cycles // 2) + ["scheduler"] * (cycles % 2)
    rng.shuffle(victims)
    exits: list[float] = []
    verified = wrong = lost = 0
    for cycle, victim in enumerate(victims):
        kids = Children()
        try:
            with socket_dir() as directory:
                delay = rng.uniform(0.0, 0.5)
                exits.append(kill_one(kids, root, journal, SEED + cycle, victim, delay, directory))
            stored = flushed(journal)[0]
            v, w, lo = asyncio.run(reopen_and_check(root, stored))
        finally:
            kids.kill_all()
        verified, wrong, lost = verified + v, wrong + w, lost + lo
    assert verified > 0
    assert wrong == 0
    assert lost == 0
    report.update(
        crash_cycles=cycles,
        schedulers_killed=victims.count("scheduler"),
        workers_killed=victims.count("worker"),
        chains_flushed=len(flushed(journal)[0]),
        blocks_verified=verified,
        blocks_lost=lost,
        wrong_blocks_served=wrong,
        slowest_exit_after_a_kill_s=round(max(exits), 3),
        shm_files_left=0,
    )


def test_scheduler_and_worker_kills_serve_no_wrong_byte(
    tmp_path: Path, report: dict[str, object]
) -> None:
    run_cycles(tmp_path, 2, report)


@pytest.mark.slow
def test_scheduler_and_worker_kills_soak(tmp_path: Path, report: dict[str, object]) -> None:
    run_cycles(tmp_path, 10, report)
