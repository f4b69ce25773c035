"""``gcache bench adapter``: the SGLang adapter's ``batch_get_v1`` / ``batch_set_v1`` beside the raw
gcache client moving the same pages (needs sglang).

A real SGLang MHA host pool on CPU (``page_first`` layout: a page is a K and a V buffer; bf16,
64 tokens a page, its geometry chosen so that one page is ``--page-bytes``) holds ``--pages``
pages. Each figure moves all of them in one call:

* ``adapter``: ``GCacheStorage.batch_set_v1`` / ``batch_get_v1`` with SGLang-style page hashes
  and host indices, the storage created by SGLang's backend factory (``skip_existing`` off, so a
  set always sends its pages);
* ``raw``: ``Client.put`` / ``Client.get_into`` of the same pages, from / into the same pool
  memory (scatter-gather views made once, before timing), under the very keys the adapter
  uses, with the same daemon pool tag and chain positions: the same owners store the same
  bytes, so the difference is the adapter's own work (a raw namespace of its own spreads the
  64 keys over the daemons differently: in one run that alone put local set at 0.69, tcp set
  at 1.16).

Adapter and raw calls alternate one by one, so that load from other processes hits both alike;
``ratio`` is adapter GB/s over raw GB/s (page bytes over the summed call times); ``ratio_p50``
compares median calls. Both run over TCP and over the local shared-memory path (forced, so a
run never silently measures TCP twice). ``own_us`` is the adapter's own work per call before the
client's (page views from the pool's metadata, keys), median.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from gcache import argtypes
from gcache.sizes import format_size, parse_size

PAGE_TOKENS = 64
LAYERS = 4
OPS = ("set", "get")
NAMESPACE = "bench-adapter"
TRANSPORTS = ("tcp", "local")


@dataclass(frozen=True)
class AdapterBenchConfig:
    pages: int = 64
    page_bytes: int = 1 << 20
    seconds: float = 3.0  # per (transport, op), adapter and raw together
    transports: tuple[str, ...] = TRANSPORTS
    ops: tuple[str, ...] = OPS

    def __post_init__(self) -> None:
        if self.pages < 1 or self.seconds <= 0:
            raise ValueError("pages and seconds must be positive")
        if self.page_bytes < 1024 or self.page_bytes % 1024:
            raise ValueError("page bytes must be a positive multiple of 1 KiB (K and V of 4 layers, "
                             "64 bf16 tokens a page)")
        if not self.transports or not set(self.transports) <= set(TRANSPORTS):
            raise ValueError(f"transports: {','.join(TRANSPORTS)}")
        if not self.ops or not set(self.ops) <= set(OPS):
            raise ValueError(f"ops: {','.join(OPS)}")


@dataclass
class AdapterRecord:
    op: str  # "set" (batch_set_v1 / Client.put) or "get" (batch_get_v1 / Client.get_into)
    transport: str
    pages: int
    page_bytes: int
    adapter_gbps: float
    raw_gbps: float
    ratio: float  # adapter_gbps / raw_gbps
    adapter_p50_ms: float
    raw_p50_ms: float
    ratio_p50: float  # raw_p50_ms / adapter_p50_ms
    adapter_cpu_ms: float  # this process's CPU time per call (all threads), median: less load-sensitive
    raw_cpu_ms: float
    own_us: float  # the adapter's own work per call (views + keys), median
    adapter_calls: int
    raw_calls: int


def geometry(page_bytes: int) -> tuple[int, int]:
    """(heads, head_dim) so that one page_first page (K + V, LAYERS layers, PAGE_TOKENS bf16
    tokens) is ``page_bytes``: heads * head_dim = page_bytes / (2 * LAYERS * PAGE_TOKENS * 2)."""
    per = page_bytes // (2 * LAYERS * PAGE_TOKENS * 2)
    if per < 1 or per * 2 * LAYERS * PAGE_TOKENS * 2 != page_bytes:
        raise ValueError(f"page bytes {page_bytes} is not a multiple of {2 * LAYERS * PAGE_TOKENS * 2}")
    return (per // 128, 128) if per % 128 == 0 else (1, per)


@dataclass
class Calls:
    """Per-call wall time and this process's CPU time (all its threads), seconds."""

    wall: list[float]
    cpu: list[float]


def make_record(op: str, transport: str, cfg: AdapterBenchConfig, adapter: Calls, raw: Calls,
                own_us: float) -> AdapterRecord:
    """The figures of one (op, transport) from the calls' times."""
    import numpy as np

    def med_ms(xs: list[float]) -> float:
        return float(np.median(xs)) * 1e3 if xs else 0.0

    moved = cfg.pages * cfg.page_bytes
    a_gbps = len(adapter.wall) * moved / sum(adapter.wall) / 1e9 if adapter.wall else 0.0
    r_gbps = len(raw.wall) * moved / sum(raw.wall) / 1e9 if raw.wall else 0.0
    a_p50, r_p50 = med_ms(adapter.wall), med_ms(raw.wall)
    a_cpu, r_cpu = med_ms(adapter.cpu), med_ms(raw.cpu)
    return AdapterRecord(op, transport, cfg.pages, cfg.page_bytes, a_gbps, r_gbps,
                         a_gbps / r_gbps if r_gbps else 0.0, a_p50, r_p50, r_p50 / a_p50 if a_p50 else 0.0,
                         a_cpu, r_cpu, own_us, len(adapter.wall), len(raw.wall))


def alternate(a_fn: Callable[[], bool], r_fn: Callable[[], bool], budget_s: float) -> tuple[Calls, Calls]:
    """Call adapter and raw alternately (the order flipping every pair) until ``budget_s`` has
    passed; their times. A call that does not fully succeed aborts the measurement."""
    a, r = Calls([], []), Calls([], [])
    end = time.perf_counter() + budget_s
    flip = False
    while time.perf_counter() < end or not a.wall:
        for name, fn, calls in (("raw", r_fn, r), ("adapter", a_fn, a)) if flip else \
                (("adapter", a_fn, a), ("raw", r_fn, r)):
            c0, t0 = time.process_time(), time.perf_counter()
            ok = fn()
            calls.wall.append(time.perf_counter() - t0)
            calls.cpu.append(time.process_time() - c0)
            if not ok:
                raise RuntimeError(f"a {name} call did not move every page")
        flip = not flip
    return a, r


def host_pool(cfg: AdapterBenchConfig) -> Any:
    """A real sglang MHA host pool on CPU holding at least ``cfg.pages`` pages."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    heads, head_dim = geometry(cfg.page_bytes)
    tokens = cfg.pages * PAGE_TOKENS
    k = [torch.zeros(PAGE_TOKENS, heads, head_dim, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.zeros(PAGE_TOKENS, heads, head_dim, dtype=torch.bfloat16) for _ in range(LAYERS)]
    info = MHABufferInfo(
        buffers=KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in v]), layout=KVBufferLayout.NHD),
        page_size=PAGE_TOKENS, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=torch.bfloat16,
        device=torch.device("cpu"))
    cls = get_mha_host_pool_cls(info)
    # host_to_device_ratio x device tokens: exactly the pages measured (plus SGLang's padding page)
    return cls(info, 1.0, 0, PAGE_TOKENS, "page_first", pin_memory=False, device="cpu",
               device_capacity_tokens=tokens, start_layer=0, end_layer=LAYERS)


def _storage(addresses: list[str], transport: str) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = {"backend_name": "gcache", "module_path": "sglang_adapter.backend", "class_name": "GCacheStorage",
             "interface_v1": 1, "nodes": list(addresses), "namespace": NAMESPACE, "timeout_s": 60.0,
             "connect_timeout_s": 10.0, "skip_existing": False,
             "local": "force" if transport == "local" else "off"}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="bench/adapter", extra_config=extra)
    return StorageBackendFactory.create_backend("dynamic", cfg, None)


def _one_transport(addresses: list[str], transport: str, cfg: AdapterBenchConfig, pool: Any,
                   progress: bool) -> list[AdapterRecord]:
    import numpy as np
    import torch

    from gcache.client import Client
    from gcache.client.client import LocalPath
    from gcache.protocol import Status
    from sglang_adapter.backend import KV
    from sglang_adapter.pages import page_views

    storage = _storage(addresses, transport)
    raw = Client(addresses, namespace=NAMESPACE, timeout_s=60.0, connect_timeout_s=10.0,
                 local=LocalPath.FORCE if transport == "local" else LocalPath.OFF)
    try:
        storage.register_mem_pool_host(pool)
        n = cfg.pages
        idx = torch.arange(0, n * PAGE_TOKENS, dtype=torch.int64)
        hashes = [hashlib.sha256(f"bench-adapter-{i}".encode()).hexdigest() for i in range(n)]
        rkeys = storage.page_keys(hashes, KV)  # the very keys the adapter writes: same owners, same bytes
        views = page_views(pool, idx, n)  # the raw client's buffers: the same pool memory, made once
        pos = list(range(n))
        ops: dict[str, tuple[Callable[[], bool], Callable[[], bool]]] = {
            "set": (lambda: all(storage.batch_set_v1(hashes, idx)),
                    lambda: all(s is Status.OK for s in raw.put(rkeys, views, pool=KV, pos=pos))),
            "get": (lambda: all(storage.batch_get_v1(hashes, idx)),
                    lambda: raw.get_into(rkeys, views).hits == n),
        }
        # prime both, and check that each side's bytes come back exactly
        buf = pool.kv_buffer.view(torch.uint8)
        buf.copy_(torch.from_numpy(np.random.default_rng(n).integers(0, 256, buf.numel(), dtype=np.uint8))
                  .view(buf.shape))
        want = [bytes(v) for page in views for v in page]
        for side in (0, 1):
            if not ops["set"][side]():
                raise RuntimeError("priming set failed: is the cluster large enough?")
            buf.zero_()
            if not ops["get"][side]() or [bytes(v) for page in views for v in page] != want:
                raise RuntimeError(f"{('adapter', 'raw')[side]} get returned other bytes than were set")
        own = []
        for _ in range(50):
            t0 = time.perf_counter()
            storage._views(KV, hashes, idx)
            storage.page_keys(hashes, KV)
            own.append(time.perf_counter() - t0)
        own_us = float(np.median(own)) * 1e6
        out = []
        for op in cfg.ops:
            a_calls, r_calls = alternate(*ops[op], cfg.seconds)
            rec = make_record(op, transport, cfg, a_calls, r_calls, own_us)
            out.append(rec)
            if progress:
                print(f"{transport:<5} {op:<3} {n} x {format_size(cfg.page_bytes)}: adapter {rec.adapter_gbps:6.2f} "
                      f"GB/s, raw {rec.raw_gbps:6.2f} GB/s, ratio {rec.ratio:.3f} (by p50 {rec.ratio_p50:.3f}); "
                      f"CPU ms a call {rec.adapter_cpu_ms:.2f} vs {rec.raw_cpu_ms:.2f}; "
                      f"adapter's own work {own_us:.0f} us", flush=True)
        return out
    finally:
        storage.close()
        raw.close()


def measure(addresses: list[str], cfg: AdapterBenchConfig, progress: bool = True) -> list[AdapterRecord]:
    from gcache.bench import torchvision_stub

    torchvision_stub.install()  # sglang's config modules import torchvision; the PyPI build needs CUDA
    pool = host_pool(cfg)
    out: list[AdapterRecord] = []
    for transport in cfg.transports:
        out += _one_transport(addresses, transport, cfg, pool, progress)
    return out


def format_markdown(records: list[AdapterRecord]) -> str:
    head = ("| path | call | pages | adapter GB/s | raw GB/s | adapter / raw | adapter p50 ms | raw p50 ms "
            "| by p50 | CPU ms a call (adapter, raw) | adapter's own µs | calls (adapter, raw) |")
    lines = [head, "|" + "---|" * 12]
    for r in records:
        call = "batch_set_v1 / put" if r.op == "set" else "batch_get_v1 / get_into"
        lines.append(f"| {r.transport} | {call} | {r.pages} x {format_size(r.page_bytes)} | {r.adapter_gbps:.2f} "
                     f"| {r.raw_gbps:.2f} | {r.ratio:.3f} | {r.adapter_p50_ms:.2f} | {r.raw_p50_ms:.2f} "
                     f"| {r.ratio_p50:.3f} | {r.adapter_cpu_ms:.2f}, {r.raw_cpu_ms:.2f} | {r.own_us:.0f} "
                     f"| {r.adapter_calls}, {r.raw_calls} |")
    return "\n".join(lines) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--nodes", default="2", help="local daemons to start (default %(default)s), or HOST:PORT,... "
                                                 "of a running cluster on this host")
    ap.add_argument("--pages", type=argtypes.count, default=64, help="pages per call (default %(default)s)")
    ap.add_argument("--page-bytes", default="1MiB", help="bytes of one page, K and V (default %(default)s)")
    ap.add_argument("--seconds", type=argtypes.seconds, default=3.0,
                    help="time per figure, adapter and raw calls alternating (default %(default)s)")
    ap.add_argument("--transport", default="tcp,local", help="tcp,local (default %(default)s)")
    ap.add_argument("--ops", default="set,get", help="set,get (default %(default)s)")
    ap.add_argument("--out", default="bench/results", metavar="DIR", help="directory for adapter.json/.md")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the JSON records here")
    ap.add_argument("--no-progress", action="store_true", help="no per-figure lines")


def _csv(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def run_cli(args: argparse.Namespace) -> int:
    from gcache.bench.driver import cluster_for
    from gcache.bench.records import write_report

    try:
        cfg = AdapterBenchConfig(pages=args.pages, page_bytes=parse_size(args.page_bytes), seconds=args.seconds,
                                 transports=_csv(args.transport), ops=_csv(args.ops))
        geometry(cfg.page_bytes)
    except ValueError as exc:
        raise SystemExit(f"gcache bench adapter: {exc}") from None
    # the adapter's pages and the raw client's, with room to spare, over all the daemons
    nodes = 1 if ":" in args.nodes else max(1, int(args.nodes))
    per_node = max(64 << 20, 4 * cfg.pages * cfg.page_bytes // nodes)
    max_value = max(64 << 20, cfg.page_bytes)
    with cluster_for(args.nodes, per_node, ["--max-value", f"{max_value >> 20}MiB"]) as addresses:
        records = measure(addresses, cfg, progress=not args.no_progress)
    json_path = args.json or os.path.join(args.out, "adapter.json")
    write_report(json_path, "adapter", [asdict(r) for r in records], format_markdown(records),
                 config=asdict(cfg), nodes=args.nodes, load_avg=os.getloadavg())
    return 0
