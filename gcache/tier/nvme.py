"""NVMe tier: append-only segment files with an in-memory index and a byte budget.

Records (gcache.tier.records) carry the key, the value-metadata record, the value's checksum
and the write's sequence number. Values are read with ``preadv`` straight into the caller's
buffer and verified.

Writing a value is three steps so the store can order it against deletes: prepare() reserves
the record's place (under the store's lock: a tombstone for a later delete therefore always
lands after the value it hides), write() does the I/O (no lock), publish() indexes it.
Until a value's write completes its place is recorded in ``tier.inflight`` (segdir.InFlight,
a mapped file: a memory store under the lock, no system call), and a restart skips it whole: a
process that dies before write() loses that value only. (A tombstone reserved after it may be
complete and acknowledged first; the unwritten place would otherwise be a hole before a valid
record, which recovery cannot tell from a lost tombstone.) A segment sealed while a write at its
end is in flight has its file extended to the size the map records. Tombstones are not
recorded: the store writes them under its lock, which every reservation takes, so nothing is
reserved after a tombstone until it is complete (one cut short is a torn tail).
A delete or overwrite of an indexed key appends a tombstone; if even that cannot be written
(a full disk), the old record is invalidated in place, so a restart cannot bring it back.

Reclamation is whole segments, oldest first, when the budget would be exceeded: this is a
cache, so the oldest data is the cheapest to forget. A tombstone is never reclaimed before the
values it hides: they are in its own or an older segment.

A failed write is rolled back: its bytes are not counted and, when it was the segment's last
reservation, the file is truncated back so the next write reuses the place; no new segment
file is made for it. Otherwise (a record was reserved after it) its header is overwritten with
DEAD_MAGIC: a short write may have left a header that verifies, and a restart must not index a
record that was never acknowledged (its key was not indexed, so a later delete wrote no
tombstone for it). A full filesystem lowers the budget to what the tier's files take (records
written, plus reclaimed segments whose files are not gone yet), and the segment size to a
quarter of that if a segment no longer fits, so from then on the oldest segments are recycled
as when the budget is reached; the only segment is recycled too (sealed, a new one started).
A write past the process's file size limit seals its segment (if it holds data) and the next
goes to a new one.

On restart the index is rebuilt by scanning every segment (resynchronising past damage); for
each key the highest sequence number wins, whatever segment or position it is in.

A start on a full filesystem drops the oldest segments until the tier's own small files fit,
and with none left runs with the disk tier off (budget 0), rather than refusing to start.

A sealed segment's size is in the segment map, the open one's high-water mark in ``tier.hwm``
(both gcache.tier.segdir): a restart that finds the open segment's records ending below the mark
takes it as damage (a tombstone may have been cut off), not as the torn append of a crash.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import resource
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from gcache.errors import ConfigError
from gcache.tier import records as R
from gcache.tier import segdir
from gcache.tier.valuemeta import NO_META, ValueMeta

log = logging.getLogger(__name__)

SEG_RE = re.compile(r"^seg-(\d{8})\.log$")
SALT_FILE = "tier.id"
ERROR_LOG_EVERY_S = 10.0

Key = tuple[str, bytes]


@dataclass(eq=False)
class Segment:
    seg_id: int
    path: str
    fd: int
    size: int = 0  # file extent: next append goes here
    used: int = 0  # bytes of written (or in-flight) records counted against the budget
    sealed: bool = False  # no more appends (full, or a write failed after data)
    refs: int = 0  # readers and writers using fd right now
    doomed: bool = False  # reclaimed: close fd when refs drop to 0
    closed: bool = False  # fd closed
    unlinked: bool = False  # reclaimed and its file removed (or removing it failed)
    keys: set[Key] = field(default_factory=set)


class Location:
    __slots__ = ("checksum", "expires", "meta", "off", "rec", "seg", "seq", "size")

    def __init__(self, seg: Segment, rec: int, off: int, size: int, checksum: int, expires: float, seq: int,
                 meta: ValueMeta) -> None:
        self.seg, self.rec, self.off, self.size, self.checksum = seg, rec, off, size, checksum
        self.expires, self.seq, self.meta = expires, seq, meta  # meta.ttl_s is unused: see expires

    def value_meta(self, now: float) -> ValueMeta:
        m = self.meta
        return ValueMeta(m.pool, m.pos, m.tail, ValueMeta.ttl_left(self.expires, now), m.fmt)


class Pending:
    """A record whose place is reserved (prepare) and not yet written (write) or indexed."""

    __slots__ = ("key", "loc", "off", "raw", "seg", "slot", "total")

    def __init__(self, key: Key, raw: bytes, total: int, seg: Segment, off: int, loc: Location | None) -> None:
        self.key, self.raw, self.total, self.seg, self.off, self.loc = key, raw, total, seg, off, loc
        self.slot = -1  # its entry in tier.inflight (segdir.InFlight; -1: none)


class NvmeTier:
    def __init__(self, directory: str, budget: int, segment_bytes: int = 64 << 20) -> None:
        if budget < segment_bytes:
            segment_bytes = max(budget // 4, 4096)
        if budget < 4096:
            raise ConfigError(f"disk budget {budget} is too small; give at least 4 KiB (e.g. --disk-size 1GiB)")
        self.directory = directory
        self.budget = budget
        self.segment_bytes = segment_bytes
        self.index: dict[Key, Location] = {}
        self.segments: list[Segment] = []  # oldest first
        self.used = 0
        self.max_seq = 0  # highest sequence number on disk or handed out
        self.write_errors = 0
        self.corrupt = 0
        self.reclaimed_segments = 0
        self._lock = threading.Lock()
        self._unlink_later: list[Segment] = []
        self._doomed_bytes = 0  # bytes of reclaimed segments whose files still take space
        self._last_seg_id = 0  # never reused: a reclaimed segment's file may not be removed yet
        self._last_error_log = 0.0
        self._errors_unlogged = 0
        try:
            os.makedirs(directory, exist_ok=True)
            self._lock_fd = segdir.lock(directory)  # before anything in it is read or changed
            self.salt = _load_salt(directory)
            self._hwm = segdir.HighWater(directory, self.salt)
            self._inflight = segdir.InFlight(directory, self.salt)
        except OSError as exc:
            if hasattr(self, "_lock_fd"):
                segdir.unlock(self._lock_fd)
            raise ConfigError(f"disk directory {directory!r} is not writable: {exc}") from None
        # (ring generation, incarnation): what this node last routed by, and as which of its
        # incarnations, with these segments (the agent's record; None: none)
        self.recovered_routing: tuple[int, int] | None = None
        try:
            try:
                self._discard_if_unclean()
                self.recovered_routing = _read_routing(directory)
                self._recover()
                # every recovered segment is sealed, its size in the map
                self._start_write(lambda: self._hwm.open(self._last_seg_id))
                self._start_write(self._inflight.open)  # (what it said was used by the recovery)
                self._start_write(lambda: _write_state(directory, clean=False))
            except _NoRoom as exc:
                self._turn_off(str(exc))
            except OSError as exc:
                raise ConfigError(f"disk directory {directory!r} (--disk) cannot be used: {exc}") from None
        except BaseException:
            self._hwm.close()
            self._inflight.close()
            segdir.unlock(self._lock_fd)
            raise

    def __len__(self) -> int:
        return len(self.index)

    def next_seq(self) -> int:
        with self._lock:
            self.max_seq += 1
            return self.max_seq

    # -- lookup and read ------------------------------------------------------------------
    def lookup(self, key: Key) -> Location | None:
        """Location of a live value; takes a reference on its segment (give it back with done())."""
        with self._lock:
            loc = self.index.get(key)
            if loc is None:
                return None
            if loc.expires and loc.expires <= time.time():
                self._unindex(key)
                return None
            loc.seg.refs += 1
            return loc

    def current(self, key: Key, loc: Location) -> bool:
        """Whether ``loc`` is still what ``key`` maps to (no delete or overwrite since lookup)."""
        with self._lock:
            return self.index.get(key) is loc

    def index_keys(self) -> list[Key]:
        """A snapshot of the indexed keys, newest writes first."""
        with self._lock:
            return list(reversed(self.index.keys()))

    def contains(self, key: Key) -> bool:
        with self._lock:
            loc = self.index.get(key)
            return loc is not None and not (loc.expires and loc.expires <= time.time())

    def read(self, key: Key, loc: Location, dest: memoryview) -> bool:
        """Read the value into ``dest[:loc.size]`` and verify it; False (and the record dropped)
        on a short read or checksum mismatch. Releases the reference taken by lookup()."""
        try:
            view = dest[: loc.size]
            n = os.preadv(loc.seg.fd, [view], loc.off)
            ok = n == loc.size and xxhash.xxh3_64_intdigest(view) == loc.checksum
        except OSError as exc:
            log.error("nvme read of %r failed: %s", key, exc)
            ok = False
        finally:
            self.done(loc)
        if not ok:
            log.error("nvme: checksum mismatch or short read for %r in %s; dropped", key, loc.seg.path)
            with self._lock:
                self.corrupt += 1
                if self.index.get(key) is loc:
                    self._unindex(key)
        return ok

    def done(self, loc: Location) -> None:
        with self._lock:
            self._deref(loc.seg)

    # -- write ----------------------------------------------------------------------------
    def prepare(self, key: Key, size: int, expires: float, seq: int, meta: ValueMeta = NO_META) -> Pending | None:
        """Reserve the place of a value record (no I/O but creating a segment); None if it
        cannot be stored (larger than the budget, no segment file)."""
        raw = meta.encode()
        total = R.head_len(key, raw) + size
        with self._lock:
            self.max_seq = max(self.max_seq, seq)
            seg, off = self._reserve(total)
            if seg is None:
                return None
            loc = Location(seg, off, off + total - size, size, 0, expires, seq, meta)
            p = Pending(key, raw, total, seg, off, loc)
            # Recorded until written: a tombstone reserved after it may be complete (and
            # acknowledged) first, and a crash in between must leave a place a restart skips,
            # not a hole it has to take for damage (which costs every older value).
            p.slot = self._inflight.add(seg.seg_id, off, total)
            return p

    def write(self, p: Pending, value: memoryview) -> bool:
        """Write a prepared value record; False (rolled back) on a disk error."""
        loc = p.loc
        assert loc is not None and len(value) == loc.size
        loc.checksum = xxhash.xxh3_64_intdigest(value)
        parts = R.pack(R.KIND_VALUE, p.key, loc.seq, loc.size, loc.expires, loc.checksum, p.raw, self.salt)
        return self._write(p, [*parts, value])

    def publish(self, p: Pending) -> bool:
        """Index a written record (False if its segment was reclaimed meanwhile)."""
        with self._lock:
            if p.seg.doomed or p.loc is None:
                return False
            self._unindex(p.key)
            self.index[p.key] = p.loc
            p.seg.keys.add(p.key)
            return True

    def append(self, key: Key, value: memoryview, expires: float, seq: int | None = None,
               meta: ValueMeta = NO_META) -> bool:
        """prepare + write + publish in one go (callers that need no ordering, tests)."""
        p = self.prepare(key, len(value), expires, self.next_seq() if seq is None else seq, meta)
        self.sweep()
        return p is not None and self.write(p, value) and self.publish(p)

    def invalidate(self, p: Pending) -> None:
        """Make a written, unpublished record unreadable by a restart (its key was deleted or
        overwritten while it was being written)."""
        assert p.loc is not None
        self._invalidate(p.loc)

    def remove(self, key: Key, seq: int | None = None, force: bool = False) -> bool:
        """Forget ``key``; a tombstone with sequence number ``seq`` makes the removal survive a
        restart. Written if the key is indexed or ``force`` (a write of it may be in flight).
        Returns whether the key was indexed."""
        return self.remove_durably(key, seq, force)[0]

    def remove_durably(self, key: Key, seq: int | None = None, force: bool = False) -> tuple[bool, bool]:
        """remove(), and whether a tombstone was written (False also when none was needed). The
        indexed record is invalidated in place when the tombstone cannot be written; a record
        of the key still being written cannot be: the caller invalidates it once written."""
        with self._lock:
            loc = self.index.get(key)
            if loc is None and not force:
                return False, False
            self._unindex(key)
            if seq is None:
                self.max_seq += 1
                seq = self.max_seq
            self.max_seq = max(self.max_seq, seq)
            parts = R.pack(R.KIND_TOMBSTONE, key, seq, salt=self.salt)
            total = R.head_len(key, b"")
            seg, off = self._reserve(total)
        ok = seg is not None and self._write(Pending(key, b"", total, seg, off, None), parts)
        if not ok and loc is not None:
            self._invalidate(loc)  # no tombstone (full disk): kill the old record itself
        return loc is not None, ok  # (files of segments reclaimed for the tombstone: the owner sweeps)

    def _reserve(self, total: int) -> tuple[Segment | None, int]:
        """Lock held. Takes a reference on the segment; _write() gives it back."""
        if total > self.budget:
            return None, 0
        seg = self.segments[-1] if self.segments else None
        if seg is None or seg.sealed or (seg.size and seg.size + total > self.segment_bytes):
            if seg is not None:
                self._seal(seg)
            seg = self._new_segment()
            if seg is None:
                return None, 0
        while self.used + total > self.budget and len(self.segments) > 1:
            self._reclaim(self.segments[0])
        if self.used + total > self.budget and seg.size:
            # The open segment alone leaves no room (a budget lowered by a full filesystem):
            # it is the oldest data, so it is recycled too, and the record starts a new one.
            seg.sealed = True
            new = self._new_segment()
            if new is None:
                return None, 0
            self._reclaim(seg)
            seg = new
        if self.used + total > self.budget:
            return None, 0
        off = seg.size
        seg.size += total
        seg.used += total
        self.used += total
        seg.refs += 1
        return seg, off

    def _write(self, p: Pending, parts: list[Any]) -> bool:
        seg = p.seg
        too_big = full = False
        written = -1  # unknown
        try:
            written = os.pwritev(seg.fd, parts, p.off)
            if written != p.total:  # a short write on a regular file: the disk or the file is full
                too_big = _over_file_limit(p.off + p.total)
                full = not too_big
                raise OSError(f"short write ({written} of {p.total} bytes)")
            ok = True
        except OSError as exc:
            ok = False
            too_big = too_big or exc.errno == errno.EFBIG
            full = full or exc.errno in (errno.ENOSPC, errno.EDQUOT)
            self._log_error("nvme write to %s failed (%s); not stored", seg.path, exc)
        with self._lock:
            if not ok:
                self.write_errors += 1
                self._roll_back(p, too_big, full, written)
            elif seg.seg_id == self._hwm.seg and p.off + p.total > self._hwm.off:
                self._hwm.set(seg.seg_id, p.off + p.total)  # before the write is acknowledged
            self._inflight.remove(p.slot)  # (after the roll back: its dead header is written)
            self._deref(seg)
        return ok

    def _roll_back(self, p: Pending, too_big: bool, full: bool, written: int) -> None:
        """Lock held: un-count a failed write (``written`` bytes of it reached the file; -1:
        unknown), and reuse its place if nothing was reserved after it, else kill its header. A
        disk-full failure keeps the segment (the next write retries there: no new files) and
        lowers the budget to what fits; one past the file size limit seals the segment, if it
        holds data, so writes go to a fresh one."""
        seg = p.seg
        seg.used -= p.total
        if not seg.doomed:  # (reclaiming it took its reservations off self.used)
            self.used -= p.total
        gone = False
        if seg.size == p.off + p.total and not seg.doomed:
            seg.size = p.off
            try:
                os.ftruncate(seg.fd, p.off)  # give back what the partial write took
                gone = True
            except OSError as exc:
                self._log_error("cannot truncate %s: %s", seg.path, exc)
        if not gone:
            # Its header may be on disk and verify (the value's unwritten tail reads as zeros): a
            # restart would index a record that was never acknowledged, and that no tombstone
            # hides (a delete of its key found nothing indexed). A dead header over the whole
            # reservation also keeps a restart from taking the hole for damage (which costs every
            # older value). fd is open: we hold a reference.
            try:
                os.pwrite(seg.fd, R.dead_header(p.total, self.salt), p.off)
            except OSError as exc:
                self._log_error("cannot invalidate a failed record in %s: %s", seg.path, exc)
        if seg.doomed:
            return
        if gone and seg.sealed:
            self._save_map()  # its recorded size shrank with it
        if too_big and seg.size > 0:
            self._seal(seg)
        elif full:
            self._lower_budget()

    def _seal(self, seg: Segment) -> None:
        """Lock held: no more appends to ``seg``; the map will record its size. A write still in
        flight at its end (see prepare) has not extended the file yet: it is extended now
        (sparse; rare: once per segment), so a crash before that write leaves the size recorded,
        not a sealed segment shorter than recorded (damage, which costs every older value)."""
        seg.sealed = True
        try:
            if os.fstat(seg.fd).st_size < seg.size:
                os.ftruncate(seg.fd, seg.size)  # (writes only go below seg.size: nothing is cut)
        except OSError as exc:
            self._log_error("nvme: cannot extend the sealed segment %s to %d bytes: %s", seg.path, seg.size, exc)

    def _lower_budget(self) -> None:
        """Lock held: the filesystem is full: the budget becomes what the tier's files take now
        (records, plus reclaimed segments whose space is not given back yet), and segments shrink
        to a quarter of it if one no longer fits, so the oldest are recycled from now on."""
        fits = self.used + self._doomed_bytes
        if not 0 < fits < self.budget:
            return
        log.warning("nvme: the filesystem of %s is full at %d bytes (%d of them records); the disk budget is "
                    "lowered from %d to that until restart", self.directory, fits, self.used, self.budget)
        self.budget = fits
        if self.budget < self.segment_bytes:
            self.segment_bytes = max(self.budget // 4, 4096)

    def _invalidate(self, loc: Location) -> None:
        with self._lock:
            if loc.seg.doomed:
                return  # its file is gone
            loc.seg.refs += 1
        try:
            os.pwrite(loc.seg.fd, R.DEAD_MAGIC, loc.rec)
        except OSError as exc:
            self._log_error("cannot invalidate a record in %s: %s", loc.seg.path, exc)
        finally:
            with self._lock:
                self._deref(loc.seg)

    def _log_error(self, msg: str, *args: object) -> None:
        """log.error, at most once per ERROR_LOG_EVERY_S (a full disk fails every write)."""
        now = time.monotonic()
        if now - self._last_error_log < ERROR_LOG_EVERY_S:
            self._errors_unlogged += 1
            return
        if self._errors_unlogged:
            msg += f" ({self._errors_unlogged} similar errors not logged)"
        self._last_error_log, self._errors_unlogged = now, 0
        log.error(msg, *args)

    # -- segments -------------------------------------------------------------------------
    def _new_segment(self) -> Segment | None:
        """Lock held: open the next segment (and record it and the one sealed before it in the
        map; if that fails the tier goes on: only a later removal of these files goes unnoticed)."""
        seg_id = self._last_seg_id + 1
        path = self._seg_path(seg_id)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            self.write_errors += 1
            self._log_error("cannot create segment %s: %s", path, exc)
            return None
        self._last_seg_id = seg_id
        seg = Segment(seg_id, path, fd)
        self.segments.append(seg)
        self._save_map()
        self._hwm.set(seg_id, 0)  # (after the map: the segment sealed before it has its size there)
        return seg

    def _seg_path(self, seg_id: int) -> str:
        return os.path.join(self.directory, f"seg-{seg_id:08d}.log")

    def _segmap(self) -> segdir.SegMap:
        """Lock held: the map of the live segments (contiguous ids: reclaimed oldest first)."""
        floor = self.segments[0].seg_id if self.segments else self._last_seg_id + 1
        return segdir.SegMap(floor, self._last_seg_id, {s.seg_id: s.size for s in self.segments if s.sealed})

    def _save_map(self, durable: bool = False) -> bool:
        """Lock held: record the segment map (see gcache.tier.segdir: a clean stop makes it
        durable); False (logged) if it cannot be written."""
        try:
            segdir.save_map(self.directory, self._segmap(), durable)
        except OSError as exc:
            self._log_error("nvme: cannot record the segment map in %s: %s", self.directory, exc)
            return False
        return True

    def drop_all(self) -> int:
        """Forget every record and remove every segment file; returns the keys forgotten. A
        write in flight into a removed segment is not indexed (the segment is doomed)."""
        with self._lock:
            n = len(self.index)
            segs = list(self.segments)
            for seg in segs:
                self._reclaim(seg, save=False)
            if segs:
                self._floor_raised(segs)
            return n

    def _reclaim(self, seg: Segment, save: bool = True) -> None:
        """Lock held: forget a segment. Its file is removed by sweep(), outside every lock
        (freeing a large file's blocks takes a while). The map's floor is raised first (unless
        ``save`` is False: the caller does it before it lets go of the lock), so a restart
        ignores the file even if it is still there: a delete of one of its keys from now on
        finds nothing indexed and writes no tombstone."""
        for key in list(seg.keys):
            self._unindex(key)
        self.segments.remove(seg)
        self.used -= seg.used
        self.reclaimed_segments += 1
        self._unlink_later.append(seg)
        self._doomed_bytes += seg.size
        seg.doomed = True
        if save:
            self._floor_raised([seg])
        if seg.refs == 0:
            self._close(seg)

    def _floor_raised(self, segs: list[Segment]) -> None:
        """Lock held: record that ``segs`` are reclaimed. If the map cannot be written, empty
        their files now: a restart then finds sealed segments shorter than recorded (damage),
        and forgets every value up to them, as it must."""
        if self._save_map():
            return
        for seg in segs:
            try:
                os.truncate(seg.path, 0)
            except OSError as exc:
                self._log_error("nvme: cannot empty the reclaimed segment %s: %s", seg.path, exc)

    def sweep(self) -> None:
        """Remove the files of reclaimed segments (call without holding the store's lock)."""
        if not self._unlink_later:
            return
        with self._lock:
            segs, self._unlink_later = self._unlink_later, []
        for seg in segs:
            try:
                os.unlink(seg.path)
            except OSError as exc:
                log.error("cannot remove segment %s: %s", seg.path, exc)
            with self._lock:
                seg.unlinked = True
                if seg.closed:
                    self._doomed_bytes -= seg.size

    def _close(self, seg: Segment) -> None:
        """Lock held: close a doomed segment's fd (its space is given back once it is unlinked too)."""
        os.close(seg.fd)
        seg.closed = True
        if seg.unlinked:
            self._doomed_bytes -= seg.size

    def _deref(self, seg: Segment) -> None:
        seg.refs -= 1
        if seg.refs == 0 and seg.doomed:
            self._close(seg)

    def _unindex(self, key: Key) -> None:
        loc = self.index.pop(key, None)
        if loc is not None:
            loc.seg.keys.discard(key)

    # -- restart recovery -----------------------------------------------------------------
    def _recover(self) -> None:
        """Rebuild the index from the segment files. Where a segment is damaged (a record that
        does not verify before its end, a sealed one shorter or longer than recorded, a missing
        file), a tombstone may have been lost there: every value written before the damage is
        dropped (its segment and older ones are reclaimed). Only a torn tail of the newest,
        unsealed segment past its high-water mark is a normal crash (an append that never
        completed, so never acknowledged): it is cut off; one that reaches below the mark is damage."""
        d = self.directory
        ids, smap, hwm_seg, hwm_off, cut = self._survey()
        inflight: dict[int, dict[int, int]] = {}  # segment id -> {offset: end} of writes in flight at a crash
        for seg_id, off, n in self._inflight.load():
            inflight.setdefault(seg_id, {})[off] = off + n
        scanned = []
        for seg_id in ids:
            seg, found, damage = self._scan_segment(seg_id, smap, top=seg_id == ids[-1],
                                                    hwm=hwm_off if seg_id == hwm_seg else 0,
                                                    inflight=inflight.get(seg_id))
            scanned.append((seg, found))
            cut = max(cut, damage)
        for seg in [s for s in self.segments if (s.seg_id, math.inf) <= cut]:
            self._reclaim(seg, save=False)
        self._index_recovered(scanned, cut)
        while self.used > self.budget and len(self.segments) > 0:
            self._reclaim(self.segments[0], save=False)
        # The files first (room for the map on a full filesystem): a crash in between finds the
        # oldest segments missing, and drops only them.
        self.sweep()
        self._start_write(lambda: segdir.save_map(d, self._segmap()))  # recovered segments are sealed
        if ids:
            log.info("nvme: recovered %d keys from %d segments (%d bytes)%s", len(self.index), len(ids),
                     self.used, f"; every value written before segment {cut[0]}"
                     f"{'' if cut[1] == math.inf else f' offset {int(cut[1])}'} is dropped (damage)" if cut[0] else "")

    def _survey(self) -> tuple[list[int], segdir.SegMap | None, int, int, tuple[int, float]]:
        """At start, before any segment is read: the ids of the segment files to scan, the
        segment map (None: none that can be trusted), the high-water mark (segment, offset;
        (0, 0): none or reclaimed) and what is not trusted because of what is missing. Sets
        aside what is not a segment of the tier (not a regular file; an id above any it
        created), removes the files of segments reclaimed before the restart, and sets
        _last_seg_id."""
        d = self.directory
        ids, strays = [], {}  # strays: id -> why it is not a segment of the tier
        for entry in os.scandir(d):
            if m := SEG_RE.match(entry.name):
                if entry.is_file(follow_symlinks=False):
                    ids.append(int(m.group(1)))
                else:
                    strays[int(m.group(1))] = "not a regular file"
        ids.sort()
        smap, hwm = segdir.load_map(d), self._hwm.load()
        cut: tuple[int, float] = (0, 0)  # values before this (segment id, offset) are not trusted
        if smap is not None and (why := segdir.implausible(smap, hwm[0] if hwm is not None else None)):
            log.warning("nvme: the segment map %s of %s is implausible (%s): it is not what the tier wrote, so none "
                        "of its segments can be trusted", segdir.MAP_FILE, d, why)
            smap, cut = None, (ids[-1], math.inf) if ids else cut
        elif smap is None and ids:
            log.warning("nvme: %s holds segments but no segment map (%s): none of them can be trusted",
                        d, segdir.MAP_FILE)
            cut = (ids[-1], math.inf)
        if smap is not None and hwm is not None:  # every segment the tier created is at most this
            top = max(smap.newest, hwm[0])
            strays.update((i, f"its id is above {top}, the newest the tier created") for i in ids if i > top)
            ids = [i for i in ids if i <= top]
        for seg_id, why in sorted(strays.items()):
            path = self._seg_path(seg_id)
            log.warning("nvme: %s is not a segment of this tier (%s): set aside as %s", path, why,
                        segdir.set_aside(path))
        floor = smap.floor if smap is not None else 1
        for seg_id in (i for i in ids if i < floor):  # reclaimed, its removal did not happen
            log.info("nvme: removing %s, a segment reclaimed before the restart", self._seg_path(seg_id))
            try:
                os.unlink(self._seg_path(seg_id))
            except OSError as exc:
                log.error("nvme: cannot remove %s (never read again: it is below the floor): %s",
                          self._seg_path(seg_id), exc)
        ids = [i for i in ids if i >= floor]
        if hwm is None and ids:
            log.warning("nvme: %s holds segments but no readable high-water mark (%s): none of them can be trusted",
                        d, segdir.HWM_FILE)
            cut = max(cut, (ids[-1], math.inf))
        hwm_seg, hwm_off = hwm if hwm is not None and hwm[0] >= floor else (0, 0)  # (below: reclaimed)
        self._last_seg_id = max(ids[-1] if ids else 0, smap.newest if smap is not None else 0, hwm_seg)
        newest = max(smap.newest if smap is not None else 0, hwm_seg)
        gaps = segdir.missing(floor, newest, ids) if smap is not None or hwm_seg else []
        if gaps:
            log.warning("nvme: segments %s of %s are missing (%d of the %d ids from %d to %d)", segdir.describe(gaps),
                        d, sum(b - a + 1 for a, b in gaps), newest - floor + 1, floor, newest)
            cut = max(cut, (gaps[-1][1], math.inf))
        return ids, smap, hwm_seg, hwm_off, cut

    def _start_write(self, write: Callable[[], object]) -> None:
        """At start: write one of the tier's own small files (map, mark, state). On a full
        filesystem the oldest segment is dropped and its file removed to make room, one at a
        time, until it fits (a cache may forget; a crash meanwhile finds the oldest segments
        missing, and drops only them); _NoRoom when none is left."""
        while True:
            try:
                write()
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if not self.segments:
                    raise _NoRoom(str(exc)) from None
                seg = self.segments[0]
                log.warning("nvme: the filesystem of %s is full (%s): %s is dropped (%d keys, %d bytes) to make "
                            "room for the tier's own files", self.directory, exc, os.path.basename(seg.path),
                            len(seg.keys), seg.size)
                self._reclaim(seg, save=False)
                self.sweep()

    def _turn_off(self, why: str) -> None:
        """At start, with not even room for the tier's own files once every segment is dropped:
        run without the disk tier (budget 0: nothing is written, so nothing on disk can lie)."""
        for seg in list(self.segments):
            self._reclaim(seg, save=False)
        self.sweep()
        self.budget = 0
        log.error("nvme: the filesystem of disk directory %s is full (%s), with no segment left to drop to make "
                  "room for the tier's own files: the disk tier is off (values are kept in RAM only); free "
                  "space there, or give another --disk, and restart the daemon", self.directory, why)

    def _scan_segment(self, seg_id: int, smap: segdir.SegMap | None, top: bool, hwm: int = 0,
                      inflight: dict[int, int] | None = None) -> tuple[Segment, R.ScanResult, tuple[int, float]]:
        """Open and scan one segment at start: the segment (sealed, in self.segments), what the
        scan found, and where damage in it ends ((0, 0): none). ``hwm``: where its acknowledged
        records end, as tier.hwm says (0: nothing known); ``inflight``: the places of value
        writes that had not completed (tier.inflight), skipped whole."""
        path = self._seg_path(seg_id)
        fd = os.open(path, os.O_RDWR)
        seg = Segment(seg_id, path, fd, sealed=True)
        self.segments.append(seg)
        file_size = os.fstat(fd).st_size
        found = R.scan(fd, file_size, self.salt, inflight)
        damage: tuple[int, float] = (0, 0)
        for off, end in found.inflight:  # kept dead for the next restarts (the table is emptied)
            try:
                os.pwrite(fd, R.dead_header(end - off, self.salt), off)
            except OSError as exc:
                log.warning("nvme: %s: cannot invalidate the place of a write in flight at the crash (%s): damage",
                            path, exc)
                damage = max(damage, (seg_id, end))
        if found.inflight:
            log.info("nvme: %s: %d value writes in flight at the crash skipped (never acknowledged)", path,
                     len(found.inflight))
        recorded = smap.sizes.get(seg_id) if smap is not None else None
        if found.versions:
            log.warning("nvme: %s: %d records of format version %s, not version %d, the one this build reads and "
                        "writes: written by another gcache version (an upgrade or a downgrade?); they cannot be "
                        "read, so they and every value written before them are dropped", path,
                        sum(found.versions.values()), "/".join(map(str, sorted(found.versions))), R.REC_VERSION)
        if found.skipped:
            log.warning("nvme: %s: %d damaged bytes resynchronised past, up to offset %d", path, found.skipped,
                        found.damaged_to)
        if found.damaged_to:
            damage = max(damage, (seg_id, found.damaged_to))
        if recorded is not None and recorded != file_size:
            log.warning("nvme: %s is %d bytes; it was sealed at %d", path, file_size, recorded)
            damage = (seg_id, math.inf)
        elif found.end < hwm:
            log.warning("nvme: %s: its records end at %d, below its high-water mark %d (cut or damaged)", path,
                        found.end, hwm)
            damage = (seg_id, math.inf)
        elif found.end < file_size:
            if top and recorded is None:  # the normal crash: an append never completed
                log.warning("nvme: %s: %d torn bytes at the end (truncated)", path, file_size - found.end)
                os.ftruncate(fd, found.end)
            else:
                log.warning("nvme: %s: %d bytes that do not verify at the end of a sealed segment", path,
                            file_size - found.end)
                damage = (seg_id, math.inf)
        seg.size = seg.used = found.end
        self.used += seg.used
        return seg, found, damage

    def _index_recovered(self, scanned: list[tuple[Segment, R.ScanResult]], cut: tuple[int, float]) -> None:
        """Index, for each key, its newest value record at or after ``cut`` that no tombstone hides
        (a tombstone anywhere hides the values of its key with a lower seq). A value dropped for
        being before the cut hides its key's older values too: they are no more current than it."""
        now = time.time()
        best: dict[Key, tuple[R.Rec, Segment]] = {}  # newest value record per key
        hidden: dict[Key, int] = {}  # newest tombstone per key: values below it are dead
        for seg, found in scanned:
            for rec in found.records:
                self.max_seq = max(self.max_seq, rec.seq)
                if rec.kind == R.KIND_TOMBSTONE:
                    hidden[rec.key] = max(hidden.get(rec.key, 0), rec.seq)
                elif (seg.seg_id, rec.off) < cut or seg.doomed:
                    hidden[rec.key] = max(hidden.get(rec.key, 0), rec.seq + 1)
                else:
                    cur = best.get(rec.key)
                    if cur is None or rec.seq >= cur[0].seq:
                        best[rec.key] = (rec, seg)
        for key, (rec, seg) in sorted(best.items(), key=lambda kv: kv[1][0].seq):  # index order: oldest first
            if rec.seq < hidden.get(key, 0) or (rec.expires and rec.expires <= now):
                continue
            self.index[key] = Location(seg, rec.off, rec.value_off, rec.value_len, rec.checksum, rec.expires,
                                       rec.seq, rec.meta)
            seg.keys.add(key)

    def save_routing(self, gen: int, inc: int) -> None:
        """Record the ring generation this node now routes by and the incarnation it runs as
        (not fsync'd: a lost or older record only makes a restart drop what it recovered)."""
        path = os.path.join(self.directory, RING_GEN_FILE)
        try:
            with open(path + ".tmp", "w") as f:
                f.write(f"{gen} {inc}\n")
            os.replace(path + ".tmp", path)
        except OSError as exc:
            self._log_error("cannot record the ring generation in %s: %s", path, exc)

    def close(self) -> None:
        """Stop; a clean stop makes the segments durable (fsync), so a reboot may keep them."""
        if self._lock_fd < 0:
            return  # closed already
        self.sweep()
        with self._lock:
            synced = True
            for seg in self.segments:
                try:
                    os.fsync(seg.fd)
                except OSError as exc:
                    synced = False
                    log.error("nvme: cannot sync %s: %s", seg.path, exc)
            synced = self._save_map(durable=True) and synced  # the sealed sizes as they are now
            synced = self._hwm.close(sync=True) and synced  # the open segment's
            self._inflight.close()
            for seg in self.segments:
                seg.doomed = True
                if seg.refs == 0:
                    os.close(seg.fd)
            self.segments.clear()
        if synced:
            try:
                _write_state(self.directory, clean=True)
            except OSError as exc:
                log.error("nvme: cannot record the clean stop in %s: %s", self.directory, exc)
        segdir.unlock(self._lock_fd)  # another daemon may use the directory now
        self._lock_fd = -1

    def _discard_if_unclean(self) -> None:
        """Segments are written through the page cache, unsynced: a process crash keeps every
        write, a machine crash (power cut, kernel panic) may lose recent ones, tombstones among
        them, while older values survive. So after the machine restarted (another boot id) since
        a daemon that did not stop cleanly, the segments are not trusted: they are removed."""
        state = _read_state(self.directory)
        if state is None or state.get("clean") or state.get("boot") == _boot_id():
            return
        names = [n for n in os.listdir(self.directory) if SEG_RE.match(n)]
        log.warning("nvme: the machine restarted since this tier was last used and it was not stopped cleanly; "
                    "recent writes (deletes among them) may be lost, so its %d segments are discarded", len(names))
        smap = segdir.load_map(self.directory)
        newest = max([int(SEG_RE.match(n).group(1)) for n in names]  # type: ignore[union-attr]
                     + [smap.newest if smap is not None else 0])
        for n in names:  # (first: room for the map on a full filesystem; this start's state is not
            os.unlink(os.path.join(self.directory, n))  # written yet, so a crash in between discards again)
        self._start_write(lambda: segdir.save_map(self.directory, segdir.SegMap(newest + 1, newest)))


class _NoRoom(Exception):
    """No room on the filesystem for the tier's own files, with no segment left to drop."""


def _over_file_limit(end: int) -> bool:
    """Whether a file ending at ``end`` is past this process's file size limit (RLIMIT_FSIZE)."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return soft != resource.RLIM_INFINITY and end > soft


STATE_FILE = "tier.state"
RING_GEN_FILE = "ring.gen"


def _read_routing(directory: str) -> tuple[int, int] | None:
    """The (ring generation, incarnation) record; None if missing, unreadable or of the older
    one-number form (which says nothing of the incarnation: its data is not trusted)."""
    try:
        with open(os.path.join(directory, RING_GEN_FILE)) as f:
            gen, inc = f.read().split()
        return int(gen), int(inc)
    except (OSError, ValueError):
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _read_state(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, STATE_FILE)) as f:
            boot, _, clean = f.read().strip().partition(" ")
            return {"boot": boot, "clean": clean == "clean"}
    except (OSError, ValueError):
        return None


def _write_state(directory: str, clean: bool) -> None:
    """Record this boot and whether the tier was stopped cleanly, durably (fsync'd)."""
    segdir.write_atomically(directory, STATE_FILE, f"{_boot_id()} {'clean' if clean else 'running'}\n")


def _load_salt(directory: str) -> int:
    """The tier's random header-checksum seed, created on first use (see gcache.tier.records)."""
    path = os.path.join(directory, SALT_FILE)
    try:
        with open(path) as f:
            return int(f.read().strip(), 16)
    except FileNotFoundError:
        pass
    except ValueError:
        log.warning("nvme: %s is unreadable; starting a new tier (old segments will not verify)", path)
    salt = secrets.randbits(64)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{salt:016x}\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return salt
