"""A kill -9 while a value's write is in flight and a tombstone reserved after it is complete
(a delete acknowledged meanwhile) loses the in-flight value, nothing else.

The demoter reserves a record's place under the lock (NvmeTier.prepare) and writes it outside;
a delete's tombstone reserved after it is written and acknowledged at once. Found by a probe: a
crash before the value's bytes reached the file left a hole before a valid tombstone, which a
restart took for damage (a tombstone may have been lost in it) and dropped every value in every
segment; when the tombstone rolled over into a new segment, the sealed segment was shorter than
its recorded size, with the same result. The crash is played by opening the directory again
while the first tier is still open (what a kill -9 leaves: the page cache)."""

import os
import shutil
import threading

import pytest

from gcache.protocol import Status
from gcache.tier import records as R
from gcache.tier.eviction import EvictionConfig
from gcache.tier.nvme import NvmeTier
from gcache.tier.store import Store, StoreConfig
from tests.conftest import read as read_store
from tests.test_nvme_full_disk import readable

KB = 1024
MB = 1024 * KB
SEG = 64 * KB
OLD = [("ns", b"old-%03d" % i) for i in range(20)]  # 20 x 8 KiB: three segments
VICTIM, OVER, INFLIGHT = ("ns", b"victim"), ("ns", b"overwritten"), ("ns", b"in-flight")


def old_value(k):
    return k[1] * (8 * KB // len(k[1]))


@pytest.mark.parametrize("partial", [False, True], ids=["unwritten", "half-written"])
@pytest.mark.parametrize("where", ["same-segment", "rollover"])
def test_a_kill_during_a_value_write_with_a_later_tombstone_keeps_every_acknowledged_record(tmp_path, where,
                                                                                           partial):
    """Test fails before: 0 of the 20 intact values survived (3 of the 4 cases)."""
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    for k in OLD:
        assert t.append(k, memoryview(old_value(k)), 0.0)
    assert t.append(VICTIM, memoryview(b"V" * 1000), 0.0)
    assert t.append(OVER, memoryview(b"1" * 1000), 0.0)
    seq = t.next_seq()
    assert t.remove(OVER, seq)  # overwritten: the new value is the one in flight below
    po = t.prepare(OVER, 1000, 0.0, seq)  # two writes in flight: the new value of OVER and INFLIGHT
    assert po is not None
    seg = po.seg
    room = SEG - seg.size - R.head_len(INFLIGHT, b"")  # for the in-flight value
    size = 2 * KB  # the tombstone fits after it, or (rollover) only the in-flight value does
    size = room - 10 if where == "rollover" else size
    assert room - size >= (10 if where == "rollover" else R.head_len(VICTIM, b""))
    p = t.prepare(INFLIGHT, size, 0.0, t.next_seq())
    assert p is not None and p.seg is seg
    assert t.remove(VICTIM)  # acknowledged: its tombstone is complete, reserved after p and po
    assert (t.segments[-1] is not seg) == (where == "rollover")
    if partial:  # the kill lands mid-write: the header and part of the value reached the file
        parts = R.pack(R.KIND_VALUE, p.key, p.loc.seq, size, 0.0, 12345, p.raw, t.salt)
        os.pwritev(p.seg.fd, [*parts, b"x" * 100], p.off)
    t2 = NvmeTier(d, 8 * MB, segment_bytes=SEG)  # the kill -9, and the restart
    kept = [k for k in OLD if readable(t2, k) == old_value(k)]
    assert len(kept) == len(OLD), f"{len(kept)} of {len(OLD)} intact acknowledged values survived"
    assert readable(t2, VICTIM) is None, "a deleted value came back"
    assert readable(t2, OVER) is None, "an overwritten value came back"
    assert readable(t2, INFLIGHT) is None
    assert t2.append(("ns", b"after"), memoryview(b"A" * 10), 0.0)
    t2.close()
    t3 = NvmeTier(d, 8 * MB, segment_bytes=SEG)  # and the next restart finds nothing to complain of
    assert all(readable(t3, k) == old_value(k) for k in OLD)
    assert readable(t3, ("ns", b"after")) == b"A" * 10 and readable(t3, VICTIM) is None
    t3.close()
    t.close()


def test_a_kill_during_a_demotion_with_a_delete_acknowledged_meanwhile_keeps_the_disk_tier(tmp_path,
                                                                                          monkeypatch):
    """The same through the store: its demoter is held between reserving a record and writing
    it while a delete of a key on disk is acknowledged; the directory is then copied (the kill
    -9) and a store opened on the copy. Test fails before: 0 of the values on disk survived."""
    d, crash = str(tmp_path / "disk"), str(tmp_path / "crash")

    def store(path):
        return Store(StoreConfig(mem_bytes=256 * KB, disk_dir=path, disk_bytes=32 * MB, segment_bytes=1 * MB,
                                 pretouch=False, eviction=EvictionConfig()))

    s = store(d)
    keys = [("ns", b"k-%03d" % i) for i in range(60)]
    try:
        for k in keys:
            assert s.put(k, k[1] * 2000) is Status.OK
        assert s.flush()
        on_disk = [k for k in keys if s.nvme.contains(k)]
        assert len(on_disk) > 20
        entered, release = threading.Event(), threading.Event()
        real_write = s.nvme.write

        def write(p, view):
            if p.key[1] == b"big":
                entered.set()
                release.wait(30)
            return real_write(p, view)

        monkeypatch.setattr(s.nvme, "write", write)
        assert s.put(("ns", b"big"), b"B" * 200 * KB) is Status.OK
        for i in range(3):  # evict big: the demoter reserves its record, then is held
            s.put(("ns", b"fill-%d" % i), b"f" * 40 * KB)
        assert entered.wait(10), "the demoter never reached big"
        victim = on_disk[-1]
        assert s.delete(victim)
        shutil.copytree(d, crash)
        release.set()
    finally:
        release.set()
        s.close()
    s2 = store(crash)
    try:
        kept = [k for k in on_disk if k != victim and read_store(s2, k) == k[1] * 2000]
        assert len(kept) == len(on_disk) - 1, f"{len(kept)} of {len(on_disk) - 1} values on disk survived"
        assert read_store(s2, victim) is None
    finally:
        s2.close()

