"""A fake inference worker: an aiohttp app that keeps a prefix cache of the prompts
it served (text chunks) and reports cached tokens like SGLang/vLLM do.

Test controls, in the request body (ignored by the router, forwarded byte-exact):
  "fail": 500        answer with that status and a JSON error
  "drop": true       read the request, then close the connection without answering (a crash)
  "hold": true       wait until POST /release before answering
  "pad": 100000      add that many bytes to the (non-streamed) answer
  "ticket": true      wait for one ``tickets.release()`` (the test lets requests finish one at a time)
  "decode_s": 0.1    take that long (after any hold and prefill) before answering: a workload's service time
  "chunks": 3        with "stream": true, send that many SSE events; between events
                     wait for POST /release when "gate" is true
  "cut": 1           with "stream": true, close the connection after that many events (a crash mid-stream)
Every answer includes the sha256 of the body the worker received.

With ``prefill_s_per_token`` > 0 the worker also models prefill time: requests take turns
(one prefill at a time) and each sleeps ``prefill_base_s + prefill_s_per_token x uncached
tokens`` before answering.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

from aiohttp import web

CHUNK = 64  # characters per cached block


class FakeWorker:
    def __init__(self, name: str, prefill_s_per_token: float = 0.0, prefill_base_s: float = 0.0) -> None:
        self.name = name
        self.prefill_s_per_token = prefill_s_per_token
        self.prefill_base_s = prefill_base_s
        self._prefill = asyncio.Lock()
        self.instance_id = "1"  # reported by /health; change it to play a restart
        self.fail_status = 0  # when set, every inference request is answered with this status
        self.cache: set[str] = set()
        self.healthy = True
        self.served = 0
        self.dropped = 0  # requests read and answered by closing the connection ("drop")
        self.active = 0
        self.gate = asyncio.Event()
        self.tickets = asyncio.Semaphore(0)
        self.bodies: list[bytes] = []
        self.seen_headers: list[dict] = []  # each request's headers, as the worker got them

    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            app.router.add_post(path, self.infer)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/release", self.release)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": self.healthy, "instance_id": self.instance_id},
                                 status=200 if self.healthy else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def release(self, request: web.Request) -> web.Response:
        self.gate.set()
        return web.json_response({"released": True})

    def _cached_tokens(self, text: str) -> int:
        n, prev = 0, ""
        for i in range(0, len(text) - CHUNK + 1, CHUNK):
            prev = hashlib.sha1((prev + text[i : i + CHUNK]).encode()).hexdigest()
            if prev in self.cache:
                n += CHUNK // 4
            self.cache.add(prev)
        return n

    async def infer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.bodies.append(raw)
        self.seen_headers.append(dict(request.headers))
        body = json.loads(raw)
        digest = hashlib.sha256(raw).hexdigest()
        if body.get("drop"):
            self.dropped += 1
            assert request.transport is not None
            request.transport.close()
            return web.Response()  # never sent: the connection is closed
        if body.get("fail") or self.fail_status:
            status = int(body.get("fail") or self.fail_status)
            return web.json_response({"error": {"message": "upstream exploded"}}, status=status)
        self.active += 1
        try:
            if body.get("hold"):
                await self.gate.wait()
            if body.get("ticket"):
                await self.tickets.acquire()
            text = body.get("prompt") or body.get("text") or json.dumps(body.get("messages"))
            text = text if isinstance(text, str) else json.dumps(text)
            if self.prefill_s_per_token > 0:
                async with self._prefill:
                    cached = self._cached_tokens(text)
                    await asyncio.sleep(self.prefill_base_s + self.prefill_s_per_token * (len(text) // 4 - cached))
            else:
                cached = self._cached_tokens(text)
            if body.get("decode_s"):
                await asyncio.sleep(float(body["decode_s"]))
            self.served += 1
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                if body.get("first_event_s"):  # headers at once, the first token later (SGLang's way)
                    await asyncio.sleep(float(body["first_event_s"]))
                for i in range(int(body.get("chunks", 3))):
                    if "cut" in body and i == int(body["cut"]):
                        assert request.transport is not None
                        request.transport.close()
                        return resp
                    if body.get("gate") and i > 0:
                        await self.gate.wait()
                        self.gate.clear()
                    await resp.write(f"data: {json.dumps({'i': i, 'worker': self.name})}\n\n".encode())
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            return web.json_response({
                "worker": self.name, "sha256": digest,
                "usage": {"prompt_tokens_details": {"cached_tokens": cached}},
                **({"pad": "x" * int(body["pad"])} if body.get("pad") else {}),
            })
        finally:
            self.active -= 1
