"""Chained block hashes of a prompt and an approximate per-worker prefix index.

A prompt is cut into fixed-size blocks (token ids when the request carries them,
else text chunks). Block i's hash covers block i and, through the previous hash,
every block before it, so equal hash at position i means equal prefix up to i.
The index remembers which worker served which block hashes; it is approximate
(the worker may have evicted them) and bounded (per-worker LRU plus a TTL).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

_MASK63 = (1 << 63) - 1  # keep hashes positive so they print and store as plain ints


def chain_token_hashes(token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """Hash every full block of ``block_tokens`` token ids, each chained to the previous."""
    n_full = len(token_ids) // block_tokens
    if n_full == 0:
        return []
    arr = np.asarray(token_ids[: n_full * block_tokens], dtype=np.int64)
    buf = arr.tobytes()
    step = block_tokens * 8
    return _chain(memoryview(buf)[i * step : (i + 1) * step] for i in range(n_full))


def next_token_hash(prev: int, token_ids: Sequence[int]) -> int:
    """The chained hash of one block after a block whose hash is ``prev`` (0 before the first):
    ``chain_token_hashes(ids, b)[i] == next_token_hash(chain[i - 1], ids[i*b:(i+1)*b])``."""
    blk = np.asarray(token_ids, dtype=np.int64).tobytes()
    h = xxhash.xxh3_64_intdigest(blk, seed=0) ^ xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little"), seed=1)
    return h & _MASK63


def chain_text_hashes(text: str, block_chars: int) -> list[int]:
    """Hash every full chunk of ``block_chars`` characters, each chained to the previous."""
    n_full = len(text) // block_chars
    return _chain(text[i * block_chars : (i + 1) * block_chars].encode() for i in range(n_full))


def _chain(blocks: Iterable[bytes | memoryview]) -> list[int]:
    out: list[int] = []
    prev = b"\0" * 8
    for blk in blocks:
        h = xxhash.xxh3_64_intdigest(blk, seed=0) ^ xxhash.xxh3_64_intdigest(prev, seed=1)
        h &= _MASK63
        out.append(h)
        prev = h.to_bytes(8, "little")
    return out


class PrefixIndex:
    """Per-worker LRU of block hashes with a TTL; answers "how many leading blocks match".

    Pure and clock-free: callers pass ``now`` (seconds), so the simulator and tests
    are deterministic.
    """

    def __init__(self, max_blocks_per_worker: int, ttl_s: float) -> None:
        if max_blocks_per_worker <= 0:
            raise ValueError("max_blocks_per_worker must be > 0")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.max_blocks = max_blocks_per_worker
        self.ttl_s = ttl_s
        self._lru: dict[str, OrderedDict[int, float]] = {}

    def __repr__(self) -> str:
        sizes = {w: len(d) for w, d in self._lru.items()}
        return f"PrefixIndex(max_blocks={self.max_blocks}, ttl_s={self.ttl_s}, sizes={sizes})"

    def size(self, worker: str) -> int:
        return len(self._lru.get(worker, ()))

    def insert(self, worker: str, hashes: Sequence[int], now: float) -> None:
        """Record that ``worker`` now holds every block in ``hashes``; evicts LRU beyond the bound."""
        lru = self._lru.setdefault(worker, OrderedDict())
        for h in hashes:
            lru[h] = now
            lru.move_to_end(h)
        while len(lru) > self.max_blocks:
            lru.popitem(last=False)

    def match(self, worker: str, hashes: Sequence[int], now: float) -> int:
        """Number of leading blocks of ``hashes`` this worker is believed to hold."""
        lru = self._lru.get(worker)
        if not lru:
            return 0
        cutoff = now - self.ttl_s
        n = 0
        for h in hashes:
            t = lru.get(h)
            if t is None or t < cutoff:
                break
            n += 1
        return n

    def match_age(self, worker: str, hashes: Sequence[int], now: float) -> tuple[int, float]:
        """(leading blocks held, seconds since the last of them was last requested; inf if none)."""
        lru = self._lru.get(worker)
        if not lru:
            return 0, float("inf")
        cutoff = now - self.ttl_s
        n, last = 0, None
        for h in hashes:
            t = lru.get(h)
            if t is None or t < cutoff:
                break
            n += 1
            last = t
        return n, (now - last) if last is not None else float("inf")

    def match_all(self, workers: Iterable[str], hashes: Sequence[int], now: float) -> dict[str, int]:
        return {w: self.match(w, hashes, now) for w in workers}

    def remove_worker(self, worker: str) -> None:
        self._lru.pop(worker, None)

    def items(self, worker: str) -> list[tuple[int, float]]:
        """(hash, last_seen) pairs oldest first; used to resynchronise Redis."""
        return list(self._lru.get(worker, {}).items())

    def workers(self) -> list[str]:
        return sorted(self._lru)
