"""The NVMe tier across a restart never brings back a value that an acknowledged delete or
overwrite hid: not when the segment holding the tombstone is damaged (bytes flipped mid-segment,
the file truncated or removed), not when a segment was reclaimed but its file not yet removed,
and not when a second daemon opens the same directory (it is refused)."""

import os
import signal
import subprocess
import sys

import pytest

import gcache.tier.nvme as nvme_mod
from gcache.cluster import free_port
from gcache.tier import records as R
from gcache.tier import segdir
from gcache.tier.nvme import NvmeTier
from tests.conftest import poll
from tests.test_nvme_full_disk import readable

KB = 1024
MB = 1024 * KB
K = ("ns", b"the-key")
V1, V2 = b"v1" * 500, b"v2" * 500
SEG = 64 * KB


def nothing_trusted_then_usable(d):
    """The directory's old values are not trusted (K is a miss), and a new one written there
    survives a clean restart."""
    t2 = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert readable(t2, K) is None
    assert t2.append(K, memoryview(V2), 0.0)
    t2.close()
    t3 = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert readable(t3, K) == V2
    t3.close()


def filler(tag, i):
    return ("ns", b"%s-%03d" % (tag, i))


def fill_until_new_segment(t, tag):
    """Append 20 KiB fillers until a new segment is opened; the keys written."""
    first = t.segments[-1]
    keys = []
    while t.segments[-1] is first:
        keys.append(filler(tag, len(keys)))
        assert t.append(keys[-1], memoryview(b"f" * 20 * KB), 0.0)
    return keys


def deleted_in_a_middle_segment(d, overwrite):
    """K=V1 in segment 1; its tombstone (a delete, or an overwrite with V2) at the start of
    segment 2, with more records after it there; two more segments after that. Returns the
    closed tier's tombstone segment path and the tombstone's offset, and the newest fillers."""
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert t.append(K, memoryview(V1), 0.0)
    fill_until_new_segment(t, b"a")
    tomb_seg = t.segments[-1]
    tomb_off = tomb_seg.size
    seq = t.next_seq()
    assert t.remove(K, seq)
    assert t.segments[-1] is tomb_seg
    if overwrite:
        assert t.append(K, memoryview(V2), 0.0, seq=seq)  # as the store does: the tombstone carries its seq
    fill_until_new_segment(t, b"b")
    newest = fill_until_new_segment(t, b"c")[-1:]
    assert readable(t, K) == (V2 if overwrite else None)
    t.close()
    return tomb_seg.path, tomb_off, newest


def flip(path, off, n=16):
    with open(path, "r+b") as f:
        f.seek(off)
        data = f.read(n)
        f.seek(off)
        f.write(bytes(b ^ 0xFF for b in data))


DAMAGE = {
    "bytes-flipped": lambda path, off: flip(path, off + 8),  # inside the tombstone's header
    "truncated-mid-record": lambda path, off: os.truncate(path, off + 10),
    "truncated-at-the-record": lambda path, off: os.truncate(path, off),
    "truncated-to-zero": lambda path, off: os.truncate(path, 0),
    "removed": lambda path, off: os.unlink(path),
}


@pytest.mark.parametrize("overwrite", [False, True], ids=["delete", "overwrite"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_tombstone_segment_never_brings_back_the_older_value(tmp_path, damage, overwrite):
    d = str(tmp_path / "disk")
    path, off, newest = deleted_in_a_middle_segment(d, overwrite)
    DAMAGE[damage](path, off)
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    got = readable(t, K)
    assert got != V1, f"{damage}: the deleted/overwritten value came back"
    assert got in ((None, V2) if overwrite else (None,))
    for k in newest:  # what was written after the damage is kept: only older values are forgotten
        assert readable(t, k) == b"f" * 20 * KB
    t.close()


def test_a_removed_newest_segment_never_brings_back_the_older_value(tmp_path):
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert t.append(K, memoryview(V1), 0.0)
    fill_until_new_segment(t, b"a")
    assert t.remove(K)
    newest = t.segments[-1].path
    t.close()
    os.unlink(newest)
    t2 = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert readable(t2, K) is None
    t2.close()


def test_a_torn_tail_of_the_newest_segment_keeps_everything_before_it(tmp_path):
    """The crash case: a kill -9 mid-append leaves half a record at the end of the newest
    segment; every record before it (in that segment and in older ones) is recovered."""
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert t.append(K, memoryview(V1), 0.0)
    older = fill_until_new_segment(t, b"a")
    assert t.append(("ns", b"last"), memoryview(b"L" * 100), 0.0)
    path = t.segments[-1].path
    t.close()
    with open(path, "ab") as f:
        f.write(R.REC_MAGIC + b"\x01" * 60)
    t2 = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert readable(t2, K) == V1 and readable(t2, ("ns", b"last")) == b"L" * 100
    assert all(readable(t2, k) == b"f" * 20 * KB for k in older)
    assert t2.append(("ns", b"after"), memoryview(b"A" * 10), 0.0)
    t2.close()
    t3 = NvmeTier(d, 8 * MB, segment_bytes=SEG)  # and the next restart finds nothing to complain of
    assert readable(t3, K) == V1 and readable(t3, ("ns", b"after")) == b"A" * 10
    t3.close()


def test_segments_without_their_segment_map_are_not_trusted(tmp_path):
    """Without the record of which segments exist a removed one cannot be noticed: nothing is
    recovered (a tier from before the map existed starts empty once)."""
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert t.append(K, memoryview(V1), 0.0)
    t.close()
    names = [n for n in os.listdir(d) if n.startswith("tier.segs")]
    assert names
    for n in names:
        os.unlink(os.path.join(d, n))
    nothing_trusted_then_usable(d)


# -- the open segment's high-water mark ----------------------------------------------------------
def deleted_in_the_newest_segment(d, overwrite, stop):
    """K=V1 in segment 1; its tombstone (a delete, or an overwrite with V2) in the newest, open
    segment, with a few records after it. The tier is stopped cleanly or abandoned (a kill -9).
    Returns the newest segment's path, the tombstone's offset, the offset of the last record and
    the segment's size (the high-water mark)."""
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert t.append(K, memoryview(V1), 0.0)
    fill_until_new_segment(t, b"a")
    seg = t.segments[-1]
    assert t.append(("ns", b"before"), memoryview(b"B" * 100), 0.0)
    tomb_off = seg.size
    seq = t.next_seq()
    assert t.remove(K, seq)
    if overwrite:
        assert t.append(K, memoryview(V2), 0.0, seq=seq)
    for i in range(3):
        last_off = seg.size
        assert t.append(filler(b"z", i), memoryview(b"z" * 300), 0.0)
    assert t.segments[-1] is seg and not seg.sealed
    assert readable(t, K) == (V2 if overwrite else None)
    hwm = seg.size
    if stop == "clean":
        t.close()
    return seg.path, tomb_off, last_off, hwm


CUTS = {
    "mid-tombstone": lambda tomb, last, hwm: tomb + 10,
    "at-the-tombstone": lambda tomb, last, hwm: tomb,
    "at-the-last-record": lambda tomb, last, hwm: last,
    "mid-last-record": lambda tomb, last, hwm: hwm - 10,
    "one-byte-short": lambda tomb, last, hwm: hwm - 1,
}


@pytest.mark.parametrize("stop", ["crash", "clean"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["delete", "overwrite"])
@pytest.mark.parametrize("cut", list(CUTS))
def test_the_newest_segment_cut_below_its_high_water_mark_never_brings_back_the_older_value(
        tmp_path, cut, overwrite, stop):
    """The newest segment's size is recorded only once it is sealed; its high-water mark (the
    end of its last acknowledged record, in tier.hwm) tells a cut tail from a torn append."""
    d = str(tmp_path / "disk")
    path, tomb, last, hwm = deleted_in_the_newest_segment(d, overwrite, stop)
    assert os.path.getsize(path) == hwm
    os.truncate(path, CUTS[cut](tomb, last, hwm))
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    got = readable(t, K)
    assert got != V1, f"{cut}: the deleted/overwritten value came back"
    assert got in ((None, V2) if overwrite else (None,))
    assert t.append(("ns", b"after"), memoryview(b"A" * 10), 0.0)
    t.close()
    t2 = NvmeTier(d, 8 * MB, segment_bytes=SEG)  # the next start finds nothing to complain of
    assert readable(t2, K) in ((None, V2) if overwrite else (None,))
    assert readable(t2, ("ns", b"after")) == b"A" * 10
    t2.close()


@pytest.mark.parametrize("stop", ["crash", "clean"])
def test_a_torn_tail_beyond_the_high_water_mark_keeps_everything_before_it(tmp_path, stop):
    """Records past the high-water mark were in flight at the crash (never acknowledged): a torn
    one is the normal crash, cut off; every acknowledged record is kept, deletes included."""
    d = str(tmp_path / "disk")
    path, _, _, hwm = deleted_in_the_newest_segment(d, False, stop)
    with open(path, "ab") as f:
        f.write(R.REC_MAGIC + b"\x01" * 60)
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert readable(t, K) is None
    assert readable(t, ("ns", b"before")) == b"B" * 100
    assert all(readable(t, filler(b"z", i)) == b"z" * 300 for i in range(3))
    assert all(readable(t, filler(b"a", i)) == b"f" * 20 * KB for i in range(2))
    assert os.path.getsize(path) == hwm  # the torn bytes are cut off
    t.close()


def test_a_torn_append_in_flight_at_a_kill_keeps_every_acknowledged_record(tmp_path):
    """A write reserved and half done when the process dies (not acknowledged: the mark is not
    past it) is a torn tail; the values and the delete acknowledged before it are all kept."""
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert t.append(K, memoryview(V1), 0.0)
    older = fill_until_new_segment(t, b"a")
    assert t.remove(K)
    assert t.append(("ns", b"last"), memoryview(b"L" * 100), 0.0)
    p = t.prepare(("ns", b"in-flight"), 5000, 0.0, t.next_seq())
    assert p is not None
    parts = R.pack(R.KIND_VALUE, p.key, p.loc.seq, 5000, 0.0, 0, p.raw, t.salt)
    os.pwritev(p.seg.fd, [*parts, b"x" * 100], p.off)  # the kill comes mid-write
    t2 = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert readable(t2, K) is None and readable(t2, ("ns", b"last")) == b"L" * 100
    assert all(readable(t2, k) == b"f" * 20 * KB for k in older)
    assert readable(t2, ("ns", b"in-flight")) is None
    t2.close()


@pytest.mark.parametrize("how", ["removed", "garbled", "empty"])
def test_segments_without_a_readable_high_water_mark_are_not_trusted(tmp_path, how):
    """Without the newest segment's high-water mark a cut tail cannot be noticed: nothing is
    recovered (as without the segment map)."""
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert t.append(K, memoryview(V1), 0.0)
    t.close()
    path = os.path.join(d, segdir.HWM_FILE)
    assert os.path.exists(path)
    if how == "removed":
        os.unlink(path)
    elif how == "garbled":
        flip(path, 12, 4)
    else:
        os.truncate(path, 0)
    nothing_trusted_then_usable(d)


# -- reclaim against a crash ----------------------------------------------------------------------
def put_unswept(t, k, v):
    """append() without its sweep(): the files of segments the reservation reclaimed stay."""
    p = t.prepare(k, len(v), 0.0, t.next_seq())
    assert p is not None and t.write(p, memoryview(v)) and t.publish(p)


@pytest.mark.parametrize("how", ["killed-before-the-sweep", "unlink-failed"])
def test_a_delete_after_reclaim_stays_deleted_though_the_file_outlives_it(tmp_path, monkeypatch, how):
    """Segment 1 (K=V1) is reclaimed; its file is removed later, outside the lock. A delete of K
    meanwhile finds nothing indexed and writes no tombstone; a crash before the file is gone (or
    a removal that failed) must not let the next start (with a larger budget) find V1."""
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 4 * SEG, segment_bytes=SEG)
    assert t.append(K, memoryview(V1), 0.0)
    first = t.segments[0]
    if how == "unlink-failed":
        def refuse(path, *a, **kw):
            raise PermissionError(1, "Operation not permitted", path)
        monkeypatch.setattr(nvme_mod.os, "unlink", refuse)
        write = lambda k, v: t.append(k, memoryview(v), 0.0)
    else:
        write = lambda k, v: put_unswept(t, k, v)
    i = 0
    while first in t.segments:
        write(filler(b"x", i), b"f" * 20 * KB)
        i += 1
    monkeypatch.undo()
    assert os.path.exists(first.path), "precondition: the reclaimed segment's file is still there"
    assert t.remove(K) is False  # acknowledged: K is gone (nothing indexed, so no tombstone)
    t2 = NvmeTier(d, 64 * MB, segment_bytes=SEG)  # a kill -9 (t is never closed), then a start
    assert readable(t2, K) is None, "a value of a reclaimed segment came back"
    assert readable(t2, filler(b"x", i - 1)) == b"f" * 20 * KB
    assert not os.path.exists(first.path)  # a file below the floor is removed at start
    t2.close()


# -- two daemons on one directory -----------------------------------------------------------------
def test_a_second_daemon_on_the_same_disk_directory_is_refused(make_cluster, tmp_path):
    c = make_cluster(nodes=1, disk="16MiB")
    disk = c.daemons[0].disk_dir
    second = subprocess.Popen(
        [sys.executable, "-m", "gcache", "daemon", "--listen", f"127.0.0.1:{free_port()}", "--mem", "16MiB",
         "--no-pretouch", "--disk", disk, "--disk-size", "16MiB", "--ready-file", str(tmp_path / "ready2")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        exited = poll(lambda: second.poll() is not None, 30)
    finally:
        if second.poll() is None:
            second.kill()
    _, err = second.communicate(timeout=30)
    assert exited, "a second daemon started on a directory another daemon uses"
    assert second.returncode == 2, (second.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and disk in lines[0] and "another gcache daemon" in lines[0], err
    assert "Traceback" not in err
    # a lock file deleted while the first runs lost its lock before: the directory is locked
    for name in os.listdir(disk):
        if name.endswith(".lock"):
            os.unlink(os.path.join(disk, name))
    third = subprocess.run(
        [sys.executable, "-m", "gcache", "daemon", "--listen", f"127.0.0.1:{free_port()}", "--mem", "16MiB",
         "--no-pretouch", "--disk", os.path.join(disk, "."), "--disk-size", "16MiB"],
        check=False, capture_output=True, text=True, timeout=60)
    assert third.returncode == 2 and "another gcache daemon" in third.stderr, (third.returncode, third.stderr)
    # the first daemon is unharmed; once it is gone (even killed) the directory can be used again
    assert c.daemons[0].proc.poll() is None
    c.kill(0, signal.SIGKILL)
    c.restart(0)
    assert c.daemons[0].proc.poll() is None
