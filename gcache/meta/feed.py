"""The membership as a master serves it: encoded once per epoch, shared by every watcher.

``MembershipFeed`` lives on the master's event loop. Raft applies commands on its own thread and
calls ``changed()`` (thread-safe); the feed then re-reads the table, and if the epoch moved,
encodes the membership once and wakes the watchers. Waking thousands of streams at once would
hold the loop (and grpc's completion queue) for the whole fan-out, so heartbeats and new
clients would queue behind it: the watchers are woken in slices with a short pause between
them, which keeps every other RPC's wait to about one slice.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gcache.meta import rpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    epoch: int
    encoded: bytes  # msgpack of the membership, as GetMembership and WatchMembership send it


@dataclass(frozen=True)
class FanOut:
    """``slice``: watchers woken per step; ``pause_s``: the loop's breathing room between steps."""

    slice: int = 64
    pause_s: float = 0.005


class MembershipFeed:
    def __init__(self, read: Callable[[], dict[str, Any]], fan_out: FanOut = FanOut()) -> None:
        """``read``: returns the table's current membership (takes the table's lock)."""
        self._read = read
        self.fan_out = fan_out
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = threading.Event()  # a refresh is scheduled
        self._waiters: list[asyncio.Future] = []
        self._epoch_waiters: list[tuple[int, asyncio.Future]] = []
        self.current = self._encode(read())
        self.published = 0  # epochs published (for metrics)
        self.watchers = 0

    @staticmethod
    def _encode(m: dict[str, Any]) -> Snapshot:
        return Snapshot(int(m["epoch"]), rpc.pack(m))

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    # -- producer side ------------------------------------------------------------------------
    def changed(self) -> None:
        """The table changed (any thread). Coalesces bursts into one refresh."""
        loop = self._loop
        if loop is None or self._pending.is_set():
            return
        self._pending.set()
        try:
            loop.call_soon_threadsafe(self._refresh)
        except RuntimeError:  # the loop is closed: the master is stopping
            pass

    def _refresh(self) -> None:
        self._pending.clear()
        m = self._read()
        if int(m["epoch"]) == self.current.epoch:
            return
        self.current = self._encode(m)
        self.published += 1
        waiters, self._waiters = self._waiters, []
        asyncio.get_running_loop().create_task(self._wake(waiters))
        still = []
        for at_least, fut in self._epoch_waiters:
            if self.current.epoch >= at_least:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((at_least, fut))
        self._epoch_waiters = still

    async def _wake(self, waiters: list[asyncio.Future]) -> None:
        step = max(1, self.fan_out.slice)
        for i in range(0, len(waiters), step):
            for fut in waiters[i:i + step]:
                if not fut.done():
                    fut.set_result(None)
            if i + step < len(waiters):
                await asyncio.sleep(self.fan_out.pause_s)

    # -- consumer side ------------------------------------------------------------------------
    async def next_after(self, known: int) -> Snapshot:
        """The membership, as soon as its epoch differs from ``known``."""
        while self.current.epoch == known:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
        return self.current

    async def at_least(self, epoch: int, timeout_s: float) -> Snapshot:
        """The membership once this master has applied ``epoch`` (a follower applies a committed
        command shortly after the leader); the current one after ``timeout_s`` regardless."""
        if self.current.epoch < epoch:
            self.changed()  # the apply may have happened before this call: look again
            fut = asyncio.get_running_loop().create_future()
            self._epoch_waiters.append((epoch, fut))
            try:
                await asyncio.wait_for(fut, timeout_s)
            except TimeoutError:
                log.warning("epoch %d not applied here within %.1fs", epoch, timeout_s)
        return self.current
