"""Admin API behind a token, /v1/models, routing by the model field, and no worker URL in
anything a client sees."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web

from router.config import WorkerSpec
from router.proxy import APP_KEY, build_app
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


BAD_URLS = {
    "http://127.0.0.1:99999": "(?i)port", "http://127.0.0.1:abc": "(?i)port", "http://[::1": "IPv6",
    "http://a b:80": "host name", "http://:80": "host name", "https://127.0.0.1:1": "https:// is not supported",
    "http://127.0.0.1:1/?x=1": "query", "http://u:p@127.0.0.1:1": "credentials", "localhost:1": "http://",
}


def test_unusable_worker_specs_are_refused_at_config_load():
    for bad, why in BAD_URLS.items():
        with pytest.raises(ValueError, match=why):
            WorkerSpec(bad)
    for speed in (float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(ValueError, match="speed"):
            WorkerSpec("http://127.0.0.1:1", speed=speed)
    with pytest.raises(ValueError, match="speed"):
        WorkerSpec.from_dict({"url": "http://127.0.0.1:1", "speed": 1e999})
    with pytest.raises(ValueError, match="listed twice"):
        build_app(test_config(), [WorkerSpec("http://127.0.0.1:1"), WorkerSpec("http://127.0.0.1:1/")])
    # one worker under two spellings (a probe: each got its own limit, prefix index and breaker)
    for a, b in (("http://127.0.0.1", "http://127.0.0.1:80"), ("http://127.0.0.1:9000", "http://127.0.0.1:09000"),
                 ("http://Localhost:9/x", "http://localhost:9/x/")):
        with pytest.raises(ValueError, match="listed twice"):
            build_app(test_config(), [WorkerSpec(a), WorkerSpec(b)])
    build_app(test_config(), [WorkerSpec("http://127.0.0.1:9/a"), WorkerSpec("http://127.0.0.1:9/b")])  # two paths
    with pytest.raises(ValueError, match="worker id 'a'"):
        build_app(test_config(), [WorkerSpec("http://127.0.0.1:1", id="a"), WorkerSpec("http://127.0.0.1:2", id="a")])
    with pytest.raises(ValueError, match="bucket 3 is not one of the 3 configured"):
        build_app(test_config(), [WorkerSpec("http://127.0.0.1:1", bucket=3)])
    WorkerSpec("http://[::1]:8000/engine1")  # an IPv6 address and a path prefix are fine


def test_admin_refuses_unusable_workers_with_the_reason():
    async def main():
        async with fleet([(), ()]) as (url, s, urls):
            async with s.post(url + "/admin/workers", json={"url": urls[1], "id": "second"}, headers=ADMIN) as r:
                assert r.status == 201  # the same URL again: its spec is replaced
            bad = [{"url": u} for u in BAD_URLS] + [
                {"url": "http://127.0.0.1:1", "speed": 1e999}, {"url": "http://127.0.0.1:1", "id": "second"},
                {"url": "http://127.0.0.1:1", "bucket": 3}]
            for body in bad:
                async with s.post(url + "/admin/workers", data=json.dumps(body), headers=ADMIN) as r:
                    msg = (await r.json())["error"]["message"]
                    assert r.status == 400 and msg.startswith("bad worker: "), (body, r.status, msg)
            async with s.get(url + "/admin/workers", headers=ADMIN) as r:
                assert sorted(w["url"] for w in (await r.json())["workers"]) == sorted(urls)
            for i in range(6):
                async with s.post(url + "/v1/completions", json={"prompt": f"still routed {i}"}) as r:
                    assert r.status == 200
    asyncio.run(main())


def test_a_worker_url_path_is_kept_when_proxying():
    async def main():
        fake = FakeWorker("p")
        outer = web.Application()
        outer.add_subapp("/engine1", fake.app())
        async with serve_app(outer) as wurl:
            app = build_app(test_config(), [WorkerSpec(wurl + "/engine1/")])
            async with serve_app(app) as url, aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 200 and (await r.json())["worker"] == "p"
                async with s.post(url + "/generate", json={"text": "y"}) as r:
                    assert r.status == 200
                assert fake.served == 2
    asyncio.run(main())


def test_a_worker_url_the_proxy_cannot_use_is_a_retryable_failure_not_a_500():
    async def main():
        fake = FakeWorker("w0")
        async with serve_app(fake.app()) as wurl:
            app = build_app(test_config(), [WorkerSpec(wurl)])
            async with serve_app(app) as url, aiohttp.ClientSession() as s:
                bad = WorkerSpec("http://127.0.0.1:1", speed=1e6)  # every request's first choice
                object.__setattr__(bad, "url", "http://127.0.0.1:99999")  # as an older replica may have stored it
                await app[APP_KEY].state.add_worker(bad)
                for i in range(4):
                    async with s.post(url + "/v1/completions", json={"prompt": f"q{i}"}) as r:
                        assert r.status == 200 and url_of(r, [wurl]) == wurl
    asyncio.run(main())
