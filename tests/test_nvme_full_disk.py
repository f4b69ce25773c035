"""The NVMe tier on a filesystem smaller than its budget: it keeps storing what fits, recycling
its oldest data (the only segment too), and a write that comes up short never comes back after a
restart. The filesystem is faked (deterministic, no root): appends to the tier's segment files
stop at a capacity, short or with ENOSPC, as a full disk makes them."""

import errno
import os
import shutil
import threading

import pytest

import gcache.tier.nvme as nvme_mod
from gcache.protocol import Status
from gcache.tier.eviction import EvictionConfig
from gcache.tier.nvme import NvmeTier
from gcache.tier.store import Store, StoreConfig
from tests.conftest import poll, read

KB = 1024
MB = 1024 * KB
NS = "ns"


def key(i):
    return (NS, b"key-%04d" % i)


def value(i, size=50 * KB):
    return (b"%08d" % i) * (size // 8)


class SmallFs:
    """The ``os`` module, except that the segment files of ``directory`` (those still there:
    unlinking gives their space back) hold at most ``capacity`` bytes together: a pwritev past
    that writes what fits (a short write) or fails with ENOSPC when nothing does."""

    def __init__(self, directory, capacity):
        self.directory, self.capacity = directory, capacity

    def __getattr__(self, attr):
        return getattr(os, attr)

    def taken(self, but=None):
        total = 0
        for name in os.listdir(self.directory):
            if name.startswith("seg-"):
                st = os.stat(os.path.join(self.directory, name))
                if st.st_ino != but:
                    total += st.st_size
        return total

    def pwritev(self, fd, parts, off):
        room = self.capacity - self.taken(but=os.fstat(fd).st_ino) - off  # what may follow ``off``
        data = b"".join(bytes(p) for p in parts)
        if len(data) <= room:
            return os.pwritev(fd, parts, off)
        if room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.pwrite(fd, data[:room], off)


def readable(t, k):
    """The bytes the tier serves for ``k`` (None: a miss)."""
    loc = t.lookup(k)
    if loc is None:
        return None
    buf = memoryview(bytearray(loc.size))
    return bytes(buf) if t.read(k, loc, buf) else None


def test_a_full_filesystem_under_a_single_segment_keeps_taking_new_values(tmp_path, monkeypatch):
    """The filesystem (1 MiB) fills while the only segment (8 MiB, the budget) is open: the
    budget comes down to what fits, and from then on the oldest data is recycled, the open
    segment included, so every new value still lands. (It used to wedge: the only segment was
    never recycled and the budget was below a segment, so nothing fitted ever again.)"""
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 * MB, segment_bytes=8 * MB)
    fs = SmallFs(d, 1 * MB)
    monkeypatch.setattr(nvme_mod, "os", fs)
    n = 100  # 5 MB of 50 KiB values through a 1 MiB filesystem
    results = [t.append(key(i), memoryview(value(i)), 0.0) for i in range(n)]
    assert t.write_errors > 0 and t.budget <= 1 * MB  # it did fill the filesystem
    assert all(results[-40:]), "the tier stopped taking values after the filesystem filled"
    assert t.segment_bytes < t.budget, "a segment no longer fits the lowered budget"
    assert t.reclaimed_segments > 0 and t.used <= t.budget and fs.taken() <= 1 * MB
    assert not t.contains(key(0))  # the oldest was recycled
    newest = [i for i in range(n) if t.contains(key(i))]
    assert len(newest) >= 8 and newest[-1] == n - 1
    assert all(readable(t, key(i)) == value(i) for i in newest)
    assert t.remove(key(n - 1))  # a delete on the full disk sticks across a restart
    monkeypatch.undo()
    t.close()
    t2 = NvmeTier(d, 8 * MB, segment_bytes=8 * MB)
    assert not t2.contains(key(n - 1))
    back = [i for i in range(n) if t2.contains(key(i))]
    assert back == newest[:-1] and all(readable(t2, key(i)) == value(i) for i in back)
    t2.close()


def test_a_budget_lowered_below_a_segment_shrinks_the_segments(tmp_path, monkeypatch):
    """After the budget came down, new segments are a fraction of it: recycling the oldest
    forgets a part of what is on disk, not all of it at once."""
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 * MB, segment_bytes=8 * MB)
    monkeypatch.setattr(nvme_mod, "os", SmallFs(d, 2 * MB))
    for i in range(200):
        t.append(key(i), memoryview(value(i, 20 * KB)), 0.0)
    assert t.write_errors > 0 and t.budget <= 2 * MB
    assert t.segment_bytes <= t.budget // 4
    assert len(t) * 20 * KB >= t.budget // 2, "most of the lowered budget holds values"
    monkeypatch.undo()
    t.close()


def test_a_failed_write_beside_a_reclaimed_file_not_yet_removed_does_not_lower_the_budget(tmp_path, monkeypatch):
    """A reservation reclaims the oldest segment, whose file the owner removes only later
    (sweep). A write failing for lack of space before that must not lower the budget by the
    reclaimed bytes: that space comes back. (It used to ratchet the budget down each time.)"""
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 * MB, segment_bytes=256 * KB)
    monkeypatch.setattr(nvme_mod, "os", SmallFs(d, 1 * MB))
    for i in range(60):
        t.append(key(i), memoryview(value(i)), 0.0)
    assert t.write_errors > 0 and t.budget <= 1 * MB
    budget, errors = t.budget, t.write_errors
    for i in range(60, 80):  # until a reservation reclaims a segment and its write fails
        before = t.reclaimed_segments
        p = t.prepare(key(i), 50 * KB, 0.0, t.next_seq())
        assert p is not None
        ok = t.write(p, memoryview(value(i)))
        if not ok and t.reclaimed_segments > before:
            break  # (the reclaimed file is still there: sweep() was not called)
        assert ok and t.publish(p)
        t.sweep()
    else:
        pytest.fail("no write failed beside a reclaimed, unremoved segment")
    assert t.write_errors == errors + 1
    assert t.budget >= budget - 64 * KB, f"the budget fell from {budget} to {t.budget}"
    t.sweep()
    assert t.append(key(99), memoryview(value(99)), 0.0)  # the space came back
    monkeypatch.undo()
    t.close()


class ShortAt:
    """The ``os`` module, except that the pwritev at offset ``off`` writes only its first
    ``n`` bytes (a disk that filled up mid-write)."""

    def __init__(self, off, n):
        self.off, self.n = off, n

    def __getattr__(self, attr):
        return getattr(os, attr)

    def pwritev(self, fd, parts, off):
        if off != self.off:
            return os.pwritev(fd, parts, off)
        return os.pwrite(fd, b"".join(bytes(p) for p in parts)[: self.n], off)


@pytest.mark.parametrize("later", ["written", "failed"])
def test_a_short_write_followed_by_another_record_never_comes_back(tmp_path, monkeypatch, later):
    """A value's write comes up short (its header on disk, its value's tail not: it reads as
    zeros) while a record reserved after it is written, or fails too. The key was never
    indexed, so its delete writes no tombstone; a restart must not index the half-written
    record, whose checksum verifies when the value's tail is zeros."""
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 4 * MB, segment_bytes=1 * MB)
    assert t.append(key(0), memoryview(b"x" * 1000), 0.0)
    v = b"live" + bytes(20 * KB)  # the tail that never reached the disk is zeros
    pa = t.prepare(key(1), len(v), 0.0, t.next_seq())
    pb = t.prepare(key(2), 100, 0.0, t.next_seq())
    assert pa is not None and pb is not None and pb.off == pa.off + pa.total
    head = pa.total - len(v)
    if later == "written":
        assert t.write(pb, memoryview(b"b" * 100)) and t.publish(pb)
    monkeypatch.setattr(nvme_mod, "os", ShortAt(pa.off, head + 4))
    assert not t.write(pa, memoryview(v))
    monkeypatch.undo()
    if later == "failed":  # rolled back after it: truncating to its start extends the file over it
        monkeypatch.setattr(nvme_mod, "os", ShortAt(pb.off, 0))
        assert not t.write(pb, memoryview(b"b" * 100))
        monkeypatch.undo()
    assert not t.contains(key(1))
    assert not t.remove(key(1))  # acknowledged delete: nothing indexed, so no tombstone
    t.close()
    t2 = NvmeTier(d, 4 * MB, segment_bytes=1 * MB)
    assert readable(t2, key(1)) is None, "the failed, deleted value came back after a restart"
    assert readable(t2, key(0)) == b"x" * 1000
    assert (readable(t2, key(2)) == b"b" * 100) == (later == "written")
    assert t2.append(key(3), memoryview(b"y" * 100), 0.0)  # appends continue
    t2.close()


def test_a_store_on_a_small_filesystem_keeps_demoting(tmp_path, monkeypatch):
    """The store's demoter on a filesystem smaller than one segment: recent values keep
    reaching the disk and are served from it, with the right bytes."""
    d = str(tmp_path / "disk")
    monkeypatch.setattr(nvme_mod, "os", SmallFs(d, 1 * MB))
    os.makedirs(d)
    s = Store(StoreConfig(mem_bytes=128 * KB, disk_dir=d, disk_bytes=8 * MB, segment_bytes=8 * MB,
                          pretouch=False))
    try:
        n = 200  # 4 MB of 20 KiB values through a 128 KiB arena and a 1 MiB filesystem
        for i in range(n):
            assert s.put(key(i), value(i, 20 * KB)) is Status.OK
        assert s.flush()
        st = s.stats()
        assert st["disk_write_errors"] > 0 and st["disk_budget"] <= 1 * MB
        recent = range(n - 40, n)  # long out of the arena: on the disk or lost
        hits = [i for i in recent if read(s, key(i)) == value(i, 20 * KB)]
        wrong = [i for i in range(n) if read(s, key(i)) not in (None, value(i, 20 * KB))]
        assert not wrong and len(hits) >= 30, f"{len(hits)} of the 40 most recent values kept"
    finally:
        s.close()



@pytest.mark.parametrize("op", ["delete", "overwrite"])
def test_a_delete_without_room_for_its_tombstone_waits_for_the_demotion_it_supersedes(tmp_path, monkeypatch, op):
    """Found by a probe: K was being written to disk by the demoter when a delete (or an
    overwrite) of K came; its tombstone failed (a full disk) and the delete was acknowledged at
    once, leaving the record for the demoter to invalidate later. A kill -9 in between brought K's
    deleted (or older) value back after the restart. Now the acknowledgement waits for the
    demoter. The crash is a copy of the directory taken right after the acknowledgement: it
    must not serve the deleted (or overwritten, with the new value only in RAM) one. K is
    evicted by hand so that RAM has room for an overwrite without waiting for the demoter."""
    d, crash = str(tmp_path / "disk"), str(tmp_path / "crash")
    os.makedirs(d)
    fs = SmallFs(d, 64 * MB)
    monkeypatch.setattr(nvme_mod, "os", fs)
    s = Store(StoreConfig(mem_bytes=1 * MB, disk_dir=d, disk_bytes=8 * MB, segment_bytes=8 * MB,
                          pretouch=False, eviction=EvictionConfig.parse("lru")))
    k, v1, v2 = key(1), value(1, 20 * KB), value(2, 20 * KB)
    real_write, racers = s.nvme.write, []

    def supersede():
        assert s.delete(k) if op == "delete" else s.put(k, v2) is Status.OK
        shutil.copytree(d, crash)  # kill -9 right after the acknowledgement

    def write(p, view):  # the demoter's write of a record, done
        ok = real_write(p, view)
        if p.key == k and not racers:
            fs.capacity = fs.taken()  # the disk is full from here on: no tombstone fits
            racers.append(threading.Thread(target=supersede))
            racers[0].start()
            racers[0].join(1.0)  # the chance to acknowledge while this record is still valid
        return ok

    monkeypatch.setattr(s.nvme, "write", write)
    try:
        assert s.put(k, v1) is Status.OK
        with s._lock:  # evict k: the demoter writes it
            s._evict(k, s.ram.index[k])
        assert poll(lambda: racers, 10), "k was never demoted"
        racers[0].join(30)
        assert not racers[0].is_alive() and os.path.isdir(crash)
        assert s.stats()["disk_write_errors"] > 0  # the tombstone did fail
    finally:
        s.close()
    monkeypatch.undo()
    t = NvmeTier(crash, 8 * MB, segment_bytes=8 * MB)
    try:
        assert readable(t, k) is None  # neither the deleted value nor the overwritten one
    finally:
        t.close()
