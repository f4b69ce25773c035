"""``gcache master``: one master of the Raft-replicated membership group (gcache.meta.master), its
health endpoints (gcache.ops.health) and its process lifetime: the master's composition root, as
gcache.daemon is the daemon's."""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import signal
import sys

from gcache import argtypes
from gcache.errors import ConfigError
from gcache.meta import rpc
from gcache.meta.core import log_without_blocking
from gcache.meta.fields import node_error
from gcache.meta.master import Master, MasterConfig
from gcache.net.address import binds_clash, split_host_port
from gcache.process import write_ready


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
    p.add_argument("--suspect-after", type=argtypes.seconds, default=2.0,
                   help="heartbeat silence before SUSPECT (s)")
    p.add_argument("--down-after", type=argtypes.seconds, default=3.0,
                   help="heartbeat silence before DOWN (s)")
    p.add_argument("--ready-file", default=None, help="write the gRPC HOST:PORT here once serving")
    p.add_argument("--log-level", type=argtypes.log_level, default="INFO",
                   help="logging level (default %(default)s)")


# MasterConfig's fields that one flag sets (ConfigError.field -> argparse dest), where they differ
_FIELD_FLAGS = {"token": "token_file", "suspect_after_s": "suspect_after", "down_after_s": "down_after"}


def master_config(args: argparse.Namespace, token: str) -> MasterConfig:
    """The master's configuration from its flags, checked as the master checks it before it
    starts anything; ConfigError whose ``field`` is the argparse dest of the flag at fault.
    ``gcache config check`` runs it on a file's [master] section."""
    if args.id is not None and (err := node_error(args.id, "--id")):
        raise ConfigError(err, "id")  # it names the master in logs and the Raft status
    try:
        config = MasterConfig(listen=args.listen, raft=args.raft,
                              peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()), token=token,
                              suspect_after_s=args.suspect_after, down_after_s=args.down_after)
    except ConfigError as exc:
        raise ConfigError(str(exc), _FIELD_FLAGS.get(exc.field or "", exc.field)) from None
    port: int | None = getattr(args, "metrics_port", None)
    host: str = getattr(args, "metrics_host", "127.0.0.1")
    for flag, address in (("--listen", config.listen), ("--raft", config.raft)):
        if port is not None and binds_clash((host, port), split_host_port(address)):
            raise ConfigError(f"--metrics-port {port} is also the {flag} port ({address}): give the metrics "
                              "endpoint a port of its own", "metrics_port")
    return config


def run(args: argparse.Namespace) -> int:
    listener = log_without_blocking(args.log_level, f"%(asctime)s master[{args.id or args.raft}] %(levelname)s "
                                                    "%(message)s")
    try:
        return _run(args)
    finally:
        listener.stop()


def _run(args: argparse.Namespace) -> int:
    try:
        config = master_config(args, rpc.load_token(args.token_file) or "")
    except ConfigError as exc:
        print(f"gcache master: {exc}", file=sys.stderr)
        return 2
    raise_fd_limit()
    return asyncio.run(_serve(config, args))


async def _serve(config: MasterConfig, args: argparse.Namespace) -> int:
    ready_file: str | None = args.ready_file
    metrics_port: int | None = getattr(args, "metrics_port", None)
    metrics_host: str = getattr(args, "metrics_host", "127.0.0.1")
    master = Master(config, args.id or args.raft, args.log_level)
    try:
        await master.start()
    except (ConfigError, OSError) as exc:
        print(f"gcache master: {exc}", file=sys.stderr)
        await master.stop()
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.create_task(_relay(master.gone, stop))
    # Objects from start-up are never garbage; new ones are collected in larger, rarer young
    # generations (short pauses for the streams).
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    print(f"gcache master listening on {master.address} raft={config.raft}", flush=True)
    health = None
    if metrics_port is not None:  # /metrics, /healthz, /readyz (gcache.ops.health)
        from gcache.ops.health import serve_master

        try:
            # in a thread: registering the collector reads the core through the loop
            health = await loop.run_in_executor(None, serve_master, master, metrics_port, metrics_host)
        except OSError as exc:
            print(f"gcache master: metrics port: {exc}", file=sys.stderr)
            await master.stop()
            return 2
        print(f"gcache master metrics on http://{health.address}/metrics", flush=True)
        if ready_file:
            write_ready(ready_file + ".metrics", health.address)
    if ready_file:
        write_ready(ready_file, master.address)
    await stop.wait()
    if health is not None:
        await loop.run_in_executor(None, health.stop)
    await master.stop()
    return 1 if master.gone.is_set() else 0


async def _relay(src: asyncio.Event, dst: asyncio.Event) -> None:
    await src.wait()
    dst.set()
