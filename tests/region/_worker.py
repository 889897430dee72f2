"""A worker process of the shared-region tests (run as a script, not collected).

usage: _worker.py NAME WORLD RANK BUDGET MODE [gate]

MODE ``exchange``: attach, write this rank's slice of every row with ``rank + 1``,
wait until every other rank's slice holds its value, print a JSON report, close.
MODE ``hold``: attach, print a JSON report, then sleep until killed; ``hold-for-holder``
the same, attaching with ``holder=True``. RANK ``holder`` attaches the holder (``rank=None``).
``gate``: print ``ready`` and wait for a line on stdin before creating, so that
a test can release many workers into the creation race at once.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from kvtier.errors import KVTierError
from kvtier.layout import KVLayout, TensorSpec
from kvtier.region import CPURegion


def layout() -> KVLayout:
    specs = (
        TensorSpec("k", (8, 300), "float16", 2, False),
        TensorSpec("kv", (2, 8, 768), "float16", 2, True),
    )
    return KVLayout(tensors=specs, model_id="m", block_tokens=16, blocks_per_chunk=2)


def main() -> None:
    name, world, rank, budget, mode = sys.argv[1:6]
    if sys.argv[6:] == ["gate"]:
        print("ready", flush=True)
        sys.stdin.readline()
    try:
        region = CPURegion.create(
            layout(),
            int(budget),
            world_size=int(world),
            rank=None if rank == "holder" else int(rank),
            shared_name=name,
            holder=mode == "hold-for-holder",
            pin="off",
            join_timeout=10.0,
        )
    except KVTierError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        return
    stats = region.statistics()
    rows = [np.frombuffer(region.row(i), dtype=np.uint8) for i in range(region.rows)]
    width = region.slice_bytes
    report = {"created": stats.created, "rows": region.rows, "backing": stats.backing}
    if mode.startswith("hold"):
        print(json.dumps(report), flush=True)
        time.sleep(3600)
    for row in rows:
        row[int(rank) * width : (int(rank) + 1) * width] = int(rank) + 1
    deadline = time.monotonic() + 10
    seen = False
    while time.monotonic() < deadline and not seen:
        seen = all(
            bool((row[r * width : (r + 1) * width] == r + 1).all())
            for row in rows
            for r in range(region.world_size)
        )
        if not seen:
            time.sleep(0.005)
    report["saw_all"] = seen
    report["padding_zero"] = all(
        bool((row[region.world_size * width :] == 0).all()) for row in rows
    )
    del rows
    region.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
