"""``gcache bench hitrate``: replay a prefix trace through the client against a real cluster, and
simulate the eviction policies on it beside the offline optimum.

Each request checks its pages (``exists``), reads the leading run of hits into buffers
(``get_into``; a page evicted between the two calls shortens the prefix, as it would for an
engine), and writes the pages after the prefix (``put``). Every page carries its block id in
its first 8 bytes, and every page read is checked against it: a cache may forget, never lie.

Pages are scaled down so the whole trace fits the machine: one 512-token block of a real model
is tens of MiB; here it is ``page_bytes`` (4 KiB by default), keeping the ratio of pages to
capacity, and so the hit rate, unchanged. Capacities are given as fractions of the trace's
working set (distinct blocks x page size), so "1.0" means a cluster that could hold every page
if the hash ring were perfectly even.

Beside every capacity the bench reports the trace maximum (infinite cache), a global LRU cache
of the same number of pages, that LRU behind a perfect admission filter (it writes only blocks
that will be used again: the bound of admission policies), the offline optimum
(gcache.bench.optimum) and each selected
eviction policy (``--policy``), through real daemons (``--engine daemon``: the replay below, a
fresh cluster per point running ``gcache daemon --eviction POLICY``) and/or simulated
(``--engine sim``: the same policy objects, gcache.bench.policysim; seconds per point). With
the NVMe tier the references are computed at the RAM + NVMe capacity.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from gcache.bench.optimum import belady, lru_oracle_admission, next_uses
from gcache.bench.policysim import SimConfig, global_lru, simulate
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
from gcache.tier.eviction import EvictionConfig, EvictionKind

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
    def __init__(self, addresses: list[str], namespace: str = "hitrate", node_ids: list[str] | None = None) -> None:
        """``node_ids``: the daemons' ids, in the order of ``addresses``: keys are placed by them,
        as the simulator places them (by addresses, which change every run, placement alone moved
        a point at small capacities by several points against the simulator's)."""
        from gcache.client import Client
        from gcache.meta.membership import Membership, Node

        nodes: list[str] | Membership = addresses
        if node_ids is not None:
            nodes = Membership(0, tuple(Node(n, a) for n, a in zip(node_ids, addresses, strict=True)))
        self.client = Client(nodes, namespace=namespace, timeout_s=30.0)

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


SEGMENT_BYTES = 64 << 20  # the daemon's NVMe segment size (smaller budgets: a quarter of the budget)
NVME_RECORD_OVERHEAD = 64  # record header, namespace and key beside the page, about


@dataclass(frozen=True)
class ReplayConfig:
    """One point: RAM as a fraction of the working set, with or without an NVMe tier of
    ``disk_fraction`` of the working set, under eviction policy ``policy``."""

    capacity_fraction: float
    nvme: bool
    disk_fraction: float = 1.25
    policy: EvictionKind = EvictionKind.REUSE


@dataclass(frozen=True)
class TraceInfo:
    requests: list[TraceRequest]
    ws_blocks: int
    slot_bytes: int  # one page in the arena (64-byte aligned)
    page_bytes: int
    max_rate: float

    @property
    def ws_bytes(self) -> int:
        return self.ws_blocks * self.slot_bytes


def _record(info: TraceInfo, ram_bytes: int, disk_bytes: int, nodes: int, acc: HitAccounting, elapsed: float,
            label: str, policy: str, engine: str) -> HitRateRecord:
    return HitRateRecord(ram_bytes, disk_bytes, nodes, info.page_bytes, acc.requests, acc.input_tokens,
                         acc.hit_tokens, acc.hit_rate, info.max_rate,
                         acc.hit_rate / info.max_rate if info.max_rate else 0.0, elapsed, acc.series(), label,
                         info.ws_bytes, policy, engine)


def _label(ram_bytes: int, nvme: bool, policy: str, engine: str) -> str:
    return f"{policy} ({engine}) RAM {format_size(ram_bytes)}" + (" + NVMe" if nvme else "")


def run_one(info: TraceInfo, cfg: ReplayConfig, nodes: int, progress: bool) -> HitRateRecord:
    """One replay on a fresh local cluster sized by ``cfg``."""
    from gcache.cluster import LocalCluster

    per_node, disk_per_node = node_bytes(info, cfg, nodes)
    ram = sim_blocks(info, cfg, nodes)[0] * info.slot_bytes  # the pages the arenas hold (one row with the sim's)
    label = _label(ram, cfg.nvme, cfg.policy.value, "daemon")
    cluster = LocalCluster(nodes=nodes, mem=str(per_node), disk=str(disk_per_node) if cfg.nvme else None,
                           extra_args=["--eviction", cfg.policy.value])
    cluster.start()
    t0 = time.perf_counter()
    try:
        cache = GcachePages(cluster.addresses, node_ids=[d.node_id for d in cluster.daemons])
        try:
            acc = replay(info.requests, cache, info.page_bytes, progress, desc=f"replay {label}")
        finally:
            cache.close()
    finally:
        cluster.stop()
    return _record(info, ram, disk_per_node * nodes, nodes, acc, time.perf_counter() - t0, label,
                   cfg.policy.value, "daemon")


def node_bytes(info: TraceInfo, cfg: ReplayConfig, nodes: int) -> tuple[int, int]:
    """RAM and NVMe bytes of each daemon at a point (floors: 64 KiB of RAM, 1 MiB of disk)."""
    per_node = max(64 << 10, int(info.ws_bytes * cfg.capacity_fraction / nodes))
    disk_per_node = max(1 << 20, int(info.ws_bytes * cfg.disk_fraction / nodes)) if cfg.nvme else 0
    return per_node, disk_per_node


def sim_blocks(info: TraceInfo, cfg: ReplayConfig, nodes: int) -> tuple[int, int, int]:
    """Pages of RAM and of NVMe over the cluster, and NVMe pages a segment, as the daemons of
    run_one hold them (their arenas and segment files, floors included)."""
    per_node, disk_per_node = node_bytes(info, cfg, nodes)
    ram_blocks = nodes * max(1, per_node // info.slot_bytes)
    disk_blocks = segment_blocks = 0
    if cfg.nvme:
        record = info.page_bytes + NVME_RECORD_OVERHEAD
        segment = SEGMENT_BYTES if disk_per_node >= SEGMENT_BYTES else max(disk_per_node // 4, 4096)
        disk_blocks, segment_blocks = nodes * (disk_per_node // record), max(1, segment // record)
    return ram_blocks, disk_blocks, segment_blocks


def run_sim(info: TraceInfo, cfg: ReplayConfig, nodes: int) -> HitRateRecord:
    """The same point simulated with the policy objects (gcache.bench.policysim), the RAM and
    the NVMe tier sized and cut into segments as the daemons of run_one do it."""
    ram_blocks, disk_blocks, segment_blocks = sim_blocks(info, cfg, nodes)
    t0 = time.perf_counter()
    acc = simulate(info.requests, SimConfig(ram_blocks, disk_blocks, nodes, EvictionConfig(cfg.policy),
                                            segment_blocks=max(1, segment_blocks)))
    return _record(info, ram_blocks * info.slot_bytes, disk_blocks * info.slot_bytes, nodes, acc,
                   time.perf_counter() - t0, _label(ram_blocks * info.slot_bytes, cfg.nvme, cfg.policy.value, "sim"),
                   cfg.policy.value, "sim")


def run_references(info: TraceInfo, cfg: ReplayConfig, nxt: list[int], nodes: int = 1) -> list[HitRateRecord]:
    """Global LRU, LRU behind a perfect admission filter and the offline optimum, at the point's
    whole capacity (RAM + NVMe) as the engines' ``nodes`` daemons hold it (sim_blocks: the
    references had no disk floor, and one beat the optimum)."""
    ram_blocks, disk_blocks, _ = sim_blocks(info, cfg, nodes)
    total = ram_blocks + disk_blocks
    runs = (("global-lru", "sim", lambda: global_lru(info.requests, total)),
            ("lru-oracle-admission", "offline", lambda: lru_oracle_admission(info.requests, total, nxt=nxt)),
            ("belady", "offline", lambda: belady(info.requests, total, nxt=nxt)))
    out = []
    for policy, engine, fn in runs:
        t0 = time.perf_counter()
        acc = fn()
        out.append(_record(info, ram_blocks * info.slot_bytes, disk_blocks * info.slot_bytes, 1, acc,
                           time.perf_counter() - t0, _label(ram_blocks * info.slot_bytes, cfg.nvme, policy, engine),
                           policy, engine))
    return out


def _parse_list(text: str, what: str, allowed: tuple[str, ...]) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"gcache bench hitrate: {what} takes {','.join(allowed)}; got {text!r}")
    return list(dict.fromkeys(items))


def _fractions(text: str) -> list[float]:
    """--capacities: finite fractions > 0 (of the working set), comma-separated."""
    out = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        try:
            v = float(x)
        except ValueError:
            raise SystemExit(f"gcache bench hitrate: --capacities takes fractions such as 0.05,0.5,1.0; "
                             f"got {x!r}") from None
        if not 0 < v <= 1000:
            raise SystemExit(f"gcache bench hitrate: --capacities takes fractions > 0 (at most 1000), got {x!r}")
        out.append(v)
    return out


def run_cli(args: argparse.Namespace) -> int:
    from gcache.bench.hitrate_report import format_markdown, summary_lines

    trace = args.trace or os.path.normpath(DEFAULT_TRACE)
    limit = args.limit or (2000 if args.quick else 0)
    fractions = [0.5, 1.25] if args.quick else _fractions(args.capacities)
    tiers = ["ram"] if args.quick else _parse_list(args.tiers, "--tiers", ("ram", "nvme"))
    policies = [EvictionKind(p) for p in _parse_list(args.policy, "--policy", tuple(k.value for k in EvictionKind))]
    engines = _parse_list(args.engine, "--engine", ("sim", "daemon"))
    if not fractions or min(fractions) <= 0 or not 0 < args.disk_capacity < math.inf:
        raise SystemExit("gcache bench hitrate: --capacities and --disk-capacity take positive fractions")
    page_bytes = parse_size(args.page_bytes)
    if page_bytes < 8:
        raise SystemExit(f"gcache bench hitrate: --page-bytes must be at least 8 bytes (a page carries its block "
                         f"id), got {args.page_bytes}")
    requests = load_trace(trace, limit)
    if not requests:
        raise SystemExit(f"gcache bench hitrate: {trace} holds no request")
    best = trace_max(requests)
    info = TraceInfo(requests, working_set_blocks(requests), (page_bytes + 63) // 64 * 64, page_bytes, best.hit_rate)
    geo = ModelGeometry()
    print(f"trace {trace}: {len(requests)} requests, {best.input_tokens} input tokens, {info.ws_blocks} distinct "
          f"blocks; working set {format_size(info.ws_bytes)} at {format_size(page_bytes)} a page "
          f"({geo.name} page of {format_size(geo.page_bytes)} scaled 1/{geo.page_bytes // page_bytes}); "
          f"trace maximum hit rate {100 * best.hit_rate:.2f}%")
    records: list[HitRateRecord] = []
    json_path = args.json or os.path.join(args.out, "hitrate.json")
    out_dir = os.path.dirname(os.path.abspath(json_path)) if args.json else args.out
    nxt = next_uses(requests)
    for tier in tiers:
        for frac in fractions:
            if tier == "nvme" and frac >= 1.0 and "ram" in tiers:
                continue  # RAM alone holds the working set: an NVMe tier would never be read
            point = ReplayConfig(frac, tier == "nvme", args.disk_capacity)
            start = len(records)
            records += run_references(info, point, nxt, args.nodes)
            for engine in engines:
                for policy in policies:
                    cfg = ReplayConfig(frac, tier == "nvme", args.disk_capacity, policy)
                    rec = run_sim(info, cfg, args.nodes) if engine == "sim" else run_one(
                        info, cfg, args.nodes, not args.no_progress)
                    records.append(rec)
            for line in summary_lines(records[start:], frac, tier == "nvme"):
                print(line, flush=True)
            # rewritten after every point, so a long run that is stopped keeps what it measured
            write_json(json_path, "hitrate", [asdict(r) for r in records],
                       trace={"path": trace, "requests": len(requests), "input_tokens": best.input_tokens,
                              "distinct_blocks": info.ws_blocks, "working_set_bytes": info.ws_bytes,
                              "trace_max_hit_rate": best.hit_rate, "trace_max_series": best.series()},
                       geometry=asdict(geo) | {"page_bytes_scaled": page_bytes})
    md = os.path.join(out_dir, "hitrate.md")
    table = format_markdown(records)
    with open(md, "w") as f:
        f.write(table)
    print(table)
    print(f"wrote {json_path}, {md}")
    if not args.no_plots:
        from gcache.bench.plots import plot_hitrate

        for path in plot_hitrate(records, out_dir):
            print(f"wrote {path}")
    return 0
