"""``kvtier inspect --cluster`` against a real cluster with a password; no secret shown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.testing.tier import Rows, block_keys
from kvtier.testing.valkey import ValkeyCluster
from kvtier.tiers.cluster import ClusterTier

from .conftest import BLOCK, NAMESPACE, config_for, running

SECRET = "inspect-s3cret-pw"


@pytest.fixture(scope="module")
def locked_cluster() -> Iterator[ValkeyCluster]:
    with running(nodes=3, password=SECRET) as cluster:
        yield cluster


def inspect(
    cluster: ValkeyCluster, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    url = "redis://" + ",".join(f"127.0.0.1:{p}" for p in cluster.ports[:2])
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "inspect", "--cluster", url, *args],
        env={**os.environ, "KVTIER_CLUSTER_PASSWORD": SECRET} if env is None else env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_inspect_counts_blocks_per_prefix_and_namespace(
    locked_cluster: ValkeyCluster, tmp_path: Path
) -> None:
    stored = {("team-a", NAMESPACE): 20, ("team-a", b"n" * 16): 7, ("team-b", NAMESPACE): 5}
    for (prefix, ns), n in stored.items():
        config = config_for(locked_cluster, tenant_prefix=prefix, password=SECRET)
        tier = await ClusterTier.open(config, ns, block_bytes=BLOCK)
        keys = block_keys(n, salt=60)
        assert len((await tier.store(keys, Rows(n, BLOCK).fill(keys).rows())).stored) == n
        await tier.aclose()
    await_foreign = locked_cluster.cli(0, "set", "team-a:not-a-block", "x")
    assert "OK" in await_foreign or "MOVED" in await_foreign

    out = inspect(locked_cluster, "--prefix", "team-a", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    got = {
        (n["prefix"], n["namespace"]): (n["blocks"], n["block_bytes"]) for n in report["namespaces"]
    }
    assert got == {
        ("team-a", NAMESPACE.hex()): (20, [BLOCK]),
        ("team-a", (b"n" * 16).hex()): (7, [BLOCK]),
    }
    assert report["blocks"] == 27
    assert report["value_bytes"] == 27 * (BLOCK + 4096)
    assert len(report["nodes"]) == 3
    assert sum(n["keys_scanned"] for n in report["nodes"]) == 27 + ("OK" in await_foreign)
    assert report["truncated"] is False

    everything = inspect(locked_cluster)  # text, every prefix
    assert everything.returncode == 0, everything.stderr
    assert "team-b" in everything.stdout
    assert "total" in everything.stdout
    bounded = json.loads(inspect(locked_cluster, "--max-keys", "4", "--json").stdout)
    assert bounded["truncated"] is True
    assert bounded["blocks"] + bounded["other_keys"] == 4

    # The password from a file works the same; it is never printed.
    secret_file = tmp_path / "pw"
    secret_file.write_text(SECRET + "\n")
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_CLUSTER_PASSWORD"}
    from_file = inspect(locked_cluster, "--password-file", str(secret_file), env=env)
    assert from_file.returncode == 0, from_file.stderr
    for run in (out, everything, from_file):
        assert SECRET not in run.stdout + run.stderr


def test_inspect_refusals_do_not_show_the_password(locked_cluster: ValkeyCluster) -> None:
    env = {**os.environ, "KVTIER_CLUSTER_PASSWORD": "wrong-" + SECRET}
    wrong = inspect(locked_cluster, env=env)
    assert wrong.returncode == 2
    assert "authentication" in wrong.stderr
    assert SECRET not in wrong.stdout + wrong.stderr
    url = f"redis://user:{SECRET}@127.0.0.1:{locked_cluster.ports[0]}"
    in_url = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "inspect", "--cluster", url],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert in_url.returncode == 2
    assert "KVTIER_CLUSTER_PASSWORD" in in_url.stderr
    assert SECRET not in in_url.stdout + in_url.stderr
