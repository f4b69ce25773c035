"""Extent allocator over a byte range: best fit, coalescing free, byte-exact accounting.

Pure object, no I/O and no locking (the caller's store lock protects it). Sizes are rounded
up to ALIGN bytes so every slot starts on a cache line.
"""

from __future__ import annotations

from sortedcontainers import SortedList

ALIGN = 64


def aligned(size: int) -> int:
    return (max(size, 1) + ALIGN - 1) & ~(ALIGN - 1)


class ExtentAllocator:
    def __init__(self, capacity: int) -> None:
        cap = capacity & ~(ALIGN - 1)
        if cap <= 0:
            raise ValueError(f"capacity {capacity} is smaller than one {ALIGN}-byte slot")
        self.capacity = cap
        self.used = 0
        self._by_start: dict[int, int] = {0: cap}  # start -> length of each free extent
        self._by_end: dict[int, int] = {cap: 0}  # end -> start
        self._by_size = SortedList([(cap, 0)])

    def __repr__(self) -> str:
        return f"ExtentAllocator(capacity={self.capacity}, used={self.used}, free_extents={len(self._by_start)})"

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def alloc(self, size: int) -> int | None:
        """Offset of a new slot of ``size`` bytes, or None if no free extent is large enough."""
        need = aligned(size)
        i = self._by_size.bisect_left((need, -1))
        if i == len(self._by_size):
            return None
        length: int
        start: int
        length, start = self._by_size.pop(i)
        del self._by_start[start]
        del self._by_end[start + length]
        if length > need:
            self._insert(start + need, length - need)
        self.used += need
        return start

    def free_slot(self, offset: int, size: int) -> None:
        """Return a slot obtained from alloc(size) at ``offset``; neighbours are merged."""
        length = aligned(size)
        start, end = offset, offset + length
        if end > self.capacity or start in self._by_start:
            raise ValueError(f"free of [{start}, {end}) which is not an allocated slot")
        nxt = self._by_start.get(end)
        if nxt is not None:
            self._remove(end, nxt)
            end += nxt
        prev = self._by_end.get(start)
        if prev is not None:
            self._remove(prev, start - prev)
            start = prev
        self._insert(start, end - start)
        self.used -= length

    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._by_size.add((length, start))

    def _remove(self, start: int, length: int) -> None:
        del self._by_start[start]
        del self._by_end[start + length]
        self._by_size.remove((length, start))
