"""A handle on work handed to hardware: a GPU copy, a kernel I/O, a worker thread.

The data plane returns a :class:`Completion` as soon as work is submitted. It
resolves when the hardware is really done with the memory involved, and only
then. Awaiting it from a task that gets cancelled does not cancel the work: the
buffers it touches must stay reserved until :meth:`Completion.done` is true, which
is why callers release rows from :meth:`Completion.add_done_callback`, not after
an ``await`` that may never return.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

__all__ = ["Completion"]

T = TypeVar("T")


class Completion(Generic[T]):
    """Awaitable result of submitted work; cancelling an awaiter never cancels the work.

    Parameters
    ----------
    loop
        The event loop whose thread resolves the completion and runs its callbacks.
    """

    __slots__ = ("_fut", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._fut: asyncio.Future[T] = self._loop.create_future()

    # -- consumer side ------------------------------------------------------------------

    def done(self) -> bool:
        """True once the hardware has finished (successfully or not)."""
        return self._fut.done()

    def result(self) -> T:
        """The result; raises the work's error, or ``InvalidStateError`` if not done."""
        return self._fut.result()

    def exception(self) -> BaseException | None:
        """The work's error, or None; ``InvalidStateError`` if not done."""
        return self._fut.exception()

    def add_done_callback(self, fn: Callable[[Completion[T]], object]) -> None:
        """Call ``fn(self)`` on the loop once the work is done (at once if it is)."""
        self._fut.add_done_callback(lambda _f: fn(self))

    def __await__(self) -> Generator[Any, None, T]:
        # shield: a cancelled awaiter gets CancelledError, the work goes on and
        # still resolves this completion for the done callbacks.
        return asyncio.shield(self._fut).__await__()

    # -- producer side (the data plane) -------------------------------------------------

    def set_result(self, value: T) -> None:
        """Resolve with ``value``; called on the loop thread. Ignored once done."""
        if not self._fut.done():
            self._fut.set_result(value)

    def set_exception(self, exc: BaseException) -> None:
        """Fail with ``exc``; called on the loop thread. Ignored once done."""
        if not self._fut.done():
            self._fut.set_exception(exc)

    def set_result_threadsafe(self, value: T) -> None:
        """Resolve from any thread (a copy worker, a CUDA event waiter)."""
        self._loop.call_soon_threadsafe(self.set_result, value)

    def set_exception_threadsafe(self, exc: BaseException) -> None:
        """Fail from any thread."""
        self._loop.call_soon_threadsafe(self.set_exception, exc)

    @staticmethod
    def gather(parts: list[Completion[Any]]) -> Completion[None]:
        """A completion done when every part is done; fails with the first error seen."""
        out: Completion[None] = Completion(parts[0]._loop if parts else None)
        if not parts:
            out.set_result(None)
            return out
        remaining = [len(parts)]
        first: list[BaseException] = []

        def _one(part: Completion[Any]) -> None:
            if part._fut.cancelled():
                first.append(asyncio.CancelledError())
            elif (exc := part._fut.exception()) is not None and not first:
                first.append(exc)
            remaining[0] -= 1
            if remaining[0] == 0:
                if first:
                    out.set_exception(first[0])
                else:
                    out.set_result(None)

        for p in parts:
            p.add_done_callback(_one)
        return out
