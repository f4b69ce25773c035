"""``gcache bench embedding``: multimodal embeddings through the SGLang embedding store beside the
raw gcache client moving the same bytes.

Each figure moves a batch of image embeddings (``tokens`` x ``hidden`` values of bf16; 576 x 4096
x 2 bytes is one 336 px image for a 7B-class VLM) between a host pool laid out as SGLang's
EmbeddingCacheController lays it out (256 KiB pages; each embedding split into ``runs`` page
runs, interleaved with the other embeddings' runs) and one local daemon:

* ``store``: ``GCacheEmbeddingStore.batch_get_into_multi_buffers`` / ``batch_put_from_multi_buffers``
  with the pool's raw pointers, as the controller calls it;
* ``raw``: ``Client.get_into`` / ``Client.put`` of the same bytes into / from the same page runs
  (scatter-gather lists), on another namespace.

Store and raw calls alternate one by one, so that load from other processes hits both alike;
``ratio`` is store GB/s over raw GB/s (value bytes over the summed call times). Both run over the local shared-memory path and over TCP.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from gcache.bench.driver import cluster_for
from gcache.bench.records import write_report
from gcache.sizes import format_size

PAGE_BYTES = 256 << 10  # the controller's TARGET_PAGE_BYTES


@dataclass(frozen=True)
class EmbeddingBenchConfig:
    tokens: tuple[int, ...] = (576, 1152, 2304)
    hidden: int = 4096
    batch: int = 4
    runs: int = 2
    seconds: float = 4.0
    transports: tuple[str, ...] = ("local", "tcp")
    ops: tuple[str, ...] = ("get", "put")

    def __post_init__(self) -> None:
        if not self.tokens or min(self.tokens) < 1 or self.hidden < 1 or self.batch < 1 or self.runs < 1:
            raise ValueError("tokens, hidden, batch and runs must be >= 1")
        if self.seconds <= 0:
            raise ValueError("seconds must be > 0")
        if not set(self.transports) <= {"local", "tcp"} or not set(self.ops) <= {"get", "put"}:
            raise ValueError("transports: local,tcp; ops: get,put")


@dataclass
class EmbeddingRecord:
    op: str
    transport: str
    tokens: int
    hidden: int
    value_bytes: int
    batch: int
    runs: int
    store_gbps: float
    raw_gbps: float
    ratio: float  # store_gbps / raw_gbps
    store_p50_ms: float
    raw_p50_ms: float
    ratio_p50: float  # raw_p50_ms / store_p50_ms: the same comparison by median call, less load-sensitive
    plan_us: float  # the store's own work per call before the client's (region lookup, keys, views), median
    store_calls: int
    raw_calls: int


class _Layout:
    """A host pool holding ``batch`` embeddings of ``tokens`` rows, each in ``runs`` page runs,
    run k of embedding i at slot k * batch + i (so no embedding is contiguous)."""

    def __init__(self, torch: Any, tokens: int, hidden: int, batch: int, runs: int) -> None:
        row = hidden * 2
        page_rows = max(PAGE_BYTES // row, 1)
        per_run = -(-tokens // runs)
        run_rows = -(-per_run // page_rows) * page_rows  # whole pages a run
        self.pool = torch.empty((batch * runs * run_rows, hidden), dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(tokens)
        self.pool.copy_(torch.randn(self.pool.shape, generator=g).to(torch.bfloat16))
        base = self.pool.data_ptr()
        self.ptrs: list[list[int]] = []
        self.sizes: list[list[int]] = []
        for i in range(batch):
            left, ptrs, sizes = tokens, [], []
            for k in range(runs):
                n = min(run_rows, left)
                if n <= 0:
                    break
                ptrs.append(base + (k * batch + i) * run_rows * row)
                sizes.append(n * row)
                left -= n
            self.ptrs.append(ptrs)
            self.sizes.append(sizes)
        self.views = [[memoryview((ctypes.c_ubyte * s).from_address(p)).cast("B") for p, s in zip(ps, ss)]
                      for ps, ss in zip(self.ptrs, self.sizes)]
        self.value_bytes = tokens * row


def _alternate(s_fn: Any, r_fn: Any, budget_s: float) -> tuple[list[float], list[float]]:
    """Call store and raw alternately (one call each, the order flipping every pair) until
    ``budget_s`` has passed; their latencies. Alternating call by call puts both under the same
    load from the rest of the machine."""
    s_lat: list[float] = []
    r_lat: list[float] = []
    end = time.perf_counter() + budget_s
    flip = False
    while time.perf_counter() < end or not s_lat:
        for fn, lat in ((r_fn, r_lat), (s_fn, s_lat)) if flip else ((s_fn, s_lat), (r_fn, r_lat)):
            t0 = time.perf_counter()
            fn()
            lat.append(time.perf_counter() - t0)
        flip = not flip
    return s_lat, r_lat


def _one_size(store: Any, raw: Any, lay: _Layout, tokens: int, transport: str, cfg: EmbeddingBenchConfig,
              progress: bool) -> list[EmbeddingRecord]:
    from gcache.protocol import Status

    store.register_buffer(lay.pool, modality="vision")
    hashes = [f"bench-{tokens}-{i}" for i in range(cfg.batch)]
    rkeys = [f"raw-{tokens}-{i}" for i in range(cfg.batch)]
    ops = {
        "put": (lambda: store.batch_put_from_multi_buffers(hashes, lay.ptrs, lay.sizes),
                lambda: raw.put(rkeys, lay.views, pool="emb")),
        "get": (lambda: store.batch_get_into_multi_buffers(hashes, lay.ptrs, lay.sizes),
                lambda: raw.get_into(rkeys, lay.views).status),
    }
    # prime both, and check that the store's bytes come back exactly
    want = [bytes(v) for runs in lay.views for v in runs]
    if not all(ops["put"][0]()) or ops["put"][1]() != [Status.OK] * cfg.batch:
        raise RuntimeError("priming put failed")
    lay.pool.zero_()
    if not all(ops["get"][0]()) or [bytes(v) for runs in lay.views for v in runs] != want:
        raise RuntimeError("store get returned other bytes than were put")
    out = []
    moved = lay.value_bytes * cfg.batch
    plan = []
    for _ in range(200):
        t0 = time.perf_counter()
        store._plan(hashes, lay.ptrs, lay.sizes)
        plan.append(time.perf_counter() - t0)
    plan_us = float(np.median(plan)) * 1e6
    for op in cfg.ops:
        s_lat, r_lat = _alternate(*ops[op], cfg.seconds)
        s_calls, r_calls = len(s_lat), len(r_lat)
        s_gbps = s_calls * moved / sum(s_lat) / 1e9
        r_gbps = r_calls * moved / sum(r_lat) / 1e9
        s_p50, r_p50 = float(np.median(s_lat)) * 1e3, float(np.median(r_lat)) * 1e3
        rec = EmbeddingRecord(op, transport, tokens, cfg.hidden, lay.value_bytes, cfg.batch, cfg.runs,
                              s_gbps, r_gbps, s_gbps / r_gbps if r_gbps else 0.0, s_p50, r_p50,
                              r_p50 / s_p50 if s_p50 else 0.0, plan_us, s_calls, r_calls)
        out.append(rec)
        if progress:
            print(f"{transport:<5} {op:<3} {tokens}x{cfg.hidden} ({format_size(lay.value_bytes)}) x{cfg.batch}: "
                  f"store {s_gbps:6.2f} GB/s, raw {r_gbps:6.2f} GB/s, ratio {rec.ratio:.2f} (by p50 "
                  f"{rec.ratio_p50:.2f}); store's own work {plan_us:.0f} us a call", flush=True)
    return out


def measure(addresses: list[str], cfg: EmbeddingBenchConfig, progress: bool = True) -> list[EmbeddingRecord]:
    from gcache.bench import torchvision_stub

    torchvision_stub.install()  # sglang's config modules import torchvision; the PyPI build needs CUDA
    import torch

    from gcache.client import Client
    from gcache.client.client import LocalPath
    from sglang_adapter.embedding import GCacheEmbeddingStore

    out: list[EmbeddingRecord] = []
    for transport in cfg.transports:
        local = "auto" if transport == "local" else "off"
        store = GCacheEmbeddingStore({"nodes": addresses, "model": "bench/vlm", "timeout_s": 30.0,
                                      "skip_existing": False, "local": local})
        raw = Client(addresses, namespace="bench-emb-raw", timeout_s=30.0, local=LocalPath(local))
        try:
            for tokens in cfg.tokens:
                lay = _Layout(torch, tokens, cfg.hidden, cfg.batch, cfg.runs)
                out += _one_size(store, raw, lay, tokens, transport, cfg, progress)
            m = store.metrics()
            if m["errors"] or m["unregistered"]:
                raise RuntimeError(f"store reported failures: {m}")
        finally:
            store.close()
            raw.close()
    return out


def format_markdown(records: list[EmbeddingRecord]) -> str:
    head = ("| path | op | embedding | batch x runs | store GB/s | raw GB/s | store / raw | store p50 ms "
            "| raw p50 ms | by p50 | store's own µs |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r.transport} | {r.op} | {r.tokens} x {r.hidden} bf16 ({format_size(r.value_bytes)}) "
                     f"| {r.batch} x {r.runs} | {r.store_gbps:.2f} | {r.raw_gbps:.2f} | {r.ratio:.2f} "
                     f"| {r.store_p50_ms:.2f} | {r.raw_p50_ms:.2f} | {r.ratio_p50:.2f} | {r.plan_us:.0f} |")
    return "\n".join(lines) + "\n"


def _csv(s: str, kind: Any = str) -> tuple:
    return tuple(kind(x) for x in s.split(",") if x)


def run_cli(args: argparse.Namespace) -> int:
    try:
        cfg = EmbeddingBenchConfig(tokens=_csv(args.tokens, int), hidden=args.hidden, batch=args.batch,
                                   runs=args.runs, seconds=args.seconds,
                                   transports=_csv(args.transport), ops=_csv(args.ops))
    except ValueError as exc:
        raise SystemExit(f"gcache bench embedding: {exc}") from None
    value = max(cfg.tokens) * cfg.hidden * 2
    biggest = value * cfg.batch
    mem = max(64 << 20, 4 * biggest)  # the store's and the raw client's batch, twice over
    extra = ["--pool-budget", "emb=90%", "--max-value", f"{max(64, (value >> 20) + 1)}MiB"]
    with cluster_for(args.nodes, mem, extra) as addresses:
        records = measure(addresses, cfg, progress=not args.no_progress)
    json_path = args.json or os.path.join(args.out, "embedding.json")
    write_report(json_path, "embedding", [asdict(r) for r in records], format_markdown(records),
                 config=asdict(cfg), nodes=args.nodes)
    return 0
