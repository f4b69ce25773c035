"""Shared fixtures: a real redis-server on a free port, helpers to run aiohttp apps
(fake workers and router replicas) on 127.0.0.1 inside a test's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

REDIS_MISSING = "redis-server not installed: apt-get install redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def poll(cond: Callable[[], object], timeout: float = 10.0, interval: float = 0.02, what: str = "") -> object:
    """Await until cond() (sync or async) is truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def serve_app(app) -> AsyncIterator[str]:
    """Run an aiohttp app (a fake worker) or a router (``build_app``) on 127.0.0.1:<free port>;
    yields its base URL."""
    if not isinstance(app, web.Application):
        host, port = (await app.start("127.0.0.1", 0))[0]
        try:
            yield f"http://{host}:{port}"
        finally:
            await app.stop()
        return
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


class RedisProc:
    """A redis-server child process on a fixed free port; kill() and start() by PID."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.02)  # polling with a deadline, not synchronising
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        self.proc = None


@pytest.fixture
def redis_proc():
    if shutil.which("redis-server") is None:
        pytest.skip(REDIS_MISSING)
    r = RedisProc()
    r.start()
    try:
        yield r
    finally:
        r.kill()


def test_config(**kw):
    """A RouterConfig with tiny blocks (16 tokens = 64 chars) and fast health checks."""
    from router.config import PrefixConfig, QueueConfig, RouterConfig

    kw.setdefault("prefix", PrefixConfig(block_tokens=16, chars_per_token=4))
    kw.setdefault("queue", QueueConfig(max_wait_s=5.0))
    kw.setdefault("health_interval_s", 0.1)
    kw.setdefault("health_failures", 2)
    kw.setdefault("upstream_first_byte_timeout_s", 20.0)  # nothing in a test waits on a worker for long
    kw.setdefault("admin_token", ADMIN_TOKEN)
    kw.setdefault("worker_header", True)
    kw.setdefault("worker_id_salt", "test")
    return RouterConfig(**kw)


ADMIN_TOKEN = "test-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def wid(url: str) -> str:
    """The X-Gcache-Worker value test_config's routers send for the worker at ``url``."""
    from router.config import WorkerSpec, worker_id

    return worker_id(WorkerSpec(url), "test")


def url_of(resp, urls) -> str | None:
    """The worker URL (among ``urls``) that served ``resp``, from its X-Gcache-Worker id."""
    got = resp.headers.get("X-Gcache-Worker")
    return next((u for u in urls if wid(u) == got), None)


test_config.__test__ = False  # not a test, despite the name
