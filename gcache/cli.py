"""The ``gcache`` command: daemon, local cluster, data commands and the benchmark."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from gcache.errors import GCacheError

DEFAULT_NODES_HELP = "comma-separated HOST:PORT of the daemons (or env GCACHE_NODES)"


def _nodes(args: argparse.Namespace) -> list[str]:
    import os

    raw = args.nodes or os.environ.get("GCACHE_NODES", "")
    nodes = [n for n in raw.split(",") if n.strip()]
    if not nodes:
        raise SystemExit("gcache: give --nodes HOST:PORT[,HOST:PORT...] or set GCACHE_NODES")
    return nodes


def _client(args: argparse.Namespace):
    from gcache.client import Client

    return Client(_nodes(args), namespace=args.namespace, timeout_s=args.timeout)


def cmd_up(args: argparse.Namespace) -> int:
    from gcache.cluster import LocalCluster

    cluster = LocalCluster(nodes=args.nodes_count, mem=args.mem, disk=args.disk_size if args.disk else None,
                           root=args.dir)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start()
    except GCacheError as exc:
        cluster.stop()
        print(f"gcache up: {exc}", file=sys.stderr)
        return 1
    print(f"gcache: {len(cluster.daemons)} daemons up (data in {cluster.root}); Ctrl-C stops them")
    for d in cluster.daemons:
        print(f"  {d.node_id}  {d.address}  pid {d.pid}")
    print(f"export GCACHE_NODES={','.join(cluster.addresses)}", flush=True)
    try:
        while not stop.wait(0.5):
            dead = [d for d in cluster.daemons if d.proc is not None and d.proc.poll() is not None]
            if dead:
                print(f"gcache up: daemon {dead[0].node_id} exited; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        cluster.stop()
        print("gcache: cluster stopped")


def cmd_put(args: argparse.Namespace) -> int:
    data = open(args.file, "rb").read() if args.file else (args.value or "").encode()
    with _client(args) as c:
        st = c.put_one(args.key, data, ttl_s=args.ttl)
    print(st.name)
    return 0 if st.name == "OK" else 1


def cmd_get(args: argparse.Namespace) -> int:
    with _client(args) as c:
        value = c.get_one(args.key)
    if value is None:
        print("NOT_FOUND", file=sys.stderr)
        return 1
    if args.out:
        with open(args.out, "wb") as f:
            f.write(value)
    else:
        sys.stdout.buffer.write(bytes(value) + b"\n")
    return 0


def cmd_exists(args: argparse.Namespace) -> int:
    with _client(args) as c:
        found = c.exists(args.keys)
    for k, f in zip(args.keys, found):
        print(f"{k}\t{'yes' if f else 'no'}")
    return 0 if all(found) else 1


def cmd_stats(args: argparse.Namespace) -> int:
    from gcache.sizes import format_size

    with _client(args) as c:
        stats = c.stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print(f"{'node':<22} {'ram used':>10} {'ram keys':>9} {'disk used':>10} {'disk keys':>9} "
          f"{'hits ram':>9} {'hits disk':>9} {'misses':>8} {'evicted':>8}")
    for node, s in stats.items():
        if "error" in s:
            print(f"{node:<22} unreachable: {s['error']}")
            continue
        print(f"{node:<22} {format_size(s.get('ram_used', 0)):>10} {s.get('ram_keys', 0):>9} "
              f"{format_size(s.get('disk_used', 0)):>10} {s.get('disk_keys', 0):>9} {s.get('hits_ram', 0):>9} "
              f"{s.get('hits_nvme', 0):>9} {s.get('misses', 0):>8} {s.get('evictions', 0):>8}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from gcache.server import daemon

    p = argparse.ArgumentParser(prog="gcache", description="gcache: a distributed KV-cache store for LLM inference.")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("daemon", help="run one gcached daemon (data plane over TCP)")
    daemon.add_arguments(d)
    d.set_defaults(fn=daemon.run)

    u = sub.add_parser("up", help="start a local cluster of daemons as real processes; Ctrl-C stops them")
    u.add_argument("--nodes", dest="nodes_count", type=int, default=3, help="number of daemons (default %(default)s)")
    u.add_argument("--mem", default="256MiB", help="RAM arena per daemon (default %(default)s)")
    u.add_argument("--disk", action="store_true", help="give each daemon an NVMe tier under --dir")
    u.add_argument("--disk-size", default="1GiB", help="NVMe budget per daemon with --disk (default %(default)s)")
    u.add_argument("--dir", default=None, help="directory for daemon data and logs (default: a temporary one)")
    u.set_defaults(fn=cmd_up)

    def data_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_)
        s.add_argument("--nodes", default=None, help=DEFAULT_NODES_HELP)
        s.add_argument("--namespace", "-n", default="default", help="namespace (tenant/model; default %(default)s)")
        s.add_argument("--timeout", type=float, default=2.0, help="call timeout in seconds (default %(default)s)")
        return s

    s = data_cmd("put", "store one value")
    s.add_argument("key")
    s.add_argument("value", nargs="?", help="the value as text (or --file)")
    s.add_argument("--file", help="read the value from this file")
    s.add_argument("--ttl", type=float, default=0.0, help="expire after this many seconds (0 = never)")
    s.set_defaults(fn=cmd_put)
    s = data_cmd("get", "read one value (to stdout or --out)")
    s.add_argument("key")
    s.add_argument("--out", help="write the value to this file")
    s.set_defaults(fn=cmd_get)
    s = data_cmd("exists", "check keys")
    s.add_argument("keys", nargs="+")
    s.set_defaults(fn=cmd_exists)
    s = data_cmd("stats", "per-node table of memory, disk, hits and evictions")
    s.add_argument("--json", action="store_true", help="print raw JSON")
    s.set_defaults(fn=cmd_stats)

    from gcache.bench_cli import add_bench_parser

    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except GCacheError as exc:
        print(f"gcache {args.cmd}: {exc}", file=sys.stderr)
        return 1
