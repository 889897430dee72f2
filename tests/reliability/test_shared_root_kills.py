"""Instances sharing one file-tier root, in real processes, SIGKILLed mid-write and mid-read.

Each instance is a process (``shared_root_child.py``) with its own FileTier
on one root (``instances`` = the number of processes, so each partition has
a fair share of about 30 slots of 8 KiB). Writers store fresh keys at full
speed, so nearly every store evicts, while readers load whatever the other
partitions publish (and keys guessed from the writers' scheme), racing those
evictions, and check every byte. At seeded random moments writer 0 is
SIGKILLed mid-write, then one reader mid-read. Then:

* every reader, killed or not, saw 0 wrong bytes (a block rewritten under a
  read is a miss, never bytes of another block or a torn one);
* the readers still alive kept loading the dead writer's blocks after it died;
* the root's disk usage (``st_blocks`` of everything under it), sampled all
  along, never exceeded ``bytes_to_use``;
* a new FileTier opened in this process (no manual step) adopts the dead
  writer's partition (partition 0: the first whose lock is free) while the
  others still run, and loads every block the dead writer's journal says it
  completed and did not evict, byte for byte, but for at most the blocks its
  store in flight evicted (one batch); any other key of the dead writer it
  serves (an attempted store that reached the disk) is byte for byte right;
* torn slots are never served: a SIGKILL lets the kernel finish the write in
  flight (no torn slot was ever seen after one here), so right after the kill
  the test tears two of the dead writer's completed slots by hand, under the
  running readers, as a write cut short would leave them (half a header; a
  whole header with half the payload another block's): the readers count
  misses, the adopting tier zeroes the first at open and quarantines the
  second at its first load, and neither is ever served;
* a writer that survived and closed cleanly: every block it held at the end
  loads byte for byte from the new tier (read from its closed partition);
* the survivors close cleanly (exit status 0).

And two processes opening one fresh root (not even created) at the same
moment both succeed, in two partitions.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from support.processes import Children

from kvtier.errors import BlockNotFoundError, IntegrityError, KVTierError
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file import FileTier
from kvtier.tiers.file._description import partition_dir_name
from kvtier.tiers.file._index import INDEX_FILE, IndexReader
from kvtier.tiers.file._root import DATA_FILE
from kvtier.tiers.file._sizing import disk_usage

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import shared_root_child as child  # noqa: E402

CHILD = str(HERE / "shared_root_child.py")
NS = child.layout().namespace.hex()
SEED = 35035
WAIT_S = 20.0
"""Bound on every wait for a child (a loaded two-core machine starts slowly)."""


class Sampler:
    """Samples the root's disk usage (``st_blocks``) on a thread until stopped."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, disk_usage(self.root))
            self.samples += 1
            self._stop.wait(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Instance:
    role: str
    number: int
    out: Path
    proc: subprocess.Popen[str]
    partition: str = ""
    slots: int = 0
    closed: dict[str, Any] = field(default_factory=dict)


def spawn(kids: Children, role: str, number: int, root: Path, instances: int) -> Instance:
    out = root.parent / f"{role}{number}.txt"
    args = {
        "role": role,
        "root": str(root),
        "instances": instances,
        "id": number,
        "out": str(out),
        "seed": SEED + number,
    }
    proc = kids.spawn(CHILD, json.dumps(args))
    return Instance(role, number, out, proc)


def expect(inst: Instance, event: str) -> dict[str, Any]:
    line = Children.line(inst.proc)
    assert line.get("event") == event, (inst.role, inst.number, line)
    return line


def journal(inst: Instance) -> dict[str, list[bytes]]:
    """A writer's journal lines by kind (``A``, ``S``, ``E``, ``X``, ``F``), in order."""
    kinds: dict[str, list[bytes]] = {k: [] for k in "ASEXF"}
    text = inst.out.read_text() if inst.out.exists() else ""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in kinds and len(parts[1]) == 32:
            kinds[parts[0]].append(bytes.fromhex(parts[1]))  # a torn last line is skipped
    return kinds


def reports(inst: Instance) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A reader's last counters and every wrong-bytes line it wrote."""
    last: dict[str, Any] = {}
    wrong = []
    text = inst.out.read_text() if inst.out.exists() else ""
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue  # the line a SIGKILL cut
        if "wrong" in item and "loads" not in item:
            wrong.append(item)
        else:
            last = item
    return last, wrong


def until(check: Callable[[], bool], what: str, group: Sequence[Instance]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            state = {
                f"{i.role}{i.number}": (
                    i.proc.poll(),
                    reports(i)[0]
                    if i.role == "reader"
                    else {k: len(v) for k, v in journal(i).items()},
                )
                for i in group
            }
            raise AssertionError(f"not reached in {WAIT_S} s: {what}; {state}")
        time.sleep(0.01)


def hits_on(inst: Instance, writer: int) -> int:
    return int(reports(inst)[0].get("by_writer", {}).get(str(writer), 0))


def kill(inst: Instance) -> None:
    inst.proc.send_signal(signal.SIGKILL)
    assert inst.proc.wait(timeout=WAIT_S) == -signal.SIGKILL, "it ended before the kill"


def tear(partition: Path, keys: set[bytes]) -> tuple[bytes, bytes]:
    """Tear two of ``keys``' slots in ``partition`` as a write cut short would.

    The first keeps its header, but the second half of its payload is another
    block's (cut between pages); the second's header is half overwritten (cut
    inside the header page). Returns their keys.
    """
    index = IndexReader(partition / INDEX_FILE)
    try:
        held = [(s, k) for s, k in sorted(index.changes()) if k in keys]
    finally:
        index.close()
    (payload_slot, payload_key), (header_slot, header_key) = held[0], held[-1]
    half = child.BLOCK // 2
    page = child.Rows(1)
    page.array[0] = child.payload(child.key(99, 0))
    slot_bytes = HEADER_BYTES + child.BLOCK
    fd = os.open(partition / DATA_FILE, os.O_WRONLY | os.O_DIRECT)
    try:
        at = payload_slot * slot_bytes + HEADER_BYTES + half
        assert os.pwrite(fd, page.views[0][:half], at) == half
        assert os.pwrite(fd, page.views[0][:512], header_slot * slot_bytes) == 512
    finally:
        os.close(fd)
    return payload_key, header_key


async def load_checked(
    tier: FileTier, keys: Sequence[bytes]
) -> tuple[list[bytes], int, dict[bytes, KVTierError]]:
    """Load ``keys`` with ``tier``: the keys loaded, the wrong bytes among them, the misses."""
    rows = child.Rows(child.READ_BATCH)
    loaded: list[bytes] = []
    missing: dict[bytes, KVTierError] = {}
    wrong = 0
    for at in range(0, len(keys), child.READ_BATCH):
        batch = list(keys[at : at + child.READ_BATCH])
        rows.array[: len(batch)] = 0x5A
        result = await tier.load(batch, rows.views[: len(batch)])
        for k in result.loaded:
            wrong += child.wrong_bytes(k, rows.array[batch.index(k)])
        loaded += result.loaded
        missing.update(result.missing)
    return loaded, wrong, missing


def all_found(tier: FileTier, keys: Sequence[bytes]) -> bool:
    return tier.lookup(keys) == len(keys)


async def wait_for(check: Callable[[], bool], what: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {seconds} s: {what}")
        await asyncio.sleep(0.005)


@pytest.mark.parametrize(("writers", "readers"), [(1, 1), (2, 2)], ids=["2procs", "4procs"])
def test_kills_mid_write_and_mid_read(
    writers: int, readers: int, tmp_path: Path, report: dict[str, object]
) -> None:
    rng = random.Random(SEED * 10 + writers)
    root = tmp_path / "root"
    instances = writers + readers
    budget = child.budget(instances)
    kids = Children()
    sampler: Sampler | None = None
    try:
        group = [spawn(kids, "writer", n, root, instances) for n in range(writers)]
        group += [spawn(kids, "reader", n, root, instances) for n in range(readers)]
        for inst in group:
            expect(inst, "started")
        # They imported at once; they open one after the other, so partition n is
        # the n-th: writer 0 (the victim) holds partition 0.
        for n, inst in enumerate(group):
            Children.tell(inst.proc, "open")
            ready = expect(inst, "ready")
            inst.partition, inst.slots = ready["partition"], ready["slots"]
            assert inst.partition == partition_dir_name(NS, n)
            assert ready["slots"] >= child.SLOTS - 4
            if n == 0:
                sampler = Sampler(root)
        slots = group[0].slots
        ws, rs = group[:writers], group[writers:]
        # Running: every writer evicting, every reader hitting every writer's blocks.
        until(
            lambda: all(len(journal(w)["E"]) >= 2 * slots for w in ws),
            "every writer evicting",
            group,
        )
        until(
            lambda: all(hits_on(r, w.number) > 0 for r in rs for w in ws),
            "every reader loading every writer's blocks",
            group,
        )
        victim, survivors = ws[0], ws[1:]
        reader_victim = rs[rng.randrange(readers)]
        time.sleep(rng.uniform(0.0, 0.5))
        kill(victim)  # mid-write: it stores back to back
        # A SIGKILL lets the kernel finish the write in flight (no torn slot
        # seen here): tear one of its completed blocks by hand, under the readers.
        dead = journal(victim)
        torn = tear(root / victim.partition, set(dead["S"]) - set(dead["E"]))
        time.sleep(0.1)  # the readers, still running, read the torn slots too
        # The others keep serving, and reading the dead writer's completed blocks.
        after = {r.number: hits_on(r, victim.number) for r in rs}
        until(
            lambda: all(hits_on(r, victim.number) > after[r.number] + 10 for r in rs),
            "the readers loading the dead writer's blocks",
            group,
        )
        written = {w.number: len(journal(w)["S"]) for w in survivors}
        until(
            lambda: all(len(journal(w)["S"]) > written[w.number] for w in survivors),
            "the other writers storing",
            group,
        )
        time.sleep(rng.uniform(0.0, 0.3))
        kill(reader_victim)  # mid-read: it loads back to back
        alive = [r for r in rs if r is not reader_victim]
        figures = asyncio.run(
            after_the_kills(root, instances, victim, torn, survivors, alive, budget)
        )
        assert sampler is not None
        sampler.stop()
        assert sampler.peak <= budget, f"the root used {sampler.peak} > {budget} bytes"
        for r in rs:
            last, wrong = reports(r)
            assert not wrong, f"reader {r.number} loaded wrong bytes: {wrong[:3]}"
            assert last["wrong"] == 0, last
            assert last["hits"] > 0, last
            assert last["errors"] == 0, last["error_kinds"]
        assert all(i.proc.wait(timeout=WAIT_S) == 0 for i in [*survivors, *alive])
        counts = [reports(r)[0] for r in rs]
        report.update(
            {
                "processes": instances,
                "budget_bytes": budget,
                "peak_disk_bytes": sampler.peak,
                "disk_samples": sampler.samples,
                "reader_hits": sum(x["hits"] for x in counts),
                "reader_misses": sum(x["misses"] for x in counts),
                "reader_stale": sum(x["peer_stale"] for x in counts),
                "wrong_bytes": sum(x["wrong"] for x in counts),
                "writer_stores": {w.number: len(journal(w)["S"]) for w in ws},
                **figures,
            }
        )
        # The reliability table's columns (benchmarks/reliability_report.py):
        # two processes SIGKILLed (a writer, a reader), every block loaded and
        # checked byte for byte, and the wrong bytes among them (0: no wrong block).
        report.update(
            crash_cycles=2,
            blocks_verified=int(report["reader_hits"])  # type: ignore[call-overload]
            + int(report.get("dead_writer_loaded", 0))  # type: ignore[call-overload]
            + int(report.get("survivor_final_blocks_loaded", 0)),  # type: ignore[call-overload]
            wrong_blocks_served=report["wrong_bytes"],
        )
    finally:
        if sampler is not None:
            sampler.stop()
        kids.kill_all()


async def after_the_kills(
    root: Path,
    instances: int,
    victim: Instance,
    torn: tuple[bytes, bytes],
    survivors: list[Instance],
    alive: list[Instance],
    budget: int,
) -> dict[str, object]:
    # A new instance, here: it adopts the dead writer's partition, no manual step.
    tier = await FileTier.open(
        child.config(root, instances), child.layout(), block_bytes=child.BLOCK
    )
    try:
        stats = tier.statistics()
        assert stats.partition == victim.partition == NS
        dead = journal(victim)
        completed = set(dead["S"]) - set(dead["E"]) - set(torn)
        assert len(completed) > 0
        loaded, wrong, missing = await load_checked(tier, sorted(completed))
        assert wrong == 0
        assert all(isinstance(e, BlockNotFoundError) for e in missing.values()), missing
        # Its store in flight may have evicted (and torn) up to one batch: no more lost.
        lost = len(completed) - len(loaded)
        assert lost <= child.BATCH, f"{lost} completed blocks of the dead writer lost"
        assert stats.blocks == stats.recovered_blocks >= len(loaded)
        # Whatever else of its keys is served (an attempted store that reached the
        # disk, or an evicted block whose slot's rewrite never started) is right.
        others = [
            k
            for k in dict.fromkeys(dead["A"])
            if k not in completed and k not in torn and tier.is_ready(k)
        ]
        extra, wrong, _ = await load_checked(tier, others)
        assert wrong == 0
        # Torn slots are never served. A torn header is zeroed at open; a torn
        # payload (its header whole) fails its first load's checksum, quarantined.
        cut_payload, cut_header = torn
        assert stats.torn_slots >= 1
        assert not tier.is_ready(cut_header)
        assert tier.is_ready(cut_payload)
        got, _, missing = await load_checked(tier, list(torn))
        assert not got
        assert isinstance(missing[cut_payload], IntegrityError), missing
        assert not tier.is_ready(cut_payload)
        assert tier.statistics().quarantined == 1
        # The survivors: the new tier sees the surviving writers' blocks...
        if survivors:
            await wait_for(lambda: tier.statistics().peer_blocks > 0, "the survivors' blocks")
        # ...who then close cleanly.
        for inst in [*survivors, *alive]:
            Children.tell(inst.proc, "stop")
        for inst in [*survivors, *alive]:
            inst.closed = await asyncio.to_thread(expect, inst, "closed")
        held = 0
        for w in survivors:
            assert w.closed["lost"] == 0, w.closed
            assert w.closed["failures"] == 0, w.closed
            final = journal(w)["F"]
            assert len(final) == w.closed["final"] > 0
            held += len(final)
            # Every block a cleanly closed writer held loads, byte for byte.
            await wait_for(partial(all_found, tier, final), "the survivor's blocks")
            got, wrong, _ = await load_checked(tier, final)
            assert wrong == 0
            assert sorted(got) == sorted(final)
        assert disk_usage(root) <= budget
        return {
            "dead_writer_completed": len(completed),
            "dead_writer_loaded": len(loaded),
            "dead_writer_other_keys_served": len(extra),
            "adopted_recovered_blocks": stats.recovered_blocks,
            "adopted_torn_slots": stats.torn_slots,
            "survivor_final_blocks_loaded": held,
        }
    finally:
        await tier.aclose()


def test_two_instances_opening_a_fresh_root_at_once(tmp_path: Path) -> None:
    for round_ in range(3):
        root = tmp_path / f"root{round_}"  # not even created: both create it
        kids = Children()
        try:
            pair = [spawn(kids, "open", n, root, 2) for n in range(2)]
            for inst in pair:
                expect(inst, "started")
            at = time.monotonic() + 0.3
            for inst in pair:
                Children.tell(inst.proc, f"open {at}")
            parts = [expect(inst, "ready")["partition"] for inst in pair]
            assert sorted(parts) == [NS, f"{NS}.1"]
            for inst in pair:
                Children.tell(inst.proc, "stop")
            for inst in pair:
                expect(inst, "closed")
                assert inst.proc.wait(timeout=WAIT_S) == 0
            assert disk_usage(root) <= child.budget(2)
        finally:
            kids.kill_all()
