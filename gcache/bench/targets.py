"""What the throughput bench measures: gcache per transport, and the two ceilings.

A ``Target`` turns (op, value size, batch, threads, seconds) into a ``Record``. gcache's
transports are picked from ``TRANSPORTS``; one that is not built or not installed is a
``Unavailable`` entry whose reason the bench prints instead of a figure, so adding the
shared-memory or UCX path later is one new class and one registry line.

Buffers are allocated and touched once per measurement, outside the timed loop (first writes
into fresh memory fault at ~1.7 GB/s here and would otherwise be what is measured).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gcache.bench.driver import BenchError, Step, drive
from gcache.bench.rawsock import RawSocketPeer
from gcache.bench.records import Record, from_latencies
from gcache.protocol import Status

OPS = ("put", "get", "exists")


class Target:
    system = ""
    transport = "tcp"

    def measure(self, op: str, size: int, batch: int, threads: int, seconds: float) -> Record:
        raise NotImplementedError

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Unavailable:
    """A transport or peer that cannot be measured here, and what would make it measurable."""

    name: str
    reason: str


class Buffers:
    """Per-thread source (random bytes) and destination buffers of ``batch`` values each."""

    def __init__(self, size: int, batch: int, threads: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed + size)
        self.size, self.batch = size, batch
        self.src = [rng.integers(0, 256, size * batch, dtype=np.uint8) for _ in range(threads)]
        self.dst = [np.zeros(size * batch, dtype=np.uint8) for _ in range(threads)]

    def views(self, arr: np.ndarray) -> list[np.ndarray]:
        return [arr[j * self.size:(j + 1) * self.size] for j in range(self.batch)]


def keys_per_thread(mem_budget: int, size: int, batch: int, threads: int) -> int:
    """How many distinct batches each thread cycles through: up to 8, within half the budget."""
    return max(1, min(8, mem_budget // (2 * threads * batch * size)))


class GcacheTcp(Target):
    """The gcache client over its TCP data plane to a running cluster (remote path)."""

    system, transport = "gcache", "tcp"
    local_mode = "off"  # never the shared-memory path, even where the daemon offers it

    def __init__(self, addresses: list[str], mem_budget: int, namespace: str = "bench") -> None:
        from gcache.client import Client

        kw: dict[str, Any] = {}
        try:
            from gcache.client.client import LocalPath

            kw["local"] = LocalPath(self.local_mode)
        except ImportError:  # a client without the local path speaks only TCP
            if self.local_mode != "off":
                raise BenchError("this gcache client has no local path") from None
        kw.update(self.extra_client_kw())
        # generous connect deadline: a benchmark on a loaded machine measures, it does not fail over
        self.client = Client(addresses, namespace=namespace, timeout_s=60.0, connect_timeout_s=10.0, **kw)
        self.mem_budget = mem_budget

    def extra_client_kw(self) -> dict:
        return {}

    def before_timing(self) -> None:
        """Called once the keys are loaded, just before the clock starts (a process barrier)."""

    def measure(self, op: str, size: int, batch: int, threads: int, seconds: float) -> Record:
        c = self.client
        bufs = Buffers(size, batch, threads)
        n = keys_per_thread(self.mem_budget, size, batch, threads)
        keys = [[[f"b/{t}/{size}/{i}/{j}" for j in range(batch)] for i in range(n)] for t in range(threads)]
        src = [bufs.views(s) for s in bufs.src]
        dst = [bufs.views(d) for d in bufs.dst]
        if op != "put":
            for t in range(threads):
                for ks in keys[t]:
                    if not all(s is Status.OK for s in c.put(ks, src[t])):
                        raise BenchError(f"could not load {batch} x {size} B for {op}: cluster too small?")
            if c.get_into(keys[0][0], dst[0]).hits != batch or not np.array_equal(bufs.dst[0], bufs.src[0]):
                raise BenchError("gcache returned wrong or missing bytes")

        def step_for(t: int) -> Step:
            ks, s, d = keys[t], src[t], dst[t]
            if op == "put":
                return lambda i: all(x is Status.OK for x in c.put(ks[i % n], s))
            if op == "get":
                return lambda i: c.get_into(ks[i % n], d).hits == batch
            return lambda i: all(c.exists(ks[i % n]))

        try:
            self.before_timing()
            timing = drive([step_for(t) for t in range(threads)], seconds, f"gcache {op}")
        finally:
            for per_thread in keys:
                for ks in per_thread:
                    c.delete(ks)
        return from_latencies("gcache", op, size, batch, threads, timing.elapsed_s, timing.batches,
                              timing.latencies_s, self.transport)

    def close(self) -> None:
        self.client.close()


class GcacheLocal(GcacheTcp):
    """The gcache client over the shared-memory local path (``LocalPath.FORCE``): values are
    copied straight between the daemon's arena and the caller's buffers; memcpy is its ceiling."""

    transport, local_mode = "local", "force"


class Memcpy(Target):
    """The local-path ceiling: ``np.copyto`` of a batch between preallocated, touched buffers,
    over the same working set as gcache's (``keys_per_thread`` distinct batches per thread): a get
    copies each of them in turn into one destination, a put one source into each in turn. (One
    batch copied over and over can stay in the last-level cache, which gcache's cannot.)"""

    system, transport = "memcpy", "local"

    def __init__(self, mem_budget: int) -> None:
        self.mem_budget = mem_budget

    def measure(self, op: str, size: int, batch: int, threads: int, seconds: float) -> Record:
        bufs = Buffers(size, batch, threads)
        n = keys_per_thread(self.mem_budget, size, batch, threads)
        far = [[bufs.src[t].copy() for _ in range(n)] for t in range(threads)]  # the stored batches

        def step_for(t: int) -> Step:
            near, stored = bufs.dst[t], far[t]

            def step(i: int) -> bool:
                if op == "put":
                    np.copyto(stored[i % n], near)
                else:
                    np.copyto(near, stored[i % n])
                return True

            return step

        timing = drive([step_for(t) for t in range(threads)], seconds, "memcpy")
        return from_latencies("memcpy", op, size, batch, threads, timing.elapsed_s, timing.batches,
                              timing.latencies_s, self.transport)


class Socket(Target):
    """The remote ceiling: one batch's bytes as one request/response on a plain TCP socket
    to another process (gcache.bench.rawsock), one connection."""

    system, transport = "socket", "tcp"

    def __init__(self, max_bytes: int) -> None:
        self.peer = RawSocketPeer(max_bytes)

    def measure(self, op: str, size: int, batch: int, threads: int, seconds: float) -> Record:
        n = size * batch
        fn = self.peer.get if op == "get" else self.peer.put
        fn(n, size)  # one message per value, as gcache sends them

        timing = drive([lambda i: fn(n, size) is None], seconds, self.system)
        return from_latencies("socket", op, size, batch, 1, timing.elapsed_s, timing.batches,
                              timing.latencies_s, self.transport)

    def close(self) -> None:
        self.peer.close()


class UcxRaw(Socket):
    """The UCX ceiling: the socket ceiling's requests as UCX tag messages between two processes
    (gcache.bench.rawucx), with the same UCX_TLS as gcache's UCX path in this run."""

    system, transport = "ucx-raw", "ucx"

    def __init__(self, max_bytes: int) -> None:
        from gcache.bench.rawucx import RawUcxPeer
        from gcache.transport import ucx

        ok, why = ucx.available()
        if not ok:
            raise BenchError(why)
        self.peer = RawUcxPeer(max_bytes)

    def measure(self, op: str, size: int, batch: int, threads: int, seconds: float) -> Record:
        return replace(super().measure(op, size, batch, threads, seconds), system=self.system,
                       transport=self.transport)


class GcacheUcx(GcacheTcp):
    """The gcache client over UCX (``Transport.UCX``; daemons started with ``--ucx``). UCX picks
    its transports from UCX_TLS: tcp and shared memory here, verbs/GPUDirect where they exist."""

    transport = "ucx"

    def extra_client_kw(self) -> dict:
        from gcache.transport import Transport, ucx

        ok, why = ucx.available()
        if not ok:
            raise BenchError(why)
        return {"transport": Transport.UCX}


TRANSPORT_REASONS: dict[str, str] = {}
TRANSPORTS = ("tcp", "local", "ucx")


def gcache_transport(name: str, addresses: list[str], mem_budget: int) -> Target | Unavailable:
    """gcache over transport ``name``, or why it cannot run here."""
    if name == "tcp":
        return GcacheTcp(addresses, mem_budget)
    if name == "local":
        return _probe(GcacheLocal, addresses, mem_budget)
    if name == "ucx":
        return _probe(GcacheUcx, addresses, mem_budget)
    if name in TRANSPORT_REASONS:
        return Unavailable(name, TRANSPORT_REASONS[name])
    return Unavailable(name, f"unknown transport (known: {', '.join(TRANSPORTS)})")


def _probe(cls: type[GcacheTcp], addresses: list[str], mem_budget: int) -> Target | Unavailable:
    """Build a gcache target and move one small value through it, or say why it cannot run."""
    from gcache.errors import GCacheError

    try:
        t = cls(addresses, mem_budget)
    except (BenchError, GCacheError, OSError, ValueError) as exc:
        return Unavailable(cls.transport, f"not available here: {exc}")
    try:
        ok = t.client.put(["probe"], [b"x" * 64])[0] is Status.OK and t.client.get(["probe"])[0] == b"x" * 64
        t.client.delete(["probe"])
    except (GCacheError, OSError) as exc:
        ok, why = False, str(exc)
    else:
        why = "a probe value did not round-trip"
    if not ok:
        t.close()
        return Unavailable(cls.transport, f"not available with these daemons: {why}")
    return t
