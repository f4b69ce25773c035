"""RAM tier: arena slots, the key index (most recently used last) and the eviction policy of the
untagged entries (gcache.tier.eviction). No locking: the store's lock covers it."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from gcache.tier.allocator import ExtentAllocator
from gcache.tier.arena import Arena
from gcache.tier.eviction import EvictionConfig
from gcache.tier.policies import make_policy

if TYPE_CHECKING:
    from gcache.tier.pools import PoolGroup

Key = tuple[str, bytes]  # (namespace, key)


class RamEntry:
    """One value in the arena. ``pins`` counts readers copying out of the slot; a pinned slot is
    never reused, so an entry overwritten or evicted while pinned is only marked ``dead`` and its
    slot is freed by the last unpin. ``group``/``pos``/``tail``/``okey``: pool membership, chain
    position, restore-point mark and eviction order key (see gcache.tier.pools); None/0 when
    untagged. ``pool``/``pos``/``tail``/``fmt``/``expires`` are the value-metadata record."""

    __slots__ = ("dead", "expires", "fmt", "group", "off", "okey", "on_disk", "pins", "pool", "pos", "seq", "size",
                 "superseded", "tail")

    def __init__(self, off: int, size: int, expires: float, on_disk: bool = False) -> None:
        self.off = off
        self.size = size
        self.expires = expires  # wall-clock seconds; 0 = never
        self.pins = 0
        self.dead = False
        self.on_disk = on_disk  # an identical copy is indexed in the NVMe tier
        self.superseded = False  # set while demoting if the key was overwritten or deleted
        self.group: PoolGroup | None = None
        self.pos = 0
        self.tail = 0
        self.okey: tuple[Any, ...] = ()
        self.pool: str | None = None  # pool tag, kept even when ``group`` is None (pool not tracked)
        self.fmt = 0  # the writer's format tag (gcache.tier.valuemeta)
        self.seq = 0  # the store's sequence number of the write that made this value

    def __repr__(self) -> str:
        return f"RamEntry(off={self.off}, size={self.size}, pins={self.pins}, dead={self.dead})"


class RamTier:
    def __init__(self, arena: Arena, recency_bucket_s: float = 1.0,
                 eviction: EvictionConfig | None = None) -> None:
        self.arena = arena
        self.alloc = ExtentAllocator(arena.size)
        self.policy = make_policy(eviction or EvictionConfig(), self.alloc.capacity)  # untagged entries
        self.index: OrderedDict[Key, RamEntry] = OrderedDict()
        self.value_bytes = 0  # sum of value sizes indexed (allocated bytes: alloc.used)
        self.recency_bucket_s = recency_bucket_s
        self.groups: dict[tuple[str, str], PoolGroup] = {}  # pooled entries, by (namespace, pool)
        self.untagged = 0  # entries in no pool (the plain LRU's victims)

    def bucket(self, now: float | None = None) -> int:
        """Recency bucket of wall-clock time ``now`` (pooled entries' eviction order)."""
        return int((time.time() if now is None else now) / self.recency_bucket_s)

    def __len__(self) -> int:
        return len(self.index)

    def lookup(self, key: Key, now: float) -> RamEntry | None:
        """The live entry for ``key``, moved to most-recently-used; an expired one is dropped."""
        return self.lookup_many([key], now)[0]

    def lookup_many(self, keys: Sequence[Key | None], now: float) -> list[RamEntry | None]:
        """lookup() of each key (None: a miss), in one loop: a batch's probes without a method
        call per key."""
        get, to_end = self.index.get, self.index.move_to_end
        out: list[RamEntry | None] = []
        hits = []  # untagged hits: the policy's references, in one call
        for key in keys:
            if key is None:
                out.append(None)
                continue
            e = get(key)
            if e is not None:
                if e.expires and e.expires <= now:
                    self.release(self.pop(key))
                    e = None
                else:
                    to_end(key)
                    if e.group is not None:
                        e.group.touch(key, e, self.bucket(now))
                    else:
                        hits.append(key)
            out.append(e)
        if hits:
            self.policy.hit_many(hits)
        return out

    def insert(self, key: Key, entry: RamEntry, reused: bool = False) -> RamEntry | None:
        """Index ``entry`` as most recent; returns the entry it replaced (caller releases it).
        ``reused``: the value was just read (an NVMe hit promoted to RAM). An untagged value
        that overwrites an untagged one keeps the key's standing with the policy (a reference)."""
        old = self.pop(key, keep_policy=entry.group is None)
        self.index[key] = entry
        self.value_bytes += entry.size
        if entry.group is not None:
            entry.group.add(key, entry, self.bucket())
        else:
            self.untagged += 1
            self.policy.insert(key, entry.size, reused)
        return old

    def pop(self, key: Key, evicted: bool = False, keep_policy: bool = False) -> RamEntry | None:
        """Unindex ``key``; ``evicted``: the store evicts it (the policy may remember that)."""
        e = self.index.pop(key, None)
        if e is not None:
            self.value_bytes -= e.size
            if e.group is not None:
                e.group.remove(key, e)
            else:
                self.untagged -= 1
                if not keep_policy:
                    self.policy.remove(key, evicted)
        return e

    def victims(self) -> Iterator[tuple[Key, RamEntry]]:
        """Unpinned untagged entries in the policy's eviction order; the caller may evict each
        one yielded (``pop(key, evicted=True)``). Pooled entries are evicted only through their
        PoolGroup. A put into a full arena costs O(evicted), not O(keys stored)."""
        for key in self.policy.candidates():
            e = self.index.get(key)  # type: ignore[call-overload]
            if e is not None and e.pins == 0 and e.group is None:
                yield key, e  # type: ignore[misc]

    def release(self, entry: RamEntry | None) -> None:
        """Free the entry's slot now, or when its last reader unpins it."""
        if entry is None or entry.dead:
            return
        entry.dead = True
        if entry.pins == 0:
            self.alloc.free_slot(entry.off, entry.size)

    def unpin(self, entry: RamEntry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.dead:
            self.alloc.free_slot(entry.off, entry.size)
