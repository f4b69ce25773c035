"""One upstream call: send a request body to a worker and pass its answer back to the client.

Timeouts: connect (``upstream_connect_timeout_s``), first byte (response headers within
``upstream_first_byte_timeout_s``), idle (each later chunk, read from the worker and written
to the client, within ``upstream_idle_timeout_s``). Failures are classified once, here:
a request that never reached the worker (connection refused, connect timeout, reset before
any response byte) raises ``NeverReached`` so the caller can retry it on another worker
(``router.upstream`` classifies); every other outcome is a ``Forwarded`` saying whether it
counts as a success for the worker's circuit breaker. A worker that closed the connection
after the request was sent, without a response byte, may have received it (and crashed on
it): a 502 saying so, counted as that worker's failure, not sent to another worker.

A short answer (``Content-Length`` up to ``WHOLE_BODY_MAX``, not an event stream) is read
whole and written to the client in one write; anything else streams chunk by chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from router.http11 import HttpConnection
from router.http_messages import Request, Response, head_bytes, json_error
from router.upstream import NoResponse, Unreached, UpstreamConn, UpstreamError, UpstreamPool

log = logging.getLogger("gcache.router.forward")

HOP_HEADERS = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"upgrade",
                         b"proxy-authorization", b"proxy-connection", b"te", b"trailer", b"accept-encoding",
                         b"expect"})
RESPONSE_DROP = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive",
                           b"content-encoding", b"date", b"server"})
WHOLE_BODY_MAX = 1 << 20  # non-streamed answers up to this size are read whole and sent in one write

CUT = "cut"  # the status a stream the worker cut mid-way is counted under (its head went out as 200)

__all__ = ["CUT", "Forwarded", "NeverReached", "Target", "Timeouts", "forward", "json_error"]


class NeverReached(Exception):
    """The worker never received the request; it is safe to send it elsewhere."""


@dataclass(frozen=True)
class Timeouts:
    first_byte_s: float
    idle_s: float


@dataclass(frozen=True)
class Target:
    """Where a worker URL points: the pool key, the Host header and the path prefix of every
    route (``http://host:port/engine1`` is sent ``POST /engine1/v1/completions``)."""

    key: tuple[str, int]
    host: bytes
    path: bytes = b""

    @classmethod
    def of(cls, url: str) -> Target:
        u = urlsplit(url)  # WorkerSpec checked it: http://, a host, a port in range
        return cls((u.hostname or "127.0.0.1", u.port or 80), u.netloc.encode("latin-1"),
                   u.path.rstrip("/").encode("latin-1"))


@dataclass
class Forwarded:
    response: Response | None  # None: the answer was already written to the client
    ok: bool  # for the circuit breaker: False on a 5xx, a timeout or a broken stream
    status: int | str  # for gcache_router_requests_total: the worker's status, or CUT


def request_bytes(req: Request, target: Target) -> bytes:
    """The upstream request: the client's own headers minus hop-by-hop ones (the fixed set, and
    those the client's Connection header names, RFC 9110 7.6.1), the body as sent."""
    parts = [b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n"
             % (target.path, req.path_qs.encode("utf-8", "surrogateescape"), target.host, len(req.body))]
    named = {tok.strip().lower() for k, v in req.headers if k.lower() == b"connection" for tok in v.split(b",")}
    for k, v in req.headers:
        if k.lower() not in HOP_HEADERS and k.lower() not in named:
            parts.append(b"%s: %s\r\n" % (k, v))
    parts.append(b"\r\n")
    parts.append(req.body)
    return b"".join(parts)


async def forward(pool: UpstreamPool, req: Request, conn: HttpConnection, target: Target, t: Timeouts,
                  extra_headers: list[bytes], on_first_byte: Callable[[], Awaitable[None]]) -> Forwarded:
    sent_at = time.monotonic()
    try:
        up = await pool.post(target.key, request_bytes(req, target), t.first_byte_s)
    except Unreached as e:
        raise NeverReached(str(e)) from None
    except TimeoutError:
        return Forwarded(json_error(504, f"the worker sent no response within {t.first_byte_s:g}s",
                                    "upstream_timeout"), False, 504)
    except NoResponse:  # it may have received the request: not sent to another worker
        return Forwarded(json_error(502, "the worker closed the connection without a response; the request may "
                                         "have reached it, so it was not retried", "upstream_error"), False, 502)
    except UpstreamError as e:
        return Forwarded(json_error(502, f"the worker failed: {e}", "upstream_error"), False, 502)
    ok = up.status < 500
    try:
        hdrs = [b"%s: %s\r\n" % (k, v) for k, v in up.headers if k.lower() not in RESPONSE_DROP]
        hdrs += extra_headers
        ctype = up.header("Content-Type") or b""
        if up.complete or (up.content_length is not None and up.content_length <= WHOLE_BODY_MAX
                           and not ctype.startswith(b"text/event-stream")):
            parts = []
            while chunks := await up.next_chunks(t.idle_s):
                parts += chunks
            body = b"".join(parts)
            hdrs.append(b"Content-Length: %d\r\n" % len(body))
            conn.write(head_bytes(up.status, hdrs, conn.keep_alive, up.reason) + body)
            return Forwarded(None, ok, up.status)
        return await _stream(conn, up, hdrs, t, on_first_byte, ok, target, sent_at)
    except (TimeoutError, UpstreamError) as e:
        log.warning("worker %s failed mid-response: %s: %s", target.key, type(e).__name__, e)
        return Forwarded(json_error(502, f"the worker failed mid-response: {type(e).__name__}", "upstream_error"),
                         False, 502)
    finally:
        up.release()


async def _stream(conn: HttpConnection, up: UpstreamConn, hdrs: list[bytes], t: Timeouts,
                  on_first_byte: Callable[[], Awaitable[None]], ok: bool, target: Target,
                  sent_at: float) -> Forwarded:
    conn.write_head(up.status, hdrs, up.reason)
    first = True
    try:
        while True:
            # the first chunk is the prefill's wait (a worker sends its headers at once, then
            # the first token): the first-byte budget, what is left of it; the idle one after
            wait = max(t.first_byte_s - (time.monotonic() - sent_at), t.idle_s) if first else t.idle_s
            chunks = await up.next_chunks(wait)
            if not chunks:
                break
            if first:
                await on_first_byte()
                first = False
            for c in chunks:
                conn.write_chunk(c)
            if conn.write_paused:
                await asyncio.wait_for(conn.drain(), t.idle_s)
        conn.write_eof()
    except ConnectionResetError:
        log.debug("client went away while streaming from %s", target.key)
        conn.abort()
    except (TimeoutError, UpstreamError) as e:
        # headers are sent: close without the terminating chunk, so the client sees the answer
        # was cut off (a clean end would pass a truncated answer for a whole one)
        log.warning("worker %s failed mid-stream: %s: %s", target.key, type(e).__name__, e)
        conn.abort()
        return Forwarded(None, False, CUT)
    return Forwarded(None, ok, up.status)
