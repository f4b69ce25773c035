"""Routing state in Redis, shared by stateless router replicas (``--state redis``).

One Redis command per request: a request's snapshot is one Lua call (``redis_scripts.SYNC``)
that first applies this replica's buffered changes (requests admitted with their prefix
blocks, first bytes, completions, breaker outcomes) and then reads every worker's match,
the other replicas' load, health and circuit state. Admitting, first byte and release only
change the local mirror and append to the buffer; the next request's call carries them, and
a timer flushes them within ``flush_delay_s`` when no request comes (off the request path).
Commands issued in the same event-loop turn go out as one pipeline, so under load many
requests share a round trip.

The hot command goes over the replica's own pipelined RESP connection (``router.resp``); the
snapshots of one event-loop turn are one script run (mode 1 of ``SYNC``), which computes the
workers' shared state once and each request's prefix match. redis-py serves everything else.

A replica's own load is always its exact local count; other replicas' load is as of their
last call (at most ``flush_delay_s`` old). Far from a worker's ``max_inflight`` that is
enough; within ``strict_margin`` of it admission takes a second round trip, an atomic check
of every replica's count, so replicas never admit past the limit together. Each replica writes only its
own ``load`` hash; after an outage it overwrites that hash with its local truth, and a
replica that dies stops counting once its heartbeat is older than ``lease_s``. If Redis is
unreachable every call falls back to the local mirror (``MemoryState``), the log says so
once, ``degraded`` turns true, and the heartbeat loop reconnects and resynchronises: one
pipeline of the replica's local counts as of one instant, its workers, their health and the
prefix records made offline; changes after that instant are buffered as deltas on it, so
recovery takes a fixed number of round trips however busy the replica is. If Redis
answers but no longer holds this replica's state (it restarted empty, its scripts are gone, or
the replica was stopped past its lease and another one dropped its load), the scripts refuse
(``NOSCRIPT``, ``LEASELOST``, a heartbeat of 0): the same fallback, and a resync at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import cast

import redis.asyncio as aioredis
import redis.exceptions

from router.breaker import BreakerConfig
from router.config import PrefixConfig, WorkerSpec
from router.redis_batch import (
    FLUSH,
    MISSED_MAX,
    SNAPSHOT,
    SNAPSHOT_TICKET,
    STRICT_ACQUIRE,
    Common,
    commands,
    deliver,
    merge,
    replay_ops,
)
from router.redis_scripts import HEARTBEAT, RESYNC, SYNC
from router.resp import Arg, RespClient
from router.state_base import Lease, RivalHead, RouterState, WorkerState
from router.state_memory import MemoryState

log = logging.getLogger("gcache.router.state")

CLOCK_RTT_S = 0.05  # a clock sample from a slower round trip is not trusted (its midpoint is too uncertain)
_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
_NOT_A_REPLICA = "not in its replica set: it restarted empty, or this replica stalled past its lease"
class RedisState(RouterState):
    def __init__(
        self,
        url: str,
        prefix: PrefixConfig,
        namespace: str = "gcache-router",
        breaker: BreakerConfig | None = None,
        timeout_s: float = 0.5,
        lease_s: float = 10.0,
        replica_id: str | None = None,
        flush_delay_s: float = 0.005,
        max_connections: int = 64,
        head_ttl_s: float = 0.5,
    ) -> None:
        self.url = url
        self.shown_url = re.sub(r"//[^@/]*@", "//***@", url)  # for logs: without the password
        self.prefix = prefix
        self.ns = namespace
        self.lease_s = lease_s
        self.flush_delay_s = flush_delay_s
        # queue fairness across replicas: this replica's published queue heads (field -> key),
        # whether Redis has yet to hear of a change, and the other replicas' heads as last read
        self.head_ttl_s = head_ttl_s
        self._heads: dict[str, str] = {}
        self._heads_dirty = False
        self._rivals: list[RivalHead] = []
        self._fields: dict[bytes, tuple[int, str | None]] = {}  # decoded head fields, cached
        self._listener: asyncio.Task | None = None
        self.wakes_sent = 0
        self.wakes_received = 0
        self.replica = replica_id or uuid.uuid4().hex[:12]
        self.local = MemoryState(prefix, breaker=breaker)
        # A bounded pool that waits for a free connection (the default pool fails with "too many
        # connections" under a burst, which would count as an outage); no CLIENT SETINFO per connection.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry_on_timeout=False, decode_responses=False, driver_info=None)
        self.r = aioredis.Redis(connection_pool=pool)
        self.clock_offset = 0.0  # Redis's clock minus this host's (``wall``)
        self._sync = self.r.register_script(SYNC)
        self._sync_sha = self._sync.sha
        self.fast = RespClient(url, timeout_s)  # the hot command's own pipelined connection
        self._batch: list[tuple[int, Sequence[object], asyncio.Future]] = []
        self._loop_cache: asyncio.AbstractEventLoop | None = None
        self._last_send = float("-inf")  # loop time a request's batch last went out
        self._inflight: set[asyncio.Task] = set()
        self._resync = self.r.register_script(RESYNC)
        self._heartbeat = self.r.register_script(HEARTBEAT)
        self._up = False
        self._resync_lock = asyncio.Lock()
        self._resync_task: asyncio.Task | None = None  # one started at once after Redis lost our state
        self._resyncing = False  # a resync's pipeline is out: changes are buffered as deltas on what it pushed
        self._ops: list[object] = []  # changes not yet sent (SYNC op arguments)
        self._flush_timer: asyncio.TimerHandle | None = None
        self._missed: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=MISSED_MAX)  # prefix records made offline
        self._others: dict[str, int] = {}  # other replicas' in-flight requests per worker, last seen
        self._fails: dict[str, int] = {}  # breaker failure counts, last seen
        self._bad_specs: set[str] = set()  # workers in redis whose spec this replica refuses (logged once)
        self.errors = 0
        self.resyncs = 0
        # Redis commands by purpose. A request makes one (its snapshot; a second, the strict
        # acquire, only near a worker's limit); commands issued together share a pipeline.
        self.request_commands = 0
        self.flush_commands = 0  # timer flushes of buffered changes, off the request path
        self.background_commands = 0  # heartbeats, resyncs, admin changes, health/metrics snapshots
        self.pipelines = 0  # round trips the SYNC commands took

    def __repr__(self) -> str:
        return f"RedisState(url={self.shown_url!r}, replica={self.replica}, up={self._up}, buffered={len(self._ops)})"

    @property
    def degraded(self) -> bool:
        return not self._up

    # -- connection management ----------------------------------------------------------
    def _lost(self, e: Exception) -> None:
        self.errors += 1
        if self._up:
            log.warning("redis unreachable (%s: %s); serving from local state", type(e).__name__, e)
        self._up = False
        if not self._resyncing:  # (a resync's deltas are its own to keep or drop)
            self._ops.clear()  # the local truth is pushed on resync

    def _forgotten(self, why: str) -> None:
        """Redis answers but lost this replica's state (``why``): serve locally until resynced."""
        if self._up:
            log.warning("redis lost this replica's state (%s); serving from local state, resynchronising", why)
        self._up = False
        if not self._resyncing:
            self._ops.clear()

    async def start(self) -> None:
        await self.try_resync()
        self._listener = self._loop().create_task(self._listen())

    async def close(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
        if self._resync_task is not None:
            self._resync_task.cancel()
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
        if self._heads:
            self.publish_heads({})  # the other replicas need not wait for them to expire
        if (self._ops or self._heads_dirty) and self._up:
            await self._call(FLUSH, ())
        await self.fast.close()
        await self.r.aclose()

    async def try_resync(self) -> bool:
        """Reconnect and push local truth to Redis; called by the heartbeat loop. True if up."""
        async with self._resync_lock:
            return await self._try_resync()

    def _resync_soon(self) -> None:
        if self._resync_task is None or self._resync_task.done():
            self._resync_task = self._loop().create_task(self.try_resync())

    async def _try_resync(self) -> bool:
        self.background_commands += 1
        if self._up:
            try:
                if await self._heartbeat(args=[self.ns, self.replica]):
                    await self._measure_clock()
                    return True
            except _REDIS_ERRORS as e:
                self._lost(e)
                return False
            self._forgotten(_NOT_A_REPLICA)
        try:
            await self.r.connection_pool.disconnect()  # drop connections to the dead server
            await self.fast.close()  # fails the batches still waiting on it at once
            while self._inflight or self._batch:  # applied or refused before the local truth goes out
                if self._inflight:
                    await asyncio.wait(set(self._inflight))
                else:
                    await asyncio.sleep(0)  # a batch queued this turn: let it go out (and fail)
        except _REDIS_ERRORS as e:
            self._lost(e)
            return False
        return await self._push_local_truth()

    async def _push_local_truth(self) -> bool:
        """One pipeline: this replica's absolute load (``RESYNC``), its workers, their health and
        the prefix records of the requests admitted while degraded, as of one instant. What
        changes after that instant (admissions, first bytes, releases) is buffered as deltas on
        it and goes out with the first call once Redis has answered: so the resync takes a fixed
        number of round trips however busy the replica is, and requests keep being served from
        the local state meanwhile. A failure or a cancellation puts the records back."""
        local = self.local
        fields: list[Arg] = []
        for w in local.workers:
            r, t = local.loads.get(w)
            fields += [f"r:{w}", r, f"t:{w}", t]
        specs = list(local.workers.values())
        health = dict(local.health)  # this replica's view: health changes seen offline were not written
        missed, self._missed = self._missed, deque(maxlen=MISSED_MAX)
        self._ops.clear()
        self._resyncing = True  # from here, changes are buffered (deltas on the state pushed now)
        done = False
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.script_load(SYNC)  # the request path's EVALSHA
            await self._resync(args=[self.ns, self.replica, *fields], client=pipe)
            for spec in specs:
                pipe.hsetnx(f"{self.ns}:workers", spec.name, json.dumps(spec.to_dict()))
            down = [s.name for s in specs if not health.get(s.name, True)]
            up = [s.name for s in specs if health.get(s.name, True)]
            if down:
                pipe.sadd(f"{self.ns}:down", *down)
            if up:
                pipe.srem(f"{self.ns}:down", *up)
            for ops in replay_ops(missed):
                await self._sync(args=[self.ns, self.replica, self.prefix.ttl_s, self.lease_s,
                                       self.prefix.max_blocks_per_worker, FLUSH, 1, 1, len(ops), *ops], client=pipe)
            await pipe.execute()
            done = True
        except _REDIS_ERRORS as e:
            self._lost(e)
            return False
        except redis.exceptions.RedisError as e:  # refused (e.g. out of memory): still degraded, retried
            log.error("redis refused the resync: %s: %s", type(e).__name__, e)
            self._lost(e)
            return False
        finally:
            self._resyncing = False
            if not done:  # nothing of it counts: records back for the next try; loads are pushed whole again
                self._keep_records(self._ops)
                self._ops.clear()
                self._missed = deque([*missed, *self._missed], maxlen=MISSED_MAX)
        self._up = True
        for w, hashes in self._missed:  # kept by a batch that failed meanwhile: with the next call
            self._ops.extend(("R", w, len(hashes), *hashes))
        self._missed.clear()
        await self._catch_up(specs, health)
        with contextlib.suppress(*_REDIS_ERRORS):
            await self._measure_clock()
        self.resyncs += 1
        log.warning("redis reachable at %s; state resynchronised (replica %s)", self.shown_url, self.replica)
        return True

    async def _catch_up(self, specs: list[WorkerSpec], health: dict[str, bool]) -> None:
        """After a resync: send what changed while its pipeline was out (buffered load changes,
        workers added, health changes), without waiting for the next request."""
        calls: list[tuple] = []
        known = {s.name for s in specs}
        for spec in self.local.workers.values():
            if spec.name not in known:
                calls.append(("hsetnx", f"{self.ns}:workers", spec.name, json.dumps(spec.to_dict())))
        for w, ok in self.local.health.items():
            if w in self.local.workers and ok != health.get(w, True):
                calls.append(("srem" if ok else "sadd", f"{self.ns}:down", w))
        if calls:
            await self._admin(*calls)  # carries the buffered changes first
        elif self._ops or self._heads_dirty:
            self._send_now()

    def wall(self) -> float:
        """This host's clock corrected to Redis's (``_measure_clock``): the replicas' head keys
        then compare on one clock, whatever the skew between their hosts (a replica whose clock
        ran 3 s ahead was owed nothing for 3 s; with more skew than max-wait its requests 503'd)."""
        return time.time() + self.clock_offset

    async def _measure_clock(self) -> None:
        """Redis's TIME against this host's clock, at the midpoint of the round trip; a sample
        whose round trip is slow (more than CLOCK_RTT_S) is not trusted."""
        t0 = time.time()
        sec, usec = await self.r.time()
        t1 = time.time()
        if t1 - t0 <= CLOCK_RTT_S:
            self.clock_offset = sec + usec / 1e6 - (t0 + t1) / 2

    def _loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, looked up once (Python 3.11's lookup costs a getpid() system call)."""
        loop = self._loop_cache
        if loop is None or loop.is_closed():
            loop = self._loop_cache = asyncio.get_running_loop()
        return loop

    # -- the buffered changes -------------------------------------------------------------
    def _buffer(self, *op: object) -> None:
        if not self._up:
            if self._resyncing:
                self._ops.extend(op)
            return
        self._ops.extend(op)
        if self._flush_timer is None:
            self._flush_timer = self._loop().call_later(self.flush_delay_s, self._flush_soon)

    def _flush_soon(self, force: bool = False) -> None:
        """Send the buffered changes, unless a request sent its batch recently: then they ride on
        the next one, or on this timer's next turn if requests stop (no extra round trip under load)."""
        self._flush_timer = None
        if not (self._ops or self._heads_dirty) or not self._up:
            return
        loop = self._loop()
        wait = self._last_send + self.flush_delay_s - loop.time()
        if wait > 0 and not force:
            self._flush_timer = loop.call_later(wait, self._flush_soon)
            return
        self.flush_commands += 1
        loop.create_task(self._call(FLUSH, ()))

    async def _call(self, mode: int, hashes: Sequence[object]) -> object:
        """One SYNC call; None if Redis is unreachable. Calls issued in the same event-loop turn
        share one round trip, and their snapshots one script run; the first carries every
        buffered change."""
        loop = self._loop()
        fut = loop.create_future()
        self._batch.append((mode, hashes, fut))
        if len(self._batch) == 1:
            loop.call_soon(self._send_batch)
        return await fut

    def _send_batch(self) -> None:
        batch, self._batch = self._batch, []
        ops, self._ops = self._ops, []
        if self._heads or self._heads_dirty:  # every call refreshes them while any wait
            ops.extend(("Q", int(self.head_ttl_s * 1000), len(self._heads)))
            for kv in self._heads.items():
                ops.extend(kv)
            self._heads_dirty = False
        loop = self._loop()
        if any(mode != FLUSH for mode, _, _ in batch):
            self._last_send = loop.time()
        task = loop.create_task(self._run_batch(batch, ops))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _run_batch(self, batch: list, ops: list) -> None:
        b = self.local.breaker
        head: list[Arg] = ["EVALSHA", self._sync_sha, 0, self.ns, self.replica, self.prefix.ttl_s, self.lease_s,
                           self.prefix.max_blocks_per_worker]
        cmds = commands(batch, ops, head, b.failures, b.open_s)
        results: list | None = None
        try:
            self.pipelines += 1
            results = await self.fast.execute(cmds)
            err = next((r for r in results if isinstance(r, Exception)), None)
            if err is not None:
                raise err
        except redis.exceptions.NoScriptError:  # Redis restarted (or flushed its scripts): the state may be gone
            results = None
            self._forgotten("it has no state script: restarted?")
            self._keep_records(ops)
            self._resync_soon()
        except _REDIS_ERRORS as e:
            self._lost(e)
            self._keep_records(ops)
            results = None
        except redis.exceptions.ResponseError as e:
            results = None
            if str(e).startswith("LEASELOST"):  # restarted empty, or our lease expired and our load was dropped
                self._forgotten(_NOT_A_REPLICA)
                self._keep_records(ops)
                self._resync_soon()
            else:
                log.error("redis refused the state script: %s", e)
        if results is None:
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_result(None)
            return
        deliver(batch, results, self._common)

    def _common(self, res: list) -> Common:
        rows = res[0]
        self._rivals = self._decode_heads(res[2]) if len(res) > 2 and res[2] else []
        out = []
        for i, (name_b, spec_json, reqs, work, down, fails, is_open) in enumerate(rows):
            name = name_b.decode()
            if name not in self.local.workers:  # learnt from another replica
                try:
                    spec = WorkerSpec.from_dict(json.loads(spec_json))
                except (ValueError, TypeError, KeyError) as e:  # json errors are ValueErrors
                    if name not in self._bad_specs:
                        self._bad_specs.add(name)
                        log.error("ignoring worker %s from redis: its spec is not valid here (%s)", name, e)
                    continue
                self.local.add_worker_sync(spec)
            r = max(0, int(reqs))
            self._others[name] = r
            self._fails[name] = int(fails)
            out.append((name, i, r, max(0, int(work)), bool(down), bool(is_open)))
        known = {row[0] for row in out}
        for gone in [w for w in self.local.workers if w not in known]:
            self.local.remove_worker_sync(gone)  # removed through another replica
        out.sort()
        return Common(out)

    def _keep_records(self, ops: list) -> None:
        i = 0
        while i < len(ops):  # prefix records are replayed after the outage; loads resync
            kind = ops[i]
            if kind == "A":
                n = ops[i + 3]
                self._missed.append((ops[i + 1], tuple(ops[i + 4 : i + 4 + n])))
                i += 4 + n
            elif kind == "R":  # a record replayed after a resync (_try_resync): kept again
                n = ops[i + 2]
                self._missed.append((ops[i + 1], tuple(ops[i + 3 : i + 3 + n])))
                i += 3 + n
            elif kind == "Q":
                self._heads_dirty = True
                i += 3 + 2 * cast(int, ops[i + 2])
            else:
                i += {"D": 4, "C": 3, "W": 2}[kind]

    # -- queue fairness across replicas -------------------------------------------------------
    def publish_heads(self, heads: dict[tuple[int, str | None], float]) -> None:
        """Every call this replica makes carries these (``Q``) and refreshes their expiry
        (``head_ttl_s``) while any wait; a change goes out at once (its own round trip only when
        no call is under way in this event-loop turn)."""
        fields = {json.dumps(list(b)): repr(k) for b, k in heads.items()}
        if fields == self._heads:
            return
        self._heads = fields
        self._heads_dirty = True
        if self._up:
            self._loop().call_soon(self._send_now)

    def rival_heads(self) -> list[RivalHead]:
        return self._rivals if self._up else []

    def wake(self, replica: str) -> None:
        if not self._up:
            return
        self.wakes_sent += 1
        self._buffer("W", replica)
        self._loop().call_soon(self._send_now)

    def _send_now(self) -> None:
        """Send the buffered changes now, unless a call of this turn is about to carry them."""
        if self._batch or not self._up or not (self._ops or self._heads_dirty):
            return
        self.flush_commands += 1
        self._batch.append((FLUSH, (), self._loop().create_future()))
        self._loop().call_soon(self._send_batch)

    def _decode_heads(self, flat: list) -> list[RivalHead]:
        out = []
        for j in range(0, len(flat), 2):
            replica = flat[j].decode()
            kv = flat[j + 1]
            for f in range(0, len(kv), 2):
                q = self._fields.get(kv[f])
                if q is None:
                    try:
                        b, m = json.loads(kv[f])
                        q = (int(b), None if m is None else str(m))
                    except (ValueError, TypeError):
                        continue
                    if len(self._fields) > 10_000:
                        self._fields.clear()
                    self._fields[kv[f]] = q
                try:
                    out.append(RivalHead(replica, q[0], q[1], float(kv[f + 1])))
                except ValueError:
                    continue
        return out

    async def _listen(self) -> None:
        """Run ``on_wake`` whenever another replica leaves this one a slot (``ns:wake:<me>``).
        Reconnects after a failure; until then the admission's poll still finds the slot."""
        channel = f"{self.ns}:wake:{self.replica}"
        while True:
            ps = self.r.pubsub(ignore_subscribe_messages=True)
            try:
                await ps.subscribe(channel)
                while True:
                    msg = await ps.get_message(timeout=1.0)
                    if msg is not None and msg.get("type") == "message":
                        self.wakes_received += 1
                        if self.on_wake is not None:
                            self.on_wake()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure: the poll covers until we are back
                log.debug("wake subscription failed (%s: %s); retrying", type(e).__name__, e)
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await ps.aclose()

    # -- workers (admin changes: direct calls, not on the request path) ------------------
    async def _admin(self, *calls) -> list | None:
        if not self._up:
            return None
        if self._ops:  # changes made before this one go first (a removal must not be undone by them)
            self.background_commands += 1
            await self._call(FLUSH, ())
        self.background_commands += 1
        try:
            pipe = self.r.pipeline(transaction=True)
            for name, *args in calls:
                getattr(pipe, name)(*args)
            return await pipe.execute()
        except _REDIS_ERRORS as e:
            self._lost(e)
            return None

    async def add_worker(self, spec: WorkerSpec) -> None:
        self.local.add_worker_sync(spec)
        await self._admin(("hset", f"{self.ns}:workers", spec.name, json.dumps(spec.to_dict())))

    async def remove_worker(self, name: str) -> bool:
        found = self.local.remove_worker_sync(name)
        res = await self._admin(("hdel", f"{self.ns}:workers", name), ("delete", f"{self.ns}:px:{name}"),
                                ("srem", f"{self.ns}:down", name), ("hdel", f"{self.ns}:cb", f"f:{name}", f"o:{name}"))
        return found or bool(res and res[0])

    def known_specs(self) -> list[WorkerSpec]:
        return self.local.known_specs()

    async def list_workers(self) -> list[WorkerSpec]:
        return [s.spec for s in await self.snapshot(())]

    async def set_health(self, name: str, healthy: bool) -> None:
        was = self.local.health.get(name)
        await self.local.set_health(name, healthy)
        if was != healthy or not healthy:
            key = f"{self.ns}:down"
            await self._admin(("srem", key, name) if healthy else ("sadd", key, name))

    async def forget_prefixes(self, worker: str) -> None:
        self.local.index.remove_worker(worker)
        await self._admin(("delete", f"{self.ns}:px:{worker}"))

    async def record_outcome(self, worker: str, ok: bool) -> None:
        self.local.record_outcome_sync(worker, ok)
        if not ok or self._fails.get(worker):  # a success on a clean record changes nothing
            self._fails[worker] = 0 if ok else self._fails.get(worker, 0) + 1
            self._buffer("C", worker, int(ok))
            if not ok and self._flush_timer is not None:  # failures reach the other replicas at once
                self._flush_timer.cancel()
                self._flush_soon(force=True)

    # -- routing ------------------------------------------------------------------------
    async def snapshot(self, hashes: Sequence[int]) -> list[WorkerState]:
        """For health checks, metrics and the admin API (the request path uses ``route_view``)."""
        self.background_commands += 1
        return (await self._view(hashes, False))[0]

    async def route_view(self, hashes: Sequence[int], want_ticket: bool) -> tuple[list[WorkerState], int]:
        self.request_commands += 1
        if self._up:  # the request path, inline: one coroutine level less per request
            res = await self._call(SNAPSHOT_TICKET if want_ticket else SNAPSHOT, hashes)
            if res is not None:
                common, (ticket, matches) = cast(tuple[Common, list], res)
                return merge(common, matches, hashes, self.local), int(ticket)
        return self.local.snapshot_sync(hashes), await self.local.next_ticket()

    async def _view(self, hashes: Sequence[int], want_ticket: bool) -> tuple[list[WorkerState], int]:
        if self._up:
            res = await self._call(SNAPSHOT_TICKET if want_ticket else SNAPSHOT, hashes)
            if res is not None:
                common, (ticket, matches) = cast(tuple[Common, list], res)
                return merge(common, matches, hashes, self.local), int(ticket)
        return self.local.snapshot_sync(hashes), await self.local.next_ticket()

    async def next_ticket(self) -> int:
        return (await self._view((), True))[1]

    async def acquire(self, worker: str, limit: int, work_ms: int, hashes: Sequence[int]) -> Lease | None:
        """Far from the limit: count locally, Redis learns it with the next call. Within
        ``strict_margin(limit)`` of it (where another replica's last few admissions matter):
        one more round trip that checks every replica's count and admits atomically."""
        own = self.local.loads.get(worker)[0]
        if self._up:
            seen = self._others.get(worker, 0) + own
            if seen >= limit:
                return None
            if seen >= limit - strict_margin(limit):
                self.request_commands += 1
                ok = await self._call(STRICT_ACQUIRE, (worker, limit, work_ms, len(hashes), *hashes))
                if ok is not None:
                    if not ok:
                        return None
                    return self.local.acquire_sync(worker, 1 << 60, work_ms, hashes)
            else:
                lease = self.local.acquire_sync(worker, 1 << 60, work_ms, hashes)
                self._buffer("A", worker, work_ms, len(hashes), *hashes)
                return lease
        lease = self.local.acquire_sync(worker, limit, work_ms, hashes)
        if lease is not None:
            if self._resyncing:  # a delta on the load the resync is pushing
                self._ops.extend(("A", worker, work_ms, len(hashes), *hashes))
            else:
                self._missed.append((worker, tuple(hashes)))
        return lease

    async def prefill_done(self, lease: Lease) -> None:
        if lease.prefilled or lease.released:
            return
        self.local.prefill_done_sync(lease)
        self._buffer("D", lease.worker, 0, -lease.work_ms)

    async def release(self, lease: Lease) -> None:
        if lease.released:
            return
        dwork = 0 if lease.prefilled else -lease.work_ms
        self.local.release_sync(lease)
        self._buffer("D", lease.worker, -1, dwork)


def strict_margin(limit: int) -> int:
    """How close to a worker's in-flight limit admission turns strict (an atomic check in Redis)."""
    return max(4, limit // 4)


async def heartbeat_loop(state: RedisState, interval_s: float, stopping: asyncio.Event) -> None:
    """Keep this replica's lease alive and reconnect after an outage, until ``stopping`` is set
    (checked as well as cancellation: Python 3.11 can lose a cancel that lands as a timeout fires)."""
    while not stopping.is_set():
        await state.try_resync()
        await asyncio.sleep(interval_s)
