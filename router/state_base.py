"""The routing-state interface shared by the in-memory and the Redis backends.

Everything a router replica decides from lives behind this interface: the
worker list and health, the approximate prefix index, the in-flight load and
the round-robin ticket. One concurrency model: every method is a coroutine.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.config import WorkerSpec


# not frozen: built per request, and a frozen dataclass costs several times as much to build
@dataclass(slots=True)
class WorkerState:
    """A worker as seen at one instant: its spec, health, prefix match and load
    (in-flight requests, and pending prefill work in estimated milliseconds)."""

    spec: WorkerSpec
    healthy: bool
    matched_blocks: int
    inflight_requests: int
    pending_ms: int
    match_age_s: float = float("inf")  # since the last matched block was last requested
    circuit_open: bool = False  # the circuit breaker keeps requests away for now

    @property
    def routable(self) -> bool:
        return self.healthy and not self.circuit_open

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def bucket(self) -> int | None:
        return self.spec.bucket


@dataclass
class Lease:
    """One admitted request's share of a worker's load; released exactly once."""

    worker: str
    work_ms: int
    prefilled: bool = False
    released: bool = False
    probe: object = None  # the half-open circuit's probe token this request holds, if any


@dataclass
class LoadTable:
    """Plain per-worker counters (requests, pending prefill work in ms); never negative."""

    reqs: dict[str, int] = field(default_factory=dict)
    work: dict[str, int] = field(default_factory=dict)

    def add(self, worker: str, dreqs: int, dwork: int) -> None:
        self.reqs[worker] = max(0, self.reqs.get(worker, 0) + dreqs)
        self.work[worker] = max(0, self.work.get(worker, 0) + dwork)

    def get(self, worker: str) -> tuple[int, int]:
        return self.reqs.get(worker, 0), self.work.get(worker, 0)

    def forget(self, worker: str) -> None:
        self.reqs.pop(worker, None)
        self.work.pop(worker, None)

    def total_requests(self) -> int:
        return sum(self.reqs.values())


@dataclass(frozen=True, slots=True)
class RivalHead:
    """Another replica's head waiter of one queue, as it published it: the queue's length bucket
    and model, and the head's order key on wall-clock time (``queue.order_key``)."""

    replica: str
    bucket: int
    model: str | None
    key: float


class RouterState(abc.ABC):
    """Async state backend. ``acquire`` is atomic: check the limit and count the request
    in one step, so concurrent replicas never admit past ``max_inflight``."""

    on_wake: Callable[[], None] | None = None  # called when another replica leaves this one a slot

    @property
    def degraded(self) -> bool:
        """True while serving from local state because the shared store is unreachable."""
        return False

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    @abc.abstractmethod
    async def add_worker(self, spec: WorkerSpec) -> None: ...

    @abc.abstractmethod
    async def remove_worker(self, name: str) -> bool: ...

    @abc.abstractmethod
    async def list_workers(self) -> list[WorkerSpec]: ...

    @abc.abstractmethod
    def known_specs(self) -> list[WorkerSpec]:
        """The workers this replica knows of right now, without I/O."""

    @abc.abstractmethod
    async def set_health(self, name: str, healthy: bool) -> None: ...

    @abc.abstractmethod
    async def snapshot(self, hashes: Sequence[int]) -> list[WorkerState]:
        """Every known worker with its match length for ``hashes`` and its load, sorted by name."""

    @abc.abstractmethod
    async def next_ticket(self) -> int: ...

    async def route_view(self, hashes: Sequence[int], want_ticket: bool) -> tuple[list[WorkerState], int]:
        """``snapshot(hashes)`` and, if asked, the next round-robin ticket (else 0); backends
        with a round trip per call do both in one."""
        return await self.snapshot(hashes), (await self.next_ticket() if want_ticket else 0)

    @abc.abstractmethod
    async def record_outcome(self, worker: str, ok: bool) -> None:
        """Feed the worker's circuit breaker: a success, or a failure (5xx, timeout, broken connection)."""

    def take_probe(self, worker: str, token: object) -> bool:
        """May a request be sent to ``worker`` now? While its circuit is half-open only one
        request at a time may (the probe, holding ``token`` until its outcome is recorded or
        ``drop_probe``). This default lets every request through (the Redis backend's breaker
        lives in Redis and has no probe token yet)."""
        return True

    def drop_probe(self, worker: str, token: object) -> None:
        """The probe holding ``token`` ended without an outcome: the next request probes."""

    def publish_heads(self, heads: dict[tuple[int, str | None], float]) -> None:
        """This replica's head key per waiting (bucket, model) queue, for the other replicas
        (``rival_heads``). A single replica (memory state) has nobody to tell."""

    def wall(self) -> float:
        """Wall-clock seconds that every replica's ``wall`` agrees on (published head keys are
        compared across replicas): this host's clock here; the Redis backend's is Redis's."""
        return time.time()

    def rival_heads(self) -> list[RivalHead]:
        """The other replicas' published heads, as of this replica's latest state call."""
        return []

    def wake(self, replica: str) -> None:
        """Tell ``replica`` that a slot it is owed is free (its ``on_wake`` runs)."""

    @abc.abstractmethod
    async def forget_prefixes(self, worker: str) -> None:
        """The worker lost its cache (it restarted): drop everything the index credits it with."""

    @abc.abstractmethod
    async def acquire(self, worker: str, limit: int, work_ms: int, hashes: Sequence[int]) -> Lease | None:
        """Count one request of ``work_ms`` estimated prefill work on ``worker`` and record its
        prefix, unless the worker already has ``limit`` in flight (then None)."""

    @abc.abstractmethod
    async def prefill_done(self, lease: Lease) -> None:
        """The worker started answering: its prefill work no longer counts as pending."""

    @abc.abstractmethod
    async def release(self, lease: Lease) -> None:
        """The request finished (or failed): undo whatever the lease still counts."""
