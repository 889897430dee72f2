from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvtier import ConfigurationError, FileTierConfig, KVTierConfig
from kvtier.config import parse_bytes


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
        pytest.param(
            {"cpu_bytes_to_use": 1.5}, r"cpu_bytes_to_use: must be a whole number", id="fraction"
        ),
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
            {"cpu_bytes_to_use": 1, "colour": "red"},
            r"colour: unknown key \(the keys of KVTierConfig are cpu_bytes_to_use, ",
            id="unknown-key",
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
            r"file_tier.peer_poll_s: .*greater than or equal to 0.001",
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


# -- issue 41: one size rule, strict counts, a bounded poll, ~ in roots, typos ------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4G", 4 << 30),
        ("4GiB", 4 << 30),
        ("4g", 4 << 30),
        ("4Gi", 4 << 30),
        ("4GB", 4_000_000_000),
        ("2M", 2 << 20),
        ("256K", 256 << 10),
        ("1T", 1 << 40),
        ("512 MB", 512_000_000),
        (" 8 GiB ", 8 << 30),
        ("4096", 4096),
        ("4096B", 4096),
        ("1.5GiB", 3 << 29),
        ("0.5K", 512),
        (".25MiB", 256 << 10),
        ("1.5 GB", 1_500_000_000),
        (4096, 4096),
        (2.0**20, 1 << 20),
    ],
)
def test_sizes_follow_one_rule(text: object, size: int) -> None:
    # K/M/G/T alone are binary, like KiB/MiB/GiB/TiB; KB/MB/GB/TB are decimal.
    assert parse_bytes(text) == size
    assert KVTierConfig.from_dict({"cpu_bytes_to_use": text}).cpu_bytes_to_use == size


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1.5 B", r"not a whole number of bytes \(1.5 bytes\)"),
        ("1.5", r"not a whole number of bytes \(1.5 bytes\)"),
        ("0.1K", r"not a whole number of bytes \(102.4 bytes\)"),
        ("1.0000001GiB", r"not a whole number of bytes \(1,073,741,931.4 bytes\)"),
        (1.5, r"must be a whole number of bytes"),
        (float("inf"), r"must be a whole number of bytes"),
        ("8GiB of RAM", r"could not parse a size: a number and an optional unit"),
        ("1e9", r"could not parse a size"),
        ("4 xb", r"unknown unit 'xb'"),
        ("4Gbit", r"unknown unit 'Gbit'"),
        ("-5G", r"must be a positive number of bytes"),
        ([4096], r"must be a number of bytes or a size string, not list"),
    ],
)
def test_sizes_refuse_what_is_not_whole_bytes(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_bytes(value)
    with pytest.raises(ConfigurationError, match=f"cpu_bytes_to_use: {message}.* \\(got "):
        KVTierConfig.from_dict({"cpu_bytes_to_use": value})


def test_bench_block_sizes_take_the_same_rule() -> None:
    # `kvtier bench --block-size 2M` was 2,000,000 bytes, refused as no multiple of 4096.
    from kvtier.cli._args import parse_size

    assert parse_size("2M") == parse_size("2MiB") == 2 << 20
    assert parse_size("256K") == 256 << 10
    with pytest.raises(argparse.ArgumentTypeError, match="not a byte size"):
        parse_size("1.5 B")


@pytest.mark.parametrize(
    ("where", "key"),
    [
        ((), "blocks_per_chunk"),
        ((), "world_size"),
        (("file_tier",), "instances"),
        (("file_tier",), "peer_poll_s"),
    ],
)
@pytest.mark.parametrize("value", [True, False, "2", 2.0], ids=["True", "False", "str", "float"])
def test_counts_and_periods_refuse_bools_and_strings(
    where: tuple[str, ...], key: str, value: object
) -> None:
    if key == "peer_poll_s" and value == 2.0:
        return  # a float is what this field takes
    data: dict[str, Any] = {"cpu_bytes_to_use": 1 << 20}
    table = data
    for part in where:
        table = table.setdefault(part, {"root": "/x", "bytes_to_use": 1 << 20})
    table[key] = value
    path = ".".join((*where, key))
    with pytest.raises(ConfigurationError, match=rf"{path}: Input should be a valid"):
        KVTierConfig.from_dict(data)


@pytest.mark.parametrize("poll", [1e-9, 0.0005, -1.0])
def test_peer_poll_has_a_floor(poll: float) -> None:
    with pytest.raises(ConfigurationError, match=r"peer_poll_s: .*greater than or equal to 0.001"):
        FileTierConfig(root=Path("/x"), bytes_to_use=1 << 20, peer_poll_s=poll)
    assert FileTierConfig(root=Path("/x"), bytes_to_use=1 << 20, peer_poll_s=0.001).peer_poll_s


def test_root_expands_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for root in ("~/kvtier-cache", Path("~/kvtier-cache")):
        tier = FileTierConfig(root=root, bytes_to_use=1 << 20)
        assert tier.root == tmp_path / "kvtier-cache"
    cfg = KVTierConfig.from_dict(
        {"cpu_bytes_to_use": 1 << 20, "file_tier": {"root": "~", "bytes_to_use": 1 << 20}}
    )
    assert cfg.file_tier is not None
    assert cfg.file_tier.root == tmp_path
    assert not (tmp_path / "~").exists()
    # A relative root stays relative: it resolves against the working directory.
    assert FileTierConfig(root="cache", bytes_to_use=1 << 20).root == Path("cache")


def test_root_of_an_unknown_user_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"file_tier.root: cannot expand '~no-such-u"):
        KVTierConfig.from_dict(
            {
                "cpu_bytes_to_use": 1 << 20,
                "file_tier": {"root": "~no-such-user-kvtier/x", "bytes_to_use": 1 << 20},
            }
        )


@pytest.mark.parametrize(
    ("data", "where", "hint"),
    [
        ({"cpu_bytes_to_us": 1}, "cpu_bytes_to_us", "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 1, "eviction_polcy": "lru"}, "eviction_polcy", "eviction_policy"),
        ({"cpu_bytes_to_use": 1, "blocks_per_chunks": 2}, "blocks_per_chunks", "blocks_per_chunk"),
        (
            {"cpu_bytes_to_use": 1, "file_tier": {"root": "/x", "bytes_to_use": 1, "instance": 2}},
            "file_tier.instance",
            "instances",
        ),
        (
            {"cpu_bytes_to_use": 1, "cluster_tier": {"nodes": ["h:1"], "tennant_prefix": "a"}},
            "cluster_tier.tennant_prefix",
            "tenant_prefix",
        ),
    ],
)
def test_a_typo_names_the_nearest_key(data: dict[str, Any], where: str, hint: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        KVTierConfig.from_dict(data)
    assert (where, f"unknown key, did you mean {hint!r}?") in info.value.problems
    assert f"{where}: unknown key, did you mean {hint!r}?" in str(info.value)


def test_a_typo_in_a_table_alone_names_the_nearest_key() -> None:
    with pytest.raises(ConfigurationError, match=r"bytes_to_us: unknown key, did you mean"):
        FileTierConfig.from_dict({"root": "/x", "bytes_to_us": 1})
