"""The HTTP proxy in memory mode against fake workers on real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json

import aiohttp

from router.config import BucketConfig, QueueConfig, WorkerSpec
from router.proxy import APP_KEY, build_app
from tests.router.conftest import ADMIN, poll, serve_app, test_config, url_of, wid
from tests.router.fakeworker import FakeWorker

SYSTEM = "You are a helpful assistant. " * 10  # ~290 chars: 4 blocks of 64 chars


@contextlib.asynccontextmanager
async def fleet(n=3, cfg=None, specs=None):
    fakes = [FakeWorker(f"w{i}") for i in range(n)]
    async with contextlib.AsyncExitStack() as st:
        urls = [await st.enter_async_context(serve_app(f.app())) for f in fakes]
        app = build_app(cfg or test_config(), [WorkerSpec(u, **(specs or {})) for u in urls])
        rurl = await st.enter_async_context(serve_app(app))
        session = await st.enter_async_context(aiohttp.ClientSession())
        yield rurl, session, dict(zip(urls, fakes, strict=True)), app[APP_KEY]


async def inflight_total(router):
    return sum(s.inflight_requests + s.pending_ms for s in await router.state.snapshot(()))


async def counters_zero(router):
    return await inflight_total(router) == 0


def test_forwarding_is_byte_exact_and_cache_affine():
    async def main():
        async with fleet() as (url, s, fakes, _router):
            raw = b'{"prompt":  "' + (SYSTEM + "conversation one " * 20).encode() + b'", "max_tokens": 3}'
            async with s.post(url + "/v1/completions", data=raw,
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200
                first = await r.json()
                w1 = url_of(r, fakes)
            assert first["sha256"] == hashlib.sha256(raw).hexdigest()
            assert fakes[w1].bodies[-1] == raw
            for _ in range(3):  # the same conversation keeps going to the worker that has it
                async with s.post(url + "/v1/completions", data=raw) as r:
                    body = await r.json()
                    assert url_of(r, fakes) == w1
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            # a different conversation sharing only the system prompt is balanced elsewhere
            async with s.post(url + "/v1/chat/completions", json={"messages": [
                    {"role": "user", "content": "an unrelated question " * 30}]}) as r:
                assert r.status == 200
    asyncio.run(main())


def test_streaming_passes_through_chunk_by_chunk():
    async def main():
        async with fleet(n=1) as (url, s, fakes, router):
            fake = next(iter(fakes.values()))
            async with s.post(url + "/generate", json={"text": "hi", "stream": True, "chunks": 3, "gate": True}) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                got = await r.content.readuntil(b"\n\n")  # arrives while the worker still holds the rest
                assert json.loads(got[len(b"data: "):]) == {"i": 0, "worker": "w0"}
                snap = await router.state.snapshot(())
                assert snap[0].inflight_requests == 1 and snap[0].pending_ms == 0  # prefill done
                fake.gate.set()
                got = await r.content.readuntil(b"\n\n")
                assert b'"i": 1' in got
                fake.gate.set()
                rest = await r.read()
                assert rest.endswith(b"data: [DONE]\n\n")
            await poll(lambda: counters_zero(router), what="in-flight counters back to zero")
    asyncio.run(main())


def test_bad_requests_get_clear_4xx_and_the_router_survives():
    async def main():
        cfg = test_config(max_body_bytes=2048)
        async with fleet(n=1, cfg=cfg) as (url, s, _fakes, _router):
            cases = [
                ("POST", "/v1/completions", b"{not json", 400, "not valid JSON"),
                ("POST", "/v1/completions", b'{"prompt": 42}', 400, "'prompt' must be"),
                ("POST", "/v1/chat/completions", b'{"messages": "hi"}', 400, "'messages' must be"),
                ("POST", "/v1/completions", b'{"prompt": "' + b"x" * 4096 + b'"}', 413, "exceeds the limit"),
                ("POST", "/v1/embeddings", b"{}", 404, "unknown route"),
                ("GET", "/v1/completions", b"", 405, "not allowed"),
                ("DELETE", "/admin/workers", b"", 400, "?url="),
            ]
            for method, path, data, status, msg in cases:
                async with s.request(method, url + path, data=data, headers=ADMIN) as r:
                    body = await r.json()
                    assert r.status == status, (path, r.status, body)
                    assert msg in body["error"]["message"], body
            async with s.post(url + "/v1/completions", json={"prompt": "still alive"}) as r:
                assert r.status == 200
    asyncio.run(main())


def test_upstream_error_is_passed_back_and_counters_return_to_zero():
    async def main():
        async with fleet(n=2) as (url, s, _fakes, router):
            async with s.post(url + "/v1/completions", json={"prompt": "boom " * 50, "fail": 503}) as r:
                assert r.status == 503
                assert (await r.json())["error"]["message"] == "upstream exploded"
            await poll(lambda: counters_zero(router), what="in-flight counters back to zero")
            metrics = await (await s.get(url + "/metrics")).text()
            assert 'gcache_router_requests_total{route="/v1/completions",status="503"} 1.0' in metrics
    asyncio.run(main())


def test_unreachable_worker_gives_502_then_health_check_removes_and_restores_it():
    async def main():
        fake = FakeWorker("w0")
        cfg = test_config()
        async with serve_app(fake.app()) as good, aiohttp.ClientSession() as s:
            dead = "http://127.0.0.1:9"  # discard port: nothing listens
            app = build_app(cfg, [WorkerSpec(good), WorkerSpec(dead)])
            async with serve_app(app) as url:
                router = app[APP_KEY]

                async def healthy(name):
                    return {w.name: w.healthy for w in await router.state.snapshot(())}[name]

                await poll(lambda: _not(healthy(dead)), what="dead worker marked down")
                for _ in range(4):
                    async with s.post(url + "/v1/completions", json={"prompt": "p"}) as r:
                        assert r.status == 200 and r.headers["X-Gcache-Worker"] == wid(good)
                fake.healthy = False
                await poll(lambda: _not(healthy(good)), what="failing worker marked down")
                async with s.post(url + "/v1/completions", json={"prompt": "p"}) as r:
                    assert r.status == 503 and "no healthy worker" in (await r.json())["error"]["message"]
                fake.healthy = True
                await poll(lambda: healthy(good), what="recovered worker back")
                async with s.post(url + "/v1/completions", json={"prompt": "p"}) as r:
                    assert r.status == 200
    asyncio.run(main())


async def _not(coro):
    return not await coro


def test_admin_api_add_list_remove():
    async def main():
        async with fleet(n=1) as (url, s, fakes, _router):
            extra = FakeWorker("extra")
            async with serve_app(extra.app()) as eurl:
                async with s.post(url + "/admin/workers", json={"url": eurl, "max_inflight": 7}, headers=ADMIN) as r:
                    assert r.status == 201
                async with s.post(url + "/admin/workers", json={"url": "ftp://x"}, headers=ADMIN) as r:
                    assert r.status == 400 and "http://" in (await r.json())["error"]["message"]
                listed = (await (await s.get(url + "/admin/workers", headers=ADMIN)).json())["workers"]
                assert {w["url"] for w in listed} == {*fakes, eurl}
                assert [w["max_inflight"] for w in listed if w["url"] == eurl] == [7]
                async with s.delete(url + "/admin/workers", params={"url": eurl}, headers=ADMIN) as r:
                    assert r.status == 200
                async with s.delete(url + "/admin/workers", params={"url": eurl}, headers=ADMIN) as r:
                    assert r.status == 404
                listed = (await (await s.get(url + "/admin/workers", headers=ADMIN)).json())["workers"]
                assert {w["url"] for w in listed} == set(fakes)
    asyncio.run(main())


def test_full_workers_queue_then_503_with_retry_after():
    async def main():
        cfg = test_config(queue=QueueConfig(max_wait_s=0.3))
        async with fleet(n=1, cfg=cfg, specs={"max_inflight": 1}) as (url, s, fakes, router):
            fake = next(iter(fakes.values()))
            held = asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "a", "hold": True}))
            await poll(lambda: fake.active == 1, what="first request held")
            async with s.post(url + "/v1/completions", json={"prompt": "b"}) as r:
                assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
                assert "no worker slot freed" in (await r.json())["error"]["message"]
            waiting = asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "c"}))
            await poll(lambda: router.admission.depth() == 1, what="request queued")
            fake.gate.set()
            r1, r2 = await held, await waiting
            assert r1.status == 200 and r2.status == 200
            r1.release()
            r2.release()
            metrics = await (await s.get(url + "/metrics")).text()
            assert 'gcache_router_rejected_total{reason="queue_timeout"} 1.0' in metrics
            assert "gcache_router_queue_wait_seconds_count 1.0" in metrics
            await poll(lambda: counters_zero(router), what="in-flight counters back to zero")
    asyncio.run(main())


def test_a_waiting_request_of_another_length_bucket_is_not_overtaken():
    """Queues are per length bucket, but a worker without a bucket serves them all: a freed slot
    goes to the waiting request with the best aged key across every queue, not to the queue
    made first (there a stream of short prompts kept a long one out until it timed out)."""
    async def main():
        cfg = test_config(queue=QueueConfig(max_wait_s=5.0, aging_tokens_per_s=1e6),
                          buckets=BucketConfig(((0, 100), (100, 1 << 30))))
        async with fleet(n=1, cfg=cfg, specs={"max_inflight": 1}) as (url, s, fakes, router):
            fake = next(iter(fakes.values()))
            sent = []

            async def send(prompt, depth):
                sent.append(asyncio.ensure_future(s.post(url + "/v1/completions",
                                                         json={"prompt": prompt, "hold": True})))
                await poll(lambda: (fake.active, router.admission.depth()) == (1, depth), what=f"{prompt[:8]} waits")

            sent.append(asyncio.ensure_future(s.post(url + "/v1/completions", json={"prompt": "held", "hold": True})))
            await poll(lambda: fake.active == 1, what="the slot taken")
            await send("short one", 1)  # bucket 0
            await send("long " + "x" * 800, 2)  # ~200 tokens: bucket 1, after short one
            await send("short two", 3)  # bucket 0, after the long one
            fake.gate.set()
            for r in await asyncio.gather(*sent):
                assert r.status == 200
                r.release()
            order = [json.loads(b)["prompt"][:9] for b in fake.bodies]
            assert order == ["held", "short one", "long xxxx", "short two"]
    asyncio.run(main())


def test_a_request_whose_worker_is_free_is_not_held_behind_another_models_waiter():
    """Model A's only worker is full and an A request waits; a B request, whose worker is idle,
    in the same length bucket, is served at once (a probe: 503 after the whole max_wait)."""
    async def main():
        cfg = test_config(queue=QueueConfig(max_wait_s=3.0))
        fa, fb = FakeWorker("wa"), FakeWorker("wb")
        async with contextlib.AsyncExitStack() as st:
            ua = await st.enter_async_context(serve_app(fa.app()))
            ub = await st.enter_async_context(serve_app(fb.app()))
            app = build_app(cfg, [WorkerSpec(ua, max_inflight=1, models=("A",)),
                                  WorkerSpec(ub, max_inflight=4, models=("B",))])
            url = await st.enter_async_context(serve_app(app))
            s = await st.enter_async_context(aiohttp.ClientSession())
            router = app[APP_KEY]
            held = asyncio.ensure_future(s.post(url + "/v1/completions", json={"model": "A", "prompt": "x", "hold": True}))
            await poll(lambda: fa.active == 1, what="A's slot taken")
            waiting = asyncio.ensure_future(s.post(url + "/v1/completions", json={"model": "A", "prompt": "y"}))
            await poll(lambda: router.admission.depth() == 1, what="an A request waits")
            async with s.post(url + "/v1/completions", json={"model": "B", "prompt": "z"}) as r:
                assert r.status == 200 and fb.served == 1
            assert not waiting.done()
            fa.gate.set()
            for r in await asyncio.gather(held, waiting):
                assert r.status == 200
                r.release()
    asyncio.run(main())


def test_media_requests_stick_to_one_encoder():
    async def main():
        fakes = [FakeWorker(f"e{i}") for i in range(3)]
        async with contextlib.AsyncExitStack() as st:
            urls = [await st.enter_async_context(serve_app(f.app())) for f in fakes]
            llm = FakeWorker("llm")
            lurl = await st.enter_async_context(serve_app(llm.app()))
            specs = [WorkerSpec(u, role="encoder") for u in urls] + [WorkerSpec(lurl)]
            url = await st.enter_async_context(serve_app(build_app(test_config(), specs)))
            s = await st.enter_async_context(aiohttp.ClientSession())
            chosen = {}
            for img in ("AAAA", "BBBB", "CCCC", "DDDD"):
                for q in ("what is this?", "describe it"):
                    body = {"messages": [{"role": "user", "content": [
                        {"type": "text", "text": q}, {"type": "image_url", "image_url": {"url": img}}]}]}
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200
                        chosen.setdefault(img, set()).add(url_of(r, urls))
            assert all(len(v) == 1 and next(iter(v)) in urls for v in chosen.values())
            async with s.post(url + "/v1/completions", json={"prompt": "text only"}) as r:
                assert r.headers["X-Gcache-Worker"] == wid(lurl)
    asyncio.run(main())


def test_a_batch_is_routed_by_its_longest_prompt_in_every_sglang_form():
    async def main():
        short, long = FakeWorker("short"), FakeWorker("long")
        cfg = test_config(buckets=BucketConfig(((0, 100), (100, 1 << 30))))
        async with serve_app(short.app()) as surl, serve_app(long.app()) as lurl:
            app = build_app(cfg, [WorkerSpec(surl, bucket=0), WorkerSpec(lurl, bucket=1)])
            async with serve_app(app) as url, aiohttp.ClientSession() as s:
                big = "x" * 4000  # ~1000 tokens: bucket 1
                for path, body in [("/v1/completions", {"prompt": ["hi", big]}),
                                   ("/v1/completions", {"prompt": [[1, 2], list(range(500))]}),
                                   ("/generate", {"text": ["hi", big]}),
                                   ("/generate", {"input_ids": [[1, 2], list(range(500))]})]:
                    async with s.post(url + path, json=body) as r:
                        assert r.status == 200, (path, await r.text())
                        assert url_of(r, [surl, lurl]) == lurl, (path, body.keys())
                for path, body in [("/v1/completions", {"prompt": ["hi", "there"]}),
                                   ("/generate", {"input_ids": [[1, 2], [3]]})]:
                    async with s.post(url + path, json=body) as r:
                        assert r.status == 200 and url_of(r, [surl, lurl]) == surl
                async with s.post(url + "/generate", json={"text": ["hi", 3]}) as r:
                    assert r.status == 400
    asyncio.run(main())


def test_prompts_shorter_than_a_block_spread_over_idle_workers():
    """A prompt with no full block has no prefix hash, and its tie-break key was 0 for all of
    them: every short prompt (most chat first turns) went to the same idle worker, on every
    replica. Now a hash of the whole short prompt breaks the tie (the same one still lands on
    the same worker)."""
    async def main():
        async with fleet(n=4) as (rurl, s, _fakes, _router):
            seen = []
            for i in range(40):  # one at a time: every worker idle at each decision
                async with s.post(rurl + "/v1/completions", json={"prompt": f"hi {i}"}) as r:
                    assert r.status == 200
                    seen.append(r.headers["X-Gcache-Worker"])
            counts = sorted(seen.count(w) for w in set(seen))
            assert len(counts) == 4 and counts[0] >= 3, counts
            again = []
            for _ in range(3):
                async with s.post(rurl + "/v1/completions", json={"prompt": "hi 7"}) as r:
                    again.append(r.headers["X-Gcache-Worker"])
            assert again == [seen[7]] * 3
    asyncio.run(main())


def test_a_media_request_waits_for_its_busy_encoder_when_no_llm_worker_serves_it():
    """Only encoder workers, the one an image belongs to busy: the request got an instant 503
    saying no healthy worker could serve it (a probe); now it waits for the encoder as a queued
    request would."""
    async def main():
        enc = FakeWorker("e0")
        async with serve_app(enc.app()) as eurl:
            app = build_app(test_config(), [WorkerSpec(eurl, role="encoder", max_inflight=1)])
            async with serve_app(app) as url, aiohttp.ClientSession() as s:
                def body(hold):
                    return {"messages": [{"role": "user", "content": [
                        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "AAAA"}}]}],
                        "hold": hold}

                async def ask(hold):
                    async with s.post(url + "/v1/chat/completions", json=body(hold)) as r:
                        return r.status

                first = asyncio.ensure_future(ask(True))
                await poll(lambda: enc.active == 1, what="the encoder busy")
                second = asyncio.ensure_future(ask(False))
                await asyncio.sleep(0.3)
                assert not second.done(), "answered while the encoder was busy (before: an instant 503)"
                enc.gate.set()
                assert [await first, await second] == [200, 200]
    asyncio.run(main())
