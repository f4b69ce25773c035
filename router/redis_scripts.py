"""Lua scripts of the Redis state backend (router/state_redis.py); all run on Redis's clock.

Keys (``ns`` = namespace)::

    ns:workers          HASH  worker name -> JSON WorkerSpec
    ns:down             SET   workers failing health checks
    ns:cb               HASH  f:<worker> consecutive failures, o:<worker> circuit open until (Redis time)
    ns:px:<worker>      ZSET  block hash -> last-seen time (bounded, TTL): the approximate prefix index
    ns:load:<replica>   HASH  r:<worker> in-flight requests, t:<worker> pending prefill work (ms)
    ns:replicas         ZSET  replica id -> last heartbeat. A replica missing from it has no load
                              hash (its lease expired and another replica dropped both, or Redis
                              restarted empty): its SYNC and HEARTBEAT calls refuse to run
                              (``LEASELOST``, 0) until it resyncs (``RESYNC`` re-adds it)
    ns:rr               INT   round-robin ticket
    ns:q:<replica>      HASH  JSON [bucket, model] -> the replica's head waiter's order key (wall
                              clock); expires (PEXPIRE) unless the replica's calls refresh it
    ns:wake:<replica>   pub/sub channel: another replica left this one a slot
"""

_NOW = "local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1e6\n"

_RECORD = """
local function record(w, first, last)
  local key = ns .. ':px:' .. w
  local args = {}
  for j = first, last do
    -- earlier blocks get the later timestamp, so eviction drops chain tails first (no holes)
    args[#args + 1] = now - (j - first) * 1e-6
    args[#args + 1] = ARGV[j]
    if #args >= 1000 then redis.call('ZADD', key, unpack(args)); args = {} end
  end
  if #args > 0 then redis.call('ZADD', key, unpack(args)) end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - ttl)
  local n = redis.call('ZCARD', key)
  if n > maxb then redis.call('ZREMRANGEBYRANK', key, 0, n - maxb - 1) end
  redis.call('EXPIRE', key, math.ceil(ttl))
end
"""

# The one call a request makes, shared by every request of one event-loop turn. ARGV: ns, me,
# ttl, lease_s, max_blocks, mode (0 flush only, 1 snapshots, 3 strict acquire), breaker
# failures, breaker open_s, k, then k op arguments, then
#   mode 1: q, then per request: want_ticket (0/1), n, its n block hashes. Returns
#           {rows, per_request, heads}: rows = {name, spec, reqs, work, down, fails, open} per
#           worker (other replicas' load), per_request = {ticket, {match, age, match, age, ...}}
#           in the order of rows, heads = {replica, {field, key, ...}, ...} the other replicas'
#           published queue heads;
#   mode 3: worker, limit, work, n, then the n hashes: admit only if every replica together
#           has fewer than limit in flight on the worker; returns 1 or 0.
# Ops (this replica's changes since its last call):
#   A w work n h1..hn   a request admitted: +1 request, +work, its n block hashes recorded
#   D w dreqs dwork     a request's counts adjusted (first byte, finished)
#   C w ok              a circuit-breaker outcome (ok = 1 success, 0 failure)
#   R w n h1..hn        block hashes recorded while Redis was unreachable
#   Q ms n f1 k1..fn kn this replica's queue heads (field: JSON [bucket, model], key: its order
#                       key on wall-clock time) replace ns:q:<me>, which expires after ms
#                       unless a later call refreshes it (every call carries Q while any wait)
#   W r                 PUBLISH ns:wake:<r>: a slot replica r is owed is free (after the ops
#                       above, so r's next snapshot sees it)
# Counts may go transiently negative (two calls on two connections can be applied out of
# order); readers clamp the sums at zero. A replica not in ns:replicas gets the error LEASELOST
# and nothing is applied: its ops are deltas on a load hash that no longer exists.
SYNC = (
    "local ns, me, ttl, lease = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])\n"
    "local maxb, mode, cbf, cbo = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])\n"
    + _NOW
    + _RECORD
    + """
if not redis.call('ZSCORE', ns .. ':replicas', me) then return redis.error_reply('LEASELOST ' .. me) end
redis.call('ZADD', ns .. ':replicas', now, me)
local load = ns .. ':load:' .. me
local i, stop = 10, 9 + tonumber(ARGV[9])
while i <= stop do
  local op, w = ARGV[i], ARGV[i + 1]
  if op == 'A' then
    redis.call('HINCRBY', load, 'r:' .. w, 1)
    redis.call('HINCRBY', load, 't:' .. w, ARGV[i + 2])
    local n = tonumber(ARGV[i + 3])
    if n > 0 then record(w, i + 4, i + 3 + n) end
    i = i + 4 + n
  elseif op == 'D' then
    redis.call('HINCRBY', load, 'r:' .. w, ARGV[i + 2])
    redis.call('HINCRBY', load, 't:' .. w, ARGV[i + 3])
    i = i + 4
  elseif op == 'C' then
    if ARGV[i + 2] == '1' then
      redis.call('HDEL', ns .. ':cb', 'f:' .. w, 'o:' .. w)
    elseif redis.call('HINCRBY', ns .. ':cb', 'f:' .. w, 1) >= cbf then
      redis.call('HSET', ns .. ':cb', 'o:' .. w, tostring(now + cbo))
    end
    i = i + 3
  elseif op == 'Q' then
    local hk, n = ns .. ':q:' .. me, tonumber(ARGV[i + 2])
    redis.call('DEL', hk)
    if n > 0 then
      for j = i + 3, i + 1 + 2 * n, 2 do redis.call('HSET', hk, ARGV[j], ARGV[j + 1]) end
      redis.call('PEXPIRE', hk, ARGV[i + 1])
    end
    i = i + 3 + 2 * n
  elseif op == 'W' then
    redis.call('PUBLISH', ns .. ':wake:' .. w, me)
    i = i + 2
  else -- 'R'
    local n = tonumber(ARGV[i + 2])
    if n > 0 then record(w, i + 3, i + 2 + n) end
    i = i + 3 + n
  end
end
if mode == 0 then return {} end
local stale = redis.call('ZRANGEBYSCORE', ns .. ':replicas', '-inf', now - lease)
for _, r in ipairs(stale) do
  redis.call('DEL', ns .. ':load:' .. r, ns .. ':q:' .. r)
  redis.call('ZREM', ns .. ':replicas', r)
end
if mode == 3 then
  local w, limit = ARGV[stop + 1], tonumber(ARGV[stop + 2])
  local total = 0
  for _, r in ipairs(redis.call('ZRANGE', ns .. ':replicas', 0, -1)) do
    total = total + (tonumber(redis.call('HGET', ns .. ':load:' .. r, 'r:' .. w)) or 0)
  end
  if total >= limit then return 0 end
  redis.call('HINCRBY', load, 'r:' .. w, 1)
  redis.call('HINCRBY', load, 't:' .. w, ARGV[stop + 3])
  local n = tonumber(ARGV[stop + 4])
  if n > 0 then record(w, stop + 5, stop + 4 + n) end
  return 1
end
local others, heads = {}, {}
for _, r in ipairs(redis.call('ZRANGE', ns .. ':replicas', 0, -1)) do
  if r ~= me then
    others[#others + 1] = ns .. ':load:' .. r
    local h = redis.call('HGETALL', ns .. ':q:' .. r)
    if #h > 0 then heads[#heads + 1] = r; heads[#heads + 1] = h end
  end
end
local ws = redis.call('HGETALL', ns .. ':workers')
local rows, names = {}, {}
for a = 1, #ws, 2 do
  local name = ws[a]
  local reqs, work = 0, 0
  for _, k in ipairs(others) do
    local v = redis.call('HMGET', k, 'r:' .. name, 't:' .. name)
    reqs = reqs + (tonumber(v[1]) or 0)
    work = work + (tonumber(v[2]) or 0)
  end
  local cb = redis.call('HMGET', ns .. ':cb', 'f:' .. name, 'o:' .. name)
  names[#names + 1] = name
  rows[#rows + 1] = {name, ws[a + 1], reqs, work, redis.call('SISMEMBER', ns .. ':down', name),
                     tonumber(cb[1]) or 0, (tonumber(cb[2]) or 0) > now and 1 or 0}
end
-- per request: a round-robin ticket if asked, then (match, age) per worker for its hashes
local out = {}
local j = stop + 2
for q = 1, tonumber(ARGV[stop + 1]) do
  local n = tonumber(ARGV[j + 1])
  local ticket = 0
  if ARGV[j] == '1' then ticket = redis.call('INCR', ns .. ':rr') end
  local ms = {}
  for _, name in ipairs(names) do
    local m, key, age = 0, ns .. ':px:' .. name, -1
    for h = j + 2, j + 1 + n do
      local s = redis.call('ZSCORE', key, ARGV[h])
      if (not s) or tonumber(s) < now - ttl then break end
      m = m + 1
      age = now - tonumber(s)
    end
    ms[#ms + 1] = m
    ms[#ms + 1] = tostring(age)
  end
  out[#out + 1] = {ticket, ms}
  j = j + 2 + n
end
return {rows, out, heads}
"""
)

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

# ARGV: ns, replica. 1, or 0 if the replica lost its lease (then it must RESYNC)
HEARTBEAT = (
    "local ns, me = ARGV[1], ARGV[2]\n"
    + _NOW
    + """
if not redis.call('ZSCORE', ns .. ':replicas', me) then return 0 end
redis.call('ZADD', ns .. ':replicas', now, me)
return 1
"""
)
