"""The host tier as a tier of the chain: the Tier contract, and Engines sharing one host tier."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from support.processes import Children

from kvtier import Engine, KVLayout, KVTierConfig, chain_keys
from kvtier.config import FileTierConfig, HostTierConfig
from kvtier.errors import ConfigurationError, InvalidArgumentError
from kvtier.layout import TensorSpec
from kvtier.testing.tier import OpenTier, TierSuite
from kvtier.tiers.base import Tier, Watched
from kvtier.tiers.host import ChainedHostTier, Geometry, HostTier, segment_path

BLOCK = 8192


def _layout(model: str) -> KVLayout:
    spec = TensorSpec(name="kv", shape=(8, 2048), dtype="float16", itemsize=2, kv_first=False)
    return KVLayout(tensors=(spec,), model_id=model, block_tokens=16)


def _left_behind(paths: list[str]) -> list[str]:
    """The segments of ``paths`` still there, removed (so that one failure stays one)."""
    left = [p for p in paths if os.path.exists(p)]
    for p in left:
        os.unlink(p)
    return left


def test_the_chained_host_tier_implements_the_contract() -> None:
    assert issubclass(ChainedHostTier, Tier)
    assert not ChainedHostTier.__abstractmethods__


class TestChainedHostTier(TierSuite):
    block_bytes = BLOCK

    @pytest_asyncio.fixture
    async def open_tier(self) -> AsyncIterator[OpenTier]:
        opened: list[ChainedHostTier] = []
        paths: list[str] = []

        async def _open() -> Tier:
            layout = _layout(uuid.uuid4().hex)  # a namespace, so a segment, per tier
            config = HostTierConfig(
                bytes_to_use=32 * (4096 + BLOCK), instances=1, orphan_grace_s=None
            )
            tier = await ChainedHostTier.open(config, layout, block_bytes=BLOCK)
            opened.append(tier)
            paths.append(tier.host.path)
            assert isinstance(tier, Watched)
            return tier

        yield _open
        for tier in opened:
            await tier.aclose()
        left = _left_behind(paths)
        assert not left, f"segments left behind: {left}"

    async def damage(self, tier: Tier, key: bytes) -> None:
        assert isinstance(tier, ChainedHostTier)
        at = tier.host.payload_offset(key)
        assert at is not None
        fd = os.open(tier.host.path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, at + 7)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), at + 7)
        finally:
            os.close(fd)

    def verification_failures(self, stats: Any) -> int:
        return int(stats.integrity_failures)


# -- Engines on one host tier ------------------------------------------------------------

NUM_BLOCKS = 32
Tensors = list[torch.Tensor]


def _kv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, 4, 2, 16, generator=g).to(torch.float16) for _ in range(2)]


def _config(tmp_path: Path, model: str, *, host_rows: int = 64, file: bool = False) -> KVTierConfig:
    layout = KVLayout.from_tensors(_kv(0), model_id=model, block_tokens=4, num_blocks=NUM_BLOCKS)
    row = -(-layout.bytes_per_chunk // 4096) * 4096
    return KVTierConfig(
        cpu_bytes_to_use=8 * row,
        host_tier=HostTierConfig(bytes_to_use=Geometry.budget_for(row, host_rows, 2), instances=2),
        file_tier=(
            FileTierConfig(root=tmp_path / "file", bytes_to_use=64 * (row + 4096) + 4096)
            if file
            else None
        ),
    )


@pytest_asyncio.fixture
async def two_engines(tmp_path: Path) -> AsyncIterator[tuple[Engine, Engine, list[Tensors]]]:
    model = uuid.uuid4().hex
    config = _config(tmp_path, model)
    kv_a, kv_b = _kv(1), _kv(2)
    layout = KVLayout.from_tensors(kv_a, model_id=model, block_tokens=4, num_blocks=NUM_BLOCKS)
    a = await Engine.open(config, layout, kv_a)
    b = await Engine.open(config, layout, kv_b)
    path = segment_path(layout.namespace)
    try:
        yield a, b, [kv_a, kv_b]
    finally:
        await a.aclose()
        await b.aclose()
    assert not _left_behind([path]), "the last engine's close left the host segment"


def _keys(engine: Engine, n: int, salt: int) -> list[bytes]:
    tokens = [salt * 100_000 + i for i in range(n * engine.block_tokens)]
    return chain_keys(tokens, engine.block_tokens, engine.namespace)


async def test_an_engine_loads_what_another_stored_byte_for_byte(
    two_engines: tuple[Engine, Engine, list[Tensors]],
) -> None:
    a, b, (kv_a, kv_b) = two_engines
    keys = _keys(a, 8, salt=1)
    await a.store(keys, list(range(8)))
    await a.flush()  # written through to the host tier
    # B picks A's blocks up within peer_poll_s; refresh picks them up now.
    assert await b.refresh(keys) == 8
    assert await b.load(keys, list(range(10, 18))) == 8
    for i in range(8):
        for ta, tb in zip(kv_a, kv_b, strict=True):
            assert torch.equal(ta[:, i], tb[:, 10 + i]), f"block {i} differs"
    host = b.statistics().tiers["host"]
    assert host.statistics.peer_hits == 8
    assert host.statistics.own_hits == 0
    # A stored each block once; B stored none and holds none.
    assert a.statistics().tiers["host"].statistics.stores == 8


async def test_a_block_the_host_holds_is_not_stored_twice(
    two_engines: tuple[Engine, Engine, list[Tensors]],
) -> None:
    a, b, _ = two_engines
    keys = _keys(a, 4, salt=2)
    await a.store(keys, [0, 1, 2, 3])
    await a.flush()
    await b.store(keys, [4, 5, 6, 7])  # B computed the same blocks
    await b.flush()
    # B's chain knows the host holds them (or the host skips them): no second copy.
    sb = b.statistics().tiers["host"].statistics
    assert sb.stores == 0
    assert sb.own_blocks == 0
    assert a.statistics().tiers["host"].statistics.own_blocks == 4


async def test_an_instance_with_another_budget_is_refused_naming_both(tmp_path: Path) -> None:
    model = uuid.uuid4().hex
    kv = _kv(1)
    layout = KVLayout.from_tensors(kv, model_id=model, block_tokens=4, num_blocks=NUM_BLOCKS)
    a = await Engine.open(_config(tmp_path, model, host_rows=64), layout, kv)
    try:
        other = _config(tmp_path, model, host_rows=32)
        with pytest.raises(ConfigurationError) as err:
            await Engine.open(other, layout, _kv(2))
        mine = _config(tmp_path, model, host_rows=64).host_tier
        assert mine is not None
        assert other.host_tier is not None
        assert str(mine.bytes_to_use) in str(err.value)
        assert str(other.host_tier.bytes_to_use) in str(err.value)
    finally:
        await a.aclose()


# -- Engine processes on one host tier -----------------------------------------------------

ENGINE_SCRIPT = str(Path(__file__).with_name("_engine_instance.py"))


def _start(children: Children, model: str, instances: int, rows: int) -> subprocess.Popen[str]:
    proc = children.spawn(ENGINE_SCRIPT, model, instances, rows)
    hello = children.line(proc)
    assert "slot" in hello, hello
    return proc


def _ask(children: Children, proc: subprocess.Popen[str], **cmd: object) -> dict[str, Any]:
    children.tell(proc, json.dumps(cmd))
    return children.line(proc)


@pytest.mark.parametrize("count", [2, 4])
def test_engine_processes_load_each_others_blocks_byte_for_byte(
    children: Children, count: int
) -> None:
    model = uuid.uuid4().hex
    procs = [_start(children, model, count, 16 * count) for _ in range(count)]
    for i, p in enumerate(procs):
        assert _ask(children, p, op="store", salt=i + 1, n=8) == {"stored": 8}
    for i, p in enumerate(procs):
        for j in range(count):
            if j != i:
                got = _ask(children, p, op="load", salt=j + 1, n=8)
                assert got == {"loaded": 8, "wrong": 0}, (i, j, got)
    for p in procs:
        st = _ask(children, p, op="stats")
        assert st["peer_hits"] == 8 * (count - 1)
        assert st["own_blocks"] == 8  # each block once on the host
        assert sum(st["rows_held"]) <= st["rows"]
    for p in procs:
        assert _ask(children, p, op="close") == {"closed": True}


def test_an_engine_killed_mid_store_serves_no_wrong_bytes_and_its_rows_are_adopted(
    children: Children,
) -> None:
    model = uuid.uuid4().hex
    reader = _start(children, model, 2, 32)
    writer = _start(children, model, 2, 32)
    assert _ask(children, writer, op="store", salt=1, n=8) == {"stored": 8}
    # The writer stores salt after salt, evicting its own rows; it is killed
    # at a seeded moment, in a store or between two.
    rng = random.Random(44)
    children.tell(writer, json.dumps({"op": "storm", "first_salt": 10, "count": 10**6, "n": 8}))
    for _ in range(rng.randrange(1, 12)):
        assert "storing" in children.line(writer)
    time.sleep(rng.random() * 0.01)
    writer.kill()
    writer.wait()
    # Whatever the dead writer's rows hold: a verified block or a miss.
    loaded = 0
    for salt in [1, *range(10, 22)]:
        got = _ask(children, reader, op="load", salt=salt, n=8)
        assert got["wrong"] == 0, (salt, got)
        loaded += got["loaded"]
    assert loaded > 0  # the dead writer's last blocks are served
    st = _ask(children, reader, op="stats")
    assert sum(st["rows_held"]) <= st["rows"]
    # A restarted instance adopts the dead one's rows, and serves what they hold.
    again = _start(children, model, 2, 32)
    st = _ask(children, again, op="stats")
    assert st["rows_adopted"] > 0
    got = _ask(children, again, op="load", salt=21, n=8)
    assert got["wrong"] == 0
    for p in (reader, again):
        assert _ask(children, p, op="close") == {"closed": True}


def test_gc_lists_and_removes_a_host_segment_every_instance_left(
    children: Children, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier.cli import main

    model = uuid.uuid4().hex
    p = _start(children, model, 2, 16)
    st = _ask(children, p, op="stats")
    p.kill()
    p.wait()
    assert main(["gc", "--shm", "--dry-run", "--json"]) == 0
    assert st["path"] in json.loads(capsys.readouterr().out)["host_segments"]
    assert os.path.exists(st["path"])
    assert main(["gc", "--shm"]) == 0
    assert st["path"] in capsys.readouterr().out
    assert not os.path.exists(st["path"])


# -- configuration -----------------------------------------------------------------------------

DOC = Path(__file__).resolve().parents[3] / "docs" / "host-tier.md"


def test_the_documented_configuration_is_what_it_says(tmp_path: Path) -> None:
    text = DOC.read_text()
    block = text.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "kvtier.toml").write_text(block)
    config = KVTierConfig.from_toml(tmp_path / "kvtier.toml")
    assert config.host_tier is not None
    assert config.host_tier.bytes_to_use == 192 << 30
    assert config.host_tier.instances == 8
    assert [name for name, _ in config.chain] == ["host"]


def test_vllm_takes_the_host_tier_key() -> None:
    from kvtier.integrations.vllm.settings import parse_extra_config

    extra = {
        "cpu_bytes_to_use": "8GiB",
        "host_tier": {"bytes_to_use": "192GiB", "instances": 8},
        "file_tier": {"root": "/tmp/kv", "bytes_to_use": "1GiB"},
    }
    config = parse_extra_config(extra).config
    assert [name for name, _ in config.chain] == ["host", "file"]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("instances", 0, "instances"),
        ("bytes_to_use", "0", "bytes_to_use"),
        ("directory", "/no/such/dir", "directory"),
        ("orphan_grace_s", 0, "orphan_grace_s"),
        ("write_policy", "write_back", "write_policy"),
        ("peer_poll_s", 0.0, "peer_poll_s"),
    ],
)
def test_a_bad_host_tier_field_is_named(field: str, value: object, says: str) -> None:
    data: dict[str, object] = {"bytes_to_use": "1GiB", field: value}
    with pytest.raises(ConfigurationError, match=says):
        KVTierConfig.from_dict({"cpu_bytes_to_use": "1GiB", "host_tier": data})


def test_inspect_shm_reads_a_segment_without_joining_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from kvtier.cli import main

    ns = uuid.uuid4().bytes
    # A directory of its own: whatever else sits in /dev/shm is not this test's.
    budget = Geometry.budget_for(BLOCK, 32, 2)  # 32 rows beside the tables
    with HostTier.open(ns, BLOCK, budget, 2, directory=str(tmp_path)) as a:
        assert (
            a.store_many([bytes([i + 1]) * 16 for i in range(5)], [memoryview(bytes(BLOCK))] * 5)
            == [True] * 5
        )
        assert main(["inspect", "--shm", str(tmp_path), "--json"]) == 0
        survey = json.loads(capsys.readouterr().out)
        assert survey["damaged"] == []
        (mine,) = [r for r in survey["segments"] if r["namespace"] == ns.hex()]
        assert mine["live_instances"] == 1
        assert mine["blocks"] == 5
        assert mine["rows_held"][a.slot] == 16
        assert mine["rows"] == 32
        assert a.statistics().live_instances == 1  # the inspection took no slot
        assert main(["inspect", "--shm", str(tmp_path)]) == 0
        assert ns.hex() in capsys.readouterr().out
        # The all-zero key marks an empty row: refused, nothing stored lost.
        with pytest.raises(InvalidArgumentError, match="all-zero key"):
            a.store_many([bytes(16)], [memoryview(bytes(BLOCK))])
        assert a.statistics().own_blocks == 5


async def test_a_block_read_from_the_file_tier_goes_up_to_the_host_tier(tmp_path: Path) -> None:
    model = uuid.uuid4().hex
    kv = _kv(1)
    layout = KVLayout.from_tensors(kv, model_id=model, block_tokens=4, num_blocks=NUM_BLOCKS)
    # 8 host rows for 2 instances: this one owns 4, the file tier holds everything.
    config = _config(tmp_path, model, host_rows=8, file=True)
    engine = await Engine.open(config, layout, kv)
    try:
        old = _keys(engine, 4, salt=1)
        await engine.store(old, [0, 1, 2, 3])
        await engine.flush()
        for salt in (2, 3, 4):  # out of the CPU tier (8 rows) and the host rows (4)
            await engine.store(_keys(engine, 4, salt), [4, 5, 6, 7])
            await engine.flush()
        host = engine.statistics().tiers["host"].statistics
        assert engine.lookup(old) == 4
        assert await engine.load(old, [10, 11, 12, 13]) == 4
        await engine.flush()
        after = engine.statistics()
        assert after.tiers["file"].statistics.hits >= 4  # read from the file tier
        # ... and written up to the host tier, where the other instances find it.
        assert after.tiers["host"].statistics.stores == host.stores + 4
    finally:
        await engine.aclose()
