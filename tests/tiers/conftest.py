"""Fixtures shared by the file tier's tests: small real filesystems."""

from __future__ import annotations

import errno
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

Mount = Callable[[int], Path]


def _mounted(tmp_path: Path, kind: str) -> Iterator[Mount]:
    """Mount ``kind`` filesystems of a given size under ``tmp_path``; unmount them after."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        mnt = tmp_path / f"{kind}-{len(mounted)}"
        mnt.mkdir()
        tool = shutil.which("mount")
        if kind == "tmpfs":
            argv = ["-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)]
        else:
            # ext4 with no reserved blocks, on a loop device over a sparse image.
            image = tmp_path / f"{mnt.name}.img"
            with open(image, "wb") as fh:
                fh.truncate(size)
            mkfs = shutil.which("mkfs.ext4") or "mkfs.ext4"
            made = subprocess.run(
                [mkfs, "-q", "-F", "-m", "0", str(image)], capture_output=True, check=False
            )
            if made.returncode != 0:
                pytest.skip(f"cannot make an ext4 image here: {made.stderr!r}")
            argv = ["-o", "loop", str(image), str(mnt)]
        proc = subprocess.run([tool or "mount", *argv], capture_output=True, check=False)
        if tool is None or proc.returncode != 0:
            pytest.skip(
                f"cannot mount a {size}-byte {kind} here (needs CAP_SYS_ADMIN"
                f"{' and loop devices' if kind == 'ext4' else ''}): {proc.stderr!r}"
            )
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Mount]:
    """Mount tmpfs filesystems of a given size; skips, saying why, where mounting is refused."""
    yield from _mounted(tmp_path, "tmpfs")


@pytest.fixture
def mount_ext4(tmp_path: Path) -> Iterator[Mount]:
    """Mount loop ext4 filesystems of a given size; skips, saying why, where it cannot.

    ext4, unlike tmpfs, keeps what a failed ``fallocate`` allocated: the
    filesystem the issue was seen on.
    """
    yield from _mounted(tmp_path, "ext4")


@pytest.fixture
def small_fs(mount_tmpfs: Mount) -> Path:
    """A 256 KiB tmpfs, smaller than some budgets."""
    return mount_tmpfs(256 << 10)


@pytest.fixture
def fill_filesystem() -> Callable[[Path], int]:
    """A function writing a file until its filesystem is full; it returns the bytes written."""
    return _fill


def _fill(path: Path) -> int:
    chunk = b"f" * 4096
    total = 0
    code = 0
    with open(path, "wb", buffering=0) as fh:
        while not code:
            try:
                total += fh.write(chunk) or 0
            except OSError as exc:
                code = exc.errno or -1
    assert code == errno.ENOSPC
    return total
