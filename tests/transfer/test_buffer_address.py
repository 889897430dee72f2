"""buffer_address: the compiled helper and the ctypes / NumPy fallback agree on every buffer."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvtier.transfer._io_base import _buffer_address_py, buffer_address


def test_the_helper_is_built_in_this_checkout() -> None:
    # make and pip build it; without this a failed build would fall back silently.
    from kvtier.transfer._address import address

    m = mmap.mmap(-1, 8192)
    view = memoryview(m)[4096:]
    assert address(view) == buffer_address(view) == _buffer_address_py(view)
    view.release()
    m.close()


@pytest.mark.parametrize("start", [0, 1, 4096, 12345])
def test_writable_and_read_only_buffers_agree(start: int) -> None:
    m = mmap.mmap(-1, 1 << 16)
    try:
        view = memoryview(m)[start : start + 4096]
        assert buffer_address(view) == _buffer_address_py(view)
        # A read-only view of the same memory has the same address.
        assert buffer_address(view.toreadonly()) == buffer_address(view)
        view.release()
    finally:
        m.close()
    data = bytes(range(256)) * 64
    ro = memoryview(data)[start % 4096 :]
    assert buffer_address(ro) == _buffer_address_py(ro)


def test_numpy_array_address() -> None:
    a = np.zeros(1024, dtype=np.uint8)
    assert buffer_address(a.data) == a.ctypes.data
    assert buffer_address(a.data[100:]) == a.ctypes.data + 100


def test_a_non_contiguous_buffer_is_refused() -> None:
    a = np.zeros((16, 16), dtype=np.uint8)
    strided = a[:, ::2].data
    assert not strided.c_contiguous
    with pytest.raises((BufferError, TypeError, ValueError)):
        buffer_address(strided)
