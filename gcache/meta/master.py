"""``gcache master``: the membership service, a Raft group of 1, 3 or 5 replicas.

It only learns who is alive and publishes the membership epoch; it is never on the I/O path.
Any master answers reads; writes are Raft proposals, which pysyncobj forwards to the leader.
Daemons heartbeat every master; only the leader's failure detector turns silence into
SUSPECT / DOWN (a new leader first gives every node a full grace period).

A master is two processes. This one, the front, serves gRPC on one asyncio event loop
(grpc.aio): a watch stream is a coroutine parked on the membership feed, not a thread, so one
master holds thousands of them, and the membership is encoded once per epoch and the same bytes
go to every watcher (gcache.meta.feed). The core (gcache.meta.core), a child process, runs Raft,
the node table, the failure detector and the UDP heartbeat listener, so that no fan-out or
reconnect storm here can delay Raft's timers or a heartbeat; the front also runs at a lower CPU
priority than the core (FRONT_NICE), so on a busy machine the core is scheduled first.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from gcache.errors import ConfigError
from gcache.meta import rpc
from gcache.meta.core import core_main
from gcache.meta.feed import FanOut, MembershipFeed
from gcache.meta.fields import MAX_INT, cut, flag_error, heartbeat_error, int_error, node_error
from gcache.meta.frontstats import FrontStats
from gcache.meta.raft import raft_address_error
from gcache.net.address import advertised_address_error, binds_clash, split_host_port

log = logging.getLogger("gcache.master")


FRONT_NICE = 5  # the front runs this much below the core: a client storm must not starve Raft


def lower_own_priority(by: int) -> None:
    """Add ``by`` to the nice value of every thread of this process (Linux priorities are per
    thread; threads started later inherit their creator's)."""
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            now = os.getpriority(os.PRIO_PROCESS, int(tid))
            os.setpriority(os.PRIO_PROCESS, int(tid), min(19, now + by))
        except OSError:  # the thread has exited
            pass


MAX_CAPACITY = 1 << 60  # bytes a node may declare (RAM + disk)
MAX_ADDRESS = 262  # characters of HOST:PORT: a 253-character DNS name, or a bracketed IPv6 address


def register_error(req: dict[str, Any]) -> str | None:
    """What is wrong with a Register request (None: nothing): every field ends up in the
    membership that every client and daemon routes by."""
    address, capacity = req.get("address"), req.get("capacity")
    err = node_error(req.get("node"))
    if err is not None:
        return err
    if not isinstance(address, str) or len(address) > MAX_ADDRESS:
        return f"'address' must be a HOST:PORT string of at most {MAX_ADDRESS} characters"
    try:
        if split_host_port(address, "'address'")[1] == 0:
            raise ValueError(f"'address' {address!r}: port 0 cannot be reached")
    except ValueError as exc:
        return cut(str(exc))
    # what every client and daemon checks (a comma, a space...), and no wildcard: 0.0.0.0 in the
    # membership sends every client to a daemon on its own host, whichever node it meant
    err = advertised_address_error(address)
    if err is not None:
        return cut(f"'address': {err}")
    if type(capacity) is not int or not 0 < capacity <= MAX_CAPACITY:
        return f"'capacity' must be an int of bytes in 1..{MAX_CAPACITY}"
    return None


class CoreGone(Exception):
    """The core process exited: this master cannot serve."""


@dataclass(frozen=True)
class MasterConfig:
    """listen: gRPC HOST:PORT (port 0 picks one). raft/peers: this master's and all masters'
    Raft HOST:PORT. suspect_after_s/down_after_s: heartbeat silence before SUSPECT / DOWN."""

    listen: str
    raft: str
    peers: tuple[str, ...]
    token: str
    suspect_after_s: float = 2.0
    down_after_s: float = 3.0
    fan_out: FanOut = field(default_factory=FanOut)

    def __post_init__(self) -> None:
        """ConfigError (``field``: this dataclass's field at fault) for what a master cannot run with."""
        if not self.token:
            raise ConfigError("a master needs the cluster token (--token-file, $GCACHE_TOKEN_FILE or $GCACHE_TOKEN)",
                              "token")
        if not 0 < self.suspect_after_s < self.down_after_s:
            raise ConfigError("need 0 < --suspect-after < --down-after", "down_after_s")
        if len(self.peers) not in (1, 3, 5) or self.raft not in self.peers:
            raise ConfigError("--peers must list 1, 3 or 5 Raft addresses, this master's --raft among them", "peers")
        if twice := sorted({p for p in self.peers if self.peers.count(p) > 1}):
            raise ConfigError(f"--peers lists {', '.join(twice)} twice: each master's Raft address once", "peers")
        if err := raft_address_error(self.raft):
            raise ConfigError(err, "raft")
        try:
            listen, raft = split_host_port(self.listen, "--listen"), split_host_port(self.raft, "--raft")
        except ValueError as exc:
            raise ConfigError(str(exc), "listen" if "--listen" in str(exc) else "raft") from None
        if binds_clash(listen, raft):
            raise ConfigError(f"--raft {self.raft} is also the gRPC --listen port ({self.listen}): give Raft a port "
                              "of its own", "raft")


class Master:
    """Build it, then ``await start()`` on the loop that will serve it."""

    def __init__(self, config: MasterConfig, name: str = "master", log_level: str = "INFO") -> None:
        self.config, self.name, self.log_level = config, name, log_level
        self.feed = MembershipFeed(config.fan_out)
        self.stats = FrontStats()
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.core_pid = -1
        self.gone = asyncio.Event()  # the core exited
        self._conn: Any = None
        self._proc: Any = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tuple[bool, Any]]] = {}
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> Master:
        loop = self._loop = asyncio.get_running_loop()
        self.server = grpc.aio.server(options=rpc.SERVER_OPTIONS)
        tok = self.config.token
        handlers = {
            "Register": rpc.unary(tok, self.register),
            "Heartbeat": rpc.unary(tok, self.heartbeat),
            "GetMembership": rpc.unary(tok, self.get_membership),
            "WatchMembership": rpc.stream(tok, self.watch_membership),
            "Drain": rpc.unary(tok, self.drain),
            "HandoverDone": rpc.unary(tok, self.handover_done),
            "Status": rpc.unary(tok, self.status),
            "Rings": rpc.unary(tok, self.rings),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(rpc.SERVICE, handlers),))
        host, _, port = self.config.listen.rpartition(":")
        try:
            bound = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise ConfigError(f"cannot listen on {self.config.listen}")
        self.address = f"{host}:{bound}"
        # the core: Raft, the table, heartbeats on UDP at the same port number
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=core_main, name=f"gcache-master-core[{self.name}]",
                                 args=(child, self.config, (host, bound), self.log_level, self.name))
        self._proc.start()
        child.close()
        self.core_pid = self._proc.pid
        lower_own_priority(FRONT_NICE)  # the core keeps the priority we started with
        first = await loop.run_in_executor(None, self._first_message)
        if first[0] != "ready":
            raise ConfigError(f"the master's core did not start: {first[1]}")
        loop.add_reader(self._conn.fileno(), self._on_link)
        await asyncio.wait_for(self.feed.at_least(0, timeout_s=30.0), 31.0)
        await self.server.start()
        self.stats.start()
        return self

    def _first_message(self) -> tuple[Any, ...]:
        if not self._conn.poll(60):
            return ("failed", "no answer within 60 s")
        try:
            first: tuple[Any, ...] = self._conn.recv()
            return first
        except EOFError:
            return ("failed", f"it exited with {self._proc.exitcode} (see the log above)")

    def _on_link(self) -> None:
        try:
            while self._conn.poll():
                msg = self._conn.recv()
                if msg[0] == "membership":
                    self.feed.offer(msg[1], msg[2])
                elif msg[0] == "reply":
                    fut = self._waiting.pop(msg[1], None)
                    if fut is not None and not fut.done():
                        fut.set_result((msg[2], msg[3]))
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            if not self._stopping:
                log.critical("the master's core process exited; stopping")
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(CoreGone())
            self.gone.set()

    async def _ask(self, op: str, *args: Any, timeout_s: float = 10.0) -> tuple[bool, Any]:
        if self.gone.is_set():
            raise CoreGone()
        req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[req_id] = fut
        self._conn.send((op, req_id, *args))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._waiting.pop(req_id, None)

    @property
    def serving(self) -> bool:
        """The front serves and its core runs (for the liveness probe)."""
        return self._loop is not None and not self._stopping and not self.gone.is_set()

    def health(self, timeout_s: float = 2.0) -> dict[str, Any]:
        """From any thread but the loop's (the metrics/health server): the core's Raft status,
        epoch and node counts by state. Raises CoreGone or TimeoutError when it does not answer."""
        if self._loop is None:
            raise CoreGone()
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: the expected case
            running = None
        if running is self._loop:
            raise RuntimeError("Master.health() blocks: call it from another thread than the loop's")
        fut = asyncio.run_coroutine_threadsafe(self._ask("health", timeout_s=timeout_s), self._loop)
        _ok, value = fut.result(timeout_s + 1.0)
        return dict(value)

    async def stop(self) -> None:
        self._stopping = True
        self.stats.stop()
        if self.server is not None:
            await self.server.stop(grace=0.5)
        if self._conn is not None and not self.gone.is_set():
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
        if self._proc is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 10)
            if self._proc.is_alive():
                self._proc.kill()

    # -- RPCs -------------------------------------------------------------------------------
    async def _propose(self, cmd: dict[str, Any], context: Any, timeout_s: float = 3.0) -> dict[str, Any]:
        try:
            ok, value = await self._ask("propose", cmd, timeout_s, timeout_s=timeout_s + 2.0)
        except (CoreGone, TimeoutError):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this master is stopping")
        if ok:
            result: dict[str, Any] = value
            return result
        kind, message = value
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION if kind == "refused"
                            else grpc.StatusCode.UNAVAILABLE, cut(str(message)))
        raise AssertionError("unreachable")

    async def register(self, req: dict[str, Any], context: Any) -> dict[str, Any]:
        err = register_error(req)
        if err is not None:  # it would go into every membership: one bad entry breaks every client
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Register: {err}")
        node = str(req["node"])
        out = await self._propose({"op": "register", "node": node, "address": str(req["address"]),
                                   "capacity": int(req["capacity"])}, context)
        log.info("registered %s at %s (incarnation %d, epoch %d)", node, req["address"], out["inc"], out["epoch"])
        snap = await self.feed.at_least(int(out["epoch"]), timeout_s=2.0)
        return {**out, "membership": rpc.unpack(snap.encoded)}

    async def heartbeat(self, req: dict[str, Any], context: Any) -> dict[str, Any]:
        """The RPC path (daemons use UDP, gcache.meta.beat); answered by the core."""
        err = heartbeat_error(req)
        if err is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Heartbeat: {err}")
        req = {"node": req["node"], "inc": req["inc"], "cut": req.get("cut") is True}
        try:
            _ok, value = await self._ask("heartbeat", req, timeout_s=2.0)
        except (CoreGone, TimeoutError):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this master is stopping")
        reply: dict[str, Any] = value
        return reply

    async def get_membership(self, req: dict[str, Any], context: Any) -> bytes:
        return self.feed.current.encoded

    async def watch_membership(self, req: dict[str, Any], context: Any) -> AsyncIterator[bytes]:
        """The membership now, then at every epoch change: the delta from the epoch the watcher
        holds (gcache.meta.delta) when this master still has it, else the whole membership. A
        watcher re-attaching with the current epoch (``known``) first gets just ``{"epoch",
        "unchanged": true}``, and one a few epochs behind a delta: after a master fails, thousands
        re-attach at once. Liveness: HTTP/2 keepalive."""
        started = time.perf_counter()
        err = int_error(req, "known", -1, MAX_INT, required=False)
        if err is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"WatchMembership: {err}")
        known: int = req.get("known", -1)
        self.feed.watchers += 1
        try:
            snap = self.feed.current
            if known == snap.epoch and snap.unchanged:
                yield snap.unchanged
                self.stats.first_written(started)
            else:
                snap = await self.feed.next_after(known)
                out = self.feed.payload(snap, known)
                known = snap.epoch
                yield out
                self.stats.first_written(started)
            while True:
                snap = await self.feed.next_after(known)
                out = self.feed.payload(snap, known)
                known = snap.epoch
                yield out
        finally:
            self.feed.watchers -= 1

    async def drain(self, req: dict[str, Any], context: Any) -> dict[str, Any]:
        """A node to drain: one that this master does not know is refused by the core before it
        is proposed when it can tell (gcache.meta.core), else when the command is applied."""
        err = node_error(req.get("node"))
        if err is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Drain: {err}")
        out = await self._propose({"op": "drain", "node": req["node"]}, context)
        log.info("draining %s (epoch %d)", req["node"], out["epoch"])
        return out

    async def handover_done(self, req: dict[str, Any], context: Any) -> dict[str, Any]:
        err = node_error(req.get("node")) or int_error(req, "epoch", 0, MAX_INT)
        if err is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"HandoverDone needs a 'node' string and an int 'epoch': {err}")
        return await self._propose({"op": "handover_done", "node": req["node"], "epoch": req["epoch"]}, context)

    async def rings(self, req: dict[str, Any], context: Any) -> dict[str, Any]:
        """The rings of generations after ``after`` (NodeTable.rings_after; None: not all held
        here): for a daemon that missed some changes of the ring."""
        err = int_error(req, "after", -1, MAX_INT)
        if err is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Rings needs an int 'after': {err}")
        after: int = req["after"]
        try:
            _ok, rings = await self._ask("rings", after, timeout_s=5.0)
        except (CoreGone, TimeoutError):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this master's core does not answer")
        return {"rings": rings}

    async def status(self, req: dict[str, Any], context: Any) -> dict[str, Any]:
        """This master's Raft view, the membership and heartbeat ages; with ``brief`` only the
        first (no per-node rows: cheap enough to poll during a failover); with ``front`` also this
        front's loop lag and new watches' first-message times since the last such call."""
        err = flag_error(req, "brief") or flag_error(req, "front")
        if err is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Status: {err}")
        brief = bool(req.get("brief")) or bool(req.get("front"))
        try:
            _ok, core = await self._ask("health" if brief else "status", timeout_s=5.0)
        except (CoreGone, TimeoutError):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this master's core does not answer")
        if brief:
            out = {"master": {"grpc": self.address, **core["raft"], "watchers": self.feed.watchers,
                              "epoch": core["epoch"], "core_pid": self.core_pid}}
            if req.get("front"):
                out["front"] = self.stats.take()
            return out
        return {"master": {"grpc": self.address, **core["raft"], "watchers": self.feed.watchers,
                           "epochs_published": self.feed.published, "udp_heartbeats": core["udp_heartbeats"],
                           "core_pid": self.core_pid},
                "membership": core["membership"], "heartbeat_age_s": core["heartbeat_age_s"]}
