"""The router's own HTTP/1.1 server on raw sockets: pipelining, chunked request bodies,
malformed requests, huge heads, slow and vanishing clients, HTTP/1.0; the router survives
each and keeps answering."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

from router.config import WorkerSpec
from router.proxy import build_app
from tests.router.conftest import poll, serve_app, test_config
from tests.router.fakeworker import FakeWorker


@contextlib.asynccontextmanager
async def router(**cfg):
    fake = FakeWorker("w0")
    async with serve_app(fake.app()) as wurl, serve_app(build_app(test_config(**cfg), [WorkerSpec(wurl)])) as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port), fake


@contextlib.asynccontextmanager
async def router_with(spec=None, **cfg):
    """``router`` that also yields the RouterApp; ``spec``: WorkerSpec fields of the one worker."""
    fake = FakeWorker("w0")
    async with serve_app(fake.app()) as wurl:
        app = build_app(test_config(**cfg), [WorkerSpec(wurl, **(spec or {}))])
        async with serve_app(app) as url:
            host, port = url.removeprefix("http://").split(":")
            try:
                yield host, int(port), fake, app
            finally:
                fake.gate.set()  # nothing held at teardown, even when the test failed


async def inflight(r) -> int:
    return sum(w.inflight_requests for w in await r.state.snapshot(()))


def post(body: bytes, path: str = "/v1/completions", extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
            % (path.encode(), extra, len(body), body))


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += data[:-2]
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        body = await asyncio.wait_for(reader.read(), 10)
    return status, headers, body


async def still_alive(host: str, port: int) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(post(b'{"prompt": "still alive"}'))
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["worker"] == "w0"
    writer.close()


def test_pipelined_requests_are_answered_in_order_on_one_connection():
    async def main():
        async with router() as (host, port, fake):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"".join(post(json.dumps({"prompt": f"p{i}", "echo": i}).encode()) for i in range(5))
                         + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            for i in range(5):
                status, _, body = await read_response(reader)
                assert status == 200, body
                assert fake.bodies[i] == json.dumps({"prompt": f"p{i}", "echo": i}).encode()
            status, _, body = await read_response(reader)
            assert status == 200 and json.loads(body)["status"] == "ok"
            writer.close()
    asyncio.run(main())


def test_a_chunked_request_body_is_forwarded_whole():
    async def main():
        async with router() as (host, port, fake):
            reader, writer = await asyncio.open_connection(host, port)
            body = json.dumps({"prompt": "chunked " * 50}).encode()
            chunks = [body[:10], body[10:200], body[200:]]
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")
            status, _, _ = await read_response(reader)
            assert status == 200 and fake.bodies[-1] == body
            writer.close()
    asyncio.run(main())


def test_a_chunked_body_over_the_limit_is_a_413():
    async def main():
        async with router(max_body_bytes=1024) as (host, port, fake):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + b"400\r\n" + b"x" * 1024 + b"\r\n" + b"400\r\n" + b"x" * 1024 + b"\r\n")
            status, headers, body = await read_response(reader)
            assert status == 413 and "exceeds the limit" in json.loads(body)["error"]["message"]
            assert headers.get("connection") == "close"
            assert fake.served == 0
            writer.close()
            await still_alive(host, port)
    asyncio.run(main())


def test_malformed_requests_get_a_400_and_the_connection_closes():
    bad = [b"THIS IS NOT HTTP\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
           b"GET / HTTP/1.1\r\nBad Header Without Colon\r\n\r\n", b"\x00\x01\x02\x03\r\n\r\n"]

    async def main():
        async with router() as (host, port, _):
            for raw in bad:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(raw)
                status, _, body = await read_response(reader)
                assert status == 400, (raw, status, body)
                assert "malformed HTTP request" in json.loads(body)["error"]["message"]
                assert await asyncio.wait_for(reader.read(), 10) == b""  # closed
                writer.close()
            await still_alive(host, port)
    asyncio.run(main())


def test_a_huge_head_is_a_431_without_buffering_it_all():
    async def main():
        async with router() as (host, port, _):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (200 << 10))
            status, _, body = await read_response(reader)
            assert status == 431 and "request head exceeds" in json.loads(body)["error"]["message"]
            writer.close()
            await still_alive(host, port)
    asyncio.run(main())


def test_a_head_over_the_limit_is_a_431_even_when_one_read_completes_it():
    async def main():
        async with router() as (host, port, fake):
            raw = post(b'{"prompt": "x"}', extra=b"X-Big: " + b"a" * 70_000 + b"\r\n")
            for pieces in ([raw], [raw[i:i + 32768] for i in range(0, len(raw), 32768)]):
                reader, writer = await asyncio.open_connection(host, port)
                for p in pieces:
                    writer.write(p)
                    await writer.drain()
                status, _, body = await read_response(reader)
                assert status == 431 and "request head exceeds" in json.loads(body)["error"]["message"]
                writer.close()
            await still_alive(host, port)
            assert fake.served == 1  # only the still-alive request
    asyncio.run(main())


def test_a_slow_client_head_times_out_with_408_and_a_vanishing_client_costs_nothing():
    async def main():
        async with router(client_body_timeout_s=0.3) as (host, port, fake):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the head never ends
            status, _, body = await read_response(reader)
            assert status == 408 and "did not arrive" in json.loads(body)["error"]["message"]
            writer.close()
            for _ in range(5):  # clients that send half a request and vanish
                _r, w = await asyncio.open_connection(host, port)
                w.write(post(b'{"prompt": "gone"}')[:-5])
                w.close()
            await still_alive(host, port)
            assert fake.served == 1
    asyncio.run(main())


def test_http10_client_and_connection_close():
    async def main():
        async with router() as (host, port, _):
            for version, extra in ((b"HTTP/1.0", b""), (b"HTTP/1.1", b"Connection: close\r\n")):
                reader, writer = await asyncio.open_connection(host, port)
                body = b'{"prompt": "old client"}'
                writer.write(b"POST /v1/completions %s\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s"
                             % (version, extra, len(body), body))
                status, headers, _ = await read_response(reader)
                assert status == 200 and headers.get("connection") == "close"
                assert await asyncio.wait_for(reader.read(), 10) == b""
                writer.close()
            # a streamed answer to an HTTP/1.0 client ends with the connection, not with chunks
            reader, writer = await asyncio.open_connection(host, port)
            body = b'{"text": "hi", "stream": true, "chunks": 2}'
            writer.write(b"POST /generate HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            status, headers, data = await read_response(reader)
            assert status == 200 and "transfer-encoding" not in headers and data.endswith(b"data: [DONE]\n\n")
            writer.close()
    asyncio.run(main())


def test_expect_100_continue_is_honoured():
    async def main():
        async with router() as (host, port, fake):
            reader, writer = await asyncio.open_connection(host, port)
            body = b'{"prompt": "expect"}'
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 100")
            writer.write(body)
            status, _, _ = await read_response(reader)
            assert status == 200 and fake.bodies[-1] == body
            writer.close()
    asyncio.run(main())


def test_a_queued_request_whose_client_left_is_never_forwarded():
    async def main():
        async with router_with({"max_inflight": 1}) as (host, port, fake, app):
            r = app.router
            first = await asyncio.open_connection(host, port)
            first[1].write(post(b'{"prompt": "first", "hold": true}'))
            await poll(lambda: fake.active == 1, what="the first request at the worker")
            ghosts = []
            for i in range(3):
                ghosts.append(await asyncio.open_connection(host, port))
                ghosts[-1][1].write(post(b'{"prompt": "ghost %d"}' % i))
            await poll(lambda: r.admission.depth() == 3, what="three requests queued")
            for _, w in ghosts:
                w.close()  # their clients give up
            await poll(lambda: r.admission.depth() == 0, timeout=3, what="the queue empties as the clients leave")
            fake.gate.set()
            assert (await read_response(first[0]))[0] == 200
            await still_alive(host, port)
            assert [json.loads(b)["prompt"] for b in fake.bodies] == ["first", "still alive"]
            first[1].close()
    asyncio.run(main())


def test_a_client_that_leaves_aborts_its_upstream_request_and_frees_the_slot():
    async def main():
        async with router_with() as (host, port, fake, app):
            r = app.router
            # non-streamed: the worker holds the answer
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(post(b'{"prompt": "x", "hold": true}'))
            await poll(lambda: fake.active == 1, what="the request at the worker")
            writer.close()
            await poll(lambda: _is(inflight(r), 0), timeout=3, what="the slot freed when the client left")
            # streamed: the client leaves between two events
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(post(b'{"prompt": "y", "stream": true, "chunks": 3, "gate": true}'))
            assert b"200 OK" in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)  # the first event
            assert await inflight(r) == 1
            writer.close()
            await poll(lambda: _is(inflight(r), 0), timeout=3, what="the stream's slot freed when the client left")
            await still_alive(host, port)
    asyncio.run(main())


async def _is(coro, v) -> bool:
    return await coro == v


def test_a_client_that_pipelines_and_never_reads_is_not_answered_ahead():
    async def main():
        async with router_with() as (host, port, fake, app):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, port))
            reader, writer = await asyncio.open_connection(sock=sock)
            n = 40
            writer.write(b"".join(post(b'{"prompt": "p%d", "pad": 500000}' % i) for i in range(n)))
            conn = next(iter(await poll(lambda: app.server.conns, what="the connection accepted")))
            # the router either answers all (and buffers them) or waits for the client to read
            await poll(lambda: fake.served == n or (conn._drain is not None and not conn._drain.done()),
                       what="every answer written, or the router waiting for the client")
            assert conn._paused_reading  # and reads no more requests meanwhile
            buffered = conn.transport.get_write_buffer_size()
            assert fake.served < n - 5 and buffered < 2 * 500_000, (fake.served, buffered)
            for i in range(n):  # the client reads at last: every answer, in order
                status, _, body = await read_response(reader)
                assert status == 200 and json.loads(body)["pad"] == "x" * 500000
            assert [json.loads(b)["prompt"] for b in fake.bodies] == [f"p{i}" for i in range(n)]
            writer.close()
    asyncio.run(main())

