"""One serving instance of the host tier tests, in its own process (a script, not collected).

usage: _instance.py NAMESPACE_HEX ROW_BYTES BUDGET INSTANCES [LEASE_TTL_S [ORPHAN_GRACE_S]]

Opens the host tier, prints ``{"slot", "pid"}`` (or ``{"error", "message"}``), then
runs one JSON command per stdin line, answering each with one JSON line:

* ``{"op": "store", "keys": [hex]}``: store each key's pattern -> ``{"stored": [bool]}``
* ``{"op": "load", "keys": [hex]}``: refresh, load each and compare with its pattern ->
  ``{"hits", "wrong", "missed": [hex]}``
* ``{"op": "pause", "stage": "store" | "load", "at": N}``: the Nth time the tier's hook
  runs at that stage (counted from now), print ``{"paused": stage}`` and wait for a line
  on stdin (a test kills the process there, or sends one to go on)
* ``{"op": "storm_store", "seed", "seconds", "space"}``: for that long, remove and store
  again keys drawn from ``space`` random keys of the seed -> ``{"stored"}``
* ``{"op": "storm_load", "seed", "seconds"}``: load random keys the host holds for that
  long, each compared with its pattern -> ``{"hits", "stale", "wrong", "loads"}``
* ``{"op": "stats"}``: the tier's statistics; ``{"op": "close"}``: close and exit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import sys
import time

from kvtier.errors import KVTierError
from kvtier.tiers.host import HostTier


def pattern(key: bytes, n: int) -> bytes:
    return hashlib.shake_128(key).digest(n)


def say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    ns, row_bytes, budget, instances = sys.argv[1:5]
    ttl = float(sys.argv[5]) if len(sys.argv) > 5 else 5.0
    grace = float(sys.argv[6]) if len(sys.argv) > 6 else None
    n = int(row_bytes)
    try:
        tier = HostTier.open(
            bytes.fromhex(ns), n, int(budget), int(instances), lease_ttl_s=ttl, orphan_grace_s=grace
        )
    except KVTierError as exc:
        say({"error": type(exc).__name__, "message": str(exc)})
        return
    say({"slot": tier.slot, "pid": os.getpid()})
    armed: dict[str, int] = {}

    def hook(stage: str) -> None:
        if stage in armed:
            armed[stage] -= 1
            if armed[stage] == 0:
                del armed[stage]
                say({"paused": stage})
                sys.stdin.readline()

    tier.hook = hook
    buf = bytearray(n)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "store":
            keys = [bytes.fromhex(k) for k in cmd["keys"]]
            stored = tier.store_many(keys, [memoryview(pattern(k, n)) for k in keys])
            say({"stored": stored})
        elif op == "load":
            tier.refresh()
            hits = wrong = 0
            missed = []
            for k in (bytes.fromhex(k) for k in cmd["keys"]):
                if tier.load(k, memoryview(buf)):
                    hits += 1
                    wrong += buf != pattern(k, n)
                else:
                    missed.append(k.hex())
            say({"hits": hits, "wrong": wrong, "missed": missed})
        elif op == "pause":
            armed[cmd["stage"]] = int(cmd["at"])
            say({"armed": cmd["stage"]})
        elif op == "storm_store":
            rng = random.Random(cmd["seed"])
            space = [rng.randbytes(16) for _ in range(cmd["space"])]
            count = 0
            end = time.monotonic() + cmd["seconds"]
            while time.monotonic() < end:
                k = rng.choice(space)
                tier.remove(k)  # rewrite it: rows change under the readers
                count += tier.store(k, memoryview(pattern(k, n)))
            say({"stored": count})
        elif op == "storm_load":
            rng = random.Random(cmd["seed"])
            hits = stale = wrong = loads = 0
            end = time.monotonic() + cmd["seconds"]
            while time.monotonic() < end:
                tier.refresh()
                keys = tier.held_keys()
                if not keys:
                    continue
                k = rng.choice(keys)
                loads += 1
                if tier.load(k, memoryview(buf)):
                    hits += 1
                    wrong += buf != pattern(k, n)
                else:
                    stale += 1
            say({"hits": hits, "stale": stale, "wrong": wrong, "loads": loads})
        elif op == "stats":
            say(dataclasses.asdict(tier.statistics()))
        elif op == "close":
            tier.close()
            say({"closed": True})
            return


if __name__ == "__main__":
    main()
