"""Prometheus metrics of one gcached daemon, served over HTTP on 127.0.0.1.

Two kinds of figure, kept apart so the data path pays almost nothing:
- per request (``RequestMetrics.observe``): one histogram observation of the request's
  latency, labelled by op (its ``_count`` is the request count), and two counter increments
  per batch (keys and payload bytes), never per key;
- store state (hits and misses per tier, evictions, demotions, arena and disk use): read from
  ``Store.stats()`` when Prometheus scrapes, by a custom collector, so the hot path never
  updates them.

Each daemon has its own ``CollectorRegistry``: two daemons in one process (tests) do not mix
their numbers, and the default registry's process metrics are not mixed in either.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Latency buckets from 50 µs (a small exists) to 2.5 s (a batch of 16 MiB values on a busy box).
BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)

# Store.stats() (and ServerContext.counters()) counter -> (metric name, help, labels)
STORE_COUNTERS = {
    "hits_ram": ("gcache_hits", "keys found, by tier", {"tier": "ram"}),
    "hits_nvme": ("gcache_hits", "keys found, by tier", {"tier": "nvme"}),
    "misses": ("gcache_misses", "keys not found (including checksum failures)", {}),
    "puts": ("gcache_puts", "values stored", {}),
    "put_bytes": ("gcache_put_bytes", "value bytes stored", {}),
    "full": ("gcache_full", "puts refused because RAM and the demotion queue were full", {}),
    "evictions": ("gcache_evictions", "values evicted from RAM", {}),
    "demotions": ("gcache_demotions", "evicted values written to the NVMe tier", {}),
    "demotion_failures": ("gcache_demotion_failures", "evicted values the NVMe tier could not take", {}),
    "demotion_drops": ("gcache_demotion_drops", "evicted values dropped: demotion queue full", {}),
    "promotions": ("gcache_promotions", "NVMe hits copied back into RAM", {}),
    "corrupt": ("gcache_corrupt", "NVMe reads that failed their checksum", {}),
    "requests_stalled": ("gcache_requests_stalled",
                         "connections reset: a request's payload or reply moved no byte for --progress-timeout", {}),
    "requests_too_slow": ("gcache_requests_too_slow",
                          "connections reset: a request's payload fell below 1 MiB/s after --frame-timeout", {}),
    "demotion_skips": ("gcache_demotion_skips", "evicted values not written to the NVMe tier (not worth it)", {}),
    "demotions_superseded": ("gcache_demotions_superseded",
                             "demotions dropped: the value was deleted or overwritten meanwhile", {}),
    "promotions_dropped": ("gcache_promotions_dropped",
                           "NVMe hits not promoted: deleted or overwritten while read", {}),
    "disk_reads_refused": ("gcache_disk_reads_refused",
                           "NVMe hits answered as misses: no room to promote them nor in --disk-read-budget", {}),
    "dropped": ("gcache_dropped", "values dropped whole (a node declared down, a ring change it missed)", {}),
    "disk_write_errors": ("gcache_disk_write_errors", "NVMe tier writes that failed (a full or failing disk)", {}),
    "disk_corrupt": ("gcache_disk_corrupt", "NVMe records dropped: they failed their checksum", {}),
    "disk_reclaimed_segments": ("gcache_disk_reclaimed_segments", "NVMe segments reclaimed for space", {}),
}
STORE_GAUGES = {
    "ram_capacity": ("gcache_ram_capacity_bytes", "RAM arena size"),
    "ram_used": ("gcache_ram_used_bytes", "RAM arena bytes allocated"),
    "ram_keys": ("gcache_ram_keys", "values in RAM"),
    "ram_value_bytes": ("gcache_ram_value_bytes", "bytes of the values in RAM (ram_used less slot rounding)"),
    "demote_queue_bytes": ("gcache_demote_queue_bytes", "evicted bytes waiting for the NVMe tier"),
    "disk_budget": ("gcache_disk_budget_bytes", "NVMe tier byte budget"),
    "disk_used": ("gcache_disk_used_bytes",
                  "NVMe tier bytes occupied (records of deleted values too, until their segment is reclaimed)"),
    "disk_keys": ("gcache_disk_keys", "values in the NVMe tier"),
    "disk_read_buffer_bytes": ("gcache_disk_read_buffer_bytes",
                               "bytes of NVMe hits held outside the arena until their reply is sent"),
    "disk_read_budget": ("gcache_disk_read_budget_bytes", "--disk-read-budget"),
    "meta_budget_held": ("gcache_meta_budget_held_bytes", "bytes of the --meta-budget held by requests being read"),
}


class StoreCollector:
    """Reads ``stats()`` (a dict of ints) at scrape time and exposes it as counters/gauges."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self):
        s = self._stats()
        families: dict[str, CounterMetricFamily] = {}
        for key, (name, help_, labels) in STORE_COUNTERS.items():
            fam = families.get(name)
            if fam is None:
                fam = families[name] = CounterMetricFamily(name, help_, labels=list(labels))
            fam.add_metric(list(labels.values()), float(s.get(key, 0)))
        yield from families.values()
        for key, (name, help_) in STORE_GAUGES.items():
            if key in s:
                yield GaugeMetricFamily(name, help_, value=float(s[key]))


class RequestMetrics:
    """Per-request figures of one daemon, and the HTTP endpoint that serves them."""

    OPS = ("ping", "put", "get", "exists", "delete", "stats", "error")

    def __init__(self, stats: Callable[[], dict] | None = None) -> None:
        self.registry = CollectorRegistry()
        lat = Histogram("gcache_request_seconds", "time to serve one request (batch), by op", ["op"],
                        buckets=BUCKETS, registry=self.registry)
        keys = Counter("gcache_request_keys", "keys in requests, by op", ["op"], registry=self.registry)
        byt = Counter("gcache_bytes", "payload bytes, by direction and path (tcp, local: the shared-memory "
                      "path, copied through the arena or inline over its Unix socket, ucx)",
                      ["direction", "path"], registry=self.registry)
        # label children resolved once: observe() does no label lookups
        self._lat = {op: lat.labels(op) for op in self.OPS}
        self._keys = {op: keys.labels(op) for op in self.OPS}
        self._bytes = {(d, p): byt.labels(d, p) for d in ("in", "out") for p in self.PATHS}
        self._lat_family, self._keys_family = lat, keys
        if stats is not None:
            self.registry.register(StoreCollector(stats))
        self.address = ""
        self._server: Any = None  # the WSGI server, once serving

    PATHS = ("tcp", "local", "ucx")

    def observe(self, op: str, t0: float, nkeys: int = 0, bytes_in: int = 0, bytes_out: int = 0,
                path: str = "tcp") -> None:
        """Count one served request that started at ``time.perf_counter() == t0``."""
        lat = self._lat.get(op)
        if lat is None:  # an op added after this list was written: count it under its own name
            lat = self._lat[op] = self._lat_family.labels(op)
            self._keys[op] = self._keys_family.labels(op)
        lat.observe(time.perf_counter() - t0)
        if nkeys:
            self._keys[op].inc(nkeys)
        if bytes_in:
            self._bytes["in", path].inc(bytes_in)
        if bytes_out:
            self._bytes["out", path].inc(bytes_out)

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> str:
        """Serve /metrics on host:port (0 picks a free port); returns "host:port"."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        self.address = f"{host}:{server.server_port}"
        return self.address

    def attach(self, server: Any, address: str) -> None:
        """Serve through ``server`` (an HTTP server with shutdown()/server_close(), e.g. the health
        endpoints'), found at ``address``, instead of serve()."""
        self._server, self.address = server, address

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def parse_text(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}, summed over nothing (for stats/tests)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def scrape(address: str, timeout_s: float = 2.0) -> dict[str, float]:
    """GET http://address/metrics and parse it."""
    from urllib.request import urlopen

    with urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:
        return parse_text(resp.read().decode())


def histogram_quantile(m: dict[str, float], op: str, q: float) -> float:
    """Estimate the q-quantile (seconds) of gcache_request_seconds{op} from its buckets, by
    linear interpolation inside the bucket (as PromQL's histogram_quantile does); 0 if empty."""
    buckets = sorted((float(k.split('le="')[1].split('"')[0]), v) for k, v in m.items()
                     if k.startswith("gcache_request_seconds_bucket{") and f'op="{op}"' in k)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return 0.0
    rank, prev_le, prev_n = q * total, 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 1.0)
        prev_le, prev_n = le, n
    return prev_le


def cluster_table(endpoints: dict[str, str]) -> str:
    """One row per node (node id -> metrics address) and a cluster total: requests, keys,
    bytes in/out, get latency, hit rate per tier, evictions, demotions, arena and disk use."""
    from gcache.sizes import format_size

    head = (f"{'node':<22} {'requests':>9} {'keys':>9} {'in':>9} {'out':>9} {'get p50':>8} {'get p99':>8} "
            f"{'hit ram':>8} {'hit nvme':>8} {'evicted':>8} {'demoted':>8} {'ram used':>9} {'disk used':>9}")
    rows: list[str] = [head]
    tot: dict[str, float] = {}
    for node, addr in sorted(endpoints.items()):
        try:
            m = scrape(addr)
        except OSError as exc:
            rows.append(f"{node:<22} metrics at {addr} unreachable: {exc}")
            continue
        f = {
            "req": sum(v for k, v in m.items() if k.startswith("gcache_request_seconds_count")),
            "keys": sum(v for k, v in m.items() if k.startswith("gcache_request_keys_total")),
            "in": sum(v for k, v in m.items() if k.startswith('gcache_bytes_total{direction="in"')),
            "out": sum(v for k, v in m.items() if k.startswith('gcache_bytes_total{direction="out"')),
            "ram": m.get('gcache_hits_total{tier="ram"}', 0.0),
            "nvme": m.get('gcache_hits_total{tier="nvme"}', 0.0),
            "miss": m.get("gcache_misses_total", 0.0),
            "ev": m.get("gcache_evictions_total", 0.0),
            "dem": m.get("gcache_demotions_total", 0.0),
            "ram_used": m.get("gcache_ram_used_bytes", 0.0),
            "disk_used": m.get("gcache_disk_used_bytes", 0.0),
        }
        for k, v in f.items():
            tot[k] = tot.get(k, 0.0) + v
        rows.append(_row(node, f, histogram_quantile(m, "get", 0.5), histogram_quantile(m, "get", 0.99), format_size))
    if len(rows) > 2:
        rows.append(_row("cluster", tot, None, None, format_size))
    return "\n".join(rows)


def _row(name: str, f: dict[str, float], p50: float | None, p99: float | None, fmt) -> str:
    looked = f["ram"] + f["nvme"] + f["miss"]
    pct = (lambda x: f"{100 * x / looked:.1f}%") if looked else (lambda x: "-")
    ms = (lambda x: f"{1e3 * x:.2f}ms") if p50 is not None else (lambda x: "")
    return (f"{name:<22} {f['req']:>9.0f} {f['keys']:>9.0f} {fmt(int(f['in'])):>9} {fmt(int(f['out'])):>9} "
            f"{ms(p50):>8} {ms(p99):>8} {pct(f['ram']):>8} {pct(f['nvme']):>8} {f['ev']:>8.0f} {f['dem']:>8.0f} "
            f"{fmt(int(f['ram_used'])):>9} {fmt(int(f['disk_used'])):>9}")
