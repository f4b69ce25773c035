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


def plot_hitrate(records: list[HitRateRecord], out_dir: str) -> list[str]:
    """hitrate_vs_capacity.png (one line per tier set, the trace maximum dashed) and
    hitrate_over_time.png (windowed hit rate of each replay)."""
    if not records:
        return []
    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for disk in sorted({r.disk_bytes > 0 for r in records}):
        pts = sorted((r.capacity_bytes, r.hit_rate) for r in records if (r.disk_bytes > 0) == disk)
        ax.plot([p[0] / 2**20 for p in pts], [100 * p[1] for p in pts], marker="o",
                label="RAM + NVMe tier" if disk else "RAM only")
    ax.axhline(100 * records[0].trace_max_hit_rate, color="k", linestyle="--", label="trace maximum")
    ax.set_xlabel("cluster RAM capacity, MiB")
    ax.set_ylabel("token hit rate, %")
    ax.set_title(f"hit rate vs capacity ({records[0].requests} requests)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p1 = os.path.join(out_dir, "hitrate_vs_capacity.png")
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for r in records:
        if r.series:
            s = np.asarray(r.series)
            ax.plot(s[:, 0] / 60, 100 * s[:, 1], label=r.label, linewidth=1)
    ax.set_xlabel("trace time, minutes")
    ax.set_ylabel("token hit rate in window, %")
    ax.set_title("hit rate over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p2 = os.path.join(out_dir, "hitrate_over_time.png")
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]
