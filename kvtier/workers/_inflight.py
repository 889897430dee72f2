"""The group's jobs in flight: sending each to every rank, and resolving it from their answers.

:class:`InFlight` keeps the table of jobs not yet answered by every rank. It
writes each job as one record to the rank's job pipe (the socket when the
record is too large or the pipe full), reads the ``done`` pipe the workers
answer on, and resolves a job's :class:`~kvtier.transfer.completion.Completion`
once every rank reported it, counting it in the group's
:class:`~kvtier.workers._statistics.Counts`.

It is apart from :class:`~kvtier.workers.group.WorkerGroup` so that the
group validates and routes, and this holds the per-job path; it reaches the
ranks through the :class:`~kvtier.workers._registry.Registry` and learns of a
lost rank from the group (:meth:`InFlight.fail_rank`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ProtocolError, WorkerError, WorkerLostError
from kvtier.transfer.completion import Completion
from kvtier.workers._registry import Registry
from kvtier.workers._statistics import Counts
from kvtier.workers.jobs import (
    PIPE_BUF,
    JobDone,
    JobSpec,
    Kind,
    decode,
    pack_record,
    unpack_records,
)

__all__ = ["InFlight"]

log = logging.getLogger("kvtier.workers")


@dataclass(slots=True, eq=False)
class _Pending:
    done: Completion[None]
    waiting: set[int]
    store: bool
    nbytes: int
    error: WorkerError | None = None


class InFlight:
    """The jobs sent to the ranks and not yet answered by all of them."""

    def __init__(self, directory: str, workers: Registry, counts: Counts) -> None:
        """Make the ``done`` pipe in ``directory``; count finished jobs in ``counts``."""
        done_pipe = os.path.join(directory, "done")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(done_pipe)  # a killed instance's, in a directory given again
        os.mkfifo(done_pipe, 0o600)
        # Read and write: the pipe never reports end-of-file when a worker goes.
        self._fd = os.open(done_pipe, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._buf = bytearray()
        self._workers = workers
        self._n = counts
        self._jobs: dict[int, _Pending] = {}
        self._next_job = 0
        self._block_bytes = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._jobs)

    def start(self, loop: asyncio.AbstractEventLoop, bytes_per_block: int) -> None:
        """Read the ``done`` pipe whenever ``loop`` finds it readable."""
        self._loop = loop
        self._block_bytes = bytes_per_block
        loop.add_reader(self._fd, self._on_pipe)

    def close(self) -> None:
        """Stop reading the ``done`` pipe and close it."""
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
        os.close(self._fd)

    def submit(
        self, kind: Kind, rows: np.ndarray, ids: dict[int, np.ndarray], skip: int, blocks: int
    ) -> Completion[None]:
        """Send the job of ``blocks`` device blocks to every rank; its completion."""
        self._next_job += 1
        spec = JobSpec(self._next_job, kind, rows, ids, skip)
        done: Completion[None] = Completion()
        if blocks == 0:
            done.set_result(None)
            return done
        by_rank = self._workers.by_rank
        pending = _Pending(done, set(by_rank), kind == "store", blocks * self._block_bytes)
        # In the table before any send: a rank lost while sending fails this job too.
        self._jobs[spec.job] = pending
        frames = spec.encode()
        record = pack_record(frames)
        for peer in list(by_rank.values()):
            fd = peer.pipes.get(kind)
            if fd is not None and len(record) <= PIPE_BUF:
                try:
                    os.write(fd, record)  # whole or not at all (at most PIPE_BUF)
                    continue
                except BlockingIOError:
                    pass  # full (its worker stopped reading: dead?): the socket
            self._workers.send(peer.ident, frames)
        return done

    def _on_pipe(self) -> None:
        """Read every answer waiting in the ``done`` pipe."""
        while True:
            try:
                chunk = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                break
            self._buf += chunk
            if len(chunk) < 1 << 16:
                break
        try:
            records = unpack_records(self._buf)
        except ProtocolError as exc:
            log.warning("dropped the done pipe's contents: %s", exc)
            self._buf.clear()
            return
        by_rank = self._workers.by_rank
        for rank, frames in records:
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                log.warning("ignored a record of the done pipe: %s", exc)
                continue
            # A record of a rank since forgotten answers for a worker that is gone.
            if rank in by_rank and isinstance(msg, JobDone):
                self._done(rank, msg)

    def done(self, ident: bytes, msg: JobDone) -> None:
        """An answer that came on the socket from the worker ``ident``."""
        peer = self._workers.peers.get(ident)
        if peer is not None:
            self._done(peer.rank, msg)

    def _done(self, rank: int, msg: JobDone) -> None:
        pending = self._jobs.get(msg.job)
        if pending is None or rank not in pending.waiting:
            return
        pending.waiting.discard(rank)
        if msg.error is not None and pending.error is None:
            pending.error = WorkerError(
                f"rank {rank}: {'store' if pending.store else 'load'} job {msg.job} failed: "
                f"{msg.error}: {msg.message}",
                rank,
                msg.error,
            )
        self._finish(msg.job, pending)

    def fail_rank(self, rank: int, err: WorkerLostError) -> None:
        """Fail every job still waiting for the lost ``rank`` (once the others answered)."""
        for job_id, p in list(self._jobs.items()):
            if rank in p.waiting:
                p.waiting.discard(rank)
                p.error = err
                self._finish(job_id, p)

    def _finish(self, job_id: int, p: _Pending) -> None:
        if p.waiting:
            return
        del self._jobs[job_id]
        n = self._n
        if p.error is not None:
            n.failures += 1
            p.done.set_exception(p.error)
        else:
            if p.store:
                n.stores += 1
                n.bytes_stored += p.nbytes
            else:
                n.loads += 1
                n.bytes_loaded += p.nbytes
            p.done.set_result(None)

    async def settle(self) -> None:
        """Wait until every job in flight ended, however it ended."""
        if self._jobs:
            await asyncio.gather(*(_settle(p.done) for p in list(self._jobs.values())))


async def _settle(c: Completion[None]) -> None:
    with contextlib.suppress(Exception):
        await c
