"""What a master's front measures about itself, for ``Status``: how late its event loop runs
(a coroutine that asks to wake every ``LAG_TICK_S`` notes how much later it did) and how long a
new watch stream waits from its handler's start to its first message being written.

Both are reset by each reading (``take``), so a poller gets the figures of its own window.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

LAG_TICK_S = 0.005


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    s = sorted(values)
    return {"n": len(s), "p50": round(s[len(s) // 2] * 1e3, 2), "p99": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3, 2),
            "max": round(s[-1] * 1e3, 2)}


class FrontStats:
    def __init__(self) -> None:
        self.first_message: list[float] = []  # seconds, per new watch stream
        self.lag: list[float] = []  # seconds late, per tick
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _tick(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(LAG_TICK_S)
            self.lag.append(max(0.0, time.perf_counter() - t0 - LAG_TICK_S))
            if len(self.lag) > 100_000:  # nobody reads them: keep the last half
                del self.lag[:50_000]

    def first_written(self, started: float) -> None:
        self.first_message.append(time.perf_counter() - started)
        if len(self.first_message) > 100_000:
            del self.first_message[:50_000]

    def take(self) -> dict[str, Any]:
        """The figures since the last ``take`` (milliseconds), and a fresh window."""
        out = {"watch_first_ms": _summary(self.first_message), "loop_lag_ms": _summary(self.lag)}
        self.first_message, self.lag = [], []
        return out
