"""PNG plots of bench results (matplotlib, Agg backend: no display needed).

Plots are drawn from the same records the JSON holds, so a plot never shows a number the
JSON does not. Each function returns the paths it wrote.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import FuncFormatter

from gcache.bench.records import HitRateRecord, Record
from gcache.sizes import format_size


def _name(r: Record) -> str:
    return r.system if r.system != "gcache" or r.transport == "tcp" else f"gcache/{r.transport}"


def plot_throughput(records: list[Record], out_dir: str) -> list[str]:
    """throughput_gbps.png (GB/s vs value size, one line per system, one panel per op, at the
    smallest batch/thread count) and latency_cdf.png (per-batch latency CDF near 1 MiB)."""
    os.makedirs(out_dir, exist_ok=True)
    recs = [r for r in records if r.op != "exists"]
    if not recs:
        return []
    batch, threads = min(r.batch for r in recs), min(r.threads for r in recs)
    ops = [op for op in ("put", "get") if any(r.op == op for r in recs)]
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for name in sorted({_name(r) for r in recs}):
            pts = sorted((r.value_bytes, r.gbps) for r in recs
                         if _name(r) == name and r.op == op and r.batch == batch and r.threads == threads)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                        linestyle="--" if name in ("socket", "memcpy") else "-")
        ax.set_xscale("log", base=2)
        ticks = sorted({r.value_bytes for r in recs})
        ax.set_xticks(ticks, [format_size(t) for t in ticks], rotation=30)
        ax.set_xlabel("value size")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{op}, batch {batch}, {threads} thread(s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    p1 = os.path.join(out_dir, "throughput_gbps.png")
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    with_lat = [r for r in recs if r.latencies_ms and r.batch == batch and r.threads == threads]
    if not with_lat:
        return [p1]
    size = min({r.value_bytes for r in with_lat}, key=lambda s: abs(np.log2(s) - 20))
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for r in with_lat:
            if r.op == op and r.value_bytes == size:
                lat = np.sort(np.asarray(r.latencies_ms))
                ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=f"{_name(r)} (p50 {r.p50_ms:.2f} ms)")
        ax.set_xscale("log")
        ax.set_xlabel("per-batch latency, ms")
        ax.set_ylabel("fraction of batches")
        ax.set_title(f"{op} latency CDF, {format_size(size)} x {batch}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    p2 = os.path.join(out_dir, "latency_cdf.png")
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def _style(policy: str, engine: str) -> dict:
    if policy == "belady":
        return {"color": "k", "linestyle": ":", "marker": "^"}
    if policy == "global-lru":
        return {"color": "0.5", "linestyle": "-.", "marker": "s"}
    if policy == "lru-oracle-admission":
        return {"color": "0.3", "linestyle": ":", "marker": "v"}
    return {"linestyle": "--" if engine == "sim" else "-", "marker": "o" if engine == "daemon" else "x"}


def plot_hitrate(records: list[HitRateRecord], out_dir: str) -> list[str]:
    """hitrate_vs_capacity.png (a panel per tier set: every policy and engine beside global LRU,
    the offline optimum and the trace maximum, dashed) and hitrate_over_time.png (windowed hit
    rate at the smallest RAM-only capacity, or the smallest one measured)."""
    if not records:
        return []
    from gcache.bench.hitrate_report import share

    os.makedirs(out_dir, exist_ok=True)
    tiers = sorted({r.disk_bytes > 0 for r in records})
    fig, axes = plt.subplots(1, len(tiers), figsize=(6.5 * len(tiers), 4.6), squeeze=False)
    for ax, disk in zip(axes[0], tiers):
        recs = [r for r in records if (r.disk_bytes > 0) == disk]
        for policy, engine in dict.fromkeys((r.policy, r.engine) for r in recs):
            pts = sorted((share(r), r.hit_rate) for r in recs if (r.policy, r.engine) == (policy, engine))
            name = {"belady": "offline optimum (Belady)", "global-lru": "global LRU",
                    "lru-oracle-admission": "LRU + perfect admission"}.get(policy, f"{policy} ({engine})")
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], label=name, linewidth=1.2,
                    **_style(policy, engine))
        ax.axhline(100 * records[0].trace_max_hit_rate, color="k", linestyle="--", linewidth=0.8, label="trace maximum")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[-1] in "25" else ""))
        ax.set_xlabel("cluster RAM / working set" + (" (NVMe tier beside it)" if disk else ""))
        ax.set_ylabel("token hit rate, %")
        ax.set_title(("RAM + NVMe" if disk else "RAM only") + f", {records[0].requests} requests")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    p1 = os.path.join(out_dir, "hitrate_vs_capacity.png")
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    pool = [r for r in records if r.disk_bytes == 0 and r.series] or [r for r in records if r.series]
    smallest = min(share(r) for r in pool) if pool else 0
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for r in pool:
        if share(r) == smallest and r.engine != "offline":
            s = np.asarray(r.series)
            ax.plot(s[:, 0] / 60, 100 * s[:, 1], label=r.label, linewidth=1)
    ax.set_xlabel("trace time, minutes")
    ax.set_ylabel("token hit rate in window, %")
    ax.set_title(f"hit rate over time at {smallest:g} x the working set")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p2 = os.path.join(out_dir, "hitrate_over_time.png")
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]
