"""Window-safe prefix matching (pure): which prefix lengths can be restored.

A prefix of L pages is restorable only if every KV page in [0, L) exists and, for each side
pool, its hit policy holds at L:

* ALL_PAGES: the pool's pages [0, L) all exist;
* TRAILING_PAGES with window w: the pool's pages [max(0, L - w), L) exist (SWA: the pages the
  sliding window attends to when decoding resumes after L).

Returns the whole set of legal stop points, not only the longest: a trailing-window pool leaves
holes (5 may be restorable while 4 is not) and SGLang intersects the sets across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PoolCheck:
    name: str
    exists: list[bool]  # per page of the queried span
    trailing: int | None = None  # None: ALL_PAGES; else TRAILING_PAGES with this many pages


@dataclass
class WindowResult:
    kv_pages: int
    pool_hits: dict[str, int] = field(default_factory=dict)
    restorable: list[int] = field(default_factory=list)

    @property
    def final_pages(self) -> int:
        return self.restorable[-1] if self.restorable else 0


def leading(exists: list[bool]) -> int:
    """Count of consecutive True from the start."""
    for i, ok in enumerate(exists):
        if not ok:
            return i
    return len(exists)


def window_safe(kv_exists: list[bool], pools: list[PoolCheck]) -> WindowResult:
    kv_pages = leading(kv_exists)
    res = WindowResult(kv_pages, {"kv": kv_pages} if kv_pages else {})
    restorable = set(range(1, kv_pages + 1))
    for pool in pools:
        ex = pool.exists
        if pool.trailing is None:
            ok = set(range(1, min(leading(ex), kv_pages) + 1))
        else:
            w = max(1, pool.trailing)
            # missing[i]: count of missing pages in [0, i); a window is whole when none is missing
            missing = [0]
            for i in range(kv_pages):
                missing.append(missing[-1] + (0 if i < len(ex) and ex[i] else 1))
            ok = {n for n in range(1, kv_pages + 1) if missing[n] - missing[max(0, n - w)] == 0}
        if ok:
            res.pool_hits[pool.name] = max(ok)
        restorable &= ok
    res.restorable = sorted(restorable)
    return res
