"""One KV event subscriber per worker that has a ``kv_events`` endpoint, kept in step with
the worker list, and the exact index they feed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

from router.config import WorkerSpec
from router.kv_index import ExactIndex
from router.kv_subscriber import KvEventSubscriber
from router.request import ParsedRequest

log = logging.getLogger("gcache.router.kv_events")


class KvFleet:
    def __init__(self, page_tokens: int, on_restart: Callable[[str], Awaitable[None]]) -> None:
        self.page_tokens = page_tokens
        self.index = ExactIndex(page_tokens)
        self.on_restart = on_restart
        self.subs: dict[str, tuple[KvEventSubscriber, asyncio.Task]] = {}

    def __repr__(self) -> str:
        return f"KvFleet({sorted(self.subs)}, {self.index!r})"

    def reconcile(self, specs: Iterable[WorkerSpec]) -> None:
        """Start a subscriber for every worker that publishes; stop those of workers gone."""
        want = {s.name: s for s in specs if s.kv_events}
        for name in [n for n in self.subs if n not in want or self.subs[n][0].endpoint != want[n].kv_events]:
            self._stop(name)
        loop = asyncio.get_running_loop()
        for name, spec in want.items():
            if name not in self.subs:
                sub = KvEventSubscriber(name, spec.kv_events, self.index, spec.kv_replay, spec.kv_topic,
                                        self.on_restart)
                task = loop.create_task(sub.run(), name=f"kv-events {name}")
                task.add_done_callback(self._died)
                self.subs[name] = (sub, task)

    def _died(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("KV event subscriber %s stopped: %r", task.get_name(), task.exception())

    def _stop(self, name: str) -> None:
        _sub, task = self.subs.pop(name)
        task.cancel()
        self.index.clear(name)

    def match(self, req: ParsedRequest) -> dict[str, int]:
        """Prompt tokens each publishing worker holds (workers that published nothing yet are
        left to the approximate index)."""
        return {name: self.index.match(name, req.page_hashes) * self.page_tokens
                for name, (sub, _) in self.subs.items() if sub.live}

    async def close(self) -> None:
        tasks = [t for _, t in self.subs.values()]
        for name in list(self.subs):
            self._stop(name)
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
