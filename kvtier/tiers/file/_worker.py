"""The file tier's one thread: payload checksums and quarantine copies off the event loop.

Separate from the I/O pipeline because two parts use it: the pipeline hands
it the XXH3 of the stored payloads (one call per few MiB of blocks, not one
per block), the quarantine its copies of bad blocks
(:mod:`kvtier.tiers.file._quarantine`), and both get their results back on the
loop in the order they asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Then", "Worker"]

log = logging.getLogger("kvtier.file_tier")

_WORKER_BATCH = 256

Then = Callable[[Any, Exception | None], None]
"""Called on the loop with a worker call's return value, or None and its error."""


class Worker:
    """One thread computing payload checksums off the event loop.

    It also writes quarantine copies, one at a time.

    XXH3 releases the GIL and reads the payload from memory at 7-13 GB/s
    here: at 256 KiB a block it was a third of the loop's work per store.
    One busy thread takes its queue in batches and hands results back with one
    ``call_soon_threadsafe`` per batch; several threads cost more CPU per GB
    (each wakes up for every call) for no more throughput (measured on the
    former metadata threads, docs/lab/file-tier-runs.md).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Then, bool] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="kvtier-file-tier", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], Any], then: Then, *, at_once: bool = False) -> None:
        """Run ``call`` on the thread; ``then`` gets its outcome on the loop.

        Outcomes go back once per batch of calls taken from the queue; with
        ``at_once``, this one's goes back as soon as it is computed (a long
        call whose blocks should start while the next call runs).
        """
        self._jobs.put((call, then, at_once))

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        jobs = self._jobs
        while True:
            batch = [jobs.get()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < _WORKER_BATCH:
                    batch.append(jobs.get_nowait())
            done: list[tuple[Then, Any, Exception | None]] = []
            stop = False
            for job in batch:
                if job is None:
                    stop = True
                    continue
                call, then, at_once = job
                try:
                    result = call()
                except Exception as exc:
                    # An error must fail its block, not kill the thread (every later
                    # call would wait for ever, and aclose with them).
                    done.append((then, None, exc))
                else:
                    done.append((then, result, None))
                if at_once:
                    self._send(done)
                    done = []
            self._send(done)
            if stop:
                return

    def _send(self, done: list[tuple[Then, Any, Exception | None]]) -> None:
        if done:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                self._loop.call_soon_threadsafe(_deliver, done)


def _deliver(done: list[tuple[Then, Any, Exception | None]]) -> None:
    for then, result, exc in done:
        try:
            then(result, exc)
        except Exception:
            # One failing callback must not strand the rest of the batch (their
            # blocks would stay in flight and aclose would wait forever).
            log.exception("file tier: a worker completion failed")
