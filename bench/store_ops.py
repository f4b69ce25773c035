"""Per-operation CPU cost of the store (in-process, no sockets): put into a full arena (each put
evicts), get and exists hits, for each eviction policy. CPU time of this process, so other jobs
on the machine barely move it; best of ``--repeat`` runs.

    python bench/store_ops.py                    # the policies of the gcache on sys.path
    PYTHONPATH=/path/to/older/checkout python bench/store_ops.py   # a build without policies
"""

from __future__ import annotations

import argparse
import time

from gcache.tier.store import Store, StoreConfig

KB = 1024


def measure(config: StoreConfig, n: int) -> dict[str, float]:
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
                s.release(s.acquire(k))
        out["get"] = (time.process_time() - t) / (25 * len(recent)) * 1e6
        t = time.process_time()
        for _ in range(25):
            for k in recent:
                s.exists(k)
        out["exists"] = (time.process_time() - t) / (25 * len(recent)) * 1e6
        return out
    finally:
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--puts", type=int, default=20000, help="puts of 4 KiB into an arena of 1,000 (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per policy; the best is kept (default %(default)s)")
    args = ap.parse_args()
    try:
        from gcache.tier.eviction import EvictionConfig, EvictionKind

        configs = {k.value: {"eviction": EvictionConfig(k)} for k in EvictionKind}
    except ImportError:
        configs = {"(no policies)": {}}
    print(f"policy       put us  get us  exists us   (per key, CPU time, best of {args.repeat})")
    for name, extra in configs.items():
        runs = [measure(StoreConfig(mem_bytes=1000 * 4 * KB, **extra), args.puts) for _ in range(args.repeat)]
        best = {op: min(r[op] for r in runs) for op in runs[0]}
        print(f"{name:<12} {best['put']:6.2f}  {best['get']:6.2f}  {best['exists']:9.2f}")


if __name__ == "__main__":
    main()
