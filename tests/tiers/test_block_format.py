from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.tiers.block_format import (
    HEADER_BYTES,
    BlockHeader,
    HeaderError,
    checksum,
    decode_header,
    decode_header_fields,
    encode_header,
    encode_header_fields,
    scan_header,
)


@given(
    key=st.binary(min_size=16, max_size=16),
    ns=st.binary(min_size=16, max_size=16),
    length=st.integers(min_value=0, max_value=2**40),
    check=st.integers(min_value=0, max_value=2**64 - 1),
    at=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_header_round_trip(key: bytes, ns: bytes, length: int, check: int, at: int) -> None:
    buf = bytearray(os.urandom(HEADER_BYTES))  # stale bytes must not leak into a header
    header = BlockHeader(
        key=key, namespace=ns, payload_bytes=length, payload_checksum=check, stored_at=at
    )
    encode_header(memoryview(buf), header)
    assert decode_header(memoryview(buf)) == header
    assert scan_header(memoryview(buf)) == (key, ns, length, at)
    assert decode_header_fields(memoryview(buf)) == (key, ns, length, at, check)
    assert buf[80:] == bytes(HEADER_BYTES - 80)
    # The file tier's hot path packs the fields directly: byte for byte the same,
    # over other stale bytes.
    direct = bytearray(os.urandom(HEADER_BYTES))
    encode_header_fields(memoryview(direct), key, ns, length, check, at)
    assert direct == buf


@pytest.mark.parametrize(
    ("at", "match"),
    [(0, "magic"), (8, "version"), (20, "checksum"), (30, "checksum"), (75, "checksum")],
    ids=["magic", "version", "length", "key", "header-checksum"],
)
def test_any_flipped_header_byte_is_refused(at: int, match: str) -> None:
    buf = bytearray(HEADER_BYTES)
    encode_header(memoryview(buf), BlockHeader(bytes(16), bytes(16), 4096, 1))
    good = bytes(buf)
    buf[at] ^= 0x01
    with pytest.raises(HeaderError):
        scan_header(memoryview(buf))  # the scan at open refuses what decode refuses
    buf[:] = good
    buf[at] ^= 0x40
    with pytest.raises(HeaderError, match=match):
        decode_header(memoryview(buf))


def test_short_header_and_checksum() -> None:
    with pytest.raises(HeaderError, match="shorter"):
        decode_header(memoryview(bytes(100)))
    assert checksum(memoryview(b"a" * 4096)) != checksum(memoryview(b"b" + b"a" * 4095))
