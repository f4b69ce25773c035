"""The router's HTTP/1.1 server: an ``asyncio.Protocol`` over httptools (llhttp), built for
the proxy's hot path (aiohttp's server cost about half of the router's CPU per request).

One ``HttpConnection`` per client connection. Requests are parsed as bytes arrive and
answered strictly in order (pipelining); a handler answers with a whole ``Response`` or
streams through the connection (``write_head`` / ``write_chunk`` / ``write_eof``).
Protection: a head larger than ``max_head_bytes`` is a 431, a body over ``max_body_bytes``
a 413 (declared or chunked), a request not complete within ``request_timeout_s`` of its
first byte a 408, a malformed request a 400; each of these answers, then closes the
connection. Backpressure: while the client does not read (the transport's write buffer is over
its high-water mark) no further request is read or answered; at most ``_MAX_QUEUED`` parsed
requests wait behind the one being answered. Idle keep-alive connections close after ``keepalive_s``. Timers are one sweep
per server (``sweep_s``), not one per request.

A client that closes its side of the connection (EOF, or a reset) has given up, as nginx
assumes: requests queued behind the one being answered are dropped, ``gone()`` resolves and the
work in ``guard()`` (the upstream exchange) is cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar, cast

import httptools

from router.http_messages import Request, Response, ServerLimits, head_bytes, json_error

log = logging.getLogger("gcache.router.http")

_MAX_QUEUED = 16  # pipelined requests parsed ahead of the one being answered
Handler = Callable[[Request, "HttpConnection"], Awaitable[Response | None]]
T = TypeVar("T")


class HttpConnection(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self._queue: collections.deque[Request] = collections.deque()
        self._busy = False  # a task is answering the queue
        self._stopped = False  # no more requests are read (a refused one, or the client's close)
        self._refused = False
        self._paused_reading = False  # the transport's reading is paused (see _sync_reading)
        self._queue_full = False  # too many parsed requests wait: read no more until half are answered
        self._drain: asyncio.Future | None = None
        self._write_paused = False
        self._gone: asyncio.Future | None = None  # resolved when the client closes
        self._guarded: asyncio.Task | None = None  # cancelled when the client closes
        # the request being parsed
        self._in_msg = False
        self._started = 0.0
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_len = 0
        self._head_len = 0  # bytes received while the head was incomplete (a head that never ends)
        self._head_size = 0  # the parsed head: URL and header lines (checked when it completes)
        self._headers_done = False
        self._req: Request | None = None
        self.idle_since = 0.0
        # the response being written
        self._chunked = False
        self._keep_alive = True
        self._http11 = True
        self._linger_since: float | None = None

    @property
    def keep_alive(self) -> bool:
        """Whether the connection stays open after the answer being written."""
        return self._keep_alive

    @property
    def write_paused(self) -> bool:
        return self._write_paused

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.idle_since = self.server.loop.time()
        self.server.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stopped = True
        self._queue.clear()
        self.server.conns.discard(self)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)
        if self._guarded is not None:
            self._guarded.cancel()
            self._guarded = None

    def pause_writing(self) -> None:
        self._write_paused = True
        self._sync_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._sync_reading()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def _sync_reading(self) -> None:
        """Read while the client reads our answers and the queue has room."""
        paused = self._queue_full or self._write_paused
        if paused != self._paused_reading and self.transport is not None and not self.closed:
            self._paused_reading = paused
            if paused:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._stopped:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
            return
        except httptools.HttpParserError as e:
            self._refuse(400, f"malformed HTTP request: {e}")
            return
        if self._in_msg and not self._headers_done:
            self._head_len += len(data)
            if self._head_len > self.limits.max_head_bytes:
                self._refuse(431, f"request head exceeds {self.limits.max_head_bytes} bytes")

    def eof_received(self) -> bool | None:
        # the client closed (or half-closed) its side: it will not read what it asked for, or
        # has read our last answer; close (connection_lost cancels whatever is in flight)
        self._stopped = True
        return False

    # -- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._in_msg = True
        self._started = self.server.loop.time()
        self._url = b""
        self._headers = []
        self._body = []
        self._body_len = 0
        self._head_len = 0
        self._head_size = 0
        self._headers_done = False
        self._req = None

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        self._head_size += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        self._headers_done = True
        if self._head_size > self.limits.max_head_bytes:  # a head that ended in the read that crossed the limit
            self._refuse(431, f"request head exceeds {self.limits.max_head_bytes} bytes")
            return
        p = self.parser
        try:
            u = httptools.parse_url(self._url)
            path = u.path.decode("utf-8", "surrogateescape") if u.path else "/"
            query = u.query.decode("utf-8", "surrogateescape") if u.query else ""
        except httptools.HttpParserInvalidURLError:
            path, query = self._url.decode("latin-1"), ""
        clen: int | None = None
        expect = False
        for k, v in self._headers:
            if len(k) == 14 and k.lower() == b"content-length":
                with contextlib.suppress(ValueError):
                    clen = int(v)
            elif len(k) == 6 and k.lower() == b"expect":
                expect = v.lower() == b"100-continue"
        req = self._req = Request(p.get_method().decode("latin-1"), path, query, self._headers, b"",
                                  p.get_http_version(), p.should_keep_alive(), clen)
        if clen is not None and clen > self.limits.max_body_bytes:
            self._refuse(413, f"request body of {clen} bytes exceeds the limit of {self.limits.max_body_bytes} bytes",
                         req)
        elif expect and not self._busy and not self._queue and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._body_len += len(body)
        if self._body_len > self.limits.max_body_bytes:
            self._refuse(413, f"request body exceeds the limit of {self.limits.max_body_bytes} bytes", self._req)

    def on_message_complete(self) -> None:
        req = self._req
        self._in_msg = False
        if req is None or self._stopped:
            return
        body = self._body
        req.body = body[0] if len(body) == 1 else b"".join(body)
        self._push(req)
        if len(self._queue) > _MAX_QUEUED and not self._queue_full:
            self._queue_full = True
            self._sync_reading()

    # -- answering ----------------------------------------------------------------------
    def _refuse(self, status: int, message: str, req: Request | None = None) -> None:
        """Stop reading; answer ``status`` after whatever is queued ahead, then close."""
        if self._stopped:
            return
        self._stopped = True
        self._refused = True
        self._in_msg = False
        if req is None:
            req = Request("", "", "", [], b"", "1.1", False, None)
        req.reject = (status, message)
        req.keep_alive = False
        self._push(req)

    def _push(self, req: Request) -> None:
        self._queue.append(req)
        if not self._busy:
            self._busy = True
            self.server.loop.create_task(self._answer())

    async def _answer(self) -> None:
        handler = self.server.handler
        try:
            while self._queue:
                req = self._queue.popleft()
                if self._queue_full and len(self._queue) <= _MAX_QUEUED // 2:
                    self._queue_full = False
                    self._sync_reading()
                self._http11 = req.version == "1.1"
                self._keep_alive = req.keep_alive and self._http11  # HTTP/1.0: one request per connection
                self._chunked = False
                try:
                    resp = await handler(req, self)
                except ConnectionResetError:
                    resp = None
                    self._keep_alive = False
                except Exception:  # a bug: still an answer
                    log.exception("unhandled error answering %s %s", req.method, req.path)
                    resp = json_error(500, "internal router error; see the router's log", "internal_error")
                if resp is not None:
                    self.write_response(resp)
                if self._write_paused and not self.closed:
                    # the client is not reading: answer nothing more until it does (or give up)
                    try:
                        await asyncio.wait_for(self.drain(), self.limits.keepalive_s)
                    except (ConnectionResetError, TimeoutError):
                        self._close()
                        return
                if self.closed:
                    return
                if not self._keep_alive:
                    self._finish()
                    return
        finally:
            self._busy = False
            self.idle_since = self.server.loop.time()
        if self._stopped and not self.closed:
            self._finish()

    def _finish(self) -> None:
        """Close after the last answer. After a refusal the client may still be sending: shut our
        side, discard what arrives and close a moment later, so the answer is not lost to a reset."""
        t = self.transport
        if t is None or self.closed:
            return
        if self._refused and t.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                t.write_eof()
            self._linger_since = self.server.loop.time()
            return
        t.close()

    def write_response(self, resp: Response) -> None:
        hdrs = [b"Content-Type: %s\r\nContent-Length: %d\r\n" % (resp.content_type.encode(), len(resp.body))]
        hdrs += [f"{k}: {v}\r\n".encode("latin-1") for k, v in resp.headers.items()]
        self.write(head_bytes(resp.status, hdrs, self._keep_alive) + resp.body)

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def write_head(self, status: int, headers: list[bytes], reason: bytes | None = None) -> None:
        """Start a streamed answer; ``headers`` are ``Name: value\\r\\n`` lines (no framing headers)."""
        self._chunked = self._http11
        if self._chunked:
            headers = [*headers, b"Transfer-Encoding: chunked\r\n"]
        else:
            self._keep_alive = False  # an HTTP/1.0 client: the body ends with the connection
        self.write(head_bytes(status, headers, self._keep_alive, reason))

    def write_chunk(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if data:
            self.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)

    def write_eof(self) -> None:
        if self._chunked:
            self.write(b"0\r\n\r\n")

    def abort(self) -> None:
        """The streamed answer cannot be completed: close without a terminating chunk."""
        self._keep_alive = False
        self._close()

    def gone(self) -> asyncio.Future:
        """A future resolved once the client has closed the connection."""
        if self._gone is None:
            self._gone = self.server.loop.create_future()
            if self.closed:
                self._gone.set_result(None)
        return self._gone

    async def guard(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` in this task, cancelled if the client closes the connection meanwhile;
        then ConnectionResetError. Only code that is safe to cancel (no shared-state I/O) belongs here."""
        if self.closed:
            coro.close()
            raise ConnectionResetError("the client closed the connection")
        task = asyncio.current_task()
        self._guarded = task
        try:
            return await coro
        except asyncio.CancelledError:
            if self.closed and task is not None and task.uncancel() == 0:  # our cancel, not a shutdown's
                raise ConnectionResetError("the client closed the connection") from None
            raise
        finally:
            if self._guarded is task:
                self._guarded = None

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if self._write_paused:
            self._drain = self.server.loop.create_future()
            await self._drain

    def _close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    def sweep(self, now: float) -> None:
        if self._linger_since is not None:
            if now - self._linger_since > 2.0:
                self._close()
        elif self._in_msg and now - self._started > self.limits.request_timeout_s:
            req = self._req
            if req is not None:
                msg = (f"the request body did not arrive within {self.limits.request_timeout_s:g}s "
                       f"(Content-Length {req.content_length})")
            else:
                msg = f"the request head did not arrive within {self.limits.request_timeout_s:g}s"
            self._refuse(408, msg, req)
        elif not self._busy and not self._queue and not self._in_msg and now - self.idle_since > self.limits.keepalive_s:
            self._close()


class HttpServer:
    """Listen on host:port and answer every request with ``handler``."""

    def __init__(self, handler: Handler, limits: ServerLimits) -> None:
        self.handler = handler
        self.limits = limits
        self.conns: set[HttpConnection] = set()
        self.server: asyncio.Server | None = None
        self._sweeper: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop  # set by start()

    async def start(self, host: str, port: int, reuse_port: bool = False) -> list[tuple[str, int]]:
        self.loop = asyncio.get_running_loop()
        self.server = await self.loop.create_server(lambda: HttpConnection(self), host, port, backlog=1024,
                                                    reuse_port=reuse_port or None)
        self._sweeper = self.loop.create_task(self._sweep())
        return [s.getsockname()[:2] for s in self.server.sockets]

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.limits.sweep_s)
            now = self.loop.time()
            for c in list(self.conns):
                c.sweep(now)

    async def drain(self, timeout_s: float) -> bool:
        """Stop accepting, then wait (at most ``timeout_s``) until no connection has a request
        being answered or waiting; True if none was left. A rolling restart then cuts no
        generation that could finish in time (before, SIGTERM closed every connection at once:
        streams cut, queued clients given no answer at all)."""
        if self.server is not None:
            self.server.close()
        deadline = self.loop.time() + timeout_s
        while any(c._busy or c._queue or c._in_msg for c in self.conns):
            if self.loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self.server is not None:
            self.server.close()
        for c in list(self.conns):
            c._close()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)
