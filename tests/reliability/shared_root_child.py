"""Child of the shared-root kill tests: one instance (a FileTier) on a root shared with others.

Usage: ``python shared_root_child.py JSON``, the JSON an object with ``role``
(``writer``, ``reader`` or ``open``), ``root``, ``instances``, ``id`` (the
writer's number, written into its keys), ``out`` (a file this child appends
to) and ``seed``.

The child prints one JSON line ``{"event": "started"}`` once imported, then
waits for a line on stdin: ``open`` (open now) or ``open T`` (open at
``time.monotonic() == T``: the clock is the machine's, so two children told
the same ``T`` open at the same moment). Once open it prints
``{"event": "ready", "partition": ...}`` and runs its role until the line
``stop``; then it closes the tier cleanly and prints ``{"event": "closed", ...}``.
A test may SIGKILL it at any moment instead.

* ``writer``: stores batches of :data:`BATCH` fresh keys (:func:`key`, the
  writer's id and a sequence number) at full speed into a partition of a few
  tens of slots, so nearly every store evicts. Every block's bytes are
  :func:`payload` of its key, so any reader can check them. Its journal
  (``out``) gets ``A <key>`` lines before a store (attempted), then ``S <key>``
  for each block stored, ``E <key>`` for each evicted and ``X <key>`` for
  each failed, once the store completed; at ``stop``, ``F <key>`` for each
  block it still holds (its final resident blocks), before closing. Lines are
  ``os.write`` on an ``O_APPEND`` descriptor: a SIGKILL loses at most the
  line being written.
* ``reader``: learns the keys the other partitions hold with ``tier.watch``
  and also probes keys derived from the writers' scheme with
  ``tier.is_ready``; loads batches of them (rows poisoned first) and checks
  every byte of every block reported loaded against :func:`payload`. It
  appends a JSON line of its counters to ``out`` every :data:`REPORT_S` and
  at once a ``{"wrong": ...}`` line for any block with a wrong byte, so a
  killed reader's counts are on disk.
* ``open``: only opens (and closes at ``stop``): the concurrent-open test.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.config import FileTierConfig
from kvtier.errors import BlockNotFoundError
from kvtier.layout import KVLayout, TensorSpec
from kvtier.tiers.file import FileTier

BLOCK = 8192
"""Payload bytes of every block."""
SLOTS = 32
"""Slots each instance's share of the budget is sized for (a few less once
metadata is counted): small, so that every writer evicts all the time."""
BATCH = 4
"""Blocks per store of a writer (one store in flight at a time)."""
READ_BATCH = 8
"""Blocks per load of a reader."""
QUEUE_DEPTH = 8
POLL_S = 0.005
"""peer_poll_s of every child: readers see writes within a few milliseconds."""
REPORT_S = 0.05
"""How often a reader appends its counters to its report file."""
_TAG = b"SR"
_RECORDS = BLOCK // 16
_POSITIONS = np.arange(_RECORDS, dtype="<u4").view(np.uint8).reshape(_RECORDS, 4)


def layout() -> KVLayout:
    """The layout (so the namespace) every child and the test use."""
    spec = TensorSpec(name="kv", shape=(4, 1024), dtype="float16", itemsize=2, kv_first=False)
    return KVLayout(tensors=(spec,), model_id="shared-root-kills", block_tokens=16)


def budget(instances: int) -> int:
    """``bytes_to_use`` of a root shared by ``instances``: :data:`SLOTS` slots each."""
    return instances * FileTier.budget_for(SLOTS, BLOCK)


def config(root: Path, instances: int, poll_s: float = POLL_S) -> FileTierConfig:
    """The tier configuration of every instance on ``root``."""
    return FileTierConfig(
        root=root,
        bytes_to_use=budget(instances),
        instances=instances,
        queue_depth=QUEUE_DEPTH,
        peer_poll_s=poll_s,
    )


def key(writer: int, seq: int) -> bytes:
    """The key of writer ``writer``'s ``seq``-th block (16 bytes)."""
    return _TAG + bytes([writer, 0]) + seq.to_bytes(8, "big") + b"\xa5" * 4


def split_key(k: bytes) -> tuple[int, int] | None:
    """``(writer, seq)`` of a key made by :func:`key`; None for any other."""
    if len(k) != 16 or k[:2] != _TAG:
        return None
    return k[2], int.from_bytes(k[4:12], "big")


def payload(k: bytes) -> npt.NDArray[np.uint8]:
    """The bytes of ``k``'s block: 16-byte records of ``k[:12]`` and the record's number."""
    out = np.empty((_RECORDS, 16), dtype=np.uint8)
    out[:, :12] = np.frombuffer(k[:12], dtype=np.uint8)
    out[:, 12:] = _POSITIONS
    return out.reshape(-1)


def wrong_bytes(k: bytes, got: npt.NDArray[np.uint8]) -> int:
    """How many bytes of ``got`` differ from ``k``'s block."""
    return int(np.count_nonzero(got != payload(k)))


class Rows:
    """Page-aligned rows of :data:`BLOCK` bytes (what a CPU region's rows look like)."""

    def __init__(self, n: int) -> None:
        self.map = mmap.mmap(-1, n * BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self.map, dtype=np.uint8).reshape(n, BLOCK)
        whole = memoryview(self.map)
        self.views = [whole[i * BLOCK : (i + 1) * BLOCK] for i in range(n)]


def say(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


class Commands:
    """Lines of stdin, read on the loop (the roles run while waiting for ``stop``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._buffer = b""
        self._fd = sys.stdin.fileno()
        loop.add_reader(self._fd, self._readable)
        self.stop = asyncio.Event()

    def _readable(self) -> None:
        data = os.read(self._fd, 4096)
        if not data:  # the test went away: stop
            data = b"stop\n"
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            text = line.decode().strip()
            if text == "stop":
                self.stop.set()
            self._queue.put_nowait(text)

    async def next(self) -> str:
        return await self._queue.get()


def append(fd: int, lines: Sequence[bytes]) -> None:
    if lines:
        os.write(fd, b"".join(line + b"\n" for line in lines))


def keyed(tag: bytes, keys: Sequence[bytes]) -> list[bytes]:
    return [tag + b" " + k.hex().encode() for k in keys]


async def write(tier: FileTier, me: int, journal: int, stop: asyncio.Event) -> dict[str, Any]:
    rows = Rows(BATCH)
    held: dict[bytes, None] = {}  # what this writer holds, oldest first
    seq = stores = evictions = failures = 0
    while not stop.is_set():
        keys = [key(me, seq + i) for i in range(BATCH)]
        seq += BATCH
        for i, k in enumerate(keys):
            rows.array[i] = payload(k)
        append(journal, keyed(b"A", keys))
        result = await tier.store(keys, rows.views)
        await asyncio.sleep(0)  # let the tier's polls run, whatever the store did
        append(
            journal,
            keyed(b"S", result.stored)
            + keyed(b"E", result.evicted)
            + keyed(b"X", list(result.failed)),
        )
        for k in result.evicted:
            held.pop(k, None)
        held.update(dict.fromkeys(result.stored))
        stores += len(result.stored)
        evictions += len(result.evicted)
        failures += len(result.failed)
    final = [k for k in held if tier.is_ready(k)]
    append(journal, keyed(b"F", final))
    return {
        "stores": stores,
        "evictions": evictions,
        "failures": failures,
        "final": len(final),
        "lost": len(held) - len(final),
    }


class Reader:
    """The reader role's state: the keys it knows of, and its counters."""

    def __init__(self, tier: FileTier, report: int, seed: int) -> None:
        self.tier = tier
        self.report = report
        self.rng = random.Random(seed)
        self.known: dict[bytes, None] = {}  # what the other partitions hold, oldest first
        self.newest: dict[int, int] = {}  # writer -> highest sequence number seen
        self.loads = self.hits = self.misses = self.errors = self.wrong = 0
        self.wrong_blocks = self.probes = 0
        self.error_kinds: dict[str, int] = {}
        self.by_writer: dict[int, int] = {}
        tier.watch(self.changed)

    def changed(self, added: Sequence[bytes], removed: Sequence[bytes]) -> None:
        for k in removed:
            self.known.pop(k, None)
        for k in added:
            self.known[k] = None
            parts = split_key(k)
            if parts is not None and parts[1] > self.newest.get(parts[0], -1):
                self.newest[parts[0]] = parts[1]

    def pick(self) -> list[bytes]:
        chosen: dict[bytes, None] = {}
        known = list(self.known)
        chosen.update(dict.fromkeys(known[-READ_BATCH // 2 :]))  # newest: likely still there
        if known:
            chosen.update(dict.fromkeys(self.rng.sample(known, min(len(known), READ_BATCH // 2))))
        if self.newest:  # keys of the writers' scheme the watch may not have told yet
            writer = self.rng.choice(list(self.newest))
            top = self.newest[writer]
            for seq in range(max(0, top - 2 * SLOTS), top + 2 * BATCH):
                if len(chosen) >= READ_BATCH:
                    break
                self.probes += 1
                k = key(writer, seq)
                if k not in chosen and self.tier.is_ready(k) and self.rng.random() < 0.25:
                    chosen[k] = None
        return list(chosen)[:READ_BATCH]

    def counters(self) -> dict[str, Any]:
        stats = self.tier.statistics()
        return {
            "t": time.monotonic(),
            "loads": self.loads,
            "hits": self.hits,
            "misses": self.misses,
            "errors": self.errors,
            "error_kinds": self.error_kinds,
            "wrong": self.wrong,
            "wrong_blocks": self.wrong_blocks,
            "probes": self.probes,
            "by_writer": {str(w): n for w, n in self.by_writer.items()},
            "peer_stale": stats.peer_stale,
            "peer_partitions": stats.peer_partitions,
        }

    def flush(self) -> None:
        append(self.report, [json.dumps(self.counters()).encode()])

    async def run(self, stop: asyncio.Event) -> dict[str, Any]:
        rows = Rows(READ_BATCH)
        loop = asyncio.get_running_loop()
        next_report = loop.time()
        while not stop.is_set():
            if loop.time() >= next_report:
                self.flush()
                next_report = loop.time() + REPORT_S
            keys = self.pick()
            if not keys:
                await asyncio.sleep(0.001)
                continue
            rows.array[: len(keys)] = 0x5A  # poison: a row reported loaded must be written
            result = await self.tier.load(keys, rows.views[: len(keys)])
            # A load of keys that are all gone completes at once, without I/O,
            # and awaiting it does not yield: without this the loop would
            # starve the tier's polls, which tell what is gone (a livelock).
            await asyncio.sleep(0)
            self.loads += len(keys)
            index = {k: i for i, k in enumerate(keys)}
            for k in result.loaded:
                self.hits += 1
                wrong = wrong_bytes(k, rows.array[index[k]])
                if wrong:
                    self.wrong += wrong
                    self.wrong_blocks += 1
                    line = {"wrong": wrong, "key": k.hex(), "t": time.monotonic()}
                    append(self.report, [json.dumps(line).encode()])
                parts = split_key(k)
                if parts is not None:
                    self.by_writer[parts[0]] = self.by_writer.get(parts[0], 0) + 1
            for err in result.missing.values():
                if isinstance(err, BlockNotFoundError):
                    self.misses += 1
                else:
                    self.errors += 1
                    kind = type(err).__name__
                    self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
        self.flush()
        return self.counters()


async def main(args: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    commands = Commands(loop)
    out = os.open(args["out"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    say({"event": "started", "pid": os.getpid()})
    command = (await commands.next()).split()
    if command[:1] != ["open"]:
        return
    if len(command) > 1:
        await asyncio.sleep(max(0.0, float(command[1]) - time.monotonic()))
    tier = await FileTier.open(
        config(Path(args["root"]), int(args["instances"])), layout(), block_bytes=BLOCK
    )
    stats = tier.statistics()
    say(
        {
            "event": "ready",
            "partition": stats.partition,
            "slots": stats.capacity_bytes // stats.file_bytes,
            "recovered": stats.recovered_blocks,
        }
    )
    figures: dict[str, Any] = {}
    if args["role"] == "writer":
        figures = await write(tier, int(args["id"]), out, commands.stop)
    elif args["role"] == "reader":
        figures = await Reader(tier, out, int(args["seed"])).run(commands.stop)
    else:
        await commands.stop.wait()
    await tier.aclose()
    say({"event": "closed", **figures})


if __name__ == "__main__":
    options = json.loads(sys.argv[1])
    # Warnings go to a file: a full stderr pipe would stall the child.
    logging.basicConfig(filename=f"{options['out']}.log", level=logging.WARNING)
    asyncio.run(main(options))
