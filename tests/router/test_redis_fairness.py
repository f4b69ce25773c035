"""Queue fairness across replicas sharing Redis: a request's wait must not depend on which
replica it reached, and a replica that died must not hold the others' queues for longer than
its published head lives."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import redis.asyncio as aioredis

from router import admission
from tests.router.conftest import poll
from tests.router.test_redis_state import conv, replicas


def test_an_occasional_replica_is_served_like_the_busy_one(redis_proc):
    """One worker (max_inflight=2, 0.1 s per request) saturated by six closed-loop clients of
    replica B; one client of replica A. Same-size requests: A's requests must wait about as long
    as B's (before: B's pump took every slot its own releases freed; A waited for seconds or
    timed out)."""
    async def main():
        async with replicas(redis_proc.url, n_workers=1, max_inflight=2, ns="fair") as (rurls, s, fakes, routers):
            a_url, b_url = rurls
            done = asyncio.Event()
            lat: dict[str, list[tuple[int, float]]] = {"a": [], "b": []}

            async def one(url, who, i):
                t0 = time.monotonic()
                async with s.post(url + "/v1/completions",
                                  json={"prompt": f"{who}{i:05d} same size question", "decode_s": 0.1}) as r:
                    await r.read()
                    lat[who].append((r.status, time.monotonic() - t0))

            async def b_client(k):
                i = 0
                while not done.is_set():
                    await one(b_url, "b", k * 10_000 + i)
                    i += 1

            async def a_client():
                for i in range(8):
                    # occasional: each request comes once B has taken the worker and queued again
                    # (else A's next request would take the slot its last one freed)
                    await poll(lambda: next(iter(fakes.values())).active == 2 and routers[1].admission.depth() >= 3,
                               what="the worker full and B's queue filled")
                    await one(a_url, "a", i)
                done.set()

            bs = [asyncio.ensure_future(b_client(k)) for k in range(6)]
            try:
                await asyncio.wait_for(a_client(), timeout=60)
            finally:
                done.set()
                await asyncio.gather(*bs)
            a_ok = [t for st, t in lat["a"] if st == 200]
            b_ok = [t for st, t in lat["b"] if st == 200]
            assert [st for st, _ in lat["a"]] == [200] * 8, lat["a"]
            assert all(st == 200 for st, _ in lat["b"])
            b_med = statistics.median(b_ok)
            # seven clients share two slots of 0.1 s: everyone's turn comes every ~0.35 s
            assert max(a_ok) < 2 * max(b_med, 0.3) + 0.2, (sorted(a_ok), b_med)
            assert statistics.median(a_ok) < 1.5 * b_med + 0.1, (sorted(a_ok), b_med)
            assert routers[1].state.wakes_sent > 0 and routers[0].state.wakes_received > 0
    asyncio.run(main())


def test_slots_go_across_replicas_in_arrival_order(redis_proc, monkeypatch):
    """Worker full (max_inflight=2) with B's requests; B queues b1-b3, then A queues a, then B
    queues b4-b9. Requests finish one at a time: a must get the fourth slot, not the last."""
    monkeypatch.setattr(admission, "FAIR_TOLERANCE_S", 0.0)  # strict arrival order

    async def main():
        async with replicas(redis_proc.url, n_workers=1, max_inflight=2, ns="ord") as (rurls, s, fakes, routers):
            (fake,) = fakes.values()
            a, b = routers

            def send(url, name):
                return asyncio.ensure_future(s.post(url + "/v1/completions",
                                                    json={"prompt": f"{name} same size question", "ticket": True}))
            reqs = [send(rurls[1], f"b-{i}") for i in range(2)]
            await poll(lambda: fake.active == 2, what="the worker full")
            for i in range(1, 4):
                reqs.append(send(rurls[1], f"b{i}"))
                await poll(lambda i=i: b.admission.depth() == i, what=f"b{i} queued")
            reqs.append(send(rurls[0], "a0"))
            await poll(lambda: a.admission.depth() == 1, what="a queued")
            for i in range(4, 10):
                reqs.append(send(rurls[1], f"b{i}"))
                await poll(lambda i=i: b.admission.depth() == i, what=f"b{i} queued")
            try:
                for k in range(1, 11):
                    fake.tickets.release()
                    await poll(lambda k=k: fake.served == k and fake.active == min(2, 12 - k),
                               what=f"slot {k} handed on")
            finally:
                for _ in range(12):
                    fake.tickets.release()
            assert [r.status for r in await asyncio.gather(*reqs)] == [200] * 12
            order = [json.loads(body)["prompt"].split()[0] for body in fake.bodies[2:]]
            assert order == ["b1", "b2", "b3", "a0", "b4", "b5", "b6", "b7", "b8", "b9"], order
    asyncio.run(main())


async def _redis_time(rc) -> float:
    sec, usec = await rc.time()
    return sec + usec / 1e6


async def _dead_rival(rc, ns, ttl_ms=None):
    """A replica that published an old head for bucket 0 (any model) and then died: it stays in
    ns:replicas (its lease is 10 s) and its ns:q hash lives until its expiry."""
    await rc.zadd(f"{ns}:replicas", {"dead": await _redis_time(rc)})
    await rc.hset(f"{ns}:q:dead", "[0, null]", "0.0")
    if ttl_ms is not None:
        await rc.pexpire(f"{ns}:q:dead", ttl_ms)


def test_a_dead_replicas_head_stops_mattering_after_its_expiry(redis_proc, monkeypatch):
    monkeypatch.setattr(admission, "YIELD_GRACE_S", 60.0)  # only the expiry can release it here

    async def main():
        async with replicas(redis_proc.url, n_workers=1, n_replicas=1, ns="dead") as (rurls, s, _fakes, routers):
            rt = routers[0]
            rc = aioredis.Redis.from_url(redis_proc.url)
            try:
                async with s.post(rurls[0] + "/v1/completions", json={"prompt": conv(0)}) as r:
                    assert r.status == 200  # the replica is up and has read the worker list
                await _dead_rival(rc, "dead")
                req = asyncio.ensure_future(s.post(rurls[0] + "/v1/completions", json={"prompt": conv(1)}))
                # the idle worker's slot is left to the (dead) replica with the older head, again and again
                await poll(lambda: rt.admission.depth() == 1 and rt.state.wakes_sent >= 3,
                           what="the request held back for the dead replica's older head")
                assert not req.done()
                t0 = time.monotonic()
                await rc.pexpire("dead:q:dead", 300)
                r = await asyncio.wait_for(req, timeout=5)
                assert r.status == 200
                r.release()
                assert time.monotonic() - t0 < 2.0
                assert await rc.exists("dead:q:dead") == 0
                assert await rc.zscore("dead:replicas", "dead") is not None  # expiry, not the lease, freed it
                assert rt.admission.depth() == 0
            finally:
                await rc.aclose()
    asyncio.run(main())


def test_a_head_that_never_takes_its_slots_is_ignored_after_the_grace(redis_proc):
    """A published head that does not expire (a replica stalled while its key lives, or a head
    that cannot use the worker after all) holds others back for YIELD_GRACE_S at most."""
    async def main():
        async with replicas(redis_proc.url, n_workers=1, n_replicas=1, ns="gr") as (rurls, s, _fakes, _routers):
            rc = aioredis.Redis.from_url(redis_proc.url)
            try:
                async with s.post(rurls[0] + "/v1/completions", json={"prompt": conv(0)}) as r:
                    assert r.status == 200
                await _dead_rival(rc, "gr", ttl_ms=60_000)
                t0 = time.monotonic()
                async with s.post(rurls[0] + "/v1/completions", json={"prompt": conv(1)}) as r:
                    assert r.status == 200
                waited = time.monotonic() - t0
                assert admission.YIELD_GRACE_S * 0.9 < waited < admission.YIELD_GRACE_S + 2.0, waited
                assert await rc.exists("gr:q:dead") == 1  # still published, no longer obeyed
            finally:
                await rc.aclose()
    asyncio.run(main())


def test_head_keys_are_on_redis_clock_whatever_this_hosts_clock_says(redis_proc, monkeypatch):
    """Head keys were built on each replica's own time.time(): a replica whose host clock ran
    3 s ahead was owed nothing for 3 s (p50 3.3 s against 0.33 s), and with more skew than
    max-wait its queued requests got 503s. A replica's wall clock is now Redis's."""
    import time as real_time
    import types

    from router import state_redis
    from router.config import PrefixConfig
    from router.state_redis import RedisState

    skewed = types.SimpleNamespace(time=lambda: real_time.time() + 7.0, monotonic=real_time.monotonic)
    monkeypatch.setattr(state_redis, "time", skewed)

    async def main():
        st = RedisState(redis_proc.url, PrefixConfig(), namespace="sk")
        rc = aioredis.Redis.from_url(redis_proc.url)
        try:
            await st.start()
            sec, usec = await rc.time()
            assert abs(st.wall() - (sec + usec / 1e6)) < 0.5, (st.wall(), sec, st.clock_offset)
            assert abs(st.clock_offset + 7.0) < 0.5
        finally:
            await st.close()
            await rc.aclose()
    asyncio.run(main())
