"""On-disk format of one block (one slot of the file tier's ``blocks.dat``).

A block is a fixed-size header followed by the payload (one CPU-region
row)::

    offset  size  field
    0       8     magic            b"KVTBLK\\x00\\x01"
    8       2     format version   1 (u16, little-endian, like every integer)
    10      2     header bytes     4096: where the payload starts
    12      4     flags            0 (reserved)
    16      8     payload bytes    length of the payload
    24      16    key              the block key (kvtier.keys, 16 bytes)
    40      16    namespace        KVLayout.namespace of the layout that wrote it
    56      4     checksum kind    1 = XXH3-64 of the payload
    60      4     stored at        seconds since the epoch (u32; 0 = unknown)
    64      8     payload checksum
    72      8     header checksum  XXH3-64 of bytes 0..72
    80      ...   zero padding up to ``header bytes``
    4096    n     payload

The header is one 4096-byte block so that the payload offset, the payload
length (a multiple of the alignment) and hence every slot's offset keep
O_DIRECT alignment, and so that header and payload are read and written by one
vectored request. The header checksum tells a torn or foreign header from a
payload that fails its checksum; a header of 4096 zero bytes marks a free
slot. "Stored at" (formerly reserved, so version 1 still reads it) orders the
blocks found at open by age.

The per-block path (:func:`checksum`, :func:`checksums`, :data:`seal_header`,
:data:`verify_block`, and :data:`seal_headers`, :data:`verify_reaped` for a run
of blocks in one call) runs in the compiled helper ``kvtier/tiers/_blocks.c``
beside this module when it is built, and in the pure Python below otherwise;
both write and accept exactly the same bytes (a test compares them).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

__all__ = [
    "CHECKSUM_XXH3_64",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "VERIFY_CHECKSUM",
    "VERIFY_HEADER",
    "VERIFY_KEY",
    "VERIFY_NAMESPACE",
    "VERIFY_OK",
    "VERIFY_SIZE",
    "VERIFY_TRANSFER",
    "BlockHeader",
    "HeaderError",
    "checksum",
    "checksums",
    "decode_header",
    "decode_header_fields",
    "encode_header",
    "encode_header_fields",
    "scan_header",
    "seal_header",
    "seal_headers",
    "verify_block",
    "verify_reaped",
]

MAGIC = b"KVTBLK\x00\x01"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
CHECKSUM_XXH3_64 = 1

_FIELDS = struct.Struct("<8sHHIQ16s16sIIQ")
_HCHECK = struct.Struct("<Q")
_CHECKED = _FIELDS.size  # 72 bytes covered by the header checksum
_SCANNED = struct.Struct(_FIELDS.format + "Q")  # the fields and the header checksum
_PADDING_START = _CHECKED + _HCHECK.size
_PADDING = bytes(HEADER_BYTES - _PADDING_START)


VERIFY_OK, VERIFY_HEADER, VERIFY_NAMESPACE, VERIFY_KEY, VERIFY_SIZE, VERIFY_CHECKSUM = range(6)
"""Outcomes of :func:`verify_block`: valid, or the first check that failed."""

VERIFY_TRANSFER = 6
""":data:`verify_reaped`'s outcome for a block whose read failed or came back short
(not checked further: its header page and payload hold what the read left)."""


def _checksum_py(payload: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _checksums_py(payloads: Sequence[memoryview]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(p) for p in payloads]


def checksum(payload: memoryview) -> int:
    """XXH3-64 of ``payload`` (measured above 20 GB/s on one core here)."""
    return _checksum(payload)


def checksums(payloads: Sequence[memoryview]) -> list[int]:
    """XXH3-64 of each payload; the compiled helper releases the GIL once for all."""
    return _checksums(payloads)


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The decoded header of one block."""

    key: bytes
    """Block key the slot holds."""
    namespace: bytes
    """Namespace of the layout that wrote it."""
    payload_bytes: int
    """Length of the payload that follows the header."""
    payload_checksum: int
    """XXH3-64 of the payload."""
    version: int = FORMAT_VERSION
    """Format version."""
    stored_at: int = 0
    """Seconds since the epoch when the block was written (0 = unknown)."""


class HeaderError(ValueError):
    """A header that is not a valid kvtier block header (the reason in the message)."""


def encode_header(into: memoryview, header: BlockHeader) -> None:
    """Write ``header`` into the first :data:`HEADER_BYTES` of ``into`` (zero-padded)."""
    encode_header_fields(
        into,
        header.key,
        header.namespace,
        header.payload_bytes,
        header.payload_checksum,
        header.stored_at,
        header.version,
    )


def encode_header_fields(
    into: memoryview,
    key: bytes,
    namespace: bytes,
    payload_bytes: int,
    payload_checksum: int,
    stored_at: int,
    version: int = FORMAT_VERSION,
) -> None:
    """:func:`encode_header` from the fields, without building a :class:`BlockHeader`.

    The pure-Python encoder; the file tier's per-block path calls
    :data:`seal_header`, the compiled one when it is built.
    """
    into[_PADDING_START:HEADER_BYTES] = _PADDING
    _FIELDS.pack_into(
        into,
        0,
        MAGIC,
        version,
        HEADER_BYTES,
        0,
        payload_bytes,
        key,
        namespace,
        CHECKSUM_XXH3_64,
        stored_at & 0xFFFFFFFF,
        payload_checksum,
    )
    _HCHECK.pack_into(into, _CHECKED, xxhash.xxh3_64_intdigest(into[:_CHECKED]))


def _verify_block_py(page: memoryview, key: bytes, namespace: bytes, payload: memoryview) -> int:
    try:
        found, ns, payload_bytes, _, payload_checksum = decode_header_fields(page)
    except HeaderError:
        return VERIFY_HEADER
    if ns != namespace:
        return VERIFY_NAMESPACE
    if found != key:
        return VERIFY_KEY
    if payload_bytes != payload.nbytes:
        return VERIFY_SIZE
    if xxhash.xxh3_64_intdigest(payload) != payload_checksum:
        return VERIFY_CHECKSUM
    return VERIFY_OK


def decode_header_fields(data: memoryview) -> tuple[bytes, bytes, int, int, int]:
    """``(key, namespace, payload bytes, stored at, payload checksum)`` of a valid header.

    The checks of :func:`decode_header` without building a
    :class:`BlockHeader` (a frozen dataclass costs more than the checks): the
    file tier verifies one header per block loaded.

    Raises
    ------
    HeaderError
        For anything :func:`decode_header` refuses.
    """
    if len(data) < HEADER_BYTES:
        raise HeaderError(f"header is {len(data)} bytes, shorter than {HEADER_BYTES}")
    magic, version, hbytes, _f, payload, key, ns, kind, at, pcheck, hcheck = _SCANNED.unpack_from(
        data
    )
    if magic != MAGIC:
        raise HeaderError(f"not a kvtier block file (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise HeaderError(f"block format version {version} is not {FORMAT_VERSION}")
    if hcheck != xxhash.xxh3_64_intdigest(data[:_CHECKED]):
        raise HeaderError("header checksum mismatch (torn or overwritten header)")
    if hbytes != HEADER_BYTES or kind != CHECKSUM_XXH3_64:
        raise HeaderError(f"unsupported header (size {hbytes}, checksum kind {kind})")
    return key, ns, payload, at, pcheck


def scan_header(data: memoryview) -> tuple[bytes, bytes, int, int]:
    """``(key, namespace, payload bytes, stored at)`` of a valid header.

    The checks of :func:`decode_header` without building a
    :class:`BlockHeader`: a tier reopening a million slots reads each header
    once, and the object was half the cost.

    Raises
    ------
    HeaderError
        For anything :func:`decode_header` refuses.
    """
    key, ns, payload, at, _ = decode_header_fields(data)
    return key, ns, payload, at


def decode_header(data: memoryview) -> BlockHeader:
    """Parse and verify a header.

    Raises
    ------
    HeaderError
        For a wrong magic, an unknown version or checksum kind, a bad header
        checksum, or an impossible size.
    """
    key, ns, payload, at, pcheck = decode_header_fields(data)
    return BlockHeader(
        key=key, namespace=ns, payload_bytes=payload, payload_checksum=pcheck, stored_at=at
    )


_checksum: Callable[[memoryview], int] = _checksum_py
_checksums: Callable[[Sequence[memoryview]], list[int]] = _checksums_py

seal_header: Callable[[memoryview, bytes, bytes, int, int, int], None] = encode_header_fields
"""``seal_header(page, key, namespace, payload bytes, payload checksum, stored at)``:
:func:`encode_header_fields` of the current version, compiled when it is built
(one call per block stored)."""

verify_block: Callable[[memoryview, bytes, bytes, memoryview], int] = _verify_block_py
"""``verify_block(page, key, namespace, payload)``: check one block as read.

Returns :data:`VERIFY_OK`, or the first check that failed: the header must be
valid (:func:`decode_header_fields`, else :data:`VERIFY_HEADER`), of
``namespace`` (:data:`VERIFY_NAMESPACE`), of ``key`` (:data:`VERIFY_KEY`), of
``payload``'s length (:data:`VERIFY_SIZE`), and its payload checksum that of
``payload`` (:data:`VERIFY_CHECKSUM`). One call per block loaded, right after
its read is reaped: compiled, it allocates nothing and hashes payloads of
256 KiB or more with the GIL released. The reason of a header failure is
:func:`decode_header_fields`'s to tell (the failure path only)."""


def _seal_headers_py(
    pages: list[memoryview],
    keys: list[bytes],
    namespace: bytes,
    payload_bytes: int,
    sums: list[int],
    stored_at: int,
) -> None:
    for page, key, summed in zip(pages, keys, sums, strict=True):
        seal_header(page, key, namespace, payload_bytes, summed, stored_at)


def _verify_reaped_py(
    pages: list[memoryview],
    keys: list[bytes],
    namespace: bytes,
    payloads: list[memoryview],
    done: list[tuple[int, int, BaseException | None]],
    expected: int,
) -> list[tuple[int, int]]:
    out = [
        (
            i,
            VERIFY_TRANSFER
            if exc is not None or moved != expected
            else verify_block(pages[i], keys[i], namespace, payloads[i]),
        )
        for i, moved, exc in done
    ]
    return [(i, code) for i, code in out if code != VERIFY_OK]


seal_headers: Callable[[list[memoryview], list[bytes], bytes, int, list[int], int], None] = (
    _seal_headers_py
)
"""``seal_headers(pages, keys, namespace, payload bytes, checksums, stored at)``:
:data:`seal_header` of each page with its key and checksum, one call per run
of blocks stored."""

verify_reaped: Callable[
    [
        list[memoryview],
        list[bytes],
        bytes,
        list[memoryview],
        list[tuple[int, int, BaseException | None]],
        int,
    ],
    list[tuple[int, int]],
] = _verify_reaped_py
"""``verify_reaped(pages, keys, namespace, payloads, done, expected)``: for each
``(i, bytes, error)`` an I/O engine reported for block ``i``'s read,
:data:`VERIFY_TRANSFER` when it failed or moved other than ``expected`` bytes,
else :data:`verify_block` of block ``i``; the ``(i, outcome)`` of the blocks
that failed (an empty list when all are sound). One call per run of reads
reaped, with the engine's outcomes as they came."""

try:
    from kvtier.tiers import _blocks
except ImportError:  # not built (no C compiler at install): the Python above
    pass
else:
    _checksum, _checksums = _blocks.checksum, _blocks.checksums
    seal_header, verify_block = _blocks.seal, _blocks.verify
    seal_headers, verify_reaped = _blocks.seal_many, _blocks.verify_reaped
