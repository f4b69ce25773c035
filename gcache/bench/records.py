"""Benchmark result records, the JSON document they are written in, and machine info.

Every throughput figure is a ``Record``; the fields the core issue documented (op, value_bytes,
batch, threads, gbps, p50_ms, p99_ms, ceiling_gbps, ratio) keep their meaning, and ``system``
says who produced it (gcache, redis, mooncake, memcpy, socket). ``ratios`` holds the figure
divided by each peer's figure for the same (op, size, batch, threads), so a reader never has
to pair rows by hand. Hit-rate records carry the capacity they were measured at beside the
trace's own maximum, so a number can be judged without re-running the replay.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SYSTEMS = ("gcache", "redis", "mooncake", "memcpy", "socket", "ucx-raw")
THROUGHPUT_FIELDS = ("system", "transport", "op", "value_bytes", "batch", "threads", "gbps", "ops_per_s",
                     "p50_ms", "p99_ms", "p999_ms", "ceiling_gbps", "ratio", "ratios")
HITRATE_FIELDS = ("capacity_bytes", "disk_bytes", "nodes", "page_bytes", "requests", "hit_rate",
                  "trace_max_hit_rate", "ratio_to_max", "series")


@dataclass
class Record:
    """One throughput measurement. ``gbps`` counts value bytes only (0 for exists);
    ``ops_per_s`` counts keys; latencies are per batch; ``ratio`` is gbps / ceiling_gbps."""

    system: str
    op: str
    value_bytes: int
    batch: int
    threads: int
    gbps: float
    ops_per_s: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    ceiling_gbps: float = 0.0
    ratio: float = 0.0
    transport: str = "tcp"
    ratios: dict[str, float] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list, repr=False)

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.op, self.value_bytes, self.batch, self.threads)

    def to_json(self, keep_latencies: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not keep_latencies:
            d.pop("latencies_ms")
        return d


@dataclass
class HitRateRecord:
    """One replay of a trace at one cluster capacity (RAM bytes over all nodes; ``disk_bytes``
    is the NVMe budget over all nodes, 0 without the tier). ``series`` is a list of
    [seconds into the trace, hit rate of that window]. ``engine``: ``daemon`` (real daemons),
    ``sim`` (the policy objects simulated, gcache.bench.policysim) or ``offline`` (the offline
    optimum); ``policy``: the eviction policy (``global-lru``: one LRU cache of the whole
    capacity; ``belady``: the optimum)."""

    capacity_bytes: int
    disk_bytes: int
    nodes: int
    page_bytes: int
    requests: int
    input_tokens: int
    hit_tokens: int
    hit_rate: float
    trace_max_hit_rate: float
    ratio_to_max: float
    elapsed_s: float
    series: list[list[float]] = field(default_factory=list)
    label: str = ""
    working_set_bytes: int = 0
    policy: str = "lru"
    engine: str = "daemon"


def from_latencies(system: str, op: str, value_bytes: int, batch: int, threads: int, elapsed_s: float,
                   batches_done: int, lat_s: list[float] | np.ndarray, transport: str = "tcp") -> Record:
    """A Record from a count of batches moved in ``elapsed_s`` and their latencies (seconds)."""
    lat = np.asarray(lat_s, dtype=np.float64) * 1e3
    keys = batches_done * batch
    gbps = 0.0 if op == "exists" else keys * value_bytes / elapsed_s / 1e9
    p50, p99, p999 = (float(x) for x in np.percentile(lat, [50, 99, 99.9])) if lat.size else (0.0, 0.0, 0.0)
    return Record(system, op, value_bytes, batch, threads, gbps, keys / elapsed_s, p50, p99, p999,
                  transport=transport, latencies_ms=[float(x) for x in lat])


def versions() -> dict[str, str]:
    """Versions of everything that shapes the figures; absent packages are left out."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("gcache", "numpy", "msgpack", "redis", "hiredis", "mooncake-transfer-engine-non-cuda",
                 "prometheus-client", "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                            "python": platform.python_version(), "versions": versions()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
        with open("/proc/meminfo") as f:
            info["mem_bytes"] = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return info


def write_json(path: str, kind: str, records: list[dict[str, Any]], **extra: Any) -> None:
    """Write ``{"kind", "machine", "records", ...extra}`` to ``path`` (directories are created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"kind": kind, "machine": machine_info(), "records": records, **extra}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def write_report(path: str, kind: str, records: list[dict[str, Any]], markdown: str, **extra: Any) -> str:
    """write_json() plus the markdown table beside it (same name, .md), printed too; returns
    the markdown's path."""
    write_json(path, kind, records, **extra)
    md = os.path.splitext(path)[0] + ".md"
    with open(md, "w") as f:
        f.write(markdown)
    print(markdown)
    print(f"wrote {path}, {md}")
    return md


def validate(doc: dict[str, Any]) -> list[str]:
    """Problems with a result document (empty when it is well formed): the schema check the
    tests and anyone consuming the JSON can share."""
    problems = []
    if "machine" not in doc or "cpus" not in doc.get("machine", {}):
        problems.append("no machine info")
    kind = doc.get("kind")
    want = {"throughput": THROUGHPUT_FIELDS, "hitrate": HITRATE_FIELDS}.get(kind) if isinstance(kind, str) else None
    if want is None:
        return problems + [f"unknown kind {kind!r}"]
    recs = doc.get("records")
    if not isinstance(recs, list) or not recs:
        return problems + ["no records"]
    for i, r in enumerate(recs):
        missing = [f for f in want if f not in r]
        if missing:
            problems.append(f"record {i} lacks {missing}")
        elif kind == "throughput" and r["system"] not in SYSTEMS:
            problems.append(f"record {i}: unknown system {r['system']!r}")
        elif kind == "hitrate" and not 0.0 <= r["hit_rate"] <= r["trace_max_hit_rate"] + 1e-9:
            problems.append(f"record {i}: hit rate {r['hit_rate']} outside [0, trace max]")
    return problems
