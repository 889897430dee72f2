"""benchmarks/vllm_serving.py at its smallest: three real `vllm serve`, chat users against each.

2 users x 3 rounds (each round's prompt the whole conversation so far),
vLLM's KV cache capped below the two histories, served without offloading,
with kvtier's CPU tier, and with a small CPU tier over a file tier slower
than recomputing (``kvtier-slow+decline``: ``KVTIER_BENCH_SLOW_BLOCK_S``
makes ``_serving_site`` wrap it in :class:`kvtier.testing.faults.SlowTier`)
with the load-or-recompute decision on, by the benchmark's own servers and
client process. Every greedy answer must equal the one without offloading;
kvtier must have served tokens (``kvtier_read_blocks_total`` on
``/metrics``), and the benchmark must have found kvtier's threads in the
engine processes; the slow tier's blocks must have been declined
(``kvtier_loads_declined_total``) rather than waited for.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import vllm_serving as bench  # noqa: E402


def test_kvtier_serves_chat_users_with_the_answers_of_no_offloading(
    model_dir: Path, tmp_path: Path
) -> None:
    configs = ["no-offload", "kvtier-cpu", "kvtier-slow+decline"]
    argv = ["--users", "2", "--rounds", "3", "--system", "512", "--turn", "256", "--gen", "8"]
    argv += ["--think", "0.3", "--reps", "1", "--configs", *configs]
    args = bench._parser().parse_args(argv)
    wl = bench.workloads(args, 0)[0]
    longest = -(-wl.longest() // 128)  # blocks of 128 tokens
    # One longest request and a block: the two histories (17 blocks) do not fit;
    # nor do they in the small CPU tier, so that the file tier holds some of them.
    sizes = bench.Sizes.plan(bench.kv_bytes_per_token(model_dir), wl, longest + 1)
    sizes = dataclasses.replace(sizes, small_cpu_blocks=longest - 1)
    assert sizes.working_set_blocks > sizes.engine_blocks
    assert sizes.working_set_blocks > sizes.small_cpu_blocks
    out = tmp_path / "out"
    out.mkdir()
    phases = bench.run(model_dir, configs, args, sizes, tmp_path, out, wait_s=None)
    rows = {r.config: r for r in bench.summarize(phases, configs)}

    kv = rows["kvtier-cpu"]
    assert kv.compared == 6, kv
    assert kv.equal == 6, "a greedy answer differs from the one without offloading"
    assert kv.kvtier_cpu_tokens > 0, "kvtier served nothing: " + str(phases[1].metrics)
    assert kv.connector_tokens > 0
    (phase,) = [p for p in phases if p.config == "kvtier-cpu"]
    assert any(name.startswith("kvtier-vllm") for name in phase.kvtier_threads), phase
    assert 0 <= phase.kvtier_cpu_s < phase.engine_cpu_s  # in ticks of 10 ms: may be 0
    assert "| kvtier-cpu | 2 |" in bench.table(list(rows.values()))

    slow = rows["kvtier-slow+decline"]
    (phase,) = [p for p in phases if p.config == "kvtier-slow+decline"]
    assert slow.compared == 6, slow
    assert slow.equal == 6, "a greedy answer differs from the one without offloading"
    assert slow.declined > 0, f"nothing declined: {phase.metrics}, {phase.decision}"
    # The warm-up read the slowed file tier once: kvtier measured it slower than
    # recomputing (0.5 s a block on one link).
    recompute = phase.decision["recompute_s_per_block"]
    read = phase.decision["file_read_s_per_block"]
    assert recompute is not None, phase.decision
    assert read is not None, phase.decision
    assert read > recompute, phase.decision
