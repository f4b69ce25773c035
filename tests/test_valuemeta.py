"""The value-metadata record (pool, chain position, tail mark, TTL, format tag) survives every
hop: client -> wire -> RAM -> NVMe -> promotion -> restart -> handover, the GPU staging path,
and pools beyond the number the daemon tracks as groups."""

import time

import pytest

from gcache import Client, LocalPath, Status
from gcache.cluster import LocalCluster
from gcache.meta.master_client import MasterClient
from gcache.tier.nvme import NvmeTier
from gcache.tier.store import Store
from gcache.tier.valuemeta import ValueMeta, parse_value_meta
from tests.conftest import poll

KB = 1024
NS = "ns"



def meta_of(store, key):
    hit = store.acquire(key)
    if hit is None:
        return None
    try:
        return hit.meta
    finally:
        store.release(hit)


def same(m, pool, pos, tail, fmt, ttl_max):
    """``m`` carries these fields and a TTL that is counting down from at most ``ttl_max``."""
    return (m is not None and (m.pool, m.pos, m.tail, m.fmt) == (pool, pos, tail, fmt)
            and 0 < m.ttl_s <= ttl_max)


# -- pure -------------------------------------------------------------------------------------
def test_disk_encoding_round_trips_and_rejects_garbage():
    for m in (ValueMeta(), ValueMeta("kv", 7, 1, 0.0, 0xDEADBEEF), ValueMeta(None, 3, 0, 0.0, 0)):
        assert ValueMeta.decode(m.encode()) == m
    assert ValueMeta().encode() == b""
    with pytest.raises(ValueError):
        ValueMeta.decode(b"\x01\x02")
    with pytest.raises(ValueError):
        ValueMeta.decode(ValueMeta("kv", 1).encode() + b"x")


def test_wire_fields_per_key_or_for_all():
    ms = parse_value_meta({"pool": "kv", "pos": [1, 2], "tail": [0, 1], "ttl": [5, 0.5], "fmt": 9}, 2, "PUT")
    assert ms == [ValueMeta("kv", 1, 0, 5.0, 9), ValueMeta("kv", 2, 1, 0.5, 9)]
    assert parse_value_meta({"ttl": 3}, 2, "PUT") == [ValueMeta(ttl_s=3.0)] * 2
    for bad in ({"ttl": -1}, {"ttl": [1]}, {"fmt": 1 << 32}, {"fmt": [1, "x"]}, {"ttl": "1"}):
        assert isinstance(parse_value_meta(bad, 2, "PUT"), str)


# -- in-process store ---------------------------------------------------------------------------


def test_a_pooled_value_keeps_its_record_through_disk_promotion_and_restart(tiered):
    s = tiered()
    k = (NS, b"page")
    assert s.put(k, b"p" * 10 * KB, ttl_s=300, pool="kv", pos=5, tail=1, fmt=42) is Status.OK
    assert same(meta_of(s, k), "kv", 5, 1, 42, 300)
    for i in range(8):
        assert s.put((NS, b"f%d" % i), b"f" * 10 * KB) is Status.OK  # untagged pressure: not the pool's
    for i in range(8):
        # the pool's own pressure: restore points too (a put evicts only what it needs, and a pool
        # evicts its interior pages before any restore point)
        assert s.put((NS, b"g%d" % i), b"g" * 10 * KB, pool="kv", tail=1) is Status.OK
    assert s.flush() and k not in s.ram.index and s.nvme.contains(k)  # demoted
    assert same(s.nvme.index[k].value_meta(time.time()), "kv", 5, 1, 42, 300)
    assert same(meta_of(s, k), "kv", 5, 1, 42, 300)  # read from disk (promoted, or not if no room yet)
    assert poll(lambda: s.flush() and same(meta_of(s, k), "kv", 5, 1, 42, 300) and k in s.ram.index, 5)
    e = s.ram.index[k]
    assert e.group is s.ram.groups[(NS, "kv")] and (e.pos, e.tail, e.fmt) == (5, 1, 42)  # back in its pool
    s.close()
    s2 = tiered()  # restart: the record comes back from the segment
    assert same(meta_of(s2, k), "kv", 5, 1, 42, 300)


def test_the_record_is_kept_beyond_the_tracked_pools(tiered, monkeypatch):
    monkeypatch.setattr(Store, "MAX_GROUPS", 2)
    s = tiered()
    for i in range(4):
        assert s.put((NS, b"k%d" % i), b"v" * 100, pool=f"p{i}", pos=i, tail=1, fmt=i + 1) is Status.OK
    assert len(s.ram.groups) == 2
    for i in range(4):
        m = meta_of(s, (NS, b"k%d" % i))
        assert (m.pool, m.pos, m.tail, m.fmt) == (f"p{i}", i, 1, i + 1)


def test_expired_values_do_not_come_back_from_disk(tmp_path):
    t = NvmeTier(str(tmp_path / "d"), 1 << 20)
    assert t.append((NS, b"k"), memoryview(b"v"), time.time() + 0.05, meta=ValueMeta("kv", 1))
    t.close()
    assert poll(lambda: time.time() > t.index[(NS, b"k")].expires, 5)
    t2 = NvmeTier(str(tmp_path / "d"), 1 << 20)
    assert not t2.contains((NS, b"k"))
    t2.close()


# -- over the wire ------------------------------------------------------------------------------
@pytest.mark.parametrize("local", [LocalPath.OFF, LocalPath.FORCE])
def test_the_record_crosses_the_wire_and_the_disk_of_a_daemon(make_cluster, local):
    c = make_cluster(nodes=1, mem="2MiB", disk="64MiB")
    keys = [f"k{i}" for i in range(8)]
    with Client(c.addresses, local=local) as cl:
        st = cl.put(keys, [bytes([i]) * 4 * KB for i in range(8)], pool="kv", pos=list(range(8)),
                    tail=[i % 2 for i in range(8)], ttl_s=[600.0 + i for i in range(8)], fmt=[100 + i for i in range(8)])
        assert st == [Status.OK] * 8
        res = cl.get_into(keys, [bytearray(4 * KB) for _ in keys], with_meta=True)
        assert all(same(res.meta[i], "kv", i, i % 2, 100 + i, 600 + i) for i in range(8))
        for j in range(0, 800, 100):  # 3.2 MiB more of the pool through a 2 MiB arena: the pages go to disk
            cl.put([f"fill{j + i}" for i in range(100)], [b"x" * 32 * KB] * 100, pool="kv")
        def stats():
            return next(iter(cl.stats().values()))

        poll(lambda: stats().get("disk_keys", 0) >= 8 and stats()["demote_queue_bytes"] == 0, 10)
        res = cl.get_into(keys, [bytearray(4 * KB) for _ in keys], with_meta=True)
        assert stats()["hits_nvme"] >= 1
        assert all(same(res.meta[i], "kv", i, i % 2, 100 + i, 600 + i) for i in range(8) if res.meta[i])
        assert sum(m is not None for m in res.meta) >= 6


def test_the_gpu_staging_path_carries_the_record(make_cluster, monkeypatch):
    torch = pytest.importorskip("torch", reason="the staging pool needs the torch extra")
    import gcache.client.client as client_mod

    monkeypatch.setattr(client_mod, "is_device_tensor", lambda v: isinstance(v, torch.Tensor))  # CPU stands in
    c = make_cluster(nodes=2, mem="16MiB")
    keys = [f"t{i}" for i in range(6)]
    with Client(c.addresses) as cl:
        st = cl.put(keys, [torch.full((1024,), i, dtype=torch.int32) for i in range(6)], pool="swa",
                    pos=[10 + i for i in range(6)], tail=[1, 0, 1, 0, 1, 0], ttl_s=900, fmt=7)
        assert st == [Status.OK] * 6
        res = cl.get_into(keys, [bytearray(4 * KB) for _ in keys], with_meta=True)
        assert all(same(res.meta[i], "swa", 10 + i, (i + 1) % 2, 7, 900) for i in range(6))


def test_a_handover_gives_the_new_owner_the_record(tmp_path):
    c = LocalCluster(nodes=1, mem="64MiB", masters=1, root=str(tmp_path / "c")).start()
    try:
        keys = [f"h{i}" for i in range(300)]
        with Client(c.master_url, token=c.token, timeout_s=5.0) as cl:
            assert cl.put(keys, [b"v%d" % i for i in range(300)], pool="kv", pos=list(range(300)),
                          tail=[i % 2 for i in range(300)], ttl_s=[1000.0 + i for i in range(300)],
                          fmt=[i for i in range(300)]) == [Status.OK] * 300
            new = c.add_node()
            mc = MasterClient(c.master_url, c.token, timeout_s=1.0)
            assert poll(lambda: (m := mc.membership())["transition"] is None and any(
                r["id"] == new.node_id and r["state"] == "up" for r in m["nodes"]), 30)
            cl.refresh_membership()
            moved = [i for i, o in enumerate(cl.owners(keys)) if o == new.node_id]
            assert len(moved) > 50
            assert poll(lambda: cl.stats()[new.node_id].get("ram_keys", 0) >= len(moved), 10)
            res = cl.get_into([keys[i] for i in moved], [bytearray(16) for _ in moved], with_meta=True)
            assert res.status == [Status.OK] * len(moved)
            for i, m in zip(moved, res.meta):
                assert same(m, "kv", i, i % 2, i, 1000 + i), (i, m)
            assert cl.stats()[new.node_id]["pool_keys:default:kv"] == len(moved)  # in its pool there too
    finally:
        c.stop()
