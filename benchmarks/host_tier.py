"""A block loaded from another instance's rows of the host tier, against one of its own.

Run from the repository root::

    .venv/bin/python benchmarks/host_tier.py            # 1 MiB blocks, 32 a request, 9 rounds
    .venv/bin/python benchmarks/host_tier.py --quick    # 3 rounds

Two :class:`~kvtier.Engine` instances (the CPU backend) in two processes share
one host tier (``host_tier`` with ``instances: 2``); each has a CPU tier of
``--blocks`` rows. Per round, interleaved, each a fresh prefix of ``--blocks``
blocks stored by instance A and then loaded into device blocks (``lookup``,
``load``, every block verified):

``cpu hit``
    A loads what it just stored: every block in its CPU tier (a device copy).
``own host hit``
    A loads a prefix it stored two rounds before, since pushed out of its CPU
    tier: from A's rows of the host tier (a copy into a CPU row, verified,
    then to the device).
``peer host hit``
    B loads a prefix A stored two rounds before: from A's rows, with a lease
    (B never had it in its CPU tier).

What is printed: milliseconds per request and GB/s of payload, medians over
the rounds, and the ratios ``peer / own`` (the issue's target: within 1.2x) and
``peer / cpu``.

First, the rows alone (``--rows-only`` for just this part): two
:class:`~kvtier.tiers.host.HostTier` in this process, one storing ``--rows``
blocks, then each loading all of them (verified), interleaved, ``--repeats``
times: a peer's rows read cold (their pages not yet in the reader's page
tables: minor faults), and after :meth:`HostTier.prefault
<kvtier.tiers.host.HostTier.prefault>` (what the chain's host tier does in
the background at open), against the owner's own reads.

The machine this runs on is shared and noisy: compare the ratios, not the
milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import torch

from kvtier import Engine, KVLayout, KVTierConfig, chain_keys
from kvtier.config import HostTierConfig
from kvtier.tiers.host import HostTier

NUM_BLOCKS = 128
LOAD_AT = 64


def _kv(block_bytes: int) -> list[torch.Tensor]:
    # Two K/V-first fp16 tensors: 16 tokens x 8 heads x (block_bytes / 1024) per block.
    dim = block_bytes // (2 * 2 * 16 * 8 * 2)
    return [torch.zeros(2, NUM_BLOCKS, 16, 8, dim, dtype=torch.float16) for _ in range(2)]


async def instance(model: str, block_bytes: int, blocks: int) -> None:
    """One Engine, driven by JSON lines on stdin (the benchmark's child process)."""
    kv = _kv(block_bytes)
    layout = KVLayout.from_tensors(kv, model_id=model, block_tokens=16, num_blocks=NUM_BLOCKS)
    row = -(-layout.bytes_per_chunk // 4096) * 4096
    config = KVTierConfig(
        cpu_bytes_to_use=blocks * row,
        host_tier=HostTierConfig(
            bytes_to_use=16 * blocks * (row + 4096), instances=2, orphan_grace_s=None
        ),
    )
    engine = await Engine.open(config, layout, kv)
    loop = asyncio.get_running_loop()
    print(json.dumps({"ready": layout.bytes_per_chunk}), flush=True)
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd: dict[str, Any] = json.loads(line)
            tokens = [cmd["salt"] * 1_000_000 + t for t in range(blocks * 16)]
            keys = chain_keys(tokens, 16, engine.namespace)
            if cmd["op"] == "store":
                for t in kv:
                    t[:, :blocks].normal_()
                await engine.store(keys, list(range(blocks)))
                await engine.flush()
                print(json.dumps({"stored": blocks}), flush=True)
            elif cmd["op"] == "load":
                await engine.refresh(keys)
                t0 = time.perf_counter()
                n = engine.lookup(keys)
                got = await engine.load(keys[:n], list(range(LOAD_AT, LOAD_AT + n))) if n else 0
                seconds = time.perf_counter() - t0
                host = engine.statistics().tiers["host"].statistics
                out = {"loaded": got, "s": seconds, "peer_hits": host.peer_hits}
                print(json.dumps(out), flush=True)
    finally:
        await engine.aclose()


class Child:
    def __init__(self, args: argparse.Namespace, model: str) -> None:
        argv = [sys.executable, __file__, "--child", model, "--block-kib", str(args.block_kib)]
        argv += ["--blocks", str(args.blocks)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.block_bytes = int(self.read()["ready"])

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("a benchmark instance exited")
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, **cmd: object) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def rows(block_bytes: int, count: int, repeats: int) -> None:
    """Peer reads of the rows alone, cold and prefaulted, against the owner's."""
    times: dict[str, list[float]] = {"own": [], "peer, cold": [], "peer, prefaulted": []}
    faults = 0
    for _ in range(repeats):
        for prefaulted in (False, True):
            ns = uuid.uuid4().bytes
            budget = 2 * count * (block_bytes + 4096) + (1 << 20)
            with (
                HostTier.open(ns, block_bytes, budget, 2) as a,
                HostTier.open(ns, block_bytes, budget, 2) as b,
            ):
                keys = [uuid.uuid4().bytes for _ in range(count)]
                payload = memoryview(bytearray(block_bytes))
                a.store_many(keys, [payload] * count)
                b.refresh()
                if prefaulted:
                    b.prefault()
                buf = memoryview(bytearray(block_bytes))
                buf[:] = bytes(block_bytes)  # touched: only the segment's pages can fault
                for who, name in (
                    (b, "peer, prefaulted" if prefaulted else "peer, cold"),
                    (a, "own"),
                ):
                    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    t0 = time.perf_counter()
                    if not all(who.load_many(keys, [buf] * count)):
                        raise RuntimeError(f"{name}: a block did not load")
                    times[name].append((time.perf_counter() - t0) / count)
                    if name == "peer, cold":
                        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"rows alone: {count} blocks of {block_bytes >> 10} KiB, {repeats} repeats (medians)")
    print("| read | ms a block | GB/s | / own |")
    print("|---|---|---|---|")
    for name, sec in med.items():
        ratio = sec / med["own"]
        print(f"| {name} | {sec * 1e3:.3f} | {block_bytes / sec / 1e9:.2f} | {ratio:.2f}x |")
    print(f"minor page faults of the cold peer reads: {faults // repeats} a pass\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--block-kib", type=int, default=1024, help="payload of a block (KiB)")
    ap.add_argument("--blocks", type=int, default=32, help="blocks a request (= CPU rows)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="3 rounds, 3 repeats")
    ap.add_argument("--rows", type=int, default=256, help="blocks of the rows-alone part")
    ap.add_argument("--repeats", type=int, default=7, help="of the rows-alone part")
    ap.add_argument("--rows-only", action="store_true", help="only the rows-alone part")
    ap.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        asyncio.run(instance(args.child, args.block_kib * 1024, args.blocks))
        return
    rounds = 3 if args.quick else args.rounds
    rows(args.block_kib * 1024, args.rows, 3 if args.quick else args.repeats)
    if args.rows_only:
        return
    model = f"host-bench-{uuid.uuid4().hex[:8]}"
    a, b = Child(args, model), Child(args, model)
    times: dict[str, list[float]] = {"cpu hit": [], "own host hit": [], "peer host hit": []}
    try:
        for salt in (1, 2):  # two prefixes ahead: the first rounds load them from the host
            a.ask(op="store", salt=salt)
        # Untimed: each instance's CPU rows and device blocks touched once (first-touch
        # page faults are not what is compared).
        a.ask(op="load", salt=2)
        b.ask(op="load", salt=1)
        for r in range(rounds):
            salt = 3 + r
            a.ask(op="store", salt=salt)
            for name, who, s in (
                ("cpu hit", a, salt),
                ("own host hit", a, salt - 2),
                ("peer host hit", b, salt - 1),
            ):
                got = who.ask(op="load", salt=s)
                if got["loaded"] != args.blocks:
                    raise RuntimeError(f"{name}: {got['loaded']} of {args.blocks} blocks loaded")
                times[name].append(got["s"])
        peer_hits = b.ask(op="load", salt=rounds + 1)["peer_hits"]
    finally:
        a.close()
        b.close()
    payload = args.blocks * a.block_bytes
    print(
        f"{args.blocks} blocks of {a.block_bytes >> 10} KiB a request, {rounds} rounds "
        f"(medians); B's peer hits: {peer_hits}"
    )
    print("| load | ms a request | GB/s |")
    print("|---|---|---|")
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, sec in med.items():
        print(f"| {name} | {sec * 1e3:.2f} | {payload / sec / 1e9:.2f} |")
    print(f"peer / own host hit: {med['peer host hit'] / med['own host hit']:.2f}x")
    print(f"peer host / cpu hit: {med['peer host hit'] / med['cpu hit']:.2f}x")


if __name__ == "__main__":
    main()
