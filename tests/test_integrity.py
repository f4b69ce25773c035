"""Data integrity of the tiered store in-process: an acknowledged delete or overwrite is final
(write-behind queue, promotion races, restart recovery past corruption), and a full disk
neither multiplies segment files nor counts bytes it never wrote."""

import os
import random
import subprocess
import threading
import time

import pytest

import gcache.tier.nvme as nvme_mod
from gcache.protocol import Status
from gcache.tier.nvme import NvmeTier
from gcache.tier.records import REC_MAGIC
from gcache.tier.store import Store, StoreConfig
from tests.conftest import read

KB = 1024
NS = "ns"




class GatedOs:
    """The ``os`` module, except that ``name`` blocks in the thread named ``thread`` until
    release() (``entered`` is set when a call is waiting): it holds a disk write or read open
    at the moment a test chooses."""

    def __init__(self, name, thread):
        self._name, self._thread = name, thread
        self.entered, self._gate = threading.Event(), threading.Event()

    def __getattr__(self, attr):
        fn = getattr(os, attr)
        if attr != self._name:
            return fn

        def gated(*args, **kw):
            if threading.current_thread().name == self._thread and not self._gate.is_set():
                self.entered.set()
                assert self._gate.wait(20), "test never released the gate"
            return fn(*args, **kw)

        return gated

    def release(self):
        self._gate.set()




def fill(store, n=3, size=20 * KB, tag=b"f"):
    """Put ``n`` filler values, pushing older values out of the (64 KiB) arena."""
    for i in range(n):
        assert store.put((NS, tag + b"%d" % i), b"F" * size) is Status.OK


# -- 1. the write-behind queue -------------------------------------------------------------------
def test_delete_or_overwrite_of_a_value_queued_for_disk_is_final(tiered, monkeypatch):
    gate = GatedOs("pwritev", "gcache-demoter")
    monkeypatch.setattr(nvme_mod, "os", gate)
    s = tiered(full_wait_s=0)
    a, b, c = (NS, b"a"), (NS, b"b"), (NS, b"c")
    for k in (a, b, c):
        assert s.put(k, k[1] * 15 * KB) is Status.OK
    # a, b, c are evicted to make room: a is being written (held), b and c wait in the queue. Their
    # slots stay taken until written, so the put that evicted them finds no room.
    assert s.put((NS, b"big"), b"F" * 30 * KB) is Status.FULL
    assert gate.entered.wait(10)
    assert s.stats()["demote_queue_bytes"] >= 3 * 15 * KB
    assert s.delete(a) and s.delete(b)  # acknowledged deletes: in flight, and queued
    assert s.put(c, b"new") is Status.OK  # acknowledged overwrite of a queued value
    assert read(s, a) is None and read(s, b) is None and read(s, c) == b"new"
    assert not s.exists(a) and not s.exists(b)
    gate.release()
    assert s.flush()
    assert read(s, a) is None and read(s, b) is None and read(s, c) == b"new"
    fill(s, 4, 15 * KB, b"g")  # c's new value goes to disk too
    assert s.flush() and read(s, c) == b"new"
    s.close()
    s2 = tiered()  # restart: the deletes and the overwrite survive it
    assert read(s2, a) is None and read(s2, b) is None and read(s2, c) in (b"new", None)


# -- 2. promotion from disk racing a delete -------------------------------------------------------
def on_disk(store, keys, value_of):
    for k in keys:
        assert store.put(k, value_of(k)) is Status.OK
    fill(store, store.config.mem_bytes // (15 * KB) + 1, 15 * KB, b"push")
    assert store.flush()
    assert all(store.nvme.contains(k) and k not in store.ram.index for k in keys)


def test_a_promotion_never_brings_back_a_key_deleted_while_it_read(tiered, monkeypatch):
    gate = GatedOs("preadv", "reader")
    monkeypatch.setattr(nvme_mod, "os", gate)
    s = tiered()
    k = (NS, b"k")
    on_disk(s, [k], lambda k: b"v1" * 4 * KB)
    got = []
    t = threading.Thread(target=lambda: got.append(read(s, k)), name="reader")
    t.start()
    assert gate.entered.wait(10)  # the GET is reading the value from disk
    assert s.delete(k)  # acknowledged
    gate.release()
    t.join(10)
    assert got and got[0] in (b"v1" * 4 * KB, None)  # concurrent with the delete: either is fine
    assert read(s, k) is None and not s.exists(k)  # after the delete: never again
    assert k not in s.ram.index and s.stats()["promotions_dropped"] == 1


def test_gets_hammering_deletes_of_disk_keys_resurrect_nothing(tiered):
    s = tiered(mem=256 * KB)
    resurrected = 0
    for rnd in range(15):
        keys = [(NS, b"r%d-%d" % (rnd, i)) for i in range(12)]
        on_disk(s, keys, lambda k: k[1] * 500)
        barrier = threading.Barrier(3)

        def getter(keys=keys, barrier=barrier):
            barrier.wait()
            for k in keys:
                read(s, k)

        def deleter(keys=keys, barrier=barrier):
            barrier.wait()
            for k in keys:
                s.delete(k)

        threads = [threading.Thread(target=f) for f in (getter, getter, deleter)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        resurrected += sum(read(s, k) is not None for k in keys)
    assert resurrected == 0


# -- 3. restart recovery ------------------------------------------------------------------------
def corrupt_record_of(directory, key):
    """Overwrite the magic of ``key``'s (first) record in its segment file."""
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.startswith("seg-"):
            continue
        with open(path, "r+b") as f:
            data = f.read()
            at = data.find(key)
            if at < 0:
                continue
            start = data.rfind(REC_MAGIC, 0, at)
            f.seek(start)
            f.write(b"\xde\xad\xbe\xef")
            return
    raise AssertionError(f"no record of {key!r}")


def key(i):
    return (NS, b"key-%03d" % i)


def test_recovery_resynchronises_past_a_corrupt_header(tmp_path):
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 << 20, segment_bytes=4 << 20)
    for i in range(100):
        assert t.append(key(i), memoryview(b"v1-%03d" % i * 100), 0.0)
    for i in range(40):
        assert t.remove(key(i))  # deleted
    for i in range(40, 60):
        assert t.append(key(i), memoryview(b"v2-%03d" % i * 100), 0.0)  # overwritten
    assert len(t.segments) == 1  # everything above lives in one segment
    t.close()
    corrupt_record_of(d, b"key-010")  # an early record, mid-segment
    t2 = NvmeTier(d, 8 << 20, segment_bytes=4 << 20)
    got = {}
    for i in range(100):
        loc = t2.lookup(key(i))
        if loc is not None:
            buf = memoryview(bytearray(loc.size))
            assert t2.read(key(i), loc, buf)
            got[i] = bytes(buf)
    assert not [i for i in range(40) if i in got], "deleted keys came back"
    assert all(got.get(i) in (b"v2-%03d" % i * 100, None) for i in range(40, 60)), "an overwrite lost"
    assert all(got.get(i) == b"v1-%03d" % i * 100 for i in range(60, 100)), "records past the bad one lost"
    t2.close()


def test_the_newest_record_wins_whatever_the_segment_order(tmp_path):
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 << 20, segment_bytes=64 * KB)
    assert t.append(key(1), memoryview(b"old1" * 100), 0.0)
    assert t.append(key(2), memoryview(b"old2" * 100), 0.0)
    for i in range(3):
        assert t.append(key(100 + i), memoryview(b"f" * 30 * KB), 0.0)  # fills the first segment
    assert t.append(key(1), memoryview(b"new1" * 100), 0.0)  # overwrite, in a later segment
    assert t.remove(key(2))  # delete, in a later segment
    first, last = t.segments[0].path, t.segments[-1].path
    assert first != last
    t.close()
    tmp = first + ".swap"  # the later segment now sorts first
    os.rename(first, tmp)
    os.rename(last, first)
    os.rename(tmp, last)
    # The swapped files do not have the sizes the segment map recorded for them: that is damage,
    # and the values written before it (new1 among them) are forgotten; never is old1 served.
    t2 = NvmeTier(d, 8 << 20, segment_bytes=64 * KB)
    assert not t2.contains(key(2))
    loc = t2.lookup(key(1))
    if loc is not None:
        buf = memoryview(bytearray(loc.size))
        assert t2.read(key(1), loc, buf) and bytes(buf) == b"new1" * 100
    t2.close()


def test_a_segment_written_after_drop_all_survives_the_sweep_and_a_restart(tmp_path):
    """drop_all reclaims every segment and sweep() removes their files later: a new segment
    must not reuse a reclaimed one's name, or the sweep removes the live file (its values lost
    at the next start)."""
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 << 20, segment_bytes=64 * KB)
    assert t.append(key(1), memoryview(b"old1" * 100), 0.0)
    assert t.drop_all() == 1 and not t.contains(key(1))
    assert t.append(key(2), memoryview(b"new2" * 100), 0.0)
    t.sweep()
    assert t.contains(key(2)) and not t.contains(key(1))
    t.close()
    t2 = NvmeTier(d, 8 << 20, segment_bytes=64 * KB)
    assert not t2.contains(key(1))
    loc = t2.lookup(key(2))
    buf = memoryview(bytearray(loc.size)) if loc is not None else None
    assert loc is not None and t2.read(key(2), loc, buf) and bytes(buf) == b"new2" * 100
    t2.close()


# -- 10. a full disk ----------------------------------------------------------------------------
@pytest.fixture
def tiny_fs(tmp_path):
    """A 2 MiB tmpfs (needs root to mount; skipped otherwise)."""
    path = tmp_path / "tiny"
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)], capture_output=True,
                       check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs (needs root): {r.stderr.decode().strip()}")
    yield str(path)
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_filesystem_makes_no_extra_files_and_counts_only_what_was_written(tiny_fs):
    d = os.path.join(tiny_fs, "disk")
    t = NvmeTier(d, 16 << 20, segment_bytes=256 * KB)  # the budget is larger than the filesystem
    rnd = random.Random(1)
    ok = {}
    for i in range(300):
        v = bytes([i % 251]) * rnd.randint(8 * KB, 40 * KB)
        if t.append(key(i), memoryview(v), 0.0):
            ok[i] = v
    assert t.write_errors > 0 and t.budget <= 2 << 20  # the budget came down to what fits
    assert len(ok) > 250  # the oldest segments were recycled, the tier kept working
    segs = [n for n in os.listdir(d) if n.startswith("seg-")]
    assert len(segs) <= 2 * KB * KB // (256 * KB) + 1, f"{len(segs)} segment files on a 2 MiB filesystem"
    on_disk = sum(os.path.getsize(os.path.join(d, n)) for n in segs)
    assert t.used <= 2 << 20 and t.used == on_disk
    kept = [i for i in ok if t.contains(key(i))]
    assert len(kept) > 20
    for i in kept:  # intact
        loc = t.lookup(key(i))
        buf = memoryview(bytearray(loc.size))
        assert t.read(key(i), loc, buf) and bytes(buf) == ok[i]
    for i in kept[:10]:  # deletes still work on a full disk, and stick
        assert t.remove(key(i))
    t.close()
    t2 = NvmeTier(d, 16 << 20, segment_bytes=256 * KB)
    assert not any(t2.contains(key(i)) for i in kept[:10])
    assert all(t2.contains(key(i)) for i in kept[10:])
    t2.close()


def test_a_store_on_a_full_filesystem_keeps_serving(tiny_fs):
    s = Store(StoreConfig(mem_bytes=128 * KB, disk_dir=os.path.join(tiny_fs, "disk"), disk_bytes=16 << 20,
                          segment_bytes=256 * KB))
    try:
        deadline = time.monotonic() + 60
        for i in range(400):
            assert s.put(key(i), bytes([i % 251]) * 16 * KB) is Status.OK
            assert time.monotonic() < deadline
        assert s.flush()
        st = s.stats()
        assert st["disk_write_errors"] > 0 and st["disk_used"] <= 2 << 20
        hits = sum(read(s, key(i)) == bytes([i % 251]) * 16 * KB for i in range(400))
        wrong = sum(read(s, key(i)) not in (None, bytes([i % 251]) * 16 * KB) for i in range(400))
        assert wrong == 0 and hits > 50
    finally:
        s.close()


def test_a_delete_whose_tombstone_cannot_be_written_still_sticks(tmp_path, monkeypatch):
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 4 << 20, segment_bytes=1 << 20)
    for i in range(5):
        assert t.append(key(i), memoryview(b"v" * 1000), 0.0)

    class NoAppends:  # every append fails as on a full disk; in-place writes still work
        def __getattr__(self, attr):
            return getattr(os, attr)

        @staticmethod
        def pwritev(fd, parts, off):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(nvme_mod, "os", NoAppends())
    assert t.remove(key(2))
    monkeypatch.undo()
    assert t.write_errors == 1 and not t.contains(key(2))
    t.close()
    t2 = NvmeTier(d, 4 << 20, segment_bytes=1 << 20)
    assert not t2.contains(key(2)) and all(t2.contains(key(i)) for i in (0, 1, 3, 4))
    t2.close()


def test_after_a_machine_crash_an_uncleanly_stopped_tier_is_not_trusted(tmp_path, monkeypatch):
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 4 << 20)
    assert t.append(key(1), memoryview(b"v"), 0.0)
    t2 = NvmeTier(d, 4 << 20)  # a process crash (t never closed), same boot: every write is kept
    assert t2.contains(key(1))
    monkeypatch.setattr(nvme_mod, "_boot_id", lambda: "another-boot")  # the machine restarted
    t3 = NvmeTier(d, 4 << 20)  # unsynced writes (a tombstone, say) may be lost: nothing is trusted
    assert len(t3) == 0
    assert t3.append(key(2), memoryview(b"w"), 0.0)
    t3.close()  # a clean stop syncs: after the next reboot the tier is kept
    monkeypatch.setattr(nvme_mod, "_boot_id", lambda: "a-third-boot")
    t4 = NvmeTier(d, 4 << 20)
    assert t4.contains(key(2))
    t4.close()
