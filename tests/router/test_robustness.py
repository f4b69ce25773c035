"""Bad input, slow clients, slow or dead workers: every case answered clearly and counted,
requests that never reached a worker retried elsewhere, the router survives."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time

import aiohttp
import pytest

from router.config import QueueConfig, WorkerSpec
from router.proxy import APP_KEY, build_app
from tests.router.conftest import poll, serve_app, test_config, wid
from tests.router.fakeworker import FakeWorker


@contextlib.asynccontextmanager
async def router_for(specs, **cfg):
    app = build_app(test_config(**cfg), specs)
    async with serve_app(app) as url, aiohttp.ClientSession() as s:
        yield url, s, app[APP_KEY]


async def metric(s, url, line_start):
    text = await (await s.get(url + "/metrics")).text()
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_malformed_inputs_are_clear_4xx_and_counted():
    cases = [
        ("/generate", b'{"input_ids": [1, 2, 18446744073709551616]}', "token ids must be integers"),
        ("/v1/completions", b'{"prompt": [5, -1]}', "token ids must be integers"),
        ("/v1/completions", b'{"prompt": "hello \\ud800 world"}', "lone UTF-16 surrogate"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\udfff"}]}',
         "lone UTF-16 surrogate"),
        ("/v1/chat/completions", (b'{"messages": [{"role": "user", "content": [{"type": "image_url", '
                                 b'"image_url": {"url": "http://x/\\ud800.png"}}]}]}'), "lone UTF-16 surrogate"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ]

    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl, router_for([WorkerSpec(wurl)], max_body_bytes=1 << 20) as (url, s, _):
            for path, raw, msg in cases:
                async with s.post(url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
                    body = await r.json()
                    assert r.status == 400 and msg in body["error"]["message"], (path, r.status, body)
            assert fake.served == 0
            n400 = sum([await metric(s, url, f'gcache_router_requests_total{{route="{p}",status="400"}}')
                        for p in ("/generate", "/v1/completions", "/v1/chat/completions")])
            assert n400 == len(cases)
            async with s.post(url + "/v1/completions", json={"prompt": "still alive"}) as r:
                assert r.status == 200
    asyncio.run(main())


def test_a_wrong_method_on_an_llm_route_is_counted():
    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl, router_for([WorkerSpec(wurl)]) as (url, s, _):
            for path in ("/v1/completions", "/generate"):
                async with s.get(url + path) as r:
                    assert r.status == 405
            assert await metric(s, url, 'gcache_router_requests_total{route="/v1/completions",status="405"}') == 1
            assert await metric(s, url, 'gcache_router_requests_total{route="/generate",status="405"}') == 1
    asyncio.run(main())


def test_a_body_shorter_than_its_content_length_times_out_with_408():
    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl, \
                router_for([WorkerSpec(wurl)], client_body_timeout_s=0.3) as (url, s, _):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            t0 = time.monotonic()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"prompt":')
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 408"), head
            assert time.monotonic() - t0 < 5
            writer.close()
            assert await metric(s, url, 'gcache_router_requests_total{route="/v1/completions",status="408"}') == 1
    asyncio.run(main())


def test_upstream_first_byte_and_idle_timeouts():
    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl, router_for(
                [WorkerSpec(wurl)], upstream_first_byte_timeout_s=0.3, upstream_idle_timeout_s=0.3) as (url, s, router):
            t0 = time.monotonic()
            async with s.post(url + "/v1/completions", json={"prompt": "slow", "hold": True}) as r:
                assert r.status == 504 and "no response within 0.3s" in (await r.json())["error"]["message"]
            assert time.monotonic() - t0 < 5
            fake.gate.set()  # let the held handler finish
            fake.gate.clear()
            t0 = time.monotonic()
            async with s.post(url + "/generate", json={"text": "hi", "stream": True, "chunks": 3, "gate": True}) as r:
                assert r.status == 200
                got = await r.content.readuntil(b"\n\n")  # first event, then the worker goes silent
                with pytest.raises(aiohttp.ClientPayloadError):  # cut: no terminating chunk, so the
                    await r.read()  # client can tell it from a complete answer
            assert got.startswith(b"data: ") and b"[DONE]" not in got
            assert time.monotonic() - t0 < 5
            fake.gate.set()
            await poll(lambda: _idle(router), what="leases released")
    asyncio.run(main())


async def _idle(router):
    return all(w.inflight_requests == 0 and w.pending_ms == 0 for w in await router.state.snapshot(()))


@contextlib.asynccontextmanager
async def dead_worker(kind):
    """A worker address that refuses, never accepts, or resets every connection before answering."""
    if kind == "refused":
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    elif kind == "connect_timeout":
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        lst.listen(0)
        port = lst.getsockname()[1]
        fillers = []
        for _ in range(4):  # fill the accept backlog: further SYNs are dropped, connects hang
            c = socket.socket()
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(("127.0.0.1", port))
            fillers.append(c)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            for c in fillers:
                c.close()
            lst.close()
    else:  # reset: accept, read the request, close with RST
        async def handle(reader, writer):
            await reader.read(1)
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        finally:
            srv.close()


def test_a_request_that_never_reached_a_worker_is_retried_on_the_next_best():
    async def main():
        good = FakeWorker("good")
        async with serve_app(good.app()) as gurl:
            for kind in ("refused", "connect_timeout", "reset"):
                async with dead_worker(kind) as durl, router_for(
                        # the good worker is very slow on paper, so the dead one is always the first choice
                        [WorkerSpec(durl), WorkerSpec(gurl, speed=1e-6)], upstream_connect_timeout_s=0.3,
                        health_interval_s=60) as (url, s, router):
                    before = good.served
                    async with s.post(url + "/v1/completions", json={"prompt": f"retry me {kind}"}) as r:
                        assert r.status == 200, (kind, await r.text())
                        assert r.headers["X-Gcache-Worker"] == wid(gurl)
                    assert good.served == before + 1
                    assert await metric(s, url, "gcache_router_retries_total") == 1, kind
                    await poll(lambda: _idle(router), what="leases released")
    asyncio.run(main())


def test_a_worker_that_closes_without_answering_gets_the_request_once_and_the_client_the_truth():
    """A request after which the worker closes the connection (a crash on that request) was sent
    6 times across 3 workers (a probe) and answered "no worker could be reached ... tried 3"."""
    async def main():
        fakes = [FakeWorker(f"w{i}") for i in range(3)]
        async with contextlib.AsyncExitStack() as st:
            urls = [await st.enter_async_context(serve_app(f.app())) for f in fakes]
            url, s, router = await st.enter_async_context(
                router_for([WorkerSpec(u) for u in urls], health_interval_s=60))
            for i in range(12):  # pooled keep-alive connections to every worker
                async with s.post(url + "/v1/completions", json={"prompt": f"warm {i}"}) as r:
                    assert r.status == 200
            async with s.post(url + "/v1/completions", json={"prompt": "poison", "drop": True}) as r:
                body = await r.json()
                assert r.status == 502, body
            msg = body["error"]["message"]
            assert "closed the connection without a response" in msg and "could be reached" not in msg, msg
            assert sum(f.dropped for f in fakes) == 1
            assert await metric(s, url, "gcache_router_retries_total") == 0
            crashed = next(u for u, f in zip(urls, fakes, strict=True) if f.dropped)
            assert router.state.circuits[crashed].fails == 1  # a failure of that worker
            await poll(lambda: _idle(router), what="leases released")
            for i in range(6):
                async with s.post(url + "/v1/completions", json={"prompt": f"after {i}"}) as r:
                    assert r.status == 200
    asyncio.run(main())


def test_only_dead_workers_is_a_502_after_the_retries():
    async def main():
        async with dead_worker("refused") as d1, dead_worker("refused") as d2, router_for(
                [WorkerSpec(d1), WorkerSpec(d2)], health_interval_s=60, retries=1) as (url, s, router):
            async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                body = await r.json()
                assert r.status == 502 and "no worker could be reached" in body["error"]["message"], body
            await poll(lambda: _idle(router), what="leases released")
    asyncio.run(main())


def test_upstream_5xx_is_passed_back_and_the_queue_still_drains():
    async def main():
        fake = FakeWorker("w0")
        fake.fail_status = 503
        async with serve_app(fake.app()) as wurl, router_for(
                [WorkerSpec(wurl, max_inflight=1)], queue=QueueConfig(max_wait_s=2)) as (url, s, router):
            rs = await asyncio.gather(*(s.post(url + "/v1/completions", json={"prompt": str(i)}) for i in range(3)))
            assert [r.status for r in rs] == [503] * 3  # the worker's own answer, not a router error
            for r in rs:
                r.release()
            await poll(lambda: _idle(router), what="leases released")
    asyncio.run(main())


def test_a_streams_first_event_gets_the_first_byte_budget_not_the_idle_one():
    """A worker that sends its SSE headers at once and its first event after the prefill (as
    SGLang does): the router waited for that event with the idle timeout and cut the stream
    (a probe: 120 s idle cut every long-context stream whose first token took longer)."""

    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl, router_for(
                [WorkerSpec(wurl)], upstream_first_byte_timeout_s=10, upstream_idle_timeout_s=0.3) as (url, s, router):
            async with s.post(url + "/generate", json={"text": "hi", "stream": True, "chunks": 2,
                                                       "first_event_s": 1.0}) as r:
                assert r.status == 200
                body = await r.read()
            assert body.count(b"data: ") == 3 and body.endswith(b"data: [DONE]\n\n")
            await poll(lambda: _idle(router), what="leases released")
    asyncio.run(main())


def test_headers_the_connection_header_names_are_not_forwarded():
    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl, router_for([WorkerSpec(wurl)]) as (url, s, _):
            async with s.post(url + "/v1/completions", json={"prompt": "x"},
                              headers={"Connection": "keep-alive, X-Secret", "X-Secret": "s3cr3t",
                                       "X-Kept": "1"}) as r:
                assert r.status == 200
            got = {k.lower() for k in fake.seen_headers[-1]}
            assert "x-secret" not in got and "x-kept" in got
    asyncio.run(main())


def test_a_request_whose_client_left_is_counted_499():
    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl, router_for([WorkerSpec(wurl)]) as (url, s, _router):
            with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError):
                async with s.post(url + "/v1/completions", json={"prompt": "slow", "hold": True},
                                  timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                    await r.read()
            fake.gate.set()
            await poll(lambda: metric(s, url, 'gcache_router_requests_total{route="/v1/completions",status="499"}'),
                       what="the abandoned request counted")
    asyncio.run(main())


def test_a_stopping_router_lets_requests_already_taken_finish():
    """SIGTERM closed every connection at once: streams cut, queued clients given no answer at
    all (a probe). Stopping with a drain: no new connection is accepted, the requests already
    taken (one at the worker, one queued behind it) are answered."""
    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl:
            app = build_app(test_config(), [WorkerSpec(wurl, max_inflight=1)])
            host, port = (await app.start("127.0.0.1", 0))[0]
            url = f"http://{host}:{port}"
            async with aiohttp.ClientSession() as s:
                async def ask(prompt):
                    async with s.post(url + "/v1/completions", json={"prompt": prompt, "hold": True}) as r:
                        return r.status, await r.json()

                first = asyncio.ensure_future(ask("one"))
                await poll(lambda: fake.active == 1, what="the first request at the worker")
                second = asyncio.ensure_future(ask("two"))  # queued: the worker takes one at a time
                await poll(lambda: sum(c._busy for c in app.server.conns) == 2, what="both requests taken")
                stopping = asyncio.ensure_future(app.stop(drain_s=10))
                await poll(lambda: not app.server.server.is_serving(), what="the listener closed")
                with pytest.raises(aiohttp.ClientConnectorError):  # no new connection meanwhile
                    async with aiohttp.ClientSession() as fresh:
                        await fresh.get(url + "/health")
                fake.gate.set()
                assert [(await first)[0], (await second)[0]] == [200, 200]
                await stopping
    asyncio.run(main())
