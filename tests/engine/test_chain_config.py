"""The tier chain in the configuration: placement, policies, typed refusals (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier import ConfigurationError, KVTierConfig


def test_the_chain_is_file_then_cluster(tmp_path: Path) -> None:
    config = KVTierConfig.from_dict(
        {
            "cpu_bytes_to_use": "1MiB",
            "file_tier": {"root": str(tmp_path), "bytes_to_use": "1GiB"},
            "cluster_tier": {"nodes": ["127.0.0.1:7000"], "write_policy": "write_back"},
        }
    )
    assert [name for name, _ in config.chain] == ["file", "cluster"]
    assert config.cluster_tier is not None
    assert config.cluster_tier.write_policy == "write_back"
    assert config.cluster_tier.promote_to_file is None  # yes, there is a file tier


def test_the_cluster_alone_sits_below_the_cpu_tier(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text(
        '[kvtier]\ncpu_bytes_to_use = "1MiB"\n'
        '[kvtier.cluster_tier]\nnodes = ["10.0.0.5:6379"]\ntenant_prefix = "team-a"\n'
    )
    config = KVTierConfig.from_toml(path)
    assert [name for name, _ in config.chain] == ["cluster"]
    assert KVTierConfig(cpu_bytes_to_use=1 << 20).chain == ()


@pytest.mark.parametrize(
    ("cluster", "where"),
    [
        ({"nodes": ["a:1"], "promote_to_file": True}, "cluster_tier.promote_to_file"),
        ({"nodes": ["a:1"], "write_policy": "later"}, "cluster_tier.write_policy"),
        ({"nodes": []}, "cluster_tier.nodes"),
        ({"nodes": ["a:1"], "tenant_prefix": "a:b"}, "cluster_tier.tenant_prefix"),
    ],
    ids=["promote-without-file-tier", "bad-write-policy", "no-nodes", "bad-prefix"],
)
def test_bad_cluster_settings_are_typed_errors(cluster: dict[str, object], where: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        KVTierConfig(cpu_bytes_to_use=1 << 20, cluster_tier=cluster)
    assert where in {w for w, _ in info.value.problems}


def test_the_password_never_shows() -> None:
    config = KVTierConfig(
        cpu_bytes_to_use=1 << 20,
        cluster_tier={"nodes": ["a:1"], "username": "u", "password": "hunter2"},
    )
    assert "hunter2" not in repr(config)
    assert "hunter2" not in str(config)
