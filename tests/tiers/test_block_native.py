"""The compiled block helper (kvtier/tiers/_blocks.c) against the pure-Python format.

Both paths of :mod:`kvtier.tiers.block_format` must write and accept exactly the
same bytes: a tier written by one is read by the other (an install without a
C compiler, then one with).
"""

from __future__ import annotations

import os

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvtier.tiers import block_format as _format
from kvtier.tiers.block_format import (
    HEADER_BYTES,
    VERIFY_CHECKSUM,
    VERIFY_HEADER,
    VERIFY_KEY,
    VERIFY_NAMESPACE,
    VERIFY_OK,
    VERIFY_SIZE,
)

_blocks = pytest.importorskip("kvtier.tiers._blocks", reason="the C helper is not built")

KEY, NS = bytes(range(16)), bytes(range(16, 32))


def test_the_tier_uses_the_compiled_helper() -> None:
    # An install that built the helper must not silently run the Python path.
    assert _format.verify_block is _blocks.verify
    assert _format.seal_header is _blocks.seal


@given(
    key=st.binary(min_size=16, max_size=16),
    ns=st.binary(min_size=16, max_size=16),
    length=st.integers(min_value=0, max_value=2**64 - 1),
    check=st.integers(min_value=0, max_value=2**64 - 1),
    at=st.integers(min_value=-(2**40), max_value=2**40),
)
def test_seal_writes_the_python_bytes(
    key: bytes, ns: bytes, length: int, check: int, at: int
) -> None:
    py, c = bytearray(os.urandom(HEADER_BYTES)), bytearray(os.urandom(HEADER_BYTES))
    _format.encode_header_fields(memoryview(py), key, ns, length, check, at)
    _blocks.seal(memoryview(c), key, ns, length, check, at)
    assert c == py


@pytest.mark.parametrize("size", [0, 1, 240, 4096, 65536, 1 << 20], ids=lambda s: f"{s}B")
def test_checksums_are_xxh3(size: int) -> None:
    data = [os.urandom(size) for _ in range(3)]
    assert _blocks.checksums([memoryview(d) for d in data]) == [
        xxhash.xxh3_64_intdigest(d) for d in data
    ]
    assert _blocks.checksum(data[0]) == xxhash.xxh3_64_intdigest(data[0])


def _block(payload: bytes) -> bytearray:
    page = bytearray(HEADER_BYTES)
    _format.encode_header_fields(
        memoryview(page), KEY, NS, len(payload), xxhash.xxh3_64_intdigest(payload), 1
    )
    return page


def _cases() -> list[object]:
    """Good and bad blocks: (page, key, namespace, payload, expected outcome)."""
    payload = os.urandom(300 << 10)  # above the size hashed without the GIL
    good = _block(payload)
    flipped = bytearray(payload)
    flipped[12345] ^= 1
    torn = bytearray(good)
    torn[30] ^= 0xFF  # a key byte: the header checksum no longer matches
    version = bytearray(good)
    version[8] = 2
    return [
        pytest.param(good, KEY, NS, payload, VERIFY_OK, id="valid"),
        pytest.param(good, KEY, NS, bytes(flipped), VERIFY_CHECKSUM, id="payload-bit"),
        pytest.param(torn, KEY, NS, payload, VERIFY_HEADER, id="torn-header"),
        pytest.param(version, KEY, NS, payload, VERIFY_HEADER, id="other-version"),
        pytest.param(bytearray(HEADER_BYTES), KEY, NS, payload, VERIFY_HEADER, id="zero-header"),
        pytest.param(good, KEY, bytes(16), payload, VERIFY_NAMESPACE, id="other-namespace"),
        pytest.param(good, bytes(16), NS, payload, VERIFY_KEY, id="other-key"),
        pytest.param(good, KEY, NS, payload[:-4096], VERIFY_SIZE, id="other-size"),
        pytest.param(bytearray(good[:100]), KEY, NS, payload, VERIFY_HEADER, id="short-page"),
    ]


@pytest.mark.parametrize(("page", "key", "ns", "payload", "expected"), _cases())
def test_verify_agrees_with_python(
    page: bytearray, key: bytes, ns: bytes, payload: bytes, expected: int
) -> None:
    assert _blocks.verify(memoryview(page), key, ns, memoryview(payload)) == expected
    assert _format._verify_block_py(memoryview(page), key, ns, memoryview(payload)) == expected


def test_bad_arguments_raise() -> None:
    page = bytearray(HEADER_BYTES)
    with pytest.raises(ValueError, match="16 bytes"):
        _blocks.seal(page, b"short", NS, 0, 0, 0)
    with pytest.raises(ValueError, match="4096"):
        _blocks.seal(bytearray(10), KEY, NS, 0, 0, 0)
    with pytest.raises(BufferError):
        _blocks.seal(bytes(HEADER_BYTES), KEY, NS, 0, 0, 0)  # read-only
    with pytest.raises(TypeError):
        _blocks.verify(page, "not bytes", NS, b"")


def test_no_module_holds_the_python_fallbacks_once_the_helper_is_built() -> None:
    # A fresh interpreter: which module imports block_format first decides
    # nothing. A module that bound a name with ``from block_format import``
    # during block_format's own import (it loads the helper from inside the
    # file package) would keep the pure-Python function for ever.
    import subprocess
    import sys

    code = (
        "import sys, kvtier, kvtier.tiers.file, kvtier.tiers.cluster, kvtier.cli\n"
        "from kvtier.tiers import block_format as f\n"
        "slow = {id(getattr(f, n)) for n in dir(f) if n.endswith('_py')}\n"
        "bad = [f'{m}.{n}' for m, mod in list(sys.modules.items()) if m.startswith('kvtier')\n"
        "       and m != 'kvtier.tiers.block_format'\n"
        "       for n, v in vars(mod).items() if id(v) in slow]\n"
        "bad += [n for n in ('verify_reaped', 'seal_headers', 'verify_block', 'seal_header')\n"
        "        if id(getattr(f, n)) in slow]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
