"""Prometheus metrics of one router replica, on a registry of its own (several
replicas can live in one process, as they do in the tests)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.state_base import WorkerState


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("gcache_router_requests", "HTTP requests by route and status (\"cut\": a "
                                "stream the worker cut or stalled mid-way, after its 200 head went out)",
                                ["route", "status"], registry=r)
        self.decisions = Counter("gcache_router_decisions", "Routing decisions by policy and reason",
                                 ["policy", "reason"], registry=r)
        self.rejected = Counter("gcache_router_rejected", "Requests refused by the router, by reason",
                                ["reason"], registry=r)
        self.retries = Counter("gcache_router_retries", "Requests sent to another worker because the "
                               "chosen one was never reached (refused, reset, connect timeout)", registry=r)
        self.queue_depth = Gauge("gcache_router_queue_depth", "Requests waiting for a worker slot",
                                 registry=r)
        self.queue_wait = Histogram("gcache_router_queue_wait_seconds", "Time requests waited in the queue",
                                    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r)
        self.prompt_tokens = Counter("gcache_router_prompt_tokens", "Prompt tokens routed (estimated)",
                                     registry=r)
        self.cached_tokens = Counter("gcache_router_estimated_cached_tokens",
                                     "Prompt tokens the chosen worker is believed to hold", registry=r)
        self.hit_rate = Gauge("gcache_router_estimated_prefix_hit_rate",
                              "estimated_cached_tokens / prompt_tokens since start", registry=r)
        self.worker_inflight = Gauge("gcache_router_worker_inflight_requests",
                                     "In-flight requests per worker (all replicas)", ["worker"], registry=r)
        self.worker_pending = Gauge("gcache_router_worker_pending_prefill_ms",
                                    "Estimated prefill work sent and not yet answered (ms)", ["worker"], registry=r)
        self.worker_healthy = Gauge("gcache_router_worker_healthy", "1 if the worker passes health checks",
                                    ["worker"], registry=r)
        self.redis_up = Gauge("gcache_router_redis_up",
                              "1 when shared state in Redis is reachable, 0 when serving from local state",
                              registry=r)
        self.redis_errors = Gauge("gcache_router_redis_errors", "Redis calls that failed since start",
                                  registry=r)
        self._prompt = 0
        self._cached = 0
        self._children: dict[tuple, object] = {}  # labels() costs tens of microseconds: look each up once
        # The request path only bumps these plain counts; render() moves them into the registry.
        self._requests: dict[tuple[str, int | str], int] = {}
        self._decisions: dict[tuple[str, str], int] = {}
        self._synced: dict[tuple, int] = {}
        self._synced_prompt = 0
        self._synced_cached = 0

    def child(self, metric, *labels: str):
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def count_request(self, route: str, status: int | str) -> None:
        k = (route, status)
        self._requests[k] = self._requests.get(k, 0) + 1

    def routed(self, policy: str, reason: str, prompt_tokens: int, cached_tokens: int) -> None:
        k = (policy, reason)
        self._decisions[k] = self._decisions.get(k, 0) + 1
        self._prompt += prompt_tokens
        self._cached += cached_tokens

    def _sync(self) -> None:
        for metric, counts in ((self.requests, self._requests), (self.decisions, self._decisions)):
            for labels, n in list(counts.items()):
                key = (id(metric), *labels)
                d = n - self._synced.get(key, 0)
                if d:
                    self.child(metric, *map(str, labels)).inc(d)
                    self._synced[key] = n
        self.prompt_tokens.inc(self._prompt - self._synced_prompt)
        self.cached_tokens.inc(self._cached - self._synced_cached)
        self._synced_prompt, self._synced_cached = self._prompt, self._cached
        if self._prompt:
            self.hit_rate.set(self._cached / self._prompt)

    def set_workers(self, states: list[WorkerState], worker_id: Callable[[str], str]) -> None:
        """Per-worker gauges, labelled with the worker id (GET /admin/workers maps ids to URLs)."""
        for g in (self.worker_inflight, self.worker_pending, self.worker_healthy):
            g.clear()
        for s in states:
            wid = worker_id(s.name)
            self.worker_inflight.labels(wid).set(s.inflight_requests)
            self.worker_pending.labels(wid).set(s.pending_ms)
            self.worker_healthy.labels(wid).set(1 if s.healthy else 0)

    def render(self) -> bytes:
        self._sync()
        return generate_latest(self.registry)
