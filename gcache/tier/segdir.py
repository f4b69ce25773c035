"""The NVMe tier directory's own files: the lock that keeps a second daemon out, the segment
map that lets a restart notice a segment that is missing, truncated or already reclaimed, the
open segment's high-water mark, and the places of writes in flight.

The lock: an exclusive ``flock`` on the directory itself, held while the tier is open. A
second process (another daemon) is refused; the kernel drops the lock when its holder dies
however it dies; and no file in the directory can be deleted to lose it (a lock on a
``tier.lock`` file was: delete the file while the daemon runs, and a second daemon locked a new
one). A second tier in the same process shares the lock (the in-process tests reopen a
directory to play a restart after a crash): the process keeps one locked descriptor per
directory, released when its last tier closes.

``tier.segs``: the segment map. Its first line is ``FLOOR NEWEST``: segment files with an id
below FLOOR were reclaimed (a restart ignores and removes them), and every id from FLOOR to
NEWEST has a file. Each further line is ``ID SIZE``: a sealed segment (no appends any more) and
the size its file has. Replaced atomically (temporary file, rename) when a segment is created or
reclaimed, before anything depends on it, and not fsync'd then: like the segments themselves it
has to survive a process crash, which the page cache does; after a machine crash the tier keeps
nothing unless it was stopped cleanly (gcache.tier.nvme), and a clean stop writes it durably
(fsync of the file and of the directory). An fsync while running would be taken under the
store's lock, and on a busy disk one can take as long as flushing every dirty segment page.

``tier.hwm``: the open segment's high-water mark (segment id, offset up to which every appended
record is complete, a checksum seeded with the tier's salt). A sealed segment's size is in the
map; the open one's is not, so this small file, mapped into memory, is updated with a plain
store after each append and before it is acknowledged (no system call: a process crash keeps the
page cache). A restart that finds the open segment's records ending below the mark takes it as
damage (a tombstone may have been cut off), not as the torn append of a crash.

``tier.inflight``: the places of value records reserved and not yet written (InFlight), mapped
and updated the same way; a restart skips them whole (see gcache.tier.nvme).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import threading
from dataclasses import dataclass, field

import xxhash

from gcache.errors import ConfigError

log = logging.getLogger(__name__)

MAP_FILE = "tier.segs"
HWM_FILE = "tier.hwm"
HWM = struct.Struct("<4s4xQQQ")  # magic, segment id, offset, xxh3 of the rest (seeded with the salt)
HWM_MAGIC = b"GCH1"


class DirectoryInUse(ConfigError):
    """Another process (a gcache daemon) holds the tier directory's lock."""


_held: dict[tuple[int, int], list[int]] = {}  # (device, inode) of a directory -> [locked fd, tiers using it]
_held_lock = threading.Lock()


def lock(directory: str) -> int:
    """Take the directory's lock; returns a handle for ``unlock``. DirectoryInUse if another
    process holds it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    st = os.fstat(fd)
    ident = (st.st_dev, st.st_ino)
    with _held_lock:
        held = _held.get(ident)
        if held is not None:  # this process has it already (another tier, or one left open)
            os.close(fd)
            held[1] += 1
            return held[0]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise DirectoryInUse(f"disk directory {directory!r} is in use by another gcache daemon (it holds the "
                                 "directory's lock); stop that daemon or give this one another --disk") from None
        _held[ident] = [fd, 1]
        return fd


def unlock(handle: int) -> None:
    """Release what ``lock`` returned: the directory is free once its last tier here closed."""
    with _held_lock:
        for ident, held in _held.items():
            if held[0] == handle:
                held[1] -= 1
                if held[1] == 0:
                    del _held[ident]
                    os.close(handle)
                return


@dataclass
class SegMap:
    floor: int  # lowest id not reclaimed
    newest: int  # highest id created
    sizes: dict[int, int] = field(default_factory=dict)  # sealed segment id -> its file's size

    def encode(self) -> str:
        return "".join([f"{self.floor} {self.newest}\n", *(f"{i} {n}\n" for i, n in sorted(self.sizes.items()))])


def load_map(directory: str) -> SegMap | None:
    """The segment map; None if there is none or it cannot be read (then nothing is known)."""
    try:
        with open(os.path.join(directory, MAP_FILE)) as f:
            pairs = [_pair(line) for line in f]
    except (OSError, ValueError):
        return None
    if not pairs:
        return None
    (floor, newest), sizes = pairs[0], dict(pairs[1:])
    return SegMap(floor, newest, sizes)


MAX_SEG_ID = 99_999_999  # seg-NNNNNNNN.log


def implausible(smap: SegMap, hwm_seg: int | None) -> str | None:
    """Why ``smap`` cannot be a map the tier wrote (None: it can be). ``hwm_seg``: the segment
    tier.hwm names (None: unknown); the map is saved before a new segment's mark is set, so its
    newest id is at most one above it."""
    floor, newest = smap.floor, smap.newest
    if not 1 <= floor <= newest + 1:
        return f"its floor {floor} is not between 1 and its newest id {newest} + 1"
    if newest > MAX_SEG_ID:
        return f"its newest id {newest} is beyond what a segment file name holds"
    if hwm_seg is not None and newest > hwm_seg + 1:
        return f"its newest id {newest} is far above segment {hwm_seg}, the newest {HWM_FILE} names"
    bad = sorted(i for i, n in smap.sizes.items() if not floor <= i <= newest or n < 0)
    if bad:
        return f"it records a size for segment {bad[0]}, outside {floor}..{newest} or below 0"
    return None


def missing(floor: int, newest: int, ids: list[int]) -> list[tuple[int, int]]:
    """The ranges (first, last) of ids from ``floor`` to ``newest`` that are not in ``ids``
    (sorted): O(len(ids)), however far apart floor and newest are."""
    gaps = []
    prev = floor - 1
    for i in ids:
        if i > newest:
            break
        if i > prev + 1:
            gaps.append((prev + 1, i - 1))
        prev = max(prev, i)
    if newest > prev:
        gaps.append((prev + 1, newest))
    return gaps


def describe(ranges: list[tuple[int, int]], most: int = 5) -> str:
    """``[(2, 3), (7, 7)]`` -> ``"2..3, 7"`` (the first ``most`` ranges, then how many more)."""
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in ranges[:most])
    return text + (f" and {len(ranges) - most} more ranges" if len(ranges) > most else "")


def set_aside(path: str) -> str | None:
    """Rename ``path`` (not one of the tier's files) to ``path.stray`` (or ``.strayN``), out of
    the way of the tier but kept for whoever put it there; the new path, None if it failed."""
    dest, n = path + ".stray", 0
    while os.path.lexists(dest):
        n += 1
        dest = f"{path}.stray{n}"
    try:
        os.rename(path, dest)
    except OSError as exc:
        log.error("nvme: cannot set %s aside: %s", path, exc)
        return None
    return dest


def _pair(line: str) -> tuple[int, int]:
    a, b = line.split()  # ValueError unless two fields
    return int(a), int(b)


def save_map(directory: str, segmap: SegMap, durable: bool = False) -> None:
    write_atomically(directory, MAP_FILE, segmap.encode(), durable)


def write_atomically(directory: str, name: str, text: str, durable: bool = True) -> None:
    """Replace ``directory/name`` with ``text`` atomically (a crash leaves the old text or the
    new); ``durable``: also fsync'd, file and directory, so a power cut keeps it."""
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except OSError:
        _remove_quietly(tmp)  # (a full filesystem: what it took is given back)
        raise
    os.replace(tmp, path)
    if not durable:
        return
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class HighWater:
    """tier.hwm, mapped: records of segment ``seg`` are complete up to ``off``."""

    def __init__(self, directory: str, salt: int) -> None:
        self.path = os.path.join(directory, HWM_FILE)
        self.salt = salt
        self.seg = 0
        self.off = 0
        self._mm: mmap.mmap | None = None

    def load(self) -> tuple[int, int] | None:
        """What the file says (segment id, offset); None if it is missing or does not verify."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(HWM.size)
        except OSError:
            return None
        if len(data) != HWM.size:
            return None
        if data[:3] == HWM_MAGIC[:3] and data[:4] != HWM_MAGIC:
            log.warning("nvme: %s is of format %r, not %r as this build writes: written by another gcache version "
                        "(an upgrade or a downgrade?)", self.path, data[:4], HWM_MAGIC)
        _, seg_id, off, _ = HWM.unpack(data)
        if data != self._encode(seg_id, off):  # the magic, the padding and the checksum
            return None
        return seg_id, off

    def open(self, seg_id: int) -> None:
        """A fresh mark (segment ``seg_id``, offset 0), written atomically (a crash leaves the old
        file or the new), then mapped."""
        self.seg, self.off = seg_id, 0
        try:
            with open(self.path + ".tmp", "wb") as f:
                f.write(self._encode(seg_id, 0))
        except OSError:
            _remove_quietly(self.path + ".tmp")
            raise
        os.replace(self.path + ".tmp", self.path)
        fd = os.open(self.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, HWM.size)
        finally:
            os.close(fd)

    def set(self, seg_id: int, off: int) -> None:
        """The caller's lock held: a memory store (nothing if not open)."""
        self.seg, self.off = seg_id, off
        if self._mm is not None:
            self._mm[: HWM.size] = self._encode(seg_id, off)

    def close(self, sync: bool = False) -> bool:
        """Unmap; ``sync``: write it to disk first (a clean stop). False if that failed."""
        mm, self._mm = self._mm, None
        if mm is None:
            return True
        ok = True
        try:
            if sync:
                mm.flush()
        except OSError as exc:
            ok = False
            log.error("nvme: cannot sync %s: %s", self.path, exc)
        mm.close()
        return ok

    def _encode(self, seg_id: int, off: int) -> bytes:
        chk = xxhash.xxh3_64_intdigest(struct.pack("<QQ", seg_id, off), seed=self.salt)
        return HWM.pack(HWM_MAGIC, seg_id, off, chk)


INFLIGHT_FILE = "tier.inflight"
SLOT = struct.Struct("<QQQQ")  # segment id, offset, length, xxh3 of the rest (seeded with the salt)
SLOTS = 64


class InFlight:
    """tier.inflight, mapped: the places of value records reserved and not yet written (at most
    SLOTS at once; the store has one writer). Set and cleared with plain memory stores under the
    tier's lock (no system call); a process crash keeps the page. A restart skips these places
    whole, whatever they hold: the write never completed, was never acknowledged, and is not a
    hole of damage to take for a lost tombstone."""

    def __init__(self, directory: str, salt: int) -> None:
        self.path = os.path.join(directory, INFLIGHT_FILE)
        self.salt = salt
        self._mm: mmap.mmap | None = None
        self._free = list(range(SLOTS - 1, -1, -1))

    def load(self) -> list[tuple[int, int, int]]:
        """The places the file records (segment id, offset, length); none if it is missing."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(SLOT.size * SLOTS)
        except OSError:
            return []
        out = []
        for at in range(0, len(data) - SLOT.size + 1, SLOT.size):
            seg_id, off, n, _ = SLOT.unpack_from(data, at)
            if n and data[at: at + SLOT.size] == self._encode(seg_id, off, n):
                out.append((seg_id, off, n))
        return out

    def open(self) -> None:
        """An empty table, written atomically, then mapped."""
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(bytes(SLOT.size * SLOTS))
        except OSError:
            _remove_quietly(tmp)
            raise
        os.replace(tmp, self.path)
        fd = os.open(self.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, SLOT.size * SLOTS)
        finally:
            os.close(fd)
        self._free = list(range(SLOTS - 1, -1, -1))

    def add(self, seg_id: int, off: int, n: int) -> int:
        """The caller's lock held: record a place; its slot (-1: none free, or not open)."""
        if self._mm is None or not self._free:
            return -1
        slot = self._free.pop()
        self._mm[slot * SLOT.size: (slot + 1) * SLOT.size] = self._encode(seg_id, off, n)
        return slot

    def remove(self, slot: int) -> None:
        """The caller's lock held: the place's write completed (or was rolled back)."""
        if slot < 0 or self._mm is None:
            return
        self._mm[slot * SLOT.size: (slot + 1) * SLOT.size] = bytes(SLOT.size)
        self._free.append(slot)

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            mm.close()

    def _encode(self, seg_id: int, off: int, n: int) -> bytes:
        chk = xxhash.xxh3_64_intdigest(struct.pack("<QQQ", seg_id, off, n), seed=self.salt)
        return SLOT.pack(seg_id, off, n, chk)
