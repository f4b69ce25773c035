"""The console entry point as a real process: ``python -m router serve`` in front of a fake worker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp

from tests.router.conftest import free_port, poll, serve_app
from tests.router.fakeworker import FakeWorker


async def started_router(session, *args, stderr=subprocess.DEVNULL):
    """A ``router serve`` process on a free port with ``args``, once it listens (or has exited:
    the caller asserts on proc.poll()): (process, base URL). The caller stops it by PID."""
    port = free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, stopped by PID by the caller
        [sys.executable, "-m", "router", "serve", "--port", str(port), *args],
        stdout=subprocess.DEVNULL, stderr=stderr)
    url = f"http://127.0.0.1:{port}"

    async def up():
        try:
            async with session.get(url + "/health") as r:
                return r.status == 200
        except aiohttp.ClientConnectionError:
            return proc.poll() is not None  # exited: stop polling, the caller asserts
    try:
        await poll(up, timeout=20, what="router process listening")
    except BaseException:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(10)
        raise
    return proc, url


def test_help_exits_zero():
    for args in (["--help"], ["serve", "--help"], ["sim", "--help"]):
        r = subprocess.run([sys.executable, "-m", "router", *args], check=False, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "usage: gcache-router" in r.stdout


def test_max_queue_flag(monkeypatch):
    """QueueConfig.max_depth had no flag (a probe): a replica always queued up to 10,000 requests."""
    from router import cli

    r = subprocess.run([sys.executable, "-m", "router", "serve", "--help"], check=False, capture_output=True,
                       text=True, timeout=30)
    assert "--max-queue" in r.stdout
    for bad in ("0", "-3", "many", "1.5"):
        r = subprocess.run([sys.executable, "-m", "router", "serve", "--max-queue", bad, "--worker", "http://127.0.0.1:1"],
                           check=False, capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "--max-queue" in r.stderr, (bad, r.stderr)
    seen = {}

    def capture(a):  # what serve would run with, without serving
        seen["cfg"] = cli.config_from_args(a)[0]
        return 0
    monkeypatch.setattr(cli, "serve", capture)
    assert cli.main(["serve", "--max-queue", "3"]) == 0
    assert seen["cfg"].queue.max_depth == 3
    assert cli.main(["serve"]) == 0
    assert seen["cfg"].queue.max_depth == 10_000


def test_a_full_queue_of_max_queue_requests_refuses_the_next_at_once():
    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl, aiohttp.ClientSession() as s:
            proc, url = await started_router(s, "--worker", f"{wurl},max_inflight=1", "--max-queue", "1",
                                             "--max-wait", "30")
            held = []
            try:
                assert proc.poll() is None
                held.append(asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "a", "hold": True})))
                await poll(lambda: fake.active == 1, what="one request at the worker")
                held.append(asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "b", "hold": True})))

                async def queued():
                    async with s.get(url + "/health") as r:
                        return (await r.json())["queue_depth"] == 1
                await poll(queued, what="one request queued")
                async with s.post(url + "/v1/completions", json={"prompt": "c"}) as r:
                    assert r.status == 503 and "queue is full" in (await r.json())["error"]["message"]
                fake.gate.set()
                assert [r.status for r in await asyncio.gather(*held)] == [200, 200]
            finally:
                fake.gate.set()
                for f in held:
                    if f.done() and not f.exception():
                        f.result().release()
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGTERM)
                proc.wait(10)
    asyncio.run(main())


def test_bad_flag_value_is_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "router", "serve", "--worker", "localhost:1"],
                       check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "http://" in r.stderr


def test_serve_process_routes_requests():
    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl, aiohttp.ClientSession() as s:
            proc, url = await started_router(s, "--worker", wurl, "--state", "memory", "--log-level", "INFO",
                                             stderr=subprocess.PIPE)
            try:
                assert proc.poll() is None, proc.stderr.read().decode()
                async with s.post(f"{url}/v1/completions", json={"prompt": "hello"}) as r:
                    assert r.status == 200 and (await r.json())["worker"] == "w0"
            finally:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(10)
                log = proc.stderr.read().decode()
                proc.stderr.close()
            assert '"POST /v1/completions' not in log  # no access log unless --access-log, even at INFO
    asyncio.run(main())
