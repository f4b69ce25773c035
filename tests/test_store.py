"""The tiered store in-process: LRU, TTL, pins, demotion, checksums, full disk, recovery."""

import dataclasses
import os
import resource

import pytest

from gcache.protocol import Status
from gcache.tier.nvme import NvmeTier
from gcache.tier.store import Store, StoreConfig
from gcache.tier.valuemeta import NO_META
from tests.conftest import poll, read

KB = 1024






@pytest.fixture
def ram_store():
    s = Store(StoreConfig(mem_bytes=64 * KB))
    yield s
    s.close()




def test_lru_evicts_least_recently_used_first(ram_store):
    for i in range(4):
        assert ram_store.put(("ns", b"k%d" % i), bytes([i]) * 16 * KB) is Status.OK
    assert read(ram_store, ("ns", b"k0")) is not None  # k0 becomes most recent
    assert ram_store.put(("ns", b"k4"), b"x" * 16 * KB) is Status.OK
    present = [ram_store.exists(("ns", b"k%d" % i)) for i in range(5)]
    assert present == [True, False, True, True, True]  # k1 was the least recent
    assert ram_store.stats()["evictions"] == 1



def test_commit_many_publishes_in_order_and_gives_back_what_follows_a_failure(ram_store, monkeypatch):
    s = ram_store
    res = [s.reserve(4 * KB) for _ in range(4)]
    for i, r in enumerate(res):
        r.view[:] = bytes([i]) * (4 * KB)
    real = s._publish
    calls = []

    def publish(key, r, entry):
        calls.append(key)
        if len(calls) == 2:
            raise RuntimeError("injected")
        real(key, r, entry)

    monkeypatch.setattr(s, "_publish", publish)
    with pytest.raises(RuntimeError, match="injected"):
        s.commit_many([(("ns", b"k%d" % i), r, NO_META) for i, r in enumerate(res)])
    assert calls == [("ns", b"k0"), ("ns", b"k1")]  # stopped at the failure
    assert read(s, ("ns", b"k0")) == bytes([0]) * (4 * KB)
    assert not s.exists(("ns", b"k2")) and not s.exists(("ns", b"k3"))
    # k0 is stored, k2 and k3 were given back; only the slot of the one that failed is unaccounted
    assert s.stats()["ram_used"] == 2 * 4 * KB
    monkeypatch.setattr(s, "_publish", real)
    s.commit_many([(("ns", b"a"), s.reserve(100), NO_META), (("ns", b"b"), s.reserve(200), NO_META)])
    assert s.exists(("ns", b"a")) and s.exists(("ns", b"b")) and s.stats()["puts"] == 3


def test_commit_many_gives_every_reservation_back_when_its_guard_fails(ram_store):
    s = ram_store
    res = [s.reserve(4 * KB) for _ in range(3)]

    def guard():
        raise ValueError("the connection was closed under the check")

    with pytest.raises(ValueError):
        s.commit_many([(("ns", b"k%d" % i), r, NO_META) for i, r in enumerate(res)], guard)
    assert s.stats()["ram_used"] == 0 and not any(s.exists(("ns", b"k%d" % i)) for i in range(3))


def test_ttl_expiry(ram_store):
    ram_store.put(("ns", b"short"), b"v", ttl_s=0.05)
    ram_store.put(("ns", b"long"), b"v")
    assert ram_store.exists(("ns", b"short"))
    assert poll(lambda: not ram_store.exists(("ns", b"short")), 5)
    assert ram_store.exists(("ns", b"long"))
    assert ram_store.stats()["ram_keys"] == 1


def test_byte_exact_accounting(ram_store):
    ram_store.put(("ns", b"a"), b"x" * 100)
    ram_store.put(("ns", b"b"), b"y" * 1000)
    s = ram_store.stats()
    assert s["ram_value_bytes"] == 1100 and s["ram_used"] == 128 + 1024
    ram_store.put(("ns", b"a"), b"z" * 10)  # overwrite frees the old slot
    s = ram_store.stats()
    assert s["ram_value_bytes"] == 1010 and s["ram_used"] == 64 + 1024
    assert ram_store.delete(("ns", b"b")) and not ram_store.delete(("ns", b"b"))
    assert ram_store.stats()["ram_used"] == 64


def test_pinned_value_is_never_overwritten_in_place(ram_store):
    ram_store.put(("ns", b"a"), b"A" * 32 * KB)
    hit = ram_store.acquire(("ns", b"a"))
    ram_store.put(("ns", b"a"), b"B" * 32 * KB)  # replaces while the reader holds the old slot
    for i in range(3):
        ram_store.put(("ns", b"f%d" % i), b"C" * 16 * KB)  # pressure: must not reuse the pinned slot
    assert bytes(hit.view) == b"A" * 32 * KB
    ram_store.release(hit)
    assert read(ram_store, ("ns", b"a")) in (b"B" * 32 * KB, None)


def test_full_when_everything_is_pinned(ram_store):
    ram_store.put(("ns", b"a"), b"x" * 60 * KB)
    hit = ram_store.acquire(("ns", b"a"))
    assert ram_store.put(("ns", b"b"), b"y" * 16 * KB) is Status.FULL
    ram_store.release(hit)
    assert ram_store.put(("ns", b"b"), b"y" * 16 * KB) is Status.OK


def test_a_value_that_cannot_fit_past_a_pinned_slot_evicts_nothing():
    """A reader's pinned slot in the middle of the arena leaves two runs of ~half of it: a
    larger value cannot fit however much is evicted. It is refused FULL with every other value
    kept (before: all 14 were evicted first, then FULL)."""
    s = Store(StoreConfig(mem_bytes=16 * 64 * KB, pretouch=False))
    try:
        keys = [("ns", b"k%02d" % i) for i in range(15)]
        for k in keys:
            assert s.put(k, b"v" * 64 * KB) is Status.OK
        hit = s.acquire(("ns", b"k08"))
        assert hit.entry.off == 8 * 64 * KB  # the arena's middle
        assert s.put(("ns", b"big"), b"b" * 9 * 64 * KB) is Status.FULL
        assert all(s.exists(k) for k in keys) and s.counters["evictions"] == 0
        assert s.put(("ns", b"fits"), b"f" * 7 * 64 * KB) is Status.OK  # what can fit still evicts and fits
        s.release(hit)
        assert s.put(("ns", b"big"), b"b" * 9 * 64 * KB) is Status.OK  # unpinned: room can be made
        assert read(s, ("ns", b"big")) == b"b" * 9 * 64 * KB
    finally:
        s.close()


def test_too_large(ram_store):
    assert ram_store.put(("ns", b"big"), b"x" * 65 * KB) is Status.TOO_LARGE


def test_namespaces_are_isolated(ram_store):
    ram_store.put(("a", b"k"), b"tenant-a")
    assert read(ram_store, ("b", b"k")) is None
    assert not ram_store.delete(("b", b"k"))
    assert read(ram_store, ("a", b"k")) == b"tenant-a"


def test_pressure_demotes_to_nvme_and_values_are_still_served(tiered):
    s = tiered()
    values = {b"k%03d" % i: os.urandom(10 * KB) for i in range(40)}  # 400 KiB through a 64 KiB arena
    for k, v in values.items():
        assert s.put(("ns", k), v) is Status.OK
    assert s.flush()
    st = s.stats()
    assert st["demotions"] > 30 and st["disk_keys"] > 30
    for k, v in values.items():
        assert read(s, ("ns", k)) == v
    assert s.stats()["hits_nvme"] > 0


def test_checksum_mismatch_is_a_miss_never_bad_bytes(tiered):
    s = tiered(promote_on_hit=False)
    s.put(("ns", b"victim"), b"v" * 20 * KB)
    for i in range(8):
        s.put(("ns", b"f%d" % i), b"f" * 20 * KB)
    assert s.flush()
    loc = s.nvme.index[("ns", b"victim")]
    os.pwrite(loc.seg.fd, b"\xff\xfe", loc.off + 100)  # bit rot inside the value
    assert read(s, ("ns", b"victim")) is None
    assert s.stats()["disk_corrupt"] == 1
    assert not s.exists(("ns", b"victim"))  # the bad record is dropped


def test_restart_recovers_disk_keys_and_drops_a_torn_tail(tmp_path):
    d = str(tmp_path / "disk")
    t = NvmeTier(d, 4 << 20, segment_bytes=1 << 20)
    for i in range(10):
        assert t.append(("ns", b"k%d" % i), memoryview(bytes([i]) * 5000), 0.0)
    t.remove(("ns", b"k3"))
    seg_path = t.segments[-1].path
    t.close()
    with open(seg_path, "ab") as f:  # a crash mid-append: a header and half a value
        f.write(b"GCR1" + b"\x01" * 60)
    t2 = NvmeTier(d, 4 << 20, segment_bytes=1 << 20)
    assert len(t2) == 9 and not t2.contains(("ns", b"k3"))
    for i in (0, 5, 9):
        loc = t2.lookup(("ns", b"k%d" % i))
        buf = memoryview(bytearray(loc.size))
        assert t2.read(("ns", b"k%d" % i), loc, buf) and bytes(buf) == bytes([i]) * 5000
    assert t2.append(("ns", b"new"), memoryview(b"n" * 10), 0.0)  # appends continue after the tail
    t2.close()


def test_disk_budget_reclaims_oldest_segments(tmp_path):
    t = NvmeTier(str(tmp_path / "d"), 1 << 20, segment_bytes=256 * KB)
    for i in range(40):
        assert t.append(("ns", b"k%d" % i), memoryview(b"x" * 50 * KB), 0.0)
    assert t.used <= 1 << 20
    assert t.contains(("ns", b"k39")) and not t.contains(("ns", b"k0"))
    assert t.reclaimed_segments > 0
    t.close()


def test_full_disk_is_survived_and_loses_nothing_stored(tmp_path):
    """RLIMIT_FSIZE makes writes past 300 KiB of a file fail with EFBIG, as a full disk would."""
    t = NvmeTier(str(tmp_path / "d"), 16 << 20, segment_bytes=1 << 20)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300 * KB, hard))
    try:
        results = [t.append(("ns", b"k%d" % i), memoryview(bytes([i]) * 40 * KB), 0.0) for i in range(12)]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert results[0] and not all(results)
    assert t.write_errors > 0
    for i, ok in enumerate(results):
        loc = t.lookup(("ns", b"k%d" % i))
        assert (loc is not None) == ok
        if loc is not None:
            buf = memoryview(bytearray(loc.size))
            assert t.read(("ns", b"k%d" % i), loc, buf) and bytes(buf) == bytes([i]) * 40 * KB
    t.close()


def test_overwrite_survives_restart_as_the_new_value(tiered, tmp_path):
    s = tiered()
    s.put(("ns", b"k"), b"old" * 10 * KB)
    for i in range(10):
        s.put(("ns", b"f%d" % i), b"f" * 10 * KB)
    assert s.flush() and s.nvme.contains(("ns", b"k"))
    s.put(("ns", b"k"), b"new")  # a tombstone hides the old disk copy
    s.close()
    t = NvmeTier(str(tmp_path / "disk"), 4 << 20, segment_bytes=256 * KB)
    assert not t.contains(("ns", b"k"))
    t.close()


def test_batched_lookups_agree_with_single_ones_across_tiers(tiered):
    """acquire_many / exists_many (one lock per request) answer what acquire / exists answer,
    for RAM hits, disk hits, misses and skipped (None) keys, and pin what they return."""
    s = tiered(promote_on_hit=False, read_buffer_bytes=1 << 20)  # every disk hit held at once
    values = {b"k%03d" % i: os.urandom(10 * KB) for i in range(30)}  # most end up on disk only
    for k, v in values.items():
        assert s.put(("ns", k), v) is Status.OK
    assert s.flush()
    keys = [("ns", k) for k in values] + [("ns", b"missing"), None]
    assert s.exists_many(keys) == [s.exists(k) for k in keys[:-1]] + [False]
    assert s.exists_many(keys)[:30] == [True] * 30
    hits = s.acquire_many(keys)
    try:
        assert [bytes(h.view) if h is not None else None for h in hits] == list(values.values()) + [None, None]
        on_ram = [h for h in hits if h is not None and h.entry is not None]
        assert on_ram and all(h.entry.pins == 1 for h in on_ram)  # pinned until released
    finally:
        for h in hits:
            if h is not None:
                s.release(h)
    assert all(h.entry.pins == 0 for h in on_ram)


def test_reserve_many_that_fails_partway_holds_nothing(ram_store, monkeypatch):
    s = ram_store
    real = s._make_room
    calls = []

    def make_room(size, *args):
        calls.append(size)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(size, *args)

    monkeypatch.setattr(s, "_make_room", make_room)
    with pytest.raises(RuntimeError, match="injected"):
        s.reserve_many([KB, None, 2 * KB, 3 * KB])
    assert calls == [KB, 2 * KB, 3 * KB] and s.stats()["ram_used"] == 0  # the first two were given back


def test_delete_namespace_drops_ram_pooled_queued_and_disk_keys_for_good(tiered, monkeypatch):
    s = tiered()
    old = {b"k%03d" % i: os.urandom(10 * KB) for i in range(40)}  # 400 KiB through a 64 KiB arena
    for k, v in old.items():
        assert s.put(("a", k), v) is Status.OK
    assert s.put(("a", b"queued"), b"q" * KB, pool="kv") is Status.OK  # pooled: always worth the disk
    assert s.put(("b", b"k000"), b"other namespace") is Status.OK
    assert s.flush() and s.stats()["disk_keys"] > 30
    gate, real_write = __import__("threading").Event(), s.nvme.write
    monkeypatch.setattr(s.nvme, "write", lambda p, v: gate.wait(10) and real_write(p, v))  # the demoter waits
    monkeypatch.setattr(s, "config", dataclasses.replace(s.config, full_wait_s=0))  # FULL at once meanwhile
    try:
        for i in range(16):  # puts until eviction queues "queued" for the disk (FULL once the queue holds the arena)
            if ("a", b"queued") not in s.ram.index:
                break
            s.put(("a", b"push%d" % i), b"x" * 10 * KB, pool="kv")
        held = [k for k in s.keys_hottest_first() if k[0] == "a"]  # what eviction did not drop
        assert ("a", b"queued") in held and ("a", b"queued") not in s.ram.index and len(held) > 30
        assert s.delete_namespace("a", chunk=7) == len(held)
    finally:
        gate.set()
    assert s.flush()
    assert all(read(s, k) is None for k in held)
    assert read(s, ("b", b"k000")) == b"other namespace"
    assert s.delete_namespace("nothing-here") == 0
    s.close()
    t = tiered()  # the same directory: recovery finds tombstones, not the old values
    assert [k for k in t.keys_hottest_first() if k[0] == "a"] == []
    assert read(t, ("b", b"k000")) == b"other namespace"


def test_disk_hits_read_outside_the_arena_are_bounded_and_given_back(tiered):
    """A disk hit that cannot be promoted is read into a private buffer, drawn on a daemon-wide
    budget (read_buffer_bytes): beyond it the hit is a miss (counted), and release gives it back."""
    s = tiered(promote_on_hit=False, read_buffer_bytes=48 * KB)
    values = {b"k%02d" % i: os.urandom(16 * KB) for i in range(20)}  # 320 KiB through a 64 KiB arena
    for k, v in values.items():
        assert s.put(("ns", k), v) is Status.OK
    assert s.flush()
    on_disk = [("ns", k) for k in values if ("ns", k) not in s.ram.index]
    assert len(on_disk) >= 10
    hits = s.acquire_many(on_disk)
    try:
        got = [h for h in hits if h is not None]
        # before: every one was read into its own buffer (RSS grew with the request, not --mem)
        assert len(got) == 3 and hits[:3] == got, "private reads went past their budget"
        assert all(bytes(h.view) == values[k[1]] for h, k in zip(hits, on_disk) if h is not None)
        st = s.stats()
        assert st["disk_reads_refused"] == len(on_disk) - 3
        assert st["disk_read_buffer_bytes"] == 48 * KB and st["disk_read_budget"] == 48 * KB
    finally:
        s.release_many([h for h in hits if h is not None])
    assert s.stats()["disk_read_buffer_bytes"] == 0
    assert read(s, on_disk[-1]) == values[on_disk[-1][1]]  # the budget is back: a hit again
    assert s.stats()["disk_read_buffer_bytes"] == 0


def test_a_disk_hit_without_read_budget_waits_for_another_reader_to_release_it(tiered):
    import threading

    s = tiered(promote_on_hit=False, read_buffer_bytes=32 * KB, read_wait_s=10.0)
    values = {b"k%02d" % i: os.urandom(16 * KB) for i in range(12)}
    for k, v in values.items():
        assert s.put(("ns", k), v) is Status.OK
    assert s.flush()
    on_disk = [("ns", k) for k in values if ("ns", k) not in s.ram.index]
    first = s.acquire_many(on_disk[:2])  # the whole budget
    assert all(h is not None for h in first)
    got = []
    t = threading.Thread(target=lambda: got.append(s.acquire(on_disk[2])))
    t.start()
    assert poll(lambda: s._read_waiters == 1, 5), "the reader holding no budget did not wait for it"
    s.release_many(first)  # its reply is out: the waiting reader goes on
    t.join(5)
    assert got and got[0] is not None and bytes(got[0].view) == values[on_disk[2][1]]
    assert s.stats().get("disk_reads_refused", 0) == 0
    s.release(got[0])
    s.close()
    s = tiered(promote_on_hit=False, read_buffer_bytes=32 * KB, read_wait_s=0.05)  # recovers the disk
    held = s.acquire_many(on_disk[:2])
    assert all(h is not None for h in held)
    assert s.acquire(on_disk[2]) is None, "a reader waited past read_wait_s"  # then a miss
    assert s.stats()["disk_reads_refused"] == 1
    s.release_many(held)


def test_a_put_into_a_full_arena_with_a_disk_tier_evicts_what_it_needs_not_all_of_ram(tiered):
    """A victim bound for the disk keeps its slot until the demoter has written it, and the
    demoter needs the lock the eviction loop holds: one put into a full arena evicted every entry
    (a prober: 256 of 256 pages went to the disk queue, RAM emptied). It evicts about what it
    needs and waits for the demoter."""
    page = 4096
    s = tiered(mem=256 * page, disk=64 << 20, pretouch=False)
    for i in range(256):
        assert s.put(("n", b"k%d" % i), b"x" * page) is Status.OK
    assert s.flush()
    before = s.stats()
    assert s.put(("n", b"new"), b"y" * page) is Status.OK
    after = s.stats()
    assert after.get("evictions", 0) - before.get("evictions", 0) <= 4, (before, after)
    assert after["ram_keys"] >= before["ram_keys"] - 3
    assert read(s, ("n", b"new")) == b"y" * page
    assert read(s, ("n", b"k0")) == b"x" * page  # the evicted ones are on disk


def test_a_pooled_batch_counts_its_own_reservations_against_the_pools_budget(tmp_path):
    """The budget was checked against committed bytes only: one batch at a 128-page budget took
    the pool to 196 pages (a prober). Values the batch's earlier ones leave no budget for are FULL."""
    from gcache.tier.pools import PoolBudget
    from gcache.tier.valuemeta import ValueMeta

    page = 4096
    s = Store(StoreConfig(mem_bytes=1024 * page, pretouch=False, full_wait_s=0.0,
                          pool_budgets=(PoolBudget("kv", 128 * page),)))
    res = s.reserve_many([page] * 120, pool=("ns", "kv"))
    s.commit_many([(("ns", b"a%d" % i), r, ValueMeta(pool="kv")) for i, r in enumerate(res)])
    res = s.reserve_many([page] * 120, pool=("ns", "kv"))
    ok = [r for r in res if not isinstance(r, Status)]
    s.commit_many([(("ns", b"b%d" % i), r, ValueMeta(pool="kv")) for i, r in enumerate(ok)])
    pool = s.stats()
    kv_bytes = sum(g.bytes for g in s.ram.groups.values())
    assert kv_bytes <= 128 * page, (kv_bytes // page, pool)
    assert len(ok) == 120 and Status.FULL not in res  # room made by evicting the pool's older pages
    res = s.reserve_many([page] * 130, pool=("ns", "kv"))  # more than the budget in one batch
    assert res[:128].count(Status.FULL) == 0 and res[128:] == [Status.FULL, Status.FULL]
    s.abort_many([r for r in res if not isinstance(r, Status)])
    s.close()


@pytest.mark.parametrize("value_kib", [16, 128, 256])
def test_a_large_put_into_a_full_arena_with_a_disk_tier_does_not_empty_it(tiered, value_kib):
    """The patient eviction was off for values of 1/64 of the arena or more: one 128 KiB put
    into a full 8 MiB arena still evicted all 64 values (a reviewer)."""
    size = value_kib * KB
    s = tiered(mem=8 << 20, disk=64 << 20, pretouch=False)
    n = (8 << 20) // size
    for i in range(n):
        assert s.put(("n", b"k%d" % i), b"x" * size) is Status.OK
    assert s.flush()
    before = s.stats().get("evictions", 0)
    assert s.put(("n", b"new"), b"y" * size) is Status.OK
    assert s.stats().get("evictions", 0) - before <= 2


def test_a_disk_hit_larger_than_the_whole_read_budget_is_a_miss_at_once(tiered):
    """It can never get the budget: it waited read_wait_s (1 s) for every request, then missed
    (a reviewer)."""
    import time

    s = tiered(mem=64 * KB, disk=4 << 20, pretouch=False, promote_on_hit=False, read_buffer_bytes=16 * KB)
    assert s.put(("n", b"big"), b"b" * 32 * KB) is Status.OK
    assert s.put(("n", b"small"), b"s" * 8 * KB) is Status.OK
    for i in range(8):  # push both out to disk
        assert s.put(("n", b"f%d" % i), b"f" * 8 * KB) is Status.OK
    assert s.flush() and ("n", b"big") not in s.ram.index
    t0 = time.monotonic()
    assert read(s, ("n", b"big")) is None
    assert time.monotonic() - t0 < 0.5
    assert read(s, ("n", b"small")) == b"s" * 8 * KB  # one that fits is still read
