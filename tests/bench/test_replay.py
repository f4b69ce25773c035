"""The hit-rate replay's accounting against in-memory caches whose answers are known exactly."""

from collections import OrderedDict

import numpy as np
import pytest

from gcache.bench.hitrate import PageCache, WrongBytes, replay
from gcache.bench.trace import TraceRequest, trace_max


class DictPages(PageCache):
    """An LRU page cache of ``capacity`` pages (None = infinite), holding copies of the bytes."""

    def __init__(self, capacity=None):
        self.pages, self.capacity, self.calls = OrderedDict(), capacity, []

    def exists(self, keys):
        self.calls.append(("exists", list(keys)))
        return [k in self.pages for k in keys]

    def get_into(self, keys, bufs):
        self.calls.append(("get", list(keys)))
        out = []
        for k, b in zip(keys, bufs):
            v = self.pages.get(k)
            if v is not None:
                self.pages.move_to_end(k)
                b[:] = v
            out.append(v is not None)
        return out

    def put(self, keys, values):
        self.calls.append(("put", list(keys)))
        for k, v in zip(keys, values):
            self.pages[k] = np.array(v)
            self.pages.move_to_end(k)
            while self.capacity is not None and len(self.pages) > self.capacity:
                self.pages.popitem(last=False)
        return [True] * len(keys)


REQS = [
    TraceRequest(0, 1536, 0, (0, 1, 2)),
    TraceRequest(10, 1024, 0, (0, 1)),
    TraceRequest(20, 2048, 0, (0, 1, 2, 3)),
    TraceRequest(30, 700, 0, (0, 5)),
    TraceRequest(40, 1536, 0, (0, 5, 6)),
]


def test_infinite_cache_reaches_exactly_the_trace_maximum():
    acc = replay(REQS, DictPages(), page_bytes=64)
    best = trace_max(REQS)
    assert (acc.hit_tokens, acc.input_tokens) == (best.hit_tokens, best.input_tokens)
    assert acc.hit_tokens == 1024 + 1536 + 512 + 1024


def test_replay_reads_hits_and_writes_only_misses():
    cache = DictPages()
    replay(REQS[:3], cache, page_bytes=16)
    assert cache.calls == [
        ("exists", ["0", "1", "2"]), ("put", ["0", "1", "2"]),
        ("exists", ["0", "1"]), ("get", ["0", "1"]),
        ("exists", ["0", "1", "2", "3"]), ("get", ["0", "1", "2"]), ("put", ["3"]),
    ]


def test_small_lru_cache_loses_hits():
    acc = replay(REQS, DictPages(capacity=2), page_bytes=16)
    # r0 leaves {1,2}; r1 misses 0 (so 1 is useless), leaves {0,1}; r2 hits 0,1 (1024), leaves {2,3};
    # r3 misses, leaves {0,5}; r4 hits 0,5 (1024), leaves {5,6}
    assert acc.hit_tokens == 1024 + 1024 < trace_max(REQS).hit_tokens


def test_page_evicted_between_exists_and_get_shortens_the_prefix():
    class Forgetful(DictPages):
        def get_into(self, keys, bufs):
            self.pages.pop("1", None)  # gone after exists said yes
            return super().get_into(keys, bufs)

    acc = replay(REQS[:2], Forgetful(), page_bytes=16)
    assert acc.hit_tokens == 512


def test_a_cache_that_returns_another_pages_bytes_is_caught():
    class Liar(DictPages):
        def get_into(self, keys, bufs):
            return super().get_into(list(reversed(keys)), bufs)

    with pytest.raises(WrongBytes, match="came back holding block"):
        replay(REQS[:2], Liar(), page_bytes=16)


def test_the_daemon_replay_places_pages_as_the_simulator_does():
    """The daemon replay's client placed keys by the daemons' addresses (new ports every run), the
    simulator by node ids: at small capacities placement alone moved a point by several points
    between the two columns of one run (a prober). Both place by the node ids now."""
    from gcache.bench.hitrate import GcachePages
    from gcache.meta.ring import HashRing, key_hash

    ids = [f"node{i}" for i in range(3)]
    pages = GcachePages([f"127.0.0.1:{7000 + i}" for i in range(3)], node_ids=ids)  # connects lazily
    try:
        blocks = list(range(3000))
        ring = HashRing({n: 1.0 for n in ids})
        hashes = np.array([key_hash("hitrate", str(h).encode()) for h in blocks], dtype=np.uint64)
        assert pages.client.owners([str(h) for h in blocks]) == [ids[i] for i in ring.owner_indices(hashes).tolist()]
    finally:
        pages.close()


def test_simulated_capacity_is_the_daemons_arena_floors_included():
    """The daemon run floors a node's RAM at 64 KiB and the simulator did not (separate 0.02 and
    0.021 rows); the references had no disk floor (one beat the optimum)."""
    from gcache.bench.hitrate import ReplayConfig, TraceInfo, node_bytes, sim_blocks
    from gcache.tier.eviction import EvictionKind

    info = TraceInfo(requests=[], ws_blocks=1000, slot_bytes=4096, page_bytes=4096, max_rate=0.0)
    cfg = ReplayConfig(capacity_fraction=0.02, nvme=True, disk_fraction=0.01, policy=EvictionKind.LRU)
    ram, disk = node_bytes(info, cfg, 3)
    assert ram == 64 << 10 and disk == 1 << 20  # both floors apply at this size
    ram_blocks, disk_blocks, _ = sim_blocks(info, cfg, 3)
    assert ram_blocks == 3 * 16 and disk_blocks > 3 * 200
