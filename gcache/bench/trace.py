"""Prefix-hit arithmetic over Mooncake-format request traces (pure, no I/O).

The trace format, its units and the reader are in :mod:`gcache.mooncake_trace` (shared with
``gcache-router sim``); its names are re-exported here. A request's cached prefix is the longest
run of its leading blocks that the cache holds: a block after a missing one is useless to the
engine (it needs every earlier page), so it never counts as a hit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gcache.mooncake_trace import BLOCK_TOKENS, TraceError, TraceRequest, load_trace, parse_line

__all__ = [
    "BLOCK_TOKENS", "HitAccounting", "TraceError", "TraceRequest", "leading_hits", "load_trace", "parse_line",
    "scan_trace", "trace_max", "working_set_blocks",
]


def leading_hits(found: Sequence[bool]) -> int:
    """How many leading entries are true: the usable prefix."""
    n = 0
    for f in found:
        if not f:
            break
        n += 1
    return n


@dataclass
class HitAccounting:
    """Token hit rate overall and per ``window_s`` of trace time."""

    window_s: float = 60.0
    hit_tokens: int = 0
    input_tokens: int = 0
    requests: int = 0
    _windows: dict[int, list[int]] = field(default_factory=dict)

    def add(self, req: TraceRequest, hit_blocks: int, block_tokens: int = BLOCK_TOKENS) -> int:
        """Record a request whose first ``hit_blocks`` blocks hit; returns its hit tokens."""
        if not 0 <= hit_blocks <= len(req.hash_ids):
            raise ValueError(f"hit_blocks={hit_blocks} outside [0, {len(req.hash_ids)}]")
        hit = req.prefix_tokens(hit_blocks, block_tokens)
        self.hit_tokens += hit
        self.input_tokens += req.input_length
        self.requests += 1
        w = self._windows.setdefault(int(req.timestamp_ms / 1000 // self.window_s), [0, 0])
        w[0] += hit
        w[1] += req.input_length
        return hit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def series(self) -> list[list[float]]:
        """[[window start, s], [hit rate in that window]] for every window with traffic."""
        return [[k * self.window_s, h / t if t else 0.0] for k, (h, t) in sorted(self._windows.items())]


def trace_max(requests: Iterable[TraceRequest], block_tokens: int = BLOCK_TOKENS) -> HitAccounting:
    """The best any cache can do on this trace: infinite capacity, prefix-only matching, in
    arrival order (a block hits if any earlier request had it at that position)."""
    seen: set[int] = set()
    acc = HitAccounting()
    for req in requests:
        acc.add(req, leading_hits([h in seen for h in req.hash_ids]), block_tokens)
        seen.update(req.hash_ids)
    return acc


def working_set_blocks(requests: Iterable[TraceRequest]) -> int:
    """Distinct blocks in the trace: the pages a cache needs to never forget anything."""
    return len({h for r in requests for h in r.hash_ids})


def scan_trace(capacity_blocks: int, hot_blocks: int = 8, warm: int = 3, scan_factor: int = 10,
               every_factor: float = 2.0, chain: int = 8, block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """An adversarial trace for a cache of ``capacity_blocks``: a hot chain of ``hot_blocks``
    requested ``warm`` times, then a scan of ``scan_factor`` x the capacity in new blocks
    (chains of ``chain``), with the hot chain requested again after every ``every_factor`` x the
    capacity of scanned blocks: too far apart for LRU to keep it. Only the hot chain can ever hit,
    so the hit rate over the trace maximum is the share of hot requests served from cache."""
    hot = tuple(range(hot_blocks))
    reqs = [TraceRequest(i, hot_blocks * block_tokens, 0, hot) for i in range(warm)]
    every = max(1, int(every_factor * capacity_blocks))
    nxt, since = hot_blocks, 0
    while nxt - hot_blocks < scan_factor * capacity_blocks:
        reqs.append(TraceRequest(len(reqs), chain * block_tokens, 0, tuple(range(nxt, nxt + chain))))
        nxt += chain
        since += chain
        if since >= every:
            reqs.append(TraceRequest(len(reqs), hot_blocks * block_tokens, 0, hot))
            since = 0
    return reqs
