"""The admin API (``/admin/workers``) behind a bearer token, and ``GET /v1/models``.

Without ``RouterConfig.admin_token`` the admin API answers 403 (it is off); with one, a
request must carry ``Authorization: Bearer <token>`` (401 otherwise). ``/v1/models`` lists
the models the workers are configured with (``WorkerSpec.models``); when no worker names its
models it passes a healthy worker's own ``/v1/models`` answer through.
"""

from __future__ import annotations

import hmac
import time
from typing import TYPE_CHECKING

import aiohttp

from router.config import WorkerSpec, check_workers, worker_id
from router.http_messages import Request, Response, json_error, json_response

if TYPE_CHECKING:
    from router.proxy import Router


class Admin:
    def __init__(self, router: Router) -> None:
        self.router = router
        token = router.cfg.admin_token
        self._token = token.encode() if token else None

    def _denied(self, request: Request) -> Response | None:
        if self._token is None:
            return json_error(403, "the admin API is off; start the router with --admin-token-file to turn it on",
                              "forbidden")
        auth = request.header("Authorization") or ""
        given = auth[7:].encode() if auth.startswith("Bearer ") else b""
        if not hmac.compare_digest(given, self._token):
            return json_error(401, "the admin API needs 'Authorization: Bearer <admin token>'", "unauthorized",
                              {"WWW-Authenticate": 'Bearer realm="gcache-router admin"'})
        return None

    async def list_workers(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        salt = self.router.id_salt
        snap = await self.router.state.snapshot(())
        return json_response({"workers": [
            {**s.spec.to_dict(), "id": worker_id(s.spec, salt), "healthy": s.healthy,
             "circuit_open": s.circuit_open, "inflight_requests": s.inflight_requests,
             "pending_prefill_ms": s.pending_ms} for s in snap
        ]})

    async def add_worker(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            spec = WorkerSpec.from_dict(request.json())  # type: ignore[arg-type]  # from_dict checks it
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
            return json_error(400, f"bad worker: {e}", "invalid_request_error")
        try:  # the same URL again replaces its spec; another worker's id is refused
            check_workers([*(w for w in self.router.state.known_specs() if w.name != spec.name), spec],
                          len(self.router.cfg.buckets.ranges))
        except ValueError as e:
            return json_error(400, f"bad worker: {e}", "invalid_request_error")
        await self.router.state.add_worker(spec)
        self.router.forget_ids()
        return json_response({"added": {**spec.to_dict(), "id": worker_id(spec, self.router.id_salt)}},
                                 status=201)

    async def remove_worker(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        url = request.query.get("url", "").rstrip("/")
        if not url:
            return json_error(400, "give the worker to remove as ?url=http://host:port", "invalid_request_error")
        if not await self.router.state.remove_worker(url):
            return json_error(404, f"no worker {url!r}", "not_found")
        self.router.forget_ids()
        return json_response({"removed": url})

    async def models(self, request: Request) -> Response:
        snap = await self.router.state.snapshot(())
        llm = [s for s in snap if s.spec.role == "llm"]
        named = sorted({m for s in llm for m in s.spec.models})
        if named:
            now = int(time.time())
            return json_response({"object": "list", "data": [
                {"id": m, "object": "model", "created": now, "owned_by": "gcache-router"} for m in named]})
        session = self.router.session
        for s in llm:
            if not s.routable or session is None:
                continue
            try:
                async with session.get(s.name + "/v1/models",
                                                   timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return Response(200, await r.read(), "application/json")
            except (aiohttp.ClientError, TimeoutError):
                continue
        return json_error(503, "no healthy worker answered /v1/models", "service_unavailable")
