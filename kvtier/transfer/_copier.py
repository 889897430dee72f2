"""What differs between the device-copy backends: the :class:`_Copier` contract.

:class:`~kvtier.transfer.device.DeviceTransfer` runs a worker thread per
direction and hands each request's copies to a copier: numpy on CPU
(:mod:`kvtier.transfer._cpu_copy`), CUDA streams and events
(:mod:`kvtier.transfer._cuda_copy`), or a fault-injecting one in tests. A
module of its own, below the backends and :mod:`kvtier.transfer.device`
(which picks one), so that no module imports one that imports it back.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["_Copier"]


class _Copier(abc.ABC):
    """What differs between backends: how a list of copies runs and completes.

    Implemented in :mod:`kvtier.transfer._cpu_copy` and
    :mod:`kvtier.transfer._cuda_copy`; tests plug fault-injecting ones in.
    """

    name: str

    @abc.abstractmethod
    def mark(self) -> object:
        """Called on the submitting thread: a marker of the compute stream's progress."""

    @abc.abstractmethod
    def run(
        self, store: bool, batches: Iterable[list[tuple[Any, Any]]], marker: object, nbytes: int
    ) -> tuple[int, Callable[[], None] | None]:
        """Issue ``dst.copy_(src)`` for each pair of each batch (a batch per tensor).

        Returns the number of copies issued and, when the copies may still be
        running on return, a callable that blocks until they are done (it runs
        on a waiter thread, so the next request can be issued meanwhile).
        """

    def close(self) -> None:  # noqa: B027 - most copiers hold nothing to release
        """Release helper threads; called once no request is in flight."""
