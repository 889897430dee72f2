"""Where each asyncio task waits, printed when a test stalls.

pytest-timeout ends a test that runs past its limit and prints the threads'
stacks; a stalled asyncio test then shows only its event loop waiting in
``select``, not which ``await`` never returned. :func:`watch` prints, shortly
before the limit, the stack of every task of every running event loop, from
that loop's own thread (a loop that still turns runs the dump; one blocked in
a call shows in the threads' stacks anyway). The output goes to stderr, which
pytest captures and reports with the failure.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

import pytest

__all__ = ["DUMP_BEFORE_S", "dump_running_loops", "tasks_before_the_timeout", "watch"]

DUMP_BEFORE_S = 10.0
"""How long before pytest-timeout's limit the tasks' stacks are printed."""


def dump_running_loops(file: TextIO | None = None) -> int:
    """Ask every running event loop to print its tasks' stacks; how many were asked."""
    out = sys.stderr if file is None else file
    # type(), not isinstance(): that asks objects for __class__, which some
    # modules' lazy attributes answer with a deprecation warning.
    loops = [
        o
        for o in gc.get_objects()
        if issubclass(type(o), asyncio.AbstractEventLoop) and o.is_running()
    ]
    for loop in loops:
        loop.call_soon_threadsafe(_dump, loop, out)
    return len(loops)


def _dump(loop: asyncio.AbstractEventLoop, out: TextIO) -> None:
    tasks = asyncio.all_tasks(loop)
    print(f"--- a test is about to time out: {len(tasks)} asyncio task(s) ---", file=out)
    for task in tasks:
        print(f"{task!r}, awaiting:", file=out)
        for where in _awaits(task.get_coro()):
            print(f"  {where}", file=out)
    out.flush()


def _awaits(coro: object) -> list[str]:
    """The chain of awaits a coroutine is suspended in, outermost first
    (``Task.print_stack`` shows only the task's own frame)."""
    chain = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            chain.append(repr(coro))  # a future, or a finished coroutine
            break
        code = frame.f_code
        chain.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_qualname}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return chain


def watch(after_s: float) -> threading.Timer:
    """A started daemon timer that dumps the running loops' tasks after ``after_s``;
    cancel it when the test ends."""
    timer = threading.Timer(after_s, dump_running_loops)
    timer.daemon = True
    timer.start()
    return timer


def limit_s(request: pytest.FixtureRequest) -> float:
    """The test's pytest-timeout limit in seconds (0: none)."""
    marker = request.node.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    option = request.config.getoption("timeout", None)
    if option is not None:
        return float(option)
    return float(request.config.getini("timeout") or 0)


def tasks_before_the_timeout(request: pytest.FixtureRequest) -> Iterator[None]:
    """The fixture (tests/conftest.py makes it autouse): :func:`watch` over the test."""
    limit = limit_s(request)
    if limit <= 0:
        yield
        return
    timer = watch(max(limit - DUMP_BEFORE_S, limit * 0.9))
    try:
        yield
    finally:
        timer.cancel()
