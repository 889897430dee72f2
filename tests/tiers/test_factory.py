"""The one tier factory (kvtier.tiers.factory): the chain opened in order, closed in reverse."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import pytest

from kvtier.config import ClusterTierConfig, FileTierConfig, KVTierConfig
from kvtier.errors import InvalidArgumentError, KVTierError
from kvtier.layout import KVLayout, TensorSpec
from kvtier.region import CPURegion
from kvtier.tiers.base import Tier
from kvtier.tiers.factory import aclose_tiers, open_tiers
from kvtier.tiers.file import FileTier

ROW = 4096
ROWS = 4


def layout() -> KVLayout:
    page = TensorSpec("page", (1, ROW), "int8", 1, False)
    return KVLayout(tensors=(page,), model_id="factory-test", block_tokens=16)


def file_config(root: Path) -> FileTierConfig:
    return FileTierConfig(root=root, bytes_to_use="4MiB", queue_depth=4)


async def test_the_file_tier_opens_with_the_region_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lay = layout()
    region = CPURegion.create(lay, ROWS * ROW, alignment=4096)
    registered: list[int] = []
    register = FileTier.register_memory

    def spy(self: FileTier, buffers: list[memoryview]) -> int:
        registered.extend(memoryview(b).nbytes for b in buffers)
        return register(self, buffers)

    monkeypatch.setattr(FileTier, "register_memory", spy)
    config = KVTierConfig(cpu_bytes_to_use=ROWS * ROW, file_tier=file_config(tmp_path))
    try:
        tiers = await open_tiers(config, lay, region)
        try:
            (tier,) = tiers
            assert isinstance(tier, FileTier)
            assert registered == [region.buffer().nbytes]
        finally:
            await aclose_tiers(tiers, ["file"])
    finally:
        region.close()


async def test_a_tier_that_fails_to_open_closes_those_opened_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lay = layout()
    region = CPURegion.create(lay, ROWS * ROW, alignment=4096)
    closed: list[str] = []
    aclose = FileTier.aclose

    async def spy(self: FileTier) -> None:
        closed.append("file")
        await aclose(self)

    monkeypatch.setattr(FileTier, "aclose", spy)
    # Nothing listens on port 1: the cluster tier's open is refused at once.
    cluster = ClusterTierConfig(
        nodes=("127.0.0.1:1",), mode="single", require_at_open=True, connect_timeout_s=1.0
    )
    config = KVTierConfig(
        cpu_bytes_to_use=ROWS * ROW, file_tier=file_config(tmp_path), cluster_tier=cluster
    )
    try:
        with pytest.raises(KVTierError):
            await open_tiers(config, lay, region)
        assert closed == ["file"]
        # The file tier released its root: it opens again.
        again = KVTierConfig(cpu_bytes_to_use=ROWS * ROW, file_tier=file_config(tmp_path))
        tiers = await open_tiers(again, lay, region)
        await aclose_tiers(tiers, ["file"])
    finally:
        region.close()


class _Fake:
    def __init__(self, name: str, closed: list[str], *, fails: bool = False) -> None:
        self.name, self.closed, self.fails = name, closed, fails

    async def aclose(self) -> None:
        self.closed.append(self.name)
        if self.fails:
            raise OSError(f"{self.name} would not close")


async def test_tiers_close_lowest_first_and_a_failure_stops_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed: list[str] = []
    tiers = [_Fake("file", closed), _Fake("cluster", closed, fails=True)]
    with caplog.at_level(logging.ERROR, logger="kvtier.tiers"):
        await aclose_tiers(cast("list[Tier]", tiers), ["file", "cluster"])
    assert closed == ["cluster", "file"]
    (record,) = caplog.records
    assert record.getMessage() == "closing the cluster tier failed"
    assert record.exc_info is not None


async def test_closing_needs_a_name_per_tier() -> None:
    closed: list[str] = []
    with pytest.raises(InvalidArgumentError, match="1 tiers but 2 names"):
        await aclose_tiers(cast("list[Tier]", [_Fake("file", closed)]), ["file", "cluster"])
    assert closed == []
