"""One Engine on a host tier, in its own process (a script of the host tier tests, not collected).

usage: _engine_instance.py MODEL INSTANCES HOST_ROWS

Opens an :class:`~kvtier.Engine` (the CPU backend) whose chain has a host tier
of ``HOST_ROWS`` rows for ``INSTANCES`` instances, prints ``{"slot", "pid"}``, then
runs one JSON command per stdin line, answering each with one JSON line:

* ``{"op": "store", "salt", "n"}``: fill device blocks 0..n-1 with the blocks of
  ``salt`` (a function of salt and index: any process knows them), store them
  under ``salt``'s keys and flush -> ``{"stored"}``
* ``{"op": "load", "salt", "n"}``: refresh, load the prefix of ``salt``'s keys the
  host holds into device blocks 16.., compare each with what it must be ->
  ``{"loaded", "wrong"}``
* ``{"op": "storm", "first_salt", "count", "n"}``: store that many salts one after the
  other, printing ``{"storing": salt}`` before each (a test kills the process meanwhile)
* ``{"op": "stats"}``: the host tier's statistics; ``{"op": "close"}``: close and exit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from typing import Any

import torch

from kvtier import Engine, KVLayout, KVTierConfig, chain_keys
from kvtier.config import HostTierConfig
from kvtier.tiers.host import Geometry

NUM_BLOCKS = 32
LOAD_AT = 16
SHAPE = (2, NUM_BLOCKS, 4, 2, 16)


def block(salt: int, i: int) -> torch.Tensor:
    """Block ``i`` of ``salt``: one tensor's slice ``[:, i]``, the same in every process."""
    g = torch.Generator().manual_seed(salt * 1000 + i)
    return torch.randn(SHAPE[0], *SHAPE[2:], generator=g).to(torch.float16)


def keys(engine: Engine, salt: int, n: int) -> list[bytes]:
    tokens = [salt * 100_000 + t for t in range(n * engine.block_tokens)]
    return chain_keys(tokens, engine.block_tokens, engine.namespace)


def say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


async def main() -> None:
    model, instances, host_rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kv = [torch.zeros(*SHAPE, dtype=torch.float16) for _ in range(2)]
    layout = KVLayout.from_tensors(kv, model_id=model, block_tokens=4, num_blocks=NUM_BLOCKS)
    row = -(-layout.bytes_per_chunk // 4096) * 4096
    config = KVTierConfig(
        cpu_bytes_to_use=8 * row,
        host_tier=HostTierConfig(
            bytes_to_use=Geometry.budget_for(row, host_rows, instances),
            instances=instances,
            peer_poll_s=0.005,
        ),
    )
    engine = await Engine.open(config, layout, kv)
    host = engine.statistics().tiers["host"].statistics
    say({"slot": host.slot, "pid": os.getpid()})
    loop = asyncio.get_running_loop()

    async def store(salt: int, n: int) -> None:
        for i in range(n):
            for t in kv:
                t[:, i] = block(salt, i)
        await engine.store(keys(engine, salt, n), list(range(n)))
        await engine.flush()

    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd: dict[str, Any] = json.loads(line)
        op = cmd["op"]
        if op == "store":
            await store(cmd["salt"], cmd["n"])
            say({"stored": cmd["n"]})
        elif op == "load":
            ks = keys(engine, cmd["salt"], cmd["n"])
            ks = ks[: await engine.refresh(ks)]  # what the host holds now
            ids = list(range(LOAD_AT, LOAD_AT + len(ks)))
            for t in kv:
                t[:, LOAD_AT:] = 0
            got = await engine.load(ks, ids) if ks else 0
            wrong = sum(
                not all(torch.equal(t[:, LOAD_AT + i], block(cmd["salt"], i)) for t in kv)
                for i in range(got)
            )
            say({"loaded": got, "wrong": wrong})
        elif op == "storm":
            for salt in range(cmd["first_salt"], cmd["first_salt"] + cmd["count"]):
                say({"storing": salt})
                await store(salt, cmd["n"])
            say({"stormed": cmd["count"]})
        elif op == "stats":
            record = engine.statistics().tiers["host"].statistics
            say(dataclasses.asdict(record))
        elif op == "close":
            await engine.aclose()
            say({"closed": True})
            return
    await engine.aclose()


if __name__ == "__main__":
    asyncio.run(main())
