"""A minimal OpenAI-compatible echo worker for benchmarks: answers every completion at once
with a small JSON body, or with ``stream: true`` a few SSE events (the first one at once).
Run as ``python -m router.bench.echo --port N``; it prints ``listening`` when ready."""

from __future__ import annotations

import argparse
import json

from aiohttp import web

_ANSWER = json.dumps({"id": "cmpl-bench", "object": "text_completion", "model": "bench",
                      "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}}).encode()


async def complete(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    if b'"stream": true' not in body and b'"stream":true' not in body:
        return web.Response(body=_ANSWER, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(4):
        await resp.write(b'data: {"choices": [{"index": 0, "text": "t%d"}]}\n\n' % i)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def app() -> web.Application:
    a = web.Application()
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        a.router.add_post(path, complete)
    a.router.add_get("/health", health)
    return a


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m router.bench.echo")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    web.run_app(app(), host=a.host, port=a.port, access_log=None, print=lambda m: print("listening", flush=True))


if __name__ == "__main__":
    main()
