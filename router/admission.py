"""Admission: route a parsed request to a worker and take a lease, or wait in the
priority queue until one frees up, or refuse with a reason.

The decision itself is ``decide.plan`` (pure); this module adds the state I/O,
the wait queues (one per length bucket and model) and encoder affinity. One asyncio task
pumps the queues at a time; the head is retried when a local lease is released,
when another replica leaves this one a slot (``RouterState.on_wake``) and every ``poll_s``.

Fairness across replicas (``--state redis``): each replica publishes the order key of each
queue's head, on wall-clock time (``queue.order_key``), and reads the others' with every
snapshot. A free slot on worker W goes to this replica's request (queued or new) only if no
other replica publishes a head that W can serve (same bucket or a bucket-less W, a model W
serves) with a key better by more than ``FAIR_TOLERANCE_S``; otherwise this replica leaves
the slot and wakes that replica. A published head expires ``head_ttl_s`` after its replica's
last call, and one that has been left slots for ``YIELD_GRACE_S`` without taking them (its
replica stalled, or its head cannot use W after all) is ignored: neither blocks anybody
longer than that.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from router.buckets import BucketMap
from router.config import RouterConfig, WorkerSpec
from router.decide import Outcome, Plan, plan
from router.encoder import EncoderRing
from router.metrics import RouterMetrics
from router.policies import Decision, Policy, Reason
from router.queue import PendingQueue, key_tolerance, order_key
from router.request import ParsedRequest
from router.state_base import Lease, RivalHead, RouterState

FAIR_TOLERANCE_S = 0.01  # a rival head must be this much older (in arrival time) to be let first
YIELD_GRACE_S = 0.5  # a rival head left slots this long without taking them stops counting


class Rejected(Exception):
    """The router refuses the request; ``status`` and message go back to the client."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


@dataclass
class _Waiter:
    req: ParsedRequest
    fut: asyncio.Future = field(repr=False)
    since: float = 0.0
    exclude: frozenset[str] = frozenset()
    l3_tokens: int = 0
    gone: asyncio.Future | None = None  # resolved when the client went away
    handle: Any = None  # its queue entry (PendingQueue.push), to remove exactly this waiter
    uncached: int = 0
    wall: float = 0.0  # time.time() at arrival: its published key compares across replicas


class Admission:
    def __init__(self, cfg: RouterConfig, state: RouterState, policy: Policy, metrics: RouterMetrics,
                 poll_s: float = 0.05, exact: Callable[[ParsedRequest], dict[str, int]] | None = None) -> None:
        """``exact(req)``: prompt tokens each worker holds by its KV events (workers that publish)."""
        self.exact = exact
        self.cfg = cfg
        self.state = state
        self.policy = policy
        self.metrics = metrics
        self.buckets = BucketMap(cfg.buckets)
        # one queue per (length bucket, model): the waiters of one queue want the same workers, so
        # a head that finds them all full holds back nobody who could be served elsewhere
        self.queues: dict[tuple[int, str | None], PendingQueue[_Waiter]] = {}
        self.poll_s = poll_s
        self._pump_lock = asyncio.Lock()
        self._poller: asyncio.Task | None = None
        self._tol = key_tolerance(cfg.queue, FAIR_TOLERANCE_S)
        self._yielded: dict[tuple[str, int, str | None, float], float] = {}  # rival head -> first left a slot
        self._waker: asyncio.Task | None = None
        self._rewake = False
        state.on_wake = self._woken

    def __repr__(self) -> str:
        return f"Admission(policy={self.policy.name}, depth={self.depth()})"

    def depth(self) -> int:
        return sum(len(q) for q in self.queues.values())

    async def admit(self, req: ParsedRequest, exclude: frozenset[str] = frozenset(),
                    l3_tokens: int = 0, gone: Callable[[], asyncio.Future] | None = None) -> tuple[Lease, Decision]:
        """A lease on a worker for ``req``, not one in ``exclude``; ``l3_tokens`` of its prefix any
        worker can load from the shared L3 tier. Raises Rejected (503) when none frees up in time,
        ConnectionResetError when the future ``gone()`` (the client left) resolves while it waits."""
        if req.media_keys and not exclude:
            got = await self._try_encoder(req)
            if got is not None:
                return got
        # straight to a worker only while nobody waits: a waiting request of any bucket may be
        # the one a free shared (bucket-less) worker owes its next slot to
        wall = self.state.wall()
        p, got = await self._try(req, exclude, l3_tokens, take=lambda p: not self.depth(),
                                 key_of=lambda p: order_key(self.cfg.queue, p.uncached_tokens, wall))
        if got is not None:
            return got
        if p.outcome is Outcome.NO_MODEL:
            self.metrics.rejected.labels("no_model").inc()
            raise Rejected(404, "model_not_found", f"no worker serves model {req.model!r}; GET /v1/models lists them")
        if p.outcome is Outcome.NO_WORKER and req.media_keys and not exclude:
            got = await self._wait_for_encoder(req, gone)  # only encoders serve it: wait for one
            if got is not None:
                return got
        if p.outcome is Outcome.NO_WORKER:
            self.metrics.rejected.labels("no_worker").inc()
            raise Rejected(503, "no_worker", f"no healthy worker can serve a prompt of ~{req.n_tokens} tokens",
                           retry_after=self.cfg.health_interval_s)
        q = self.queues.setdefault((p.bucket, req.model), PendingQueue(self.cfg.queue))
        if q.full():
            self.metrics.rejected.labels("queue_full").inc()
            raise Rejected(503, "queue_full", "router queue is full; retry later", retry_after=1.0)
        w = _Waiter(req, asyncio.get_running_loop().create_future(), time.monotonic(), exclude, l3_tokens,
                    gone() if gone is not None else None, uncached=p.uncached_tokens, wall=wall)
        handle = w.handle = q.push(w, p.uncached_tokens, w.since)
        self.metrics.queue_depth.set(self.depth())
        self._ensure_poller()
        await self.pump()
        ok = False
        try:
            waits = {w.fut} if w.gone is None else {w.fut, w.gone}
            await asyncio.wait(waits, timeout=self.cfg.queue.max_wait_s, return_when=asyncio.FIRST_COMPLETED)
            if w.fut.done():
                got = w.fut.result()  # or the Rejected the pump set
                ok = True
                return cast(tuple[Lease, Decision], got)
            if w.gone is not None and w.gone.done():
                self.metrics.rejected.labels("client_gone").inc()
                raise ConnectionResetError("the client closed the connection while its request waited")
            self.metrics.rejected.labels("queue_timeout").inc()
            raise Rejected(503, "queue_timeout",
                           f"no worker slot freed within {self.cfg.queue.max_wait_s:g}s; retry later",
                           retry_after=max(1.0, self.cfg.queue.max_wait_s / 4))
        finally:
            if q.cancel(handle):
                self.metrics.queue_depth.set(self.depth())
                self._publish()
            if not ok:
                if not w.fut.done():
                    w.fut.cancel()
                elif not w.fut.cancelled() and w.fut.exception() is None:
                    await self.release(w.fut.result()[0])  # granted just as we gave up

    async def release(self, lease: Lease) -> None:
        await self._give_back(lease)
        if self.depth():
            await self.pump()
        elif self.state.rival_heads():  # nobody here wants the slot: wake the replica owed it, if any
            spec = next((s for s in self.state.known_specs() if s.name == lease.worker), None)
            rival = self._owed(spec, float("inf")) if spec is not None else None
            if rival is not None:
                self.state.wake(rival)

    async def _give_back(self, lease: Lease) -> None:
        if lease.probe is not None:
            self.state.drop_probe(lease.worker, lease.probe)
        await self.state.release(lease)

    async def pump(self) -> None:
        """Hand free slots to waiting requests, best key first across every bucket's queue (the
        queues share one order: a worker without a bucket serves them all). A queue whose head
        finds every eligible worker full is passed over, its order kept, until the next pump."""
        async with self._pump_lock:
            blocked: set[tuple[int, str | None]] = set()
            while True:
                heads = [(key, b) for b, q in self.queues.items()
                         if b not in blocked and (key := q.head_key()) is not None]
                self._publish()
                if not heads:
                    break
                bucket = min(heads, key=lambda h: h[0])[1]  # (length bucket, model)
                q = self.queues[bucket]
                w = q.peek()
                if w is None or w.fut.done() or (w.gone is not None and w.gone.done()):
                    q.pop()
                    continue
                p, got = await self._try(w.req, w.exclude, w.l3_tokens, key_of=_const(self._key(w)))
                # the state may have been remote (Redis): meanwhile this waiter may have left (its
                # client gave up) and another may have become the head. Take out exactly this one;
                # a slot taken for a waiter no longer there goes back at once
                if w.fut.done() or not q.waiting(w.handle):
                    if got is not None:
                        await self._give_back(got[0])
                    continue
                if p.outcome is Outcome.FULL or (got is None and p.outcome is Outcome.ROUTED):
                    blocked.add(bucket)
                    continue
                q.cancel(w.handle)
                if got is None and p.outcome is Outcome.NO_MODEL:
                    w.fut.set_exception(Rejected(404, "model_not_found",
                                                 f"no worker serves model {w.req.model!r} any more"))
                elif got is None:
                    w.fut.set_exception(Rejected(503, "no_worker", "no healthy worker for this request"))
                else:
                    self.metrics.queue_wait.observe(time.monotonic() - w.since)
                    w.fut.set_result(got)
            self.metrics.queue_depth.set(self.depth())
            self._publish()

    def _key(self, w: _Waiter) -> float:
        return order_key(self.cfg.queue, w.uncached, w.wall)

    def _publish(self) -> None:
        """Tell the other replicas each queue's head key (nothing to tell in memory mode). A head
        that must avoid some workers (a retry) is not published: it might not take what it is left."""
        heads = {}
        for b, q in self.queues.items():
            w = q.peek()
            if w is not None and not w.exclude:
                heads[b] = self._key(w)
        self.state.publish_heads(heads)

    def _owed(self, spec: WorkerSpec, key: float) -> str | None:
        """The replica owed a free slot on ``spec``'s worker ahead of a request of ``key``: the
        one publishing the best head key below ``key - tolerance`` that the worker can serve."""
        rivals = self.state.rival_heads()
        if not rivals:
            if self._yielded:
                self._yielded.clear()
            return None
        now = time.monotonic()
        best: RivalHead | None = None
        for h in rivals:
            if (h.key < key - self._tol and (best is None or h.key < best.key) and spec.role == "llm"
                    and (spec.bucket is None or spec.bucket == h.bucket)
                    and (h.model is None or spec.serves(h.model))):
                if now - self._yielded.get((h.replica, h.bucket, h.model, h.key), now) > YIELD_GRACE_S:
                    continue  # left slots long enough without taking one: stale, or cannot use them
                best = h
        if len(self._yielded) > 4 * len(rivals) + 64:  # forget heads no longer published
            live = {(h.replica, h.bucket, h.model, h.key) for h in rivals}
            self._yielded = {k: t for k, t in self._yielded.items() if k in live}
        if best is None:
            return None
        self._yielded.setdefault((best.replica, best.bucket, best.model, best.key), now)
        return best.replica

    def _woken(self) -> None:
        """Another replica left this one a slot: pump now (again after a running pump)."""
        if not self.depth():
            return
        if self._waker is not None and not self._waker.done():
            self._rewake = True
            return
        self._waker = asyncio.get_running_loop().create_task(self._pump_woken())

    async def _pump_woken(self) -> None:
        while True:
            self._rewake = False
            await self.pump()
            if not self._rewake or not self.depth():
                return

    async def _try(self, req: ParsedRequest, exclude: frozenset[str], l3_tokens: int = 0,
                   take=lambda p: True, key_of: Callable[[Plan], float] | None = None,
                   ) -> tuple[Plan, tuple[Lease, Decision] | None]:
        """Plan, then acquire the chosen worker unless ``take(plan)`` says to queue instead, or
        another replica's head with a better key than ``key_of(plan)`` is owed the worker (then
        that replica is woken, and the plan comes back ROUTED without a lease)."""
        for _ in range(3):  # another replica may take the slot between snapshot and acquire
            snap, ticket = await self.state.route_view(req.hashes, self.policy.name == "round_robin")
            p = plan(self.policy, self.buckets, snap, req.n_tokens, req.n_blocks,
                     self.cfg.prefix.block_tokens, ticket, req.tie_key, exclude=exclude,
                     model=req.model, exact=self.exact(req) if self.exact is not None else None,
                     l3_tokens=l3_tokens)
            if p.outcome is not Outcome.ROUTED or not take(p):
                return p, None
            d = p.decision
            assert d is not None  # ROUTED
            ws = next(s for s in snap if s.name == d.worker)
            if key_of is not None and (rival := self._owed(ws.spec, key_of(p))) is not None:
                self.state.wake(rival)
                return p, None
            limit = ws.spec.max_inflight
            token = object()
            if not self.state.take_probe(d.worker, token):
                continue  # its circuit is half-open and the probe is in flight: the next snapshot says so
            lease = await self.state.acquire(d.worker, limit, p.work_ms, req.hashes)
            if lease is None:
                self.state.drop_probe(d.worker, token)
            else:
                lease.probe = token
                self.metrics.routed(self.policy.name, d.reason.value, req.n_tokens,
                                    req.n_tokens - p.uncached_tokens)
                return p, (lease, d)
        return p, None

    async def _try_encoder(self, req: ParsedRequest) -> tuple[Lease, Decision] | None:
        snap = await self.state.snapshot(())
        enc = {s.name: s for s in snap if s.spec.role == "encoder" and s.routable and s.spec.serves(req.model)}
        if not enc:
            return None
        owner = EncoderRing(enc).owner(req.media_keys[0])
        work = self.policy.cfg.cost.work(req.n_tokens)
        lease = await self.state.acquire(owner, enc[owner].spec.max_inflight, work, req.hashes)
        if lease is None:
            return None  # the owner is saturated: fall back to ordinary routing
        self.metrics.routed(self.policy.name, Reason.ENCODER_AFFINITY.value, req.n_tokens, 0)
        return lease, Decision(owner, Reason.ENCODER_AFFINITY, 0)

    async def _wait_for_encoder(self, req: ParsedRequest,
                                gone: Callable[[], asyncio.Future] | None) -> tuple[Lease, Decision] | None:
        """A media request no LLM worker serves, its encoder saturated: wait for the encoder (at
        most max_wait_s, as a queued request would) instead of a 503 at once that blamed a
        missing worker. None: no encoder at all, or none freed up in time."""
        deadline = time.monotonic() + self.cfg.queue.max_wait_s
        left = gone() if gone is not None else None  # the connection's (shared): never cancelled here
        while time.monotonic() < deadline:
            snap = await self.state.snapshot(())
            if not any(s.spec.role == "encoder" and s.routable and s.spec.serves(req.model) for s in snap):
                return None
            got = await self._try_encoder(req)
            if got is not None:
                return got
            if left is not None and left.done():
                self.metrics.rejected.labels("client_gone").inc()
                raise ConnectionResetError("the client left while waiting for an encoder")
            await asyncio.sleep(self.poll_s)
        self.metrics.rejected.labels("queue_timeout").inc()
        raise Rejected(503, "queue_timeout", f"the encoder for this request stayed busy for "
                                             f"{self.cfg.queue.max_wait_s:g}s; retry later", retry_after=1.0)

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while self.depth():
            await asyncio.sleep(self.poll_s)
            await self.pump()

    async def close(self) -> None:
        if self._waker is not None:
            self._waker.cancel()
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass


def _const(key: float) -> Callable[[Plan], float]:
    return lambda p: key
