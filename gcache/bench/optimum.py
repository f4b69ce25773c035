"""The offline optimum of a prefix trace at a given capacity: Belady with prefix semantics.

Every block of every request is referenced in prompt order. A request's hit is the leading run
of its blocks that are cached when it arrives (as in the replay). Then each block is referenced:
a cached one gets its next reference time updated, a missing one is written back (as the engine
writes it) and the cached block whose next reference is farthest in the future is evicted
(possibly the one just written: a block never used again is not worth a slot). A reference's
"next use" is the next position in the whole reference stream where the same block appears;
"never" is farther than everything.

This is the bound the issue set the policies against: an online policy cannot see the future,
so it reaches this only when the trace makes the future obvious. Pure: no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from gcache.bench.trace import BLOCK_TOKENS, HitAccounting, TraceRequest, leading_hits

NEVER = 1 << 62


def next_uses(requests: Sequence[TraceRequest]) -> list[int]:
    """For each reference (block of a request, in trace order), the index of the next reference
    to the same block, or NEVER."""
    stream = [h for r in requests for h in r.hash_ids]
    out = [NEVER] * len(stream)
    last: dict[int, int] = {}
    for i in range(len(stream) - 1, -1, -1):
        h = stream[i]
        out[i] = last.get(h, NEVER)
        last[h] = i
    return out


def belady(requests: Sequence[TraceRequest], capacity_blocks: int, block_tokens: int = BLOCK_TOKENS,
           nxt: list[int] | None = None) -> HitAccounting:
    """Token hit accounting of the offline-optimal cache of ``capacity_blocks`` blocks.
    ``nxt``: next_uses(requests), when several capacities are evaluated."""
    if capacity_blocks < 0:
        raise ValueError("capacity_blocks must be >= 0")
    nxt = next_uses(requests) if nxt is None else nxt
    cached: dict[int, int] = {}  # block -> index of its next reference
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries are skipped
    acc = HitAccounting()
    t = 0
    for req in requests:
        acc.add(req, leading_hits([h in cached for h in req.hash_ids]), block_tokens)
        for h in req.hash_ids:
            n = nxt[t]
            t += 1
            cached[h] = n
            heapq.heappush(heap, (-n, h))
            while len(cached) > capacity_blocks:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
        if len(heap) > 4 * max(len(cached), 1024):  # drop stale entries now and then
            heap = [(-n, h) for h, n in cached.items()]
            heapq.heapify(heap)
    return acc


def lru_oracle_admission(requests: Sequence[TraceRequest], capacity_blocks: int, block_tokens: int = BLOCK_TOKENS,
                         nxt: list[int] | None = None) -> HitAccounting:
    """An LRU cache behind a perfect admission filter: a missing block is written back only if
    it will be referenced again; everything else is plain LRU (a cached block stays until it is
    the least recently used, even after its last use). The best any admission filter in front of
    LRU can do; TinyLFU and S3-FIFO's small queue and ghost approximate such a filter online."""
    from collections import OrderedDict

    nxt = next_uses(requests) if nxt is None else nxt
    cached: OrderedDict[int, None] = OrderedDict()
    acc = HitAccounting()
    t = 0
    for req in requests:
        acc.add(req, leading_hits([h in cached for h in req.hash_ids]), block_tokens)
        for h in req.hash_ids:
            again = nxt[t] != NEVER
            t += 1
            if h in cached:
                cached.move_to_end(h)
            elif again and capacity_blocks > 0:
                cached[h] = None
                if len(cached) > capacity_blocks:
                    cached.popitem(last=False)
    return acc
