"""``gcache daemon``: build the store, serve the data plane, stop cleanly on SIGTERM/SIGINT.

The daemon's composition root: it wires the store (gcache.tier), the servers and the agent
(gcache.server), the handover put (gcache.client.handover) and the health endpoints (gcache.ops).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from gcache import argtypes
from gcache.client.handover import ClientPut
from gcache.errors import ConfigError
from gcache.meta.master_client import MasterClient
from gcache.meta.rpc import load_token
from gcache.net.address import binds_clash, is_wildcard, parse_advertise, split_host_port
from gcache.process import stop_on_signals, wait_for_stop, write_ready
from gcache.protocol import DEFAULT_MAX_VALUE_BYTES
from gcache.server.admission import AdmissionConfig
from gcache.server.agent import Agent
from gcache.server.local import MIN_LEASE_S, LocalServer
from gcache.server.server import DataServer
from gcache.sizes import parse_size
from gcache.tier.eviction import EvictionConfig, EvictionKind
from gcache.tier.pools import PoolBudget, PoolBudgets
from gcache.tier.store import Store, StoreConfig

log = logging.getLogger("gcached")
T = TypeVar("T")


def _node_id(text: str) -> str:
    """argparse type: a node id the masters take (gcache.meta.fields.node_error)."""
    from gcache.meta.fields import node_error

    if err := node_error(text, "--node-id"):
        raise argparse.ArgumentTypeError(err)
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:7400",
                   help="HOST:PORT for the data plane (port 0 picks a free one; default %(default)s)")
    p.add_argument("--advertise", default=None, metavar="HOST[:PORT]",
                   help="the address registered with the masters and given to clients: the one they reach this "
                        "daemon at (PORT defaults to the port it listens on; the local path's socket is named "
                        "after it). Required when --listen is a wildcard (0.0.0.0, ::), which no client can dial "
                        "(default: the listen address)")
    p.add_argument("--node-id", type=_node_id, default=None,
                   help="stable node id, printable ASCII without spaces (default: the advertised address)")
    p.add_argument("--mem", type=argtypes.size, default="1GiB",
                   help="RAM arena size, e.g. 512MiB, 4GiB (default %(default)s)")
    p.add_argument("--disk", default=None, help="NVMe tier directory (omit for RAM only)")
    p.add_argument("--disk-size", type=argtypes.size, default="10GiB",
                   help="NVMe tier byte budget (default %(default)s)")
    p.add_argument("--max-value", type=argtypes.size, default=f"{DEFAULT_MAX_VALUE_BYTES >> 20}MiB",
                   help="largest value accepted (default %(default)s)")
    p.add_argument("--disk-read-budget", type=argtypes.size, default=None, metavar="SIZE",
                   help="bytes of NVMe hits all requests may hold outside the arena at once (read into buffers "
                        "of their own when the arena has no room to promote them, until their reply is sent); a "
                        "hit beyond it is answered as a miss (default: a quarter of --mem, at least --max-value)")
    p.add_argument("--pool-budget", action="append", default=[], metavar="[NS:]POOL=SIZE|PCT%",
                   help="RAM budget of a tagged pool (e.g. kv=75%%, swa=25%%, mimo:swa=1GiB); repeatable. "
                        "A pool evicts only its own pages; pools without a budget share the arena")
    p.add_argument("--eviction", default=EvictionConfig().kind.value, choices=[k.value for k in EvictionKind],
                   help="eviction policy of untagged RAM entries: reuse (values read again, or rewritten soon "
                        "after eviction, outlive fresh ones, and only fresh ones go while reused ones hold "
                        "under 30%% of the entries: scan-resistant), slru, lru, or s3fifo (default %(default)s)")
    p.add_argument("--no-pretouch", action="store_true",
                   help="do not pre-fault the arena at start-up (faster start, slower first writes)")
    p.add_argument("--ready-file", default=None,
                   help="write 'HOST:PORT' here once listening (for supervisors and tests)")
    p.add_argument("--masters", default=None,
                   help="gcache://HOST:PORT,... of the master group: register, heartbeat, hand keys over "
                        "(omit for a static cluster)")
    p.add_argument("--token-file", default=None,
                   help="cluster token file (else $GCACHE_TOKEN_FILE, else $GCACHE_TOKEN); required of clients when set")
    p.add_argument("--heartbeat", type=argtypes.seconds, default=1.0,
                   help="seconds between heartbeats (default %(default)s)")
    p.add_argument("--fence-after", type=argtypes.seconds, default=2.0,
                   help="refuse data requests (FENCED) after this long without an acknowledgement from the master "
                        "leader, unless every peer confirms a master outage; it must be above --heartbeat, and "
                        "it + 0.6 below the masters' --down-after (gcache config check checks a file with both) "
                        "(default %(default)s)")
    p.add_argument("--outage-max", type=argtypes.seconds, default=15.0,
                   help="in a master outage its peers confirm, serve on under the last membership for at most "
                        "this long after the master leader last acknowledged this node, then fence; a node "
                        "joining while nodes are declared down waits up to this (+ --fence-after) for them "
                        "(default %(default)s)")
    p.add_argument("--metrics-port", type=argtypes.port, default=None, metavar="PORT",
                   help="serve Prometheus /metrics, /healthz and /readyz on METRICS_HOST:PORT (--metrics-host, "
                        "default 127.0.0.1; 0 picks a free port; default off); the address is printed at "
                        "start-up and written to READY_FILE.metrics")
    p.add_argument("--no-local", action="store_true",
                   help="do not serve the local shared-memory path (Unix socket + arena fd) to clients on this host")
    p.add_argument("--lease", type=argtypes.seconds_at_least(MIN_LEASE_S), default=5.0,
                   help=f"seconds a local client may hold pinned or reserved slots, at least {MIN_LEASE_S:g} "
                        "(default %(default)s)")
    p.add_argument("--ucx", action="store_true",
                   help="also carry the data plane over UCX for clients that ask (Client(transport=Transport.UCX)); "
                        "set up over the TCP port, UCX picks its transports (UCX_TLS; tcp, shared memory, RDMA)")
    p.add_argument("--max-connections", type=argtypes.count, default=4096,
                   help="client connections (TCP and local) held at once; kept below ulimit -n. At the cap an "
                        "idle or unauthenticated connection makes room for a new one (default %(default)s)")
    p.add_argument("--meta-budget", type=argtypes.size, default="64MiB",
                   help="request metadata (keys, sizes) all connections may hold at once (default %(default)s)")
    p.add_argument("--frame-timeout", type=argtypes.seconds, default=10.0,
                   help="seconds a begun frame's header and metadata may take to arrive (default %(default)s)")
    p.add_argument("--progress-timeout", type=argtypes.seconds, default=AdmissionConfig().progress_timeout_s,
                   help="seconds a request's payload may go without a byte arriving, or its reply without a byte "
                        "leaving, before its connection is reset and what it holds (reserved or pinned values, "
                        "its connection slot) is released; a slow but moving transfer is never cut "
                        "(default %(default)s)")
    p.add_argument("--handshake-timeout", type=argtypes.seconds, default=10.0,
                   help="seconds a connection may stay unauthenticated when a token is set (default %(default)s)")
    p.add_argument("--log-level", type=argtypes.log_level, default="INFO",
                   help="logging level (default %(default)s)")


class FlagError(ConfigError):
    """A flag value the daemon refuses: ``dest`` is the flag's argparse destination (None when
    no one flag is at fault), ``detail`` the reason without the flag's name."""

    def __init__(self, dest: str | None, detail: str) -> None:
        flag = f"--{dest.replace('_', '-')}" if dest else ""
        super().__init__(detail if not flag or detail.startswith(flag) else f"{flag}: {detail}", dest)
        self.dest, self.detail = dest, detail


@dataclass(frozen=True)
class Settings:
    """What the daemon's flags say, checked: where to listen, the store's and the admission's sizing."""

    host: str
    port: int
    store: StoreConfig
    admission: AdmissionConfig
    advertise: str | None = None  # --advertise as given (HOST or HOST:PORT, checked)


# the fields of StoreConfig and AdmissionConfig that one flag sets (ConfigError.field -> dest)
_FIELD_FLAGS = {"mem_bytes": "mem", "disk_bytes": "disk_size", "max_value_bytes": "max_value",
                "read_buffer_bytes": "disk_read_budget",
                "max_connections": "max_connections", "meta_budget": "meta_budget",
                "handshake_timeout_s": "handshake_timeout", "frame_timeout_s": "frame_timeout",
                "progress_timeout_s": "progress_timeout"}
_DURATIONS = ("heartbeat", "fence_after", "outage_max", "lease", "frame_timeout", "handshake_timeout",
              "progress_timeout")
# No duration of the daemon's is sensibly longer than a day; a longer one is a typo (and a wait of
# 1e300 s raises OverflowError in the thread that waits).
MAX_DURATION_S = 86400.0


def fence_error(heartbeat_s: float, fence_after_s: float, down_after_s: float | None = None) -> tuple[str, str] | None:
    """(argparse dest, why) when the daemon's timing breaks what keeps a node cut off from the
    masters from serving keys that have moved (None: it does not): heartbeat rounds more often
    than --fence-after, and --fence-after plus a cut-off master leader's step-down
    (gcache.meta.raft.LEADER_FALLBACK_S) below the masters' --down-after, when that is known
    (``gcache config check`` on a file with both sections; the daemon does not know it)."""
    if not heartbeat_s < fence_after_s:
        return "heartbeat", (f"must be below --fence-after ({fence_after_s:g} s), or the node fences between "
                             f"heartbeat rounds (got {heartbeat_s:g} s)")
    if down_after_s is not None:
        from gcache.meta.raft import LEADER_FALLBACK_S

        if not fence_after_s + LEADER_FALLBACK_S < down_after_s:
            return "fence_after", (f"{fence_after_s:g} s + {LEADER_FALLBACK_S:g} s (a cut-off master leader's "
                                   f"step-down) must be below the masters' down_after ({down_after_s:g} s): else a "
                                   "node cut off from the masters serves on after its keys have moved")
    return None


def settings(args: argparse.Namespace) -> Settings:
    """Check every flag as the daemon does before it touches the system (no file, socket or
    memory yet) and build its configuration; FlagError naming the first flag at fault.

    ``gcache config check`` runs this on a file's [daemon] section, so it refuses what the
    daemon would refuse. Values from a config file did not pass argparse's types: the durations,
    port and count are checked here again."""

    def flag(dest: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except ValueError as exc:  # ConfigError is one
            raise FlagError(dest, str(exc)) from None

    host, port = flag("listen", lambda: split_host_port(args.listen, "--listen"))
    advertise = getattr(args, "advertise", None)  # (absent from an older config's namespace)
    if advertise is None and is_wildcard(host):
        raise FlagError("listen", f"--listen {args.listen!r} is a wildcard address (every interface), which no "
                                  "client or peer can dial: set --advertise HOST[:PORT] ([daemon] advertise) to "
                                  "the address they reach this daemon at")
    if advertise is not None:  # a port 0 listen: the port it binds is not known yet, any will do for the check
        flag("advertise", lambda: parse_advertise(advertise, port or 1))
    for dest in _DURATIONS:
        if err := argtypes.seconds_error(getattr(args, dest), minimum=MIN_LEASE_S if dest == "lease" else None,
                                         maximum=MAX_DURATION_S):
            raise FlagError(dest, err)
    if bad := fence_error(args.heartbeat, args.fence_after):
        raise FlagError(*bad)
    if args.metrics_port is not None and (err := argtypes.port_error(args.metrics_port)):
        raise FlagError("metrics_port", err)
    if args.metrics_port is not None and binds_clash(
            (host, port), (getattr(args, "metrics_host", "127.0.0.1"), args.metrics_port)):
        raise FlagError("metrics_port", f"{args.metrics_port} is also the --listen port ({args.listen}): give the "
                                        "metrics endpoint a port of its own")
    if err := argtypes.count_error(args.max_connections):
        raise FlagError("max_connections", err)
    mem = flag("mem", lambda: parse_size(args.mem))
    disk_bytes = flag("disk_size", lambda: parse_size(args.disk_size)) if args.disk else 0
    max_value = flag("max_value", lambda: parse_size(args.max_value))
    read_text = getattr(args, "disk_read_budget", None)  # (absent from an older config's namespace)
    read_budget = flag("disk_read_budget", lambda: parse_size(read_text)) if read_text is not None else None
    meta_budget = flag("meta_budget", lambda: parse_size(args.meta_budget))
    pools = flag("pool_budget", lambda: tuple(PoolBudget.parse(spec, mem) for spec in args.pool_budget))
    flag("pool_budget", lambda: PoolBudgets(pools, mem))  # they add up to at most the arena (as the Store checks)
    eviction = flag("eviction", lambda: EvictionConfig.parse(args.eviction))
    try:
        store = StoreConfig(mem_bytes=mem, disk_dir=args.disk, disk_bytes=disk_bytes, max_value_bytes=max_value,
                            pretouch=not args.no_pretouch, pool_budgets=pools, eviction=eviction,
                            read_buffer_bytes=read_budget)
        admission = AdmissionConfig(
            max_connections=args.max_connections,
            fd_headroom=64 + (store.disk_bytes // store.segment_bytes + 1 if store.disk_dir else 0),
            meta_budget=meta_budget, handshake_timeout_s=args.handshake_timeout, frame_timeout_s=args.frame_timeout,
            progress_timeout_s=args.progress_timeout)
    except ConfigError as exc:
        raise FlagError(_FIELD_FLAGS.get(exc.field or ""), str(exc)) from None
    return Settings(host, port, store, admission, advertise)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s gcached[%(process)d] %(levelname)s %(name)s: %(message)s")
    try:
        s = settings(args)
        host, port, config, admission = s.host, s.port, s.store, s.admission
        token = load_token(args.token_file)
        store = Store(config)
        server = DataServer(store, host, port, node_id=args.node_id,
                            max_payload=max(config.max_value_bytes * 64, 1 << 30), token=token, admission=admission,
                            advertise=s.advertise)
        agent = None
        if args.masters:
            agent = Agent(MasterClient(args.masters, token), server.node_id, server.address,
                          config.mem_bytes + config.disk_bytes, store, token, ClientPut(token, sender=server.node_id),
                          heartbeat_s=args.heartbeat, fence_after_s=args.fence_after,
                          outage_max_s=args.outage_max)
            server.ctx.agent = agent  # the local server shares this context
        local = None
        if not args.no_local:
            local = LocalServer(server.ctx, server.address, server.admission, args.lease)
        if args.ucx:
            from gcache.server import ucx_op
            from gcache.transport import ucx

            ok, why = ucx.available()
            if not ok:
                raise ConfigError(f"--ucx: {why}")
            ucx_op.install(server.ctx, server.host)
        metrics = None
        if args.metrics_port is not None:
            from gcache.ops.health import serve_daemon
            from gcache.server.metrics import RequestMetrics

            ctx = server.ctx
            metrics = RequestMetrics(lambda: {**store.stats(), **ctx.counters()})
            serve_daemon(metrics, server, store, agent, args.metrics_port, getattr(args, "metrics_host", "127.0.0.1"))
            server.ctx.metrics = metrics
    except (ConfigError, OSError) as exc:
        print(f"gcache daemon: {exc}", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    server.start()
    if local is not None:
        local.start()
    if agent is not None:
        agent.start()
        deadline = time.monotonic() + 30
        while not agent.wait_registered(0.1) and not stop.is_set():  # SIGTERM still stops it meanwhile
            if time.monotonic() >= deadline:
                print("gcache daemon: could not register with any master within 30s", file=sys.stderr)
                break
        if not agent.wait_registered(0):
            agent.stop()
            if metrics is not None:
                metrics.stop()
            server.stop()
            store.close()
            return 0 if stop.is_set() else 3
    line = f"gcached listening on {server.address} node={server.node_id} mem={config.mem_bytes}"
    if server.bound != server.address:
        line = line.replace(server.address, f"{server.bound} (advertised as {server.address})", 1)
    if config.disk_dir:
        line += f" disk={config.disk_dir} ({len(store.nvme or [])} keys recovered)"
    print(line, flush=True)
    if metrics is not None:
        print(f"gcached metrics on http://{metrics.address}/metrics", flush=True)
        if args.ready_file:  # before the ready file, so whoever sees that one finds this one
            write_ready(args.ready_file + ".metrics", metrics.address)
    if args.ready_file:
        write_ready(args.ready_file, server.address)
    wait_for_stop(stop)
    log.info("stopping")
    if agent is not None:
        agent.stop()
    if local is not None:
        local.stop()
    server.stop()
    if metrics is not None:
        metrics.stop()
    store.close()
    return 0
