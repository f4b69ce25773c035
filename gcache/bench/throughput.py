"""``gcache bench throughput``: gcache beside its ceilings and its peers, in one run.

For every configuration (op, value size, batch, threads) the systems are measured back to back
(ceilings, gcache per transport, Redis, Mooncake Store), so slow drift of a shared machine
hits them all alike; each figure is then divided by the ceiling and by every other system's
figure for the same configuration. A transport or peer that cannot run here is skipped with
the reason and how to install it; it never fails the run.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace

from gcache.bench.driver import BenchError
from gcache.bench.records import Record, write_json
from gcache.bench.targets import (
    OPS,
    TRANSPORTS,
    Memcpy,
    Socket,
    Target,
    UcxRaw,
    Unavailable,
    gcache_transport,
)
from gcache.cluster import LocalCluster
from gcache.sizes import format_size, parse_size

PEERS = ("redis", "mooncake")
CEILINGS = ("socket", "memcpy")
RAW = (*CEILINGS, "ucx-raw")  # ceilings: no peer ratios to or from them


@dataclass(frozen=True)
class Profile:
    """What to measure. ``seconds`` is per figure; the whole run takes about
    len(ops) * len(sizes) * len(batches) * len(threads) * (systems + ceilings) * seconds."""

    sizes: tuple[int, ...]
    batches: tuple[int, ...] = (16,)
    threads: tuple[int, ...] = (1,)
    ops: tuple[str, ...] = ("put", "get")
    seconds: float = 1.0

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError("value sizes must be >= 1 byte")
        if min(self.batches) < 1 or min(self.threads) < 1 or self.seconds <= 0:
            raise ValueError("batch, threads and seconds must be positive")
        bad = [op for op in self.ops if op not in OPS]
        if bad:
            raise ValueError(f"unknown ops {bad} (known: {', '.join(OPS)})")

    def configs(self) -> list[tuple[str, int, int, int]]:
        return [(op, s, b, t) for s in self.sizes for b in self.batches for t in self.threads for op in self.ops]


QUICK = Profile(sizes=(64 << 10, 1 << 20, 4 << 20), ops=("put", "get"), seconds=0.4)
FULL = Profile(sizes=(4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20), threads=(1, 4),
               ops=("put", "get", "exists"), seconds=1.0)


def make_peer(name: str, mem_budget: int) -> Target | Unavailable:
    if name == "redis":
        from gcache.bench.redis_peer import make_redis_peer

        return make_redis_peer(mem_budget)
    if name == "mooncake":
        from gcache.bench.mooncake_peer import make_mooncake_peer

        return make_mooncake_peer(mem_budget)
    return Unavailable(name, f"unknown peer (known: {', '.join(PEERS)})")


def attach_ratios(records: list[Record]) -> list[Record]:
    """Fill ceiling_gbps/ratio (socket for TCP, memcpy for the local path) and ``ratios``:
    this figure over every other system's figure for the same configuration (GB/s; keys/s
    for exists)."""
    by_key: dict[tuple, dict[str, Record]] = {}
    for r in records:
        name = r.system if r.system != "gcache" or r.transport == "tcp" else f"gcache/{r.transport}"
        by_key.setdefault(r.key, {})[name] = r
    socket_by = {(r.op, r.value_bytes, r.batch): r for r in records if r.system == "socket"}
    ucx_by = {(r.op, r.value_bytes, r.batch): r for r in records if r.system == "ucx-raw"}
    out = []
    for r in records:
        peers = by_key[r.key]
        carrier = r.transport.split("-")[0]
        ceil = (socket_by if carrier == "tcp" else ucx_by).get((r.op, r.value_bytes, r.batch)) \
            if carrier in ("tcp", "ucx") else peers.get("memcpy")
        ceiling = ceil.gbps if ceil is not None else 0.0
        metric = (lambda x: x.ops_per_s) if r.op == "exists" else (lambda x: x.gbps)
        mine = metric(r)
        ratios = {name: round(mine / metric(p), 4) for name, p in peers.items()
                  if p is not r and metric(p) > 0 and name not in RAW and r.system not in RAW}
        out.append(replace(r, ceiling_gbps=ceiling, ratio=round(r.gbps / ceiling, 4) if ceiling else 0.0,
                           ratios=ratios))
    return out


def run_throughput(addresses: list[str], profile: Profile, mem_budget: int, transports: tuple[str, ...] = ("tcp",),
                   peers: tuple[str, ...] = PEERS, ceilings: tuple[str, ...] = CEILINGS,
                   progress: bool = True, say=print, procs: int = 1) -> list[Record]:
    """Measure every configuration of ``profile`` on every available system; returns records
    with ratios attached. Unavailable transports/peers are reported through ``say``."""
    from tqdm import tqdm

    configs = profile.configs()
    systems: list[Target] = []
    try:
        max_bytes = max(profile.sizes) * max(profile.batches)
        if "socket" in ceilings:
            systems.append(Socket(max_bytes))
        if "memcpy" in ceilings:
            systems.append(Memcpy(mem_budget))
        if "ucx" in transports and "socket" in ceilings:  # gcache over UCX beside raw UCX
            try:
                systems.append(UcxRaw(max_bytes))
            except BenchError as exc:
                say(f"skipping the raw UCX ceiling: {exc}")
        for name in transports:
            t = gcache_transport(name, addresses, mem_budget)
            if isinstance(t, Unavailable):
                say(f"skipping gcache over {name}: {t.reason}")
            else:
                systems.append(t)
                if procs > 1 and name in ("tcp", "local"):  # the same client in N processes at once
                    from gcache.bench.procs import GcacheProcs

                    systems.append(GcacheProcs(name, procs, addresses, mem_budget))
        for name in peers:
            if name:
                p = make_peer(name, mem_budget)
                if isinstance(p, Unavailable):
                    say(f"skipping peer {name}: {p.reason}")
                else:
                    systems.append(p)
        todo = [(c, s) for c in configs for s in systems if applies(s, c, min(profile.threads))]
        records = []
        with tqdm(total=len(todo), desc="bench throughput", disable=not progress, leave=False) as bar:
            for (op, size, batch, threads), s in todo:
                bar.set_postfix_str(f"{s.system} {op} {format_size(size)} x{batch} t{threads}")
                try:
                    records.append(s.measure(op, size, batch, threads, profile.seconds))
                except BenchError as exc:
                    say(f"{s.system} {op} {format_size(size)}: not measured: {exc}")
                bar.update()
        return attach_ratios(records)
    finally:
        for s in systems:
            s.close()


def applies(s: Target, config: tuple[str, int, int, int], socket_threads: int) -> bool:
    """Ceilings move bytes, so they have no exists figure; the socket ceiling is one stream,
    measured once per (op, size, batch), at the smallest thread count."""
    op, _, _, threads = config
    if s.system in ("socket", "memcpy", "ucx-raw"):
        return op != "exists" and (s.system == "memcpy" or threads == socket_threads)
    return True


def format_table(records: list[Record]) -> str:
    """Every figure beside its ratio to the ceiling and to each peer."""
    names = sorted({n for r in records for n in r.ratios})
    head = (f"{'system':<12} {'op':<6} {'value':>7} {'batch':>5} {'thr':>3} {'GB/s':>7} {'keys/s':>9} "
            f"{'p50 ms':>8} {'p99 ms':>8} {'p999 ms':>8} {'ceiling':>7} {'ratio':>6} "
            + " ".join(f"{'vs ' + n:>12}" for n in names))
    lines = [head, "-" * len(head)]
    for r in records:
        sysname = r.system if r.system != "gcache" or r.transport == "tcp" else f"gcache/{r.transport}"
        vs = " ".join(f"{r.ratios[n]:>12.2f}" if n in r.ratios else f"{'':>12}" for n in names)
        lines.append(f"{sysname:<12} {r.op:<6} {format_size(r.value_bytes):>7} {r.batch:>5} {r.threads:>3} "
                     f"{r.gbps:>7.2f} {r.ops_per_s:>9.0f} {r.p50_ms:>8.3f} {r.p99_ms:>8.3f} {r.p999_ms:>8.3f} "
                     f"{r.ceiling_gbps:>7.2f} {r.ratio:>6.2f} {vs}".rstrip())
    return "\n".join(lines)


def format_markdown(records: list[Record]) -> str:
    names = sorted({n for r in records for n in r.ratios})
    cols = ["system", "op", "value", "batch", "threads", "GB/s", "keys/s", "p50 ms", "p99 ms", "p999 ms",
            "ceiling GB/s", "ratio", *[f"vs {n}" for n in names]]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        sysname = r.system if r.system != "gcache" or r.transport == "tcp" else f"gcache/{r.transport}"
        cells = [sysname, r.op, format_size(r.value_bytes), str(r.batch), str(r.threads), f"{r.gbps:.2f}",
                 f"{r.ops_per_s:.0f}", f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}", f"{r.p999_ms:.3f}",
                 f"{r.ceiling_gbps:.2f}", f"{r.ratio:.2f}", *[f"{r.ratios[n]:.2f}" if n in r.ratios else ""
                                                               for n in names]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _list(raw: str, conv=str) -> tuple:
    return tuple(conv(x) for x in raw.split(",") if x and x != "none")


def profile_from_args(args: argparse.Namespace) -> Profile:
    base = QUICK if args.quick else FULL
    try:
        return Profile(
            sizes=_list(args.sizes, parse_size) if args.sizes else base.sizes,
            batches=_list(args.batch, int) if args.batch else base.batches,
            threads=_list(args.threads, int) if args.threads else base.threads,
            ops=_list(args.ops) if args.ops else base.ops,
            seconds=args.seconds if args.seconds else base.seconds)
    except ValueError as exc:
        raise SystemExit(f"gcache bench throughput: {exc}") from None


def run_cli(args: argparse.Namespace) -> int:
    profile = profile_from_args(args)
    transports = _list(args.transport)
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        raise SystemExit(f"gcache bench throughput: unknown transport {unknown} (known: {', '.join(TRANSPORTS)})")
    cluster = None
    if args.nodes.isdigit() and int(args.nodes) < 1:
        raise SystemExit("gcache bench throughput: --nodes takes a number of local daemons >= 1, or HOST:PORT,...")
    if args.nodes.isdigit():
        extra = ["--ucx"] if "ucx" in transports else []  # daemons serve UCX only when asked
        cluster = LocalCluster(nodes=int(args.nodes), mem=args.mem, extra_args=extra).start()
        addresses, mem_budget = cluster.addresses, int(args.nodes) * parse_size(args.mem)
        print(f"local cluster: {len(addresses)} daemons, {args.mem} RAM each: {', '.join(addresses)}")
    else:
        addresses, mem_budget = [a for a in args.nodes.split(",") if a], 1 << 30
    try:
        if args.procs < 1:
            raise SystemExit("gcache bench throughput: --procs must be >= 1")
        records = run_throughput(addresses, profile, mem_budget, transports, _list(args.peers),
                                 _list(args.ceilings), progress=not args.no_progress, procs=args.procs)
    finally:
        if cluster is not None:
            cluster.stop()
    print(format_table(records))
    out_dir = args.out or (os.path.dirname(os.path.abspath(args.json)) if args.json else "bench/results")
    json_path = args.json or os.path.join(out_dir, "throughput.json")
    write_json(json_path, "throughput", [r.to_json() for r in records],
               profile={"sizes": profile.sizes, "batches": profile.batches, "threads": profile.threads,
                        "ops": profile.ops, "seconds": profile.seconds},
               cluster={"nodes": len(addresses), "mem_budget": mem_budget})
    md = os.path.join(out_dir, "throughput.md")
    with open(md, "w") as f:
        f.write(format_markdown(records))
    print(f"wrote {json_path}, {md}")
    if not args.no_plots:
        from gcache.bench.plots import plot_throughput

        for path in plot_throughput(records, out_dir):
            print(f"wrote {path}")
    return 0
