"""``gcache master``: the membership service, a Raft group of 1, 3 or 5 replicas.

It only learns who is alive and publishes the membership epoch; it is never on the I/O path.
Any master answers reads; writes are Raft proposals, which pysyncobj forwards to the leader.
Daemons heartbeat every master; only the leader's failure detector turns silence into
SUSPECT / DOWN (a new leader first gives every node a full grace period).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from gcache.errors import ConfigError
from gcache.meta import rpc
from gcache.meta.nodetable import COMMAND_VERSION, OWNING, NodeTable
from gcache.meta.raft import ProposalFailed, RaftGroup
from gcache.process import stop_on_signals, write_ready

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

    def __post_init__(self) -> None:
        if not self.token:
            raise ConfigError("a master needs the cluster token (--token-file, $GCACHE_TOKEN_FILE or $GCACHE_TOKEN)")
        if not 0 < self.suspect_after_s < self.down_after_s:
            raise ConfigError("need 0 < --suspect-after < --down-after")
        if len(self.peers) not in (1, 3, 5) or self.raft not in self.peers:
            raise ConfigError("--peers must list 1, 3 or 5 Raft addresses, this master's --raft among them")


class _Guarded:
    """The node table behind a condition: Raft applies under it, readers wait on it."""

    def __init__(self, table: NodeTable, cond: threading.Condition) -> None:
        self.table, self.cond = table, cond

    def apply(self, cmd: dict[str, Any]) -> dict[str, Any]:
        with self.cond:
            out = self.table.apply(cmd)
            self.cond.notify_all()
            return out

    def snapshot(self) -> bytes:
        with self.cond:
            return self.table.snapshot()

    def restore(self, blob: bytes) -> None:
        with self.cond:
            self.table.restore(blob)
            self.cond.notify_all()


class Master:
    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.table = NodeTable()
        self.cond = threading.Condition()
        self.raft = RaftGroup(config.raft, list(config.peers), config.token, _Guarded(self.table, self.cond))
        # node -> (incarnation, when this master last heard from it). A new incarnation starts a
        # fresh grace period even on masters that did not handle its Register.
        self._last_seen: dict[str, tuple[int, float]] = {}
        self._stop = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="master-rpc"),
                                  options=rpc.CHANNEL_OPTIONS)
        tok = config.token
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
        host, _, port = config.listen.rpartition(":")
        bound = self.server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise ConfigError(f"cannot listen on {config.listen}")
        self.address = f"{host}:{bound}"
        self._detector = threading.Thread(target=self._detect_loop, name="failure-detector", daemon=True)

    def start(self) -> Master:
        self.server.start()
        self._detector.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        self.server.stop(grace=0.5)
        self.raft.close()

    # -- RPCs -------------------------------------------------------------------------------
    def _propose(self, cmd: dict[str, Any], context: grpc.ServicerContext) -> dict[str, Any]:
        try:
            return self.raft.propose({"v": COMMAND_VERSION, **cmd}, timeout_s=3.0)
        except ValueError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ProposalFailed as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"no Raft leader: {exc}")
        raise AssertionError("unreachable")

    def register(self, req: dict, context: grpc.ServicerContext) -> dict:
        out = self._propose({"op": "register", "node": str(req["node"]), "address": str(req["address"]),
                             "capacity": int(req["capacity"])}, context)
        self._last_seen[str(req["node"])] = (int(out["inc"]), time.monotonic())
        log.info("registered %s at %s (incarnation %d, epoch %d)", req["node"], req["address"], out["inc"],
                 out["epoch"])
        return {**out, "membership": self._membership(at_least=out["epoch"])}

    def heartbeat(self, req: dict, context: grpc.ServicerContext) -> dict:
        node, inc = str(req["node"]), int(req["inc"])
        with self.cond:
            rec = self.table.nodes.get(node)
            epoch = self.table.epoch
            t = self.table.transition
            pending = t is not None and node in t["pending"]
        if rec is None or rec["inc"] != inc or rec["state"] == "down":
            why = "unknown node" if rec is None else (
                "stale incarnation" if rec["inc"] != inc else "declared down")
            return {"ok": False, "reason": why, "epoch": epoch, "leader": self.raft.is_leader}
        self._last_seen[node] = (inc, time.monotonic())
        # "leader": only the leader's failure detector declares nodes DOWN, so a daemon's
        # membership lease is an acknowledgement from the leader (gcache.server.lease)
        return {"ok": True, "epoch": epoch, "state": rec["state"], "handover_pending": pending,
                "leader": self.raft.is_leader}

    def _membership(self, at_least: int = 0) -> dict:
        """The local table's membership, once it has applied epoch ``at_least`` (a follower
        applies a command shortly after the leader has committed it)."""
        with self.cond:
            self.cond.wait_for(lambda: self.table.epoch >= at_least, timeout=2.0)
            return self.table.membership()

    def get_membership(self, req: dict, context: grpc.ServicerContext) -> dict:
        return self._membership()

    def watch_membership(self, req: dict, context: grpc.ServicerContext) -> Iterator[dict]:
        """Stream the membership now and at every epoch change (and every 5 s as a keep-alive)."""
        known = -1
        while context.is_active() and not self._stop.is_set():
            with self.cond:
                if self.table.epoch == known:
                    self.cond.wait(timeout=5.0)
                m = self.table.membership()
            known = m["epoch"]
            yield m

    def drain(self, req: dict, context: grpc.ServicerContext) -> dict:
        out = self._propose({"op": "drain", "node": str(req["node"])}, context)
        log.info("draining %s (epoch %d)", req["node"], out["epoch"])
        return out

    def handover_done(self, req: dict, context: grpc.ServicerContext) -> dict:
        return self._propose({"op": "handover_done", "node": str(req["node"]), "epoch": int(req["epoch"])},
                             context)

    def status(self, req: dict, context: grpc.ServicerContext) -> dict:
        now = time.monotonic()
        return {"master": {"grpc": self.address, **self.raft.status()}, "membership": self._membership(),
                "heartbeat_age_s": {n: round(now - t, 3) for n, (_inc, t) in self._last_seen.items()}}

    # -- failure detection (leader only) ----------------------------------------------------
    def _detect_loop(self) -> None:
        leader_since: float | None = None
        while not self._stop.wait(0.1):
            if not self.raft.is_leader:
                leader_since = None
                continue
            now = time.monotonic()
            if leader_since is None:
                leader_since = now
                log.info("became Raft leader; failure detection starts with a full grace period")
            with self.cond:
                nodes = [(n, r["inc"], r["state"]) for n, r in self.table.nodes.items()]
            for node, inc, state in nodes:
                if state not in OWNING:
                    continue
                seen = self._last_seen.get(node)
                if seen is None or seen[0] != inc:  # an incarnation this master has not heard from
                    self._last_seen[node] = (inc, now)  # yet: it gets a full grace period
                    continue
                age = now - max(seen[1], leader_since)
                target = ("down" if age > self.config.down_after_s
                          else "suspect" if age > self.config.suspect_after_s else "up")
                if target != state:
                    try:
                        self.raft.propose({"v": COMMAND_VERSION, "op": "set_state", "node": node, "inc": inc,
                                           "state": target}, timeout_s=1.0)
                        log.warning("node %s is %s (no heartbeat for %.1fs)", node, target.upper(), age)
                    except (ValueError, ProposalFailed) as exc:
                        log.warning("could not mark %s %s: %s", node, target, exc)


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
        master = Master(config).start()
    except (ConfigError, OSError) as exc:
        print(f"gcache master: {exc}", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    print(f"gcache master listening on {master.address} raft={config.raft}", flush=True)
    health = None
    if getattr(args, "metrics_port", None) is not None:  # /metrics, /healthz, /readyz (gcache.ops.health)
        from gcache.ops.health import serve_master

        try:
            health = serve_master(master, args.metrics_port, args.metrics_host)
        except OSError as exc:
            print(f"gcache master: metrics port: {exc}", file=sys.stderr)
            master.stop()
            return 2
        print(f"gcache master metrics on http://{health.address}/metrics", flush=True)
        if args.ready_file:
            write_ready(args.ready_file + ".metrics", health.address)
    if args.ready_file:
        write_ready(args.ready_file, master.address)
    stop.wait()
    if health is not None:
        health.stop()
    master.stop()
    return 0
