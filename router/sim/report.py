"""Render simulator results: a text table, a JSON file (one record per run) and a PNG."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

COLUMNS = [
    ("speedup", "load", "{:g}x"),
    ("cache_blocks", "cache", "{}"),
    ("max_inflight", "limit", "{}"),
    ("policy", "policy", "{}"),
    ("queue", "queue", "{}"),
    ("hit_rate", "hit", "{:.3f}"),
    ("ttft_p50_s", "p50", "{:.3f}"),
    ("ttft_p90_s", "p90", "{:.3f}"),
    ("ttft_p99_s", "p99", "{:.2f}"),
    ("ttft_p90_long_s", "p90>=32K", "{:.3f}"),
    ("throughput_tok_s", "tok/s", "{:.0f}"),
    ("max_wait_s", "maxwait", "{:.2f}"),
]


def _fmt(fmt: str, v: object) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def table(records: Sequence[dict]) -> str:
    rows = [[h for _, h, _ in COLUMNS]]
    rows += [[_fmt(f, r.get(k)) for k, _, f in COLUMNS] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(records: Sequence[dict], path: str | Path) -> None:
    Path(path).write_text(json.dumps(list(records), indent=1, sort_keys=True) + "\n")


def plot(records: Sequence[dict], path: str | Path) -> None:
    """One bar group per (policy, queue) of the first configuration, four panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        raise ValueError("nothing to plot: no simulator records")
    first = records[0]
    sel = [
        r
        for r in records
        if (r["speedup"], r["cache_blocks"], r["max_inflight"])
        == (first["speedup"], first["cache_blocks"], first["max_inflight"])
    ]
    labels = [f"{r['policy']}\n{r['queue']}" for r in sel]
    panels = [
        ("hit_rate", "prefix hit rate"),
        ("ttft_p90_s", "TTFT p90 (s)"),
        ("ttft_p90_long_s", "TTFT p90, prompts >= 32K (s)"),
        ("throughput_tok_s", "throughput (tokens/s)"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(max(10, 0.6 * len(sel) + 4), 8))
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        ax.bar(range(len(sel)), [r[key] for r in sel], color="tab:blue")
        ax.set_title(title)
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels(labels, rotation=70, fontsize=7)
    fig.suptitle(
        f"router simulator: {first['workers']} workers, cache {first['cache_blocks']} blocks, "
        f"limit {first['max_inflight']}, load {first['speedup']:g}x"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
