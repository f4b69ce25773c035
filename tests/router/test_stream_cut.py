"""A stream the worker cuts mid-way is counted apart from complete answers. Found by a probe: it
was counted as status 200 in gcache_router_requests_total (its headers had gone out with 200),
so the metrics showed truncated answers as successes."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from router.config import WorkerSpec
from router.proxy import build_app
from tests.router.conftest import serve_app, test_config
from tests.router.fakeworker import FakeWorker


async def _requests_by_status(s: aiohttp.ClientSession, url: str, route: str) -> dict[str, float]:
    text = await (await s.get(url + "/metrics")).text()
    out = {}
    for line in text.splitlines():
        prefix = f'gcache_router_requests_total{{route="{route}",status="'
        if line.startswith(prefix):
            out[line[len(prefix):].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_stream_cut_mid_way_is_counted_as_cut_not_200():
    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl, serve_app(build_app(test_config(), [WorkerSpec(wurl)])) as url, \
                aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json={"text": "whole", "stream": True, "chunks": 3}) as r:
                assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
            async with s.post(url + "/generate", json={"text": "cut", "stream": True, "chunks": 3, "cut": 1}) as r:
                assert r.status == 200  # the head went out before the worker failed
                with pytest.raises(aiohttp.ClientPayloadError):  # and the client sees the cut
                    await r.read()
            assert await _requests_by_status(s, url, "/generate") == {"200": 1.0, "cut": 1.0}
    asyncio.run(main())
