"""The wait queue: requests wait here when every eligible worker is at its limit.

Orders (``QueueOrder``):

- FCFS: arrival order.
- UNCACHED: fewest estimated uncached tokens first (shortest-prefill-first). Good
  for mean TTFT, but a long prompt can wait forever behind a stream of short ones.
- AGED: key(t) = min(uncached_tokens, cap) - aging_tokens_per_s * (t - arrival), with
  cap = aging_tokens_per_s * max_wait_s / 2. Every waiting request ages at the same
  rate, so the relative order of two requests never changes while both wait and the
  key reduces to the static ``min(uncached_tokens, cap) + aging_tokens_per_s *
  arrival`` (a plain heap works). Starvation-free: a request (u, a) is served before
  any request that arrives after a + min(u / aging_tokens_per_s, max_wait_s / 2),
  because that request's key exceeds min(u, cap) + rate*a even with zero uncached
  tokens; so at most the requests arriving in that window can overtake it. The cap
  keeps the window inside max_wait_s: without it a prompt of more than
  rate x max_wait_s uncached tokens (123K at the defaults) could be overtaken until
  it timed out.

Pure and clock-free: callers pass ``now``.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from router.config import QueueConfig, QueueOrder

T = TypeVar("T")


@dataclass(order=True)
class _Entry(Generic[T]):
    key: tuple[float, int]
    arrival: float = field(compare=False)
    uncached: int = field(compare=False)
    item: T = field(compare=False)
    live: bool = field(default=True, compare=False)


def order_key(cfg: QueueConfig, uncached: int, arrival: float) -> float:
    """The first part of ``PendingQueue.key``: what a request of ``uncached`` tokens arriving at
    ``arrival`` is ordered by. With wall-clock arrivals it compares across router replicas."""
    order = cfg.order
    if order is QueueOrder.FCFS:
        return arrival
    if order is QueueOrder.UNCACHED:
        return float(uncached)
    rate = cfg.aging_tokens_per_s
    return min(uncached, rate * cfg.max_wait_s / 2) + rate * arrival


def key_tolerance(cfg: QueueConfig, seconds: float) -> float:
    """``seconds`` of arrival time in key units (0 for UNCACHED, whose keys hold no time)."""
    if cfg.order is QueueOrder.FCFS:
        return seconds
    if cfg.order is QueueOrder.UNCACHED:
        return 0.0
    return cfg.aging_tokens_per_s * seconds


class PendingQueue(Generic[T]):
    """A priority queue of waiting items with cancellation and expiry."""

    def __init__(self, cfg: QueueConfig) -> None:
        self.cfg = cfg
        self._heap: list[_Entry[T]] = []
        self._fifo: list[_Entry[T]] = []  # arrival order, for expiry scans
        self._seq = itertools.count()
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def __repr__(self) -> str:
        return f"PendingQueue(order={self.cfg.order.value}, depth={self._live})"

    def key(self, uncached: int, arrival: float, seq: int) -> tuple[float, int]:
        return (order_key(self.cfg, uncached, arrival), seq)

    def full(self) -> bool:
        return self._live >= self.cfg.max_depth

    def push(self, item: T, uncached_tokens: int, now: float) -> _Entry[T]:
        """Add an item; returns a handle for ``cancel``. Raises OverflowError when full."""
        if self.full():
            raise OverflowError(f"wait queue is full ({self.cfg.max_depth} requests)")
        seq = next(self._seq)
        e = _Entry(self.key(uncached_tokens, now, seq), now, uncached_tokens, item)
        heapq.heappush(self._heap, e)
        self._fifo.append(e)
        self._live += 1
        return e

    def head_key(self) -> tuple[float, int] | None:
        """The key of the head (None when empty): heads of several queues compare by it."""
        self._drop_dead()
        return self._heap[0].key if self._heap else None

    def peek(self) -> T | None:
        self._drop_dead()
        return self._heap[0].item if self._heap else None

    def pop(self) -> T:
        """Remove and return the head. Raises IndexError when empty."""
        self._drop_dead()
        if not self._heap:
            raise IndexError("pop from an empty PendingQueue")
        e = heapq.heappop(self._heap)
        e.live = False
        self._live -= 1
        return e.item

    def cancel(self, handle: _Entry[T]) -> bool:
        """Remove a waiting item (e.g. its client went away). False if already gone."""
        if not handle.live:
            return False
        handle.live = False
        self._live -= 1
        return True

    @staticmethod
    def waiting(handle: _Entry[T]) -> bool:
        """The item of ``handle`` is still in the queue (not popped, cancelled or expired)."""
        return handle.live

    def expire(self, now: float) -> list[T]:
        """Remove and return every item that has waited longer than max_wait_s."""
        out: list[T] = []
        limit = now - self.cfg.max_wait_s
        k = 0
        while k < len(self._fifo) and self._fifo[k].arrival <= limit:
            e = self._fifo[k]
            if e.live:
                e.live = False
                self._live -= 1
                out.append(e.item)
            k += 1
        if k:
            del self._fifo[:k]
        return out

    def oldest_arrival(self) -> float | None:
        for e in self._fifo:
            if e.live:
                return e.arrival
        return None

    def _drop_dead(self) -> None:
        while self._heap and not self._heap[0].live:
            heapq.heappop(self._heap)
        if len(self._fifo) > 64 and len(self._fifo) > 2 * self._live:
            self._fifo = [e for e in self._fifo if e.live]
