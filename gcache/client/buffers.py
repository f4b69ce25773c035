"""Caller buffers as flat byte memoryviews, without copying.

Accepts anything with the buffer protocol (bytes, bytearray, memoryview, mmap, numpy arrays)
and CPU torch tensors. Non-contiguous arrays are refused: copying them silently would hide a
cost the caller should see.
"""

from __future__ import annotations

from typing import Any


def _torch_view(obj: Any) -> memoryview | None:
    mod = type(obj).__module__
    if not mod.startswith("torch"):
        return None
    if obj.device.type != "cpu":
        raise TypeError(f"a {obj.device.type} tensor inside a list of parts cannot be staged; "
                        "pass device tensors as whole values")
    if not obj.is_contiguous():
        raise ValueError("tensor is not contiguous; call .contiguous() first")
    try:
        flat = obj.detach().reshape(-1)
        return memoryview(flat.view(__import__("torch").uint8).numpy())
    except RuntimeError as exc:  # a conjugate or negative view, a stride-0 expansion, ...
        raise ValueError(f"this tensor's memory cannot be used as a buffer ({exc}); pass a contiguous "
                         ".clone() of it") from None


def as_view(obj: Any, writable: bool = False) -> memoryview:
    """A flat, C-contiguous, unsigned-byte memoryview over ``obj``'s memory."""
    kind = type(obj)
    if kind is bytearray or (kind is bytes and not writable):  # always flat, contiguous bytes
        return memoryview(obj)
    if isinstance(obj, memoryview):
        view = obj
    else:
        tv = _torch_view(obj)
        if tv is not None:
            view = tv
        else:
            try:
                view = memoryview(obj)
            except (TypeError, ValueError) as exc:  # no buffer; or numpy's refusal (datetime64: ValueError)
                raise TypeError(f"{type(obj).__name__} does not expose a buffer (use bytes, bytearray, "
                                f"memoryview, a numpy array or a CPU tensor): {exc}") from None
    if "O" in view.format:  # object references: pointers into this process, meaningless as bytes
        raise TypeError(f"{type(obj).__name__} holds Python objects (format {view.format!r}), not data")
    if not view.c_contiguous:
        raise ValueError("buffer is not C-contiguous; make a contiguous copy first")
    if writable and view.readonly:
        raise TypeError(f"{type(obj).__name__} is read-only; get_into needs a writable buffer")
    if view.nbytes == 0:
        return memoryview(b"") if not writable else memoryview(bytearray())  # an empty array of any shape
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
