"""Tiered store: RAM arena in front of NVMe segments.

Puts land in RAM. RAM eviction (gcache.tier.eviction) hands values to a bounded write-behind queue; one demoter
thread writes them to NVMe and then frees their slots, so a put never waits on the disk unless
the queue is full of in-flight demotions and nothing else can be evicted. Gets are served from
whichever tier holds the key; an NVMe hit is promoted into RAM when there is room. A checksum
mismatch is a miss plus a logged error, never corrupt bytes.

Concurrency: one lock covers the index, the allocator and the queue; payload copies (socket
receive into a slot, send from a slot, disk reads) happen outside it on pinned or reserved
slots. A pinned slot is never reused, so a reader never sees another value's bytes.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

from gcache.errors import ConfigError
from gcache.protocol import Status
from gcache.tier.arena import Arena
from gcache.tier.eviction import EvictionConfig
from gcache.tier.nvme import NvmeTier
from gcache.tier.pools import GroupId, PoolBudget, PoolBudgets, PoolGroup
from gcache.tier.ram import Key, RamEntry, RamTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreConfig:
    """Sizing of one daemon's store.

    mem_bytes: RAM arena size. disk_dir/disk_bytes: NVMe tier (None disables it).
    max_value_bytes: larger puts get TOO_LARGE. demote_queue_bytes: bytes of evicted values
    waiting for the disk; beyond it evictions are dropped. full_wait_s: how long a put waits for
    in-flight demotions to free room before answering FULL. promote_on_hit: copy NVMe hits to RAM.
    pool_budgets: RAM byte budgets of tagged pools (gcache.tier.pools); recency_bucket_s: width
    of the recency buckets that order pooled entries (within one, later chain positions go first).
    eviction: the policy that orders untagged entries and picks what is written to NVMe.
    """

    mem_bytes: int
    disk_dir: str | None = None
    disk_bytes: int = 0
    max_value_bytes: int = 64 << 20
    demote_queue_bytes: int = 256 << 20
    full_wait_s: float = 2.0
    promote_on_hit: bool = True
    segment_bytes: int = 64 << 20
    pretouch: bool = True
    pool_budgets: tuple[PoolBudget, ...] = ()
    recency_bucket_s: float = 1.0
    eviction: EvictionConfig = field(default_factory=EvictionConfig)

    def __post_init__(self) -> None:
        if self.mem_bytes < 4096:
            raise ConfigError(f"mem_bytes={self.mem_bytes}: the RAM tier needs at least 4 KiB")
        if self.disk_dir is not None and self.disk_bytes < 4096:
            raise ConfigError(f"disk_bytes={self.disk_bytes}: give the NVMe tier at least 4 KiB, or no disk_dir")
        if self.max_value_bytes < 1:
            raise ConfigError("max_value_bytes must be >= 1")
        if self.full_wait_s < 0:
            raise ConfigError("full_wait_s must be >= 0")
        if not self.recency_bucket_s > 0:
            raise ConfigError("recency_bucket_s must be > 0")


class Reservation:
    """A slot being filled by a put: not visible to readers until commit()."""

    __slots__ = ("group", "off", "size", "view")

    def __init__(self, off: int, size: int, view: memoryview, group: PoolGroup | None = None) -> None:
        self.off, self.size, self.view, self.group = off, size, view, group


class Hit:
    """A value being read: ``view`` stays valid until Store.release(hit)."""

    __slots__ = ("entry", "view")

    def __init__(self, view: memoryview, entry: RamEntry | None) -> None:
        self.view, self.entry = view, entry


class Store:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.arena = Arena(config.mem_bytes, pretouch=config.pretouch)
        self.ram = RamTier(self.arena, config.recency_bucket_s, config.eviction)
        self.budgets = PoolBudgets(config.pool_budgets, config.mem_bytes)
        self.nvme = (
            NvmeTier(config.disk_dir, config.disk_bytes, config.segment_bytes) if config.disk_dir else None
        )
        self._lock = threading.Condition(threading.Lock())
        self._demoting: dict[Key, RamEntry] = {}
        self._queue: collections.deque[tuple[Key, RamEntry]] = collections.deque()
        self._queue_bytes = 0
        self._closed = False
        self.counters = collections.Counter()
        self._demoter = None
        if self.nvme is not None:
            self._demoter = threading.Thread(target=self._demote_loop, name="gcache-demoter", daemon=True)
            self._demoter.start()

    # -- put --------------------------------------------------------------------------------
    def reserve(self, size: int, pool: GroupId | None = None) -> Reservation | Status:
        """A slot for a value of ``size`` bytes, evicting as needed; or TOO_LARGE / FULL.
        ``pool`` = (namespace, pool name) tags the value: only that pool's entries (and untagged
        ones) are evicted to make room, and the pool's budget is enforced."""
        if size > self.config.max_value_bytes or size > self.ram.alloc.capacity:
            return Status.TOO_LARGE
        deadline = time.monotonic() + self.config.full_wait_s
        with self._lock:
            group = self._group(pool) if pool is not None else None
            if group is not None and group.budget is not None and size > group.budget:
                return Status.TOO_LARGE
            while True:
                off = self._make_room(size, group)
                if off is not None:
                    return Reservation(off, size, self.arena.slot(off, size), group)
                remaining = deadline - time.monotonic()
                if not self._demoting or remaining <= 0:
                    self.counters["full"] += 1
                    return Status.FULL
                self._lock.wait(remaining)

    def commit(self, key: Key, res: Reservation, ttl_s: float = 0.0, pos: int = 0, tail: int = 0) -> None:
        """Publish a filled reservation. ``pos``: chain position, ``tail``: 1 for a restore
        point's trailing-window page (both only matter for a pooled reservation; a tail mark
        is sticky across overwrites within the pool)."""
        expires = time.time() + ttl_s if ttl_s > 0 else 0.0
        entry = RamEntry(res.off, res.size, expires)
        with self._lock:
            self._forget_older(key)
            if res.group is not None:
                old = self.ram.index.get(key)
                entry.group, entry.pos = res.group, pos
                entry.tail = max(tail, old.tail) if old is not None and old.group is res.group else tail
            self.ram.release(self.ram.insert(key, entry))
            self.counters["puts"] += 1
            self.counters["put_bytes"] += res.size

    def abort(self, res: Reservation) -> None:
        with self._lock:
            self.ram.alloc.free_slot(res.off, res.size)
            self._lock.notify_all()

    def put(self, key: Key, value: memoryview | bytes, ttl_s: float = 0.0, pool: str | None = None,
            pos: int = 0, tail: int = 0) -> Status:
        """Store a value held in memory (used by tests and local callers)."""
        res = self.reserve(len(value), (key[0], pool) if pool is not None else None)
        if isinstance(res, Status):
            return res
        res.view[:] = value
        self.commit(key, res, ttl_s, pos, tail)
        return Status.OK

    # -- get --------------------------------------------------------------------------------
    def acquire(self, key: Key) -> Hit | None:
        """The value for ``key`` pinned for reading, or None on a miss. Call release(hit)."""
        with self._lock:
            entry = self.ram.lookup(key, time.time()) or self._demoting.get(key)
            if entry is not None:
                entry.pins += 1
                self.counters["hits_ram"] += 1
                return Hit(self.arena.slot(entry.off, entry.size), entry)
        return self._acquire_from_disk(key)

    def release(self, hit: Hit) -> None:
        if hit.entry is not None:
            with self._lock:
                self.ram.unpin(hit.entry)
                if hit.entry.dead:
                    self._lock.notify_all()

    def _acquire_from_disk(self, key: Key) -> Hit | None:
        nvme = self.nvme
        loc = nvme.lookup(key) if nvme is not None else None
        if loc is None:
            with self._lock:
                self.counters["misses"] += 1
            return None
        assert nvme is not None
        off = None
        if self.config.promote_on_hit:
            with self._lock:
                off = self._make_room(loc.size)
        if off is None:  # no room to promote: read into a private buffer
            buf = memoryview(bytearray(loc.size))
            ok = nvme.read(key, loc, buf)
            with self._lock:
                self.counters["hits_nvme" if ok else "misses"] += 1
            return Hit(buf, None) if ok else None
        view = self.arena.slot(off, loc.size)
        ok = nvme.read(key, loc, view)
        with self._lock:
            if not ok:
                self.ram.alloc.free_slot(off, loc.size)
                self.counters["misses"] += 1
                self.counters["corrupt"] += 1
                return None
            self.counters["hits_nvme"] += 1
            current = self.ram.lookup(key, time.time())
            if current is not None:  # a put landed while we read: serve the newer value
                self.ram.alloc.free_slot(off, loc.size)
                entry = current
            else:
                entry = RamEntry(off, loc.size, loc.expires, on_disk=True)
                self.ram.insert(key, entry, reused=True)
                self.counters["promotions"] += 1
            entry.pins += 1
            return Hit(self.arena.slot(entry.off, entry.size), entry)

    # -- exists / delete ---------------------------------------------------------------------
    def exists(self, key: Key, tail: int | None = None) -> bool:
        """Whether ``key`` is stored; a RAM hit becomes most recent. ``tail`` (not None) re-marks
        a pooled entry as a restore point's trailing-window page (1) or an interior one (0)."""
        with self._lock:
            now = time.time()
            e = self.ram.lookup(key, now)
            if e is not None and tail is not None and e.group is not None and e.tail != tail:
                e.group.touch(key, e, self.ram.bucket(now), tail)
            if e is not None or key in self._demoting:
                return True
        return self.nvme is not None and self.nvme.contains(key)

    def delete(self, key: Key) -> bool:
        with self._lock:
            found = self._forget_older(key)
            old = self.ram.pop(key)
            self.ram.release(old)
            self._lock.notify_all()
        return found or old is not None

    def _forget_older(self, key: Key) -> bool:
        """Lock held: make older copies of ``key`` in flight or on disk unreachable."""
        found = False
        pending = self._demoting.get(key)
        if pending is not None:
            pending.superseded = True
            found = True
        if self.nvme is not None and self.nvme.remove(key):
            found = True
        return found

    # -- eviction and demotion ---------------------------------------------------------------
    def _group(self, gid: GroupId) -> PoolGroup | None:
        """Lock held: the pool group ``gid``, created on first use (None beyond MAX_GROUPS)."""
        group = self.ram.groups.get(gid)
        if group is None and len(self.ram.groups) < self.MAX_GROUPS:
            group = self.ram.groups[gid] = PoolGroup(gid, self.budgets.budget(gid))
        return group

    MAX_GROUPS = 4096

    def _make_room(self, size: int, group: PoolGroup | None = None) -> int | None:
        """Lock held: allocate ``size`` bytes. A pooled value first brings its pool under
        budget, evicting that pool's own entries; then untagged entries are evicted in LRU
        order, then (pooled) the pool's own. Other pools' entries are never touched."""
        alloc = self.ram.alloc
        if group is not None and group.over_budget(size):
            for key, entry in group.victims():
                self._evict(key, entry)
                if not group.over_budget(size):
                    break
            if group.over_budget(size):
                return None
        off = alloc.alloc(size)
        if off is not None:
            return off
        sources = [self.ram.victims()] if group is None else [self.ram.victims(), group.victims()]
        for victims in sources:
            for key, entry in victims:
                self._evict(key, entry)
                off = alloc.alloc(size)
                if off is not None:
                    return off
        return None

    def _evict(self, key: Key, entry: RamEntry) -> None:
        worth_disk = entry.group is not None or self.ram.policy.admit_to_disk(key)
        self.ram.pop(key, evicted=True)
        self.counters["evictions"] += 1
        if self.nvme is None or entry.on_disk or self._closed:
            self.ram.release(entry)
        elif not worth_disk:
            self.counters["demotion_skips"] += 1
            self.ram.release(entry)
        elif self._queue_bytes + entry.size <= self.config.demote_queue_bytes:
            self._demoting[key] = entry
            self._queue.append((key, entry))
            self._queue_bytes += entry.size
            self._lock.notify_all()
        else:
            self.counters["demotion_drops"] += 1
            self.ram.release(entry)

    def _demote_loop(self) -> None:
        assert self.nvme is not None
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                key, entry = self._queue.popleft()
            ok = False
            try:
                ok = self.nvme.append(key, self.arena.slot(entry.off, entry.size), entry.expires)
            except Exception:  # never let the demoter die silently
                log.exception("demotion of %r failed", key)
            with self._lock:
                if self._demoting.get(key) is entry:
                    del self._demoting[key]
                self._queue_bytes -= entry.size
                self.counters["demotions" if ok else "demotion_failures"] += 1
                if ok and entry.superseded:
                    self.nvme.remove(key)
                self.ram.release(entry)
                self._lock.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued demotion is written; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._queue_bytes > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
        return True

    def keys_hottest_first(self) -> list[Key]:
        """Every live key, RAM most-recently-used first, then disk-only keys (for handover)."""
        with self._lock:
            ram = list(reversed(self.ram.index.keys()))
            seen = set(ram)
        disk = [k for k in self.nvme.index_keys() if k not in seen] if self.nvme is not None else []
        return ram + disk

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self.counters)
            out.update(
                ram_capacity=self.ram.alloc.capacity,
                ram_used=self.ram.alloc.used,
                ram_value_bytes=self.ram.value_bytes,
                ram_keys=len(self.ram),
                demote_queue_bytes=self._queue_bytes,
            )
            for (ns, pool), g in self.ram.groups.items():
                out[f"pool_bytes:{ns}:{pool}"] = g.bytes
                out[f"pool_keys:{ns}:{pool}"] = len(g)
                if g.budget is not None:
                    out[f"pool_budget:{ns}:{pool}"] = g.budget
        if self.nvme is not None:
            out.update(
                disk_budget=self.nvme.budget,
                disk_used=self.nvme.used,
                disk_keys=len(self.nvme),
                disk_write_errors=self.nvme.write_errors,
                disk_corrupt=self.nvme.corrupt,
            )
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._demoter is not None:
            self._demoter.join(timeout=10)
        if self.nvme is not None:
            self.nvme.close()
