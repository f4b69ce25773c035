"""The HTTP edge: a reverse proxy for /v1/completions, /v1/chat/completions and /generate,
plus /health, /metrics, /v1/models and the /admin/workers API, on the router's own HTTP/1.1
server (``router.http11``).

Request bodies are forwarded byte-exact; responses (SSE included) are streamed
back chunk by chunk as they arrive. Every error the router itself produces is
JSON ``{"error": {"message", "type"}}`` with a 4xx/5xx status; an upstream error
is passed back with the upstream's status and body.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
from collections.abc import Awaitable, Callable

import aiohttp

from router.admin import Admin
from router.admission import Admission, Rejected
from router.config import RouterConfig, StateMode, WorkerSpec, check_workers, worker_id
from router.forward import NeverReached, Target, Timeouts, forward
from router.health import HealthChecker
from router.http11 import HttpConnection, HttpServer
from router.http_messages import Request, Response, ServerLimits, json_error, json_response
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
_LLM = frozenset(LLM_ROUTES)


def error(status: int, message: str, kind: str = "invalid_request_error",
          headers: dict[str, str] | None = None) -> Response:
    return json_error(status, message, kind, headers)


class Router:
    """One replica: state, policy, admission, health checks and an HTTP client."""

    def __init__(self, cfg: RouterConfig, workers: list[WorkerSpec], state: RouterState | None = None) -> None:
        check_workers(workers, len(cfg.buckets.ranges))
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
        self._targets: dict[str, Target] = {}
        self.routes: dict[str, dict[str, Callable[[Request], Awaitable[Response]]]] = {}
        self.access_log: logging.Logger | None = None  # --access-log

    def __repr__(self) -> str:
        return f"Router(policy={self.policy.name}, state={self.state!r})"

    async def start(self) -> None:
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
        assert self.kv is not None
        while not self._stopping.is_set():
            self.kv.reconcile(self.state.known_specs())
            await asyncio.sleep(self.cfg.health_interval_s)

    async def stop(self) -> None:
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

    # -- dispatch ---------------------------------------------------------------------------
    async def handle(self, req: Request, conn: HttpConnection) -> Response | None:
        """The server's one handler: route by path and method."""
        path = req.path
        if path in _LLM:
            if req.reject is None and req.method != "POST":
                self.metrics.count_request(path, 405)
                return error(405, f"method {req.method} not allowed on {path}")
            resp: Response | None
            try:
                resp, status = await self._handle_llm(req, conn)
            except ConnectionResetError:  # the client left first: counted as nginx does (499)
                self.metrics.count_request(path, 499)
                raise
            except Exception:  # a bug: still a JSON answer, still counted
                log.exception("unexpected error handling %s", req.path)
                resp, status = error(500, "internal router error; see the router's log", "internal_error"), 500
            self.metrics.count_request(path, status)
            return resp
        if req.reject is not None:
            return error(*req.reject)
        routes = self.routes.get(path)
        if routes is None:
            return error(404, f"unknown route {path}; routes: {', '.join(LLM_ROUTES)}, /v1/models, /health, "
                              "/metrics, /admin/workers", "not_found")
        handler = routes.get(req.method)
        if handler is None:
            return error(405, f"method {req.method} not allowed on {path}")
        return await handler(req)

    async def handle_logged(self, req: Request, conn: HttpConnection) -> Response | None:
        """``handle`` plus one access-log line per request (off the hot path unless asked for)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        resp = await self.handle(req, conn)
        if self.access_log is not None:
            self.access_log.info("%s %s %s %.1fms", req.method, req.path,
                                 resp.status if resp is not None else "streamed", (loop.time() - t0) * 1000)
        return resp

    # -- inference routes -----------------------------------------------------------------
    async def _handle_llm(self, req: Request, conn: HttpConnection) -> tuple[Response | None, int | str]:
        cfg = self.cfg
        if req.reject is not None:
            return error(*req.reject), req.reject[0]
        try:
            obj = json.loads(req.body)
        except RecursionError:
            return error(400, "request body is nested too deeply to be parsed"), 400
        except (ValueError, UnicodeDecodeError) as e:
            return error(400, f"request body is not valid JSON: {e}"), 400
        try:
            parsed = parse_request(req.path, obj, cfg.prefix, self.tok)
        except BadRequest as e:
            return error(400, str(e)), 400
        except RecursionError:
            return error(400, "request body is nested too deeply to be routed"), 400
        assert self.upstream is not None, "the router is not started"
        l3_tokens = await self.l3.loadable_tokens(parsed.token_ids) if self.l3 is not None else 0
        tried: set[str] = set()
        failure = ""
        for _ in range(cfg.retries + 1):
            try:
                lease, decision = await self.admission.admit(parsed, frozenset(tried), l3_tokens, conn.gone)
            except Rejected as e:
                if tried:
                    return error(502, f"no worker could be reached ({failure}); tried {len(tried)}",
                                 "upstream_error"), 502
                headers = {"Retry-After": str(int(e.retry_after + 0.999))} if e.retry_after else None
                kind = e.reason if e.status == 404 else "service_unavailable"
                return error(e.status, str(e), kind, headers), e.status
            worker = decision.worker
            try:
                extra = [b"X-Gcache-Worker: %s\r\n" % self.worker_id(worker).encode()] if cfg.worker_header else []
                # a client that leaves aborts the upstream exchange (ConnectionResetError)
                res = await conn.guard(forward(self.upstream, req, conn, self.target(worker), self.timeouts,
                                               extra, functools.partial(self.state.prefill_done, lease)))
                # before the release: a half-open circuit's probe token goes with its outcome
                await self.state.record_outcome(worker, res.ok)  # no I/O for a success on a clean record
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
            return res.response, res.status
        return error(502, f"no worker could be reached ({failure}); tried {len(tried)}", "upstream_error"), 502

    def target(self, worker: str) -> Target:
        t = self._targets.get(worker)
        if t is None:
            try:
                t = Target.of(worker)
            except ValueError as e:  # a URL no check let through (e.g. written to Redis by an older replica)
                raise NeverReached(f"unusable worker URL: {e}") from None
            self._targets[worker] = t
        return t

    # -- admin, health, metrics -----------------------------------------------------------
    async def handle_health(self, req: Request) -> Response:
        mode = "memory" if isinstance(self.state, MemoryState) else ("degraded" if self.state.degraded else "redis")
        return json_response({"status": "ok", "state": mode, "queue_depth": self.admission.depth()})

    async def handle_metrics(self, req: Request) -> Response:
        self.metrics.set_workers(await self.state.snapshot(()), self.worker_id)
        self.metrics.redis_up.set(0 if self.state.degraded else 1)
        self.metrics.redis_errors.set(getattr(self.state, "errors", 0))
        return Response(200, self.metrics.render(), "text/plain; charset=utf-8")

    def forget_ids(self) -> None:
        self._ids.clear()

    def worker_id(self, name: str) -> str:
        wid = self._ids.get(name)
        if wid is None:
            spec = next((w for w in self.state.known_specs() if w.name == name), None)
            wid = worker_id(spec or WorkerSpec(name), self.id_salt)
            self._ids[name] = wid
        return wid


APP_KEY = "router"


class RouterApp:
    """A router replica and its HTTP server: ``start(host, port)``, ``stop()``; ``app[APP_KEY]``
    is the ``Router``."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.server: HttpServer | None = None

    def __getitem__(self, key: str) -> Router:
        if key != APP_KEY:
            raise KeyError(key)
        return self.router

    async def start(self, host: str, port: int, reuse_port: bool = False) -> list[tuple[str, int]]:
        cfg = self.router.cfg
        await self.router.start()
        handler = self.router.handle if self.router.access_log is None else self.router.handle_logged
        self.server = HttpServer(handler, ServerLimits(max_body_bytes=cfg.max_body_bytes,
                                                                  request_timeout_s=cfg.client_body_timeout_s))
        try:
            return await self.server.start(host, port, reuse_port)
        except BaseException:
            await self.router.stop()
            raise

    async def stop(self, drain_s: float = 0.0) -> None:
        """Stop; with ``drain_s``, first let the requests already taken finish (at most that long)."""
        if self.server is not None:
            if drain_s > 0 and not await self.server.drain(drain_s):
                log.warning("requests still running after the %gs drain: cut", drain_s)
            await self.server.stop()
        await self.router.stop()


def build_app(cfg: RouterConfig, workers: list[WorkerSpec], state: RouterState | None = None) -> RouterApp:
    router = Router(cfg, workers, state)
    admin = Admin(router)
    Handler = Callable[[Request], Awaitable[Response]]
    routes: dict[str, dict[str, Handler]] = {
        "/health": {"GET": router.handle_health},
        "/metrics": {"GET": router.handle_metrics},
        "/v1/models": {"GET": admin.models},
        "/admin/workers": {"GET": admin.list_workers, "POST": admin.add_worker, "DELETE": admin.remove_worker},
    }
    router.routes = routes
    return RouterApp(router)


def run(app: RouterApp, host: str, port: int, on_listening: Callable[[str], None] = print) -> None:
    """Serve until SIGINT or SIGTERM, on uvloop when it is installed."""
    async def main() -> None:
        addrs = await app.start(host, port)
        on_listening(", ".join(f"http://{h}:{p}" for h, p in addrs))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
            log.info("stopping: no new connections; requests already taken may run %gs",
                     app.router.cfg.drain_timeout_s)
        finally:
            await app.stop(drain_s=app.router.cfg.drain_timeout_s if stop.is_set() else 0.0)

    try:
        import uvloop
    except ImportError:  # the router extra installs it; without it the router still runs, slower
        log.warning("uvloop not installed; using the default asyncio loop")
        asyncio.run(main())
        return
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(main())
