"""``kvtier inspect --shm`` and ``gc --shm`` against what anyone can plant under the prefix.

Each test works in a directory of its own (``--shm DIR``), so that what other
tests and users keep in ``/dev/shm`` is neither read nor removed; the commands
run as child processes with a timeout, so that one that blocks fails instead
of hanging the suite.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.shm import set_lock
from kvtier.tiers.host import HostTier, segment_path
from kvtier.tiers.host._layout import FILE_PREFIX, SLOT_LOCK_BASE

from .conftest import ROW_BYTES, budget

NOBODY = 65534


def _name() -> str:
    return FILE_PREFIX + uuid.uuid4().hex


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``kvtier ARGS`` in a child process; a command that blocks fails the test."""
    return subprocess.run(
        [sys.executable, "-m", "kvtier", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _json(*args: str) -> tuple[int, Any]:
    done = _kvtier(*args, "--json")
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    """A directory of the test's own, private as kvtier wants one."""
    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def live(shm: Path) -> Iterator[HostTier]:
    """A sound segment with a live instance in ``shm``."""
    with HostTier.open(uuid.uuid4().bytes, ROW_BYTES, budget(8), 1, directory=str(shm)) as tier:
        yield tier


def _left(shm: Path) -> Path:
    """A real segment that nobody holds."""
    ns = uuid.uuid4().bytes
    path = Path(segment_path(ns, str(shm)))
    keep = shm / "keep"
    with HostTier.open(ns, ROW_BYTES, budget(8), 1, directory=str(shm)):
        os.link(path, keep)  # the close removes the name, not this link
    os.rename(keep, path)
    return path


def _truncated(shm: Path) -> Path:
    """A real segment that nobody holds, cut to two pages."""
    path = _left(shm)
    os.truncate(path, 8192)
    return path


def _file(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_a_fifo_under_the_prefix_blocks_neither_inspect_nor_gc(shm: Path) -> None:
    fifo = shm / _name()
    os.mkfifo(fifo, 0o600)
    # The library call (what the command runs) returns at once: no writer is waited for.
    look = "import sys; from kvtier.tiers.host import inspect_host_segments as f; f(sys.argv[1])"
    subprocess.run([sys.executable, "-c", look, str(shm)], check=True, timeout=60)
    status, survey = _json("inspect", "--shm", str(shm))
    assert status == 1
    assert survey["segments"] == []
    (entry,) = survey["damaged"]
    assert entry["path"] == str(fifo)
    assert entry["problem"] == "not a regular file (a FIFO)"
    assert entry["removable"]
    assert _kvtier("gc", "--shm", str(shm)).returncode == 0
    assert not fifo.exists()
    assert _json("inspect", "--shm", str(shm)) == (
        0,
        {"directory": str(shm), "segments": [], "damaged": []},
    )


def test_inspect_lists_each_damaged_entry_and_gc_removes_only_this_users(
    shm: Path, live: HostTier
) -> None:
    target = _file(shm / "target", b"not to be touched")
    link = shm / _name()
    link.symlink_to(target)
    truncated = _truncated(shm)
    garbage = _file(shm / _name(), os.urandom(8192))
    short = _file(shm / _name(), b"KVTHOST1")
    loose = _file(shm / _name(), os.urandom(8192), 0o644)
    held = _file(shm / _name(), os.urandom(8192))
    # A live instance's slot lock on a damaged file: gc must wait for it to go.
    holder = os.open(held, os.O_RDWR)
    assert set_lock(holder, fcntl.F_WRLCK, SLOT_LOCK_BASE)
    try:
        expect = {
            str(link): "not a regular file (a symbolic link)",
            str(truncated): "truncated: 8192 bytes, its header says ",
            str(garbage): "not a kvtier host segment (no kvtier header)",
            str(short): "too short for a host segment's header (8 bytes)",
            str(loose): "mode 0644: other users could have written it",
            str(held): "not a kvtier host segment (no kvtier header)",
        }
        status, survey = _json("inspect", "--shm", str(shm))
        assert status == 1
        assert [s["path"] for s in survey["segments"]] == [live.path]
        found = {d["path"]: d for d in survey["damaged"]}
        assert sorted(found) == sorted(expect)
        for path, problem in expect.items():
            assert found[path]["problem"].startswith(problem), found[path]
            assert found[path]["removable"] == (path != str(held))
        text = _kvtier("inspect", "--shm", str(shm))
        assert text.returncode == 1
        for path in expect:
            assert f"damaged {path}: " in text.stdout

        status, dry = _json("gc", "--shm", str(shm), "--dry-run")
        assert status == 0
        assert sorted(d["path"] for d in dry["damaged"]) == sorted(set(expect) - {str(held)})
        assert all(os.path.lexists(p) for p in expect)
        status, done = _json("gc", "--shm", str(shm))
        assert status == 0
        assert sorted(d["path"] for d in done["damaged"]) == sorted(set(expect) - {str(held)})
        assert sorted(os.listdir(shm)) == sorted([Path(live.path).name, held.name, target.name])
        assert target.read_bytes() == b"not to be touched"  # the link went, not its target
    finally:
        os.close(holder)
    # Its holder gone, the damaged file goes too; the live segment stays.
    assert _json("gc", "--shm", str(shm))[1]["damaged"][0]["path"] == str(held)
    assert sorted(os.listdir(shm)) == sorted([Path(live.path).name, target.name])
    assert _json("inspect", "--shm", str(shm))[0] == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's files takes root")
def test_another_users_entries_are_listed_and_never_removed(shm: Path) -> None:
    shm.chmod(0o1777)  # a sticky directory anyone writes, as /dev/shm
    theirs = _file(shm / _name(), os.urandom(8192))
    fifo = shm / _name()
    os.mkfifo(fifo, 0o600)
    # A sound segment, made by this user and then given away: never read either.
    segment = _left(shm)
    for p in (theirs, fifo, segment):
        os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
    status, survey = _json("inspect", "--shm", str(shm))
    assert status == 1
    found = {d["path"]: d for d in survey["damaged"]}
    assert found[str(fifo)]["problem"] == "not a regular file (a FIFO)"
    for p in (theirs, segment):
        assert found[str(p)]["problem"].startswith(f"another user's file (owner {NOBODY}")
    assert {d["owner_uid"] for d in found.values()} == {NOBODY}
    assert not any(d["removable"] for d in found.values())
    status, done = _json("gc", "--shm", str(shm))
    assert (status, done["damaged"], done["host_segments"]) == (0, [], [])
    assert sorted(os.listdir(shm)) == sorted(p.name for p in (theirs, fifo, segment))
