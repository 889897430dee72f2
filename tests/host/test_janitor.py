"""The host segment's janitor: a segment whose instances were all killed goes after its grace."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from support.processes import Children

from kvtier.tiers.host import HostTier, segment_path

from .conftest import ROW_BYTES, budget
from .test_host_tier import SCRIPT, hello, keys, kill, loads_exactly, store


def _janitors(path: str) -> list[int]:
    """Pids of the processes watching ``path`` as its janitor."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-m" in argv and b"kvtier.tiers.host._janitor" in argv and path.encode() in argv:
            out.append(int(pid))
    return out


def _until(what: str, check: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not {what} after {timeout} s"
        time.sleep(0.1)


def _instance(children: Children, ns: bytes, grace: float) -> subprocess.Popen[str]:
    proc = children.spawn(SCRIPT, ns.hex(), ROW_BYTES, budget(8), 2, 5.0, grace)
    hello(children, proc)
    return proc


def test_a_segment_every_instance_of_which_was_killed_is_removed_after_its_grace(
    namespace: bytes, children: Children
) -> None:
    path = segment_path(namespace)
    a = _instance(children, namespace, 0.5)
    b = _instance(children, namespace, 0.5)
    _until("watched", lambda: len(_janitors(path)) == 1)  # one janitor for both
    time.sleep(1.5)  # past the grace, with instances live: kept
    assert os.path.exists(path)
    kill(a)
    kill(b)
    _until("removed", lambda: not os.path.exists(path))
    _until("the janitor gone", lambda: not _janitors(path))


def test_an_instance_restarting_within_the_grace_adopts_and_its_close_removes(
    namespace: bytes, children: Children
) -> None:
    path = segment_path(namespace)
    a = _instance(children, namespace, 60.0)
    _until("watched", lambda: len(_janitors(path)) == 1)
    ks = keys(3, 1)
    children.tell(a, json.dumps({"op": "store", "keys": [k.hex() for k in ks]}))
    assert children.line(a)["stored"] == [True] * 3
    kill(a)
    with HostTier.open(namespace, ROW_BYTES, budget(8), 2, orphan_grace_s=60.0) as again:
        assert again.statistics().rows_adopted == 4
        assert all(loads_exactly(again, k) for k in ks)
        assert store(again, keys(1, 2)) == [True]
        # One janitor watches it (a second one started before the first took
        # the janitor lock finds it taken, and exits).
        _until("one janitor", lambda: len(_janitors(path)) == 1)
    assert not os.path.exists(path)
    _until("the janitor gone", lambda: not _janitors(path))
