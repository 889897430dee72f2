"""The errors kvtier raises, one tree rooted at :class:`KVTierError`.

Every failure kvtier reports is a subclass of :class:`KVTierError`; where a
builtin exception describes the same kind of failure, the kvtier error also
inherits it, so ``except KeyError`` or ``except OSError`` keep working. The
lower-layer error (an ``OSError`` from the kernel, a CUDA error) is kept as
``__cause__``.

::

    KVTierError
    ├── ConfigurationError        (ValueError)   a configuration value is invalid
    ├── InvalidArgumentError      (ValueError)   a call got arguments it cannot use
    │   └── LayoutError                          KV tensors do not form a usable layout
    │       └── NamespaceMismatchError           bytes from another model / layout
    ├── CapacityError                            the data cannot fit the budget
    ├── AlignmentError            (ValueError)   a buffer breaks O_DIRECT alignment
    ├── ProtocolError             (RuntimeError) the residency protocol was misused
    ├── BlockNotFoundError        (KeyError)     a key is not resident / not ready
    ├── TierIOError               (OSError)      an I/O failed; carries errno and path
    │   └── DirectIOUnsupportedError             O_DIRECT refused where it was required
    ├── IntegrityError                           stored bytes fail verification
    ├── TransferError                            a device <-> CPU copy failed
    │   └── WorkerError                          a worker process failed a job (names the rank)
    │       └── WorkerLostError                  a worker process is gone; its group is broken
    ├── SharedRegionError                        a shared CPU region cannot be joined
    │   └── UnsafeSharedFileError (PermissionError) a shared file others could have written
    ├── ClosedError               (RuntimeError) the object was closed
    └── BusyError                 (RuntimeError) the resource is in use
"""

from __future__ import annotations

import errno as _errno
import os

__all__ = [
    "AlignmentError",
    "BlockNotFoundError",
    "BusyError",
    "CapacityError",
    "ClosedError",
    "ConfigurationError",
    "DirectIOUnsupportedError",
    "IntegrityError",
    "InvalidArgumentError",
    "KVTierError",
    "LayoutError",
    "NamespaceMismatchError",
    "ProtocolError",
    "SharedRegionError",
    "TierIOError",
    "TransferError",
    "UnsafeSharedFileError",
    "WorkerError",
    "WorkerLostError",
]


class KVTierError(Exception):
    """Root of every error kvtier raises."""


class ConfigurationError(KVTierError, ValueError):
    """A configuration value is missing, of the wrong type or out of range.

    Parameters
    ----------
    message
        The whole explanation.
    problems
        ``(field path, problem)`` pairs, one per invalid field, when known.
    """

    def __init__(self, message: str, problems: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


class InvalidArgumentError(KVTierError, ValueError):
    """A call received arguments it cannot act on (wrong type, range, duplicates)."""


class LayoutError(InvalidArgumentError):
    """The KV cache tensors do not describe a usable layout, or do not match one."""


class NamespaceMismatchError(LayoutError):
    """Stored bytes belong to another model, dtype, shape or parallel layout."""


class CapacityError(KVTierError):
    """The requested data cannot fit in the tier's byte budget."""


class AlignmentError(KVTierError, ValueError):
    """A buffer's address or length breaks the alignment O_DIRECT requires.

    Parameters
    ----------
    address
        The buffer's start address.
    length
        The buffer's length in bytes.
    alignment
        The alignment both must be a multiple of.
    """

    def __init__(self, address: int, length: int, alignment: int) -> None:
        super().__init__(
            f"buffer at 0x{address:x} of {length} bytes is not aligned for direct I/O: "
            f"address and length must be multiples of {alignment}"
        )
        self.address = address
        self.length = length
        self.alignment = alignment


class ProtocolError(KVTierError, RuntimeError):
    """The two-phase residency protocol was misused (e.g. completing an unprepared store)."""


class BlockNotFoundError(KVTierError, KeyError):
    """A block key is not resident, or not ready, in the tier asked."""

    def __str__(self) -> str:
        # KeyError.__str__ shows repr(args[0]); a sentence reads better.
        return str(self.args[0]) if self.args else "block not found"


class TierIOError(KVTierError, OSError):
    """An I/O operation of a tier failed.

    ``errno`` and ``filename`` carry the kernel's error number and the path, as on
    any ``OSError``; ``path`` is the same path as a string.

    Parameters
    ----------
    err
        The errno value (e.g. ``errno.ENOSPC``), or 0 when the failure is not the
        kernel's (a short read or write).
    message
        What kvtier was doing when it failed.
    path
        The file involved, if any.
    """

    def __init__(self, err: int, message: str, path: str | os.PathLike[str] | None = None) -> None:
        name = _errno.errorcode.get(err, "") if err else ""
        text = f"{message} [{name}]" if name else message
        if path is None:
            super().__init__(err, text)
        else:
            super().__init__(err, text, os.fspath(path))
        self.path: str | None = None if path is None else os.fspath(path)

    def __str__(self) -> str:
        base = self.strerror or ""
        return f"{base}: {self.path}" if self.path else base

    def __reduce__(self) -> tuple[type[TierIOError], tuple[int, str, str | None]]:
        return (type(self), (self.errno or 0, self.strerror or "", self.path))


class DirectIOUnsupportedError(TierIOError):
    """The filesystem refused O_DIRECT and ``direct_io="require"`` was set."""


class IntegrityError(KVTierError):
    """Bytes read back do not verify: checksum mismatch, torn or foreign file.

    Parameters
    ----------
    message
        What failed verification.
    path
        The file involved, if any.
    """

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(f"{message}: {os.fspath(path)}" if path is not None else message)
        self.path: str | None = None if path is None else os.fspath(path)


class TransferError(KVTierError):
    """A copy between device memory and the CPU region failed."""


class WorkerError(TransferError):
    """A worker process (one tensor-parallel rank) failed a job or its registration.

    Parameters
    ----------
    message
        The whole explanation; it names the rank.
    rank
        The rank of the worker, or None when no single rank is to blame.
    remote
        The class name of the error the worker raised, when it raised one.
    """

    def __init__(self, message: str, rank: int | None = None, remote: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.remote = remote


class WorkerLostError(WorkerError):
    """A worker process exited (or its channel broke); its group refuses further jobs."""


class SharedRegionError(KVTierError):
    """A shared CPU region could not be created or joined (dead creator, timeout)."""


class UnsafeSharedFileError(SharedRegionError, PermissionError):
    """A shared-memory file kvtier would join is not this user's private file.

    It is not a regular file (a symbolic link, a FIFO, a directory), another user
    owns it, or its mode lets others read or write it: its bytes could have been
    planted, or read by someone else. The message names the path, its mode and
    its owner. kvtier never maps such a file; ``errno`` is ``EPERM``.
    """

    def __init__(self, message: str, path: str) -> None:
        super().__init__(_errno.EPERM, message, path)
        self.path = path

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> tuple[type[UnsafeSharedFileError], tuple[str, str]]:
        return (type(self), (str(self.strerror), self.path))


class ClosedError(KVTierError, RuntimeError):
    """The object was closed; no further calls are accepted."""


class BusyError(KVTierError, RuntimeError):
    """The resource is held by work in flight and cannot do what was asked now."""
