"""The router's pooled worker connections (router.upstream) against a raw HTTP/1.1 worker on
loopback that misbehaves on cue. Found by a probe:

* a worker that sent one unsolicited extra response on a keep-alive connection desynchronised it:
  every later request on that connection got the previous request's answer (40 of 40), with no
  error anywhere;
* a worker that read a request and closed the connection was sent the same request again on
  every idle pooled connection to it (66 receipts of one request with 64 idle connections);
* then still twice (the reused connection, then a fresh one), and the second close was called
  "never reached", so the proxy sent it to two more workers: 6 receipts across 3 workers.
  A close after the request was written, before any answer, may follow its receipt: only a
  pooled connection idle long enough to have met the worker's keep-alive timeout is retried,
  once, on a fresh one; otherwise it is ``NoResponse``. A reset (the worker left the request
  unread) is still ``Unreached``."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import pytest

from router.upstream import NoResponse, Unreached, UpstreamPool
from tests.conftest import poll


class RawWorker:
    """Answers each POST with {"n": its request number}; ``mode`` says how to misbehave."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.received = 0
        self.stray = asyncio.Event()  # "stray": send an unsolicited response when set
        self.writers: list[asyncio.StreamWriter] = []

    @staticmethod
    def response(body: dict) -> bytes:
        data = json.dumps(body).encode()
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        served_here = 0
        try:
            while True:
                if self.mode == "reset":  # leave the request unread and abort (RST)
                    await reader.read(1)
                    self.received += 1
                    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                               struct.pack("ii", 1, 0))
                    writer.close()
                    return
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                self.received += 1
                n = self.received
                if self.mode == "close" or (self.mode == "close_reused" and served_here):
                    writer.close()
                    return
                served_here += 1
                if self.mode == "double":  # a second response in the same write
                    writer.write(self.response({"n": n}) + self.response({"n": f"STALE-{n}"}))
                else:
                    writer.write(self.response({"n": n}))
                await writer.drain()
                if self.mode == "stray":
                    await self.stray.wait()
                    writer.write(self.response({"n": f"STALE-{n}"}))
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


REQUEST = b"POST /generate HTTP/1.1\r\nHost: w\r\nContent-Length: 2\r\n\r\n{}"


async def ask(pool: UpstreamPool, key) -> tuple[dict, object]:
    conn = await pool.post(key, REQUEST, 5.0)
    body = b""
    while chunks := await conn.next_chunks(5.0):
        body += b"".join(chunks)
    conn.release()
    return json.loads(body), conn


async def with_worker(test, **pool_kw) -> None:
    worker = RawWorker()
    server = await asyncio.start_server(worker.serve, "127.0.0.1", 0)
    key = server.sockets[0].getsockname()[:2]
    pool = UpstreamPool(connect_timeout_s=2.0, **pool_kw)
    try:
        await test(worker, pool, key)
    finally:
        await pool.close()
        for w in worker.writers:
            w.close()
        server.close()


@pytest.mark.parametrize("mode", ["stray", "double"])
def test_an_extra_response_never_answers_the_next_request(mode):
    async def test(worker, pool, key):
        worker.mode = mode
        first, conn = await ask(pool, key)
        assert first == {"n": 1}
        if mode == "stray":  # sent while the connection waits idle in the pool
            worker.mode = "ok"
            worker.stray.set()
            assert await asyncio.to_thread(poll, lambda: conn.closed, 5), "the connection stayed in the pool"
        worker.mode = "ok"
        for _ in range(5):
            answer, _ = await ask(pool, key)
            assert answer == {"n": worker.received}, "an answer to another request"

    asyncio.run(with_worker(test))


async def _idle_connections(pool, key, n):
    conns = await asyncio.gather(*(pool.post(key, REQUEST, 5.0) for _ in range(n)))
    for c in conns:
        while await c.next_chunks(5.0):
            pass
        c.release()


def test_a_worker_that_closes_after_reading_gets_the_request_once():
    async def test(worker, pool, key):
        await _idle_connections(pool, key, 16)  # just used: no keep-alive timeout is due
        worker.mode = "close"
        before = worker.received
        with pytest.raises(NoResponse):
            await pool.post(key, REQUEST, 5.0)
        assert worker.received - before == 1

    asyncio.run(with_worker(test))


def test_a_pooled_connection_idle_long_enough_is_retried_once_on_a_fresh_one():
    async def test(worker, pool, key):
        await _idle_connections(pool, key, 4)
        worker.mode = "close_reused"  # as if its keep-alive timeout fired as the request came
        before = worker.received
        answer, _ = await ask(pool, key)
        assert answer == {"n": worker.received} and worker.received - before == 2
        worker.mode = "close"  # the fresh connection closes too: not sent a third time
        before = worker.received
        with pytest.raises(NoResponse):
            await pool.post(key, REQUEST, 5.0)
        assert worker.received - before == 2

    asyncio.run(with_worker(test, stale_idle_s=0.0))


def test_a_fresh_connection_closed_without_an_answer_is_no_response_and_a_reset_is_unreached():
    async def test(worker, pool, key):
        worker.mode = "close"
        with pytest.raises(NoResponse):
            await pool.post(key, REQUEST, 5.0)
        assert worker.received == 1
        worker.mode = "reset"  # the worker left the request unread: it never got it
        with pytest.raises(Unreached):
            await pool.post(key, REQUEST, 5.0)

    asyncio.run(with_worker(test))
