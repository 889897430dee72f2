from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier import ConfigurationError, FileTierConfig, KVTierConfig


def test_sizes_accept_units_and_ints() -> None:
    cfg = KVTierConfig.from_dict({"cpu_bytes_to_use": "8GiB"})
    assert cfg.cpu_bytes_to_use == 8 * 2**30
    assert KVTierConfig(cpu_bytes_to_use=4096).cpu_bytes_to_use == 4096
    assert KVTierConfig(cpu_bytes_to_use="1 MB").cpu_bytes_to_use == 1_000_000


def test_defaults() -> None:
    cfg = KVTierConfig(cpu_bytes_to_use="1MiB")
    assert cfg.blocks_per_chunk == 1
    assert cfg.eviction_policy == "lru"
    assert cfg.file_tier is None
    ft = FileTierConfig(root=Path("/tmp/x"), bytes_to_use="1GiB")
    assert (ft.write_policy, ft.io_engine, ft.direct_io, ft.queue_depth, ft.durability) == (
        "write_through",
        "auto",
        "auto",
        "auto",
        "none",
    )


def test_nested_file_tier_from_dict() -> None:
    cfg = KVTierConfig.from_dict(
        {
            "cpu_bytes_to_use": "2GiB",
            "blocks_per_chunk": 4,
            "eviction_policy": "arc",
            "file_tier": {
                "root": "/var/cache/kv",
                "bytes_to_use": "100GiB",
                "write_policy": "write_back",
                "io_engine": "io_uring",
                "direct_io": "require",
                "queue_depth": 64,
            },
        }
    )
    assert cfg.file_tier is not None
    assert cfg.file_tier.root == Path("/var/cache/kv")
    assert cfg.file_tier.bytes_to_use == 100 * 2**30
    assert cfg.file_tier.write_policy == "write_back"


def test_frozen() -> None:
    cfg = KVTierConfig(cpu_bytes_to_use=4096)
    with pytest.raises(Exception, match="frozen"):
        cfg.blocks_per_chunk = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param({}, r"cpu_bytes_to_use: Field required", id="missing-budget"),
        pytest.param({"cpu_bytes_to_use": 0}, r"cpu_bytes_to_use: .*greater than 0", id="zero"),
        pytest.param(
            {"cpu_bytes_to_use": -5},
            r"cpu_bytes_to_use: must be a positive number of bytes",
            id="neg",
        ),
        pytest.param({"cpu_bytes_to_use": "lots"}, r"cpu_bytes_to_use: could not parse", id="unit"),
        pytest.param(
            {"cpu_bytes_to_use": True}, r"cpu_bytes_to_use: must be a number of bytes", id="bool"
        ),
        pytest.param(
            {"cpu_bytes_to_use": 2**64 + 8192},
            r"cpu_bytes_to_use: .*less than or equal to 1152921504606846976",
            id="beyond-64-bits",
        ),
        pytest.param(
            {"cpu_bytes_to_use": "2EiB"}, r"cpu_bytes_to_use: .*less than or equal", id="2EiB"
        ),
        pytest.param({"cpu_bytes_to_use": 1.5}, r"cpu_bytes_to_use: ", id="fraction"),
        pytest.param(
            {"cpu_bytes_to_use": 1, "file_tier": {"root": "/x", "bytes_to_use": False}},
            r"file_tier.bytes_to_use: must be a number of bytes",
            id="ft-bool",
        ),
        pytest.param(
            {"cpu_bytes_to_use": 1, "blocks_per_chunk": 0},
            r"blocks_per_chunk: .*greater than or equal to 1",
            id="bpc-zero",
        ),
        pytest.param(
            {"cpu_bytes_to_use": 1, "blocks_per_chunk": "two"},
            r"blocks_per_chunk: .*valid integer",
            id="bpc-str",
        ),
        pytest.param(
            {"cpu_bytes_to_use": 1, "eviction_policy": "fifo"},
            r"eviction_policy: Input should be 'lru' or 'arc'",
            id="policy",
        ),
        pytest.param(
            {"cpu_bytes_to_use": 1, "colour": "red"}, r"colour: Extra inputs", id="unknown-key"
        ),
        pytest.param(
            {"cpu_bytes_to_use": 1, "file_tier": {"bytes_to_use": 1}},
            r"file_tier.root: Field required",
            id="ft-root",
        ),
        pytest.param(
            {"cpu_bytes_to_use": 1, "file_tier": {"root": "/x", "bytes_to_use": 0}},
            r"file_tier.bytes_to_use: .*greater than 0",
            id="ft-budget",
        ),
        pytest.param(
            {
                "cpu_bytes_to_use": 1,
                "file_tier": {"root": "/x", "bytes_to_use": 1, "write_policy": "sometimes"},
            },
            r"file_tier.write_policy: Input should be 'write_through' or 'write_back'",
            id="ft-write-policy",
        ),
        pytest.param(
            {
                "cpu_bytes_to_use": 1,
                "file_tier": {"root": "/x", "bytes_to_use": 1, "io_engine": "aio"},
            },
            r"file_tier.io_engine: Input should be 'auto', 'io_uring' or 'threads'",
            id="ft-io-engine",
        ),
        pytest.param(
            {
                "cpu_bytes_to_use": 1,
                "file_tier": {"root": "/x", "bytes_to_use": 1, "direct_io": "yes"},
            },
            r"file_tier.direct_io: Input should be 'auto', 'require' or 'off'",
            id="ft-direct-io",
        ),
        pytest.param(
            {
                "cpu_bytes_to_use": 1,
                "file_tier": {"root": "/x", "bytes_to_use": 1, "queue_depth": 0},
            },
            r"file_tier.queue_depth: .*greater than or equal to 1",
            id="ft-qd",
        ),
        pytest.param(
            {"cpu_bytes_to_use": 1, "file_tier": {"root": "/x", "bytes_to_use": 1, "instances": 0}},
            r"file_tier.instances: .*greater than or equal to 1",
            id="ft-instances-0",
        ),
        pytest.param(
            {
                "cpu_bytes_to_use": 1,
                "file_tier": {"root": "/x", "bytes_to_use": 1, "instances": 257},
            },
            r"file_tier.instances: .*less than or equal to 256",
            id="ft-instances-many",
        ),
        pytest.param(
            {
                "cpu_bytes_to_use": 1,
                "file_tier": {"root": "/x", "bytes_to_use": 1, "peer_poll_s": 0},
            },
            r"file_tier.peer_poll_s: .*greater than 0",
            id="ft-peer-poll",
        ),
        pytest.param(
            {"cpu_bytes_to_use": 1, "shared_region_name": "../etc"},
            r"shared_region_name: String should match pattern",
            id="shm-name",
        ),
        pytest.param(
            {"cpu_bytes_to_use": 1, "world_size": 0},
            r"world_size: .*greater than or equal to 1",
            id="world-size",
        ),
    ],
)
def test_invalid_fields_name_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        KVTierConfig.from_dict(data)


def test_configuration_error_is_value_error() -> None:
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        KVTierConfig(cpu_bytes_to_use=0)


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ConfigurationError, match="expects a mapping"):
        KVTierConfig.from_dict([("cpu_bytes_to_use", 1)])  # type: ignore[arg-type]


def test_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text(
        '[kvtier]\ncpu_bytes_to_use = "16GiB"\nblocks_per_chunk = 2\n'
        '[kvtier.file_tier]\nroot = "/data/kv"\nbytes_to_use = "1TiB"\n'
    )
    cfg = KVTierConfig.from_toml(path)
    assert cfg.cpu_bytes_to_use == 16 * 2**30
    assert cfg.file_tier is not None
    assert cfg.file_tier.bytes_to_use == 2**40


def test_from_toml_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot read"):
        KVTierConfig.from_toml(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("cpu_bytes_to_use = = 3")
    with pytest.raises(ConfigurationError, match="not valid TOML"):
        KVTierConfig.from_toml(bad)


def test_row_alignment_is_what_the_chain_needs(tmp_path: Path) -> None:
    # The file tier reads and writes rows with O_DIRECT; without it no alignment is asked.
    assert KVTierConfig(cpu_bytes_to_use=1 << 20).row_alignment is None
    with_file = KVTierConfig(
        cpu_bytes_to_use=1 << 20,
        file_tier=FileTierConfig(root=tmp_path, bytes_to_use=1 << 30),
    )
    assert with_file.file_tier is not None
    assert with_file.row_alignment == 4096 == with_file.file_tier.buffer_alignment
