"""``gcache-router bench``: echo worker direct vs through the router (memory and Redis state).

Every server is its own process on 127.0.0.1 (echo worker, redis-server, router), the
client is this process. Small non-streaming requests at ``--concurrency``; then streaming
requests one at a time, where the time to the first body byte is the figure. The direct
figures come from the same run and the same client, so the difference is the router's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from router.bench.client import Run, load

SMALL = json.dumps({"model": "bench", "prompt": "Say ok.", "max_tokens": 1}).encode()
STREAM = json.dumps({"model": "bench", "prompt": "Say ok.", "max_tokens": 4, "stream": True}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.05)  # polling a starting process with a deadline
    raise RuntimeError(f"{url} did not answer within {timeout:g}s")


@contextlib.contextmanager
def process(args: list[str], health_url: str | None) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    try:
        if health_url:
            _wait_http(health_url, proc)
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if proc.stderr is not None:
            proc.stderr.close()


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str, int]]:
    port = free_port()
    with process(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                 None) as proc:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
            time.sleep(0.02)  # polling a starting process with a deadline
        yield f"redis://127.0.0.1:{port}/0", proc.pid


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(port: int, n: int, concurrency: int, stream_n: int, pids: dict[str, int]) -> dict:
    """The three runs against one port; CPU seconds each process in ``pids`` spent per small request."""
    async def go() -> tuple[Run, Run, Run, dict[str, float]]:
        await load("127.0.0.1", port, "/v1/completions", SMALL, min(200, n), concurrency)  # warm up
        before = {k: cpu_s(p) for k, p in pids.items()}
        client0 = time.process_time()
        small = await load("127.0.0.1", port, "/v1/completions", SMALL, n, concurrency)
        cpu = {k: (cpu_s(p) - before[k]) / n * 1e6 for k, p in pids.items()}
        cpu["client"] = (time.process_time() - client0) / n * 1e6
        single = await load("127.0.0.1", port, "/v1/completions", SMALL, stream_n, 1)
        stream = await load("127.0.0.1", port, "/v1/completions", STREAM, stream_n, 1)
        return small, single, stream, cpu

    small, single, stream, cpu = asyncio.run(go())
    return {"rps": small.rps, "p50_ms": small.pct_ms(50), "p90_ms": small.pct_ms(90), "p99_ms": small.pct_ms(99),
            "errors": small.errors + single.errors + stream.errors, "c1_p50_ms": single.pct_ms(50),
            "ttfb_p50_ms": stream.pct_ms(50, ttfb=True), "ttfb_p90_ms": stream.pct_ms(90, ttfb=True),
            "cpu_us_per_request": cpu, "load_average": os.getloadavg()[0]}


def run(a: argparse.Namespace) -> int:
    states = [s for s in a.states.split(",") if s]
    if "redis" in states and shutil.which("redis-server") is None:
        print("error: redis-server is not installed (apt-get install redis-server); use --states memory",
              file=sys.stderr)
        return 2
    rows: list[dict] = []
    wport = free_port()
    worker = f"http://127.0.0.1:{wport}"
    with process([sys.executable, "-m", "router.bench.echo", "--port", str(wport)], worker + "/health") as wp:
        rows.append({"path": "direct", **measure(wport, a.requests, a.concurrency, a.stream_requests,
                                                 {"worker": wp.pid})})
        for state in states:
            with contextlib.ExitStack() as st:
                pids = {"worker": wp.pid}
                extra: list[str] = []
                if state == "redis":
                    rurl, pids["redis"] = st.enter_context(redis_server())
                    extra = ["--redis", rurl]
                rport = free_port()
                rp = st.enter_context(process([sys.executable, "-m", "router", "serve", "--port", str(rport),
                                               "--worker", worker, "--state", state, "--log-level", "WARNING",
                                               *extra], f"http://127.0.0.1:{rport}/health"))
                pids["router"] = rp.pid
                rows.append({"path": f"router ({state})", **measure(rport, a.requests, a.concurrency,
                                                                    a.stream_requests, pids)})
    print(table(rows, a))
    if a.json_path:
        Path(a.json_path).write_text(json.dumps({"concurrency": a.concurrency, "requests": a.requests,
                                                 "rows": rows}, indent=1) + "\n")
        print(f"wrote {a.json_path}")
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def table(rows: list[dict], a: argparse.Namespace) -> str:
    d = rows[0]
    out = [(f"{a.requests} small non-streaming requests at concurrency {a.concurrency}; "
           f"{a.stream_requests} at concurrency 1 (c1) and {a.stream_requests} streaming at concurrency 1 (TTFB); "
           "CPU: microseconds of CPU per small request, per process"),
           ("| path | req/s | p50 ms | p90 ms | p99 ms | added p50 ms | c1 p50 ms | added c1 ms | TTFB p50 ms "
           "| added TTFB ms | CPU us/req | errors | load avg |"),
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cpu = ", ".join(f"{k} {v:.0f}" for k, v in r["cpu_us_per_request"].items())
        out.append(f"| {r['path']} | {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | {r['p99_ms']:.2f} "
                   f"| {r['p50_ms'] - d['p50_ms']:.2f} | {r['c1_p50_ms']:.2f} | {r['c1_p50_ms'] - d['c1_p50_ms']:.2f} "
                   f"| {r['ttfb_p50_ms']:.2f} | {r['ttfb_p50_ms'] - d['ttfb_p50_ms']:.2f} | {cpu} | {r['errors']} "
                   f"| {r['load_average']:.1f} |")
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=5000, help="small requests per path (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32, help="client connections (default: %(default)s)")
    p.add_argument("--stream-requests", type=int, default=300,
                   help="requests at concurrency 1, plain and streaming, per path (default: %(default)s)")
    p.add_argument("--states", default="memory,redis", help="router state backends to measure (default: %(default)s)")
    p.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
