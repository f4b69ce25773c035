"""The HTTP edge: an aiohttp reverse proxy for /v1/completions, /v1/chat/completions
and /generate, plus /health, /metrics and the /admin/workers API.

Request bodies are forwarded byte-exact; responses (SSE included) are streamed
back chunk by chunk as they arrive. Every error the router itself produces is
JSON ``{"error": {"message", "type"}}`` with a 4xx/5xx status; an upstream error
is passed back with the upstream's status and body.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from router.admin import Admin
from router.admission import Admission, Rejected
from router.config import RouterConfig, StateMode, WorkerSpec, worker_id
from router.forward import NeverReached, Timeouts, forward, json_error
from router.health import HealthChecker
from router.kv_fleet import KvFleet
from router.l3 import L3Probe
from router.metrics import RouterMetrics
from router.policies import make_policy
from router.request import BadRequest, parse_request
from router.state_base import RouterState
from router.state_memory import MemoryState
from router.state_redis import RedisState, heartbeat_loop
from router.tokenize import Tokenization
from router.upstream import UpstreamPool

log = logging.getLogger("gcache.router.proxy")

LLM_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")


def error(status: int, message: str, kind: str = "invalid_request_error",
          headers: dict[str, str] | None = None) -> web.Response:
    return json_error(status, message, kind, headers)


class Router:
    """One replica: state, policy, admission, health checks and an HTTP client."""

    def __init__(self, cfg: RouterConfig, workers: list[WorkerSpec], state: RouterState | None = None) -> None:
        self.cfg = cfg
        self.initial_workers = workers
        if state is None:
            state = (RedisState(cfg.redis_url, cfg.prefix, cfg.namespace, breaker=cfg.breaker,
                                timeout_s=cfg.redis_timeout_s)
                     if cfg.state is StateMode.REDIS else MemoryState(cfg.prefix, breaker=cfg.breaker))
        self.state = state
        self.metrics = RouterMetrics()
        self.policy = make_policy(cfg.policy, cfg.policy_cfg)
        pc = cfg.prefix
        self.tok = Tokenization.load(pc.tokenizer_path, pc.chat_template_path) if pc.tokenizer_path else None
        self.kv = KvFleet(pc.page_tokens, self.state.forget_prefixes) if pc.page_tokens else None
        self.l3 = L3Probe(cfg.l3, pc.page_tokens) if cfg.l3 is not None else None
        self.admission = Admission(cfg, state, self.policy, self.metrics,
                                   exact=self.kv.match if self.kv is not None else None)
        self.session: aiohttp.ClientSession | None = None
        self.upstream: UpstreamPool | None = None
        self.health: HealthChecker | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = asyncio.Event()
        self.timeouts = Timeouts(cfg.upstream_first_byte_timeout_s, cfg.upstream_idle_timeout_s)
        self.id_salt = cfg.worker_id_salt or cfg.namespace
        self._ids: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"Router(policy={self.policy.name}, state={self.state!r})"

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(auto_decompress=False)  # health checks
        self.upstream = UpstreamPool(self.cfg.upstream_connect_timeout_s)
        await self.state.start()
        for w in self.initial_workers:
            await self.state.add_worker(w)
        self.health = HealthChecker(self.state, self.session, self.cfg.health_interval_s, self.cfg.health_failures)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.health.run(self._stopping)))
        if self.kv is not None:
            self._tasks.append(loop.create_task(self._kv_loop()))
        if isinstance(self.state, RedisState):
            self._tasks.append(loop.create_task(heartbeat_loop(self.state, min(1.0, self.cfg.health_interval_s),
                                                               self._stopping)))

    async def _kv_loop(self) -> None:
        """Keep one KV event subscriber per publishing worker, as workers come and go."""
        while not self._stopping.is_set():
            self.kv.reconcile(self.state.known_specs())
            await asyncio.sleep(self.cfg.health_interval_s)

    async def stop(self, app: web.Application) -> None:
        self._stopping.set()
        if self.kv is not None:
            await self.kv.close()
        if self.l3 is not None:
            self.l3.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.admission.close()
        if self.session is not None:
            await self.session.close()
        if self.upstream is not None:
            await self.upstream.close()
        await self.state.close()

    # -- inference routes -----------------------------------------------------------------
    async def handle_llm(self, request: web.Request) -> web.StreamResponse:
        try:
            resp = await self._handle_llm(request)
        except Exception:  # a bug: still a JSON answer, still counted
            log.exception("unexpected error handling %s", request.path)
            resp = error(500, "internal router error; see the router's log", "internal_error")
        self.metrics.count_request(request.path, resp.status)
        return resp

    async def _handle_llm(self, request: web.Request) -> web.StreamResponse:
        cfg = self.cfg
        if request.content_length is not None and request.content_length > cfg.max_body_bytes:
            return error(413, f"request body of {request.content_length} bytes exceeds the limit of "
                              f"{cfg.max_body_bytes} bytes")
        try:
            async with asyncio.timeout(cfg.client_body_timeout_s):
                body = await request.read()
        except TimeoutError:
            return error(408, f"the request body did not arrive within {cfg.client_body_timeout_s:g}s "
                              f"(Content-Length {request.content_length})")
        except web.HTTPRequestEntityTooLarge:
            return error(413, f"request body exceeds the limit of {cfg.max_body_bytes} bytes")
        try:
            obj = json.loads(body)
        except RecursionError:
            return error(400, "request body is nested too deeply to be parsed")
        except (ValueError, UnicodeDecodeError) as e:
            return error(400, f"request body is not valid JSON: {e}")
        try:
            parsed = parse_request(request.path, obj, cfg.prefix, self.tok)
        except BadRequest as e:
            return error(400, str(e))
        except RecursionError:
            return error(400, "request body is nested too deeply to be routed")
        l3_tokens = await self.l3.loadable_tokens(parsed.token_ids) if self.l3 is not None else 0
        tried: set[str] = set()
        failure = ""
        for _ in range(cfg.retries + 1):
            try:
                lease, decision = await self.admission.admit(parsed, frozenset(tried), l3_tokens)
            except Rejected as e:
                if tried:
                    return error(502, f"no worker could be reached ({failure}); tried {len(tried)}",
                                 "upstream_error")
                headers = {"Retry-After": str(int(e.retry_after + 0.999))} if e.retry_after else None
                return error(e.status, str(e), e.reason if e.status == 404 else "service_unavailable", headers)
            worker = decision.worker
            try:
                extra = {"X-Gcache-Worker": self.worker_id(worker)} if cfg.worker_header else {}
                res = await forward(self.upstream, request, body, worker + request.path_qs, self.timeouts,
                                    extra, functools.partial(self.state.prefill_done, lease))
            except NeverReached as e:
                failure = str(e)
                tried.add(worker)
                self.metrics.retries.inc()
                await self.state.record_outcome(worker, False)
                if self.health is not None:
                    await self.health.report(worker, False)
                continue
            finally:
                await self.admission.release(lease)
            await self.state.record_outcome(worker, res.ok)  # no I/O for a success on a clean record
            return res.response
        return error(502, f"no worker could be reached ({failure}); tried {len(tried)}", "upstream_error")

    # -- admin, health, metrics -----------------------------------------------------------
    async def handle_health(self, request: web.Request) -> web.Response:
        mode = "memory" if isinstance(self.state, MemoryState) else ("degraded" if self.state.degraded else "redis")
        return web.json_response({"status": "ok", "state": mode, "queue_depth": self.admission.depth()})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        self.metrics.set_workers(await self.state.snapshot(()), self.worker_id)
        self.metrics.redis_up.set(0 if self.state.degraded else 1)
        self.metrics.redis_errors.set(getattr(self.state, "errors", 0))
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    def forget_ids(self) -> None:
        self._ids.clear()

    def worker_id(self, name: str) -> str:
        wid = self._ids.get(name)
        if wid is None:
            spec = next((w for w in self.state.known_specs() if w.name == name), None)
            wid = worker_id(spec or WorkerSpec(name), self.id_salt)
            self._ids[name] = wid
        return wid


APP_KEY = web.AppKey("router", Router)


@web.middleware
async def json_errors(request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Turn aiohttp's plain-text HTTP errors (404, 405, 413...) into JSON with a message."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = {404: f"unknown route {request.path}; routes: {', '.join(LLM_ROUTES)}, /v1/models, /health, "
                    "/metrics, /admin/workers",
               405: f"method {request.method} not allowed on {request.path}"}.get(e.status, e.reason)
        return error(e.status, msg, "not_found" if e.status == 404 else "invalid_request_error")


def build_app(cfg: RouterConfig, workers: list[WorkerSpec], state: RouterState | None = None) -> web.Application:
    router = Router(cfg, workers, state)
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[json_errors])
    app[APP_KEY] = router
    for path in LLM_ROUTES:
        app.router.add_post(path, router.handle_llm)
    app.router.add_get("/health", router.handle_health)
    app.router.add_get("/metrics", router.handle_metrics)
    admin = Admin(router)
    app.router.add_get("/v1/models", admin.models)
    app.router.add_get("/admin/workers", admin.list_workers)
    app.router.add_post("/admin/workers", admin.add_worker)
    app.router.add_delete("/admin/workers", admin.remove_worker)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    return app
