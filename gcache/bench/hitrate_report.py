"""Tables and progress lines of ``gcache bench hitrate``: one row per capacity, the references
(trace maximum, global LRU, offline optimum) beside every policy and engine measured."""

from __future__ import annotations

from gcache.bench.records import HitRateRecord

REFERENCES = ("global-lru", "lru-oracle-admission", "belady")


def share(r: HitRateRecord) -> float:
    """RAM capacity as a fraction of the working set (the row key)."""
    return round(r.capacity_bytes / r.working_set_bytes, 3) if r.working_set_bytes else 0.0


def _columns(records: list[HitRateRecord]) -> list[tuple[str, str]]:
    cols = [(p, e) for p, e in dict.fromkeys((r.policy, r.engine) for r in records) if p not in REFERENCES]
    return sorted(cols, key=lambda c: (c[1] != "sim", c[0]))


def format_markdown(records: list[HitRateRecord]) -> str:
    """One table per tier set: token hit rate per capacity, references first."""
    out = []
    for nvme in sorted({r.disk_bytes > 0 for r in records}):
        recs = [r for r in records if (r.disk_bytes > 0) == nvme]
        cols = _columns(recs)
        by = {(share(r), r.policy, r.engine): r for r in recs}
        head = ["RAM / working set", "RAM pages", "NVMe pages", "trace max", "global LRU",
                "LRU + perfect admission", "Belady",
                *[f"{p} ({e})" for p, e in cols]]
        out.append("RAM + NVMe (global LRU and Belady at the RAM + NVMe capacity)" if nvme else "RAM only")
        out.append("")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for frac in sorted({share(r) for r in recs}):
            any_r = by.get((frac, "belady", "offline")) or next(r for r in recs if share(r) == frac)
            slot = (any_r.page_bytes + 63) // 64 * 64  # a page in the arena
            pages, disk = any_r.capacity_bytes // slot, any_r.disk_bytes // slot
            cells = [f"{frac:g}", f"{pages:,}", f"{disk:,}" if disk else "-", f"{100 * any_r.trace_max_hit_rate:.2f}%"]
            for p, e in (("global-lru", "sim"), ("lru-oracle-admission", "offline"), ("belady", "offline"), *cols):
                r = by.get((frac, p, e))
                cells.append(f"{100 * r.hit_rate:.2f}%" if r else "-")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def summary_lines(recs: list[HitRateRecord], frac: float, nvme: bool) -> list[str]:
    """Progress lines for the records of one capacity: each beside global LRU and the maximum."""
    lru = next((r for r in recs if r.policy == "global-lru"), None)
    lines = []
    for r in recs:
        vs = "" if lru is None or r is lru else f", {100 * (r.hit_rate - lru.hit_rate):+.2f} points vs global LRU"
        lines.append(f"capacity {frac:.3g} x working set{' + NVMe' if nvme else ''}: {r.policy:<10} ({r.engine:<7}) "
                     f"hit rate {100 * r.hit_rate:6.2f}% ({100 * r.ratio_to_max:5.1f}% of max{vs}) "
                     f"in {r.elapsed_s:.1f} s")
    return lines
