"""Fast hit-rate simulation of the eviction policies (gcache.tier.eviction) on a prefix trace.

The same policy objects the daemon runs, driven the way a daemon drives them, over blocks
instead of bytes: every page is one slot. A simulated cluster is ``nodes`` stores, each owning
the keys the client's consistent-hash ring gives it; each store has a RAM tier of
``ram_blocks / nodes`` slots under the policy and, optionally, an NVMe tier of
``disk_blocks / nodes`` slots reclaimed oldest-write first (the segment files, one block per
record). The request flow is the replay's: ``exists`` on every block, ``get`` of the leading
hits, ``put`` of the rest.

Store semantics kept: ``exists`` and ``get`` hits are references; an NVMe hit on ``get`` is
promoted into RAM as a reused entry and keeps its disk copy, so evicting it again writes
nothing unless the policy refreshes it (``refresh_on_disk``); a put drops any disk copy (an overwrite) and an existing RAM entry counts as a
reference; a RAM victim is written to NVMe when the policy admits it. Not simulated: the
demotion queue (writes are instant) and arena fragmentation (pages are equal).

``lru`` with ``nodes=1`` is the global LRU the issue compares against.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gcache.bench.trace import BLOCK_TOKENS, HitAccounting, TraceRequest, leading_hits
from gcache.meta.ring import HashRing, key_hash
from gcache.tier.eviction import EvictionConfig, EvictionKind, make_policy


@dataclass(frozen=True)
class SimConfig:
    """ram_blocks / disk_blocks: slots over the whole cluster (disk 0: RAM only)."""

    ram_blocks: int
    disk_blocks: int = 0
    nodes: int = 1
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    namespace: str = "hitrate"

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ram_blocks < self.nodes or self.disk_blocks < 0:
            raise ValueError(f"{self}: need nodes >= 1, ram_blocks >= nodes, disk_blocks >= 0")


class SimStore:
    """One daemon's store in slots."""

    def __init__(self, ram_slots: int, disk_slots: int, eviction: EvictionConfig) -> None:
        self.ram_slots, self.disk_slots = ram_slots, disk_slots
        self.policy = make_policy(eviction, ram_slots)
        self.ram: dict[int, bool] = {}  # block -> an identical copy is on disk
        self.disk: OrderedDict[int, None] = OrderedDict()  # oldest write first
        self.evictions = self.demotions = 0

    def exists(self, key: int) -> bool:
        if key in self.ram:
            self.policy.hit(key)
            return True
        return key in self.disk

    def get(self, key: int) -> bool:
        if key in self.ram:
            self.policy.hit(key)
            return True
        if key not in self.disk:
            return False
        self._make_room()
        self.ram[key] = True
        self.policy.insert(key, 1, reused=True)
        return True

    def put(self, key: int) -> None:
        self.disk.pop(key, None)
        if key in self.ram:
            self.ram[key] = False
            self.policy.insert(key, 1)
            return
        self._make_room()
        self.ram[key] = False
        self.policy.insert(key, 1)

    def _make_room(self) -> None:
        while len(self.ram) >= self.ram_slots:
            victim = next(iter(self.policy.candidates()))
            on_disk = self.ram[victim] and not self.policy.refresh_on_disk(victim)
            to_disk = self.disk_slots > 0 and not on_disk and self.policy.admit_to_disk(victim)
            self.policy.remove(victim, evicted=True)
            del self.ram[victim]
            self.evictions += 1
            if to_disk:
                self.disk.pop(victim, None)  # a rewrite moves the copy to the newest end
                self.disk[victim] = None
                self.demotions += 1
                while len(self.disk) > self.disk_slots:
                    self.disk.popitem(last=False)


def simulate(requests: Sequence[TraceRequest], cfg: SimConfig, block_tokens: int = BLOCK_TOKENS) -> HitAccounting:
    """Token hit accounting of the replay against a simulated cluster."""
    n = cfg.nodes
    stores = [SimStore(cfg.ram_blocks // n, cfg.disk_blocks // n, cfg.eviction) for _ in range(n)]
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
