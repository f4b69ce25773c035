"""Health checks: GET <worker>/health; ``failures`` misses in a row mark a worker
down, one success brings it back. The checker only reports; the state decides."""

from __future__ import annotations

import asyncio
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
        self.timeout = aiohttp.ClientTimeout(total=min(timeout_s, interval_s * 2))
        self.misses: dict[str, int] = {}
        self.down: set[str] = set()

    def __repr__(self) -> str:
        return f"HealthChecker(down={sorted(self.down)}, misses={self.misses})"

    async def probe(self, url: str) -> bool:
        try:
            async with self.session.get(url + "/health", timeout=self.timeout) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def check_once(self) -> None:
        workers = await self.state.list_workers()
        results = await asyncio.gather(*(self.probe(w.name) for w in workers))
        for w, ok in zip(workers, results, strict=True):
            await self.report(w.name, ok)

    async def report(self, name: str, ok: bool) -> None:
        """Count a success or a failure (also called by the proxy on connection errors)."""
        if ok:
            self.misses[name] = 0
            if name in self.down:
                self.down.discard(name)
                log.warning("worker %s is healthy again", name)
            await self.state.set_health(name, True)
            return
        self.misses[name] = self.misses.get(name, 0) + 1
        if self.misses[name] >= self.failures:
            if name not in self.down:
                log.warning("worker %s failed %d health checks; removing it from routing", name, self.misses[name])
            self.down.add(name)
            await self.state.set_health(name, False)

    async def run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.interval_s)
