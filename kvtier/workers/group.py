"""The scheduler's side of the process split: a :class:`DeviceTransfer` over worker processes.

The engine drives every copy through a
:class:`~kvtier.transfer.device.DeviceTransfer`. In one process that is the
in-process copier; across processes it is a :class:`WorkerGroup`, which sends
each job to every rank's worker and resolves the job's
:class:`~kvtier.transfer.completion.Completion` once every rank has reported
it. One engine, two transports (as httpx sends every request through a
transport)::

    scheduler process                                 worker process, rank r
      Engine --store/load--> WorkerGroup                 Worker
                               ROUTER  ipc://<0700 dir>/jobs  DEALER   registration, control
                               |  pipe <dir>/<r>.store ------> |  store thread: copies slice r
                               |  pipe <dir>/<r>.load  ------> |  load thread:  copies slice r
                               | <------ pipe <dir>/done ----- |  JobDone (job, ok / error)
                               pidfd of each worker            pidfd of the scheduler

Registration (hello, welcome, attached), stop and goodbye travel on a pyzmq
ROUTER/DEALER pair. Jobs and their answers take named pipes in the same
private directory: a job is one record of :func:`~kvtier.workers.jobs.pack_record`
written whole (at most ``PIPE_BUF`` bytes) to the rank's pipe of its
direction, where a thread of the worker waits in ``read``, runs the copy
itself (:class:`~kvtier.transfer.device.RunsNow`) and writes its answer to the
``done`` pipe that the scheduler's loop watches. Why pipes and not the
socket: every zmq message crosses two I/O threads (the sender's and the
receiver's) before the receiver's loop wakes, and the worker's loop then
handed the job to a copy thread and the answer back: about 0.9 ms of wake-ups
per job on the 2-core VM, a third of a 16-block request at 2 MiB rows. A pipe
wakes the copying thread directly, as the in-process copier's queue does
(docs/architecture.md has the figures). A job too large for one record, or
met by a full pipe, goes on the socket instead: jobs need no order between
them (the scheduler sends a job only once its rows are free).

Completions reach the event loop without polling: the loop watches the
``done`` pipe and zmq.asyncio the socket's descriptor, and each worker's exit
is a readable pidfd (``os.pidfd_open``) registered with ``loop.add_reader``.

*A worker that dies* fails every job it had not reported with
:class:`~kvtier.errors.WorkerLostError` (once the other ranks have reported
theirs, so no copy still writes a row the engine reuses), and the group is
broken from then on: every later job is refused with the same error. A
tensor-parallel instance missing a rank cannot serve its model anyway; the
serving engine restarts the instance (vLLM does the same when a worker dies).

The group validates and routes; its parts are private modules beside it, each
an object it owns: :mod:`kvtier.workers._registry` (the socket, the handshake,
each worker's life and its stop), :mod:`kvtier.workers._inflight` (the jobs in
flight: the pipes, the answers) and :mod:`kvtier.workers._statistics` (the
counters).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import (
    ClosedError,
    InvalidArgumentError,
    ProtocolError,
    WorkerError,
    WorkerLostError,
)
from kvtier.layout import KVLayout
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import (
    BlockIds,
    DeviceTransfer,
    TransferStatistics,
    check_block_ids,
    check_rows,
)
from kvtier.workers._inflight import InFlight
from kvtier.workers._registry import Registry
from kvtier.workers._statistics import Counts
from kvtier.workers.jobs import Hello, JobDone, Notice, Welcome, decode

if TYPE_CHECKING:
    from kvtier.region import CPURegion

__all__ = ["WorkerGroup"]

log = logging.getLogger("kvtier.workers")


class WorkerGroup(DeviceTransfer):
    """Sends copy jobs to one worker process per tensor-parallel rank.

    Bind it with :meth:`bind`, hand :attr:`address` to the worker processes
    (:class:`kvtier.workers.Worker`), and give it to
    :meth:`kvtier.Engine.open` as ``workers=``: the engine creates the shared
    CPU region, waits for every rank to register and attach it, and closes the
    group with itself.

    Notes
    -----
    **Registration.** A worker is refused, with a typed error it raises, when
    its rank is outside ``[0, world_size)`` (``InvalidArgumentError``), its
    layout's namespace differs from the scheduler's (``LayoutError`` naming
    the fields), or its rank is already held by a live worker
    (``BusyError``). A refused worker changes nothing: the group keeps waiting
    for a good one until the engine's ``worker_timeout``.

    **Jobs.** :meth:`store` and :meth:`load` validate on the caller's thread
    (as the in-process copier does), then send one :class:`JobSpec` to every
    rank; the completion resolves once every rank reported the job done, and
    fails with :class:`~kvtier.errors.WorkerError` (naming the rank and the
    worker's own error) if any rank failed it.

    **Worker death.** See the module docstring: jobs fail with
    :class:`~kvtier.errors.WorkerLostError`, the group refuses new ones.
    """

    def __init__(self, world_size: int, directory: str, owns_directory: bool) -> None:
        """Use :meth:`bind`."""
        self._world = world_size
        self._dir = directory
        self._owns_dir = owns_directory
        self._address = f"ipc://{os.path.join(directory, 'jobs')}"
        self._instance = os.urandom(16)
        # Three collaborators: the workers (socket, handshake, life, stop), the jobs in
        # flight (pipes, answers), and the counters both feed the statistics from.
        self._workers = Registry(world_size, directory, self._address, self._worker_lost)
        self._n = Counts()
        try:
            self._jobs = InFlight(directory, self._workers, self._n)
        except BaseException:
            self._workers.close()
            raise
        self._layout: KVLayout | None = None
        self._rows = 0
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    def bind(cls, world_size: int, *, directory: str | None = None) -> WorkerGroup:
        """Bind the group's socket in a private directory.

        Parameters
        ----------
        world_size
            Worker processes (tensor-parallel ranks), one per rank.
        directory
            An existing directory for the socket and the job pipes, which only
            this user may enter; by default a fresh one (mode 0700) that
            :meth:`aclose` removes.

        Raises
        ------
        InvalidArgumentError
            For a world size outside ``[1, 1024]``, or a directory that others
            may enter.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise InvalidArgumentError(f"world_size must be an int, got {world_size!r}")
        if not 1 <= world_size <= 1024:
            raise InvalidArgumentError(f"world_size must be in [1, 1024], got {world_size}")
        owns = directory is None
        if directory is None:
            directory = tempfile.mkdtemp(prefix="kvtier-workers-")  # mode 0700
        elif os.stat(directory).st_mode & 0o077:
            raise InvalidArgumentError(
                f"{directory} may be entered by other users: the job socket must be private "
                "(chmod 700)"
            )
        try:
            return cls(world_size, directory, owns)
        except BaseException:
            if owns:
                shutil.rmtree(directory, ignore_errors=True)
            raise

    # -- properties ---------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The ``ipc://`` endpoint the workers connect to."""
        return self._address

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._world

    @property
    def instance(self) -> bytes:
        """16 random bytes naming this instance; the shared region carries them."""
        return self._instance

    @property
    def backend(self) -> str:
        return "workers"

    # -- registration -------------------------------------------------------------------

    async def start(
        self,
        layout: KVLayout,
        region: CPURegion,
        cpu_bytes_to_use: int,
        timeout: float,  # noqa: ASYNC109 - a deadline on registration, not on the call
    ) -> None:
        """Accept one worker per rank and wait until each has attached ``region``.

        Called by :meth:`kvtier.Engine.open`.

        Raises
        ------
        WorkerError
            When not every rank attached within ``timeout`` seconds; the
            message lists the missing ranks and the refusals seen.
        """
        shared_name = region.statistics().shared_name
        if shared_name is None:  # pragma: no cover - the engine always names it
            raise InvalidArgumentError("the workers need a shared region")
        loop = asyncio.get_running_loop()
        self._layout = layout
        self._rows = region.rows
        all_attached = self._workers.begin(
            loop,
            layout,
            Welcome(
                shared_name=shared_name,
                instance=self._instance.hex(),
                cpu_bytes_to_use=cpu_bytes_to_use,
                alignment=region.alignment,
                world_size=self._world,
                scheduler_pid=os.getpid(),
                pipes=self._dir,
            ),
        )
        self._jobs.start(loop, layout.bytes_per_block)
        self._reader = asyncio.ensure_future(self._read())
        try:
            await asyncio.wait_for(asyncio.shield(all_attached), timeout)
        except TimeoutError:
            missing = self._workers.missing()
            seen = "; ".join(self._workers.refusals[-5:]) or "none"
            raise WorkerError(
                f"ranks {missing} of {self._world} did not register and attach the CPU region "
                f"within {timeout} s (refused: {seen})",
                missing[0] if missing else None,
            ) from None

    async def _read(self) -> None:
        """Route each message of the job socket: answers to the jobs, the rest to the workers."""
        workers, jobs = self._workers, self._jobs
        while True:
            frames = await workers.receive()
            ident, body = frames[0], frames[1:]
            try:
                msg = decode(body)
            except ProtocolError as exc:
                log.warning("ignored a message from the job socket: %s", exc)
                continue
            if isinstance(msg, JobDone):
                jobs.done(ident, msg)
            elif isinstance(msg, Hello):
                workers.hello(ident, msg)
            elif isinstance(msg, Notice):
                workers.notice(ident, msg)
            else:
                log.warning("ignored a %s from a worker", type(msg).__name__)

    def _worker_lost(self, rank: int, err: WorkerLostError) -> None:
        # The registry knows the rank is gone; only the jobs know what it still owed.
        self._jobs.fail_rank(rank, err)

    # -- jobs ---------------------------------------------------------------------------

    def store(
        self, device_block_ids: BlockIds, rows: Sequence[int] | np.ndarray
    ) -> Completion[None]:
        layout = self._usable()
        r = check_rows(rows, self._rows, unique=True)
        bpc = layout.blocks_per_chunk
        ids = check_block_ids(layout, device_block_ids, r.size * bpc, unique=False)
        return self._jobs.submit("store", r, ids, 0, r.size * bpc)

    def load(
        self, rows: Sequence[int] | np.ndarray, device_block_ids: BlockIds, skip: int = 0
    ) -> Completion[None]:
        layout = self._usable()
        r = check_rows(rows, self._rows, unique=False)
        bpc = layout.blocks_per_chunk
        if isinstance(skip, bool) or not isinstance(skip, int | np.integer):
            raise InvalidArgumentError(f"skip must be an int, got {skip!r}")
        skip = int(skip)
        if not 0 <= skip < bpc or (skip and r.size == 0):
            raise InvalidArgumentError(f"skip must be in [0, {bpc}) with rows, got {skip}")
        n = r.size * bpc - skip
        ids = check_block_ids(layout, device_block_ids, n, unique=True)
        return self._jobs.submit("load", r, ids, skip, n)

    def _usable(self) -> KVLayout:
        workers = self._workers
        if workers.closing:
            raise ClosedError("the worker group is closed")
        if workers.broken is not None:
            raise WorkerLostError(
                f"the worker group is broken: {workers.broken}", workers.broken.rank, None
            )
        if self._layout is None or not workers.started:
            raise ClosedError("the worker group has not started (Engine.open starts it)")
        return self._layout

    # -- statistics and closing ---------------------------------------------------------

    def statistics(self) -> TransferStatistics:
        """Counters over the group: bytes are one rank's slices, summed over ranks."""
        return self._n.snapshot(self._world, len(self._jobs))

    async def aclose(self) -> None:
        """Wait for the jobs in flight, stop every worker, close the socket; idempotent.

        Notes
        -----
        Jobs in flight end when every rank reported them or died. The workers
        are then told to stop (each finishes its copies, closes its region and
        says goodbye) and waited for up to 10 s; a worker that never answers
        is left to notice the scheduler's exit.
        """
        workers = self._workers
        if workers.closing and self._reader is None:
            return
        workers.closing = True
        try:
            await self._jobs.settle()
            if self._reader is not None:
                await workers.stop()
        finally:
            reader, self._reader = self._reader, None
            if reader is not None:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
            self._jobs.close()
            workers.close()
            if self._owns_dir:
                shutil.rmtree(self._dir, ignore_errors=True)
