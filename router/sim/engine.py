"""The discrete-event engine: arrivals, per-worker prefill (serial) and decode
(concurrent), a router built from the proxy's own classes (policy, MemoryState
with its PrefixIndex and LoadTable, BucketMap, PendingQueue, decide.plan).

Deterministic: no randomness; events at equal times run in insertion order.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gcache.mooncake_trace import TraceRequest
from router.buckets import BucketMap
from router.config import (
    DEFAULT_MAX_INFLIGHT,
    BucketConfig,
    PolicyConfig,
    PrefixConfig,
    QueueConfig,
    WorkerSpec,
)
from router.decide import Outcome, plan
from router.policies import make_policy
from router.queue import PendingQueue
from router.sim.costmodel import CostModel
from router.state_base import Lease
from router.state_memory import MemoryState


@dataclass(frozen=True)
class SimConfig:
    """One simulated fleet. cache_blocks is each worker's prefix-cache capacity in
    512-token blocks; the router's index is bounded to the same size by default."""

    policy: str = "min_ttft"
    policy_cfg: PolicyConfig = field(default_factory=PolicyConfig)
    queue: QueueConfig = field(default_factory=lambda: QueueConfig(max_wait_s=3600.0))
    workers: int = 8
    cache_blocks: int = 8192
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    block_tokens: int = 512
    speedup: float = 1.0
    long_threshold: int = 32768
    buckets: BucketConfig = field(default_factory=BucketConfig)
    worker_buckets: tuple[int | None, ...] | None = None
    index_blocks: int | None = None
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        if self.workers <= 0:
            raise ValueError("workers must be > 0")
        if self.cache_blocks <= 0:
            raise ValueError("cache_blocks must be > 0")
        if self.max_inflight <= 0:
            raise ValueError("max_inflight must be > 0")
        if self.speedup <= 0:
            raise ValueError("speedup must be > 0")
        if self.worker_buckets is not None and len(self.worker_buckets) != self.workers:
            raise ValueError("worker_buckets must give one bucket (or None) per worker")


class SimWorker:
    """A worker's ground truth: an LRU prefix cache of block ids and its prefill queue."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.prefill_q: deque[int] = deque()
        self.busy = False
        self.decoding = 0

    def match(self, hash_ids: Sequence[int]) -> int:
        n = 0
        for h in hash_ids:
            if h not in self.cache:
                break
            n += 1
        return n

    def insert(self, hash_ids: Sequence[int]) -> None:
        for h in hash_ids:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)


_ARRIVE, _PREFILL_DONE, _DECODE_DONE = 0, 1, 2


def simulate(trace: Sequence[TraceRequest], cfg: SimConfig) -> dict:
    """Replay ``trace``; returns a flat dict of metrics (see ``summarize``)."""
    n = len(trace)
    names = [f"w{i:02d}" for i in range(cfg.workers)]
    wb = cfg.worker_buckets or (None,) * cfg.workers
    clock = [0.0]
    state = MemoryState(
        PrefixConfig(cfg.block_tokens, max_blocks_per_worker=cfg.index_blocks or cfg.cache_blocks, ttl_s=1e9),
        clock=lambda: clock[0],
    )
    for name, b in zip(names, wb, strict=True):
        state.add_worker_sync(WorkerSpec(f"http://{name}", bucket=b, max_inflight=cfg.max_inflight))
    spec_name = {f"http://{nm}": nm for nm in names}
    workers = {f"http://{nm}": SimWorker(nm, cfg.cache_blocks) for nm in names}
    policy = make_policy(cfg.policy, cfg.policy_cfg)
    buckets = BucketMap(cfg.buckets)
    queues: dict[int, PendingQueue[int]] = {}
    ticket = itertools.count()

    arrival = np.array([r.arrival_s / cfg.speedup for r in trace])
    ttft = np.full(n, np.nan)
    cached = np.zeros(n, dtype=np.int64)
    est_cached = np.zeros(n, dtype=np.int64)
    waits = np.zeros(n)
    done_at = np.full(n, np.nan)
    leases: dict[int, Lease] = {}
    reasons: Counter[str] = Counter()
    rejected = 0
    per_worker: Counter[str] = Counter()

    events: list[tuple[float, int, int, int, str]] = []
    seq = itertools.count()
    for i in range(n):
        heapq.heappush(events, (arrival[i], next(seq), _ARRIVE, i, ""))

    def try_route(i: int, now: float):
        r = trace[i]
        snap = state.snapshot_sync(r.hash_ids)
        return plan(policy, buckets, snap, r.input_length, len(r.hash_ids), cfg.block_tokens, next(ticket),
                    r.hash_ids[-1] if r.hash_ids else i)

    def dispatch(i: int, p, now: float) -> None:
        r = trace[i]
        d = p.decision
        lease = state.acquire_sync(d.worker, cfg.max_inflight, p.work_ms, r.hash_ids)
        assert lease is not None  # plan() only returns workers below their limit
        leases[i] = lease
        reasons[d.reason.value] += 1
        per_worker[spec_name[d.worker]] += 1
        est_cached[i] = r.input_length - p.uncached_tokens
        waits[i] = now - arrival[i]
        w = workers[d.worker]
        w.prefill_q.append(i)
        if not w.busy:
            start_prefill(w, d.worker, now)

    def start_prefill(w: SimWorker, key: str, now: float) -> None:
        i = w.prefill_q.popleft()
        r = trace[i]
        hit = min(w.match(r.hash_ids) * cfg.block_tokens, r.input_length)
        cached[i] = hit
        w.busy = True
        dur = cfg.cost.prefill_s(max(1, r.input_length - hit))
        heapq.heappush(events, (now + dur, next(seq), _PREFILL_DONE, i, key))

    def pump(now: float) -> None:
        nonlocal rejected
        for q in queues.values():
            rejected += len(q.expire(now))
            while len(q):
                i = q.peek()
                if i is None:  # only expired entries were left
                    break
                p = try_route(i, now)
                if p.outcome is Outcome.FULL:
                    break
                q.pop()
                if p.outcome is Outcome.NO_WORKER:
                    rejected += 1
                else:
                    dispatch(i, p, now)

    while events:
        now, _, kind, i, key = heapq.heappop(events)
        clock[0] = now
        if kind == _ARRIVE:
            p = try_route(i, now)
            q = queues.get(p.bucket)
            if p.outcome is Outcome.NO_WORKER:
                rejected += 1
            elif p.outcome is Outcome.ROUTED and not q:
                dispatch(i, p, now)
            else:
                q = queues.setdefault(p.bucket, PendingQueue(cfg.queue))
                q.push(i, p.uncached_tokens, now)
                pump(now)
        elif kind == _PREFILL_DONE:
            w = workers[key]
            r = trace[i]
            ttft[i] = now - arrival[i]
            w.insert(r.hash_ids)
            state.prefill_done_sync(leases[i])
            w.busy = False
            w.decoding += 1
            heapq.heappush(events, (now + cfg.cost.decode_s(r.output_length, w.decoding), next(seq),
                                    _DECODE_DONE, i, key))
            if w.prefill_q:
                start_prefill(w, key, now)
        else:
            workers[key].decoding -= 1
            state.release_sync(leases.pop(i))
            done_at[i] = now
            pump(now)

    return summarize(trace, cfg, arrival, ttft, cached, est_cached, waits, done_at, reasons, rejected, per_worker)


def _pct(x: np.ndarray, q: float) -> float:
    x = x[~np.isnan(x)]
    return float(np.percentile(x, q)) if len(x) else float("nan")


def summarize(trace, cfg, arrival, ttft, cached, est_cached, waits, done_at, reasons, rejected, per_worker) -> dict:
    inp = np.array([r.input_length for r in trace], dtype=np.int64)
    out = np.array([r.output_length for r in trace], dtype=np.int64)
    ok = ~np.isnan(done_at)
    long = inp >= cfg.long_threshold
    span = float(np.nanmax(done_at) - arrival.min()) if ok.any() else float("nan")
    return {
        "policy": cfg.policy,
        "queue": cfg.queue.order.value,
        "workers": cfg.workers,
        "cache_blocks": cfg.cache_blocks,
        "max_inflight": cfg.max_inflight,
        "speedup": cfg.speedup,
        "requests": len(trace),
        "completed": int(ok.sum()),
        "rejected": int(rejected),
        "hit_rate": float(cached[ok].sum() / max(1, inp[ok].sum())),
        "est_hit_rate": float(est_cached[ok].sum() / max(1, inp[ok].sum())),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99),
        "ttft_p50_long_s": _pct(ttft[long], 50),
        "ttft_p90_long_s": _pct(ttft[long], 90),
        "ttft_p99_long_s": _pct(ttft[long], 99),
        "long_requests": int(long.sum()),
        "throughput_tok_s": float((inp[ok].sum() + out[ok].sum()) / span) if span > 0 else float("nan"),
        "max_wait_s": float(waits.max()) if len(waits) else 0.0,
        "mean_wait_s": float(waits.mean()) if len(waits) else 0.0,
        "reasons": dict(sorted(reasons.items())),
        "per_worker": dict(sorted(per_worker.items())),
    }
