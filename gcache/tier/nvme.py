"""NVMe tier: append-only segment files with an in-memory index and a byte budget.

Record layout (little endian)::

    magic b"GCR1" | version u8 | kind u8 | ns_len u16 | key_len u16 | value_len u64 |
    expires f64 | value_xxh3 u64 | header_xxh3 u64 | namespace | key | value

``header_xxh3`` covers the fields before it plus namespace and key, so a torn or garbage
header is recognised; ``value_xxh3`` is checked on every read, so a torn or rotted value is a
miss, never wrong bytes. A tombstone (kind 2) records a delete or overwrite so a restart does not
bring the old value back. Values are read with ``preadv`` straight into the caller's buffer.

Reclamation is whole segments, oldest first, when the budget would be exceeded: this is a
cache, so the oldest data is the cheapest to forget. On restart the index is rebuilt by scanning
headers; the scan of a segment stops at the first bad or truncated record (a torn tail).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import time
from dataclasses import dataclass, field

import xxhash

from gcache.errors import ConfigError

log = logging.getLogger(__name__)

REC = struct.Struct("<4sBBHHQdQ")
HCHK = struct.Struct("<Q")
REC_MAGIC = b"GCR1"
REC_VERSION = 1
KIND_VALUE = 1
KIND_TOMBSTONE = 2
FIXED = REC.size + HCHK.size
SEG_RE = re.compile(r"^seg-(\d{8})\.log$")

Key = tuple[str, bytes]


@dataclass(eq=False)
class Segment:
    seg_id: int
    path: str
    fd: int
    size: int = 0  # bytes reserved (written or being written)
    sealed: bool = False  # no more appends (full, or a write failed)
    refs: int = 0  # readers and writers using fd right now
    doomed: bool = False  # reclaimed: close fd when refs drop to 0
    keys: set[Key] = field(default_factory=set)


class Location:
    __slots__ = ("seg", "off", "size", "checksum", "expires")

    def __init__(self, seg: Segment, off: int, size: int, checksum: int, expires: float) -> None:
        self.seg, self.off, self.size, self.checksum, self.expires = seg, off, size, checksum, expires


class NvmeTier:
    def __init__(self, directory: str, budget: int, segment_bytes: int = 64 << 20) -> None:
        if budget < segment_bytes:
            segment_bytes = max(budget // 4, 4096)
        if budget < 4096:
            raise ConfigError(f"disk budget {budget} is too small; give at least 4 KiB (e.g. --disk-size 1GiB)")
        try:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, ".probe")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as exc:
            raise ConfigError(f"disk directory {directory!r} is not writable: {exc}") from None
        self.directory = directory
        self.budget = budget
        self.segment_bytes = segment_bytes
        self.index: dict[Key, Location] = {}
        self.segments: list[Segment] = []  # oldest first
        self.used = 0
        self.write_errors = 0
        self.corrupt = 0
        self.reclaimed_segments = 0
        self._lock = threading.Lock()
        self._recover()

    def __len__(self) -> int:
        return len(self.index)

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
    def append(self, key: Key, value: memoryview, expires: float) -> bool:
        """Write a value record; False if it cannot be stored (too large, disk error)."""
        ns, k = key[0].encode(), key[1]
        checksum = xxhash.xxh3_64_intdigest(value)
        header = REC.pack(REC_MAGIC, REC_VERSION, KIND_VALUE, len(ns), len(k), len(value), expires, checksum)
        hchk = HCHK.pack(xxhash.xxh3_64_intdigest(header + ns + k))
        total = FIXED + len(ns) + len(k) + len(value)
        seg, off = self._reserve(total)
        if seg is None:
            return False
        ok = self._write(seg, off, [header, hchk, ns, k, value], total)
        with self._lock:
            if ok and not seg.doomed:
                value_off = off + FIXED + len(ns) + len(k)
                self._unindex(key)
                self.index[key] = Location(seg, value_off, len(value), checksum, expires)
                seg.keys.add(key)
            self._deref(seg)
        return ok

    def remove(self, key: Key) -> bool:
        """Forget ``key``; a tombstone makes the removal survive a restart."""
        with self._lock:
            if key not in self.index:
                return False
            self._unindex(key)
        ns, k = key[0].encode(), key[1]
        header = REC.pack(REC_MAGIC, REC_VERSION, KIND_TOMBSTONE, len(ns), len(k), 0, 0.0, 0)
        hchk = HCHK.pack(xxhash.xxh3_64_intdigest(header + ns + k))
        total = FIXED + len(ns) + len(k)
        seg, off = self._reserve(total)
        if seg is not None:
            self._write(seg, off, [header, hchk, ns, k], total)
            with self._lock:
                self._deref(seg)
        return True

    def _reserve(self, total: int) -> tuple[Segment | None, int]:
        with self._lock:
            if total > self.budget:
                return None, 0
            seg = self.segments[-1] if self.segments else None
            if seg is None or seg.sealed or (seg.size and seg.size + total > self.segment_bytes):
                if seg is not None:
                    seg.sealed = True
                seg = self._new_segment()
                if seg is None:
                    return None, 0
            while self.used + total > self.budget and len(self.segments) > 1:
                self._reclaim(self.segments[0])
            if self.used + total > self.budget:
                return None, 0
            off = seg.size
            seg.size += total
            self.used += total
            seg.refs += 1
            return seg, off

    def _write(self, seg: Segment, off: int, parts: list, total: int) -> bool:
        try:
            written = os.pwritev(seg.fd, parts, off)
            if written != total:  # a short write on a regular file means the disk is full
                raise OSError(f"short write ({written} of {total} bytes)")
            return True
        except OSError as exc:
            self.write_errors += 1
            log.error("nvme write to %s failed (%s); segment sealed, value not stored", seg.path, exc)
            with self._lock:
                seg.sealed = True
            return False

    # -- segments -------------------------------------------------------------------------
    def _new_segment(self) -> Segment | None:
        seg_id = self.segments[-1].seg_id + 1 if self.segments else 1
        path = os.path.join(self.directory, f"seg-{seg_id:08d}.log")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            self.write_errors += 1
            log.error("cannot create segment %s: %s", path, exc)
            return None
        seg = Segment(seg_id, path, fd)
        self.segments.append(seg)
        return seg

    def _reclaim(self, seg: Segment) -> None:
        for key in list(seg.keys):
            self._unindex(key)
        self.segments.remove(seg)
        self.used -= seg.size
        self.reclaimed_segments += 1
        try:
            os.unlink(seg.path)
        except OSError as exc:
            log.error("cannot remove segment %s: %s", seg.path, exc)
        seg.doomed = True
        if seg.refs == 0:
            os.close(seg.fd)

    def _deref(self, seg: Segment) -> None:
        seg.refs -= 1
        if seg.refs == 0 and seg.doomed:
            os.close(seg.fd)

    def _unindex(self, key: Key) -> None:
        loc = self.index.pop(key, None)
        if loc is not None:
            loc.seg.keys.discard(key)

    # -- restart recovery -----------------------------------------------------------------
    def _recover(self) -> None:
        names = sorted(n for n in os.listdir(self.directory) if SEG_RE.match(n))
        now = time.time()
        for name in names:
            path = os.path.join(self.directory, name)
            seg_id = int(SEG_RE.match(name).group(1))  # type: ignore[union-attr]
            fd = os.open(path, os.O_RDWR)
            seg = Segment(seg_id, path, fd, sealed=True)
            self.segments.append(seg)
            seg.size = self._scan(seg, os.fstat(fd).st_size, now)
            self.used += seg.size
        while self.used > self.budget and len(self.segments) > 0:
            self._reclaim(self.segments[0])
        if names:
            log.info("nvme: recovered %d keys from %d segments (%d bytes)", len(self.index), len(names), self.used)

    def _scan(self, seg: Segment, file_size: int, now: float) -> int:
        """Index the segment's records; return the offset of the end of the last good record."""
        off = 0
        hdr = bytearray(FIXED)
        while off + FIXED <= file_size:
            if os.preadv(seg.fd, [hdr], off) != FIXED:
                break
            magic, ver, kind, ns_len, key_len, vlen, expires, checksum = REC.unpack_from(hdr)
            if magic != REC_MAGIC or ver != REC_VERSION or kind not in (KIND_VALUE, KIND_TOMBSTONE):
                break
            names = os.pread(seg.fd, ns_len + key_len, off + FIXED)
            if len(names) != ns_len + key_len:
                break
            (hchk,) = HCHK.unpack_from(hdr, REC.size)
            if xxhash.xxh3_64_intdigest(bytes(hdr[: REC.size]) + names) != hchk:
                break
            value_off = off + FIXED + ns_len + key_len
            if value_off + vlen > file_size:
                break  # torn tail: the value never fully reached the file
            try:
                key = (names[:ns_len].decode(), names[ns_len:])
            except UnicodeDecodeError:
                break
            self._unindex(key)
            if kind == KIND_VALUE and not (expires and expires <= now):
                self.index[key] = Location(seg, value_off, vlen, checksum, expires)
                seg.keys.add(key)
            off = value_off + vlen
        if off < file_size:
            log.warning("nvme: %s has %d bytes of torn or garbage tail; ignored", seg.path, file_size - off)
            os.ftruncate(seg.fd, off)
        return off

    def close(self) -> None:
        with self._lock:
            for seg in self.segments:
                seg.doomed = True
                if seg.refs == 0:
                    os.close(seg.fd)
            self.segments.clear()
