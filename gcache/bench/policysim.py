"""Fast hit-rate simulation of the eviction policies (gcache.tier.eviction) on a prefix trace.

The same policy objects the daemon runs, driven the way a daemon drives them, over blocks
instead of bytes: every page is one slot. A simulated cluster is ``nodes`` stores, each owning
the keys the client's consistent-hash ring gives it; each store has a RAM tier of
``ram_blocks / nodes`` slots under the policy and, optionally, an NVMe tier of
``disk_blocks / nodes`` slots: an append-only log cut into segments of ``segment_blocks``
records, the oldest segment reclaimed whole when a write would exceed the budget, as the
daemon's segment files are. The request flow is the replay's: ``exists`` on every block,
``get`` of the leading hits, ``put`` of the rest.

Store semantics kept: ``exists`` and ``get`` hits are references; an NVMe hit on ``get`` is
promoted into RAM as a reused entry and keeps its disk copy, so evicting it again writes
nothing; a put makes any disk copy unreachable (its record keeps its space until its segment
is reclaimed) and an existing RAM entry counts as a reference; a RAM victim is written to NVMe
when the policy admits it. Not simulated: the demotion queue (writes are instant), tombstones
(a few dozen bytes next to a page) and arena fragmentation (pages are equal).

``lru`` with ``nodes=1`` is the global LRU the issue compares against.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from gcache.bench.trace import BLOCK_TOKENS, HitAccounting, TraceRequest, leading_hits
from gcache.meta.ring import HashRing, key_hash
from gcache.tier.eviction import EvictionConfig, EvictionKind
from gcache.tier.policies import make_policy


@dataclass(frozen=True)
class SimConfig:
    """ram_blocks / disk_blocks: slots over the whole cluster (disk 0: RAM only);
    segment_blocks: records per NVMe segment (1: a block-granular FIFO)."""

    ram_blocks: int
    disk_blocks: int = 0
    nodes: int = 1
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    namespace: str = "hitrate"
    segment_blocks: int = 1

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ram_blocks < self.nodes or self.disk_blocks < 0 or self.segment_blocks < 1:
            raise ValueError(f"{self}: need nodes >= 1, ram_blocks >= nodes, disk_blocks >= 0, segment_blocks >= 1")


class SimDisk:
    """One daemon's NVMe log in slots: segments oldest first, reclaimed whole."""

    def __init__(self, slots: int, segment_slots: int) -> None:
        self.slots, self.segment_slots = slots, max(1, min(segment_slots, slots))
        self.segments: deque[tuple[int, list[int]]] = deque()  # (segment id, blocks written)
        self.where: dict[int, int] = {}  # block -> segment holding its current copy
        self.used = 0
        self._next = 0

    def __contains__(self, block: int) -> bool:
        return block in self.where

    def forget(self, block: int) -> None:
        self.where.pop(block, None)

    def append(self, block: int) -> None:
        while self.used + 1 > self.slots and len(self.segments) > 1:
            sid, blocks = self.segments.popleft()
            for b in blocks:
                if self.where.get(b) == sid:
                    del self.where[b]
            self.used -= len(blocks)
        if self.used + 1 > self.slots:
            return  # one segment fills the budget: the write fails, as on the daemon
        if not self.segments or len(self.segments[-1][1]) >= self.segment_slots:
            self.segments.append((self._next, []))
            self._next += 1
        sid, blocks = self.segments[-1]
        blocks.append(block)
        self.where[block] = sid
        self.used += 1


class SimStore:
    """One daemon's store in slots."""

    def __init__(self, ram_slots: int, disk_slots: int, eviction: EvictionConfig, segment_slots: int = 1) -> None:
        self.ram_slots = ram_slots
        self.policy = make_policy(eviction, ram_slots)
        self.ram: dict[int, bool] = {}  # block -> an identical copy is on disk
        self.disk = SimDisk(disk_slots, segment_slots) if disk_slots > 0 else None
        self.evictions = self.demotions = 0

    def exists(self, key: int) -> bool:
        if key in self.ram:
            self.policy.hit(key)
            return True
        return self.disk is not None and key in self.disk

    def get(self, key: int) -> bool:
        if key in self.ram:
            self.policy.hit(key)
            return True
        if self.disk is None or key not in self.disk:
            return False
        self._make_room()
        self.ram[key] = True
        self.policy.insert(key, 1, reused=True)
        return True

    def put(self, key: int) -> None:
        if self.disk is not None:
            self.disk.forget(key)
        if key not in self.ram:
            self._make_room()
        self.ram[key] = False
        self.policy.insert(key, 1)

    def _make_room(self) -> None:
        while len(self.ram) >= self.ram_slots:
            victim = cast(int, next(iter(self.policy.candidates())))
            to_disk = self.disk is not None and not self.ram[victim] and self.policy.admit_to_disk(victim)
            self.policy.remove(victim, evicted=True)
            del self.ram[victim]
            self.evictions += 1
            if to_disk:
                assert self.disk is not None
                self.disk.append(victim)
                self.demotions += 1


def simulate(requests: Sequence[TraceRequest], cfg: SimConfig, block_tokens: int = BLOCK_TOKENS) -> HitAccounting:
    """Token hit accounting of the replay against a simulated cluster."""
    n = cfg.nodes
    stores = [SimStore(cfg.ram_blocks // n, cfg.disk_blocks // n, cfg.eviction, cfg.segment_blocks)
              for _ in range(n)]
    owner: dict[int, SimStore] = {}
    if n > 1:
        ring = HashRing({f"node{i}": 1.0 for i in range(n)})
        blocks = list({h for r in requests for h in r.hash_ids})
        hashes = np.array([key_hash(cfg.namespace, str(h).encode()) for h in blocks], dtype=np.uint64)
        owner = {h: stores[i] for h, i in zip(blocks, ring.owner_indices(hashes).tolist())}
    else:
        owner = {h: stores[0] for r in requests for h in r.hash_ids}
    acc = HitAccounting()
    for req in requests:
        ids = req.hash_ids
        k = leading_hits([owner[h].exists(h) for h in ids])
        k = leading_hits([owner[h].get(h) for h in ids[:k]])
        for h in ids[k:]:
            owner[h].put(h)
        acc.add(req, k, block_tokens)
    return acc


def global_lru(requests: Sequence[TraceRequest], capacity_blocks: int, block_tokens: int = BLOCK_TOKENS) -> HitAccounting:
    """One LRU cache of ``capacity_blocks`` pages: the issue's reference."""
    return simulate(requests, SimConfig(max(capacity_blocks, 1), eviction=EvictionConfig(EvictionKind.LRU)),
                    block_tokens)
