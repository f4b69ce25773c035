"""The NVMe tier's start on a directory that is not what it left: a filesystem with no room
for the tier's own small files, stray or implausible segment ids, records of another format
version. It starts (a cache may forget) and says what it found; it never serves a value an
acknowledged delete or overwrite hid."""

import errno
import logging
import os

import pytest

from gcache.errors import ConfigError
from gcache.tier import segdir
from gcache.tier.nvme import NvmeTier
from tests.test_nvme_full_disk import readable

KB = 1024
MB = 1024 * KB
SEG = 64 * KB


def k(i):
    return ("ns", b"key-%03d" % i)


def v(i):
    return (b"%03d" % i) * (10 * KB // 3)


def written(d, n=30):
    """A closed tier with n 10 KiB values over several segments, k(0) deleted; its segment files."""
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    for i in range(n):
        assert t.append(k(i), memoryview(v(i)), 0.0)
    assert t.remove(k(0))
    t.close()
    return sorted(n for n in os.listdir(d) if n.startswith("seg-"))


class FullFs:
    """The tier's own files (segment map, high-water mark, state) cannot be written while the
    directory's segment files take more than ``capacity`` bytes: ENOSPC, as on a filesystem
    filled to the last byte, where only removing a segment makes room."""

    def __init__(self, directory, capacity, monkeypatch):
        self.directory, self.capacity, self.failures = directory, capacity, 0
        real_write, real_open = segdir.write_atomically, segdir.HighWater.open
        monkeypatch.setattr(segdir, "write_atomically", lambda *a, **kw: self.check() or real_write(*a, **kw))
        monkeypatch.setattr(segdir.HighWater, "open", lambda hw, *a: self.check() or real_open(hw, *a))

    def taken(self):
        return sum(os.path.getsize(os.path.join(self.directory, n)) for n in os.listdir(self.directory)
                   if n.startswith("seg-"))

    def check(self):
        if self.taken() > self.capacity:
            self.failures += 1
            raise OSError(errno.ENOSPC, "No space left on device")


def test_a_start_on_a_full_filesystem_drops_the_oldest_segments_to_make_room(tmp_path, monkeypatch, caplog):
    """Test fails before: the start was refused with "[Errno 28] No space left on device",
    naming nothing (a crash loop)."""
    d = str(tmp_path / "disk")
    segs = written(d)
    assert len(segs) >= 4
    fs = FullFs(d, sum(os.path.getsize(os.path.join(d, n)) for n in segs[1:]), monkeypatch)
    with caplog.at_level(logging.WARNING, logger="gcache.tier.nvme"):
        t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert fs.failures > 0  # it was full
    assert "full" in caplog.text and segs[0] in caplog.text  # it says what it dropped, and why
    assert sorted(n for n in os.listdir(d) if n.startswith("seg-")) == segs[1:]  # the oldest only
    assert readable(t, k(0)) is None  # deleted, stays deleted
    kept = [i for i in range(30) if readable(t, k(i)) == v(i)]
    assert kept and kept == list(range(kept[0], 30)) and len(kept) >= 20
    assert t.budget == 8 * MB
    t.close()
    monkeypatch.undo()
    t2 = NvmeTier(d, 8 * MB, segment_bytes=SEG)  # the next start keeps what this one kept
    assert [i for i in range(30) if readable(t2, k(i)) == v(i)] == kept
    t2.close()


def test_a_start_on_a_full_filesystem_with_nothing_to_drop_runs_without_the_disk_tier(tmp_path, monkeypatch,
                                                                                        caplog):
    """Nothing of the tier's own can be written, even with every segment dropped: it starts
    with the disk tier off (every write refused), says so, and works again at the next start
    with room. Test fails before: the start was refused."""
    d = str(tmp_path / "disk")
    written(d)
    FullFs(d, -1, monkeypatch)  # no room at all
    with caplog.at_level(logging.ERROR, logger="gcache.tier.nvme"):
        t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert "disk tier is off" in caplog.text and d in caplog.text and "--disk" in caplog.text
    assert t.budget == 0 and len(t) == 0
    assert not t.append(k(99), memoryview(b"x" * 100), 0.0)
    assert not t.remove(k(1))
    t.close()
    monkeypatch.undo()
    t2 = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert all(readable(t2, k(i)) is None for i in range(30))  # (dropped to make room)
    assert t2.append(k(99), memoryview(b"x" * 100), 0.0)
    t2.close()
    t3 = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert readable(t3, k(99)) == b"x" * 100
    t3.close()


def test_a_start_that_cannot_write_its_files_for_another_reason_names_the_directory_and_the_flag(tmp_path,
                                                                                               monkeypatch):
    d = str(tmp_path / "disk")
    written(d)

    def eio(*a, **kw):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(segdir, "write_atomically", eio)
    with pytest.raises(ConfigError) as e:
        NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert d in str(e.value) and "--disk" in str(e.value) and "Input/output error" in str(e.value)


def segment_names(d):
    return sorted(n for n in os.listdir(d) if n.startswith("seg-"))


@pytest.mark.parametrize("stray", ["empty", "junk", "directory"])
def test_a_stray_segment_file_above_the_newest_is_set_aside_and_every_restart_keeps_everything(tmp_path, caplog,
                                                                                               stray):
    """A seg-*.log with an id above any the tier created is not one of its segments. Test
    fails before: the first restart took its id for the newest (the map said 900) and the next
    reported 6..899 missing and dropped every value."""
    d = str(tmp_path / "disk")
    segs = written(d)
    path = os.path.join(d, "seg-00000900.log")
    if stray == "directory":
        os.mkdir(path)
    else:
        with open(path, "wb") as f:
            f.write(os.urandom(5000) if stray == "junk" else b"")
    for restart in range(2):
        with caplog.at_level(logging.WARNING, logger="gcache.tier.nvme"):
            t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
        assert all(readable(t, k(i)) == v(i) for i in range(1, 30)), f"restart {restart}"
        assert readable(t, k(0)) is None
        assert t.append(("ns", b"r%d" % restart), memoryview(b"x" * 10), 0.0)
        assert max(s.seg_id for s in t.segments) < 900
        t.close()
        assert "seg-00000900.log" not in segment_names(d)
    assert "seg-00000900.log" in caplog.text and "stray" in caplog.text
    assert os.path.exists(path + ".stray")  # set aside, for whoever left it there
    assert segment_names(d)[: len(segs)] == segs


def test_a_segment_the_map_missed_but_the_high_water_mark_knows_is_kept(tmp_path):
    """A segment created while the map could not be written (the mark still names it) is one
    of the tier's: it is read, not set aside."""
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    for i in range(10):
        assert t.append(k(i), memoryview(v(i)), 0.0)
    with open(os.path.join(d, segdir.MAP_FILE)) as f:
        old_map = f.read()
    newest = t.segments[-1].seg_id
    while t.segments[-1].seg_id == newest:
        i += 1
        assert t.append(k(i), memoryview(v(i)), 0.0)
    with open(os.path.join(d, segdir.MAP_FILE), "w") as f:
        f.write(old_map)  # the map from before the newest segment: as if saving it had failed
    t2 = NvmeTier(d, 8 * MB, segment_bytes=SEG)  # (t abandoned: a kill -9)
    assert all(readable(t2, k(j)) == v(j) for j in range(i + 1))
    t2.close()
    t.close()


@pytest.mark.parametrize("first_line", ["{floor} {newest_huge}", "{floor} 100000000000000", "-3 {newest}",
                                        "{newest_plus_two} {newest}", "0 0"])
def test_an_implausible_segment_map_is_damage_said_so_and_quick(tmp_path, caplog, first_line):
    """A map whose newest id is far above what the high-water mark names (or beyond what a
    segment name can hold), or whose floor is not a segment id: nothing is trusted (a segment
    it claims may have held a tombstone), the log says the map is implausible, the start takes
    O(files), and the ids go on from the real files. Test fails before: it built a set of every
    id up to NEWEST (30 s and gigabytes for 50 million; this test uses 3 million), and said
    millions of segments were "missing"."""
    d = str(tmp_path / "disk")
    written(d)
    p = os.path.join(d, segdir.MAP_FILE)
    with open(p) as f:
        lines = f.read().splitlines()
    floor, newest = map(int, lines[0].split())
    lines[0] = first_line.format(floor=floor, newest=newest, newest_huge=newest + 3_000_000,
                                 newest_plus_two=newest + 2)
    with open(p, "w") as f:
        f.write("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="gcache.tier.nvme"):
        t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert "implausible" in caplog.text and segdir.MAP_FILE in caplog.text
    assert len(t) == 0  # nothing trusted
    assert t.append(k(99), memoryview(b"x" * 10), 0.0)
    assert t.segments[-1].seg_id <= newest + 2
    t.close()
    t2 = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert readable(t2, k(99)) == b"x" * 10 and all(readable(t2, k(i)) is None for i in range(30))
    t2.close()


def test_missing_segments_are_reported_as_ranges(tmp_path, caplog):
    d = str(tmp_path / "disk")
    segs = written(d, 40)
    for n in segs[1:3]:
        os.unlink(os.path.join(d, n))
    with caplog.at_level(logging.WARNING, logger="gcache.tier.nvme"):
        t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert "segments 2..3 of" in caplog.text and "are missing" in caplog.text
    assert readable(t, k(39)) == v(39)
    t.close()


def test_records_of_another_format_version_are_reported_as_such(tmp_path, caplog):
    """Records that verify but carry another format version byte (an upgrade or a downgrade):
    dropped, as damage is (this build cannot read them), and the log says which version was
    found and which this build reads. Test fails before: it said "damaged bytes"."""
    import xxhash

    from gcache.tier import records as R

    d = str(tmp_path / "disk")
    segs = written(d)
    t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    salt = t.salt
    t.close()
    for name in segs[:2]:  # the two oldest segments, as a version-3 build would have written them
        fd = os.open(os.path.join(d, name), os.O_RDWR)
        try:
            for rec in R.scan(fd, os.fstat(fd).st_size, salt).records:
                hdr = bytearray(os.pread(fd, rec.value_off - rec.off, rec.off))
                hdr[4] = 3
                chk = xxhash.xxh3_64_intdigest(bytes(hdr[: R.REC.size]) + bytes(hdr[R.FIXED:]), seed=salt)
                hdr[R.REC.size: R.FIXED] = R.HCHK.pack(chk)
                os.pwrite(fd, bytes(hdr), rec.off)
        finally:
            os.close(fd)
    with caplog.at_level(logging.WARNING, logger="gcache.tier.nvme"):
        t = NvmeTier(d, 8 * MB, segment_bytes=SEG)
    assert "format version 3" in caplog.text and f"version {R.REC_VERSION}" in caplog.text
    assert "damaged" not in caplog.text
    assert readable(t, k(29)) == v(29)  # the newer segments are this version's
    assert readable(t, k(1)) is None
    t.close()
