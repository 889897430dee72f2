"""Types of the compiled helper ``_blocks.c`` (see kvtier.tiers._format)."""

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
