from __future__ import annotations

import asyncio
import threading

import pytest

from kvtier.transfer.completion import Completion


async def test_cancelled_awaiter_does_not_cancel_work() -> None:
    c: Completion[int] = Completion()
    released: list[int] = []
    c.add_done_callback(lambda done: released.append(done.result()))
    task = asyncio.create_task(_wait(c))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not c.done()
    assert released == []
    threading.Thread(target=c.set_result_threadsafe, args=(7,)).start()
    assert await c == 7
    assert released == [7]


async def _wait(c: Completion[int]) -> int:
    return await c


async def test_exception_propagates_and_set_twice_ignored() -> None:
    c: Completion[None] = Completion()
    c.set_exception(OSError(5, "EIO"))
    c.set_result(None)
    with pytest.raises(OSError, match="EIO"):
        await c


async def test_gather() -> None:
    parts: list[Completion[object]] = [Completion() for _ in range(3)]
    g = Completion.gather(parts)
    parts[1].set_exception(ValueError("second"))
    parts[0].set_result(1)
    assert not g.done()
    parts[2].set_result(3)
    with pytest.raises(ValueError, match="second"):
        await g
    await Completion.gather([])
