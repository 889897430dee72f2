"""An asyncio event loop in a thread of its own: where a queued runtime's tiers run.

A front whose chain is owned by another engine's thread (vLLM's scheduler, an
engine's storage threads) runs kvtier's tiers on a :class:`LoopThread`; the
runtime (:class:`~kvtier.chain.Runtime`, ``queued``) carries intents to it and
drains their outcomes back.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running in a daemon thread of its own."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it (start-up and shutdown only)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def soon(self, fn: Any, *args: Any) -> None:
        """Call ``fn(*args)`` on the loop thread; never blocks."""
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        """Stop the loop and join its thread (10 s at most); close it once the thread ended."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self.loop.close()
