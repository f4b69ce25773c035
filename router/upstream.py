"""A small keep-alive HTTP/1.1 client for the proxy's one job: POST a body to a worker and
read the answer back, streamed. aiohttp's client costs about three times as much CPU per
request; the health checker still uses aiohttp.

Failures are typed so the caller can tell a request that never reached the worker
(``Unreached``: refused, connect timeout, a reused connection closed or reset before any
response byte) from one that did (``UpstreamError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

_NO_BODY = (204, 304)
_HEAD_LIMIT = 1 << 16


class Unreached(Exception):
    """The worker never received the request."""


class UpstreamError(Exception):
    """The worker received the request and then failed: bad framing, a reset, an early close."""


class _Conn:
    __slots__ = ("reader", "reused", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Response:
    """Status, headers (as sent, latin-1) and a body to read whole or chunk by chunk, once."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int], conn: _Conn, status: int, reason: str,
                 headers: list[tuple[str, str]], length: int | None, chunked: bool, keep_alive: bool) -> None:
        self._pool, self._key, self._conn = pool, key, conn
        self.status, self.reason, self.headers = status, reason, headers
        self.content_length = length
        self._chunked = chunked
        self._keep_alive = keep_alive
        self._done = False

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    async def read(self) -> bytes:
        return b"".join([c async for c in self.iter_chunks()])

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        r = self._conn.reader
        try:
            if self._chunked:
                while True:
                    line = await r.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0], 16)
                    if size == 0:
                        while (await r.readuntil(b"\r\n")) != b"\r\n":
                            pass  # trailers
                        break
                    data = await r.readexactly(size + 2)
                    yield data[:-2]
            elif self.content_length is not None:
                left = self.content_length
                while left > 0:
                    data = await r.read(min(left, 1 << 16))
                    if not data:
                        raise UpstreamError(f"connection closed with {left} body bytes missing")
                    left -= len(data)
                    yield data
            else:  # delimited by the connection's end
                self._keep_alive = False
                while data := await r.read(1 << 16):
                    yield data
            self._done = True
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ConnectionError) as e:
            raise UpstreamError(f"bad or broken response body: {type(e).__name__}: {e}") from None

    def release(self) -> None:
        """Give the connection back (answer fully read, keep-alive) or close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and self._keep_alive:
            self._pool.put(self._key, conn)
        else:
            conn.close()


class UpstreamPool:
    def __init__(self, connect_timeout_s: float, max_idle_per_worker: int = 256) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle_per_worker
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    def __repr__(self) -> str:
        return f"UpstreamPool(idle={ {k: len(v) for k, v in self._idle.items()} })"

    def put(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.max_idle and not conn.writer.is_closing():
            conn.reused = True
            idle.append(conn)
        else:
            conn.close()

    async def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        idle = self._idle.get(key)
        while idle:
            c = idle.pop()
            if not c.writer.is_closing() and not c.reader.at_eof():
                return c
            c.close()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(key[0], key[1], limit=_HEAD_LIMIT)
        except TimeoutError:
            raise Unreached(f"connect timeout after {self.connect_timeout_s:g}s") from None
        except OSError as e:  # the message names no address: it may reach a client
            why = os.strerror(e.errno) if e.errno else type(e).__name__
            raise Unreached(f"connect failed: {why}") from None
        return _Conn(reader, writer)

    async def post(self, url: str, headers: list[tuple[str, str]], body: bytes) -> Response:
        """Send the request; return once the status line and headers are in. The caller bounds
        the wait (first-byte timeout) and must ``release()`` the response."""
        u = urlsplit(url)
        key = (u.hostname or "127.0.0.1", u.port or 80)
        path = u.path + (f"?{u.query}" if u.query else "")
        head = [f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Length: {len(body)}\r\n"]
        head += [f"{k}: {v}\r\n" for k, v in headers]
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + body
        while True:
            conn = await self._connect(key)
            try:
                conn.writer.write(data)
                raw = await conn.reader.readuntil(b"\r\n\r\n")
                break
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                conn.close()
                partial = getattr(e, "partial", b"")
                if partial:
                    raise UpstreamError(f"connection broke inside the response head: {type(e).__name__}") from None
                if conn.reused:
                    continue  # the worker closed an idle connection: nothing was sent to it, try a fresh one
                raise Unreached(f"connection closed before any response byte: {type(e).__name__}") from None
            except asyncio.LimitOverrunError:
                conn.close()
                raise UpstreamError(f"response head larger than {_HEAD_LIMIT} bytes") from None
            except BaseException:
                conn.close()
                raise
        try:
            return _parse_head(self, key, conn, raw)
        except (ValueError, IndexError) as e:
            conn.close()
            raise UpstreamError(f"malformed response head: {e}") from None


def _parse_head(pool: UpstreamPool, key: tuple[str, int], conn: _Conn, raw: bytes) -> Response:
    lines = raw.decode("latin-1").split("\r\n")
    version, status_s, *reason = lines[0].split(" ", 2)
    status = int(status_s)
    headers = []
    length: int | None = None
    chunked = False
    keep_alive = version == "HTTP/1.1"
    for line in lines[1:]:
        if not line:
            continue
        k, v = line.split(":", 1)
        k, v = k.strip(), v.strip()
        lk = k.lower()
        if lk == "content-length":
            length = int(v)
        elif lk == "transfer-encoding":
            chunked = "chunked" in v.lower()
        elif lk == "connection":
            keep_alive = "close" not in v.lower() and (keep_alive or "keep-alive" in v.lower())
        headers.append((k, v))
    if status in _NO_BODY or 100 <= status < 200:
        length, chunked = 0, False
    elif chunked:
        length = None
    return Response(pool, key, conn, status, reason[0] if reason else "", headers, length, chunked, keep_alive)
