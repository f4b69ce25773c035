"""``gcache master``: the membership service, a Raft group of 1, 3 or 5 replicas.

It only learns who is alive and publishes the membership epoch; it is never on the I/O path.
Any master answers reads; writes are Raft proposals, which pysyncobj forwards to the leader.
Daemons heartbeat every master; only the leader's failure detector turns silence into
SUSPECT / DOWN (a new leader first gives every node a full grace period).

The gRPC service runs on one asyncio event loop (grpc.aio): a watch stream is a coroutine
parked on the membership feed, not a thread, so one master holds thousands of them; the
membership is encoded once per epoch and the same bytes go to every watcher (gcache.meta.feed).
Heartbeats are answered on the loop from memory. Raft (pysyncobj) runs on its own thread;
proposals complete through its callbacks, so no thread waits on a commit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from gcache.errors import ConfigError
from gcache.meta import rpc
from gcache.meta.detector import FailureDetector
from gcache.meta.feed import FanOut, MembershipFeed
from gcache.meta.nodetable import COMMAND_VERSION, NodeTable
from gcache.meta.raft import ProposalFailed, RaftGroup
from gcache.process import write_ready

log = logging.getLogger("gcache.master")


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
        if not self.token:
            raise ConfigError("a master needs the cluster token (--token-file, $GCACHE_TOKEN_FILE or $GCACHE_TOKEN)")
        if not 0 < self.suspect_after_s < self.down_after_s:
            raise ConfigError("need 0 < --suspect-after < --down-after")
        if len(self.peers) not in (1, 3, 5) or self.raft not in self.peers:
            raise ConfigError("--peers must list 1, 3 or 5 Raft addresses, this master's --raft among them")


class _Guarded:
    """The node table behind a lock: Raft applies under it (on its thread), then tells the feed."""

    def __init__(self, table: NodeTable, lock: threading.Lock, changed: Callable[[], None]) -> None:
        self.table, self.lock, self.changed = table, lock, changed

    def apply(self, cmd: dict[str, Any]) -> dict[str, Any]:
        try:
            with self.lock:
                return self.table.apply(cmd)
        finally:
            self.changed()

    def snapshot(self) -> bytes:
        with self.lock:
            return self.table.snapshot()

    def restore(self, blob: bytes) -> None:
        with self.lock:
            self.table.restore(blob)
        self.changed()


class Master:
    """Build it, then ``await start()`` on the loop that will serve it."""

    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.table = NodeTable()
        self.lock = threading.Lock()
        self.feed = MembershipFeed(self._read_membership, config.fan_out)
        self.detector = FailureDetector(config.suspect_after_s, config.down_after_s)
        self.raft = RaftGroup(config.raft, list(config.peers), config.token,
                              _Guarded(self.table, self.lock, self.feed.changed))
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._detector_task: asyncio.Task | None = None
        self._in_flight: set[tuple[str, int]] = set()

    def _read_membership(self) -> dict[str, Any]:
        with self.lock:
            return self.table.membership()

    async def start(self) -> Master:
        loop = asyncio.get_running_loop()
        self.feed.bind(loop)
        self.feed.changed()  # Raft may have applied its journal before the loop was bound
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
        await self.server.start()
        self._detector_task = loop.create_task(self._detect_loop())
        return self

    async def stop(self) -> None:
        if self._detector_task is not None:
            self._detector_task.cancel()
        if self.server is not None:
            await self.server.stop(grace=0.5)
        self.raft.close()

    # -- RPCs -------------------------------------------------------------------------------
    async def _propose(self, cmd: dict[str, Any], context: Any) -> dict[str, Any]:
        try:
            return await self.raft.propose_async({"v": COMMAND_VERSION, **cmd}, timeout_s=3.0)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ProposalFailed as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"no Raft leader: {exc}")
        raise AssertionError("unreachable")

    async def register(self, req: dict, context: Any) -> dict:
        node = str(req["node"])
        out = await self._propose({"op": "register", "node": node, "address": str(req["address"]),
                                   "capacity": int(req["capacity"])}, context)
        self.detector.heard(node, int(out["inc"]))
        log.info("registered %s at %s (incarnation %d, epoch %d)", node, req["address"], out["inc"], out["epoch"])
        snap = await self.feed.at_least(int(out["epoch"]), timeout_s=2.0)
        return {**out, "membership": rpc.unpack(snap.encoded)}

    async def heartbeat(self, req: dict, context: Any) -> dict:
        node, inc = str(req["node"]), int(req["inc"])
        with self.lock:
            rec = self.table.nodes.get(node)
            epoch = self.table.epoch
            t = self.table.transition
            pending = t is not None and node in t["pending"]
            state, rec_inc = (rec["state"], rec["inc"]) if rec is not None else (None, None)
        if rec is None or rec_inc != inc or state == "down":
            why = "unknown node" if rec is None else ("stale incarnation" if rec_inc != inc else "declared down")
            return {"ok": False, "reason": why, "epoch": epoch}
        self.detector.heard(node, inc)
        return {"ok": True, "epoch": epoch, "state": state, "handover_pending": pending}

    async def get_membership(self, req: dict, context: Any) -> bytes:
        return self.feed.current.encoded

    async def watch_membership(self, req: dict, context: Any) -> AsyncIterator[bytes]:
        """The membership now and at every epoch change (liveness: HTTP/2 keepalive pings)."""
        known = -1
        self.feed.watchers += 1
        try:
            while True:
                snap = await self.feed.next_after(known)
                known = snap.epoch
                yield snap.encoded
        finally:
            self.feed.watchers -= 1

    async def drain(self, req: dict, context: Any) -> dict:
        out = await self._propose({"op": "drain", "node": str(req["node"])}, context)
        log.info("draining %s (epoch %d)", req["node"], out["epoch"])
        return out

    async def handover_done(self, req: dict, context: Any) -> dict:
        return await self._propose({"op": "handover_done", "node": str(req["node"]), "epoch": int(req["epoch"])},
                                   context)

    async def status(self, req: dict, context: Any) -> dict:
        return {"master": {"grpc": self.address, **self.raft.status(), "watchers": self.feed.watchers,
                           "epochs_published": self.feed.published},
                "membership": self._read_membership(), "heartbeat_age_s": self.detector.ages()}

    # -- failure detection (leader only) ----------------------------------------------------
    async def _detect_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.1)
            if self.detector.leadership(self.raft.is_leader):
                log.info("became Raft leader; failure detection starts with a full grace period")
            with self.lock:
                rows = [(n, r["inc"], r["state"]) for n, r in self.table.nodes.items()]
            for v in self.detector.verdicts(rows):
                if (v.node, v.inc) not in self._in_flight:
                    self._in_flight.add((v.node, v.inc))
                    loop.create_task(self._set_state(v.node, v.inc, v.state, v.silent_s))

    async def _set_state(self, node: str, inc: int, state: str, silent_s: float) -> None:
        try:
            await self.raft.propose_async({"v": COMMAND_VERSION, "op": "set_state", "node": node, "inc": inc,
                                           "state": state}, timeout_s=1.0)
            log.warning("node %s is %s (no heartbeat for %.1fs)", node, state.upper(), silent_s)
        except (ValueError, ProposalFailed) as exc:
            log.warning("could not mark %s %s: %s", node, state, exc)
        finally:
            self._in_flight.discard((node, inc))


def raise_fd_limit() -> None:
    """A master holds a connection per client and daemon: allow as many files as the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--id", default=None, help="master id, for logs (default: the --raft address)")
    p.add_argument("--listen", default="127.0.0.1:7300", help="gRPC HOST:PORT (default %(default)s)")
    p.add_argument("--raft", required=True, help="this master's Raft HOST:PORT")
    p.add_argument("--peers", required=True,
                   help="comma-separated Raft HOST:PORT of every master (1, 3 or 5), this one included")
    p.add_argument("--token-file", default=None, help="file holding the cluster token (else $GCACHE_TOKEN_FILE, else $GCACHE_TOKEN)")
    p.add_argument("--suspect-after", type=float, default=2.0, help="heartbeat silence before SUSPECT (s)")
    p.add_argument("--down-after", type=float, default=3.0, help="heartbeat silence before DOWN (s)")
    p.add_argument("--ready-file", default=None, help="write the gRPC HOST:PORT here once serving")
    p.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s master[{args.id or args.raft}] %(levelname)s %(message)s")
    try:
        config = MasterConfig(listen=args.listen, raft=args.raft,
                              peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()),
                              token=rpc.load_token(args.token_file) or "",
                              suspect_after_s=args.suspect_after, down_after_s=args.down_after)
    except ConfigError as exc:
        print(f"gcache master: {exc}", file=sys.stderr)
        return 2
    raise_fd_limit()
    return asyncio.run(_serve(config, args.ready_file))


async def _serve(config: MasterConfig, ready_file: str | None) -> int:
    try:
        master = await Master(config).start()
    except (ConfigError, OSError) as exc:
        print(f"gcache master: {exc}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"gcache master listening on {master.address} raft={config.raft}", flush=True)
    if ready_file:
        write_ready(ready_file, master.address)
    await stop.wait()
    await master.stop()
    return 0
