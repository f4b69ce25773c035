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


def test_odd_buffers_get_a_typed_error_or_work():
    """A probe: an object-dtype array was stored (its bytes are pointers into the writer's
    process), an empty 2-D array raised memoryview's own TypeError, a datetime64 array numpy's
    ValueError, a lone-surrogate key UnicodeEncodeError."""
    from gcache.client.keys import key_bytes

    with pytest.raises(TypeError, match="Python objects"):
        as_view(np.array([object(), object()], dtype=object))
    empty = np.zeros((0, 5), np.float32)
    assert as_view(empty).nbytes == 0 and as_view(empty, writable=True).nbytes == 0
    with pytest.raises(TypeError, match="does not expose a buffer"):
        as_view(np.array(["2026-01-01"], dtype="datetime64[D]"))
    with pytest.raises(ValueError, match="UTF-8"):
        key_bytes("a\udc80b")
    torch = pytest.importorskip("torch")
    expanded = torch.zeros(1, 4).expand(3, 4)  # stride 0: not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        as_view(expanded)
    conj = torch.zeros(4, dtype=torch.complex64).conj()
    try:
        view = as_view(conj)
    except ValueError as exc:
        assert "clone" in str(exc) or "contiguous" in str(exc)
    else:
        assert view.nbytes == 32
