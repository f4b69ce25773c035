"""Pools in the store (gcache.tier.pools, gcache.tier.store): budget specs, pool metadata on the
wire, per-pool budgets and the prefix-aware eviction order within a pool (pure: no sockets).

The SGLang adapter stores full-attention KV and sliding-window pages in two pools (``kv``,
``swa``) with these rules; its own logic is tested in tests/sglang_adapter."""

from __future__ import annotations

import threading

import pytest

from gcache.errors import ConfigError
from gcache.protocol import Status
from gcache.tier.pools import PoolBudget, PoolBudgets, parse_pool_meta
from gcache.tier.store import Store, StoreConfig
from tests.conftest import poll, read


# -- pool budgets ---------------------------------------------------------------------------------------
def test_budget_specs():
    mem = 1000
    assert PoolBudget.parse("swa=25%", mem) == PoolBudget("swa", 250)
    assert PoolBudget.parse("org/m:kv=100", mem) == PoolBudget("kv", 100, "org/m")
    for bad in ("swa", "swa=0", "swa=150%", "s wa=1", "=5"):
        with pytest.raises(ConfigError):
            PoolBudget.parse(bad, mem)
    with pytest.raises(ConfigError):
        PoolBudgets((PoolBudget("kv", 800), PoolBudget("swa", 300)), mem)
    b = PoolBudgets((PoolBudget("swa", 200), PoolBudget("swa", 50, "ns1")), mem)
    assert b.budget(("ns1", "swa")) == 50 and b.budget(("ns2", "swa")) == 200 and b.budget(("x", "kv")) is None


def test_pool_meta_validation():
    assert parse_pool_meta({"pool": "swa", "pos": [3, 4]}, 2, "PUT") == ("swa", [3, 4], None)
    assert parse_pool_meta({}, 2, "PUT") == (None, [0, 0], None)
    assert isinstance(parse_pool_meta({"pool": "a b"}, 1, "PUT"), str)
    assert isinstance(parse_pool_meta({"pos": [1]}, 2, "PUT"), str)
    assert isinstance(parse_pool_meta({"tail": [2]}, 1, "EXISTS"), str)


# -- store: dual pools and prefix-aware eviction -----------------------------------------------------------
PAGE = 1024


def _store(budgets=("kv=50%", "swa=25%"), mem=64 * PAGE):
    cfg = StoreConfig(mem_bytes=mem, pretouch=False, recency_bucket_s=3600.0,
                      pool_budgets=tuple(PoolBudget.parse(b, mem) for b in budgets))
    return Store(cfg)


def _have(store, ns, names):
    return [n for n in names if store.exists((ns, n))]


def test_pool_pressure_never_evicts_other_pool():
    s = _store()
    swa = [f"s{i}".encode() for i in range(16)]  # 16 pages = the whole SWA budget
    for i, k in enumerate(swa):
        assert s.put(("ns", k), b"x" * PAGE, pool="swa", pos=i) is Status.OK
    for i in range(200):  # far beyond the KV budget
        assert s.put(("ns", f"k{i}".encode()), b"y" * PAGE, pool="kv", pos=i) is Status.OK
    assert len(_have(s, "ns", swa)) == 16
    st = s.stats()
    assert st["pool_bytes:ns:kv"] <= 32 * PAGE and st["pool_bytes:ns:swa"] == 16 * PAGE


def test_within_a_chain_later_pages_go_first():
    s = _store(("kv=25%",))
    chain = [f"c{i}".encode() for i in range(16)]  # exactly the budget
    for i, k in enumerate(chain):
        s.put(("ns", k), b"x" * PAGE, pool="kv", pos=i)
    for i in range(4):  # another chain pushes 4 pages out
        s.put(("ns", f"d{i}".encode()), b"x" * PAGE, pool="kv", pos=i)
    assert _have(s, "ns", chain) == chain[:12]  # the tail went, no hole in the prefix


def test_exists_refreshes_a_hot_prefix():
    s = _store(("kv=25%",))
    s.ram.recency_bucket_s = 1e-9  # every touch is a new bucket: plain recency order
    old = [f"o{i}".encode() for i in range(8)]
    for i, k in enumerate(old):
        s.put(("ns", k), b"x" * PAGE, pool="kv", pos=i)
    newer = [f"n{i}".encode() for i in range(8)]
    for i, k in enumerate(newer):
        s.put(("ns", k), b"x" * PAGE, pool="kv", pos=i)
    assert all(s.exists(("ns", k)) for k in old)  # engine asked L3 about the old prefix
    for i in range(8):
        s.put(("ns", f"z{i}".encode()), b"x" * PAGE, pool="kv", pos=i)
    assert _have(s, "ns", old) == old and _have(s, "ns", newer) == []


def test_swa_restore_points_outlive_interior_windows():
    s = _store(("swa=25%",))
    tails = [f"t{i}".encode() for i in range(4)]
    for i, k in enumerate(tails):
        s.put(("ns", k), b"x" * PAGE, pool="swa", pos=i, tail=1)
    interior = [f"i{i}".encode() for i in range(12)]
    for i, k in enumerate(interior):
        s.put(("ns", k), b"x" * PAGE, pool="swa", pos=i)
    for i in range(4):
        s.put(("ns", f"u{i}".encode()), b"x" * PAGE, pool="swa", pos=i)
    assert _have(s, "ns", tails) == tails  # the old restore point survived newer interior pages
    assert len(_have(s, "ns", interior)) == 8
    s.exists(("ns", tails[0]), tail=0)  # demoted to an interior page
    for i in range(13):  # as many as there are interior pages now
        s.put(("ns", f"v{i}".encode()), b"x" * PAGE, pool="swa", pos=0)
    assert _have(s, "ns", tails) == tails[1:]


def test_untagged_values_keep_plain_lru():
    s = _store(budgets=(), mem=16 * PAGE)
    for i in range(20):
        assert s.put(("ns", f"k{i}".encode()), b"x" * PAGE) is Status.OK
    assert _have(s, "ns", [f"k{i}".encode() for i in range(20)])[0] == b"k4"


def _tail(store, key):
    hit = store.acquire(key)
    assert hit is not None, key
    try:
        return hit.meta.tail
    finally:
        store.release(hit)


def _push_out(store, tag, n=20):
    """Fill the pool with newer restore-point pages (evicted last within it) until the older
    pages are out, and wait for the demoter."""
    for i in range(n):
        assert store.put(("ns", b"%s%d" % (tag, i)), b"f" * 4 * PAGE, pool="swa", tail=1) is Status.OK
    assert store.flush()


def test_a_tail_re_mark_holds_through_the_disk_tier(tiered):
    """exists(tail=) re-marks a restore point's page wherever its value is (before: a value
    promoted from disk kept its disk record with the old mark, and came back with it once
    evicted again; a value only on disk was not re-marked at all). The mark orders a pool's
    eviction, so a lost re-mark left a superseded window page protected and a restore point not."""
    s = tiered(mem=16 * 4 * PAGE)
    key = ("ns", b"page")
    assert s.put(key, b"v" * 4 * PAGE, pool="swa", pos=3, tail=1) is Status.OK
    _push_out(s, b"a")
    assert key not in s.ram.index and s.nvme.index[key].meta.tail == 1  # on disk only
    # a disk-only value is promoted to be re-marked when there is room (puts into a full arena
    # evict only what they need, so the arena is full here: make room)
    assert s.delete(("ns", b"a19"))
    assert s.exists(key, tail=0)  # re-marked while only on disk: promoted and re-marked
    assert key in s.ram.index and _tail(s, key) == 0
    _push_out(s, b"b")
    assert key not in s.ram.index
    assert s.delete(("ns", b"b19"))
    assert _tail(s, key) == 0  # promoted again: its disk record has the new mark
    assert s.exists(key, tail=1)  # re-marked in RAM while a copy is on disk
    _push_out(s, b"c")
    assert key not in s.ram.index and _tail(s, key) == 1
    assert read(s, key) == b"v" * 4 * PAGE


def test_a_tail_re_mark_of_a_value_waiting_for_the_disk_is_written_with_it(tiered):
    s = tiered(mem=16 * 4 * PAGE)
    key, first = ("ns", b"page"), ("ns", b"first")
    for k in (first, key):
        assert s.put(k, b"v" * 4 * PAGE, pool="swa", pos=3, tail=1) is Status.OK
    gate, write = threading.Event(), s.nvme.write
    s.nvme.write = lambda p, v: gate.wait(10) and write(p, v)  # the demoter busy with ``first``
    try:
        with s._lock:
            s._evict(first, s.ram.index[first])
        assert poll(lambda: bool(s._writing), 5)
        with s._lock:
            s._evict(key, s.ram.index[key])  # queued behind it
        assert s.exists(key, tail=0)
    finally:
        gate.set()
    assert s.flush()
    assert s.nvme.index[key].meta.tail == 0 and _tail(s, key) == 0


def test_groups_of_emptied_pools_do_not_switch_off_budgets_and_stats_stay_small():
    """A probe: one value written and deleted in each of 4,096 (namespace, pool) pairs filled the
    store's group table for good; every pool after that, the budgeted ones included, went
    untracked (its budget silently off), and STATS listed 8,000 empty pool fields."""
    s = _store(("kv=25%",), mem=64 * PAGE)
    try:
        for i in range(s.MAX_GROUPS):
            k = ("junk", b"k%d" % i)
            assert s.put(k, b"x", pool=f"p{i}") is Status.OK
            assert s.delete(k)
        for i in range(64):  # 64 pages into a pool whose budget is 16 of them
            assert s.put(("prod", b"k%d" % i), b"x" * PAGE, pool="kv", pos=i) is Status.OK
        stats = s.stats()
        assert stats["pool_budget:prod:kv"] == 16 * PAGE
        assert stats["pool_bytes:prod:kv"] <= 16 * PAGE
        assert not any(k.startswith("pool_") and ":junk:" in k for k in stats)
        # an unbudgeted pool still gets a group once empty ones are dropped
        assert s.put(("other", b"x"), b"y", pool="fresh") is Status.OK
        assert s.ram.groups[("other", "fresh")].entries
    finally:
        s.close()
