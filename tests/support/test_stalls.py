"""The stall dump names the await a stalled task waits on."""

from __future__ import annotations

import asyncio
import io
import threading

from support.stalls import dump_running_loops


async def _waits_forever(never: asyncio.Event) -> None:
    await _deeper(never)


async def _deeper(never: asyncio.Event) -> None:
    await never.wait()


async def test_a_stalled_task_is_named_with_its_await() -> None:
    never = asyncio.Event()
    stalled = asyncio.create_task(_waits_forever(never))
    await asyncio.sleep(0)  # it starts, and waits
    out = io.StringIO()
    asked: list[int] = []
    # From another thread, as the timer does while the test's loop waits.
    thread = threading.Thread(target=lambda: asked.append(dump_running_loops(out)))
    thread.start()
    for _ in range(500):  # the dump runs on this loop at its next turn
        if not thread.is_alive() and "Event.wait" in out.getvalue():
            break
        await asyncio.sleep(0.01)
    stalled.cancel()
    assert asked == [asked[0]]
    assert asked[0] >= 1  # this test's loop, at least
    text = out.getvalue()
    assert "asyncio task(s)" in text
    # Every await of the chain, down to the one that never returns.
    assert "in _waits_forever" in text
    assert "in _deeper" in text
    assert "in Event.wait" in text
