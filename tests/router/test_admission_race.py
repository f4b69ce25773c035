"""The queue pump against a state whose calls suspend (Redis): what changes in the queue while
it waits must not cost a slot or a waiter. Found by a probe with replicas on a real Redis: a
client that gave up while the pump asked Redis left its granted lease held for ever (the worker
stayed at its limit: every later request 503 after max-wait), and a newcomer that became the
head meanwhile was popped in place of the served waiter and never answered."""

from __future__ import annotations

import asyncio

from router.admission import Admission, Rejected
from router.config import QueueConfig, WorkerSpec
from router.metrics import RouterMetrics
from router.policies import make_policy
from router.request import parse_request
from router.state_memory import MemoryState
from tests.router.conftest import test_config

W = "http://127.0.0.1:9"


class SuspendingState(MemoryState):
    """MemoryState whose next route_view after ``hold()`` yields to the event loop until
    ``gate`` is set, as a round trip to Redis does; the calls after it go straight through."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate = asyncio.Event()
        self.held = 0
        self.waiting = 0

    def hold(self) -> None:
        self.gate.clear()
        self.held = 1

    async def route_view(self, hashes, want_ticket):
        if self.held:
            self.held -= 1
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        return await super().route_view(hashes, want_ticket)


def _setup(max_inflight=1):
    cfg = test_config(queue=QueueConfig(max_wait_s=2.0))
    state = SuspendingState(cfg.prefix)
    state.add_worker_sync(WorkerSpec(W, max_inflight=max_inflight))
    return cfg, state, Admission(cfg, state, make_policy("min_ttft"), RouterMetrics(), poll_s=10.0)


def _req(cfg, text):
    return parse_request("/v1/completions", {"prompt": text}, cfg.prefix)


async def _until(cond, what, timeout=2.0):
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.001)


def test_a_waiter_that_leaves_while_the_pump_asks_the_state_gives_its_slot_back():
    async def main():
        cfg, state, adm = _setup()
        held, _ = await adm.admit(_req(cfg, "first"))  # the worker is at its limit
        gone = asyncio.get_running_loop().create_future()
        waiter = asyncio.ensure_future(adm.admit(_req(cfg, "second"), gone=lambda: gone))
        await _until(lambda: adm.depth() == 1, "second queued")
        state.hold()
        releasing = asyncio.ensure_future(adm.release(held))  # frees the slot, then pumps
        await _until(lambda: state.waiting == 1, "the pump asks the state")
        gone.set_result(None)  # the client leaves while the pump waits
        try:
            await waiter
        except ConnectionResetError:
            pass
        state.gate.set()
        await releasing
        assert adm.depth() == 0
        snap = {w.name: w.inflight_requests for w in await state.snapshot(())}
        assert snap == {W: 0}, f"a slot granted to a waiter that left was never given back: {snap}"
        third, _ = await asyncio.wait_for(adm.admit(_req(cfg, "third")), 1.0)  # served, not queued
        await adm.release(third)
        await adm.close()
    asyncio.run(main())


def test_a_newcomer_that_becomes_the_head_meanwhile_is_not_dropped_unanswered():
    async def main():
        cfg, state, adm = _setup()
        held, _ = await adm.admit(_req(cfg, "first"))
        long = asyncio.ensure_future(adm.admit(_req(cfg, "a long prompt " * 200)))
        await _until(lambda: adm.depth() == 1, "the long prompt queued")
        state.hold()
        releasing = asyncio.ensure_future(adm.release(held))
        await _until(lambda: state.waiting == 1, "the pump asks the state")
        short = asyncio.ensure_future(adm.admit(_req(cfg, "short")))  # a better key: the new head
        await _until(lambda: adm.depth() == 2, "the short prompt queued behind the pump")
        state.gate.set()
        await releasing
        lease, _ = await asyncio.wait_for(long, 1.0)  # the waiter the pump asked for got the slot
        assert not short.done() and adm.depth() == 1, "the newcomer must still be waiting"
        await adm.release(lease)
        lease2, _ = await asyncio.wait_for(short, 1.0)  # and is served once a slot frees
        await adm.release(lease2)
        try:
            await asyncio.wait_for(adm.admit(_req(cfg, "x")), 1.0)
        except Rejected as exc:  # pragma: no cover - would mean a leaked slot
            raise AssertionError(f"slot leaked: {exc}") from exc
        await adm.close()
    asyncio.run(main())
