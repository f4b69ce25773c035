"""Admin API behind a token, /v1/models, routing by the model field, and no worker URL in
anything a client sees."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from router.config import WorkerSpec
from router.proxy import build_app
from tests.router.conftest import ADMIN, serve_app, test_config, url_of, wid
from tests.router.fakeworker import FakeWorker


@contextlib.asynccontextmanager
async def fleet(models, **cfg):
    fakes = [FakeWorker(f"w{i}") for i in range(len(models))]
    async with contextlib.AsyncExitStack() as st:
        urls = [await st.enter_async_context(serve_app(f.app())) for f in fakes]
        specs = [WorkerSpec(u, models=tuple(m)) for u, m in zip(urls, models, strict=True)]
        rurl = await st.enter_async_context(serve_app(build_app(test_config(**cfg), specs)))
        s = await st.enter_async_context(aiohttp.ClientSession())
        yield rurl, s, urls


def test_admin_api_needs_the_token_and_is_off_without_one():
    async def main():
        async with fleet([()]) as (url, s, urls):
            for method, kw in [("GET", {}), ("POST", {"json": {"url": "http://127.0.0.1:1"}}),
                               ("DELETE", {"params": {"url": urls[0]}})]:
                for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": "x"}):
                    async with s.request(method, url + "/admin/workers", headers=headers, **kw) as r:
                        assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
                        assert "Bearer" in (await r.json())["error"]["message"]
            async with s.get(url + "/admin/workers", headers=ADMIN) as r:
                listed = (await r.json())["workers"]
                assert r.status == 200 and [w["url"] for w in listed] == urls and listed[0]["id"] == wid(urls[0])
        async with fleet([()], admin_token=None) as (url, s, urls), \
                s.get(url + "/admin/workers", headers=ADMIN) as r:
            assert r.status == 403 and "--admin-token-file" in (await r.json())["error"]["message"]
    asyncio.run(main())


def test_requests_are_routed_to_the_workers_of_their_model():
    async def main():
        async with fleet([("llama",), ("llama",), ("qwen",), ()]) as (url, s, urls):
            seen: dict[str, set] = {"llama": set(), "qwen": set(), None: set()}
            for i in range(24):
                for model in list(seen):
                    body = {"prompt": f"question {i} " * 10, **({"model": model} if model else {})}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200
                        seen[model].add(url_of(r, urls))
            assert seen["llama"] <= {urls[0], urls[1], urls[3]} and {urls[0], urls[1]} <= seen["llama"]
            assert seen["qwen"] <= {urls[2], urls[3]} and urls[2] in seen["qwen"]
            assert len(seen[None]) >= 3  # no model: any worker
            async with s.post(url + "/v1/chat/completions", json={"model": "mistral", "messages": [
                    {"role": "user", "content": "hi"}]}) as r:
                assert r.status == 200 and url_of(r, urls) == urls[3]  # only the any-model worker
            async with s.get(url + "/v1/models") as r:
                assert r.status == 200
                assert [m["id"] for m in (await r.json())["data"]] == ["llama", "qwen"]
        async with fleet([("llama",), ("qwen",)]) as (url, s, urls):
            async with s.post(url + "/v1/completions", json={"model": "mistral", "prompt": "hi"}) as r:
                body = await r.json()
                assert r.status == 404 and body["error"]["type"] == "model_not_found"
                assert "mistral" in body["error"]["message"]
            async with s.post(url + "/v1/completions", json={"model": 7, "prompt": "hi"}) as r:
                assert r.status == 400 and "'model' must be a string" in (await r.json())["error"]["message"]
    asyncio.run(main())


def test_v1_models_passes_a_workers_own_list_through_when_none_is_configured():
    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl, serve_app(build_app(test_config(), [WorkerSpec(wurl)])) as url, \
                aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake-model"
    asyncio.run(main())


def test_clients_never_see_a_worker_url():
    async def main():
        async with fleet([()], worker_header=False) as (url, s, urls), \
                s.post(url + "/v1/completions", json={"prompt": "hi"}) as r:
            assert r.status == 200 and "X-Gcache-Worker" not in r.headers  # off by default
        dead = "http://127.0.0.1:9"
        app = build_app(test_config(health_interval_s=60, retries=0), [WorkerSpec(dead)])
        async with serve_app(app) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": "hi"}) as r:
                text = await r.text()
                assert r.status == 502 and "127.0.0.1" not in text and ":9" not in text
            metrics = await (await s.get(url + "/metrics")).text()
            assert "127.0.0.1" not in metrics and wid(dead) in metrics
        async with fleet([()]) as (url, s, urls), s.post(url + "/v1/completions", json={"prompt": "hi"}) as r:
            assert r.headers["X-Gcache-Worker"] == wid(urls[0]) and urls[0] not in r.headers.values()
    asyncio.run(main())
