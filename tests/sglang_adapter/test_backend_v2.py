"""v2 (hybrid KV + SWA pools) through the real HybridCacheController backup and prefetch code.

The controller's constructor needs a GPU (streams, device pools), so the test builds the
controller object without it and runs its real storage methods: ``_page_backup`` (KV through
batch_set_v1, SWA through batch_set_v2 with TRAILING_PAGES), ``_storage_hit_query``
(batch_exists_v2 and restorable_prefix_pages) and ``_page_transfer`` (KV batch_get_v1, SWA
batch_get_v2 after ``_sync_trailing_keys``), on real host pools grouped by a real HostPoolGroup.
"""

from __future__ import annotations

import ctypes
from queue import Queue
from types import SimpleNamespace

import pytest

from tests.sglang_adapter.conftest import fill_random, make_storage, mha_host_pool

pytestmark = pytest.mark.usefixtures("sgl")
PAGE, WINDOW_PAGES = 4, 2


def _pages(pool, idx):
    ptrs, sizes = pool.get_page_buffer_meta(idx)
    return [ctypes.string_at(p, n) for p, n in zip(ptrs, sizes)]


def _controller(nodes, seed, extra=None, generic=False):
    """A hybrid controller over its own KV and SWA host pools; ``generic``: on SGLang's generic
    page path (no interface_v1: KV pages move as flat page tensors through batch_get/batch_set,
    side pools still through batch_get_v2/batch_set_v2), as attach_storage_backend sets it up."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry

    kv = mha_host_pool("page_first", layers=2, tokens=128, page=PAGE)
    swa = mha_host_pool("page_first", layers=3, tokens=128, page=PAGE)
    fill_random(kv, seed)
    fill_random(swa, seed + 100)
    group = HostPoolGroup([PoolEntry(PoolName.KV, kv, None, lambda i: i, is_primary_index_anchor=True),
                           PoolEntry(PoolName.SWA, swa, None, lambda i: i)])
    storage = make_storage(nodes, extra={"hicache_storage_pass_prefix_keys": True,
                                         **({"interface_v1": 0} if generic else {}), **(extra or {})})
    storage.register_mem_pool_host(group)  # what attach_storage_backend does
    for entry in group.entries:
        storage.register_mem_host_pool_v2(entry.host_pool, entry.name)
    storage.on_host_pools_registered()
    ctl = object.__new__(HybridCacheController)
    ctl.__dict__.update(storage_backend=storage, page_size=PAGE, storage_config=storage.storage_config,
                        mem_pool_host=group,
                        storage_host_pool=kv, prefetch_sync_queue=Queue(), storage_backend_type="dynamic",
                        extra_host_mem_release_queues={})
    ctl.page_set_func, ctl.page_get_func = ((ctl._generic_page_set, ctl._generic_page_get) if generic
                                            else (ctl._page_set_zero_copy, ctl._page_get_zero_copy))
    return SimpleNamespace(ctl=ctl, kv=kv, swa=swa, storage=storage, torch=torch)


def _backup(h, tokens, prefix_keys, kv_idx, swa_idx):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import StorageOperation
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    last = prefix_keys[-1] if prefix_keys else None
    hashes = get_storage_hash_str(tokens, last, page_size=PAGE)
    op = StorageOperation(kv_idx, tokens, last_hash=last, hash_value=hashes, prefix_keys=list(prefix_keys),
                          pool_transfers=[PoolTransfer(name=PoolName.SWA, host_indices=swa_idx,
                                                       keys=hashes[-WINDOW_PAGES:],
                                                       hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    h.ctl._page_backup(op)
    assert op.completed_tokens == len(tokens)
    assert op.pool_storage_result.extra_pool_hit_pages == {PoolName.SWA: WINDOW_PAGES}
    return hashes


def _prefetch(h, tokens, kv_idx, swa_idx):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation

    op = PrefetchOperation(SimpleNamespace(rid="r"), tokens, prefix_keys=[],
                           pool_transfers=[PoolTransfer(name=PoolName.SWA, host_indices=swa_idx,
                                                        keys=["?"] * WINDOW_PAGES,
                                                        hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    hashes, hit_tokens = h.ctl._storage_hit_query(op)
    op.hash_value = hashes
    op.host_indices = kv_idx[:hit_tokens]
    if hit_tokens:
        h.ctl._page_transfer(op)
    acks = [h.ctl.prefetch_sync_queue.get_nowait() for _ in range(h.ctl.prefetch_sync_queue.qsize())]
    return op, hit_tokens, acks


def test_backup_then_prefetch_restores_kv_and_the_swa_window(make_cluster):
    cluster = make_cluster(nodes=2, mem="32MiB", extra_args=["--pool-budget", "kv=60%", "--pool-budget",
                                                             "swa=20%", "--no-pretouch"])
    torch_ = __import__("torch")
    w = _controller(cluster.addresses, seed=1)
    tokens = list(range(1000, 1000 + 6 * PAGE))  # 6 pages: SWA keeps the last 2
    kv_idx, swa_idx = torch_.arange(0, 6 * PAGE), torch_.arange(40, 40 + WINDOW_PAGES * PAGE)
    first = _backup(w, tokens[:3 * PAGE], [], kv_idx[:3 * PAGE], torch_.arange(16, 16 + WINDOW_PAGES * PAGE))
    _backup(w, tokens[3 * PAGE:], first, kv_idx[3 * PAGE:], swa_idx)  # extends the chain
    stats = w.storage.client.stats()
    assert sum(s.get("pool_keys:sglang:swa", 0) for s in stats.values()) == 4  # two windows, not 6 pages
    assert sum(s.get("pool_keys:sglang:kv", 0) for s in stats.values()) == 6

    r = _controller(cluster.addresses, seed=7)
    dst_kv, dst_swa = torch_.arange(64, 64 + 6 * PAGE), torch_.arange(96, 96 + WINDOW_PAGES * PAGE)
    op, hit_tokens, acks = _prefetch(r, tokens, dst_kv, dst_swa)
    assert hit_tokens == 6 * PAGE and op.pool_storage_result.restorable_prefix_pages == [3, 6]
    assert acks[0].completed_tokens == 6 * PAGE  # the KV batch
    assert _pages(r.kv, dst_kv) == _pages(w.kv, kv_idx)
    assert _pages(r.swa, dst_swa) == _pages(w.swa, swa_idx)
    assert acks[-1].pool_hits == {"swa": WINDOW_PAGES}


def test_missing_swa_page_inside_the_window_shortens_the_hit(make_cluster):
    cluster = make_cluster(nodes=2, mem="32MiB", extra_args=["--no-pretouch"])
    torch_ = __import__("torch")
    w = _controller(cluster.addresses, seed=3)
    tokens = list(range(5000, 5000 + 6 * PAGE))
    first = _backup(w, tokens[:3 * PAGE], [], torch_.arange(0, 3 * PAGE), torch_.arange(16, 24))
    second = _backup(w, tokens[3 * PAGE:], first, torch_.arange(3 * PAGE, 6 * PAGE), torch_.arange(40, 48))
    w.storage.client.delete(w.storage.page_keys([second[-1]], "swa"))  # a page inside the last window
    r = _controller(cluster.addresses, seed=9)
    op, hit_tokens, _ = _prefetch(r, tokens, torch_.arange(64, 88), torch_.arange(96, 104))
    assert op.pool_storage_result.restorable_prefix_pages == [3]
    assert hit_tokens == 3 * PAGE  # falls back to the earlier restore point, never past the hole


def test_a_hybrid_deployment_on_the_generic_page_path_restores_only_what_it_can_load(make_cluster):
    """Without interface_v1 the KV pages are the generic path's flat pages: batch_exists_v2 asks
    the keys the KV get that follows reads, so such a deployment hits its own pages, and one that
    reads a zero-copy writer's pages (or the other way round) is told of no page it cannot load."""
    cluster = make_cluster(nodes=2, mem="32MiB", extra_args=["--no-pretouch"])
    torch_ = __import__("torch")
    kv_idx, swa_idx = torch_.arange(0, 6 * PAGE), torch_.arange(40, 40 + WINDOW_PAGES * PAGE)
    dst_kv, dst_swa = torch_.arange(64, 64 + 6 * PAGE), torch_.arange(96, 96 + WINDOW_PAGES * PAGE)
    generic, zero_copy = (_controller(cluster.addresses, seed=1, generic=True),
                          _controller(cluster.addresses, seed=2))
    for w, start in ((generic, 7000), (zero_copy, 8000)):
        w.tokens = list(range(start, start + 6 * PAGE))
        _backup(w, w.tokens, [], kv_idx, swa_idx)

    r = _controller(cluster.addresses, seed=7, generic=True)
    op, hit_tokens, acks = _prefetch(r, generic.tokens, dst_kv, dst_swa)
    assert hit_tokens == 6 * PAGE and op.pool_storage_result.restorable_prefix_pages == [6]
    assert acks[0].completed_tokens == 6 * PAGE
    assert _pages(r.kv, dst_kv) == _pages(generic.kv, kv_idx)
    assert _pages(r.swa, dst_swa) == _pages(generic.swa, swa_idx)

    for reader, writer in ((_controller(cluster.addresses, seed=8, generic=True), zero_copy),
                           (_controller(cluster.addresses, seed=9), generic)):
        op, hit_tokens, acks = _prefetch(reader, writer.tokens, dst_kv, dst_swa)
        assert (hit_tokens, op.pool_storage_result.restorable_prefix_pages, acks) == (0, [], [])


def test_under_swa_pressure_whole_windows_are_evicted_and_shared_prefixes_stay_restorable(make_cluster):
    """A prober: the SWA pool orders eviction by (tail, recency bucket, -position, seq), and a
    window's pages had consecutive positions, so the last page of every window went before the
    first of any: under pressure 63 of 64 windows held were half windows (restorable: 1). And a
    backup re-marked the pages before its window as interior, which broke the window of a shared
    prefix that other branches restore from. Now a window's pages share one position and no
    window is demoted: what the pool holds is whole windows."""
    torch_ = __import__("torch")
    # 4 KiB SWA budget per daemon = a few windows of 2 pages (3 layers x 4 tokens x 128 B x K/V)
    cluster = make_cluster(nodes=1, mem="32MiB", extra_args=["--pool-budget", "swa=24KiB", "--no-pretouch"])
    w = _controller(cluster.addresses, seed=5)
    chains = []
    for i in range(40):  # cold sequences, each a 3-page chain with its 2-page window
        tokens = list(range(100_000 + 1000 * i, 100_000 + 1000 * i + 3 * PAGE))
        chains.append(_backup(w, tokens, [], torch_.arange(0, 3 * PAGE), torch_.arange(16, 16 + WINDOW_PAGES * PAGE)))
    held = [sum(w.storage.client.exists(w.storage.page_keys(h[-WINDOW_PAGES:], "swa"))) for h in chains]
    assert sum(1 for n in held if 0 < n < WINDOW_PAGES) <= 1, held  # at most the one being written over
    assert sum(1 for n in held if n == WINDOW_PAGES) >= 2, held


def test_a_childs_backup_leaves_its_prefixs_window_a_restore_point(make_cluster):
    torch_ = __import__("torch")
    cluster = make_cluster(nodes=1, mem="32MiB", extra_args=["--no-pretouch"])
    w = _controller(cluster.addresses, seed=6)
    tokens = list(range(7000, 7000 + 6 * PAGE))
    first = _backup(w, tokens[:3 * PAGE], [], torch_.arange(0, 3 * PAGE), torch_.arange(16, 24))
    _backup(w, tokens[3 * PAGE:5 * PAGE], first, torch_.arange(3 * PAGE, 5 * PAGE), torch_.arange(40, 48))
    keys = w.storage.page_keys(first[-WINDOW_PAGES:], "swa")
    got = w.storage.client.get_into(keys, [bytearray(1 << 16) for _ in keys], with_meta=True)
    assert [m.tail for m in got.meta] == [1] * WINDOW_PAGES  # before: the child re-marked one interior


def test_a_very_large_existence_round_gets_more_time():
    from types import SimpleNamespace

    from sglang_adapter.backend import EXISTS_KEYS_PER_TIMEOUT, GCacheStorage

    fake = SimpleNamespace(config=SimpleNamespace(timeout_s=1.0))
    assert GCacheStorage._exists_timeout(fake, 1000) == 1.0
    assert GCacheStorage._exists_timeout(fake, 4 * EXISTS_KEYS_PER_TIMEOUT) == 4.0
