"""NVMe segment records: layout, packing, and the recovery scan that resynchronises past damage.

Record layout (little endian)::

    magic b"GCR1" | version u8 (2) | kind u8 | ns_len u16 | key_len u16 | meta_len u16 |
    value_len u64 | seq u64 | expires f64 | value_xxh3 u64 | header_xxh3 u64 |
    namespace | key | value metadata | value

* ``kind``: a value, or a tombstone (a delete or overwrite: no value).
* ``seq``: the store's sequence number of the write. For one key, the record with the highest
  seq is the truth wherever it lies; a tombstone with seq T hides every value record of that
  key with a seq below T (an overwrite's tombstone carries the new value's seq, a delete's a
  fresh one). So recovery does not depend on the order segments or records are scanned in.
* ``value metadata``: gcache.tier.valuemeta.ValueMeta.encode() (pool, chain position, tail
  mark, format tag); the deadline is ``expires``.
* ``header_xxh3`` covers everything before it plus namespace, key and metadata, seeded with the
  tier's own random salt (kept in the tier directory): a torn or garbage header is recognised,
  and a stored value that happens to contain bytes shaped like a record (a tenant writing a
  crafted value) cannot pass for one when recovery resynchronises through it.
* ``value_xxh3`` is checked on every read: a torn or rotted value is a miss, never wrong bytes.

Records are self-delimiting, so a scan walks from header to header. A header that fails its
checks (bit rot, a torn write, a hole) does not end the scan: it searches forward for the next
magic whose header verifies and continues from there, and reports where that damage ended
(``ScanResult.damaged_to``): a tombstone may have been in it, so the caller must not trust any
older value (gcache.tier.nvme drops them). A record whose header verifies but carries another
format version byte (written by another gcache version) is skipped whole and reported apart
(``ScanResult.versions``); it cannot be read here, so it counts as damage too (it may be a
tombstone). A record the tier invalidated on purpose (its magic overwritten with DEAD_MAGIC,
the rest of its header intact: see dead_header()) is skipped as a whole and is not damage; so
is the place of a value write still in flight at a crash (the caller passes those places, from
gcache.tier.segdir.InFlight: with records after it complete, it would otherwise be a hole).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import xxhash

from gcache.tier.valuemeta import ValueMeta

REC = struct.Struct("<4sBBHHHQQdQ")
HCHK = struct.Struct("<Q")
REC_MAGIC = b"GCR1"
REC_VERSION = 2
KIND_VALUE = 1
KIND_TOMBSTONE = 2
FIXED = REC.size + HCHK.size
RESYNC_CHUNK = 1 << 20
DEAD_MAGIC = b"\0\0\0\0"  # written over a record's magic to invalidate it in place

Key = tuple[str, bytes]


def pack(kind: int, key: Key, seq: int, value_len: int = 0, expires: float = 0.0, checksum: int = 0,
         meta: bytes = b"", salt: int = 0) -> list[bytes]:
    """The parts of a record up to (not including) its value."""
    ns, k = key[0].encode(), key[1]
    header = REC.pack(REC_MAGIC, REC_VERSION, kind, len(ns), len(k), len(meta), value_len, seq, expires, checksum)
    hchk = HCHK.pack(xxhash.xxh3_64_intdigest(header + ns + k + meta, seed=salt))
    return [header, hchk, ns, k, meta]


def head_len(key: Key, meta: bytes) -> int:
    return FIXED + len(key[0].encode()) + len(key[1]) + len(meta)


@dataclass(frozen=True, slots=True)
class Rec:
    """A verified record header found by a scan."""

    off: int  # where the record starts
    kind: int
    key: Key
    seq: int
    value_off: int
    value_len: int
    expires: float
    checksum: int
    meta: ValueMeta

    @property
    def end(self) -> int:
        return self.value_off + self.value_len


def dead_header(total: int, salt: int) -> bytes:
    """A header, already invalidated (DEAD_MAGIC), that spans ``total`` bytes (at least FIXED):
    written over a reservation whose write failed, a scan skips the whole of it as one dead
    record instead of resynchronising through it (which it would have to report as damage)."""
    header, hchk, *_ = pack(KIND_VALUE, ("", b""), 0, total - FIXED, salt=salt)
    return DEAD_MAGIC + header[len(DEAD_MAGIC):] + hchk


@dataclass(frozen=True, slots=True)
class Foreign:
    """A record whose header verifies (with the tier's salt) but carries another format version:
    written by another gcache version, and not read by this one."""

    version: int
    end: int


def _parse(fd: int, off: int, size: int, salt: int, hdr: bytearray) -> Rec | Foreign | int | None:
    """The record starting at ``off``; a record of another format version there; the end of a
    dead (invalidated) record there; or None if there is none that verifies."""
    if off + FIXED > size or os.preadv(fd, [hdr], off) != FIXED:
        return None
    magic, ver, kind, ns_len, key_len, meta_len, vlen, seq, expires, checksum = REC.unpack_from(hdr)
    if magic not in (REC_MAGIC, DEAD_MAGIC) or (ver == REC_VERSION and kind not in (KIND_VALUE, KIND_TOMBSTONE)):
        return None
    names_len = ns_len + key_len + meta_len
    names = os.pread(fd, names_len, off + FIXED)
    if len(names) != names_len:
        return None
    (hchk,) = HCHK.unpack_from(hdr, REC.size)
    if xxhash.xxh3_64_intdigest(REC_MAGIC + bytes(hdr[len(REC_MAGIC): REC.size]) + names, seed=salt) != hchk:
        return None
    value_off = off + FIXED + names_len
    if value_off + vlen > size:
        return None  # a torn tail: the value never fully reached the file
    if magic == DEAD_MAGIC:
        return int(value_off + vlen)
    if ver != REC_VERSION:
        return Foreign(ver, int(value_off + vlen))
    if kind == KIND_TOMBSTONE and vlen:
        return None
    try:
        key = (names[:ns_len].decode(), names[ns_len:ns_len + key_len])
        meta = ValueMeta.decode(names[ns_len + key_len:])
    except (UnicodeDecodeError, ValueError):
        return None
    return Rec(off, kind, key, seq, value_off, vlen, expires, checksum, meta)


def _next_magic(fd: int, start: int, size: int) -> int | None:
    """Offset of the next REC_MAGIC at or after ``start``, or None."""
    pos = start
    while pos < size:
        chunk = os.pread(fd, min(RESYNC_CHUNK, size - pos), pos)
        if not chunk:
            return None
        at = chunk.find(REC_MAGIC)
        if at >= 0:
            return pos + at
        if pos + len(chunk) >= size:
            return None
        pos += len(chunk) - (len(REC_MAGIC) - 1)  # a magic may straddle two chunks
    return None


@dataclass
class ScanResult:
    records: list[Rec]
    end: int  # end of the last good (or dead) record: what follows is torn or garbage
    skipped: int  # bytes skipped between good records (damage resynchronised past)
    damaged_to: int  # where the last damage (or record of another version) ends (0: none); a tail is not counted
    dead: int  # records invalidated on purpose, skipped whole
    versions: dict[int, int] = field(default_factory=dict)  # other format versions found: version -> records
    inflight: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of writes in flight, skipped


def scan(fd: int, size: int, salt: int, inflight: dict[int, int] | None = None) -> ScanResult:
    """Every verifiable record of a segment file of ``size`` bytes, in file order. ``inflight``:
    {offset: end} of value writes that had not completed: skipped whole, whatever they hold."""
    out: list[Rec] = []
    versions: dict[int, int] = {}
    hdr = bytearray(FIXED)
    skipped_inflight: list[tuple[int, int]] = []
    off = end = skipped = damaged_to = dead = 0
    while off + FIXED <= size:
        if inflight and off in inflight:
            if inflight[off] > size:
                break  # (the last place, never written: a torn tail)
            skipped_inflight.append((off, inflight[off]))
            off = end = inflight[off]
            continue
        rec = _parse(fd, off, size, salt, hdr)
        if isinstance(rec, Rec):
            out.append(rec)
            off = end = rec.end
            continue
        if isinstance(rec, Foreign):  # unreadable here, a tombstone maybe: damage, said apart
            versions[rec.version] = versions.get(rec.version, 0) + 1
            off = end = damaged_to = rec.end
            continue
        if rec is not None:
            dead += 1
            off = end = rec
            continue
        nxt = _next_magic(fd, off + 1, size)
        while nxt is not None and _parse(fd, nxt, size, salt, hdr) is None:
            nxt = _next_magic(fd, nxt + 1, size)
        if nxt is None:
            break
        skipped += nxt - off
        off = damaged_to = nxt
    return ScanResult(out, end, skipped, damaged_to, dead, versions, skipped_inflight)
