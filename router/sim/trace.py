"""Mooncake FAST'25 trace reader: one JSON object a line with timestamp (ms),
input_length, output_length and hash_ids (one id per 512-token block, prefix-chained)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRecord:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """Read up to ``limit`` records. Raises ValueError naming the line of a malformed record."""
    out: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rec = TraceRecord(
                    float(d["timestamp"]) / 1000.0,
                    int(d["input_length"]),
                    int(d["output_length"]),
                    tuple(int(h) for h in d["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({e})") from None
            out.append(rec)
    out.sort(key=lambda r: r.arrival_s)  # stable: equal timestamps keep file order
    return out
