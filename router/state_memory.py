"""In-process routing state: one replica, no Redis (``--state memory``).

Also the local mirror the Redis backend falls back to when Redis is unreachable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from router.breaker import BreakerConfig, Circuit
from router.config import PrefixConfig, WorkerSpec
from router.prefix import PrefixIndex
from router.state_base import Lease, LoadTable, RouterState, WorkerState


class MemoryState(RouterState):
    def __init__(self, prefix: PrefixConfig, clock: Callable[[], float] = time.time,
                 breaker: BreakerConfig | None = None) -> None:
        self.clock = clock
        self.breaker = breaker or BreakerConfig()
        self.circuits: dict[str, Circuit] = {}
        self.workers: dict[str, WorkerSpec] = {}
        self.health: dict[str, bool] = {}
        self.index = PrefixIndex(prefix.max_blocks_per_worker, prefix.ttl_s)
        self.loads = LoadTable()
        self.ticket = 0

    def __repr__(self) -> str:
        return f"MemoryState(workers={sorted(self.workers)}, reqs={self.loads.reqs}, work={self.loads.work})"

    # -- synchronous core, reused by the Redis backend's local mirror -------------------
    def add_worker_sync(self, spec: WorkerSpec) -> None:
        self.workers[spec.name] = spec
        self.health.setdefault(spec.name, True)

    def remove_worker_sync(self, name: str) -> bool:
        self.health.pop(name, None)
        self.circuits.pop(name, None)
        self.index.remove_worker(name)
        return self.workers.pop(name, None) is not None

    def record_outcome_sync(self, worker: str, ok: bool) -> None:
        if worker in self.workers:
            self.circuits.setdefault(worker, Circuit()).record(ok, self.clock(), self.breaker)

    def take_probe(self, worker: str, token: object) -> bool:
        c = self.circuits.get(worker)
        return c is None or c.take_probe(self.clock(), token)

    def drop_probe(self, worker: str, token: object) -> None:
        c = self.circuits.get(worker)
        if c is not None:
            c.drop_probe(token)

    def circuit_open(self, worker: str, now: float) -> bool:
        c = self.circuits.get(worker)
        return c is not None and c.is_open(now)

    def snapshot_sync(self, hashes: Sequence[int]) -> list[WorkerState]:
        now = self.clock()
        out = []
        for name in sorted(self.workers):
            r, t = self.loads.get(name)
            m, age = self.index.match_age(name, hashes, now)
            out.append(WorkerState(self.workers[name], self.health.get(name, True), m, r, t, age,
                                   self.circuit_open(name, now)))
        return out

    def acquire_sync(self, worker: str, limit: int, work_ms: int, hashes: Sequence[int]) -> Lease | None:
        if self.loads.get(worker)[0] >= limit:
            return None
        self.loads.add(worker, 1, work_ms)
        self.index.insert(worker, hashes, self.clock())
        return Lease(worker, work_ms)

    def prefill_done_sync(self, lease: Lease) -> None:
        if not lease.prefilled and not lease.released:
            lease.prefilled = True
            self.loads.add(lease.worker, 0, -lease.work_ms)

    def release_sync(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        self.loads.add(lease.worker, -1, 0 if lease.prefilled else -lease.work_ms)

    # -- RouterState --------------------------------------------------------------------
    async def add_worker(self, spec: WorkerSpec) -> None:
        self.add_worker_sync(spec)

    async def remove_worker(self, name: str) -> bool:
        return self.remove_worker_sync(name)

    def known_specs(self) -> list[WorkerSpec]:
        return list(self.workers.values())

    async def list_workers(self) -> list[WorkerSpec]:
        return [self.workers[n] for n in sorted(self.workers)]

    async def set_health(self, name: str, healthy: bool) -> None:
        if name in self.workers:
            self.health[name] = healthy

    async def snapshot(self, hashes: Sequence[int]) -> list[WorkerState]:
        return self.snapshot_sync(hashes)

    async def record_outcome(self, worker: str, ok: bool) -> None:
        self.record_outcome_sync(worker, ok)

    async def forget_prefixes(self, worker: str) -> None:
        self.index.remove_worker(worker)

    async def next_ticket(self) -> int:
        self.ticket += 1
        return self.ticket

    async def acquire(self, worker: str, limit: int, work_ms: int, hashes: Sequence[int]) -> Lease | None:
        return self.acquire_sync(worker, limit, work_ms, hashes)

    async def prefill_done(self, lease: Lease) -> None:
        self.prefill_done_sync(lease)

    async def release(self, lease: Lease) -> None:
        self.release_sync(lease)
