"""What crosses the process boundary between the scheduler and its workers.

Every message is a zmq multipart message whose first frame is a small JSON
header naming its ``op``; a job's index arrays follow as raw little-endian
int64 frames (no pickle: a peer can only ever send data, never code)::

    scheduler -> worker                      worker -> scheduler
      welcome  {region, scheduler pid}          hello     {rank, pid, layout}
      refused  {error, message}                 attached  {} | failed {error, message}
      job      {job, kind, skip, groups}        done      {job, error?, message?}
               + rows + ids of each group       bye       {}
      stop     {}

A job is a :class:`JobSpec`; its answer a :class:`JobDone`. The registration
messages are :class:`Hello` and :class:`Welcome`; the rest are :class:`Notice`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvtier import errors
from kvtier.errors import ProtocolError

__all__ = ["Hello", "JobDone", "JobSpec", "Notice", "Welcome", "decode", "error_from"]

Kind = Literal["store", "load"]
Frames = Sequence[bytes | memoryview]


def _header(op: str, **fields: Any) -> bytes:
    return json.dumps({"op": op, **fields}, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True, eq=False)
class JobSpec:
    """One copy job, sent alike to every rank: each copies its own slice of the rows."""

    job: int
    """Job id, unique within a worker group."""
    kind: Kind
    """``"store"`` (device blocks -> rows) or ``"load"`` (rows -> device blocks)."""
    rows: np.ndarray
    """CPU-region row indices, int64."""
    ids: Mapping[int, np.ndarray] = field(default_factory=dict)
    """Device block ids per KV group, int64, as the group's layout counts them."""
    skip: int = 0
    """Sub-blocks of the first row not loaded (loads only)."""

    def encode(self) -> list[bytes]:
        """The frames: a JSON header, the rows, then the ids of each group in order."""
        groups = sorted(self.ids)
        head = _header("job", job=self.job, kind=self.kind, skip=self.skip, groups=groups)
        return [
            head,
            np.ascontiguousarray(self.rows, dtype="<i8").tobytes(),
            *(np.ascontiguousarray(self.ids[g], dtype="<i8").tobytes() for g in groups),
        ]


@dataclass(frozen=True, slots=True)
class JobDone:
    """A rank's answer to one job."""

    job: int
    """The job id."""
    error: str | None = None
    """Class name of the error the rank raised, or None when its copy succeeded."""
    message: str = ""
    """The error's message."""

    def encode(self) -> list[bytes]:
        """One JSON frame."""
        return [_header("done", job=self.job, error=self.error, message=self.message)]


@dataclass(frozen=True, slots=True)
class Hello:
    """A worker's registration: who it is and which layout it holds."""

    rank: int
    """The tensor-parallel rank it claims."""
    pid: int
    """Its process id (the scheduler watches it for exit)."""
    namespace: str
    """Hex of its layout's namespace: equal for every rank of one instance."""
    layout: Mapping[str, Any]
    """Its layout's description (:meth:`KVLayout.describe`), to name differences."""

    def encode(self) -> list[bytes]:
        """One JSON frame."""
        return [
            _header(
                "hello",
                rank=self.rank,
                pid=self.pid,
                namespace=self.namespace,
                layout=dict(self.layout),
            )
        ]


@dataclass(frozen=True, slots=True)
class Welcome:
    """The scheduler's acceptance: where the shared region is and who to watch."""

    shared_name: str
    """Name of the shared CPU region."""
    instance: str
    """Hex of the instance token the region was created with."""
    cpu_bytes_to_use: int
    """The instance-wide budget the region was sized from."""
    alignment: int
    """The region's row alignment."""
    world_size: int
    """Ranks sharing each row."""
    scheduler_pid: int
    """The scheduler's process id (the worker watches it for exit)."""

    def encode(self) -> list[bytes]:
        """One JSON frame."""
        return [
            _header(
                "welcome",
                shared_name=self.shared_name,
                instance=self.instance,
                cpu_bytes_to_use=self.cpu_bytes_to_use,
                alignment=self.alignment,
                world_size=self.world_size,
                scheduler_pid=self.scheduler_pid,
            )
        ]


@dataclass(frozen=True, slots=True)
class Notice:
    """A message without data: ``refused``, ``attached``, ``failed``, ``stop`` or ``bye``."""

    op: str
    """What happened."""
    error: str | None = None
    """Class name of the error (``refused``, ``failed``)."""
    message: str = ""
    """Its message."""

    def encode(self) -> list[bytes]:
        """One JSON frame."""
        return [_header(self.op, error=self.error, message=self.message)]


Message = JobSpec | JobDone | Hello | Welcome | Notice


def decode(frames: Frames) -> Message:
    """Parse a message's frames.

    Raises
    ------
    ProtocolError
        For frames that are not a message of this protocol.
    """
    try:
        head = json.loads(bytes(frames[0]))
        op = head["op"]
        if op == "job":
            groups = [int(g) for g in head["groups"]]
            if len(frames) != 2 + len(groups):
                raise ValueError(f"{len(frames)} frames for {len(groups)} groups")
            ids = {
                g: np.frombuffer(f, dtype="<i8") for g, f in zip(groups, frames[2:], strict=True)
            }
            kind = head["kind"]
            if kind not in ("store", "load"):
                raise ValueError(f"kind {kind!r}")
            return JobSpec(
                int(head["job"]),
                kind,
                np.frombuffer(frames[1], dtype="<i8"),
                ids,
                int(head["skip"]),
            )
        if op == "done":
            return JobDone(int(head["job"]), head["error"], str(head["message"]))
        if op == "hello":
            return Hello(head["rank"], int(head["pid"]), str(head["namespace"]), head["layout"])
        if op == "welcome":
            return Welcome(
                str(head["shared_name"]),
                str(head["instance"]),
                int(head["cpu_bytes_to_use"]),
                int(head["alignment"]),
                int(head["world_size"]),
                int(head["scheduler_pid"]),
            )
        if op in ("refused", "attached", "failed", "stop", "bye"):
            return Notice(op, head.get("error"), str(head.get("message", "")))
        raise ValueError(f"unknown op {op!r}")
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ProtocolError(f"not a kvtier worker message: {exc}") from exc


_REFUSALS = {
    cls.__name__: cls
    for cls in (
        errors.BusyError,
        errors.ClosedError,
        errors.ConfigurationError,
        errors.InvalidArgumentError,
        errors.LayoutError,
        errors.NamespaceMismatchError,
        errors.SharedRegionError,
        errors.CapacityError,
    )
}
"""Errors that travel by name: each takes its message as its only argument."""


def error_from(name: str | None, message: str, rank: int | None) -> errors.KVTierError:
    """The typed error a peer reported by class name (a :class:`WorkerError` otherwise)."""
    cls = _REFUSALS.get(name or "")
    if cls is not None:
        return cls(message)
    return errors.WorkerError(message, rank, name)
