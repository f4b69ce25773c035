"""Tiered store: RAM arena in front of NVMe segments.

Puts land in RAM. RAM eviction (gcache.tier.eviction) hands values to a bounded write-behind queue; one demoter
thread writes them to NVMe and then frees their slots. A victim's slot is free only once it is
written, so a put into a full arena evicts about what it needs and waits for the demoter (up to
half of full_wait_s) rather than evicting the whole arena into the queue; past that it evicts on
as before (beyond demote_queue_bytes victims are dropped, which frees at once). Gets are served from
whichever tier holds the key; an NVMe hit is promoted into RAM when there is room. When there is
none (the arena is pinned full, often by the other hits of the same requests) the hit is read
into a private buffer, drawn on a daemon-wide budget (``read_buffer_bytes``) until it is
released (its reply sent), so such reads cannot grow memory past --mem by more than the budget.
A hit that finds no budget waits for room (to promote it, or budget released by other readers)
if its request holds none of the budget yet, up to ``read_wait_s`` for the whole request, and is
a miss otherwise (``disk_reads_refused``): holders never wait, so waiting always ends. A
checksum mismatch is a miss plus a logged error, never corrupt bytes.

Concurrency: one lock covers the index, the allocator and the queue; payload copies (socket
receive into a slot, send from a slot, disk reads and writes) happen outside it on pinned or
reserved slots. A pinned slot is never reused, so a reader never sees another value's bytes.

Deletes and overwrites are final. Every write and delete takes a sequence number (kept in the
NVMe records, see gcache.tier.records). A delete or overwrite, under the lock: marks a value
waiting for the disk as superseded (it is then never served nor indexed, and a record of it
already written is invalidated), and appends a tombstone whenever a copy may be on disk. A
demotion reserves its record's place under the lock, so a later tombstone always lands after
it. When the tombstone cannot be written (a full disk) while the demoter is writing an older
value of the key, the delete or overwrite is acknowledged only once the demoter has invalidated
that record: a crash in between would otherwise bring the older value back. A promotion reads
outside the lock and inserts its value only if the NVMe index still points at the record it read.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gcache.errors import ConfigError
from gcache.protocol import DEFAULT_MAX_VALUE_BYTES, Status
from gcache.tier.allocator import aligned
from gcache.tier.arena import Arena
from gcache.tier.eviction import EvictionConfig
from gcache.tier.nvme import Location, NvmeTier
from gcache.tier.pools import GroupId, PoolBudget, PoolBudgets, PoolGroup
from gcache.tier.ram import Key, RamEntry, RamTier
from gcache.tier.valuemeta import NO_META, ValueMeta

# A write's last check, run under the store lock as it lands: None (nothing to check) or a
# predicate on keys; a key it rejects is not written. (The daemon re-checks ownership here when
# its ring changed since the request was admitted: gcache.server.handler.)
Guard = Callable[[], "Callable[[Key], bool] | None"]

log = logging.getLogger(__name__)

# _room_possible runs for values of at least 1/ROOM_CHECK_SHARE of the arena, in arenas of at
# most ROOM_CHECK_MAX_KEYS values (a scan of the index, worth it only beside a large eviction)
ROOM_CHECK_SHARE = 64
ROOM_CHECK_MAX_KEYS = 200_000
SETTLE_S = 10.0  # longest a write or delete waits for the demoter to invalidate a superseded record (_settle)


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
    read_buffer_bytes: bytes of NVMe hits read outside the arena (no room to promote them) that
    all readers may hold at once; None: a quarter of mem_bytes, at least max_value_bytes (a small
    arena still serves a request of several large values from disk: one get of 64 such values from
    8 MiB arenas came back with misses under a cap of mem_bytes) (``read_budget``). read_wait_s: how long (all its hits together) a request that
    holds none of that budget waits for room, before such a hit is answered as a miss.
    """

    mem_bytes: int
    disk_dir: str | None = None
    disk_bytes: int = 0
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    demote_queue_bytes: int = 256 << 20
    full_wait_s: float = 2.0
    promote_on_hit: bool = True
    segment_bytes: int = 64 << 20
    pretouch: bool = True
    pool_budgets: tuple[PoolBudget, ...] = ()
    recency_bucket_s: float = 1.0
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    read_buffer_bytes: int | None = None
    read_wait_s: float = 1.0

    @property
    def read_budget(self) -> int:
        """The budget of private read buffers (read_buffer_bytes, or its default)."""
        if self.read_buffer_bytes is not None:
            return self.read_buffer_bytes
        return max(self.max_value_bytes, self.mem_bytes // 4)

    def __post_init__(self) -> None:
        if self.mem_bytes < 4096:
            raise ConfigError(f"mem_bytes={self.mem_bytes}: the RAM tier needs at least 4 KiB", "mem_bytes")
        if self.disk_dir is not None and self.disk_bytes < 4096:
            raise ConfigError(f"disk_bytes={self.disk_bytes}: give the NVMe tier at least 4 KiB, or no disk_dir",
                              "disk_bytes")
        if self.max_value_bytes < 1:
            raise ConfigError("max_value_bytes must be >= 1", "max_value_bytes")
        if self.full_wait_s < 0:
            raise ConfigError("full_wait_s must be >= 0")
        if not self.recency_bucket_s > 0:
            raise ConfigError("recency_bucket_s must be > 0")
        if self.read_buffer_bytes is not None and self.read_buffer_bytes < 0:
            raise ConfigError(f"read_buffer_bytes={self.read_buffer_bytes}: must be >= 0", "read_buffer_bytes")


class Reservation:
    """A slot being filled by a put: not visible to readers until commit()."""

    __slots__ = ("group", "off", "size", "view")

    def __init__(self, off: int, size: int, view: memoryview, group: PoolGroup | None = None) -> None:
        self.off, self.size, self.view, self.group = off, size, view, group


class Hit:
    """A value being read: ``view`` stays valid until Store.release(hit). ``held``: bytes of the
    private-read budget its buffer draws on (a disk hit read outside the arena), given back by
    release."""

    __slots__ = ("entry", "held", "loc", "view")

    def __init__(self, view: memoryview, entry: RamEntry | None, loc: Location | None = None,
                 held: int = 0) -> None:
        self.view, self.entry, self.loc, self.held = view, entry, loc, held

    @property
    def meta(self) -> ValueMeta:
        """The value's metadata record (ttl_s: what is left of it now)."""
        now = time.time()
        e = self.entry
        if e is not None:
            return ValueMeta(e.pool, e.pos, e.tail, ValueMeta.ttl_left(e.expires, now), e.fmt)
        return self.loc.value_meta(now) if self.loc is not None else ValueMeta()

    @property
    def seq(self) -> int:
        """The sequence number of the write that stored this value (see Store.delete(if_seq=))."""
        return self.entry.seq if self.entry is not None else self.loc.seq if self.loc is not None else 0


def _entry_meta(entry: RamEntry, meta: ValueMeta, expires: float) -> RamEntry:
    entry.pool, entry.pos, entry.tail, entry.fmt, entry.expires = meta.pool, meta.pos, meta.tail, meta.fmt, expires
    return entry


class Store:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        # The disk first: a directory another daemon holds is refused before the arena is faulted in.
        self.nvme = (
            NvmeTier(config.disk_dir, config.disk_bytes, config.segment_bytes) if config.disk_dir else None
        )
        try:
            self.arena = Arena(config.mem_bytes, pretouch=config.pretouch)
        except BaseException:
            if self.nvme is not None:
                self.nvme.close()
            raise
        self.ram = RamTier(self.arena, config.recency_bucket_s, config.eviction)
        self.budgets = PoolBudgets(config.pool_budgets, config.mem_bytes)
        self._lock = threading.Condition(threading.Lock())
        self._seq = itertools.count(1)  # without a disk; with one, the NVMe tier hands them out
        self._demoting: dict[Key, RamEntry] = {}  # queued or being written, not superseded
        self._writing: set[RamEntry] = set()  # the demoter's write of it is under way
        # per calling thread: entries superseded while being written whose tombstone could not be
        # written (a full disk); that write is acknowledged only once the demoter invalidated them
        self._mine = threading.local()
        self._queue: collections.deque[tuple[Key, RamEntry]] = collections.deque()
        self._queue_bytes = 0
        self.read_budget = config.read_budget
        self._read_held = 0  # bytes of private read buffers (disk hits not promoted) held by readers
        self._read_waiters = 0  # disk hits waiting for room or read budget
        self._closed = False
        self.counters: collections.Counter[str] = collections.Counter()
        self._demoter = None
        if self.nvme is not None:
            self._demoter = threading.Thread(target=self._demote_loop, name="gcache-demoter", daemon=True)
            self._demoter.start()

    # -- put --------------------------------------------------------------------------------
    def reserve(self, size: int, pool: GroupId | None = None) -> Reservation | Status:
        """A slot for a value of ``size`` bytes, evicting as needed; or TOO_LARGE / FULL.
        ``pool`` = (namespace, pool name) tags the value: only that pool's entries (and untagged
        ones) are evicted to make room, and the pool's budget is enforced."""
        res = self.reserve_many([size], pool)[0]
        assert res is not None
        return res

    def reserve_many(self, sizes: Sequence[int | None], pool: GroupId | None = None) -> list[Reservation | Status | None]:
        """reserve() for each size (None: skipped, None back), in order, under one lock; a full
        arena waits for the demoter at most ``full_wait_s`` for the whole batch."""
        limit = min(self.config.max_value_bytes, self.ram.alloc.capacity)
        out: list[Reservation | Status | None] = []
        with self._lock:
            group = self._group(pool) if pool is not None else None
            budget = group.budget if group is not None and group.budget is not None else limit
            try:
                self._reserve_each(sizes, group, limit, budget, out)
            except BaseException:  # nothing reserved by a call that fails
                self._give_back([res for res in out if isinstance(res, Reservation)])
                raise
        return out

    def _reserve_each(self, sizes: Sequence[int | None], group: PoolGroup | None, limit: int, budget: int,
                      out: list[Reservation | Status | None]) -> None:
        """Lock held: reserve_many's loop, appending to ``out``. A pooled batch counts its own
        reservations against the pool's budget (it could take a pool far past it: a 120-page batch
        at a 128-page budget left 196 pages, a prober); a value the batch's earlier ones leave no
        budget for is FULL at once. A full arena waits for the demoter for up to half of
        full_wait_s before evicting more than is already on its way to the disk (_make_room)."""
        deadline = 0.0
        reserved = 0  # bytes this call reserved for the pool
        wait = self.config.full_wait_s
        for size in sizes:
            if size is None:
                out.append(None)
                continue
            if size > limit or size > budget:
                out.append(Status.TOO_LARGE)
                continue
            if group is not None and group.budget is not None and reserved + aligned(size) > group.budget:
                self.counters["full"] += 1
                out.append(Status.FULL)
                continue
            while True:
                patient = wait > 0 and (not deadline or time.monotonic() < deadline - wait / 2)
                off = self._make_room(size, group, reserved, patient)
                if off is not None:
                    out.append(Reservation(off, size, self.arena.slot(off, size), group))
                    if group is not None:
                        reserved += aligned(size)
                    break
                deadline = deadline or time.monotonic() + wait
                remaining = deadline - time.monotonic()
                if not self._queue_bytes or remaining <= 0:
                    self.counters["full"] += 1
                    out.append(Status.FULL)
                    break
                if patient:  # wake when patience ends, to evict more if the demoter has not freed room
                    remaining = min(remaining, max(0.001, deadline - wait / 2 - time.monotonic()))
                self._lock.wait(remaining)

    def commit(self, key: Key, res: Reservation, meta: ValueMeta = NO_META) -> None:
        """Publish a filled reservation with its value-metadata record. For a pooled reservation
        ``meta.pos`` orders eviction and ``meta.tail`` (1: a restore point's trailing-window page)
        is sticky across overwrites within the pool."""
        self.commit_many([(key, res, meta)])

    def commit_many(self, items: Sequence[tuple[Key, Reservation, ValueMeta]], guard: Guard | None = None) -> list[int]:
        """commit() of each (key, filled reservation, metadata), in order, under one lock. If one
        fails, the reservations after it are given back (none of them is published). Items whose
        key ``guard`` rejects are given back instead; returns their positions."""
        now = time.time()
        entries = [_entry_meta(RamEntry(res.off, res.size, 0.0), meta, meta.expires_at(now))
                   for _key, res, meta in items]
        rejected: list[int] = []
        with self._lock:
            try:
                check = guard() if guard is not None else None
                if check is not None:
                    rejected = [i for i, (key, _res, _meta) in enumerate(items) if not check(key)]
            except BaseException:  # nothing published: every reservation goes back
                self._give_back([res for _key, res, _meta in items])
                raise
            if rejected:
                self._give_back([items[i][1] for i in rejected])
                drop = set(rejected)
                kept = [i for i in range(len(items)) if i not in drop]
                items, entries = [items[i] for i in kept], [entries[i] for i in kept]
            done = 0
            try:
                for (key, res, _meta), entry in zip(items, entries):
                    self._publish(key, res, entry)
                    done += 1
            except BaseException:
                self._give_back([res for _key, res, _meta in items[done + 1:]])
                raise
            finally:
                self.counters["puts"] += done
                self.counters["put_bytes"] += sum(res.size for _key, res, _meta in items[:done])
                self._settle()
        if self.nvme is not None:
            self.nvme.sweep()  # files of segments a tombstone's reservation reclaimed
        return rejected

    def _publish(self, key: Key, res: Reservation, entry: RamEntry) -> None:
        """Lock held: index ``entry`` (the value in ``res``) as the newest value of ``key``."""
        entry.seq = self._next_seq()
        self._forget_older(key, entry.seq)
        old = self.ram.index.get(key)
        group = res.group
        if group is not None and self.ram.groups.get(group.gid) is not group:
            group = self._group(group.gid)  # dropped while empty since it was reserved: its successor
        if group is not None:
            entry.group = group
            if old is not None and old.group is group:
                entry.tail = max(entry.tail, old.tail)
        self.ram.release(self.ram.insert(key, entry))

    def abort(self, res: Reservation) -> None:
        self.abort_many([res])

    def abort_many(self, reservations: Sequence[Reservation]) -> None:
        """Give back reservations that will not be committed (one lock for all)."""
        if reservations:
            with self._lock:
                self._give_back(reservations)

    def _give_back(self, reservations: Sequence[Reservation]) -> None:
        """Lock held: free the reservations' slots and wake puts waiting for room."""
        for res in reservations:
            self.ram.alloc.free_slot(res.off, res.size)
        self._lock.notify_all()

    def put(self, key: Key, value: memoryview | bytes, ttl_s: float = 0.0, pool: str | None = None,
            pos: int = 0, tail: int = 0, fmt: int = 0) -> Status:
        """Store a value held in memory (used by tests and local callers)."""
        res = self.reserve(len(value), (key[0], pool) if pool is not None else None)
        if isinstance(res, Status):
            return res
        res.view[:] = value
        self.commit(key, res, ValueMeta(pool, pos, tail, ttl_s, fmt))
        return Status.OK

    # -- get --------------------------------------------------------------------------------
    def acquire(self, key: Key, bounded: bool = True) -> Hit | None:
        """The value for ``key`` pinned for reading, or None on a miss. Call release(hit).
        ``bounded``: a disk hit read outside the arena draws on the read budget (else a miss);
        False only for an internal reader that holds few values at a time (the handover)."""
        return self.acquire_many([key], bounded)[0]

    def acquire_many(self, keys: Sequence[Key | None], bounded: bool = True) -> list[Hit | None]:
        """acquire() for each key (None: skipped, a miss) under one lock for the RAM part; keys
        only on disk are read afterwards, outside it. Each hit is pinned: release() it."""
        out: list[Hit | None] = [None] * len(keys)
        disk: list[tuple[int, Key]] = []
        holding = False  # this request holds read budget: its further disk hits do not wait for more
        with self._lock:
            now = time.time()
            hits = 0
            for i, (key, entry) in enumerate(zip(keys, self.ram.lookup_many(keys, now))):
                if key is None:
                    continue
                entry = entry or self._queued(key, now)
                if entry is None:
                    disk.append((i, key))
                    continue
                entry.pins += 1
                out[i] = Hit(self.arena.slot(entry.off, entry.size), entry)
                hits += 1
            self.counters["hits_ram"] += hits
        until = time.monotonic() + self.config.read_wait_s if disk else 0.0  # all its waits together
        try:
            for i, key in disk:
                hit = out[i] = self._acquire_from_disk(key, bounded=bounded, wait_until=None if holding else until)
                holding = holding or (hit is not None and hit.held > 0)
        except BaseException:
            self.release_many([hit for hit in out if hit is not None])
            raise
        return out

    def release(self, hit: Hit) -> None:
        self.release_many([hit])

    def release_many(self, hits: Sequence[Hit]) -> None:
        """Unpin each hit, give back the read budget of those read outside the arena (one lock
        for the batch; a hit released twice gives its budget back once)."""
        entries = [h.entry for h in hits if h.entry is not None]
        held = 0
        for h in hits:
            if h.held:
                held, h.held = held + h.held, 0
        if not entries and not held:
            return
        unpin, freed = self.ram.unpin, False
        with self._lock:
            self._read_held -= held
            for e in entries:
                unpin(e)
                freed = freed or e.dead
            if freed or (self._read_waiters and (held or entries)):  # room for a waiting disk hit
                self._lock.notify_all()

    def _queued(self, key: Key, now: float) -> RamEntry | None:
        """Lock held: the live value of ``key`` waiting for the disk, if any."""
        e = self._demoting.get(key)
        if e is None or e.superseded or (e.expires and e.expires <= now):
            return None
        return e

    def _acquire_from_disk(self, key: Key, promote_only: bool = False, bounded: bool = True,
                           wait_until: float | None = None) -> Hit | None:
        """A disk hit, promoted into RAM when there is room, else (unless ``promote_only``) read
        into a private buffer; ``bounded``: that buffer draws on the read budget, waiting until
        ``wait_until`` (time.monotonic) for room or budget when there is none (None: a miss at once)."""
        nvme = self.nvme
        loc = nvme.lookup(key) if nvme is not None else None
        if loc is None:
            with self._lock:
                self.counters["misses"] += 1
            return None
        assert nvme is not None
        off, group = None, None
        held = loc.size if bounded and not promote_only else 0
        refused = False
        with self._lock:
            while True:
                if self.config.promote_on_hit:
                    pool = loc.meta.pool
                    group = self._group((key[0], pool)) if pool is not None else None
                    # a read does not flush RAM to promote (it can be served from a buffer); a re-mark
                    # (promote_only) has no other way to keep its mark
                    off = self._make_room(loc.size, group, patient=not promote_only)
                if off is not None or promote_only or self._read_held + held <= self.read_budget:
                    break
                now = time.monotonic()
                if wait_until is None or now >= wait_until or self._closed or held > self.read_budget:
                    self.counters["misses"] += 1
                    self.counters["disk_reads_refused"] += 1
                    refused = True
                    break
                self._read_waiters += 1
                try:
                    self._lock.wait(wait_until - now)
                finally:
                    self._read_waiters -= 1
            if off is None and not refused and not promote_only:
                self._read_held += held
        if refused or (off is None and promote_only):  # (a re-mark: not worth a read that keeps nothing)
            nvme.done(loc)  # refused: a cache may forget, better than memory without bound
            return None
        if off is None:  # no room to promote: read into a private buffer, drawn on the read budget
            ok = False
            try:
                try:
                    buf = memoryview(bytearray(loc.size))
                except BaseException:
                    nvme.done(loc)
                    raise
                ok = nvme.read(key, loc, buf) and nvme.current(key, loc)  # a delete since lookup: a miss
            finally:
                with self._lock:
                    self.counters["hits_nvme" if ok else "misses"] += 1
                    if not ok:
                        self._read_held -= held
                        if held and self._read_waiters:
                            self._lock.notify_all()
            return Hit(buf, None, loc, held) if ok else None
        view = self.arena.slot(off, loc.size)
        ok = nvme.read(key, loc, view)
        with self._lock:
            current = self.ram.lookup(key, time.time())
            if not ok or (current is None and not nvme.current(key, loc)):
                # unreadable, or deleted / overwritten while we read (and the newer value is not
                # in RAM): never bring the old one back
                self.ram.alloc.free_slot(off, loc.size)
                self.counters["misses"] += 1
                self.counters["corrupt" if not ok else "promotions_dropped"] += 1
                self._lock.notify_all()
                return None
            self.counters["hits_nvme"] += 1
            if current is not None:  # a put landed while we read: serve the newer value
                self.ram.alloc.free_slot(off, loc.size)
                self._lock.notify_all()
                entry = current
            else:
                entry = _entry_meta(RamEntry(off, loc.size, 0.0, on_disk=True), loc.meta, loc.expires)
                entry.seq, entry.group = loc.seq, group
                self.ram.insert(key, entry, reused=True)
                self.counters["promotions"] += 1
            entry.pins += 1
            return Hit(self.arena.slot(entry.off, entry.size), entry)

    # -- exists / delete ---------------------------------------------------------------------
    def exists(self, key: Key, tail: int | None = None) -> bool:
        """Whether ``key`` is stored; a RAM hit becomes most recent. ``tail`` (not None) re-marks
        a pooled entry as a restore point's trailing-window page (1) or an interior one (0)."""
        return self.exists_many([key], [tail])[0]

    def exists_many(self, keys: Sequence[Key | None], tails: Sequence[int | None] | None = None) -> list[bool]:
        """exists() for each key (None: skipped, False) under one lock for the RAM part; a RAM
        hit becomes most recent, ``tails[i]`` (not None) re-marks a pooled entry's tail flag,
        wherever it is: in RAM (a copy on disk with the old mark is written again when the entry
        is evicted), waiting for the disk, or only on disk (promoted to RAM to be re-marked; when
        there is no room the mark stays as it was). A re-mark of a value the demoter is writing
        just then, or one a restart brings back from its older disk record, keeps the old mark:
        the mark orders eviction only (gcache.tier.pools), it never changes what a read returns."""
        disk: list[int] = []
        with self._lock:
            now = time.time()
            entries = self.ram.lookup_many(keys, now)
            out = [e is not None for e in entries]
            if tails is not None:
                for key, e, tail in zip(keys, entries, tails):
                    if e is not None and tail is not None and e.group is not None and e.tail != tail:
                        e.group.touch(key, e, self.ram.bucket(now), tail)  # type: ignore[arg-type]
                        e.on_disk = False  # the disk copy has the old mark: demoted again when evicted
            if not all(out):  # RAM misses: waiting for the disk, or on it
                for i, key in enumerate(keys):
                    if not out[i] and key is not None:
                        q = self._queued(key, now)
                        if q is not None:
                            out[i] = True
                            tail = tails[i] if tails is not None else None
                            if tail is not None and q.group is not None and q not in self._writing:
                                q.tail = tail  # the demoter writes its record with this mark
                        else:
                            disk.append(i)
        nvme = self.nvme
        if nvme is not None:
            for i in disk:
                key = keys[i]
                out[i] = key is not None and nvme.contains(key)
                tail = tails[i] if tails is not None else None
                if out[i] and tail is not None:
                    self._remark_on_disk(key, tail)  # type: ignore[arg-type]
        return out

    def _remark_on_disk(self, key: Key, tail: int) -> None:
        """exists_many's re-mark of a pooled value found only on disk: promoted, then re-marked
        in RAM (and written again, with the new mark, when it is evicted)."""
        assert self.nvme is not None
        loc = self.nvme.lookup(key)
        if loc is None:
            return
        self.nvme.done(loc)
        if loc.meta.pool is None or loc.meta.tail == tail:
            return
        hit = self._acquire_from_disk(key, promote_only=True)
        if hit is None:
            return
        try:
            with self._lock:
                e = hit.entry
                if e is not None and self.ram.index.get(key) is e and e.group is not None and e.tail != tail:
                    e.group.touch(key, e, self.ram.bucket(time.time()), tail)
                    e.on_disk = False
        finally:
            self.release(hit)

    def delete(self, key: Key, if_seq: int | None = None) -> bool:
        """Delete ``key`` (True if it was stored). With ``if_seq``, only if the stored value is
        still the one written with that sequence number (Hit.seq): a handover deletes what it
        pushed, never a newer value written meanwhile."""
        with self._lock:
            if if_seq is not None and self._current_seq(key) != if_seq:
                return False
            found = self._delete(key)
            self._settle()
        if self.nvme is not None:
            self.nvme.sweep()
        return found

    def delete_many(self, keys: Sequence[Key | None], guard: Guard | None = None) -> list[bool | None]:
        """delete() of each key under one lock: whether it was stored, or None for a key skipped
        (None) or rejected by ``guard`` (left as it is)."""
        out: list[bool | None] = []
        with self._lock:
            check = guard() if guard is not None else None
            for key in keys:
                out.append(None if key is None or (check is not None and not check(key)) else self._delete(key))
            self._settle()
        if self.nvme is not None:
            self.nvme.sweep()
        return out

    CLEAR_CHUNK = 512  # keys deleted per hold of the lock by delete_namespace

    def delete_namespace(self, ns: str, guard: Guard | None = None, chunk: int = CLEAR_CHUNK) -> int:
        """delete_many() of every key of namespace ``ns`` stored now (RAM, pooled or not, queued
        for the disk, on disk), ``chunk`` keys per hold of the lock, each chunk checked by
        ``guard``; returns how many were stored. A key written meanwhile may stay (its write is
        newer than the clear)."""
        keys = [k for k in self.keys_hottest_first() if k[0] == ns]
        deleted = 0
        for i in range(0, len(keys), chunk):
            deleted += sum(1 for found in self.delete_many(keys[i:i + chunk], guard) if found)
        return deleted

    def _delete(self, key: Key) -> bool:
        """Lock held: delete ``key``; whether it was stored."""
        found = self._forget_older(key, self._next_seq())
        old = self.ram.pop(key)
        self.ram.release(old)
        self._lock.notify_all()
        return found or old is not None

    def _next_seq(self) -> int:
        """Lock held: a new sequence number (the NVMe tier's, which survive restarts)."""
        return self.nvme.next_seq() if self.nvme is not None else next(self._seq)

    def _current_seq(self, key: Key) -> int | None:
        """Lock held: the sequence number of the value ``key`` maps to now, or None."""
        e = self.ram.index.get(key) or self._demoting.get(key)
        if e is not None:
            return e.seq
        loc = self.nvme.index.get(key) if self.nvme is not None else None
        return loc.seq if loc is not None else None

    def _forget_older(self, key: Key, seq: int) -> bool:
        """Lock held: make older copies of ``key`` in flight or on disk unreachable, now and
        after a restart (a tombstone with sequence number ``seq``)."""
        pending = self._demoting.pop(key, None)
        if pending is not None:
            pending.superseded = True  # never served, never indexed; a written record is invalidated
        found = pending is not None
        if self.nvme is not None:
            indexed, tombstoned = self.nvme.remove_durably(key, seq, force=pending is not None)
            found = found or indexed
            if pending is not None and not tombstoned and pending in self._writing:
                # its record may be complete on disk and nothing hides it: a crash before the
                # demoter invalidates it would bring it back (see _settle)
                self._unconfirmed().append(pending)
        return found

    def _settle(self) -> None:
        """Lock held, the last step of a write or delete before it is acknowledged: wait until
        the demoter has invalidated the records of older values it was writing when this
        thread's tombstones for them could not be written (at most SETTLE_S; the lock is
        released meanwhile)."""
        mine = self._unconfirmed()
        deadline = 0.0
        while mine:
            if mine[-1] not in self._writing:
                mine.pop()
                continue
            deadline = deadline or time.monotonic() + SETTLE_S
            left = deadline - time.monotonic()
            if left <= 0:
                log.error("a demotion superseded without a tombstone is still being written after %.0fs; "
                          "acknowledging anyway (a crash now could bring its value back)", SETTLE_S)
                mine.clear()
                return
            self._lock.wait(left)

    def _unconfirmed(self) -> list[RamEntry]:
        """This thread's entries _settle waits for (other callers never wait for them)."""
        mine: list[RamEntry] | None = getattr(self._mine, "entries", None)
        if mine is None:
            mine = self._mine.entries = []
        return mine

    # -- eviction and demotion ---------------------------------------------------------------
    def _group(self, gid: GroupId) -> PoolGroup | None:
        """Lock held: the pool group ``gid``, created on first use. At MAX_GROUPS the empty groups
        are dropped first; a pool with a configured budget always gets its group, others beyond
        the cap none (their values are then evicted like untagged ones). Before, groups were
        never dropped: a client that wrote and deleted one value in each of 4,096 (namespace,
        pool) pairs switched off every budget configured afterwards (the adapter's kv / swa)."""
        group = self.ram.groups.get(gid)
        if group is None:
            budget = self.budgets.budget(gid)
            if len(self.ram.groups) >= self.MAX_GROUPS:
                for old in [k for k, g in self.ram.groups.items() if not g.entries]:
                    del self.ram.groups[old]
            if budget is not None or len(self.ram.groups) < self.MAX_GROUPS:
                group = self.ram.groups[gid] = PoolGroup(gid, budget)
        return group

    MAX_GROUPS = 4096

    def _make_room(self, size: int, group: PoolGroup | None = None, reserved: int = 0,
                   patient: bool = False) -> int | None:
        """Lock held: allocate ``size`` bytes. A pooled value first brings its pool under
        budget (beside ``reserved`` bytes its batch holds), evicting that pool's own entries;
        then untagged entries are evicted in policy order, then (pooled) the pool's own. Other
        pools' entries are never touched. ``patient``: once enough bytes are waiting for the
        demoter to free their slots, None (the caller waits for it) instead of evicting more:
        a victim bound for the disk keeps its slot until it is written, and the demoter needs
        this lock, so one put into a full arena evicted every entry (a prober: 256 of 256)."""
        alloc = self.ram.alloc
        if group is not None and group.over_budget(size, reserved):
            for key, entry in group.victims():
                self._evict(key, entry)
                if not group.over_budget(size, reserved):
                    break
            if group.over_budget(size, reserved):
                return None
        off = alloc.alloc(size)
        if off is not None:
            return off
        if not self._room_possible(size, group):
            return None  # FULL, without evicting values for a put that could not fit anyway
        need = aligned(size)
        # (not when the queue is full: victims beyond it are dropped and free their slots at once)
        patient = patient and self._demoter is not None
        cap = self.config.demote_queue_bytes
        sources = [self.ram.victims()] if group is None else [self.ram.victims(), group.victims()]
        for victims in sources:
            for key, entry in victims:
                if patient and need <= self._queue_bytes and self._queue_bytes + entry.size <= cap:
                    return None
                self._evict(key, entry)
                off = alloc.alloc(size)
                if off is not None:
                    return off
        return None

    def _room_possible(self, size: int, group: PoolGroup | None) -> bool:
        """Lock held: whether evicting everything _make_room may evict (unpinned untagged
        entries, and the pool's own for a pooled put) could free ``size`` contiguous bytes. A
        slot that stays (pinned by a reader, reserved by a write, waiting for the disk, another
        pool's) may split the arena so that no amount of eviction makes room for a large value.
        Checked for large values only (a scan of the index): a small one always fits somewhere
        once enough is evicted, unless nearly everything is pinned."""
        alloc = self.ram.alloc
        need = aligned(size)
        if need * ROOM_CHECK_SHARE < alloc.capacity or len(self.ram.index) > ROOM_CHECK_MAX_KEYS:
            return True
        runs = alloc.free_extents()
        runs += [(e.off, aligned(e.size)) for e in self.ram.index.values()
                 if e.pins == 0 and (e.group is None or e.group is group)]
        runs.sort()
        start = end = 0
        for s, n in runs:
            if s != end:
                start = s
            end = s + n
            if end - start >= need:
                return True
        return False

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
        nvme = self.nvme
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                key, entry = self._queue.popleft()
                # Reserved under the lock: a tombstone of a later delete lands after this record.
                p = None if entry.superseded else nvme.prepare(
                    key, entry.size, entry.expires, entry.seq, ValueMeta(entry.pool, entry.pos, entry.tail, 0.0,
                                                                         entry.fmt))
                if p is not None:
                    self._writing.add(entry)
            ok = False
            nvme.sweep()  # files of segments the reservation reclaimed: their space is needed now
            if p is not None:
                try:
                    ok = nvme.write(p, self.arena.slot(entry.off, entry.size))
                except Exception:  # never let the demoter die silently
                    log.exception("demotion of %r failed", key)
            with self._lock:
                self._writing.discard(entry)
                if self._demoting.get(key) is entry:
                    del self._demoting[key]
                self._queue_bytes -= entry.size
                if entry.superseded:
                    if ok:
                        nvme.invalidate(p)  # type: ignore[arg-type]  # deleted or overwritten meanwhile
                    self.counters["demotions_superseded"] += 1
                else:
                    ok = ok and nvme.publish(p)  # type: ignore[arg-type]
                    self.counters["demotions" if ok else "demotion_failures"] += 1
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

    @property
    def recovered_routing(self) -> tuple[int, int] | None:
        """The (ring generation, incarnation) recorded with the NVMe data recovered at start
        (None: none)."""
        return self.nvme.recovered_routing if self.nvme is not None else None

    def note_routing(self, gen: int, inc: int) -> None:
        """Record with the NVMe data the ring generation this node routes by and the incarnation
        it runs as (read back at the next start: recovered_routing)."""
        if self.nvme is not None:
            self.nvme.save_routing(gen, inc)

    def drop_all(self) -> int:
        """Forget every value: RAM, queued for demotion and on disk (files removed, so a restart
        does not bring them back either). A daemon that was declared down does this before it
        serves again. Slots being read are freed by their last reader. Returns the keys dropped."""
        with self._lock:
            n = len(self.ram) + len(self._demoting)
            for key in list(self.ram.index):
                self.ram.release(self.ram.pop(key))
            for entry in self._demoting.values():
                entry.superseded = True  # the demoter still writes it, then removes it again
            self._demoting.clear()
            if self.nvme is not None:
                n += self.nvme.drop_all()
            self.counters["dropped"] += n
            self._lock.notify_all()
        if self.nvme is not None:
            self.nvme.sweep()  # remove the dropped segments' files now, so a restart cannot find them
        return n

    def keys_hottest_first(self) -> list[Key]:
        """Every live key, RAM most-recently-used first, then those waiting for the disk, then
        disk-only keys (for handover)."""
        with self._lock:
            ram = list(reversed(self.ram.index.keys()))
            ram += [k for k in self._demoting if k not in self.ram.index]
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
            if self.nvme is not None:
                out.update(disk_read_buffer_bytes=self._read_held, disk_read_budget=self.read_budget)
            for (ns, pool), g in self.ram.groups.items():
                if not g.entries and g.budget is None:
                    continue  # an empty pool without a budget says nothing (thousands may have been)
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
                disk_reclaimed_segments=self.nvme.reclaimed_segments,
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
