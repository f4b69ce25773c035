"""Routing state in Redis, shared by stateless router replicas (``--state redis``).

Keys (``ns`` = namespace)::

    ns:workers          HASH  worker name -> JSON WorkerSpec
    ns:down             SET   workers failing health checks
    ns:px:<worker>      ZSET  block hash -> last-seen time (bounded, TTL): the prefix index
    ns:load:<replica>   HASH  r:<worker> in-flight requests, t:<worker> pending prefill work (ms)
    ns:replicas         ZSET  replica id -> last heartbeat (Redis clock)
    ns:rr               INT   round-robin ticket

Every read-decide-write step that must be atomic is one Lua script, run on
Redis's own clock. Each replica writes only its own ``load`` hash, so after an
outage it resynchronises by overwriting that hash with its local truth, and a
replica that dies stops counting once its heartbeat goes stale: counters never
drift. If Redis is unreachable every call falls back to the local mirror
(``MemoryState``), the log says so once, ``degraded`` turns true, and a
background task reconnects and resynchronises.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import deque
from collections.abc import Sequence

import redis.asyncio as aioredis
import redis.exceptions

from router.breaker import BreakerConfig
from router.config import PrefixConfig, WorkerSpec
from router.state_base import Lease, RouterState, WorkerState
from router.state_memory import MemoryState

log = logging.getLogger("gcache.router.state")

_NOW = "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1e6\n"

_PRUNE = """
local stale = redis.call('ZRANGEBYSCORE', ns .. ':replicas', '-inf', now - lease)
for _, r in ipairs(stale) do
  redis.call('DEL', ns .. ':load:' .. r)
  redis.call('ZREM', ns .. ':replicas', r)
end
local reps = redis.call('ZRANGE', ns .. ':replicas', 0, -1)
local function inflight(name)
  local reqs, toks = 0, 0
  for _, r in ipairs(reps) do
    local v = redis.call('HMGET', ns .. ':load:' .. r, 'r:' .. name, 't:' .. name)
    reqs = reqs + (tonumber(v[1]) or 0)
    toks = toks + (tonumber(v[2]) or 0)
  end
  return reqs, toks
end
"""

# ARGV: ns, ttl, lease, hash...
SNAPSHOT = (
    "local ns, ttl, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])\n"
    + _NOW
    + _PRUNE
    + """
local ws = redis.call('HGETALL', ns .. ':workers')
local out = {}
for i = 1, #ws, 2 do
  local name = ws[i]
  local reqs, toks = inflight(name)
  local m, key, age = 0, ns .. ':px:' .. name, -1
  for j = 4, #ARGV do
    local s = redis.call('ZSCORE', key, ARGV[j])
    if (not s) or tonumber(s) < now - ttl then break end
    m = m + 1
    age = now - tonumber(s)
  end
  local cb = redis.call('HMGET', ns .. ':cb', 'f:' .. name, 'o:' .. name)
  local open = (tonumber(cb[2]) or 0) > now and 1 or 0
  out[#out + 1] = {name, ws[i + 1], m, reqs, toks, redis.call('SISMEMBER', ns .. ':down', name),
                   tostring(age), tonumber(cb[1]) or 0, open}
end
return out
"""
)

# ARGV: ns, replica, worker, limit, tokens, lease, max_blocks, ttl, hash...
ACQUIRE = (
    "local ns, me, w = ARGV[1], ARGV[2], ARGV[3]\n"
    "local limit, tokens, lease = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])\n"
    "local maxb, ttl = tonumber(ARGV[7]), tonumber(ARGV[8])\n"
    + _NOW
    + "redis.call('ZADD', ns .. ':replicas', now, me)\n"
    + _PRUNE
    + """
local reqs = inflight(w)
if reqs >= limit then return 0 end
redis.call('HINCRBY', ns .. ':load:' .. me, 'r:' .. w, 1)
redis.call('HINCRBY', ns .. ':load:' .. me, 't:' .. w, tokens)
"""
    + "local first = 9\n"
)

_RECORD_BODY = """
local key = ns .. ':px:' .. w
for j = first, #ARGV do
  -- earlier blocks get the later timestamp, so eviction drops chain tails first (no holes)
  redis.call('ZADD', key, now - (j - first) * 1e-6, ARGV[j])
end
redis.call('ZREMRANGEBYSCORE', key, '-inf', now - ttl)
local n = redis.call('ZCARD', key)
if n > maxb then redis.call('ZREMRANGEBYRANK', key, 0, n - maxb - 1) end
redis.call('EXPIRE', key, math.ceil(ttl))
return 1
"""
ACQUIRE += _RECORD_BODY

# ARGV: ns, worker, max_blocks, ttl, hash...  (prefix records made while Redis was away)
RECORD = (
    "local ns, w, maxb, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])\n"
    + _NOW
    + "local first = 5\n"
    + _RECORD_BODY
)

# ARGV: ns, replica, worker, dreqs, dtokens  (counters floor at zero)
ADJUST = """
local k = ARGV[1] .. ':load:' .. ARGV[2]
for i, f in ipairs({'r:', 't:'}) do
  local v = redis.call('HINCRBY', k, f .. ARGV[3], ARGV[3 + i])
  if v < 0 then redis.call('HSET', k, f .. ARGV[3], 0) end
end
return 1
"""

# ARGV: ns, replica, field, value, field, value, ...  (overwrite own load with local truth)
RESYNC = (
    "local ns, me = ARGV[1], ARGV[2]\n"
    + _NOW
    + """
redis.call('DEL', ns .. ':load:' .. me)
for i = 3, #ARGV, 2 do redis.call('HSET', ns .. ':load:' .. me, ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', ns .. ':replicas', now, me)
return 1
"""
)

# ARGV: ns, worker, ok (0/1), failures, open_s  (the circuit breaker of router/breaker.py)
CIRCUIT = (
    "local ns, w, ok, limit, open_s = ARGV[1], ARGV[2], ARGV[3] == '1', tonumber(ARGV[4]), tonumber(ARGV[5])\n"
    + _NOW
    + """
if ok then
  redis.call('HDEL', ns .. ':cb', 'f:' .. w, 'o:' .. w)
  return 0
end
local f = redis.call('HINCRBY', ns .. ':cb', 'f:' .. w, 1)
if f >= limit then redis.call('HSET', ns .. ':cb', 'o:' .. w, tostring(now + open_s)) end
return f
"""
)

HEARTBEAT = "local ns, me = ARGV[1], ARGV[2]\n" + _NOW + "redis.call('ZADD', ns .. ':replicas', now, me)\nreturn 1"

_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


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
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.ns = namespace
        self.lease_s = lease_s
        self.replica = replica_id or uuid.uuid4().hex[:12]
        self.local = MemoryState(prefix, breaker=breaker)
        self.r = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False,
            decode_responses=False,
        )
        self._scripts = {
            n: self.r.register_script(s)
            for n, s in (("snap", SNAPSHOT), ("acq", ACQUIRE), ("adj", ADJUST), ("resync", RESYNC),
                         ("hb", HEARTBEAT), ("rec", RECORD), ("cb", CIRCUIT))
        }
        self._up = False
        self._version = 0  # bumped on every local load change; guards resync races
        self._missed: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=10_000)
        self._fails: dict[str, int] = {}  # breaker failure counts as of the last snapshot
        self.errors = 0
        self.resyncs = 0

    def __repr__(self) -> str:
        return f"RedisState(url={self.url!r}, replica={self.replica}, up={self._up})"

    @property
    def degraded(self) -> bool:
        return not self._up

    # -- connection management ----------------------------------------------------------
    def _lost(self, e: Exception) -> None:
        self.errors += 1
        if self._up:
            log.warning("redis unreachable (%s: %s); serving from local state", type(e).__name__, e)
        self._up = False

    async def start(self) -> None:
        await self.try_resync()

    async def close(self) -> None:
        await self.r.aclose()

    async def try_resync(self) -> bool:
        """Reconnect and push local truth to Redis; called by the heartbeat loop. True if up."""
        if self._up:
            try:
                await self._scripts["hb"](args=[self.ns, self.replica])
                return True
            except _REDIS_ERRORS as e:
                self._lost(e)
                return False
        try:
            await self.r.connection_pool.disconnect()  # drop connections to the dead server
            while True:
                v = self._version
                fields: list[object] = []
                for w in self.local.workers:
                    r, t = self.local.loads.get(w)
                    fields += [f"r:{w}", r, f"t:{w}", t]
                await self._scripts["resync"](args=[self.ns, self.replica, *fields])
                for spec in list(self.local.workers.values()):
                    await self.r.hsetnx(f"{self.ns}:workers", spec.name, json.dumps(spec.to_dict()))
                while self._missed:
                    w, hashes = self._missed[0]
                    await self._record(w, hashes)
                    self._missed.popleft()
                if v == self._version:
                    break
        except _REDIS_ERRORS as e:
            self._lost(e)
            return False
        self._up = True
        self.resyncs += 1
        log.warning("redis reachable at %s; state resynchronised (replica %s)", self.url, self.replica)
        return True

    async def _record(self, worker: str, hashes: Sequence[int]) -> None:
        await self._scripts["rec"](
            args=[self.ns, worker, self.prefix.max_blocks_per_worker, self.prefix.ttl_s, *hashes]
        )

    # -- workers ------------------------------------------------------------------------
    async def add_worker(self, spec: WorkerSpec) -> None:
        self.local.add_worker_sync(spec)
        if self._up:
            try:
                await self.r.hset(f"{self.ns}:workers", spec.name, json.dumps(spec.to_dict()))
            except _REDIS_ERRORS as e:
                self._lost(e)

    async def remove_worker(self, name: str) -> bool:
        found = self.local.remove_worker_sync(name)
        if self._up:
            try:
                n = await self.r.hdel(f"{self.ns}:workers", name)
                await self.r.delete(f"{self.ns}:px:{name}")
                await self.r.hdel(f"{self.ns}:cb", f"f:{name}", f"o:{name}")
                await self.r.srem(f"{self.ns}:down", name)
                found = found or n > 0
            except _REDIS_ERRORS as e:
                self._lost(e)
        return found

    async def list_workers(self) -> list[WorkerSpec]:
        return [s.spec for s in await self.snapshot(())]

    async def set_health(self, name: str, healthy: bool) -> None:
        await self.local.set_health(name, healthy)
        if self._up:
            try:
                key = f"{self.ns}:down"
                await (self.r.srem(key, name) if healthy else self.r.sadd(key, name))
            except _REDIS_ERRORS as e:
                self._lost(e)

    # -- routing ------------------------------------------------------------------------
    async def snapshot(self, hashes: Sequence[int]) -> list[WorkerState]:
        if self._up:
            try:
                rows = await self._scripts["snap"](args=[self.ns, self.prefix.ttl_s, self.lease_s, *hashes])
            except _REDIS_ERRORS as e:
                self._lost(e)
            else:
                out = []
                for name, spec_json, m, reqs, toks, down, age, fails, is_open in rows:
                    spec = WorkerSpec.from_dict(json.loads(spec_json))
                    if spec.name not in self.local.workers:
                        self.local.add_worker_sync(spec)  # learnt from another replica
                    self._fails[spec.name] = int(fails)
                    age_s = float(age)
                    out.append(WorkerState(spec, not down, int(m), int(reqs), int(toks),
                                           age_s if age_s >= 0 else float("inf"), bool(is_open)))
                known = {s.name for s in out}
                for gone in [w for w in self.local.workers if w not in known]:
                    self.local.remove_worker_sync(gone)  # removed through another replica
                return sorted(out, key=lambda s: s.name)
        return self.local.snapshot_sync(hashes)

    async def record_outcome(self, worker: str, ok: bool) -> None:
        self.local.record_outcome_sync(worker, ok)
        if not self._up or (ok and not self._fails.get(worker)):
            return  # nothing to reset: a success costs no round trip
        try:
            f = await self._scripts["cb"](args=[self.ns, worker, int(ok), self.local.breaker.failures,
                                                self.local.breaker.open_s])
            self._fails[worker] = int(f)
        except _REDIS_ERRORS as e:
            self._lost(e)

    async def forget_prefixes(self, worker: str) -> None:
        self.local.index.remove_worker(worker)
        if self._up:
            try:
                await self.r.delete(f"{self.ns}:px:{worker}")
            except _REDIS_ERRORS as e:
                self._lost(e)

    async def next_ticket(self) -> int:
        if self._up:
            try:
                return int(await self.r.incr(f"{self.ns}:rr"))
            except _REDIS_ERRORS as e:
                self._lost(e)
        return await self.local.next_ticket()

    async def acquire(self, worker: str, limit: int, work_ms: int, hashes: Sequence[int]) -> Lease | None:
        if self._up:
            try:
                ok = await self._scripts["acq"](args=[
                    self.ns, self.replica, worker, limit, work_ms, self.lease_s,
                    self.prefix.max_blocks_per_worker, self.prefix.ttl_s, *hashes,
                ])
            except _REDIS_ERRORS as e:
                self._lost(e)
            else:
                if not ok:
                    return None
                # mirror locally; the local limit check cannot refuse what Redis admitted
                self._version += 1
                return self.local.acquire_sync(worker, 1 << 60, work_ms, hashes)
        lease = self.local.acquire_sync(worker, limit, work_ms, hashes)
        if lease is not None:
            self._version += 1
            self._missed.append((worker, tuple(hashes)))
        return lease

    async def prefill_done(self, lease: Lease) -> None:
        if lease.prefilled or lease.released:
            return
        self.local.prefill_done_sync(lease)
        self._version += 1
        await self._adjust(lease.worker, 0, -lease.work_ms)

    async def release(self, lease: Lease) -> None:
        if lease.released:
            return
        dtok = 0 if lease.prefilled else -lease.work_ms
        self.local.release_sync(lease)
        self._version += 1
        await self._adjust(lease.worker, -1, dtok)

    async def _adjust(self, worker: str, dreqs: int, dtokens: int) -> None:
        if not self._up:
            return  # local truth is pushed on resync
        try:
            await self._scripts["adj"](args=[self.ns, self.replica, worker, dreqs, dtokens])
        except _REDIS_ERRORS as e:
            self._lost(e)


async def heartbeat_loop(state: RedisState, interval_s: float) -> None:
    """Keep this replica's lease alive and reconnect after an outage."""
    while True:
        await state.try_resync()
        await asyncio.sleep(interval_s)
