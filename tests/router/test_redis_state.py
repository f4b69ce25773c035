"""Stateless replicas sharing a real redis-server: agreement, counters, outage and resync."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import aiohttp
import redis.asyncio as aioredis

from router.config import StateMode, WorkerSpec
from router.proxy import APP_KEY, build_app
from tests.router.conftest import poll, serve_app, test_config, url_of
from tests.router.fakeworker import FakeWorker


@contextlib.asynccontextmanager
async def replicas(redis_url, n_workers=3, n_replicas=2, max_inflight=64, ns="t", **cfg_kw):
    fakes = [FakeWorker(f"w{i}") for i in range(n_workers)]
    async with contextlib.AsyncExitStack() as st:
        urls = [await st.enter_async_context(serve_app(f.app())) for f in fakes]
        cfg = test_config(state=StateMode.REDIS, redis_url=redis_url, namespace=ns, policy="min_ttft", **cfg_kw)
        apps = [build_app(cfg, [WorkerSpec(u, max_inflight=max_inflight) for u in urls]) for _ in range(n_replicas)]
        rurls = [await st.enter_async_context(serve_app(a)) for a in apps]
        s = await st.enter_async_context(aiohttp.ClientSession())
        yield rurls, s, dict(zip(urls, fakes, strict=True)), [a[APP_KEY] for a in apps]


def conv_hashes(router, i):
    from router.request import parse_request
    return parse_request("/v1/completions", {"prompt": conv(i)}, router.cfg.prefix).hashes


def conv(i):
    return "shared system prompt. " * 4 + f"conversation {i} " * 40


def test_two_replicas_agree_on_placement_and_state(redis_proc):
    async def main():
        async with replicas(redis_proc.url) as (rurls, s, fakes, routers):
            async def send(i):
                async with s.post(rurls[i % 2] + "/v1/completions", json={"prompt": conv(i), "hold": True}) as r:
                    assert r.status == 200
                    return r.headers["X-Gcache-Worker"]
            sent = [asyncio.ensure_future(send(i)) for i in range(6)]
            await poll(lambda: sum(f.active for f in fakes.values()) == 6, what="six conversations in flight")
            for f in fakes.values():
                f.gate.set()
            first = dict(enumerate(await asyncio.gather(*sent)))
            assert len(set(first.values())) > 1  # load spreads new conversations

            async def converged():  # a replica's changes reach the others within flush_delay_s
                views = [[(w.name, w.matched_blocks, w.inflight_requests)
                          for w in await rt.state.snapshot(conv_hashes(routers[0], 3))] for rt in routers]
                return views[0] == views[1] and all(w[2] == 0 for w in views[0])
            await poll(converged, what="both replicas see the same prefixes and loads")
            for i in range(6):  # the other replica sends each conversation to the same worker
                async with s.post(rurls[(i + 1) % 2] + "/v1/completions", json={"prompt": conv(i) + "more"}) as r:
                    assert r.headers["X-Gcache-Worker"] == first[i]

            async def idle():
                return all(w.inflight_requests == 0 for w in await routers[0].state.snapshot(()))
            await poll(idle, what="all requests finished")
            views = [[(w.spec, w.healthy, w.matched_blocks, w.inflight_requests, w.pending_ms)
                      for w in await rt.state.snapshot(conv_hashes(routers[0], 3))] for rt in routers]
            assert views[0] == views[1]
            assert max(w[2] for w in views[0]) > 2  # both see the same prefix index
    asyncio.run(main())


def test_counters_stay_consistent_under_concurrent_load(redis_proc):
    async def main():
        async with replicas(redis_proc.url, max_inflight=3) as (rurls, s, fakes, routers):
            reqs = [asyncio.ensure_future(s.post(rurls[i % 2] + "/v1/completions",
                                                 json={"prompt": conv(i), "hold": True})) for i in range(15)]
            try:
                await poll(lambda: sum(rt.admission.depth() for rt in routers) == 6, what="six requests queued")
                await poll(lambda: {u: f.active for u, f in fakes.items()} == {u: 3 for u in fakes},
                           what="the nine admitted requests at the workers")  # admitted, maybe not arrived yet
                assert sum(rt.admission.depth() for rt in routers) == 6  # none over the limit

                async def agreed():  # each replica sees the other's admissions within flush_delay_s
                    snaps = [{w.name: w.inflight_requests for w in await rt.state.snapshot(())} for rt in routers]
                    return all(sn == {u: 3 for u in fakes} for sn in snaps)
                await poll(agreed, what="both replicas count 3 in flight on every worker")
            finally:
                for f in fakes.values():
                    f.gate.set()
            statuses = [r.status for r in await asyncio.gather(*reqs)]
            assert statuses == [200] * 15
            assert sum(f.served for f in fakes.values()) == 15

            async def zero():
                snaps = [await rt.state.snapshot(()) for rt in routers]
                return all(w.inflight_requests == 0 and w.pending_ms == 0 for sn in snaps for w in sn)
            await poll(zero, what="counters back to zero on both replicas")
    asyncio.run(main())


def test_redis_outage_keeps_serving_then_resynchronises(redis_proc):
    async def main():
        async with replicas(redis_proc.url, n_workers=2, n_replicas=1, ns="o") as (rurls, s, fakes, routers):
            url, router = rurls[0], routers[0]
            async with s.post(url + "/v1/completions", json={"prompt": conv(1)}) as r:
                assert r.status == 200
            held = asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": conv(2), "hold": True}))
            await poll(lambda: sum(f.active for f in fakes.values()) == 1, what="held request")
            holder = next(u for u, f in fakes.items() if f.active)

            redis_proc.kill()
            for i in range(3, 6):
                async with s.post(url + "/v1/completions", json={"prompt": conv(i)}) as r:
                    assert r.status == 200
                    outage_worker = url_of(r, fakes)
            health = await (await s.get(url + "/health")).json()
            assert health["state"] == "degraded"
            metrics = await (await s.get(url + "/metrics")).text()
            assert "gcache_router_redis_up 0.0" in metrics

            redis_proc.start()  # a fresh, empty Redis on the same port
            await poll(lambda: _state_is(s, url, "redis"), what="router back on redis")
            rc = aioredis.Redis.from_url(redis_proc.url)
            try:
                assert len(await rc.hgetall("o:workers")) == 2
                assert await rc.zcard(f"o:px:{outage_worker}") > 0  # prefix records made offline
                snap = {w.name: w.inflight_requests for w in await router.state.snapshot(())}
                assert snap[holder] == 1  # the held request's count was pushed back
                for f in fakes.values():
                    f.gate.set()
                assert (await held).status == 200

                async def zero():
                    return all(w.inflight_requests == 0 for w in await router.state.snapshot(()))
                await poll(zero, what="counter back to zero after resync")
                metrics = await (await s.get(url + "/metrics")).text()
                assert "gcache_router_redis_up 1.0" in metrics
            finally:
                await rc.aclose()
    asyncio.run(main())


def test_a_worker_spec_in_redis_this_replica_refuses_is_skipped(redis_proc, caplog):
    """A spec another (older) replica stored that this one's checks refuse (here https) is
    logged and ignored; requests keep flowing to the valid workers."""
    async def main():
        async with replicas(redis_proc.url, n_workers=2, n_replicas=1, ns="bs") as (rurls, s, fakes, routers):
            rc = aioredis.Redis.from_url(redis_proc.url)
            try:
                async with s.post(rurls[0] + "/v1/completions", json={"prompt": conv(1)}) as r:
                    assert r.status == 200
                await rc.hset("bs:workers", "https://127.0.0.1:1", '{"url": "https://127.0.0.1:1"}')
                for i in range(2, 8):
                    async with s.post(rurls[0] + "/v1/completions", json={"prompt": conv(i)}) as r:
                        assert r.status == 200
                        assert url_of(r, fakes) in fakes
                assert {w.name for w in await routers[0].state.snapshot(())} == set(fakes)
            finally:
                await rc.aclose()
    with caplog.at_level(logging.ERROR, logger="router"):
        asyncio.run(main())
    assert "its spec is not valid here" in caplog.text


def test_redis_restarted_empty_while_idle_resynchronises(redis_proc, caplog):
    """Redis killed and restarted empty between two heartbeats (1 s apart here): the router
    never sees a failed call, only a Redis without its script or its replica entry. It must
    push its workers and load back instead of reading the empty worker list as "all removed"."""
    async def main():
        async with replicas(redis_proc.url, n_workers=2, n_replicas=1, ns="ri",
                            health_interval_s=1.0) as (rurls, s, fakes, routers):
            url, state = rurls[0], routers[0].state
            async with s.post(url + "/v1/completions", json={"prompt": conv(1)}) as r:
                assert r.status == 200
            caplog.set_level(logging.WARNING, "gcache.router.state")
            redis_proc.kill()
            redis_proc.start()
            for i in range(2, 6):
                async with s.post(url + "/v1/completions", json={"prompt": conv(i)}) as r:
                    assert r.status == 200, await r.text()
            rc = aioredis.Redis.from_url(redis_proc.url)
            try:
                await poll(lambda: _state_is(s, url, "redis"), what="router back on redis")
                await poll(lambda: _hlen_is(rc, "ri:workers", 2), what="workers written back to the new Redis")
                assert await rc.zscore("ri:replicas", state.replica) is not None
                assert sorted(w.name for w in await state.snapshot(())) == sorted(fakes)
                # usually seen as a Redis that lost our state; now and then the kill itself is seen
                assert "redis lost this replica's state" in caplog.text or "redis unreachable" in caplog.text
            finally:
                await rc.aclose()
    asyncio.run(main())


async def _hlen_is(rc, key, n):
    return await rc.hlen(key) == n


def test_health_seen_while_redis_was_stopped_is_written_after(redis_proc):
    """A worker marked down, Redis stopped (state kept), the worker recovers: once Redis answers
    again it must no longer list the worker in ns:down."""
    async def main():
        async with replicas(redis_proc.url, n_workers=2, n_replicas=1, ns="hd") as (rurls, s, fakes, routers):
            url, rt = rurls[0], routers[0]
            sick = next(iter(fakes))
            rc = aioredis.Redis.from_url(redis_proc.url)
            try:
                fakes[sick].healthy = False
                await poll(lambda: rc.sismember("hd:down", sick), what="worker down in redis")
                os.kill(redis_proc.proc.pid, signal.SIGSTOP)
                try:
                    await poll(lambda: _state_is(s, url, "degraded"), what="router degraded")
                    fakes[sick].healthy = True
                    await poll(lambda: sick not in rt.health.down, what="worker healthy again locally")
                finally:
                    os.kill(redis_proc.proc.pid, signal.SIGCONT)
                await poll(lambda: _state_is(s, url, "redis"), what="router back on redis")

                async def routable():
                    return not await rc.sismember("hd:down", sick) and all(
                        w.healthy for w in await rt.state.snapshot(()))
                await poll(routable, timeout=3, what="redis no longer lists the recovered worker as down")
            finally:
                await rc.aclose()
    asyncio.run(main())


def test_replica_that_lost_its_lease_rewrites_its_load(redis_proc):
    """Replica A stalls past its lease with requests in flight: B drops A's entry and load hash
    (what SYNC does to a replica whose heartbeat is older than lease_s; done by hand here, as
    the lease is 10 s). A must write its load back, so B keeps to max_inflight, and A's
    releases must not leave negative counts."""
    async def main():
        async with replicas(redis_proc.url, n_workers=1, max_inflight=2, ns="ll") as (rurls, s, fakes, routers):
            (w, fake), = fakes.items()
            a = routers[0].state.replica
            held = [asyncio.ensure_future(s.post(rurls[0] + "/v1/completions", json={"prompt": conv(i), "hold": True}))
                    for i in range(2)]
            rc = aioredis.Redis.from_url(redis_proc.url)
            try:
                await poll(lambda: fake.active == 2, what="two requests in flight through A")
                await rc.transaction(lambda p: _drop(p, a), f"ll:load:{a}", "ll:replicas")

                async def rewritten():
                    return await rc.hget(f"ll:load:{a}", f"r:{w}") == b"2"
                await poll(rewritten, timeout=3, what="A's load written back")
                b_sees = {x.name: x.inflight_requests for x in await routers[1].state.snapshot(())}
                assert b_sees == {w: 2}
                more = asyncio.ensure_future(s.post(rurls[1] + "/v1/completions", json={"prompt": conv(9), "hold": True}))
                await poll(lambda: routers[1].admission.depth() == 1, what="B queues at the limit")
                assert fake.active == 2
                fake.gate.set()
                assert [r.status for r in await asyncio.gather(*held, more)] == [200] * 3
                await poll(lambda: _all_zero(rc, "ll"), what="counters back to zero, none negative")
            finally:
                fake.gate.set()
                await rc.aclose()
    asyncio.run(main())


def test_state_call_after_lost_lease_is_refused_and_resyncs(redis_proc):
    """Without a heartbeat loop: a SYNC call from a replica Redis no longer counts applies
    nothing (its release would go negative on a missing hash); the call is served from the
    local mirror and a resync starts at once."""
    from router.config import PrefixConfig
    from router.state_redis import RedisState

    async def main():
        st = RedisState(redis_proc.url, PrefixConfig(), namespace="ll")
        rc = aioredis.Redis.from_url(redis_proc.url)
        try:
            await st.start()
            await st.add_worker(WorkerSpec("http://w"))
            lease = await st.acquire("http://w", 64, 5, ())
            assert lease is not None
            await st._call(0, ())
            assert await rc.hget(f"ll:load:{st.replica}", "r:http://w") == b"1"
            await rc.transaction(lambda p: _drop(p, st.replica), f"ll:load:{st.replica}", "ll:replicas")
            await st.release(lease)
            view = await st.snapshot(())  # refused (LEASELOST): the local mirror answers
            assert [(w.name, w.inflight_requests) for w in view] == [("http://w", 0)]
            await poll(lambda: not st.degraded, what="resynchronised")
            assert await rc.hget(f"ll:load:{st.replica}", "r:http://w") == b"0"
        finally:
            await st.close()
            await rc.aclose()
    asyncio.run(main())


async def _drop(pipe, replica):
    pipe.multi()
    pipe.delete(f"ll:load:{replica}")
    pipe.zrem("ll:replicas", replica)


async def _state_is(s, url, want):
    async with s.get(url + "/health") as r:
        return (await r.json())["state"] == want


def test_one_redis_round_trip_per_request(redis_proc):
    async def main():
        async with replicas(redis_proc.url, n_replicas=1, ns="rt") as (rurls, s, _fakes, routers):
            state = routers[0].state
            before_req, before_flush, before_rt = state.request_commands, state.flush_commands, state.pipelines
            for i in range(20):
                async with s.post(rurls[0] + "/v1/completions", json={"prompt": conv(i)}) as r:
                    assert r.status == 200
            assert state.request_commands - before_req == 20  # the snapshot; admit/release ride on it
            assert state.flush_commands - before_flush <= 20  # flushes off the request path
            assert state.pipelines - before_rt <= 40  # one round trip per command at most
            rc = aioredis.Redis.from_url(redis_proc.url)
            try:  # and what they carried arrived: prefixes recorded, counters back to zero
                await poll(lambda: _all_zero(rc, "rt"), what="load counters back to zero in Redis")
                assert sum([await rc.zcard(f"rt:px:{w}") for w in _fakes]) > 0
            finally:
                await rc.aclose()
    asyncio.run(main())


async def _all_zero(rc, ns):
    for key in await rc.keys(f"{ns}:load:*"):
        if any(int(v) != 0 for v in (await rc.hgetall(key)).values()):
            return False
    return True


def test_concurrent_requests_share_one_round_trip_and_one_script_run(redis_proc):
    """32 requests routed at once: one pipeline carries all their snapshots (one SYNC run), each
    gets its own prefix match, and Redis records every request's prefix."""
    async def main():
        async with replicas(redis_proc.url, n_replicas=1, ns="co") as (rurls, s, fakes, routers):
            state = routers[0].state
            texts = [conv(i) for i in range(32)]
            hashes = [conv_hashes(routers[0], i) for i in range(32)]
            for h in hashes[:4]:  # some requests with a known prefix on a worker
                lease = await state.acquire(next(iter(fakes)), 64, 1, h)
                await state.release(lease)
            await state._call(0, ())  # flush those records
            state.local.index.remove_worker(next(iter(fakes)))  # matches below must come from Redis
            before = state.pipelines
            views = await asyncio.gather(*(state.route_view(h, False) for h in hashes))
            assert state.pipelines - before == 1
            for h, (snap, _) in zip(hashes, views, strict=True):
                assert len(snap) == 3 and [s.name for s in snap] == sorted(s.name for s in snap)
            assert all(max(s.matched_blocks for s in snap) == len(h) for h, (snap, _) in zip(hashes[:4], views))
            assert all(max(s.matched_blocks for s in snap) >= 1 for snap, _ in views[4:])  # the shared block
            assert all(len(h) > 1 for h in hashes)
            rs = await asyncio.gather(*(s.post(rurls[0] + "/v1/completions", json={"prompt": t}) for t in texts))
            assert all(r.status == 200 for r in rs)
            for r in rs:
                r.release()
    asyncio.run(main())
