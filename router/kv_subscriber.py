"""Subscribe to one worker's SGLang KV event publisher (ZMQ PUB, optional ROUTER replay)
and keep its pages in the ``ExactIndex``.

Each batch arrives as ``(topic, seq as 8 big-endian bytes, msgpack payload)``. Sequence
numbers let the subscriber notice what it missed: with a replay endpoint it asks for the
missing batches (and, at start, for everything the publisher still buffers); without one,
or if the replay fails, it forgets the worker's pages (they may include removed ones).
A sequence that starts over means the engine restarted: its pages and the approximate
index's prefixes for it are forgotten (``on_restart``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

from router.kv_index import DECODER, ExactIndex

log = logging.getLogger("gcache.router.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KvEventSubscriber:
    def __init__(self, worker: str, endpoint: str, index: ExactIndex, replay_endpoint: str = "", topic: str = "",
                 on_restart: Callable[[str], Awaitable[None]] | None = None, replay_timeout_s: float = 2.0) -> None:
        self.worker = worker
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.index = index
        self.on_restart = on_restart
        self.replay_timeout_s = replay_timeout_s
        self.last_seq: int | None = None
        self._dup_until = -1  # after a replay, live batches up to here are duplicates
        self.batches = 0
        self.gaps = 0
        self.restarts = 0

    def __repr__(self) -> str:
        return f"KvEventSubscriber({self.endpoint}, last_seq={self.last_seq}, batches={self.batches})"

    @property
    def live(self) -> bool:
        """True once the worker has published anything: its exact index is then used."""
        return self.batches > 0

    async def run(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            if self.replay_endpoint:  # what the publisher still buffers: the cache's history
                await self._replay(0 if self.last_seq is None else self.last_seq + 1)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                await self._on_batch(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is not None and seq <= last:
            if seq <= self._dup_until:
                return  # already had it from a replay
            self._dup_until = -1
            self.restarts += 1
            log.warning("worker %s: KV event sequence restarted (%d after %d); forgetting its pages",
                        self.worker, seq, last)
            self.index.clear(self.worker)
            self.last_seq = None
            self._dup_until = -1
            if self.on_restart is not None:
                await self.on_restart(self.worker)
        elif last is not None and seq > last + 1:
            self.gaps += 1
            if not (self.replay_endpoint and await self._replay(last + 1)):
                log.warning("worker %s: missed KV event batches %d-%d; forgetting its pages",
                            self.worker, last + 1, seq - 1)
                self.index.clear(self.worker)
            if self.last_seq is not None and seq <= self.last_seq:
                return  # the replay covered this one
        if seq > self._dup_until:
            self._dup_until = -1  # caught up with the replay: a smaller number now means a restart
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = DECODER.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("worker %s: undecodable KV event batch %d (%s); forgetting its pages", self.worker, seq, e)
            self.index.clear(self.worker)
        else:
            self.index.apply(self.worker, batch)
        self.last_seq = seq
        self.batches += 1

    async def _replay(self, start: int) -> bool:
        """Ask the publisher for every buffered batch from ``start``; True if the answer ended."""
        ctx = zmq.asyncio.Context.instance()
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        applied = False
        try:
            await req.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    frames = await req.recv_multipart()
                    if len(frames) != 4:
                        continue
                    _, _, seq_b, payload = frames
                    if seq_b == END_SEQ:
                        break
                    seq = int.from_bytes(seq_b, "big")
                    if self.last_seq is None or seq > self.last_seq:
                        self._apply(seq, payload)
                        applied = True
            if applied and self.last_seq is not None:  # live batches up to here may still be queued
                self._dup_until = self.last_seq
            return True
        except TimeoutError:
            log.warning("worker %s: no KV event replay from %s within %gs", self.worker, self.replay_endpoint,
                        self.replay_timeout_s)
            return False
        finally:
            with contextlib.suppress(zmq.ZMQError):
                req.close(linger=0)
