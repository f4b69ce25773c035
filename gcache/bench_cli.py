"""``gcache bench`` argument parsing (the benchmarks themselves live in gcache.bench).

``gcache bench`` with no subcommand runs ``throughput``, so the core issue's command lines
(``gcache bench --nodes 3 --sizes 64KiB``) keep working.
"""

from __future__ import annotations

import argparse

from gcache.tier.eviction import EvictionKind


def _throughput_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--nodes", default="3",
                   help="number of local daemons to start (default %(default)s), or HOST:PORT,... of a running cluster")
    b.add_argument("--mem", default="1GiB", help="RAM arena per local daemon (default %(default)s)")
    b.add_argument("--quick", action="store_true",
                   help="the one-minute profile: 64KiB,1MiB,4MiB x batch 16, one thread, put/get, 0.4 s a figure")
    b.add_argument("--sizes", default=None, help="value sizes (default 4KiB..16MiB; --quick: 64KiB,1MiB,4MiB)")
    b.add_argument("--batch", default=None, help="keys per batch, comma-separated (default 16)")
    b.add_argument("--threads", default=None, help="client thread counts (default 1,4; --quick: 1)")
    b.add_argument("--procs", type=int, default=1,
                   help="also measure gcache (tcp, local) with this many client processes at once, each "
                        "running --threads threads (default 1: no extra figures)")
    b.add_argument("--ops", default=None, help="put,get,exists (default all three; --quick: put,get)")
    b.add_argument("--seconds", type=float, default=None, help="time per figure (default 1.0; --quick: 0.4)")
    b.add_argument("--transport", default="tcp",
                   help="gcache transports: tcp,local,ucx; unavailable ones are skipped with the reason "
                        "(default %(default)s)")
    b.add_argument("--peers", default="redis,mooncake",
                   help="peers measured in the same run, or 'none' (default %(default)s; missing ones are "
                        "skipped; `make bench-peers` installs them)")
    b.add_argument("--ceilings", default="socket,memcpy", help="ceilings to measure (default %(default)s)")
    b.add_argument("--out", default=None, metavar="DIR",
                   help="directory for throughput.json/.md and plots (default: beside --json, else bench/results)")
    b.add_argument("--json", default=None, metavar="PATH", help="write the JSON records here")
    b.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")


def _hitrate_args(h: argparse.ArgumentParser) -> None:
    h.add_argument("--trace", default=None,
                   help="Mooncake-format JSONL trace (default ../shared/data/conversation_trace.jsonl)")
    h.add_argument("--limit", type=int, default=0, help="replay only the first N requests (0 = all)")
    h.add_argument("--nodes", type=int, default=3, help="local daemons (default %(default)s)")
    h.add_argument("--page-bytes", default="4KiB",
                   help="bytes of one 512-token block's page, scaled down from the model (default %(default)s)")
    h.add_argument("--capacities", default="0.05,0.1,0.25,0.5,1.0",
                   help="cluster RAM as fractions of the trace's working set (default %(default)s)")
    h.add_argument("--tiers", default="ram,nvme",
                   help="'ram' (RAM only) and/or 'nvme' (RAM + an NVMe tier of --disk-capacity; with both, "
                        "nvme only below capacity 1.0) (default %(default)s)")
    h.add_argument("--disk-capacity", type=float, default=1.25,
                   help="the NVMe tier as a fraction of the working set (default %(default)s)")
    h.add_argument("--policy", default=",".join(k.value for k in EvictionKind),
                   help="eviction policies to compare, comma-separated (default %(default)s); each is run beside "
                        "the trace maximum, a global LRU cache and the offline optimum (Belady)")
    h.add_argument("--engine", default="sim,daemon",
                   help="'sim' (the policy objects simulated, seconds a point) and/or 'daemon' (a real local "
                        "cluster per point and policy) (default %(default)s)")
    h.add_argument("--quick", action="store_true", help="2,000 requests, capacities 0.5,1.25, RAM only")
    h.add_argument("--out", default="bench/results", metavar="DIR",
                   help="directory for hitrate.json/.md and plots (default %(default)s)")
    h.add_argument("--json", default=None, metavar="PATH", help="write the JSON records here")
    h.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    h.add_argument("--no-progress", action="store_true", help="no progress bar")


def _embedding_args(e: argparse.ArgumentParser) -> None:
    e.add_argument("--nodes", default="1", help="local daemons to start (default %(default)s: one, on this host, "
                                                "so the shared-memory path is there), or HOST:PORT,...")
    e.add_argument("--tokens", default="576,1152,2304", help="tokens per embedding (default %(default)s)")
    e.add_argument("--hidden", type=int, default=4096, help="hidden size, bf16 values (default %(default)s)")
    e.add_argument("--batch", type=int, default=4, help="embeddings per call (default %(default)s)")
    e.add_argument("--runs", type=int, default=2, help="page runs each embedding is split into (default %(default)s)")
    e.add_argument("--seconds", type=float, default=4.0,
                   help="time per figure, store and raw calls alternating (default %(default)s)")
    e.add_argument("--transport", default="local,tcp", help="local,tcp (default %(default)s)")
    e.add_argument("--ops", default="get,put", help="get,put (default %(default)s)")
    e.add_argument("--out", default="bench/results", metavar="DIR", help="directory for embedding.json/.md")
    e.add_argument("--json", default=None, metavar="PATH", help="write the JSON records here")
    e.add_argument("--no-progress", action="store_true", help="no per-figure lines")


def _soak_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--minutes", type=float, default=5.0, help="how long to run (default %(default)s)")
    s.add_argument("--seconds", type=float, default=None, help="how long to run, in seconds (overrides --minutes)")
    s.add_argument("--nodes", type=int, default=3, help="local daemons (default %(default)s)")
    s.add_argument("--mem", default="2MiB", help="RAM arena per daemon (default %(default)s: small, so values "
                                                 "are evicted and demoted all the time)")
    s.add_argument("--disk", default="32MiB", help="disk tier per daemon (default %(default)s)")
    s.add_argument("--keys", type=int, default=2000, help="distinct keys (default %(default)s)")
    s.add_argument("--threads", type=int, default=4,
                   help="client threads, alternately TCP and local shared memory (default %(default)s)")
    s.add_argument("--no-kill", action="store_true", help="do not kill -9 and restart a daemon halfway")
    s.add_argument("--seed", type=int, default=1, help="random seed (default %(default)s)")
    s.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON here")


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks: throughput/latency beside ceilings and peers (default), "
                                     "hit-rate replay of a trace")
    _throughput_args(b)
    b.set_defaults(fn=_run_throughput)
    bsub = b.add_subparsers(dest="bench_cmd", metavar="{throughput,hitrate,embedding,soak,control-plane}")
    t = bsub.add_parser("throughput", help="GB/s, keys/s and p50/p99/p999 of gcache, Redis, Mooncake Store, "
                                           "beside the memcpy and raw-socket ceilings")
    _throughput_args(t)
    t.set_defaults(fn=_run_throughput)
    h = bsub.add_parser("hitrate", help="replay a Mooncake-format trace against a local cluster; token hit "
                                        "rate vs capacity, beside the trace's own maximum")
    _hitrate_args(h)
    h.set_defaults(fn=_run_hitrate)
    e = bsub.add_parser("embedding", help="multimodal embeddings through the SGLang embedding store beside the "
                                          "raw client moving the same bytes (needs sglang)")
    _embedding_args(e)
    e.set_defaults(fn=_run_embedding)
    s = bsub.add_parser("soak", help="mixed put/get/delete/overwrite on a local cluster with disks, a daemon "
                                     "killed and restarted halfway; counts wrong, stale and resurrected values "
                                     "(exit 1 if any)")
    _soak_args(s)
    s.set_defaults(fn=_run_soak)
    from gcache.bench import control_report

    c = bsub.add_parser("control-plane", help="real masters under simulated daemons and clients: bootstrap, "
                                              "propagation, heartbeats, false DOWN, leader failover")
    control_report.add_arguments(c)
    c.set_defaults(fn=control_report.run_cli)


def _run_throughput(args: argparse.Namespace) -> int:
    from gcache.bench.throughput import run_cli

    return run_cli(args)


def _run_hitrate(args: argparse.Namespace) -> int:
    from gcache.bench.hitrate import run_cli

    return run_cli(args)


def _run_embedding(args: argparse.Namespace) -> int:
    from gcache.bench.embedding import run_cli

    return run_cli(args)


def _run_soak(args: argparse.Namespace) -> int:
    from gcache.bench.soak import run_cli

    return run_cli(args)
