"""Health checks: GET <worker>/health; ``failures`` misses in a row mark a worker
down, one success brings it back. The checker only reports; the state decides.

A worker that comes back after being down, or whose /health answer carries a different
``instance_id`` (a JSON field or an ``X-Instance-Id`` header; SGLang sends neither) than
before, restarted with an empty cache: the index forgets everything it credited it with.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from router.state_base import RouterState

log = logging.getLogger("gcache.router.health")


class HealthChecker:
    def __init__(self, state: RouterState, session: aiohttp.ClientSession, interval_s: float,
                 failures: int, timeout_s: float = 2.0) -> None:
        self.state = state
        self.session = session
        self.interval_s = interval_s
        self.failures = failures
        self.timeout = aiohttp.ClientTimeout(total=min(timeout_s, max(interval_s * 2, 1.0)))
        self.misses: dict[str, int] = {}
        self.down: set[str] = set()
        self.instance: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"HealthChecker(down={sorted(self.down)}, misses={self.misses})"

    async def probe(self, url: str) -> tuple[bool, str | None]:
        """(healthy, instance id if the worker tells one)."""
        try:
            async with self.session.get(url + "/health", timeout=self.timeout) as r:
                raw = await r.read()
                return r.status == 200, r.headers.get("X-Instance-Id") or _instance_field(raw)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False, None

    async def check_once(self) -> None:
        workers = await self.state.list_workers()
        results = await asyncio.gather(*(self.probe(w.name) for w in workers))
        for w, (ok, instance) in zip(workers, results, strict=True):
            await self.report(w.name, ok, instance)

    async def report(self, name: str, ok: bool, instance: str | None = None) -> None:
        """Count a success or a failure (also called by the proxy on connection errors)."""
        if ok:
            self.misses[name] = 0
            before = self.instance.get(name)
            if instance is not None:
                self.instance[name] = instance
            if name in self.down or (instance is not None and before is not None and before != instance):
                why = "is healthy again" if name in self.down else f"restarted (instance {before} -> {instance})"
                log.warning("worker %s %s; forgetting the prefixes it held", name, why)
                self.down.discard(name)
                await self.state.forget_prefixes(name)
            await self.state.set_health(name, True)
            return
        self.misses[name] = self.misses.get(name, 0) + 1
        if self.misses[name] >= self.failures:
            if name not in self.down:
                log.warning("worker %s failed %d health checks; removing it from routing", name, self.misses[name])
            self.down.add(name)
            await self.state.set_health(name, False)

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            await self.check_once()
            await asyncio.sleep(self.interval_s)


def _instance_field(raw: bytes) -> str | None:
    if not raw.startswith(b"{"):
        return None
    try:
        v = json.loads(raw).get("instance_id")
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return str(v) if v is not None else None
