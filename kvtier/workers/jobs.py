"""What crosses the process boundary between the scheduler and its workers.

Every message is a zmq multipart message. The two of the hot path are binary
and fixed-layout: a job is two frames, a packed header (``J``, job id, kind,
skip, the row count, then each KV group's id and id count) and one frame of
little-endian int64 holding the rows and then each group's device ids; a
successful ``done`` is one 9-byte frame (``D`` and the job id). Every other
message, rare, is one JSON frame naming its ``op`` (no pickle anywhere: a peer
can only ever send data, never code)::

    scheduler -> worker                      worker -> scheduler
      welcome  {region, scheduler pid}          hello     {rank, pid, layout}
      refused  {error, message}                 attached  {} | failed {error, message}
      job      J header + rows and ids          done      D job | {job, error, message}
      stop     {}                               bye       {}

*On pipes.* The same frames also travel as a **record** (:func:`pack_record`):
a header (bytes that follow, the sender's rank, frame count), then each frame
after its length. A record of at most ``PIPE_BUF`` (4096) bytes is written to a
pipe in one ``write``, which the kernel keeps whole even with several writers;
that is what the job and completion pipes of
:mod:`kvtier.workers.group` rely on (a 16-block job is about 300 bytes).

Why binary: encoding and decoding a job and its answer took 29 µs with a JSON
header and a frame per KV group, 11 µs now (two groups of 16 blocks, on the
2-core development VM), CPU time that both processes spend on every job.

A job is a :class:`JobSpec`; its answer a :class:`JobDone`. The registration
messages are :class:`Hello` and :class:`Welcome`; the rest are :class:`Notice`.
"""

from __future__ import annotations

import json
import select
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvtier import errors
from kvtier.errors import ProtocolError

__all__ = [
    "PIPE_BUF",
    "Hello",
    "JobDone",
    "JobSpec",
    "Notice",
    "Welcome",
    "decode",
    "error_from",
    "pack_record",
    "unpack_records",
]

Kind = Literal["store", "load"]
Frames = Sequence[bytes | memoryview]


_JOB = struct.Struct("<cQBII")
"""``J``, job id, kind (0 store, 1 load), skip, rows; then per group :data:`_GROUP`."""
_GROUP = struct.Struct("<II")
"""A KV group's id and how many device ids it has."""
_DONE = struct.Struct("<cQ")
"""``D`` and the id of a job that succeeded."""
_KINDS: tuple[Kind, Kind] = ("store", "load")
_RECORD = struct.Struct("<III")
"""A pipe record's header: bytes that follow, the sender's rank, frame count."""
_FRAME = struct.Struct("<I")
PIPE_BUF = select.PIPE_BUF
"""The largest record a pipe takes whole, in one write, from any number of writers."""


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
        """Two frames: the packed header, then the rows and each group's ids as int64."""
        groups = sorted(self.ids)
        arrays = [self.rows, *(self.ids[g] for g in groups)]
        head = _JOB.pack(b"J", self.job, _KINDS.index(self.kind), self.skip, len(self.rows))
        head += b"".join(_GROUP.pack(g, len(self.ids[g])) for g in groups)
        body = np.concatenate(arrays).astype("<i8", copy=False) if groups else self.rows
        return [head, np.ascontiguousarray(body, dtype="<i8").tobytes()]


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
        """One frame: packed for a success, JSON for an error."""
        if self.error is None:
            return [_DONE.pack(b"D", self.job)]
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
    pipes: str = ""
    """Directory of the job and completion pipes (``<rank>.store``, ``<rank>.load``,
    ``done``); empty when every job travels on the socket."""

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
                pipes=self.pipes,
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
        first = frames[0]
        tag = first[:1]
        if tag == b"J":
            return _decode_job(first, frames)
        if tag == b"D":
            return JobDone(_DONE.unpack(first)[1])
        head = json.loads(bytes(first))
        op = head["op"]
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
                str(head.get("pipes", "")),
            )
        if op in ("refused", "attached", "failed", "stop", "bye"):
            return Notice(op, head.get("error"), str(head.get("message", "")))
        raise ValueError(f"unknown op {op!r}")
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        raise ProtocolError(f"not a kvtier worker message: {exc}") from exc


def _decode_job(head: bytes | memoryview, frames: Frames) -> JobSpec:
    _, job, kind, skip, nrows = _JOB.unpack_from(head)
    ngroups, extra = divmod(len(head) - _JOB.size, _GROUP.size)
    if extra or len(frames) != 2 or kind > 1:
        raise ValueError("a malformed job")
    body = np.frombuffer(frames[1], dtype="<i8")
    at, ids = nrows, {}
    for i in range(ngroups):
        group, count = _GROUP.unpack_from(head, _JOB.size + i * _GROUP.size)
        ids[group] = body[at : at + count]
        at += count
    if at != body.size:
        raise ValueError(f"{body.size} indices for {at}")
    return JobSpec(job, _KINDS[kind], body[:nrows], ids, skip)


def pack_record(frames: Sequence[bytes], rank: int = 0) -> bytes:
    """One message's frames as a pipe record (see the module docstring)."""
    parts = [b""]
    for f in frames:
        parts += (_FRAME.pack(len(f)), f)
    body = b"".join(parts)
    return _RECORD.pack(len(body), rank, len(frames)) + body


def unpack_records(buf: bytearray) -> list[tuple[int, list[bytes]]]:
    """Take the whole records off the front of ``buf``: (sender rank, frames) each.

    A record cut short (a read that ended inside it) stays in ``buf``.

    Raises
    ------
    ProtocolError
        For bytes that are not records (a frame running past its record).
    """
    out: list[tuple[int, list[bytes]]] = []
    at = 0
    while len(buf) - at >= _RECORD.size:
        size, rank, count = _RECORD.unpack_from(buf, at)
        end = at + _RECORD.size + size
        if end > len(buf):
            break
        frames, pos = [], at + _RECORD.size
        for _ in range(count):
            if pos + _FRAME.size > end:
                raise ProtocolError("a pipe record's frames run past its end")
            (n,) = _FRAME.unpack_from(buf, pos)
            pos += _FRAME.size
            if pos + n > end:
                raise ProtocolError("a pipe record's frames run past its end")
            frames.append(bytes(buf[pos : pos + n]))
            pos += n
        out.append((rank, frames))
        at = end
    del buf[:at]
    return out


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
