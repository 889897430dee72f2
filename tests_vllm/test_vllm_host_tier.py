"""Two live `vllm serve` on one host tier: B serves from RAM a prefix only A served.

Servers A and B (each with its own EngineCore and worker processes, alive at
once) have the same ``host_tier`` block (``instances: 2``): each owns half of
the host segment's rows and reads all of them (docs/host-tier.md). A serves a
prompt; its blocks are written through to A's rows of the host segment. B
serves a prompt sharing A's first 768 tokens: it finds them in the segment (no
syscall on lookup), copies them from A's rows verified, and its greedy tokens
equal those of vLLM without offloading. Then A is SIGKILLed while B serves a
third prompt on the same prefix: A's rows stay readable (a dead instance's
rows are kept until one adopts them), B's answer is still the right one, and
once B stops (vLLM force-kills its EngineCore: kvtier cannot close), the
segment's janitor removes it from /dev/shm after ``orphan_grace_s``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.tiers.host import reap_host_segments
from tests_vllm._harness import generate, instance, prompts, serve

SHARED = 768
BLOCKS = SHARED // 128
A, B = prompts(seed=31)
_, C = prompts(seed=32)
C = A[:SHARED] + C[SHARED:]


def _until(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def _extra() -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": "64MiB",
        "host_tier": {
            "bytes_to_use": "256MiB",
            "instances": 2,
            "peer_poll_s": 0.01,
            "orphan_grace_s": 2.0,
        },
    }


def _host_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("kvtier.host.")}


def test_two_live_servers_share_one_host_tier(model_dir: Path, tmp_path: Path) -> None:
    with instance(model_dir, None) as plain:
        want = {name: generate(plain, p).tokens for name, p in (("A", A), ("B", B), ("C", C))}
    reap_host_segments()  # what an earlier run killed with its janitor left
    before = _host_segments()
    with (
        serve(model_dir, _extra(), tmp_path / "a.log") as a,
        serve(model_dir, _extra(), tmp_path / "b.log") as b,
    ):
        assert _host_segments() - before, "no host segment in /dev/shm"
        assert a.complete(A) == want["A"]
        # A's write-through ends shortly after its request (A's /metrics show it
        # at A's next scheduler step: A is polled until then); B picks the
        # blocks up within peer_poll_s of their write (B's figures, idle, would
        # wait for its next request).
        _until(
            "A's blocks in its rows",
            lambda: a.metric("kvtier_written_blocks_total", tier="host") >= BLOCKS,
        )
        time.sleep(0.5)  # B's host tier polls the segment every peer_poll_s (0.01 s)
        assert b.complete(B) == want["B"]
        assert b.metric("vllm:external_prefix_cache_hits_total") >= SHARED
        assert b.metric("kvtier_peer_hits_total", tier="host") >= BLOCKS
        assert b.metric("kvtier_stale_peer_reads_total", tier="host") == 0
        assert b.metric("kvtier_written_blocks_total", tier="host") < BLOCKS  # B's own, not A's

        # A dies while B serves C, which shares A's prefix.
        got: list[list[int]] = []
        asking = threading.Thread(target=lambda: got.append(b.complete(C)))
        asking.start()
        os.killpg(os.getpgid(a.proc.pid), signal.SIGKILL)
        a.proc.wait(30)
        asking.join(300)
        assert got == [want["C"]]
        assert b.complete(C) == want["C"]  # and after: from the dead instance's rows or not
    # vLLM's shutdown force-kills B's EngineCore before kvtier closes: the
    # segment's janitor removes it once no instance held it for orphan_grace_s.
    _until("the host segment removed", lambda: not (_host_segments() - before))
