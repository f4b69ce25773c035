"""Resynchronising with Redis after an outage while requests keep coming (a real redis-server).

Found by a probe: the resync replayed the prefix records of requests admitted while degraded one
Redis round trip each, and started over whenever the local load changed meanwhile; under
continuous load every new request was added to the list and changed the load, so the replica
stayed degraded (and admitted against its local count only) until the load stopped, and the
resync ran well past the caller's timeout."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import redis.asyncio as aioredis

from router.config import PrefixConfig, WorkerSpec
from router.state_redis import RedisState
from tests.router.conftest import poll

W = "http://127.0.0.1:9"


async def _degraded(st: RedisState, redis_proc) -> None:
    await st.start()
    await st.add_worker(WorkerSpec(W))
    redis_proc.kill()
    await st.route_view([1], False)  # the call that finds Redis gone
    assert st.degraded


async def _load_is(rc, st: RedisState, reqs: int, work: int) -> bool:
    got = await rc.hgetall(f"{st.ns}:load:{st.replica}")
    return got.get(f"r:{W}".encode()) == str(reqs).encode() and got.get(f"t:{W}".encode()) == str(work).encode()


def test_resync_finishes_while_requests_keep_coming(redis_proc):
    async def main():
        st = RedisState(redis_proc.url, PrefixConfig(), namespace="rl")
        rc = aioredis.Redis.from_url(redis_proc.url)
        loaders: list[asyncio.Task] = []
        stop = asyncio.Event()
        try:
            await _degraded(st, redis_proc)
            held = [await st.acquire(W, 1 << 20, 10, [100 + i]) for i in range(3)]  # admitted offline, still running
            redis_proc.start()  # back, empty
            admitted = 0
            give_up = time.monotonic() + 15  # bounds the test should the resync never finish under load

            async def load(k: int) -> None:
                nonlocal admitted
                while not stop.is_set() and time.monotonic() < give_up:
                    lease = await st.acquire(W, 1 << 20, 5, [1000 + k])
                    assert lease is not None
                    admitted += 1
                    await asyncio.sleep(0)  # a request's own await: other requests and the resync run
                    await st.release(lease)

            loaders = [asyncio.get_running_loop().create_task(load(k)) for k in range(8)]
            await poll(lambda: admitted > 100, what="requests flowing while degraded")
            t0 = time.monotonic()
            ok = await st.try_resync()
            took = time.monotonic() - t0
            still_loading = not any(t.done() for t in loaders)
            stop.set()
            await asyncio.gather(*loaders)
            assert ok and not st.degraded
            assert still_loading, f"the resync took {took:.1f}s: it finished only once the load stopped"
            assert took < 3.0, f"the resync took {took:.1f}s under load"

            # Redis holds this replica's exact load (the three held requests) once the buffered
            # changes made during the resync have gone out, and the prefixes seen offline
            await poll(lambda: _load_is(rc, st, 3, 30), what="redis load == the three held requests")
            for lease in held:
                await st.release(lease)
            await poll(lambda: _load_is(rc, st, 0, 0), what="redis load back to zero")
            px = f"rl:px:{W}"
            assert all([await rc.zscore(px, str(100 + i)) is not None for i in range(3)])
            assert all([await rc.zscore(px, str(1000 + k)) is not None for k in range(8)])
        finally:
            stop.set()
            await asyncio.gather(*loaders, return_exceptions=True)
            await st.close()
            await rc.aclose()
    asyncio.run(main())


def test_a_cancelled_resync_loses_nothing(redis_proc):
    """A resync cancelled while Redis does not answer (stopped) returns at once, and the next one
    still writes back the load and the prefix records of the requests admitted offline."""
    async def main():
        st = RedisState(redis_proc.url, PrefixConfig(), namespace="rc", timeout_s=5.0)
        rc = None
        try:
            await _degraded(st, redis_proc)
            held = await st.acquire(W, 64, 7, [42, 43])
            redis_proc.start()
            os.kill(redis_proc.proc.pid, signal.SIGSTOP)
            try:
                task = asyncio.get_running_loop().create_task(st.try_resync())
                await poll(lambda: st._resyncing, what="resync waiting on the stopped redis")
                during = await st.acquire(W, 64, 5, [44])  # admitted while the resync waits
                t0 = time.monotonic()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                assert time.monotonic() - t0 < 1.0
                assert st.degraded
            finally:
                os.kill(redis_proc.proc.pid, signal.SIGCONT)
            assert await st.try_resync()
            rc = aioredis.Redis.from_url(redis_proc.url)
            await poll(lambda: _load_is(rc, st, 2, 12), what="redis load == the two requests admitted offline")
            for h in (42, 43, 44):
                assert await rc.zscore(f"rc:px:{W}", str(h)) is not None
            await st.release(held)
            await st.release(during)
            await poll(lambda: _load_is(rc, st, 0, 0), what="redis load back to zero")
        finally:
            await st.close()
            if rc is not None:
                await rc.aclose()
    asyncio.run(main())


def test_records_replayed_after_a_resync_are_kept_again_when_their_batch_fails():
    """A batch carrying records replayed after a resync ("R") that failed raised KeyError in
    _keep_records, inside _run_batch's error handling, before the batch's futures were resolved:
    every request awaiting it hung (a reviewer)."""
    from collections import deque

    from router.state_redis import RedisState

    s = RedisState.__new__(RedisState)
    s._missed, s._heads_dirty = deque(), False
    s._keep_records(["R", "w1", 2, 11, 12, "D", "w1", 1, 5, "A", "w2", 9, 1, 7])
    assert list(s._missed) == [("w1", (11, 12)), ("w2", (7,))]
