"""A scheduler process of the process-kill tests (run as a script, not collected).

usage: _scheduler.py ROOT WORLD SEED JOURNAL SOCKET_DIR

It binds a :class:`WorkerGroup` in SOCKET_DIR (a private directory the test
made, so that it can start the workers, ``_worker.py``, at the same time as
this process), prints ``{"address", "instance", "pid"}`` on stdout, opens an engine with a
write-through file tier at ROOT, appends ``R`` to JOURNAL once every rank has
attached, then stores and loads chains until it is killed. Chain ``t`` (its
tokens are ``16 t .. 16 t + 15``, four keys) is always stored from device
blocks ``t % 5 ..`` (blocks 0-7 hold each rank's seeded bytes), so the bytes
of any key are known; ``S t`` is appended once its store is flushed to the
file tier. When a worker dies (a typed error), it appends ``X`` and closes.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _worker import rank_layout

from kvtier import FileTierConfig, KVTierConfig, KVTierError, chain_keys
from kvtier.engine import Engine
from kvtier.workers import WorkerGroup

CHAINS = 64
ROW_FILE_BYTES = 8192


def config(root: Path, world: int) -> KVTierConfig:
    return KVTierConfig(
        cpu_bytes_to_use=1 << 20,
        world_size=world,
        file_tier=FileTierConfig(root=root, bytes_to_use=(4 * CHAINS + 64) * ROW_FILE_BYTES),
    )


def chain(engine: Engine, t: int) -> list[bytes]:
    return chain_keys(list(range(16 * t, 16 * t + 16)), engine.block_tokens, engine.namespace)


async def main(root: Path, world: int, seed: int, journal: Path, socket_dir: str) -> None:
    rng = random.Random(seed)
    group = WorkerGroup.bind(world, directory=socket_dir)
    print(
        json.dumps(
            {"address": group.address, "instance": group.instance.hex(), "pid": os.getpid()}
        ),
        flush=True,
    )
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    engine = await Engine.open(
        config(root, world), rank_layout(0, world), workers=group, worker_timeout=60
    )
    os.write(fd, b"R\n")
    try:
        while True:
            t = rng.randrange(CHAINS)
            keys = chain(engine, t)
            if rng.random() < 0.5 and (hits := engine.lookup(keys)):
                await engine.load(keys[:hits], list(range(8, 8 + hits)))
                continue
            await engine.store(keys, list(range(t % 5, t % 5 + 4)))
            await engine.flush()
            os.write(fd, f"S {t}\n".encode())
    except KVTierError as exc:
        os.write(fd, f"X {type(exc).__name__}\n".encode())
    finally:
        await engine.aclose()


if __name__ == "__main__":
    root, world, seed, journal, socket_dir = sys.argv[1:6]
    asyncio.run(main(Path(root), int(world), int(seed), Path(journal), socket_dir))
