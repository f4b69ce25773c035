"""The Redis peer: a redis-server this bench starts on a free loopback port, driven by redis-py
with hiredis, one pipelined round trip per batch (SET x batch, GET x batch, one EXISTS).

Redis is what many users already run as a shared cache, so it is the figure gcache has to
beat to be worth deploying. The server runs with persistence off (``--save '' --appendonly
no``); it is stopped by PID when the bench ends. Gets are counted when redis-py has the values
as ``bytes`` objects: they are not copied on into the caller's buffers, a small favour to Redis
that gcache (which lands values in the caller's buffers) does not get.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from gcache.bench.driver import BenchError, Step, drive
from gcache.bench.records import Record, from_latencies
from gcache.bench.targets import Buffers, Target, Unavailable, keys_per_thread

INSTALL_HINT = "install it with `make bench-peers` (apt-get install redis-server; pip install 'redis[hiredis]')"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server process on 127.0.0.1; ``stop()`` ends it by PID."""

    def __init__(self, maxmemory: int = 0, start_timeout_s: float = 15.0) -> None:
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server")
        self.dir = tempfile.mkdtemp(prefix="gcache-bench-redis-")
        self.port = free_port()
        args = [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--protected-mode", "yes", "--proto-max-bulk-len", "1gb"]
        if maxmemory:
            args += ["--maxmemory", str(maxmemory)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1).ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise BenchError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisPeer(Target):
    system, transport = "redis", "tcp"

    def __init__(self, mem_budget: int) -> None:
        import redis

        self.server = RedisServer()
        self.mem_budget = mem_budget
        self._redis = redis
        self._clients: list = []

    def _client(self, t: int):
        while len(self._clients) <= t:
            self._clients.append(self._redis.Redis(host="127.0.0.1", port=self.server.port, socket_timeout=60))
        return self._clients[t]

    def measure(self, op: str, size: int, batch: int, threads: int, seconds: float) -> Record:
        return measure_redis([self._client(t) for t in range(threads)], "b", self.mem_budget, op, size, batch,
                             threads, seconds)

    @staticmethod
    def _set(r, keys: list[str], values: list[memoryview]) -> bool:
        p = r.pipeline(transaction=False)
        for k, v in zip(keys, values):
            p.set(k, v)
        return all(p.execute())

    @staticmethod
    def _get(r, keys: list[str], size: int) -> bool:
        p = r.pipeline(transaction=False)
        for k in keys:
            p.get(k)
        return all(v is not None and len(v) == size for v in p.execute())

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self.server.stop()


def measure_redis(clients: list, prefix: str, mem_budget: int, op: str, size: int, batch: int, threads: int,
                  seconds: float, before_timing: Callable[[], None] | None = None) -> Record:
    """One figure with ``clients[t]`` driving thread t, on keys under ``prefix`` (deleted
    afterwards, so processes sharing a server never touch each other's keys); ``before_timing``
    runs once the keys are loaded, just before the clock starts."""
    bufs = Buffers(size, batch, threads)
    n = keys_per_thread(mem_budget, size, batch, threads)
    keys = [[[f"{prefix}/{t}/{size}/{i}/{j}" for j in range(batch)] for i in range(n)] for t in range(threads)]
    src = [[v.data for v in bufs.views(s)] for s in bufs.src]
    if op != "put":
        for t in range(threads):
            for ks in keys[t]:
                RedisPeer._set(clients[t], ks, src[t])
        got: list[Any] = list(clients[0].mget(keys[0][0]))
        if any(g is None for g in got) or b"".join(got) != bufs.src[0].tobytes():
            raise BenchError("redis returned wrong or missing bytes")

    def step_for(t: int) -> Step:
        r, ks, s = clients[t], keys[t], src[t]
        if op == "put":
            return lambda i: RedisPeer._set(r, ks[i % n], s)
        if op == "get":
            return lambda i: RedisPeer._get(r, ks[i % n], size)
        return lambda i: r.exists(*ks[i % n]) == batch

    try:
        if before_timing is not None:
            before_timing()
        timing = drive([step_for(t) for t in range(threads)], seconds, f"redis {op}")
    finally:
        for per_thread in keys:
            for ks in per_thread:
                clients[0].delete(*ks)
    return from_latencies("redis", op, size, batch, threads, timing.elapsed_s, timing.batches, timing.latencies_s)


def make_redis_peer(mem_budget: int) -> RedisPeer | Unavailable:
    try:
        import redis  # noqa: F401
    except ImportError:
        return Unavailable("redis", f"redis-py is not installed; {INSTALL_HINT}")
    if shutil.which("redis-server") is None:
        return Unavailable("redis", f"redis-server is not on PATH; {INSTALL_HINT}")
    return RedisPeer(mem_budget)

