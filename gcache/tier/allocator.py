"""Extent allocator over a byte range: best fit, coalescing free, byte-exact accounting.

Pure object, no I/O and no locking (the caller's store lock protects it). Sizes are rounded
up to ALIGN bytes so every slot starts on a cache line.

A freed slot first goes to a quick list of its size (a few hundred slots in all), where the
next allocation of that size takes it back without touching the sorted extent list: KV pages
come in a few fixed sizes, so an overwrite or an eviction followed by a put of the same size
costs a dict and a list operation instead of several sorted-list updates. An allocation that
the extents cannot satisfy first returns every quick-listed slot to them (coalescing), so the
quick lists never make an allocation fail.
"""

from __future__ import annotations

from sortedcontainers import SortedList

ALIGN = 64
QUICK_SLOTS = 512  # freed slots kept on the quick lists, in all


def aligned(size: int) -> int:
    return (max(size, 1) + ALIGN - 1) & ~(ALIGN - 1)


class ExtentAllocator:
    def __init__(self, capacity: int, quick_slots: int = QUICK_SLOTS) -> None:
        cap = capacity & ~(ALIGN - 1)
        if cap <= 0:
            raise ValueError(f"capacity {capacity} is smaller than one {ALIGN}-byte slot")
        self.capacity = cap
        self.used = 0
        self._by_start: dict[int, int] = {0: cap}  # start -> length of each free extent
        self._by_end: dict[int, int] = {cap: 0}  # end -> start
        self._by_size = SortedList([(cap, 0)])
        self._quick: dict[int, list[int]] = {}  # aligned size -> free slots of that size, not in the extents
        self._quick_offs: set[int] = set()
        self.quick_slots = quick_slots

    def __repr__(self) -> str:
        return f"ExtentAllocator(capacity={self.capacity}, used={self.used}, free_extents={len(self._by_start)})"

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        """The largest contiguous free range (quick-listed slots are merged back first)."""
        self._flush_quick()
        return self._by_size[-1][0] if self._by_size else 0

    def free_extents(self) -> list[tuple[int, int]]:
        """(start, length) of each free range, quick-listed slots merged back first."""
        self._flush_quick()
        return list(self._by_start.items())

    def alloc(self, size: int) -> int | None:
        """Offset of a new slot of ``size`` bytes, or None if no free extent is large enough."""
        need = aligned(size)
        quick = self._quick.get(need)
        if quick:
            off = quick.pop()
            if not quick:
                del self._quick[need]
            self._quick_offs.discard(off)
            self.used += need
            return off
        i = self._by_size.bisect_left((need, -1))
        if i == len(self._by_size):
            if not self._quick_offs:
                return None
            self._flush_quick()
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
        if end > self.capacity or start in self._by_start or start in self._quick_offs:
            raise ValueError(f"free of [{start}, {end}) which is not an allocated slot")
        self.used -= length
        if len(self._quick_offs) < self.quick_slots:
            self._quick.setdefault(length, []).append(start)
            self._quick_offs.add(start)
            return
        self._coalesce(start, end)

    def _flush_quick(self) -> None:
        """Return every quick-listed slot to the extents."""
        quick, self._quick = self._quick, {}
        self._quick_offs.clear()
        for length, starts in quick.items():
            for start in starts:
                self._coalesce(start, start + length)

    def _coalesce(self, start: int, end: int) -> None:
        """Add the free range [start, end) to the extents, merged with its free neighbours."""
        nxt = self._by_start.get(end)
        if nxt is not None:
            self._remove(end, nxt)
            end += nxt
        prev = self._by_end.get(start)
        if prev is not None:
            self._remove(prev, start - prev)
            start = prev
        self._insert(start, end - start)

    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._by_size.add((length, start))

    def _remove(self, start: int, length: int) -> None:
        del self._by_start[start]
        del self._by_end[start + length]
        self._by_size.remove((length, start))
