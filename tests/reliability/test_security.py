"""What kvtier writes is private, and nothing planted in its root can redirect it."""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path

import pytest
from support.slots import block_offsets

from kvtier import TierIOError, chain_keys

sys.path.insert(0, str(Path(__file__).parent))
from workload import BPC, make_kv, make_layout, open_engine, verify_everything, write_blocks


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


async def test_created_files_are_0600_and_directories_0700(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    old = os.umask(0)  # the modes must not depend on a permissive umask
    try:
        async with open_engine(root) as (engine, kv):
            keys = chain_keys(
                list(range(3 * engine.block_tokens)), engine.block_tokens, engine.namespace
            )
            write_blocks(kv, keys, list(range(3 * BPC)))
            await engine.store(keys, list(range(3 * BPC)))
            await engine.flush()
    finally:
        os.umask(old)
    paths = [root, *root.rglob("*")]
    assert len(paths) > 6
    for p in paths:
        if p.is_symlink():
            raise AssertionError(f"kvtier created a symlink: {p}")
        want = 0o700 if p.is_dir() else 0o600
        assert mode(p) == want, f"{p} has mode {oct(mode(p))}"


async def test_planted_symlinks_are_never_followed(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    secret = tmp_path / "secret"
    secret.write_bytes(b"do not touch" * 1000)
    before = secret.read_bytes()
    async with open_engine(root, cpu_rows=4) as (engine, kv):
        ns = root / engine.namespace.hex()
    # A symlink planted where the slot file goes: opening refuses it (O_NOFOLLOW)
    # with a typed error instead of writing blocks into the target.
    (ns / "blocks.dat").unlink()
    (ns / "blocks.dat").symlink_to(secret)
    with pytest.raises(TierIOError) as info:
        async with open_engine(root, cpu_rows=4):
            pass
    assert info.value.errno == errno.ELOOP
    assert secret.read_bytes() == before
    # Symlinks planted in tmp/ (where a probe or namespace.json is written) are
    # removed at open, never written through, and the tier works.
    (ns / "blocks.dat").unlink()
    (ns / "tmp" / f"namespace.json.{os.getpid()}").symlink_to(secret)
    (ns / "tmp" / f"direct-probe.{os.getpid()}").symlink_to(secret)
    async with open_engine(root, cpu_rows=4) as (engine, kv):
        keys = chain_keys(
            list(range(2 * engine.block_tokens)), engine.block_tokens, engine.namespace
        )
        write_blocks(kv, keys, list(range(2 * BPC)))
        await engine.store(keys, list(range(2 * BPC)))
        await engine.flush()
        assert secret.read_bytes() == before
        # Push both blocks out of the CPU tier, then load from the file tier.
        others = chain_keys(
            list(range(10**6, 10**6 + 8 * engine.block_tokens)),
            engine.block_tokens,
            engine.namespace,
        )
        for k in others:
            write_blocks(kv, [k], [0, 1])
            await engine.store([k], [0, 1])
        await engine.flush()
        assert await verify_everything(engine, kv, set(keys)) == 0
    assert secret.read_bytes() == before
    assert not list((ns / "tmp").iterdir())


async def test_keys_never_name_paths_outside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    async with open_engine(root) as (engine, kv):
        # Keys are opaque 16-byte digests; even bytes that spell a path are hex-named.
        evil = [b"../../etc/passwd", b"/" * 16, b"\x00" * 16]
        write_blocks(kv, evil, list(range(3 * BPC)))
        await engine.store(evil, list(range(3 * BPC)))
        await engine.flush()
        assert await verify_everything(engine, kv, set(evil)) == 0
    # No key ever becomes a path: the namespace holds exactly its fixed entries.
    (ns,) = [p for p in root.iterdir() if p.is_dir()]
    assert {p.name for p in ns.iterdir()} == {
        "namespace.json",
        "lock",
        "blocks.dat",
        "index",
        "tmp",
        "quarantine",
    }
    assert set(block_offsets(ns)) == set(evil)
    for p in root.rglob("*"):
        assert p.resolve().is_relative_to(root.resolve())


async def test_a_block_stored_under_one_layout_never_loads_under_another(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    tokens = list(range(4 * 8))
    async with open_engine(root) as (engine, kv):
        keys = chain_keys(tokens, engine.block_tokens, engine.namespace)
        write_blocks(kv, keys, list(range(4 * BPC)))
        await engine.store(keys, list(range(4 * BPC)))
        await engine.flush()
        first_namespace = engine.namespace
    other_kv = make_kv()
    other = make_layout(other_kv, model="another-model")
    assert other.namespace != first_namespace
    from kvtier import FileTierConfig, KVTierConfig
    from kvtier.engine import Engine

    config = KVTierConfig(
        cpu_bytes_to_use=16 * 8192,
        blocks_per_chunk=BPC,
        file_tier=FileTierConfig(root=root, bytes_to_use="8MiB"),
    )
    async with await Engine.open(config, other, other_kv) as engine:
        # The same tokens make other keys under the other namespace: nothing hits.
        assert engine.lookup(chain_keys(tokens, engine.block_tokens, engine.namespace)) == 0
        # Even the first engine's raw keys do not hit: they live in its directory.
        assert engine.lookup(keys) == 0
