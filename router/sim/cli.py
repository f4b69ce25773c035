"""``gcache-router sim``: sweep policies x queue orders x configurations over a trace."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence

from gcache.mooncake_trace import DEFAULT_TRACE, load_trace
from router.config import DEFAULT_MAX_INFLIGHT, QueueConfig, QueueOrder
from router.policies import POLICIES
from router.sim import report
from router.sim.engine import SimConfig, simulate


def _csv(kind):
    def parse(s: str):
        try:
            return [kind(x) for x in s.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {s!r}") from None

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake-format JSONL trace (default: %(default)s)")
    p.add_argument("--limit", type=int, default=0,
                   help="replay only the first N requests of the trace (default 0: all)")
    p.add_argument("--workers", type=int, default=8, help="simulated workers (default: %(default)s)")
    p.add_argument("--cache-blocks", type=_csv(int), default=[8192],
                   help="per-worker prefix cache sizes in 512-token blocks, comma-separated (default: 8192)")
    p.add_argument("--speedups", type=_csv(float), default=[1.0],
                   help="replay speed factors; 4 = four times the trace's arrival rate (default: 1)")
    p.add_argument("--max-inflight", type=_csv(int), default=[DEFAULT_MAX_INFLIGHT],
                   help="per-worker in-flight limits before the router queues (default: %(default)s, "
                        "the same as serve's)")
    p.add_argument("--policies", type=_csv(str), default=list(POLICIES),
                   help=f"policies to run (default: {','.join(POLICIES)})")
    p.add_argument("--queues", type=_csv(str), default=[q.value for q in QueueOrder],
                   help="queue orders to run (default: fcfs,uncached,aged)")
    p.add_argument("--aging", type=float, default=QueueConfig().aging_tokens_per_s,
                   help="aged order: tokens of priority gained per second waited (default: %(default)s)")
    p.add_argument("--json", dest="json_path", help="write one JSON record per run to this file")
    p.add_argument("--plot", dest="plot_path", help="write a PNG bar chart of the first configuration")


def run(args: argparse.Namespace) -> int:
    for pol in args.policies:
        if pol not in POLICIES:
            print(f"error: unknown policy {pol!r}; choose from {sorted(POLICIES)}", file=sys.stderr)
            return 2
    try:
        orders = [QueueOrder(q) for q in args.queues]
        trace = load_trace(args.trace, args.limit)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    records = run_grid(trace, args.workers, args.cache_blocks, args.speedups, args.max_inflight,
                       args.policies, orders, args.aging)
    print(report.table(records))
    if args.json_path:
        report.write_json(records, args.json_path)
        print(f"wrote {len(records)} records to {args.json_path}")
    if args.plot_path:
        report.plot(records, args.plot_path)
        print(f"wrote {args.plot_path}")
    return 0


def run_grid(trace, workers: int, caches: Sequence[int], speedups: Sequence[float], limits: Sequence[int],
             policies: Sequence[str], orders: Sequence[QueueOrder],
             aging: float = QueueConfig().aging_tokens_per_s) -> list[dict]:
    records = []
    for sp, cache, lim in itertools.product(speedups, caches, limits):
        for pol, order in itertools.product(policies, orders):
            cfg = SimConfig(
                policy=pol,
                queue=QueueConfig(order=order, aging_tokens_per_s=aging, max_wait_s=3600.0),
                workers=workers, cache_blocks=cache, max_inflight=lim, speedup=sp,
            )
            records.append(simulate(trace, cfg))
    return records
