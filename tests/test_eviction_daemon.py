"""Eviction policy through a real daemon: a long scan of new pages, with a small hot set read
between stretches of it, does not flush the hot set (``gcache daemon --eviction slru|reuse``), while
plain LRU loses it. The replay is the hit-rate bench's (every page read back is byte-checked)."""

import pytest

from gcache.bench.hitrate import GcachePages, replay
from gcache.bench.trace import scan_trace, trace_max

PAGES = 60  # the daemon's arena holds this many 4 KiB pages
PAGE = 4096


@pytest.mark.parametrize("policy", ["lru", "reuse", "slru"])
def test_scan_does_not_flush_the_hot_set(make_cluster, policy):
    trace = scan_trace(capacity_blocks=PAGES)  # hot chain of 8; 600 scanned pages; hot every 120
    c = make_cluster(nodes=1, mem=str(PAGES * PAGE), extra_args=["--eviction", policy])
    cache = GcachePages(c.addresses)
    try:
        share = replay(trace, cache, PAGE).hit_tokens / trace_max(trace).hit_tokens
        stats = cache.client.stats()
    finally:
        cache.close()
    node = next(iter(stats.values()))
    assert node["evictions"] >= 500  # the scan went through the arena many times over
    if policy != "lru":
        assert share == 1.0  # every hot request after the first was served whole
    else:
        assert share < 0.3  # LRU kept it only across the warm-up repeats
