"""``gcache bench hitrate``: replay a prefix trace through the client against a real cluster.

Each request checks its pages (``exists``), reads the leading run of hits into buffers
(``get_into``; a page evicted between the two calls shortens the prefix, as it would for an
engine), and writes the pages after the prefix (``put``). Every page carries its block id in
its first 8 bytes, and every page read is checked against it: a cache may forget, never lie.

Pages are scaled down so the whole trace fits the machine: one 512-token block of a real model
is tens of MiB; here it is ``page_bytes`` (4 KiB by default), keeping the ratio of pages to
capacity, and so the hit rate, unchanged. Capacities are given as fractions of the trace's
working set (distinct blocks x page size), so "1.0" means a cluster that could hold every page
if the hash ring were perfectly even.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from gcache.bench.records import HitRateRecord, write_json
from gcache.bench.trace import (
    BLOCK_TOKENS,
    HitAccounting,
    TraceRequest,
    leading_hits,
    load_trace,
    trace_max,
    working_set_blocks,
)
from gcache.sizes import format_size, parse_size

DEFAULT_TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                             "conversation_trace.jsonl")


@dataclass(frozen=True)
class ModelGeometry:
    """Maps a block of tokens to a page: K and V of every layer, every KV head."""

    name: str = "Llama-3.1-8B"
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    block_tokens: int = BLOCK_TOKENS

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.block_tokens


class PageCache:
    """What the replay needs from a cache; GcachePages is the real one, tests add fakes."""

    def exists(self, keys: list[str]) -> list[bool]:
        raise NotImplementedError

    def get_into(self, keys: list[str], bufs: list[np.ndarray]) -> list[bool]:
        raise NotImplementedError

    def put(self, keys: list[str], values: list[np.ndarray]) -> list[bool]:
        raise NotImplementedError


class GcachePages(PageCache):
    def __init__(self, addresses: list[str], namespace: str = "hitrate") -> None:
        from gcache.client import Client

        self.client = Client(addresses, namespace=namespace, timeout_s=30.0)

    def exists(self, keys: list[str]) -> list[bool]:
        return self.client.exists(keys)

    def get_into(self, keys: list[str], bufs: list[np.ndarray]) -> list[bool]:
        return self.client.get_into(keys, bufs).ok()

    def put(self, keys: list[str], values: list[np.ndarray]) -> list[bool]:
        from gcache.protocol import Status

        return [s is Status.OK for s in self.client.put(keys, values)]

    def close(self) -> None:
        self.client.close()


class WrongBytes(AssertionError):
    """A page came back with another block's bytes."""


def replay(requests: list[TraceRequest], cache: PageCache, page_bytes: int, progress: bool = False,
           block_tokens: int = BLOCK_TOKENS, window_s: float = 60.0, desc: str = "replay") -> HitAccounting:
    """Run the trace through ``cache``; returns the token hit accounting."""
    from tqdm import tqdm

    if page_bytes < 8:
        raise ValueError("page_bytes must be >= 8 (a page carries its block id)")
    longest = max((len(r.hash_ids) for r in requests), default=0)
    out = np.zeros((longest, page_bytes), dtype=np.uint8)
    src = np.zeros((longest, page_bytes), dtype=np.uint8)
    out_ids, src_ids = out[:, :8].view(np.uint64)[:, 0], src[:, :8].view(np.uint64)
    acc = HitAccounting(window_s=window_s)
    for req in tqdm(requests, desc=desc, disable=not progress, leave=False, mininterval=0.5):
        n = len(req.hash_ids)
        keys = [str(h) for h in req.hash_ids]
        k = leading_hits(cache.exists(keys)) if n else 0
        if k:
            k = leading_hits(cache.get_into(keys[:k], list(out[:k])))
            want = np.asarray(req.hash_ids[:k], dtype=np.uint64)
            if not np.array_equal(out_ids[:k], want):
                bad = int(np.flatnonzero(out_ids[:k] != want)[0])
                raise WrongBytes(f"page {keys[bad]} came back holding block {int(out_ids[bad])}")
        if k < n:
            src_ids[k:n, 0] = req.hash_ids[k:]
            cache.put(keys[k:], list(src[k:n]))
        acc.add(req, k, block_tokens)
    return acc


@dataclass(frozen=True)
class ReplayConfig:
    capacity_fraction: float
    nvme: bool


def run_one(requests: list[TraceRequest], cfg: ReplayConfig, nodes: int, page_bytes: int, ws_bytes: int,
            max_rate: float, progress: bool) -> HitRateRecord:
    """One replay on a fresh local cluster sized by ``cfg``."""
    from gcache.cluster import LocalCluster

    per_node = max(64 << 10, int(ws_bytes * cfg.capacity_fraction / nodes))
    disk_per_node = max(1 << 20, int(ws_bytes * 1.25 / nodes)) if cfg.nvme else 0
    label = f"RAM {format_size(per_node * nodes)}" + (" + NVMe" if cfg.nvme else "")
    cluster = LocalCluster(nodes=nodes, mem=str(per_node), disk=str(disk_per_node) if cfg.nvme else None)
    cluster.start()
    t0 = time.perf_counter()
    try:
        cache = GcachePages(cluster.addresses)
        try:
            acc = replay(requests, cache, page_bytes, progress, desc=f"replay {label}")
        finally:
            cache.close()
    finally:
        cluster.stop()
    return HitRateRecord(per_node * nodes, disk_per_node * nodes, nodes, page_bytes, acc.requests,
                         acc.input_tokens, acc.hit_tokens, acc.hit_rate, max_rate,
                         acc.hit_rate / max_rate if max_rate else 0.0, time.perf_counter() - t0,
                         acc.series(), label, ws_bytes)


def format_markdown(records: list[HitRateRecord]) -> str:
    lines = ["| cluster RAM | NVMe | capacity / working set | token hit rate | trace max | of max | seconds |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        ws = r.capacity_bytes / r.working_set_bytes if r.working_set_bytes else 0.0
        lines.append(f"| {format_size(r.capacity_bytes)} | {format_size(r.disk_bytes) if r.disk_bytes else '-'} "
                     f"| {ws:.2f} | {100 * r.hit_rate:.2f}% | {100 * r.trace_max_hit_rate:.2f}% "
                     f"| {100 * r.ratio_to_max:.1f}% | {r.elapsed_s:.0f} |")
    return "\n".join(lines) + "\n"


def run_cli(args: argparse.Namespace) -> int:
    trace = args.trace or os.path.normpath(DEFAULT_TRACE)
    limit = args.limit or (2000 if args.quick else 0)
    fractions = [0.5, 1.25] if args.quick else [float(x) for x in args.capacities.split(",") if x]
    tiers = ["ram"] if args.quick else [t for t in args.tiers.split(",") if t]
    if any(t not in ("ram", "nvme") for t in tiers) or not fractions or min(fractions) <= 0:
        raise SystemExit("gcache bench hitrate: --tiers takes ram,nvme; --capacities positive fractions")
    page_bytes = parse_size(args.page_bytes)
    requests = load_trace(trace, limit)
    best = trace_max(requests)
    ws_blocks = working_set_blocks(requests)
    ws_bytes = ws_blocks * ((page_bytes + 63) // 64 * 64)
    geo = ModelGeometry()
    print(f"trace {trace}: {len(requests)} requests, {best.input_tokens} input tokens, {ws_blocks} distinct "
          f"blocks; working set {format_size(ws_bytes)} at {format_size(page_bytes)} a page "
          f"({geo.name} page of {format_size(geo.page_bytes)} scaled 1/{geo.page_bytes // page_bytes}); "
          f"trace maximum hit rate {100 * best.hit_rate:.2f}%")
    records: list[HitRateRecord] = []
    json_path = args.json or os.path.join(args.out, "hitrate.json")
    out_dir = os.path.dirname(os.path.abspath(json_path)) if args.json else args.out
    for tier in tiers:
        for frac in fractions:
            if tier == "nvme" and frac >= 1.0 and "ram" in tiers:
                continue  # RAM alone holds the working set: an NVMe tier would never be read
            rec = run_one(requests, ReplayConfig(frac, tier == "nvme"), args.nodes, page_bytes, ws_bytes,
                          best.hit_rate, not args.no_progress)
            print(f"{rec.label:<24} capacity {frac:.2f} x working set: hit rate {100 * rec.hit_rate:6.2f}% "
                  f"({100 * rec.ratio_to_max:5.1f}% of max) in {rec.elapsed_s:.0f} s", flush=True)
            records.append(rec)
            # rewritten after every replay, so a long run that is stopped keeps what it measured
            write_json(json_path, "hitrate", [asdict(r) for r in records],
                       trace={"path": trace, "requests": len(requests), "input_tokens": best.input_tokens,
                              "distinct_blocks": ws_blocks, "working_set_bytes": ws_bytes,
                              "trace_max_hit_rate": best.hit_rate, "trace_max_series": best.series()},
                       geometry=asdict(geo) | {"page_bytes_scaled": page_bytes})
    md = os.path.join(out_dir, "hitrate.md")
    with open(md, "w") as f:
        f.write(format_markdown(records))
    print(format_markdown(records))
    print(f"wrote {json_path}, {md}")
    if not args.no_plots:
        from gcache.bench.plots import plot_hitrate

        for path in plot_hitrate(records, out_dir):
            print(f"wrote {path}")
    return 0
