"""Caller buffers as flat byte views (gcache.client.buffers) and the device-tensor check."""

import numpy as np
import pytest

from gcache.client.buffers import as_view
from gcache.client.staging import is_device_tensor


def test_plain_buffers_become_flat_byte_views_over_the_same_memory():
    b = b"abcdef"
    v = as_view(b)
    assert v.readonly and v.obj is b and bytes(v) == b
    ba = bytearray(b"xyz")
    w = as_view(ba, writable=True)
    w[0] = ord("X")
    assert ba == b"Xyz"
    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    flat = as_view(arr)
    assert flat.format == "B" and flat.ndim == 1 and len(flat) == arr.nbytes
    assert as_view(memoryview(arr)).nbytes == arr.nbytes


def test_what_cannot_be_a_flat_buffer_is_refused_with_the_reason():
    with pytest.raises(TypeError, match="read-only"):
        as_view(b"abc", writable=True)  # get_into cannot write into bytes
    with pytest.raises(ValueError, match="C-contiguous"):
        as_view(np.zeros((4, 4), np.uint8)[:, 1])
    with pytest.raises(TypeError, match="does not expose a buffer"):
        as_view(12345)


def test_host_buffers_are_not_device_tensors():
    for obj in (b"x", bytearray(1), memoryview(b"x"), np.zeros(3), "text", 7):
        assert not is_device_tensor(obj)
