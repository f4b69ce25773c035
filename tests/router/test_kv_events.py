"""Engine KV events from the real sglang ZmqEventPublisher: the subscriber's exact index
(history by replay, live batches, removal, engine restart) and routing through the proxy
with a locally built tokenizer, falling back to the approximate index for a worker that
publishes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from router.config import PrefixConfig, WorkerSpec
from router.kv_index import ExactIndex
from router.kv_subscriber import KvEventSubscriber
from router.prefix import chain_token_hashes
from router.proxy import APP_KEY, build_app
from router.request import parse_request
from router.tokenize import Tokenization
from tests.router.conftest import free_port, poll, serve_app, test_config, url_of
from tests.router.fakeworker import FakeWorker
from tests.router.test_kv_index import tokenizer_dir  # noqa: F401 - a fixture

kv = pytest.importorskip("sglang.srt.disaggregation.kv_events", reason="sglang is not installed")

P = 4


@contextlib.contextmanager
def publisher():
    """A real ZmqEventPublisher bound on loopback, with a replay endpoint."""
    port, replay = free_port(), free_port()
    pub = kv.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://127.0.0.1:{port}",
                               replay_endpoint=f"tcp://127.0.0.1:{replay}", bind=True)
    try:
        yield pub, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
    finally:
        pub.shutdown()


@contextlib.contextmanager
def publisher_on(endpoint, replay):
    import zmq

    deadline = time.monotonic() + 10
    while True:  # the old publisher's sockets close asynchronously: retry the bind with a deadline
        try:
            pub = kv.ZmqEventPublisher(attn_dp_rank=0, endpoint=endpoint, replay_endpoint=replay, bind=True)
            break
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    try:
        yield pub
    finally:
        pub.shutdown()


class Engine:
    """Publishes what an SGLang radix cache would for the prompts it 'prefills': one BlockStored
    chain per prompt from the root, with engine hashes of its own."""

    def __init__(self, pub) -> None:
        self.pub = pub
        self.next_hash = 10_000
        self.hashes: dict[tuple, list[int]] = {}

    def store(self, ids: list[int]) -> None:
        n = len(ids) // P
        hs = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        self.hashes[tuple(ids)] = hs
        self.pub.publish(kv.KVEventBatch(ts=time.time(), events=[
            kv.BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=list(ids[: n * P]), block_size=P,
                           lora_id=None, medium="GPU")]))

    def remove(self, ids: list[int], last: int) -> None:
        self.pub.publish(kv.KVEventBatch(ts=time.time(), events=[
            kv.BlockRemoved(block_hashes=self.hashes[tuple(ids)][-last:], medium="GPU")]))

    def clear(self) -> None:
        self.pub.publish(kv.KVEventBatch(ts=time.time(), events=[kv.AllBlocksCleared()]))


def test_subscriber_replays_history_follows_live_batches_and_sees_a_restart():
    async def main():
        ids = list(range(1, 33))  # 8 pages
        h = chain_token_hashes(ids, P)
        idx = ExactIndex(P)
        restarted: list[str] = []

        async def on_restart(w):
            restarted.append(w)

        with publisher() as (pub, ep, rep):
            eng = Engine(pub)
            eng.store(ids[:16])  # published before the router subscribed: only a replay brings it
            sub = KvEventSubscriber("w", ep, idx, rep, on_restart=on_restart)
            task = asyncio.get_running_loop().create_task(sub.run())
            try:
                await poll(lambda: idx.match("w", h) == 4, what="history replayed")
                assert sub.live
                kv_batch = kv.KVEventBatch(ts=time.time(), events=[kv.BlockStored(
                    block_hashes=[20_000, 20_001], parent_block_hash=eng.hashes[tuple(ids[:16])][-1],
                    token_ids=ids[16:24], block_size=P, lora_id=None, medium="GPU")])

                async def live_applied():  # PUB/SUB drops what is sent before the subscription lands
                    pub.publish(kv_batch)
                    await asyncio.sleep(0.05)
                    return idx.match("w", h) == 6
                await poll(live_applied, what="live batch applied")
                eng.remove(ids[:16], last=1)  # evicting page 4 breaks the prefix there
                await poll(lambda: idx.match("w", h) == 3, what="removal applied")
            finally:
                task.cancel()
        # the engine restarts: a new publisher on the same endpoints numbers its batches from 0 again
        with publisher_on(ep, rep) as pub2:
            task = asyncio.get_running_loop().create_task(sub.run())
            try:
                async def seen_restart():
                    Engine(pub2).store(ids[:4])
                    await asyncio.sleep(0.05)
                    return restarted
                await poll(seen_restart, what="restart noticed")
                assert restarted == ["w"] and idx.match("w", h) <= 1  # the old pages are gone
            finally:
                task.cancel()
    asyncio.run(main())


def test_routing_uses_the_exact_index_and_falls_back_to_the_approximate_one(tokenizer_dir):  # noqa: F811
    async def main():
        tok = Tokenization.load(str(tokenizer_dir))
        prompts = [f"hello there how is the weather today in {city} tell me more about caches and routers please"
                   for city in ("paris", "the", "a", "me", "you", "there")]
        with publisher() as (pub, ep, rep):
            eng = Engine(pub)
            pub_fake, quiet_fake = FakeWorker("pub"), FakeWorker("quiet")
            async with serve_app(pub_fake.app()) as purl, serve_app(quiet_fake.app()) as qurl:
                cfg = test_config(prefix=PrefixConfig(block_tokens=8, page_tokens=P,
                                                      tokenizer_path=str(tokenizer_dir)))
                specs = [WorkerSpec(purl, kv_events=ep, kv_replay=rep), WorkerSpec(qurl)]
                app = build_app(cfg, specs)
                async with serve_app(app) as url, aiohttp.ClientSession() as s:
                    router = app[APP_KEY]
                    for p in prompts[:4]:  # the publishing worker's engine holds these prompts
                        eng.store(tok.encode_prompt(p))
                    held = [parse_request("/v1/completions", {"prompt": p}, cfg.prefix, tok) for p in prompts[:4]]
                    await poll(lambda: all(router.kv.match(h) == {purl: 16} for h in held), what="events indexed")
                    for p in prompts[:4]:
                        async with s.post(url + "/v1/completions", json={"prompt": p}) as r:
                            assert r.status == 200 and url_of(r, [purl, qurl]) == purl, p
                    parsed = parse_request("/v1/completions", {"prompt": prompts[0]}, cfg.prefix, tok)
                    assert router.kv.match(parsed) == {purl: 16}  # exact: 4 pages of 4 tokens
                    eng.clear()  # the engine dropped everything: the router stops crediting it
                    await poll(lambda: router.kv.match(parsed) == {purl: 0}, what="cleared")
                    # the quiet worker publishes nothing: the approximate index follows what it was sent
                    for _ in range(3):
                        async with s.post(url + "/v1/completions", json={"prompt": prompts[5]}) as r:
                            first = url_of(r, [purl, qurl])
                    snap = {w.name: w.matched_blocks for w in await router.state.snapshot(parsed_hashes(
                        prompts[5], cfg, tok))}
                    assert snap[first] >= 1
    asyncio.run(main())


def parsed_hashes(prompt, cfg, tok):
    return parse_request("/v1/completions", {"prompt": prompt}, cfg.prefix, tok).hashes
