"""The value-metadata record: what a value carries besides its bytes, end to end.

One record travels with every value: client -> wire (PUT / LALLOC fields) -> RAM entry -> NVMe
segment record -> promotion back to RAM -> handover to a new owner -> GET replies that ask for
it. Nothing on the way drops a field:

* ``pool``: the daemon pool the value is tagged with (None: untagged). The tag is kept even when
  the daemon does not track the pool as a group (beyond ``Store.MAX_GROUPS``).
* ``pos``: the value's position in its page chain; ``tail``: 1 for a restore point's
  trailing-window page (both order eviction inside a pool, see gcache.tier.pools).
* ``ttl_s``: seconds left to live (0 = forever). Stored as an absolute wall-clock deadline and
  converted back to what is left when the record is handed on, so a handover does not extend it.
* ``fmt``: the writer's format tag, an unsigned 32-bit int gcache stores and returns but never
  interprets (0 = unspecified); for future use, e.g. page layout/dtype descriptors.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from gcache.tier.pools import MAX_POS, parse_pool_meta

MAX_FMT = (1 << 32) - 1
MAX_TTL_S = 1e9  # ~31 years: anything longer is "forever" said wrongly
_DISK = struct.Struct("<QBIB")  # pos, tail, fmt, pool length; then the pool name


@dataclass(frozen=True, slots=True)
class ValueMeta:
    pool: str | None = None
    pos: int = 0
    tail: int = 0
    ttl_s: float = 0.0
    fmt: int = 0

    def expires_at(self, now: float) -> float:
        """The absolute deadline (wall clock) of a value stored at ``now``; 0 = never."""
        return now + self.ttl_s if self.ttl_s > 0 else 0.0

    @staticmethod
    def ttl_left(expires: float, now: float) -> float:
        """Seconds left before ``expires`` (0 = never; a tiny positive number if just past)."""
        return max(expires - now, 1e-3) if expires else 0.0

    # -- on disk (gcache.tier.records): everything but the deadline, which the header holds --
    def encode(self) -> bytes:
        if self.pool is None and not (self.pos or self.tail or self.fmt):
            return b""
        pool = self.pool.encode() if self.pool is not None else b""
        return _DISK.pack(self.pos, self.tail, self.fmt, len(pool)) + pool  # pool names are never empty

    @classmethod
    def decode(cls, raw: bytes, ttl_s: float = 0.0) -> ValueMeta:
        """Inverse of encode(); raises ValueError for bytes encode() cannot have written."""
        if not raw:
            return cls(ttl_s=ttl_s)
        try:
            pos, tail, fmt, plen = _DISK.unpack_from(raw)
        except struct.error:
            raise ValueError("truncated value metadata") from None
        if len(raw) != _DISK.size + plen or tail > 1 or pos > MAX_POS:
            raise ValueError("malformed value metadata")
        pool = raw[_DISK.size:].decode() if plen else None
        return cls(pool, pos, tail, ttl_s, fmt)

    # -- on the wire: GET replies that asked for metadata -------------------------------------
    def to_wire(self) -> list[Any]:
        return [self.pool, self.pos, self.tail, self.ttl_s, self.fmt]

    @classmethod
    def from_wire(cls, v: Any) -> ValueMeta | None:
        if not isinstance(v, list) or len(v) != 5:
            return None
        pool, pos, tail, ttl, fmt = v
        return cls(pool if isinstance(pool, str) else None, int(pos), int(tail), float(ttl), int(fmt))


NO_META = ValueMeta()


def _per_key(meta: dict[str, Any], field: str, n: int, kind: type, lo: float, hi: float) -> list[Any] | str | None:
    """A field given once for the whole request or as one value per key; None when absent."""
    v = meta.get(field)
    if v is None:
        return None

    def ok(x: object) -> bool:
        return (type(x) is int or (kind is float and type(x) is float)) and lo <= x <= hi
    if isinstance(v, list):
        if len(v) != n or not all(ok(x) for x in v):
            return f"'{field}' must be one number in [{lo}, {hi}] per key, or one for all"
        return v
    if not ok(v):
        return f"'{field}' must be a number in [{lo}, {hi}] (or a list with one per key)"
    return [v] * n


def parse_value_meta(meta: dict[str, Any], n: int, op: str) -> list[ValueMeta] | str:
    """The value-metadata records of a PUT (or LALLOC) of ``n`` keys, or why the request is bad.

    Fields: ``pool``, ``pos``, ``tail`` (gcache.tier.pools.parse_pool_meta), ``ttl`` (seconds,
    one for all keys or one per key) and ``fmt`` (format tag, one for all or one per key)."""
    if not any(f in meta for f in ("pool", "pos", "tail", "ttl", "fmt")):
        return [NO_META] * n  # the common case: one shared record, no per-key work
    pooled = parse_pool_meta(meta, n, op)
    if isinstance(pooled, str):
        return pooled
    pool, pos, tail = pooled
    ttl = _per_key(meta, "ttl", n, float, 0, MAX_TTL_S)
    if isinstance(ttl, str):
        return ttl
    fmt = _per_key(meta, "fmt", n, int, 0, MAX_FMT)
    if isinstance(fmt, str):
        return fmt
    return [ValueMeta(pool, pos[i], tail[i] if tail else 0, float(ttl[i]) if ttl else 0.0, fmt[i] if fmt else 0)
            for i in range(n)]
