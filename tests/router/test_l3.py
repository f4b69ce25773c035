"""gcache L3 awareness against a real local gcache cluster: SGLang's page keys, one batched
exists per request, and the answer used in the prefill estimate and the queue priority."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gcache.client import Client
from gcache.cluster import LocalCluster
from router.config import PrefixConfig, WorkerSpec
from router.l3 import L3Config, L3Probe, sglang_page_hashes
from router.policies import Candidate, RouteInput, make_policy
from router.proxy import APP_KEY, build_app
from tests.router.conftest import serve_app, test_config
from tests.router.fakeworker import FakeWorker

P = 16
SHARD = "Test-Model_tp0of1"


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(nodes=2, mem="32MiB").start()
    try:
        yield c
    finally:
        c.stop()


def store_pages(cluster, ids, n_pages):
    """What the engines' HiCache backend writes for the first ``n_pages`` pages of ``ids``."""
    keys = [f"{h}.kv@{SHARD}".encode() for h in sglang_page_hashes(ids, P)[:n_pages]]
    with Client(cluster.addresses, namespace="sglang") as c:
        assert all(s.name == "OK" for s in c.put(keys, [b"page"] * len(keys)))


def test_page_keys_are_sglangs_storage_chain():
    ids = list(range(1, 50))
    h = sglang_page_hashes(ids, P)
    assert len(h) == 3 and all(len(x) == 64 for x in h)
    assert sglang_page_hashes(ids[:32] + [7] * 17, P)[:2] == h[:2]  # chained: a shared prefix, shared keys
    assert sglang_page_hashes(ids[:16] + [2**40] + ids[17:], P)[1] != h[1]  # wide tokens hash differently
    try:
        from sglang.srt.mem_cache.utils import get_hash_str
    except ImportError:
        pytest.skip("sglang is not installed: cannot compare with its own hash")
    assert h == get_hash_str(ids, None, page_size=P)[:3]


def test_one_batched_exists_answers_the_leading_pages(cluster):
    async def main():
        ids = list(range(100, 100 + 10 * P))
        store_pages(cluster, ids, 6)
        probe = L3Probe(L3Config(tuple(cluster.addresses), SHARD, timeout_s=1.0), P)
        try:
            assert await probe.loadable_tokens(ids) == 6 * P
            assert await probe.loadable_tokens(list(range(5000, 5000 + 4 * P))) == 0
            assert await probe.loadable_tokens(None) == 0 and probe.queries == 2
        finally:
            probe.close()
        dead = L3Probe(L3Config(("127.0.0.1:9",), SHARD, timeout_s=0.2), P)
        try:
            assert await dead.loadable_tokens(ids) == 0  # an unreachable tier is a miss
        finally:
            dead.close()
    asyncio.run(main())


def test_l3_tokens_lower_the_prefill_estimate():
    p = make_policy("min_ttft")
    a = Candidate("a", 30, 2, 400, 4_000, 0, 1.0, 60_000)  # holds most of it on GPU, 400 ms of queue
    b = Candidate("b", 0, 0, 0, 20_000, 0, 1.0)  # idle, holds none of it
    assert p.choose(RouteInput(40, 20_000), [a, b]).worker == "a"
    b_l3 = Candidate("b", 0, 0, 0, 20_000, 16_000, 1.0)  # the same prefix is loadable from L3
    assert p.choose(RouteInput(40, 20_000), [a, b_l3]).worker == "b"


def test_router_asks_l3_once_per_request_and_counts_it_as_cached(cluster):
    async def main():
        ids = list(range(1000, 1000 + 12 * P))
        store_pages(cluster, ids, 8)
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl:
            cfg = test_config(prefix=PrefixConfig(block_tokens=4 * P, page_tokens=P),
                              l3=L3Config(tuple(cluster.addresses), SHARD, timeout_s=1.0))
            app = build_app(cfg, [WorkerSpec(wurl)])
            async with serve_app(app) as url, aiohttp.ClientSession() as s:
                router = app[APP_KEY]
                async with s.post(url + "/generate", json={"input_ids": ids}) as r:
                    assert r.status == 200
                assert router.l3.queries == 1
                metrics = await (await s.get(url + "/metrics")).text()
                cached = next(float(line.split()[-1]) for line in metrics.splitlines()
                              if line.startswith("gcache_router_estimated_cached_tokens_total"))
                assert cached == 8 * P  # nothing on the worker yet, 8 pages loadable from L3
    asyncio.run(main())
