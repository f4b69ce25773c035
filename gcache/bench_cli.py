"""``gcache bench`` argument parsing (the benchmark itself lives in gcache.bench)."""

from __future__ import annotations

import argparse


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="throughput/latency benchmark against a local (or given) cluster, "
                                     "with the raw-socket ceiling measured in the same run")
    b.add_argument("--nodes", default="3",
                   help="number of local daemons to start (default %(default)s), or HOST:PORT,... of a running cluster")
    b.add_argument("--mem", default="1GiB", help="RAM arena per local daemon (default %(default)s)")
    b.add_argument("--sizes", default="64KiB,1MiB,4MiB", help="value sizes (default %(default)s)")
    b.add_argument("--batch", type=int, default=16, help="keys per batch (default %(default)s)")
    b.add_argument("--threads", default="1,4", help="client thread counts (default %(default)s)")
    b.add_argument("--seconds", type=float, default=1.5, help="time per measurement (default %(default)s)")
    b.add_argument("--json", default=None, metavar="PATH", help="also write the records as JSON here")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(fn=_run)


def _run(args: argparse.Namespace) -> int:
    from gcache.bench.throughput import run_cli

    return run_cli(args)
