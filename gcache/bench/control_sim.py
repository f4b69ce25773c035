"""Simulated fleet for ``gcache bench control-plane``: daemons and clients multiplexed on
event loops in a few processes, speaking the real control protocol to real masters.

* A simulated daemon registers, heartbeats every master each second (like gcache.server.agent
  through MasterClient: a UDP datagram to all masters, the RPC to those silent after 0.25 s,
  0.5 s deadline), registers again when a master no longer knows its incarnation, and reports
  HandoverDone when a heartbeat says it has a handover pending.
* A simulated client is one WatchMembership stream on a connection of its own, attached to a
  random master and re-attached to the next one after a jittered backoff when the stream
  breaks (like gcache.client.routing.MembershipWatcher: after a stream that worked, within
  uniform(0, 1 s); with --standby, over a connection it opened a few seconds after attaching). It
  reads only the epoch of each message (a real client also applies deltas
  and builds a ring, which costs the client, not the master).

Each process runs one asyncio loop and answers the driver's commands over a pipe.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import random
import time
from typing import Any

import grpc
import msgpack

from gcache.client.routing import REATTACH_SPREAD_S, STANDBY_AFTER_S
from gcache.meta import rpc
from gcache.meta.beat import BeatClient, beat_key, seal, unseal
from gcache.meta.master_client import Backoff

HEARTBEAT_S = 1.0
CAPACITY = (64 + 1024) << 30  # 64 GiB RAM + 1 TiB NVMe: the capacity that made rings huge


def epoch_of(raw: bytes) -> int:
    """The epoch of an encoded membership without decoding its node list (it is the first key)."""
    # a buffer of the message's size: by default an Unpacker allocates 1 MiB, per message
    u = msgpack.Unpacker(raw=False, max_buffer_size=max(len(raw), 16))
    u.feed(raw)
    u.read_map_header()
    if u.unpack() != "epoch":
        return int(rpc.unpack(raw)["epoch"])
    return int(u.unpack())


# What one connection may hold of messages its stream has not read yet. By default grpc's
# bandwidth probe widens a busy connection's receive window to megabytes: when epochs moved in
# bursts (whole memberships, 45 KB each, to every watcher) faster than this process's one loop
# read its thousands of streams, the unread bytes piled up in grpc, 0.3 -> 2-4 GB per process.
SIM_CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0),
                       ("grpc.http2.lookahead_bytes", 16384)]


def _channel(address: str, options: list[tuple[str, Any]] = rpc.CLIENT_CHANNEL_OPTIONS) -> grpc.aio.Channel:
    # a connection of its own, as a separate client (or daemon) process would have
    return grpc.aio.insecure_channel(address, options=[*options, *SIM_CHANNEL_OPTIONS])


def _own_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) * 1024


async def _serve_pipe(conn: Any, handle: Any) -> None:
    loop = asyncio.get_running_loop()
    while True:
        cmd, arg = await loop.run_in_executor(None, conn.recv)
        if cmd == "stop":
            conn.send(None)
            return
        conn.send(handle(cmd, arg))


# -- daemons -----------------------------------------------------------------------------------
class _Beats(asyncio.DatagramProtocol):
    """One UDP socket for every simulated daemon of the process; replies matched by seq."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.waiting: dict[tuple[int, tuple], asyncio.Future] = {}

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        reply = unseal(self.key, data)
        if reply is None:
            return
        fut = self.waiting.pop((int(reply.get("seq", -1)), addr[:2]), None)
        if fut is not None and not fut.done():
            fut.set_result(reply)


class Daemons:
    def __init__(self, masters: list[str], token: str, first: int, count: int) -> None:
        self.masters, self.md = masters, ((rpc.TOKEN_HEADER, token),)
        self.key = beat_key(token)
        self.targets = {a: (a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in masters}
        self.beats: _Beats | None = None
        self.transport: Any = None
        self.names = [f"d{i:04d}" for i in range(first, first + count)]
        self.inc: dict[str, int] = {}
        self.latencies: list[float] = []
        self.failures = 0  # heartbeat calls that failed (a master down, a deadline missed)
        self.reregistered = 0  # a master said this incarnation is unknown or down: a false DOWN
        self.handovers = 0
        self.fallbacks = 0  # heartbeats that went over gRPC (no UDP answer within 0.25 s)

    def _stub(self, ch: grpc.aio.Channel, name: str) -> Any:
        return ch.unary_unary(f"/{rpc.SERVICE}/{name}", request_serializer=rpc.pack, response_deserializer=rpc.unpack)

    async def _register(self, node: str, chans: dict[str, grpc.aio.Channel], backoff: Backoff) -> None:
        port = 20000 + int(node[1:])
        while True:
            address = random.choice(self.masters)
            try:
                out = await self._stub(chans[address], "Register")(
                    {"node": node, "address": f"127.0.0.1:{port}", "capacity": CAPACITY}, timeout=5.0,
                    metadata=self.md)
                self.inc[node] = int(out["inc"])
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(backoff.next())

    async def run_one(self, node: str, start_after_s: float) -> None:
        await asyncio.sleep(start_after_s)  # a fleet does not start in the same second
        chans = {a: _channel(a, rpc.CHANNEL_OPTIONS) for a in self.masters}
        await self._register(node, chans, Backoff(0.1, 2.0))
        await asyncio.sleep(random.uniform(0, HEARTBEAT_S))  # daemons do not start in lockstep
        reported = -1
        while True:
            t_next = time.monotonic() + HEARTBEAT_S
            req = {"node": node, "inc": self.inc[node], "epoch": 0}
            seq = BeatClient.next_seq()
            payload = seal(self.key, {**req, "v": 1, "seq": seq})
            replies = await asyncio.gather(*(self._beat(chans[a], a, req, seq, payload) for a in self.masters))
            ok = [r for r in replies if r is not None]
            if ok and not any(r.get("ok") for r in ok):
                self.reregistered += 1
                await self._register(node, chans, Backoff(0.1, 2.0))
            elif any(r.get("handover_pending") for r in ok) and max(int(r["epoch"]) for r in ok) > reported:
                epoch = reported = max(int(r["epoch"]) for r in ok)  # once per epoch, as the agent does
                try:
                    await self._stub(chans[random.choice(self.masters)], "HandoverDone")(
                        {"node": node, "epoch": epoch}, timeout=5.0, metadata=self.md)
                    self.handovers += 1
                except grpc.aio.AioRpcError:
                    pass
            await asyncio.sleep(max(0.0, t_next - time.monotonic()))

    async def _beat(self, ch: grpc.aio.Channel, master: str, req: dict, seq: int, payload: bytes) -> dict | None:
        """UDP first; the RPC if the master is silent for half the 0.5 s deadline."""
        assert self.beats is not None
        t0 = time.perf_counter()
        fut = asyncio.get_running_loop().create_future()
        target = self.targets[master]
        self.beats.waiting[(seq, target)] = fut
        self.transport.sendto(payload, target)
        try:
            out = await asyncio.wait_for(fut, 0.25)
        except TimeoutError:
            self.beats.waiting.pop((seq, target), None)
            try:
                out = await self._stub(ch, "Heartbeat")(req, timeout=0.25, metadata=self.md)
                self.fallbacks += 1
            except grpc.aio.AioRpcError:
                self.failures += 1
                return None
        self.latencies.append(time.perf_counter() - t0)
        return out

    def handle(self, cmd: str, arg: Any) -> Any:
        if cmd == "registered":
            return len(self.inc)
        if cmd == "stats":  # since the last "stats": a window
            out = {"latencies": self.latencies, "failures": self.failures, "reregistered": self.reregistered,
                   "handovers": self.handovers, "fallbacks": self.fallbacks}
            self.latencies = []
            self.failures = self.reregistered = self.handovers = self.fallbacks = 0
            return out
        raise ValueError(cmd)


async def _daemons_main(conn: Any, masters: list[str], token: str, first: int, count: int, ramp_s: float) -> None:
    d = Daemons(masters, token, first, count)
    d.transport, d.beats = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: _Beats(d.key), local_addr=("127.0.0.1", 0))
    tasks = [asyncio.create_task(d.run_one(n, random.uniform(0, ramp_s))) for n in d.names]
    await _serve_pipe(conn, d.handle)
    for t in tasks:
        t.cancel()


def daemons_process(conn: Any, masters: list[str], token: str, first: int, count: int, ramp_s: float,
                    nice: int = 0) -> None:
    if nice:
        os.setpriority(os.PRIO_PROCESS, 0, nice)  # this thread; the ones it starts inherit it
    asyncio.run(_daemons_main(conn, masters, token, first, count, ramp_s))


# -- clients (watchers) ------------------------------------------------------------------------
class Watchers:
    def __init__(self, masters: list[str], token: str, count: int, standby: bool = True) -> None:
        self.masters, self.md, self.count, self.standby = masters, ((rpc.TOKEN_HEADER, token),), count, standby
        self.attached: list[str | None] = [None] * count  # master each watcher is attached to
        self.attached_at = [0.0] * count  # wall time of its last attach
        self.first_at = [0.0] * count  # wall time of its first membership
        self.broken_at = [0.0] * count  # wall time its last stream ended (a failover: when it noticed)
        self.called_at = [0.0] * count  # wall time it started its current call
        self.seen_t: list[list[float]] = [[] for _ in range(count)]  # wall time of each membership...
        self.seen_e: list[list[int]] = [[] for _ in range(count)]  # ...and its epoch
        self.attaches = 0
        self.messages = self.bytes = 0
        self.calls: list[Any] = [None] * count
        self.move_to: list[str | None] = [None] * count  # rebalance: the master to attach to next

    def _move(self, i: int, to: str) -> None:
        self.move_to[i] = to
        call = self.calls[i]
        if call is not None:
            call.cancel()

    @staticmethod
    def _prepare(chans: dict[str, grpc.aio.Channel], standby: str) -> None:
        if standby not in chans:  # MasterClient.prepare: connect now, no call
            chans[standby] = _channel(standby)
            chans[standby].get_state(try_to_connect=True)

    async def run_one(self, i: int) -> None:
        order = random.sample(self.masters, len(self.masters))
        # the connection to the master it watches, and (like MembershipWatcher) a standby one to
        # the master it would re-attach to, opened STANDBY_AFTER_S after attaching; others closed
        chans: dict[str, grpc.aio.Channel] = {}
        backoff = Backoff()
        loop = asyncio.get_running_loop()
        standby_timer: asyncio.TimerHandle | None = None
        k = 0
        while True:
            address = order[k % len(order)]
            k += 1
            moved_to = self.move_to[i]
            if moved_to is not None:
                address, self.move_to[i] = moved_to, None
            standby = order[k % len(order)]
            for a in [a for a in chans if a not in (address, standby)]:
                await chans.pop(a).close()
            ch = chans.get(address)
            if ch is None:
                ch = chans[address] = _channel(address)
            known = self.seen_e[i][-1] if self.seen_e[i] else -1
            self.called_at[i] = time.time()
            call = self.calls[i] = ch.unary_stream(f"/{rpc.SERVICE}/WatchMembership", request_serializer=rpc.pack)(
                {"known": known}, metadata=self.md)
            try:
                async for raw in call:
                    now = time.time()
                    if self.attached[i] != address:
                        self.attached[i], self.attached_at[i] = address, now
                        self.first_at[i] = self.first_at[i] or now
                        self.attaches += 1
                        backoff.reset()
                        if self.standby and standby != address:
                            if standby_timer is not None:
                                standby_timer.cancel()
                            standby_timer = loop.call_later(random.uniform(*STANDBY_AFTER_S), self._prepare, chans,
                                                            standby)
                    self.messages += 1
                    self.bytes += len(raw)
                    self.seen_t[i].append(now)
                    self.seen_e[i].append(epoch_of(raw))
            except grpc.aio.AioRpcError:
                pass
            except asyncio.CancelledError:
                if self.move_to[i] is None:  # the process is stopping, not a rebalance
                    raise
            delivered = self.attached[i] is not None
            self.attached[i] = None
            self.broken_at[i] = time.time()
            await chans.pop(address).close()
            if self.move_to[i] is not None:
                continue  # rebalancing: straight to the master picked
            await asyncio.sleep(random.uniform(0, REATTACH_SPREAD_S) if delivered else backoff.next())

    def handle(self, cmd: str, arg: Any) -> Any:
        if cmd == "attached":
            return sum(a is not None for a in self.attached)
        if cmd == "malloc_trim":  # give freed heap back to the system; the RSS before and after (bytes)
            import ctypes
            before = _own_rss()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            return before, _own_rss()
        if cmd == "counters":  # since the start: streams that delivered a membership, messages, bytes
            return {"attaches": self.attaches, "messages": self.messages, "bytes": self.bytes}
        if cmd == "spread":  # how many watchers each master holds
            out: dict[str, int] = {}
            for a in self.attached:
                if a is not None:
                    out[a] = out.get(a, 0) + 1
            return out
        if cmd == "rebalance":  # arg: (master, seconds): its share of the watchers moves to it (new clients would)
            to, seconds = arg
            loop = asyncio.get_running_loop()
            for i in range(self.count):
                if self.attached[i] != to and random.random() < 1 / len(self.masters):
                    loop.call_later(random.uniform(0, seconds), self._move, i, to)
            return None
        if cmd == "reattach":  # arg: (dead master, kill time[, True: each re-attach's time too])
            dead, t_kill, *times = arg
            pending = sum(a is None or a == dead for a in self.attached)
            if not times:
                return {"pending": pending}
            moved = [i for i, t in enumerate(self.attached_at) if t > t_kill]
            times = [self.attached_at[i] - t_kill for i in moved]
            return {"pending": pending, "moved": len(moved), "last_s": max(times, default=0.0), "times": times,
                    # when each noticed its stream had ended, and how long its new call took to deliver
                    "noticed": [self.broken_at[i] - t_kill for i in moved],
                    "call": [self.attached_at[i] - self.called_at[i] for i in moved]}
        if cmd == "propagation":  # arg: [(epoch, t0)]: seconds until each watcher saw that epoch or later
            lats: list[list[float]] = []
            for epoch, t0 in arg:
                lat = []
                for i in range(self.count):
                    if not self.first_at[i] or self.first_at[i] > t0:
                        continue  # attached after the change: it got it by bootstrapping
                    times, epochs = self.seen_t[i], self.seen_e[i]
                    j = bisect.bisect_left(times, t0)
                    while j < len(times) and epochs[j] < epoch:
                        j += 1
                    if j < len(times):
                        lat.append(times[j] - t0)
                    else:
                        lat.append(float("inf"))  # never notified
                lats.append(lat)
            return lats
        if cmd == "trim":  # forget memberships seen before arg (keeps memory bounded on long runs)
            for i in range(self.count):
                j = max(0, min(bisect.bisect_left(self.seen_t[i], arg), len(self.seen_t[i]) - 1))
                self.seen_t[i], self.seen_e[i] = self.seen_t[i][j:], self.seen_e[i][j:]
            return None
        raise ValueError(cmd)


async def _watchers_main(conn: Any, masters: list[str], token: str, count: int, ramp_per_s: float,
                         standby: bool) -> None:
    w = Watchers(masters, token, count, standby)
    tasks = []
    for i in range(count):
        tasks.append(asyncio.create_task(w.run_one(i)))
        if ramp_per_s and i % 50 == 49:
            await asyncio.sleep(50 / ramp_per_s)
    await _serve_pipe(conn, w.handle)
    for t in tasks:
        t.cancel()


def watchers_process(conn: Any, masters: list[str], token: str, count: int, ramp_per_s: float,
                     nice: int = 0, standby: bool = True) -> None:
    if nice:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    asyncio.run(_watchers_main(conn, masters, token, count, ramp_per_s, standby))
