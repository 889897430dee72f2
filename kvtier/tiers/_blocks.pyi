"""Types of the compiled helper ``_blocks.c`` (see kvtier.tiers.block_format)."""

from collections.abc import Sequence

def checksum(buffer: object, /) -> int: ...
def checksums(buffers: Sequence[object], /) -> list[int]: ...
def seal(
    page: object,
    key: bytes,
    namespace: bytes,
    payload_bytes: int,
    payload_checksum: int,
    stored_at: int,
    version: int = ...,
    /,
) -> None: ...
def verify(page: object, key: bytes, namespace: bytes, payload: object, /) -> int: ...
def seal_many(
    pages: list[memoryview],
    keys: list[bytes],
    namespace: bytes,
    payload_bytes: int,
    checksums: list[int],
    stored_at: int,
    /,
) -> None: ...
def verify_reaped(
    pages: list[memoryview],
    keys: list[bytes],
    namespace: bytes,
    payloads: list[memoryview],
    done: list[tuple[int, int, BaseException | None]],
    expected: int,
    /,
) -> list[tuple[int, int]]: ...
