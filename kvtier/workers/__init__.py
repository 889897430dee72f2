"""Scheduler and workers in separate processes: one engine, two transports.

:class:`WorkerGroup` (scheduler side) is a
:class:`~kvtier.transfer.device.DeviceTransfer` that sends each copy job to one
:class:`Worker` per tensor-parallel rank over pyzmq ``ipc://`` sockets;
:mod:`kvtier.workers.jobs` holds what crosses the boundary.
"""

from __future__ import annotations

from kvtier.workers.group import WorkerGroup
from kvtier.workers.worker import Worker, WorkerThread, run_worker

__all__ = ["Worker", "WorkerGroup", "WorkerThread", "run_worker"]
