"""``gcache bench store-ops``: per-operation CPU cost of the store (in-process, no sockets): put
into a full arena (each put evicts), get and exists hits, for each eviction policy. CPU time of
this process, so other jobs on the machine barely move it; best of ``--repeat`` runs.

    gcache bench store-ops                               # or: python -m gcache.bench.store_ops
    PYTHONPATH=/path/to/older/checkout python gcache/bench/store_ops.py   # an older build

The measurement imports only ``gcache.tier.store`` (and ``gcache.tier.eviction`` when it
exists), so running this file by path with an older checkout first on ``PYTHONPATH`` measures
that build, policies or not, beside this one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from gcache import argtypes

KB = 1024


def measure(config: Any, n: int) -> dict[str, float]:
    """Microseconds of CPU time per put / get / exists with a store of ``config`` (a StoreConfig)."""
    from gcache.tier.store import Store

    s = Store(config)
    try:
        val = b"x" * 4 * KB
        keys = [("ns", b"k%d" % i) for i in range(n)]
        out = {}
        t = time.process_time()
        for k in keys:
            s.put(k, val)
        out["put"] = (time.process_time() - t) / n * 1e6
        recent = keys[-800:]
        t = time.process_time()
        for _ in range(25):
            for k in recent:
                hit = s.acquire(k)
                if hit is None:
                    raise RuntimeError(f"store-ops: {k!r} was evicted; the arena should hold the last 800 puts")
                s.release(hit)
        out["get"] = (time.process_time() - t) / (25 * len(recent)) * 1e6
        t = time.process_time()
        for _ in range(25):
            for k in recent:
                s.exists(k)
        out["exists"] = (time.process_time() - t) / (25 * len(recent)) * 1e6
        return out
    finally:
        s.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--puts", type=argtypes.count, default=20000,
                   help="puts of 4 KiB into an arena of 1,000 (default %(default)s)")
    p.add_argument("--repeat", type=argtypes.count, default=5, help="runs per policy; the best is kept (default %(default)s)")


def run_cli(args: argparse.Namespace) -> int:
    from gcache.tier.store import StoreConfig

    configs: dict[str, dict[str, Any]]
    try:
        from gcache.tier.eviction import EvictionConfig, EvictionKind

        configs = {k.value: {"eviction": EvictionConfig(k)} for k in EvictionKind}
    except ImportError:  # a build from before the eviction policies
        configs = {"(no policies)": {}}
    print(f"policy       put us  get us  exists us   (per key, CPU time, best of {args.repeat})")
    for name, extra in configs.items():
        runs = [measure(StoreConfig(mem_bytes=1000 * 4 * KB, **extra), args.puts) for _ in range(args.repeat)]
        best = {op: min(r[op] for r in runs) for op in runs[0]}
        print(f"{name:<12} {best['put']:6.2f}  {best['get']:6.2f}  {best['exists']:9.2f}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gcache.bench.store_ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
