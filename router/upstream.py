"""A small keep-alive HTTP/1.1 client for the proxy's one job: POST a body to a worker and
read the answer back, whole or streamed. An ``asyncio.Protocol`` per connection with
httptools parsing the response; a short answer that arrives in one read wakes the proxy
once. The health checker still uses aiohttp.

Failures are typed so the caller can tell a request that never reached the worker
(``Unreached``: refused, connect timeout, a connection reset before any response byte: the
worker left the request unread) from one that may have (``UpstreamError``; ``NoResponse``
when the worker closed the connection after the request was sent, before any response byte:
it may have read the request and crashed on it, so it is not sent elsewhere). A pooled
connection idle for ``stale_idle_s`` or more may meet the worker's keep-alive timeout as the
request goes out; if it closes without a response byte the request is sent again on a fresh
connection, once. A connection reused sooner, or the fresh one, closing without an answer is
``NoResponse``: the request reaches a worker at most twice (once, unless idle that long).

A connection carries exactly one response per request: bytes from the worker while no request is
outstanding, or a second response after the first, close it (kept, they would be read as the
answer to the next request sent on it, and every later one would get its predecessor's).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from typing import cast

import httptools

_HEAD_LIMIT = 1 << 16
_HIGH_WATER = 1 << 20  # body bytes buffered from a worker before its connection stops being read
STALE_IDLE_S = 1.0  # a pooled connection idle this long may have met the worker's keep-alive timeout


class Unreached(Exception):
    """The worker never received the request."""


class UpstreamError(Exception):
    """The worker received the request and then failed: bad framing, a reset, an early close."""


class NoResponse(UpstreamError):
    """The worker closed the connection after the request was sent, before any response byte:
    it may have received the request (and crashed on it); not safe to send elsewhere."""


class _Closed(Exception):
    """The connection closed before any response byte (the caller decides: retry or not)."""

    def __init__(self, why: str, reset: bool) -> None:
        super().__init__(why)
        self.reset = reset  # a reset: the worker left the request unread (it never got it)


class UpstreamConn(asyncio.Protocol):
    """One connection to a worker; carries one request at a time."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.idle_since = 0.0  # loop time it went back to the pool
        self.busy = False  # a request is outstanding (post() to release())
        self._waiter: asyncio.Future | None = None
        self._want_head = True
        self._paused = False
        self.deadline = 0.0  # loop time the current wait times out
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_length: int | None = None
        self.chunked = False
        self.keep_alive = True
        self.head_done = False
        self.complete = False
        self.got_bytes = False
        self.head_bytes = 0
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.error: Exception | None = None
        self.excess = False  # a second response began after this request's: never reused

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # nothing asked: a stray response would answer the next request
            self.close()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"malformed response: {e}"))
        if not self.head_done:
            self.head_bytes += len(data)
            if self.head_bytes > _HEAD_LIMIT:
                self._fail(UpstreamError(f"response head larger than {_HEAD_LIMIT} bytes"))
        elif self.buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete:
            return
        if self.head_done and self.content_length is None and not self.chunked:
            self.complete = True  # a body delimited by the connection's end
            self.keep_alive = False
        elif not self.got_bytes:
            self.error = _Closed(type(exc).__name__ if exc else "closed", isinstance(exc, ConnectionResetError))
        elif self.error is None:
            where = "body" if self.head_done else "head"
            self.error = UpstreamError(f"connection broke inside the response {where}: "
                                       f"{type(exc).__name__ if exc else 'closed'}")
        self._wake()

    # -- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second response to one request: ignored, and the connection closed
            self.excess = True
            self.close()

    def on_status(self, reason: bytes) -> None:
        if not self.excess:
            self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.excess:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.excess:
            return
        self.status = self.parser.get_status_code()
        if self.status < 200:  # an interim 1xx answer: the real one follows
            return
        self.keep_alive = self.parser.should_keep_alive()
        for k, v in self.headers:
            lk = k.lower()
            if lk == b"content-length":
                with contextlib.suppress(ValueError):
                    self.content_length = int(v)
            elif lk == b"transfer-encoding":
                self.chunked = b"chunked" in v.lower()
        if self.status in (204, 304):
            self.content_length = 0
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        if not self.excess:
            self.chunks.append(body)
            self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.excess:
            return
        if self.status < 200:
            self.status, self.reason, self.headers = 0, b"", []
            return
        self.complete = True

    # -- the proxy's side ----------------------------------------------------------------
    def _fail(self, e: Exception) -> None:
        if self.error is None:
            self.error = e
        self.close()

    def _wake(self) -> None:
        w = self._waiter
        if w is None or w.done():
            return
        if self.error is not None or self.complete or (self.head_done if self._want_head else bool(self.chunks)):
            w.set_result(None)

    def _timed_out(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(TimeoutError())

    async def _wait(self, want_head: bool, timeout_s: float) -> None:
        pool = self.pool
        self._want_head = want_head
        self._waiter = w = pool.loop.create_future()
        self._wake()
        if w.done():
            return
        self.deadline = pool.loop.time() + timeout_s
        pool.waiting.add(self)  # the pool's sweep fires the timeout: no timer per request
        try:
            await w
        finally:
            pool.waiting.discard(self)
            self._waiter = None

    async def wait_head(self, timeout_s: float) -> None:
        """Until the response head is in; raises _Closed, UpstreamError or TimeoutError."""
        await self._wait(True, timeout_s)
        if self.error is not None and not self.head_done:
            raise self.error
        if not self.head_done:
            raise UpstreamError("no response head")

    async def next_chunks(self, timeout_s: float) -> list[bytes]:
        """Body bytes received since the last call; [] once the body is complete. Raises
        UpstreamError or TimeoutError (nothing arrived for ``timeout_s``)."""
        if not self.chunks and not self.complete and self.error is None:
            await self._wait(False, timeout_s)
        if self.chunks:
            out = list(self.chunks)
            self.chunks.clear()
            self.buffered = 0
            if self._paused and self.transport is not None and not self.closed:
                self._paused = False
                self.transport.resume_reading()
            return out
        if self.error is not None:
            raise self.error if isinstance(self.error, UpstreamError) else UpstreamError(str(self.error))
        return []

    def header(self, name: str) -> bytes | None:
        key = name.lower().encode()
        return next((v for k, v in self.headers if k.lower() == key), None)

    def release(self) -> None:
        """Give the connection back (answer fully read, keep-alive) or close it."""
        if (self.complete and self.keep_alive and not self.chunks and not self.closed and self.error is None
                and not self.excess):
            self._reset()
            self.busy = False
            self.pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


class UpstreamPool:
    def __init__(self, connect_timeout_s: float, max_idle_per_worker: int = 256,
                 stale_idle_s: float = STALE_IDLE_S) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle_per_worker
        self.stale_idle_s = stale_idle_s
        self._idle: dict[tuple[str, int], list[UpstreamConn]] = {}
        self.loop = asyncio.get_running_loop()
        self.waiting: set[UpstreamConn] = set()  # connections with a wait that can time out
        self._sweeper = self.loop.create_task(self._sweep())

    async def _sweep(self, tick_s: float = 0.05) -> None:
        """Time out the waits whose deadline passed (to within ``tick_s``)."""
        while True:
            await asyncio.sleep(tick_s)
            if self.waiting:
                now = self.loop.time()
                for c in [c for c in self.waiting if c.deadline <= now]:
                    c._timed_out()

    def __repr__(self) -> str:
        return f"UpstreamPool(idle={ {k: len(v) for k, v in self._idle.items()} })"

    def put(self, conn: UpstreamConn) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) < self.max_idle:
            conn.reused = True
            conn.idle_since = self.loop.time()
            idle.append(conn)
        else:
            conn.close()

    async def close(self) -> None:
        self._sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sweeper
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()

    def _idle_conn(self, key: tuple[str, int]) -> UpstreamConn | None:
        idle = self._idle.get(key)
        while idle:
            c = idle.pop()
            if not c.closed:
                return c
        return None

    async def _connect(self, key: tuple[str, int]) -> UpstreamConn:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, proto = await self.loop.create_connection(lambda: UpstreamConn(self, key), key[0], key[1])
        except TimeoutError:
            raise Unreached(f"connect timeout after {self.connect_timeout_s:g}s") from None
        except OSError as e:  # the message names no address: it may reach a client
            why = os.strerror(e.errno) if e.errno else type(e).__name__
            raise Unreached(f"connect failed: {why}") from None
        except ValueError as e:  # an address the resolver or socket refuses (UnicodeError included)
            raise Unreached(f"connect failed: {type(e).__name__}") from None
        return proto

    async def post(self, key: tuple[str, int], data: bytes, first_byte_timeout_s: float) -> UpstreamConn:
        """Send a whole request (head and body); return the connection once the response head is
        in. Raises Unreached, UpstreamError or TimeoutError; the caller must ``release()``."""
        conn = self._idle_conn(key) or await self._connect(key)
        retried = False
        while True:
            if conn.closed or conn.transport is None:  # before anything was sent on it
                raise Unreached("connection closed before the request was sent")
            stale = conn.reused and self.loop.time() - conn.idle_since >= self.stale_idle_s
            conn.busy = True
            conn.transport.write(data)
            try:
                await conn.wait_head(first_byte_timeout_s)
                return conn
            except _Closed as e:
                conn.close()
                if stale and not retried:
                    # likely the worker's keep-alive timeout closing it as the request went out:
                    # once more, on a fresh connection
                    retried = True
                    conn = await self._connect(key)
                    continue
                if e.reset:
                    raise Unreached(f"connection reset before any response byte: {e}") from None
                raise NoResponse(f"closed the connection without a response ({e})") from None
            except BaseException:
                conn.close()
                raise
