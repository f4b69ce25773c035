"""A minimal pipelined Redis client for the router's one hot command (``EVALSHA`` of the
state script): one connection, commands packed by hand, replies parsed by hiredis, any
number of pipelines in flight on it (Redis answers in order). redis-py's asyncio pipeline
cost the router about a fifth of its CPU per request; redis-py is still used for the rest.

Errors use redis-py's types so callers handle both clients alike: a connection that fails
or a reply later than ``timeout_s`` raises ``redis.exceptions.ConnectionError`` /
``TimeoutError`` for every pipeline in flight on it (the next call reconnects); a command
Redis refuses comes back as a ``redis.exceptions.ResponseError`` (``NoScriptError`` for an
unknown script) in its place in the result list.
"""

from __future__ import annotations

import asyncio
import collections
from typing import cast

import hiredis
import redis.exceptions
from redis.asyncio.connection import parse_url

Arg = bytes | str | int | float


def pack(cmd: list[Arg]) -> bytes:
    """A command in RESP (an array of bulk strings); numbers as their decimal text."""
    enc = [a if type(a) is bytes else str(a).encode() for a in cmd]
    return b"*%d\r\n" % len(enc) + b"".join([b"$%d\r\n%s\r\n" % (len(x), x) for x in enc])


class _Pending:
    __slots__ = ("fut", "left", "replies", "timer")

    def __init__(self, fut: asyncio.Future, n: int, timer: asyncio.TimerHandle) -> None:
        self.fut = fut
        self.left = n
        self.replies: list[object] = []
        self.timer = timer


class _Conn(asyncio.Protocol):
    def __init__(self, client: RespClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()
        self.pending: collections.deque[_Pending] = collections.deque()
        self.closed = False
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        r = self.reader
        try:
            r.feed(data)
            while (reply := r.gets()) is not False:
                if not self.pending:
                    raise redis.exceptions.ConnectionError("a reply nobody asked for")
                p = self.pending[0]
                p.replies.append(reply)
                p.left -= 1
                if p.left == 0:
                    self.pending.popleft()
                    p.timer.cancel()
                    if not p.fut.done():
                        p.fut.set_result(p.replies)
        except (hiredis.ProtocolError, redis.exceptions.ConnectionError) as e:
            self.fail(redis.exceptions.ConnectionError(f"redis protocol error: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(redis.exceptions.ConnectionError(f"redis connection lost: {exc or 'closed'}"))

    def fail(self, e: Exception) -> None:
        self.closed = True
        if self.client.conn is self:
            self.client.conn = None
        while self.pending:
            p = self.pending.popleft()
            p.timer.cancel()
            if not p.fut.done():
                p.fut.set_exception(e)
        if self.transport is not None:
            self.transport.close()


class RespClient:
    def __init__(self, url: str, timeout_s: float) -> None:
        kw = parse_url(url)
        self.host = str(kw.get("host", "127.0.0.1"))
        self.port = int(kw.get("port", 6379))
        self.path = kw.get("path")  # unix socket
        self.db = int(kw.get("db", 0) or 0)
        self.username = kw.get("username")
        self.password = kw.get("password")
        self.timeout_s = timeout_s
        self.conn: _Conn | None = None
        self._connecting: asyncio.Future | None = None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.path:
                    _, proto = await loop.create_unix_connection(lambda: _Conn(self), self.path)
                else:
                    _, proto = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except TimeoutError:
            raise redis.exceptions.TimeoutError("connecting to redis timed out") from None
        except OSError as e:
            raise redis.exceptions.ConnectionError(f"cannot connect to redis: {e}") from None
        setup: list[list[Arg]] = []
        if self.password:
            setup.append(["AUTH", *([self.username] if self.username else []), self.password])
        if self.db:
            setup.append(["SELECT", self.db])
        self.conn = proto
        if setup:
            for reply in await self._send(proto, setup):
                if isinstance(reply, hiredis.ReplyError):
                    proto.fail(redis.exceptions.ConnectionError(f"redis refused the connection setup: {reply}"))
                    raise redis.exceptions.ConnectionError(f"redis refused the connection setup: {reply}")
        return proto

    async def execute(self, cmds: list[list[Arg]]) -> list[object]:
        """Send ``cmds`` as one pipeline; their replies in order."""
        conn = self.conn
        if conn is None or conn.closed:
            if self._connecting is None:
                self._connecting = asyncio.ensure_future(self._connect())
            fut = self._connecting
            conn = None
            try:
                conn = cast(_Conn, await asyncio.shield(fut))
            finally:
                if self._connecting is fut and fut.done():
                    self._connecting = None
        replies = await self._send(conn, cmds)
        return [_error(r) if isinstance(r, hiredis.ReplyError) else r for r in replies]

    def _send(self, conn: _Conn, cmds: list[list[Arg]]) -> asyncio.Future:
        loop = conn.loop
        fut = loop.create_future()
        if conn.closed or conn.transport is None:
            fut.set_exception(redis.exceptions.ConnectionError("redis connection closed"))
            return fut
        timer = loop.call_later(self.timeout_s, conn.fail,
                                redis.exceptions.TimeoutError(f"no reply from redis within {self.timeout_s:g}s"))
        conn.pending.append(_Pending(fut, len(cmds), timer))
        conn.transport.write(b"".join(pack(c) for c in cmds))
        return fut

    async def close(self) -> None:
        if self.conn is not None:
            self.conn.fail(redis.exceptions.ConnectionError("client closed"))
            self.conn = None


def _error(r: hiredis.ReplyError) -> Exception:
    msg = str(r)
    if msg.startswith("NOSCRIPT"):
        return redis.exceptions.NoScriptError(msg)
    return redis.exceptions.ResponseError(msg)
