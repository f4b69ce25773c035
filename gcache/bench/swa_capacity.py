"""``gcache bench swa-capacity``: SWA-aware storage, bytes per cached token and hit rate at a
fixed memory budget (needs sglang).

    gcache bench swa-capacity [--requests 1500] [--budget-mib 24] [--json out.json]
    python -m gcache.bench.swa_capacity ...             # the same

Geometry: MiMo-V2.5-Pro-like, 70 layers = 10 full-attention + 60 SWA, window 128 tokens, page
64 tokens. Part 1 computes the bytes stored per cached token, dual pools (full layers for every
page, SWA layers for the trailing window only) vs one pool storing every layer per page. Part 2
replays a Mooncake-format trace (``--trace``, default the conversation trace in ../shared/data
beside the checkout; 512-token blocks -> 8 pages each) through the
adapter (sglang_adapter.backend.GCacheStorage) against a local 2-daemon cluster with the same
total RAM budget, bytes per token scaled down (``--layer-page-bytes`` per layer per page) so
it fits this machine; the full:SWA ratio, window and page size are kept. Like SGLang's
per-radix-node backup, each 512-token block written gets its SWA trailing window; a request
hits the longest window-safe prefix (batch_exists_v2). Host pools are a stand-in with SGLang's
``get_page_buffer_meta`` contract (the real pools are exercised by the tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from gcache import argtypes
from gcache.mooncake_trace import BLOCK_TOKENS as BLOCK
from gcache.mooncake_trace import DEFAULT_TRACE, TraceRequest, load_trace

FULL, SWA, WINDOW, PAGE = 10, 60, 128, 64


def bytes_per_token(tokens: int, windows: int = 1) -> float:
    """Per-layer-token units stored per cached token, dual pools, relative to 1 for one layer."""
    pages = math.ceil(tokens / PAGE)
    swa_pages = min(pages, windows * math.ceil(WINDOW / PAGE))
    return (FULL * pages * PAGE + SWA * swa_pages * PAGE) / tokens


class StandInPool:
    """Host memory with SGLang's zero-copy page metadata: one buffer per page."""

    def __init__(self, page_bytes: int, pages: int) -> None:
        self.page_size = PAGE
        self.page_bytes = page_bytes
        self.buf = np.random.default_rng(0).integers(0, 255, page_bytes * pages, dtype=np.uint8)

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        base = self.buf.ctypes.data
        idx = indices.tolist()
        ptrs = [base + (idx[i] // PAGE) * self.page_bytes for i in range(0, len(idx), PAGE)]
        return ptrs, [self.page_bytes] * len(ptrs)


def replay(nodes: list[str], reqs: list[TraceRequest], dual: bool, layer_page_bytes: int) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )

    from sglang_adapter.backend import GCacheStorage

    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="mimo-like", extra_config={"nodes": nodes, "dual_pools": dual,
                                                                     "namespace": "dual" if dual else "single",
                                                                     "skip_existing": False,
                                                                     "interface_v1": 1})  # batch_set_v1 below
    s = GCacheStorage(cfg, {})
    max_pages = 8 * 256
    kv = StandInPool(layer_page_bytes * (FULL if dual else FULL + SWA), max_pages)
    swa = StandInPool(layer_page_bytes * SWA, max_pages)
    s.register_mem_pool_host(kv)
    s.register_mem_host_pool_v2(kv, PoolName.KV)
    s.register_mem_host_pool_v2(swa, PoolName.SWA)
    win = math.ceil(WINDOW / PAGE)
    hit_tok = total_tok = 0
    t0 = time.perf_counter()
    for r in reqs:
        n = max(1, r.input_length // PAGE)
        keys = [f"{h}-{j}" for h in r.hash_ids for j in range(BLOCK // PAGE)][:n]
        n = len(keys)
        if dual:
            probe = PoolTransfer(name=PoolName.SWA, keys=["?"] * win, hit_policy=PoolHitPolicy.TRAILING_PAGES)
            hit = s.batch_exists_v2(keys, [probe]).kv_hit_pages
        else:
            hit = s.batch_exists(keys)
        hit_tok += min(hit * PAGE, r.input_length)
        total_tok += r.input_length
        a = hit
        while a < n:  # back up block by block, as SGLang backs up radix nodes
            b = min(n, (a // 8 + 1) * 8)
            idx = torch.arange(0, (b - a) * PAGE)
            s.batch_set_v1(keys[a:b], idx, HiCacheStorageExtraInfo(prefix_keys=keys[:a]))
            if dual:
                w0 = max(0, b - win)
                t = PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(0, (b - w0) * PAGE),
                                 keys=keys[w0:b], hit_policy=PoolHitPolicy.TRAILING_PAGES)
                s.batch_set_v2([t], HiCacheStorageExtraInfo(prefix_keys=keys[:w0]))
            a = b
    secs = time.perf_counter() - t0
    stats = s.client.stats()
    pools: dict[str, int] = {}
    for st in stats.values():
        for k, v in st.items():
            if k.startswith("pool_bytes:"):
                pools[k.split(":")[-1]] = pools.get(k.split(":")[-1], 0) + v
    s.close()
    return {"mode": "dual pools" if dual else "one pool", "hit_rate": hit_tok / total_tok,
            "stored_bytes": pools, "seconds": round(secs, 1)}


class _AdapterErrors(logging.Handler):
    """Counts the adapter's error log records (it logs a failed call and answers misses)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count, self.first = 0, ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        self.first = self.first or record.getMessage()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake-format JSONL trace (default %(default)s)")
    ap.add_argument("--requests", type=argtypes.count_or_zero, default=1500,
                    help="replay the first N requests, 0: all (default %(default)s)")
    ap.add_argument("--budget-mib", type=argtypes.positive, default=24.0,
                    help="total RAM of the 2-daemon cluster, MiB (default %(default)s)")
    ap.add_argument("--swa-share", type=argtypes.fraction, default=0.3,
                    help="share of the budget for the SWA pool in the dual-pool run, 0-1 (default %(default)s)")
    ap.add_argument("--layer-page-bytes", type=argtypes.count, default=16,
                    help="bytes per layer per 64-token page (default %(default)s)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the tables as JSON here")


def run_cli(args: argparse.Namespace) -> int:
    print("# bytes stored per cached token (relative to storing all 70 layers = 1.000)")
    table = []
    for tokens in (1024, 6909, 12035, 27367, 126195):
        end_only = bytes_per_token(tokens) / (FULL + SWA)
        per_block = bytes_per_token(tokens, windows=math.ceil(tokens / BLOCK)) / (FULL + SWA)
        table.append({"tokens": tokens, "dual_end_window": end_only, "dual_window_per_512_block": per_block})
        print(f"  {tokens:>7} tokens: dual (window at the end) {end_only:.3f} (1/{1 / end_only:.1f}); "
              f"dual (window per 512-token node) {per_block:.3f}; one pool 1.000")

    from gcache.bench import torchvision_stub

    torchvision_stub.install()  # sglang's config modules import torchvision; the PyPI build needs CUDA
    from gcache.cluster import LocalCluster

    reqs = load_trace(args.trace, args.requests)
    per_node = int(args.budget_mib * (1 << 20) / 2)
    results = []
    for dual in (False, True):
        budgets = ([f"kv={100 - args.swa_share * 100:g}%", f"swa={args.swa_share * 100:g}%"] if dual
                   else ["kv=100%"])
        extra = ["--no-pretouch"] + [x for b in budgets for x in ("--pool-budget", b)]
        failed = _AdapterErrors()
        logging.getLogger("sglang_adapter").addHandler(failed)
        try:
            with LocalCluster(nodes=2, mem=str(per_node), extra_args=extra) as c:
                res = replay(c.addresses, reqs, dual, args.layer_page_bytes)
        finally:
            logging.getLogger("sglang_adapter").removeHandler(failed)
        if failed.count:  # the adapter turns failures into misses: a 0% hit rate is not a result
            print(f"gcache bench swa-capacity: the adapter failed {failed.count} times ({failed.first}); "
                  "no result", file=sys.stderr)
            return 1
        results.append(res)
        print(f"# replay {len(reqs)} requests, {args.budget_mib:g} MiB: {res}")
    ratio = results[1]["hit_rate"] / max(results[0]["hit_rate"], 1e-9)
    print(f"hit rate: one pool {results[0]['hit_rate']:.3f}, dual pools {results[1]['hit_rate']:.3f} "
          f"({ratio:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes_per_token": table, "replay": results,
                       "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float))}}, f, indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gcache.bench.swa_capacity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
