"""One upstream call: send a request body to a worker and stream its answer back.

Timeouts: connect (``upstream_connect_timeout_s``), first byte (response headers within
``upstream_first_byte_timeout_s``), idle (each later chunk, read from the worker and written
to the client, within ``upstream_idle_timeout_s``). Failures are classified once, here:
a request that never reached the worker (connection refused, reset or closed before any
response byte, connect timeout) raises ``NeverReached`` so the caller can retry it on
another worker (``router.upstream`` classifies); every other outcome is a ``Forwarded`` with the response the client got
and whether it counts as a success for the worker's circuit breaker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict

from router.upstream import Response, Unreached, UpstreamError, UpstreamPool

log = logging.getLogger("gcache.router.forward")

HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
                         "proxy-authorization", "proxy-connection", "te", "trailer", "accept-encoding"})
RESPONSE_DROP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding",
                           "date", "server"})
WHOLE_BODY_MAX = 1 << 20  # non-streamed answers up to this size are read whole and sent in one write


class NeverReached(Exception):
    """The worker never received the request; it is safe to send it elsewhere."""


@dataclass(frozen=True)
class Timeouts:
    first_byte_s: float
    idle_s: float


@dataclass
class Forwarded:
    response: web.StreamResponse
    ok: bool  # for the circuit breaker: False on a 5xx, a timeout or a broken stream
    status: int


def json_error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status, headers=headers)


async def forward(pool: UpstreamPool, request: web.Request, body: bytes, url: str, t: Timeouts,
                  response_headers: dict[str, str], on_first_byte: Callable[[], Awaitable[None]]) -> Forwarded:
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
    try:
        async with asyncio.timeout(t.first_byte_s):
            up = await pool.post(url, headers, body)
    except Unreached as e:
        raise NeverReached(str(e)) from None
    except TimeoutError:
        return Forwarded(json_error(504, f"the worker sent no response within {t.first_byte_s:g}s",
                                    "upstream_timeout"), False, 504)
    except UpstreamError as e:
        return Forwarded(json_error(502, f"the worker failed: {e}", "upstream_error"), False, 502)
    ok = up.status < 500
    try:
        hdrs = [(k, v) for k, v in up.headers if k.lower() not in RESPONSE_DROP]
        hdrs += response_headers.items()
        ctype = up.header("Content-Type") or ""
        if up.content_length is not None and up.content_length <= WHOLE_BODY_MAX \
                and not ctype.startswith("text/event-stream"):
            async with asyncio.timeout(t.idle_s):
                data = await up.read()
            return Forwarded(web.Response(body=data, status=up.status, reason=up.reason, headers=CIMultiDict(hdrs)),
                             ok, up.status)
        return await _stream(request, up, CIMultiDict(hdrs), t, on_first_byte, ok, url)
    except (TimeoutError, UpstreamError) as e:
        log.warning("worker %s failed mid-response: %s: %s", url, type(e).__name__, e)
        return Forwarded(json_error(502, f"the worker failed mid-response: {type(e).__name__}", "upstream_error"),
                         False, 502)
    finally:
        up.release()


async def _stream(request: web.Request, up: Response, hdrs: CIMultiDict, t: Timeouts,
                  on_first_byte: Callable[[], Awaitable[None]], ok: bool, url: str) -> Forwarded:
    out = web.StreamResponse(status=up.status, reason=up.reason, headers=hdrs)
    await out.prepare(request)
    loop = asyncio.get_running_loop()
    first = True
    try:
        async with asyncio.timeout(t.idle_s) as deadline:
            async for chunk in up.iter_chunks():
                if first:
                    await on_first_byte()
                    first = False
                await out.write(chunk)
                deadline.reschedule(loop.time() + t.idle_s)
        await out.write_eof()
    except ConnectionResetError:
        log.debug("client went away while streaming from %s", url)
    except (TimeoutError, UpstreamError) as e:
        # headers are sent: the client sees a truncated stream
        log.warning("worker %s failed mid-stream: %s: %s", url, type(e).__name__, e)
        ok = False
    return Forwarded(out, ok, up.status)
