"""Headers sealed and blocks verified a run at a time: the compiled calls against the Python."""

from __future__ import annotations

import mmap
import os

import pytest

from kvtier.tiers import block_format as _format
from kvtier.tiers.block_format import (
    HEADER_BYTES,
    VERIFY_CHECKSUM,
    VERIFY_KEY,
    VERIFY_NAMESPACE,
    VERIFY_TRANSFER,
    checksums,
)

_blocks = pytest.importorskip("kvtier.tiers._blocks", reason="the C helper is not built")

NS = bytes(range(16, 32))
N, PAYLOAD = 6, 8192


def _run() -> tuple[list[memoryview], list[bytes], list[memoryview]]:
    pages = memoryview(mmap.mmap(-1, N * HEADER_BYTES))
    payloads = memoryview(bytearray(os.urandom(N * PAYLOAD)))
    return (
        [pages[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] for i in range(N)],
        [bytes([i]) * 16 for i in range(N)],
        [payloads[i * PAYLOAD : (i + 1) * PAYLOAD] for i in range(N)],
    )


def test_the_tier_uses_the_compiled_batch_calls() -> None:
    assert _format.seal_headers is _blocks.seal_many
    assert _format.verify_reaped is _blocks.verify_reaped


@pytest.mark.parametrize("compiled", [True, False], ids=["c", "python"])
def test_sealed_runs_are_the_bytes_of_one_header_at_a_time(compiled: bool) -> None:
    pages, keys, payloads = _run()
    seal = _blocks.seal_many if compiled else _format._seal_headers_py
    sums = checksums(payloads)
    seal(pages, keys, NS, PAYLOAD, sums, 1234)
    one = bytearray(HEADER_BYTES)
    for page, key, summed in zip(pages, keys, sums, strict=True):
        _format.encode_header_fields(memoryview(one), key, NS, PAYLOAD, summed, 1234)
        assert bytes(page) == bytes(one)


def _reaped(
    which: list[int], nbytes: int = PAYLOAD + HEADER_BYTES
) -> list[tuple[int, int, BaseException | None]]:
    return [(i, nbytes, None) for i in which]


@pytest.mark.parametrize("compiled", [True, False], ids=["c", "python"])
def test_verify_reports_each_failure_and_only_those_reaped(compiled: bool) -> None:
    pages, keys, payloads = _run()
    _format.seal_headers(pages, keys, NS, PAYLOAD, checksums(payloads), 0)
    verify = _blocks.verify_reaped if compiled else _format._verify_reaped_py
    whole = PAYLOAD + HEADER_BYTES
    assert verify(pages, keys, NS, payloads, _reaped(list(range(N))), whole) == []
    payloads[1][100] ^= 0xFF  # one flipped payload bit
    keys[3] = bytes(16)  # a slot holding another block
    other = keys[:]
    failures = verify(pages, other, bytes(16), payloads, _reaped([0]), whole)
    assert failures == [(0, VERIFY_NAMESPACE)]
    assert verify(pages, keys, NS, payloads, _reaped([5, 4, 3, 2, 1, 0]), whole) == [
        (3, VERIFY_KEY),
        (1, VERIFY_CHECKSUM),
    ]
    # Blocks not reaped are not checked.
    assert verify(pages, keys, NS, payloads, _reaped([0, 2, 4, 5]), whole) == []
    # A read that failed or came back short is a transfer failure, whatever
    # its buffers hold (here a sound block, and a corrupt one).
    reaped: list[tuple[int, int, BaseException | None]] = [
        (0, 0, OSError(5, "EIO")),
        (2, whole - 512, None),
        (1, whole, OSError(5, "EIO")),
    ]
    assert verify(pages, keys, NS, payloads, reaped, whole) == [
        (0, VERIFY_TRANSFER),
        (2, VERIFY_TRANSFER),
        (1, VERIFY_TRANSFER),
    ]


def test_verify_refuses_what_an_engine_never_reports() -> None:
    pages, keys, payloads = _run()
    whole = PAYLOAD + HEADER_BYTES
    with pytest.raises(IndexError):
        _blocks.verify_reaped(pages, keys, NS, payloads, _reaped([N]), whole)
    with pytest.raises(TypeError):
        _blocks.verify_reaped(pages, keys, NS, payloads, [0], whole)
    with pytest.raises(ValueError, match="one key and payload per page"):
        _blocks.verify_reaped(pages, keys[1:], NS, payloads, _reaped([0]), whole)
