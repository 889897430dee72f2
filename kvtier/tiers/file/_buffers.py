"""The caller's buffers: checked for a store or load, and cut for registering with the engine.

A store or load names one buffer per block; before any I/O is submitted each
must be one block long, contiguous, aligned for the slot file's I/O (and
writable for a load), or the call raises a typed error naming the first that
is not. The usual call (a list of CPU-region rows, as views) is checked in one
compiled call (:mod:`kvtier.transfer._address`), no copy; anything else takes
the Python checks, which convert what can be and name what cannot.

Apart from the tier because it is pure validation, with no state: the facade
calls :func:`check_buffers` once per call, never per block.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.errors import InvalidArgumentError
from kvtier.keys import check_keys
from kvtier.transfer.io_engine import IOEngine
from kvtier.transfer.uring import MAX_FIXED_BYTES, SPLIT_MIN

__all__ = ["check_buffers", "registration_pieces"]

try:
    # The compiled module whole, never a name from it: grimp reads .py files
    # only (tests/test_architecture.py says more).
    from kvtier.transfer import _address

    _check_views_c = _address.check_views
except ImportError:  # not built (no C compiler at install): the Python checks alone
    _check_views_c = None  # type: ignore[assignment]


def check_buffers(
    keys: Sequence[bytes],
    buffers: Sequence[memoryview],
    block_bytes: int,
    alignment: int,
    writable: bool = False,
) -> list[memoryview]:
    """The call's buffers as 1-D byte views, each one block, aligned for the slot file.

    Parameters
    ----------
    keys
        The call's keys, checked too (one buffer per key).
    buffers
        The call's buffers.
    block_bytes
        Payload bytes of every block.
    alignment
        The slot file's I/O alignment (1 with buffered I/O).
    writable
        True for a load: every buffer must be writable.

    Returns
    -------
    list[memoryview]
        The buffers, as byte views (the same objects when they already are).

    Raises
    ------
    InvalidArgumentError
        For bad keys, a count that differs from the keys', or the first buffer
        of the wrong size, not contiguous or read-only
        (:class:`~kvtier.errors.AlignmentError` for one not aligned).
    """
    check_keys(keys)
    if len(buffers) != len(keys):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(buffers)} buffers")
    if (
        _check_views_c is not None
        and type(buffers) is list
        and _check_views_c(buffers, block_bytes, alignment, writable) < 0
    ):
        # The usual call (rows of a region, as views): checked in one
        # compiled call, no copy. Anything else takes the checks below,
        # which convert what can be and name what cannot.
        return list(buffers)
    views = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers]
    for i, v in enumerate(views):
        if v.nbytes != block_bytes:
            raise InvalidArgumentError(
                f"buffer {i} has {v.nbytes} bytes, blocks have {block_bytes}"
            )
        if not v.c_contiguous:
            raise InvalidArgumentError(f"buffer {i} is not contiguous")
    views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
    IOEngine.check_aligned(views, 0, alignment)
    if writable:
        for v in views:
            if v.readonly:
                raise InvalidArgumentError("load buffers must be writable")
    return views


def registration_pieces(buffers: Sequence[object], block_bytes: int) -> list[memoryview]:
    """The pieces of ``buffers`` to register with the engine; ``[]`` when none should be.

    Pieces are whole blocks (the kernel takes at most 1 GiB per buffer): a
    row that straddled two would go as before, pages pinned per request.
    Blocks under :data:`~kvtier.transfer.uring.SPLIT_MIN` register nothing
    (see :meth:`FileTier.register_memory <kvtier.tiers.file.FileTier.register_memory>`).

    Raises
    ------
    InvalidArgumentError
        A buffer is not C-contiguous.
    """
    views = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers]  # type: ignore[arg-type]
    for v in views:
        if not v.c_contiguous:
            raise InvalidArgumentError("registered memory must be C-contiguous")
    if not views or block_bytes < SPLIT_MIN:
        return []
    step = max(1, MAX_FIXED_BYTES // block_bytes) * block_bytes
    pieces: list[memoryview] = []
    for v in views:
        v = v if v.format == "B" and v.ndim == 1 else v.cast("B")
        pieces += [v[i : i + step] for i in range(0, v.nbytes, step)]
    return pieces
