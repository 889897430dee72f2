"""The integrations stay at the edge, and the vLLM adapter's configuration (no vLLM needed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtier.errors import ConfigurationError
from kvtier.integrations.vllm.settings import parse_extra_config

PACKAGE = Path(__file__).resolve().parents[2] / "kvtier"
INTEGRATIONS = PACKAGE / "integrations"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_integration_imports_vllm() -> None:
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if INTEGRATIONS not in p.parents and "vllm" in _imports(p)
    ]
    assert offenders == []
    # ...and there, the adapter's modules and vLLM's own command line only: the
    # configuration and the model's fingerprint are checked without vLLM.
    users = sorted(p.name for p in INTEGRATIONS.rglob("*.py") if "vllm" in _imports(p))
    assert users == ["_common.py", "manager.py", "serve.py", "spec.py", "tier.py", "worker.py"]


def test_settings_build_kvtiers_config(tmp_path: Path) -> None:
    s = parse_extra_config(
        {
            "spec_name": "KVTierOffloadingSpec",
            "spec_module_path": "kvtier.integrations.vllm.spec",
            "cpu_bytes_to_use": "1GiB",
            "eviction_policy": "arc",
            "file_tier": {"root": str(tmp_path), "bytes_to_use": "2GiB"},
        },
        blocks_per_chunk=2,
        world_size=4,
    )
    assert int(s.config.cpu_bytes_to_use) == 1 << 30
    assert s.config.eviction_policy == "arc"
    assert s.config.blocks_per_chunk == 2
    assert s.config.world_size == 4
    assert s.config.file_tier is not None
    assert s.config.file_tier.root == tmp_path
    assert s.statistics_file is None


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        pytest.param({"cpu_bytes_to_use": "1GiB", "cpu_bytes": 1}, "unknown key", id="unknown-key"),
        pytest.param({}, "cpu_bytes_to_use is required", id="missing-budget"),
        pytest.param({"cpu_bytes_to_use": "lots"}, "cpu_bytes_to_use", id="bad-size"),
        pytest.param(
            {"cpu_bytes_to_use": "1GiB", "eviction_policy": "fifo"}, "eviction_policy", id="policy"
        ),
        pytest.param(
            {"cpu_bytes_to_use": "1GiB", "file_tier": {"root": "/x"}},
            "bytes_to_use",
            id="file-tier-without-budget",
        ),
        pytest.param(
            {
                "cpu_bytes_to_use": "1GiB",
                "file_tier": {"root": "/x", "bytes_to_use": "1GiB", "write_policy": "write_back"},
            },
            "write_through",
            id="write-back",
        ),
        pytest.param(
            {"cpu_bytes_to_use": "1GiB", "statistics_file": 3}, "statistics_file", id="stats"
        ),
        pytest.param(
            {"cpu_bytes_to_use": "1GiB", "statistics_file": "/nonexistent-kvtier/stats.json"},
            "statistics_file its directory /nonexistent-kvtier does not exist",
            id="stats-directory-missing",
        ),
        pytest.param(
            {"cpu_bytes_to_use": "1GiB", "statistics_file": "/tmp"},
            "statistics_file /tmp is a directory",
            id="stats-is-a-directory",
        ),
        pytest.param(
            {"cpu_bytes_to_use": "1GiB", "file_tier": {"root": "", "bytes_to_use": "1GiB"}},
            "file_tier.root: must name a directory",
            id="empty-root",
        ),
        pytest.param(
            {
                "cpu_bytes_to_use": "1GiB",
                "cluster_tier": {"nodes": ["127.0.0.1:7000"], "password": "s3cret"},
            },
            "cluster_tier.password would be logged by the engine",
            id="cluster-password-in-json",
        ),
        pytest.param(
            {
                "cpu_bytes_to_use": "1GiB",
                "cluster_tier": {"nodes": ["127.0.0.1:7000"], "write_policy": "write_back"},
            },
            'cluster_tier.write_policy must be "write_through"',
            id="cluster-write-back",
        ),
        pytest.param(
            {"cpu_bytes_to_use": "1GiB", "lookup_deadline_s": 0},
            "lookup_deadline_s must be a number of seconds",
            id="deadline-zero",
        ),
    ],
)
def test_bad_settings_raise_configuration_error(extra: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        parse_extra_config(extra)


def test_a_root_that_is_a_file_is_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "kv").write_bytes(b"")
    tier = {"root": str(tmp_path / "kv"), "bytes_to_use": "1GiB"}
    with pytest.raises(ConfigurationError, match=r"file_tier\.root: .*kv exists and is not a dir"):
        parse_extra_config({"cpu_bytes_to_use": "1GiB", "file_tier": tier})


def test_the_cluster_password_comes_from_the_environment_or_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes = ["127.0.0.1:7000"]
    monkeypatch.setenv("KVTIER_TEST_PASSWORD", "from-env")
    s = parse_extra_config(
        {
            "cpu_bytes_to_use": "1GiB",
            "lookup_deadline_s": 0.5,
            "cluster_tier": {"nodes": nodes, "password_env": "KVTIER_TEST_PASSWORD"},
        }
    )
    assert s.config.cluster_tier is not None
    assert s.config.cluster_tier.password is not None
    assert s.config.cluster_tier.password.get_secret_value() == "from-env"
    assert s.lookup_deadline_s == 0.5
    (tmp_path / "pw").write_text("from-file\n")
    s = parse_extra_config(
        {
            "cpu_bytes_to_use": "1GiB",
            "cluster_tier": {"nodes": nodes, "password_file": str(tmp_path / "pw")},
        }
    )
    assert s.config.cluster_tier is not None
    assert s.config.cluster_tier.password is not None
    assert s.config.cluster_tier.password.get_secret_value() == "from-file"
    with pytest.raises(ConfigurationError, match="not set"):
        parse_extra_config(
            {"cpu_bytes_to_use": "1GiB", "cluster_tier": {"nodes": nodes, "password_env": "NOPE_X"}}
        )
