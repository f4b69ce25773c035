"""Checks of a batch call's arguments: its keys, a per-key argument given once or per key, a deadline."""

from __future__ import annotations

import math
from typing import Any

KeyLike = str | bytes


def key_bytes(key: KeyLike) -> bytes:
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        try:
            return key.encode()
        except UnicodeEncodeError as exc:  # a lone surrogate
            raise ValueError(f"key {key[:64]!r} cannot be encoded as UTF-8 ({exc.reason})") from None
    raise TypeError(f"keys are str or bytes, got {type(key).__name__}")


def check_keys(keys: object) -> None:
    """A batch takes a sequence of keys: a bare str or bytes would be taken as one key per
    character (or per byte), so it is refused; the *_one forms take a single key."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"keys must be a sequence of keys (str or bytes), got a bare {type(keys).__name__}: "
                        f"pass [key], or use the *_one form (put_one, get_one, exists_one)")


def per_key(name: str, v: Any, n: int, kind: type) -> Any:
    """A per-key argument given once for all keys (returned as is) or as one value per key (as
    a list of ``kind``)."""
    if isinstance(v, (int, float)):
        return kind(v)
    out = [kind(x) for x in v]
    if len(out) != n:
        raise ValueError(f"{n} keys but {len(out)} {name} values")
    return out


def check_deadline(deadline: float | None) -> None:
    """A call's ``deadline`` is None or a finite time.monotonic() value (NaN would never end a
    wait, and compares false with everything)."""
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or not math.isfinite(deadline)):
        raise ValueError(f"deadline must be a finite time.monotonic() value or None, got {deadline!r}")
