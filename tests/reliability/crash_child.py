"""Child of the crash-cycle test: stores blocks into a file tier until it is killed.

Usage: ``python crash_child.py ROOT JOURNAL SEED``. Before each store it appends
``A <key>`` lines (attempted) to the journal, after it ``S <key>`` for each block
stored and ``E <key>`` for each block evicted. Journal lines are written with
``os.write`` on an ``O_APPEND`` descriptor, so a SIGKILL loses at most the line
being written (the kernel keeps what was written; only a power loss would not).
Each block's bytes are its key repeated, so any block served later can be checked.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import sys
from pathlib import Path

from kvtier.config import FileTierConfig
from kvtier.layout import KVLayout, TensorSpec
from kvtier.tiers.file import FileTier

BLOCK = 64 << 10
BUDGET = 48 * (BLOCK + 4096)


def layout() -> KVLayout:
    return KVLayout(
        (TensorSpec("kv", (256, BLOCK), "uint8", 1, kv_first=False),),
        model_id="crash-cycles",
        block_tokens=16,
    )


def payload(key: bytes) -> bytes:
    return key * (BLOCK // len(key))


async def run(root: Path, journal: Path, seed: int) -> None:
    rng = random.Random(seed)
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    tier = await FileTier.open(
        FileTierConfig(root=root, bytes_to_use=BUDGET, queue_depth=8), layout(), block_bytes=BLOCK
    )
    os.write(fd, b"R ready\n")
    bufs = [mmap.mmap(-1, BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(16)]
    while True:
        n = rng.randint(1, len(bufs))
        keys = [rng.randbytes(16) for _ in range(n)]
        for key, buf in zip(keys, bufs, strict=False):
            buf[:] = payload(key)
        os.write(fd, b"".join(b"A " + k.hex().encode() + b"\n" for k in keys))
        result = await tier.store(keys, [memoryview(b) for b in bufs[:n]])
        lines = [b"S " + k.hex().encode() for k in result.stored]
        lines += [b"E " + k.hex().encode() for k in result.evicted]
        os.write(fd, b"".join(line + b"\n" for line in lines))


if __name__ == "__main__":
    asyncio.run(run(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])))
