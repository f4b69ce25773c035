"""A small keep-alive HTTP/1.1 load client on raw asyncio streams: cheap enough per request
that the servers, not the client, are what a run measures. The same client measures the
echo worker directly and through the router."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Run:
    requests: int
    elapsed_s: float
    latency_s: list[float] = field(repr=False)
    ttfb_s: list[float] = field(repr=False)
    errors: int = 0

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    def pct_ms(self, q: float, ttfb: bool = False) -> float:
        x = self.ttfb_s if ttfb else self.latency_s
        return float(np.percentile(x, q) * 1000) if x else float("nan")


def build_request(host: str, port: int, path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes) -> tuple[float, int]:
    """Send one request, read the whole answer; (seconds to the first body byte, status)."""
    t0 = time.perf_counter()
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    ttfb = 0.0
    if b"transfer-encoding: chunked" in lower:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if not ttfb:
                ttfb = time.perf_counter() - t0
            if size == 0:
                break
    else:
        i = lower.find(b"content-length:")
        n = int(lower[i + 15 : lower.find(b"\r\n", i)]) if i >= 0 else 0
        if n:
            await reader.readexactly(n)
        ttfb = time.perf_counter() - t0
    return ttfb, status


async def load(host: str, port: int, path: str, body: bytes, n: int, concurrency: int) -> Run:
    """``n`` requests over ``concurrency`` keep-alive connections, as fast as they are answered."""
    req = build_request(host, port, path, body)
    lat: list[float] = []
    ttfb: list[float] = []
    errors = 0
    left = [n]

    async def conn() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while left[0] > 0:
                left[0] -= 1
                t0 = time.perf_counter()
                first, status = await _exchange(reader, writer, req)
                lat.append(time.perf_counter() - t0)
                ttfb.append(first)
                if status != 200:
                    errors += 1
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(conn() for _ in range(concurrency)))
    return Run(n, time.perf_counter() - t0, lat, ttfb, errors)
