"""Encoder affinity: a consistent-hash ring over encoder workers keyed by media hash.

The same image/audio/video always goes to the same encoder while the encoder set
is unchanged, and adding or removing one encoder moves only ~1/N of the keys, so
repeated media hit the encoder's cache.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import xxhash


class EncoderRing:
    """Encoder workers (URLs) on a consistent-hash ring, ``vnodes`` points each, keyed by media
    hash. Not gcache's key-placement ring (gcache.meta.ring.HashRing, weighted by capacity and
    shared by every client): this one only picks the encoder whose cache likely holds a
    request's image, and only the router computes it."""

    def __init__(self, nodes: Iterable[str], vnodes: int = 64) -> None:
        if vnodes <= 0:
            raise ValueError("vnodes must be > 0")
        self.vnodes = vnodes
        self.nodes = sorted(set(nodes))
        points = []
        for n in self.nodes:
            for v in range(vnodes):
                points.append((xxhash.xxh3_64_intdigest(f"{n}#{v}".encode()), n))
        points.sort()
        self._keys = [p[0] for p in points]
        self._owners = [p[1] for p in points]

    def __repr__(self) -> str:
        return f"EncoderRing(nodes={self.nodes}, vnodes={self.vnodes})"

    def __len__(self) -> int:
        return len(self.nodes)

    def owner(self, key: bytes | str) -> str:
        """The node owning ``key``. Raises LookupError on an empty ring."""
        if not self._keys:
            raise LookupError("no encoder workers on the ring")
        if isinstance(key, str):
            key = key.encode()
        h = xxhash.xxh3_64_intdigest(key)
        i = bisect.bisect_right(self._keys, h) % len(self._keys)
        return self._owners[i]
