"""``gcache bench scaling``: the client thread / process curve of gcache (TCP) beside its peers.

For every (op, value size, batch, threads) the systems are measured back to back, as in
``gcache bench throughput``: gcache over TCP with one client process of ``threads`` threads,
the same in ``P`` processes at once (gcache.bench.procs), Redis likewise (one redis-server,
``P`` client processes, each on its own keys), and Mooncake Store (one process; its client runs
inside the peer's private network namespace, so it has no multi-process figure here).
Process figures add up (GB/s and keys/s are summed over the processes, latencies pooled); a
record's ``threads`` is per process, its ``transport`` says ``tcp-<P>p``.

The result is the curve: a table with one row per (op, size) and one column per system and
client count, and ``scaling.png``, log-scale on both axes (GB/s for values >= 64 KiB, keys/s
below and for exists), one panel per (op, size).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any

from gcache import argtypes
from gcache.bench.driver import BenchError
from gcache.bench.procs import GcacheProcs, combine, run_workers, wait_go
from gcache.bench.records import Record, write_json
from gcache.bench.targets import GcacheTcp, Target, Unavailable
from gcache.sizes import format_size, parse_size

BYTES_FROM = 64 << 10  # from this value size on, the curve is in GB/s; below, keys/s
COLORS = {"gcache": "C0", "redis": "C3", "mooncake": "C2"}  # one colour a system; dashed: N processes


def name(r: Record) -> str:
    """``gcache``, ``gcache/tcp-2p``, ``redis``, ``redis/tcp-2p``, ``mooncake``."""
    return r.system if r.transport == "tcp" else f"{r.system}/{r.transport}"


def procs_of(r: Record) -> int:
    tail = r.transport.rsplit("-", 1)[-1]
    return int(tail[:-1]) if tail.endswith("p") and tail[:-1].isdigit() else 1


def metric(r: Record) -> float:
    """What the curve plots: GB/s for values >= 64 KiB, keys/s below and for exists."""
    return r.gbps if r.op != "exists" and r.value_bytes >= BYTES_FROM else r.ops_per_s


def _unit(op: str, size: int) -> str:
    return "GB/s" if op != "exists" and size >= BYTES_FROM else "keys/s"


def _fmt(v: float, unit: str) -> str:
    return f"{v:.2f}" if unit == "GB/s" else f"{v / 1000:.1f}k"


# -- Redis in N client processes ------------------------------------------------------------


def _redis_measure(port: int, prefix: str, mem_budget: int, op: str, size: int, batch: int, threads: int,
                   seconds: float, before_timing: Any = None) -> Record:
    """RedisPeer's measurement against a running server, on keys under ``prefix``."""
    import redis

    from gcache.bench.redis_peer import measure_redis

    clients = [redis.Redis(host="127.0.0.1", port=port, socket_timeout=60) for _ in range(threads)]
    try:
        return measure_redis(clients, prefix, mem_budget, op, size, batch, threads, seconds, before_timing)
    finally:
        for c in clients:
            c.close()


class RedisProcs(Target):
    """``procs`` redis-py client processes against one redis-server (the peer's)."""

    system = "redis"

    def __init__(self, procs: int, port: int, mem_budget: int) -> None:
        self.procs, self.port, self.mem_budget = procs, port, mem_budget
        self.transport = f"tcp-{procs}p"

    def measure(self, op: str, size: int, batch: int, threads: int, seconds: float) -> Record:
        cmds = [[sys.executable, "-m", "gcache.bench.scaling", "redis-worker", str(self.port),
                 str(self.mem_budget // self.procs), op, str(size), str(batch), str(threads), str(seconds), str(w)]
                for w in range(self.procs)]
        return combine(run_workers(cmds, seconds), self.transport)


# -- the run -------------------------------------------------------------------------------


def run_scaling(addresses: list[str], mem_budget: int, sizes: tuple[int, ...], batches: tuple[int, ...],
                threads: tuple[int, ...], procs: tuple[int, ...], ops: tuple[str, ...], seconds: float,
                peers: tuple[str, ...], say: Any = print) -> list[Record]:
    from gcache.bench.throughput import make_peer

    systems: list[Target] = []  # measured, in this order, for every configuration
    peer_objs: list[Target] = []  # peers started here (their servers serve the process figures too)
    try:
        if 1 in procs:
            systems.append(GcacheTcp(addresses, mem_budget))
        systems += [GcacheProcs("tcp", p, addresses, mem_budget) for p in procs if p > 1]
        for peer in peers:
            t = make_peer(peer, mem_budget)
            if isinstance(t, Unavailable):
                say(f"skipping peer {peer}: {t.reason}")
                continue
            peer_objs.append(t)
            if 1 in procs:
                systems.append(t)
            if peer == "redis":
                port = t.server.port  # type: ignore[attr-defined]
                systems += [RedisProcs(p, port, mem_budget) for p in procs if p > 1]
            elif any(p > 1 for p in procs):
                say(f"{peer}: one process only (no multi-process figures)")
        records = []
        for size in sizes:
            for batch in batches:
                for thr in threads:
                    for op in ops:
                        for s in systems:
                            try:
                                r = s.measure(op, size, batch, thr, seconds)
                            except BenchError as exc:
                                say(f"{s.system}/{s.transport} {op} {format_size(size)} t{thr}: not measured: {exc}")
                                continue
                            records.append(r)
                            say(f"{name(r):<16} {op:<6} {format_size(size):>7} x{batch} t{thr}: "
                                f"{_fmt(metric(r), _unit(op, size))} {_unit(op, size)}, p50 {r.p50_ms:.3f} ms")
        return records
    finally:
        for s in [*(x for x in systems if x not in peer_objs), *peer_objs]:  # each once
            s.close()


# -- the curve -----------------------------------------------------------------------------


def curve_table(records: list[Record]) -> str:
    """Markdown: one row per (op, size, batch, system), one column per (processes x threads)."""
    cols = sorted({(procs_of(r), r.threads) for r in records})
    head = ["op", "value", "batch", "system", "unit", *[f"{p}p x {t}t" for p, t in cols]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by: dict[tuple, dict[tuple[int, int], Record]] = {}
    for r in records:
        by.setdefault((r.op, r.value_bytes, r.batch, r.system), {})[(procs_of(r), r.threads)] = r
    order = {"put": 0, "get": 1, "exists": 2}
    for (op, size, batch, system), row in sorted(by.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 9),
                                                                             kv[0][2], kv[0][3])):
        unit = _unit(op, size)
        cells = [_fmt(metric(row[c]), unit) if c in row else "" for c in cols]
        lines.append("| " + " | ".join([op, format_size(size), str(batch), system, unit, *cells]) + " |")
    return "\n".join(lines) + "\n"


def plot_scaling(records: list[Record], out_dir: str) -> str | None:
    """scaling.png: per (op, size) panel, figure vs total client threads, log-log; solid one
    process, dashed several."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    panels = sorted({(r.value_bytes, r.op) for r in records}, key=lambda p: (p[0], {"put": 0, "get": 1}.get(p[1], 2)))
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    for ax, (size, op) in zip(axes.flat, panels):
        mine = [r for r in records if r.value_bytes == size and r.op == op]
        for n in sorted({name(r) for r in mine}):
            pts = sorted((procs_of(r) * r.threads, metric(r)) for r in mine if name(r) == n)
            system = n.split("/")[0]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=n,
                    color=COLORS.get(system), linestyle="--" if "/" in n else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        xs = sorted({procs_of(r) * r.threads for r in mine})
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("client threads in all (processes x threads)")
        ax.set_ylabel(_unit(op, size))
        ax.set_title(f"{op} {format_size(size)}, batch {mine[0].batch}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "scaling.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--nodes", default="3", help="local daemons to start (default %(default)s), or HOST:PORT,...")
    ap.add_argument("--mem", type=argtypes.size, default="512MiB", help="RAM arena per local daemon (default %(default)s)")
    ap.add_argument("--sizes", default="4KiB,1MiB", help="value sizes (default %(default)s)")
    ap.add_argument("--batch", default="16", help="keys per batch, comma-separated (default %(default)s)")
    ap.add_argument("--threads", default="1,2,4", help="client threads per process (default %(default)s)")
    ap.add_argument("--procs", default="1,2", help="client processes (default %(default)s)")
    ap.add_argument("--ops", default="put,get,exists", help="(default %(default)s)")
    ap.add_argument("--seconds", type=argtypes.seconds, default=1.0, help="time per figure (default %(default)s)")
    ap.add_argument("--peers", default="redis,mooncake", help="peers, or 'none' (default %(default)s)")
    ap.add_argument("--out", default="bench/results/scaling", metavar="DIR",
                    help="directory for scaling.json/.md/.png (default %(default)s)")
    ap.add_argument("--from-json", default=None, metavar="PATH",
                    help="measure nothing: redraw the table and plot from this scaling.json")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plot")


def _csv(raw: str, conv: Any = str) -> tuple:
    return tuple(conv(x) for x in raw.split(",") if x and x != "none")


def run_cli(args: argparse.Namespace) -> int:
    if args.from_json:
        with open(args.from_json) as f:
            records = [Record(**r) for r in json.load(f)["records"]]
    else:
        try:
            sizes, batches = _csv(args.sizes, parse_size), _csv(args.batch, int)
            threads, procs = _csv(args.threads, int), _csv(args.procs, int)
        except ValueError as exc:
            raise SystemExit(f"gcache bench scaling: {exc}") from None
        if not sizes or not batches or not threads or not procs or min((*batches, *threads, *procs)) < 1:
            raise SystemExit("gcache bench scaling: sizes, batch, threads and procs must be positive")
        cluster = None
        if args.nodes.isdigit():
            from gcache.cluster import LocalCluster

            cluster = LocalCluster(nodes=int(args.nodes), mem=args.mem).start()
            addresses, mem_budget = cluster.addresses, int(args.nodes) * parse_size(args.mem)
        else:
            addresses, mem_budget = [a for a in args.nodes.split(",") if a], 1 << 30
        load_before = os.getloadavg()
        try:
            records = run_scaling(addresses, mem_budget, sizes, batches, threads, procs, _csv(args.ops),
                                  args.seconds, _csv(args.peers))
        finally:
            if cluster is not None:
                cluster.stop()
        os.makedirs(args.out, exist_ok=True)
        write_json(os.path.join(args.out, "scaling.json"), "scaling", [r.to_json() for r in records],
                   profile={"sizes": sizes, "batches": batches, "threads": threads, "procs": procs,
                            "ops": _csv(args.ops), "seconds": args.seconds},
                   cluster={"nodes": len(addresses), "mem_budget": mem_budget},
                   load_avg={"before": load_before, "after": os.getloadavg()})
    table = curve_table(records)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scaling.md"), "w") as f:
        f.write(table)
    if not args.no_plots:
        path = plot_scaling(records, args.out)
        if path:
            print(f"wrote {path}")
    return 0


def _redis_worker(argv: list[str]) -> int:
    port, mem_budget, op, size, batch, threads, seconds, index = argv
    rec = _redis_measure(int(port), f"p{index}", int(mem_budget), op, int(size), int(batch), int(threads),
                         float(seconds), before_timing=wait_go)
    print(json.dumps(asdict(rec)), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["redis-worker"]:
        raise SystemExit(_redis_worker(sys.argv[2:]))
    raise SystemExit("usage: python -m gcache.bench.scaling redis-worker PORT MEM_BUDGET OP SIZE BATCH THREADS "
                     "SECONDS INDEX (run `gcache bench scaling` instead)")
