"""The host segment's janitor: a segment whose instances were all killed goes after its grace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.processes import Children

from kvtier.tiers.host import HostTier, segment_path

from .conftest import ROW_BYTES, budget
from .test_host_tier import SCRIPT, hello, keys, kill, loads_exactly, store


def _janitors(path: str) -> list[int]:
    """Pids of the processes watching ``path`` as its janitor.

    A janitor's command line names its module and the segment; so does the
    short-lived process that starts it, whose command line carries the
    janitor's whole (its interpreter a second time): that one is not counted.
    """
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"kvtier.tiers.host._janitor" in argv
            and path.encode() in argv
            and argv.count(argv[0]) == 1
        ):
            out.append(int(pid))
    return out


def _until(what: str, check: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not {what} after {timeout} s"
        time.sleep(0.1)


def _instance(children: Children, ns: bytes, grace: float) -> subprocess.Popen[str]:
    proc = children.spawn(SCRIPT, ns.hex(), ROW_BYTES, budget(8, 2), 2, 5.0, grace)
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
    with HostTier.open(namespace, ROW_BYTES, budget(8, 2), 2, orphan_grace_s=60.0) as again:
        assert again.statistics().rows_adopted == 4
        assert all(loads_exactly(again, k) for k in ks)
        assert store(again, keys(1, 2)) == [True]
        # One janitor watches it (a second one started before the first took
        # the janitor lock finds it taken, and exits).
        _until("one janitor", lambda: len(_janitors(path)) == 1)
    assert not os.path.exists(path)
    _until("the janitor gone", lambda: not _janitors(path))


def test_instances_opening_at_once_start_one_janitor(namespace: bytes, children: Children) -> None:
    # Every janitor process ever seen for the segment, sampled faster than a
    # janitor starts: a second one, started before the first held the lock,
    # would live for at least its interpreter's start-up and be seen.
    path = segment_path(namespace)
    seen: set[int] = set()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.update(_janitors(path))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        procs = [
            children.spawn(SCRIPT, namespace.hex(), ROW_BYTES, budget(8, 4), 4, 5.0, 0.5)
            for _ in range(4)
        ]
        for p in procs:
            hello(children, p)
        _until("watched", lambda: len(_janitors(path)) == 1)
        time.sleep(3.0)  # what a janitor started late would take to start and exit
    finally:
        stop.set()
        sampler.join()
    assert len(seen) == 1, f"janitors started for one segment: {sorted(seen)}"
    for p in procs:
        kill(p)
    _until("removed", lambda: not os.path.exists(path))
    _until("the janitor gone", lambda: not _janitors(path))


_MARK = "import os, sys; open(os.environ['KVTIER_TEST_MARKER'], 'a').write(__file__ + '\\n')\n"


@pytest.mark.parametrize("planted", ["subprocess.py", "kvtier/__init__.py"])
def test_the_janitor_runs_nothing_from_the_instances_working_directory(
    namespace: bytes, children: Children, tmp_path: Path, planted: str
) -> None:
    # A serving process started from a directory anyone could have written
    # (a checkout, /tmp): a module there named like one the janitor imports
    # must not run as the serving user.
    cwd = tmp_path / "cwd"
    (cwd / planted).parent.mkdir(parents=True)
    (cwd / planted).write_text(_MARK)
    marker = tmp_path / "ran"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["KVTIER_TEST_MARKER"] = str(marker)
    args = [namespace.hex(), ROW_BYTES, budget(8, 2), 2, 5.0, 0.5]
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, *map(str, args)],
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    children.procs.append(proc)
    hello(children, proc)
    path = segment_path(namespace)
    _until("watched", lambda: marker.exists() or len(_janitors(path)) == 1)
    kill(proc)
    # The janitor still does its job: the segment goes after the grace.
    _until("removed", lambda: marker.exists() or not os.path.exists(path))
    assert not marker.exists(), f"ran from the working directory: {marker.read_text()}"
    _until("the janitor gone", lambda: not _janitors(path))
