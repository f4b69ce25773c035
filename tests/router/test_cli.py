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


def test_help_exits_zero():
    for args in (["--help"], ["serve", "--help"], ["sim", "--help"]):
        r = subprocess.run([sys.executable, "-m", "router", *args], check=False, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "usage: gcache-router" in r.stdout


def test_bad_flag_value_is_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "router", "serve", "--worker", "localhost:1"],
                       check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "http://" in r.stderr


def test_serve_process_routes_requests():
    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl, aiohttp.ClientSession() as s:
            port = free_port()
            proc = subprocess.Popen(  # noqa: ASYNC220 - started once, stopped by PID below
                [sys.executable, "-m", "router", "serve", "--port", str(port), "--worker", wurl,
                 "--state", "memory", "--log-level", "INFO"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
            try:
                async def up():
                    try:
                        async with s.get(f"http://127.0.0.1:{port}/health") as r:
                            return r.status == 200
                    except aiohttp.ClientConnectionError:
                        return proc.poll() is not None  # exited: stop polling, assert below
                await poll(up, timeout=20, what="router process listening")
                assert proc.poll() is None, proc.stderr.read().decode()
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hello"}) as r:
                    assert r.status == 200 and (await r.json())["worker"] == "w0"
            finally:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(10)
                log = proc.stderr.read().decode()
                proc.stderr.close()
            assert '"POST /v1/completions' not in log  # no access log unless --access-log, even at INFO
    asyncio.run(main())
