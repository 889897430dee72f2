"""The ``kvtier`` command: every subcommand runs for real, errors are one line."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.config import FileTierConfig
from kvtier.keys import chain_keys
from kvtier.layout import KVLayout, TensorSpec
from kvtier.testing.io_engine import aligned_buffer
from kvtier.tiers.file_tier import FileTier

BLOCK = 16384


def _layout(model: str = "cli-test") -> KVLayout:
    spec = TensorSpec("kv", (64, BLOCK), "uint8", 1, kv_first=False)
    return KVLayout((spec,), model_id=model, block_tokens=16)


def _fill(root: Path, blocks: int, model: str = "cli-test") -> list[Path]:
    """Store ``blocks`` blocks of known bytes under ``root``; return their files."""

    async def go() -> list[bytes]:
        layout = _layout(model)
        tier = await FileTier.open(
            FileTierConfig(root=root, bytes_to_use=16 << 20), layout, block_bytes=BLOCK
        )
        try:
            keys = chain_keys(list(range(16 * blocks)), 16, layout.namespace)
            bufs = [aligned_buffer(BLOCK) for _ in keys]
            for i, b in enumerate(bufs):
                b[:] = bytes([i % 251]) * BLOCK
            result = await tier.store(keys, [memoryview(b) for b in bufs])
            assert len(result.stored) == blocks
            return keys
        finally:
            await tier.aclose()

    keys = asyncio.run(go())
    ns = _layout(model).namespace.hex()
    return [root / ns / "blocks" / f"{k[0]:02x}" / k.hex() for k in keys]


@pytest.mark.parametrize("command", [[], ["demo"], ["bench"], ["inspect"]], ids=str)
def test_help_exits_zero(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    assert "usage: kvtier" in capsys.readouterr().out


def test_inspect_counts_blocks_and_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _fill(tmp_path, 5)
    assert main(["inspect", str(tmp_path), "--verify", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["blocks"] == 5
    assert report["verified"] == 5
    assert report["bytes"] == sum(f.stat().st_size for f in files)
    assert report["model_id"] == "cli-test"
    assert report["bad"] == []


def test_inspect_verify_names_a_corrupted_file_and_exits_nonzero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _fill(tmp_path, 3)
    with open(files[1], "r+b") as fh:
        fh.seek(4096 + 100)
        byte = fh.read(1)
        fh.seek(4096 + 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert main(["inspect", str(tmp_path), "--verify", "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["verified"] == 2
    assert report["bad"] == [{"path": str(files[1]), "reason": "payload checksum mismatch"}]
    assert main(["inspect", str(tmp_path), "--verify"]) == 1  # the table says it too
    assert "bad" in capsys.readouterr().out


def test_inspect_lists_each_namespace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(tmp_path, 2, model="model-a")
    _fill(tmp_path, 3, model="model-b")
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert sorted((r["model_id"], r["blocks"]) for r in reports) == [("model-a", 2), ("model-b", 3)]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["inspect", "/nonexistent/kvtier-root"], "does not exist"),
        (["inspect", "/etc/hostname"], "not a directory"),
        (["bench", "--block-size", "1000"], "multiples of 4096"),
        (["bench", "--queue-depth", "0"], "must be positive"),
    ],
    ids=["missing-root", "root-is-file", "unaligned-block", "zero-depth"],
)
def test_errors_are_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ")
    assert needle in err
    assert err.count("\n") == 1


def test_bad_size_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--total", "lots"])
    assert info.value.code == 2
    assert "not a byte size" in capsys.readouterr().err


def test_bench_measures_every_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "bench",
        "--block-size",
        "64KiB",
        "--queue-depth",
        "2",
        "--total",
        "2MiB",
        "--repeat",
        "1",
        "--no-fio",
        "--json",
        "--dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["block_bytes"] == 65536
    assert row["queue_depth"] == 2
    for field in ("memcpy", "device_to_cpu", "cpu_to_device", "cpu_to_file", "file_to_cpu"):
        assert row[field] > 0, field
    assert row["fio_write"] is None
    assert list(tmp_path.iterdir()) == []  # the bench cleans up after itself


def test_demo_runs_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--conversations", "6", "--turns", "2", "--root", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hit rate, CPU tier" in out
    assert "0 wrong" in out
