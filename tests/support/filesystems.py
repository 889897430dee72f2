"""Real filesystems with particular behaviour, for tests.

:func:`refusing_direct_io_dir` finds (or mounts) a directory whose filesystem
refuses ``O_DIRECT``, so that the refusal path runs against the kernel rather
than a mock.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["refuses_direct_io", "refusing_direct_io_dir"]


def refuses_direct_io(directory: str | os.PathLike[str]) -> bool:
    """Whether creating a file with ``O_DIRECT`` in ``directory`` fails."""
    probe = os.path.join(directory, f"kvtier-direct-probe-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(probe)
        return True
    os.close(fd)
    os.unlink(probe)
    return False


@contextlib.contextmanager
def refusing_direct_io_dir(scratch: Path) -> Iterator[Path]:
    """A path (not yet created) on a filesystem that refuses ``O_DIRECT``.

    /dev/shm where its tmpfs refuses (before Linux 6.6); otherwise a ramfs,
    which never supports ``O_DIRECT``, mounted under ``scratch`` for the
    duration (needs ``CAP_SYS_ADMIN``). Skips the test when neither is possible,
    saying what is missing.
    """
    if os.path.isdir("/dev/shm") and refuses_direct_io("/dev/shm"):
        root = Path(f"/dev/shm/kvtier-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            yield root
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    mnt = scratch / f"ramfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    mount = shutil.which("mount")
    done = subprocess.run(
        [mount or "mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True, check=False
    )
    if mount is None or done.returncode != 0:
        pytest.skip(
            "no filesystem refusing O_DIRECT: /dev/shm accepts it (tmpfs does since Linux "
            "6.6) and a ramfs cannot be mounted here (needs CAP_SYS_ADMIN)"
        )
    try:
        yield mnt / "tier"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)
