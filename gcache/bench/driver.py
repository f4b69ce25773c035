"""The measuring loop every system shares: N threads repeat one batch operation for a fixed time.

Each system only supplies a per-thread ``step(i)`` that moves one batch and says whether it
fully succeeded; timing, the start barrier and latency collection are the same for all of them,
so a difference between two systems' figures is the systems', not the harness's. A failed
step aborts the measurement with an error (a benchmark that silently counts failures as
throughput would lie).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

Step = Callable[[int], bool]


class BenchError(RuntimeError):
    """A measurement could not be made honestly (a batch failed, bytes came back wrong)."""


@dataclass
class Timing:
    elapsed_s: float
    batches: int
    latencies_s: list[float]


def drive(steps: list[Step], seconds: float, what: str = "batch") -> Timing:
    """Run ``steps[t]`` in thread t (inline when there is one) until ``seconds`` pass; each
    thread finishes the step it is in, so at least one step per thread is always timed."""
    lats: list[list[float]] = [[] for _ in steps]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(steps) + 1) if len(steps) > 1 else None
    t_start = [0.0]

    def worker(t: int) -> None:
        step, lat = steps[t], lats[t]
        try:
            if barrier is not None:
                barrier.wait()
            t_end = time.perf_counter() + seconds
            i = 0
            while True:
                t0 = time.perf_counter()
                ok = step(i)
                lat.append(time.perf_counter() - t0)
                if not ok:
                    raise BenchError(f"{what} {i} in thread {t} failed")
                i += 1
                if t0 >= t_end:
                    break
        except Exception as exc:  # noqa: BLE001 -- any failure in a worker is re-raised in the caller
            errors.append(exc)
            if barrier is not None:
                barrier.abort()

    if barrier is None:
        t_start[0] = time.perf_counter()
        worker(0)
    else:
        pool = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(len(steps))]
        for th in pool:
            th.start()
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass
        t_start[0] = time.perf_counter()
        for th in pool:
            th.join()
    elapsed = time.perf_counter() - t_start[0]
    if errors:
        raise errors[0]
    flat = [x for lat in lats for x in lat]
    return Timing(elapsed, len(flat), flat)


@contextmanager
def cluster_for(nodes: str, mem_bytes: int, extra_args: Sequence[str] = ()) -> Iterator[list[str]]:
    """The daemons a bench runs against: ``nodes`` is HOST:PORT,... of a running cluster, or a
    count of local daemons with ``mem_bytes`` of RAM each, started here and stopped afterwards."""
    if ":" in nodes:
        yield [a for a in nodes.split(",") if a]
        return
    from gcache.cluster import LocalCluster

    if not nodes.isdigit() or int(nodes) < 1:
        raise SystemExit(f"gcache bench: --nodes takes a number of local daemons >= 1, or HOST:PORT,...; got {nodes!r}")
    cluster = LocalCluster(nodes=int(nodes), mem=f"{mem_bytes >> 20}MiB", extra_args=list(extra_args)).start()
    try:
        yield cluster.addresses
    finally:
        cluster.stop()
