"""Circuit breaker shared by replicas through Redis; a restarted or removed worker's
prefixes forgotten (memory and Redis state)."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
import redis.asyncio as aioredis

from router.breaker import BreakerConfig, Circuit
from router.config import StateMode, WorkerSpec
from router.proxy import APP_KEY, build_app
from router.request import parse_request
from tests.router.conftest import ADMIN, poll, serve_app, test_config, wid
from tests.router.fakeworker import FakeWorker

CONV = "a long conversation about caches " * 20


def test_circuit_opens_after_consecutive_failures_then_half_opens():
    cfg = BreakerConfig(failures=3, open_s=10)
    c = Circuit()
    for t in range(2):
        c.record(False, t, cfg)
    c.record(True, 2, cfg)  # a success resets the count
    for t in range(3):
        c.record(False, 3 + t, cfg)
    assert c.is_open(5) and c.is_open(14.9) and not c.is_open(15)
    c.record(False, 15, cfg)  # half-open: one more failure re-opens at once
    assert c.is_open(16)
    c.record(True, 26, cfg)
    assert not c.is_open(26) and c.fails == 0
    with pytest.raises(ValueError):
        BreakerConfig(failures=0)


@contextlib.asynccontextmanager
async def fleet(n_replicas=1, state=StateMode.MEMORY, redis_url="", ns="f", **cfg):
    bad, good = FakeWorker("bad"), FakeWorker("good")
    async with contextlib.AsyncExitStack() as st:
        burl = await st.enter_async_context(serve_app(bad.app()))
        gurl = await st.enter_async_context(serve_app(good.app()))
        conf = test_config(state=state, redis_url=redis_url or "redis://127.0.0.1:1/0", namespace=ns, **cfg)
        # "good" is slow on paper, so "bad" is every replica's first choice while its circuit is closed
        apps = [build_app(conf, [WorkerSpec(burl), WorkerSpec(gurl, speed=1e-6)]) for _ in range(n_replicas)]
        urls = [await st.enter_async_context(serve_app(a)) for a in apps]
        s = await st.enter_async_context(aiohttp.ClientSession())
        yield urls, s, (burl, bad), (gurl, good), [a[APP_KEY] for a in apps]


def test_breaker_is_shared_by_replicas_through_redis(redis_proc):
    async def main():
        async with fleet(2, StateMode.REDIS, redis_proc.url, breaker=BreakerConfig(failures=3, open_s=1.0)) as (
                urls, s, (burl, bad), (gurl, _good), routers):
            bad.fail_status = 500
            for i in range(3):  # three 5xx through replica 0 open the circuit...
                async with s.post(urls[0] + "/v1/completions", json={"prompt": f"q{i}"}) as r:
                    assert r.status == 500 and r.headers["X-Gcache-Worker"] == wid(burl)

            async def open_on_replica_1():
                return {w.name: w.circuit_open for w in await routers[1].state.snapshot(())}[burl]
            await poll(open_on_replica_1, what="replica 1 sees the circuit replica 0 opened")
            for i in range(3):  # ...and replica 1, which saw none of them, keeps away too
                async with s.post(urls[1] + "/v1/completions", json={"prompt": f"r{i}"}) as r:
                    assert r.status == 200 and r.headers["X-Gcache-Worker"] == wid(gurl)
            bad.fail_status = 0

            async def back():  # half-open after open_s: the next request tries it, a success closes it
                async with s.post(urls[1] + "/v1/completions", json={"prompt": "probe"}) as r:
                    return r.status == 200 and r.headers["X-Gcache-Worker"] == wid(burl)
            await poll(back, timeout=10, interval=0.2, what="circuit half-open and closed again")
            rc = aioredis.Redis.from_url(redis_proc.url)
            try:
                await poll(lambda: _is(rc.hgetall("f:cb"), {}), what="the closed circuit cleared in Redis")
            finally:
                await rc.aclose()
    asyncio.run(main())


def test_breaker_counts_timeouts_in_memory_mode():
    async def main():
        async with fleet(breaker=BreakerConfig(failures=2, open_s=30), upstream_first_byte_timeout_s=0.2) as (
                urls, s, (burl, bad), (gurl, _good), routers):
            for i in range(2):
                async with s.post(urls[0] + "/v1/completions", json={"prompt": f"q{i}", "hold": True}) as r:
                    assert r.status == 504 and r.headers.get("X-Gcache-Worker") is None
            async with s.post(urls[0] + "/v1/completions", json={"prompt": "next"}) as r:
                assert r.status == 200 and r.headers["X-Gcache-Worker"] == wid(gurl)
            snap = {w.name: w for w in await routers[0].state.snapshot(())}
            assert snap[burl].circuit_open and not snap[gurl].circuit_open
            bad.gate.set()
    asyncio.run(main())


def test_half_open_circuit_lets_one_probe_through_at_a_time():
    async def main():
        async with fleet(breaker=BreakerConfig(failures=2, open_s=0.3), retries=0) as (
                urls, s, (burl, bad), (gurl, good), routers):
            bad.fail_status = 500
            for i in range(2):
                async with s.post(urls[0] + "/v1/completions", json={"prompt": f"q{i}"}) as r:
                    assert r.status == 500
            state = routers[0].state
            await poll(lambda: not state.circuit_open(burl, state.clock()), what="the circuit half-open")
            bad.fail_status = 0

            async def one(i):
                async with s.post(urls[0] + "/v1/completions", json={"prompt": f"p{i}", "hold": True}) as r:
                    return r.status, r.headers["X-Gcache-Worker"]
            reqs = [asyncio.ensure_future(one(i)) for i in range(4)]
            try:
                await poll(lambda: bad.active + good.active == 4, what="all four requests at a worker")
                assert bad.active == 1  # the probe; the others went to the slow-on-paper worker
                assert state.circuit_open(burl, state.clock())  # while the probe is in flight
            finally:
                bad.gate.set()
                good.gate.set()
            got = await asyncio.gather(*reqs)
            assert sorted(w for _, w in got) == sorted([wid(burl)] + [wid(gurl)] * 3)
            assert all(st == 200 for st, _ in got)
            assert not state.circuit_open(burl, state.clock()) and state.circuits[burl].fails == 0
    asyncio.run(main())


def test_half_open_probe_failure_reopens_and_a_dropped_probe_frees_the_token():
    cfg = BreakerConfig(failures=1, open_s=10)
    c = Circuit()
    c.record(False, 0, cfg)
    a, b = object(), object()
    assert not c.take_probe(5, a)  # open
    assert c.take_probe(10, a) and not c.take_probe(10, b)  # half-open: one probe
    c.drop_probe(b)  # not b's to drop
    assert c.is_open(10)
    c.drop_probe(a)  # the probe ended with no outcome
    assert c.take_probe(11, b)
    c.record(False, 12, cfg)  # the probe failed: open again for open_s
    assert c.is_open(21.9) and not c.take_probe(21.9, a) and c.take_probe(22, a)
    c.record(True, 23, cfg)
    assert not c.is_open(23) and c.take_probe(23, b) and c.take_probe(23, a)  # closed


async def matched(router, worker):
    hashes = parse_request("/v1/completions", {"prompt": CONV}, router.cfg.prefix).hashes
    return {w.name: w.matched_blocks for w in await router.state.snapshot(hashes)}[worker]


@pytest.mark.parametrize("state", [StateMode.MEMORY, StateMode.REDIS])
def test_a_restarted_worker_loses_its_prefixes(state, request):
    redis_url = request.getfixturevalue("redis_proc").url if state is StateMode.REDIS else ""

    async def main():
        async with fleet(state=state, redis_url=redis_url) as (urls, s, (burl, bad), _good, routers):
            router = routers[0]
            async with s.post(urls[0] + "/v1/completions", json={"prompt": CONV}) as r:
                assert r.headers["X-Gcache-Worker"] == wid(burl)
            await poll(lambda: router.health.instance.get(burl) == "1", what="instance id seen")
            assert await matched(router, burl) > 5
            bad.instance_id = "2"  # the worker restarted between two health checks
            await poll(lambda: _is(matched(router, burl), 0), what="prefixes forgotten after a restart")

            async with s.post(urls[0] + "/v1/completions", json={"prompt": CONV}) as r:
                assert r.headers["X-Gcache-Worker"] == wid(burl)
            assert await matched(router, burl) > 5
            bad.healthy = False  # down, then back: assume it restarted
            await poll(lambda: _not_healthy(router, burl), what="worker marked down")
            bad.healthy = True
            await poll(lambda: _is(matched(router, burl), 0), what="prefixes forgotten after down -> up")

            async with s.post(urls[0] + "/v1/completions", json={"prompt": CONV}) as r:
                assert r.headers["X-Gcache-Worker"] == wid(burl)
            async with s.delete(urls[0] + "/admin/workers", params={"url": burl}, headers=ADMIN) as r:
                assert r.status == 200
            async with s.post(urls[0] + "/admin/workers", json={"url": burl}, headers=ADMIN) as r:
                assert r.status == 201
            assert await matched(router, burl) == 0  # removed and re-added: starts empty
    asyncio.run(main())


async def _is(coro, v):
    return await coro == v


async def _not_healthy(router, name):
    return not {w.name: w.healthy for w in await router.state.snapshot(())}[name]
