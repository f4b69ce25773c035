"""A daemon's Prometheus endpoint, scraped for real, and `gcache stats` reading it."""

import os
import subprocess
import sys

import numpy as np
import pytest

from gcache.client import Client

try:  # the TCP data plane is what these counters instrument; keep the shared-memory path out
    from gcache.client.client import LocalPath

    TCP_ONLY = {"local": LocalPath.OFF}
except ImportError:
    TCP_ONLY = {}
from gcache.server.metrics import histogram_quantile, parse_text, scrape
from tests.conftest import poll


def metrics_address(daemon, timeout_s=10.0):
    path = daemon.ready_file + ".metrics"
    assert poll(lambda: os.path.exists(path), timeout_s), f"{path} never written"
    with open(path) as f:
        return f.read().strip()


def delta(before, after, name):
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_counters_move_with_traffic(make_cluster):
    cluster = make_cluster(nodes=1, mem="1MiB", extra_args=["--metrics-port", "0", "--no-pretouch"])
    addr = metrics_address(cluster.daemons[0])
    m0 = scrape(addr)
    assert m0["gcache_ram_capacity_bytes"] == 1 << 20
    vals = [np.full(100_000, i, dtype=np.uint8) for i in range(4)]
    with Client(cluster.addresses, namespace="m", **TCP_ONLY) as c:
        c.put([f"k{i}" for i in range(4)], vals)
        out = [np.empty(100_000, np.uint8) for _ in range(3)]
        assert c.get_into(["k0", "k1", "absent"], out).hits == 2
        assert c.exists(["k2", "nope"]) == [True, False]
        m1 = scrape(addr)
        assert delta(m0, m1, 'gcache_request_seconds_count{op="put"}') == 1  # one request per batch
        assert delta(m0, m1, 'gcache_request_keys_total{op="put"}') == 4
        assert delta(m0, m1, 'gcache_bytes_total{direction="in",path="tcp"}') == 400_000
        assert delta(m0, m1, 'gcache_bytes_total{direction="out",path="tcp"}') == 200_000
        assert delta(m0, m1, 'gcache_hits_total{tier="ram"}') == 2
        assert delta(m0, m1, "gcache_misses_total") == 1
        assert delta(m0, m1, 'gcache_request_keys_total{op="exists"}') == 2
        assert m1["gcache_ram_keys"] == 4 and m1["gcache_ram_used_bytes"] >= 400_000
        assert 0 < histogram_quantile(m1, "get", 0.5) <= 2.5
        c.put([f"big{i}" for i in range(12)], [np.zeros(100_000, np.uint8)] * 12)  # 1.6 MB into 1 MiB
        m2 = scrape(addr)
        assert delta(m1, m2, "gcache_evictions_total") >= 6
        assert m2["gcache_ram_used_bytes"] <= 1 << 20
        stats = subprocess.run([sys.executable, "-m", "gcache", "stats", "--nodes", cluster.addresses[0]],
                               check=False, capture_output=True, text=True, timeout=30)
    assert stats.returncode == 0, stats.stderr
    table = stats.stdout.split("\n\n", 1)[1].splitlines()
    assert table[0].split()[:3] == ["node", "requests", "keys"]
    row = table[1].split()
    assert row[0] == cluster.addresses[0] and int(row[1]) >= 5 and row[7] == "66.7%"  # 2 ram hits of 3 lookups


def test_daemon_without_metrics_port_serves_none(make_cluster):
    cluster = make_cluster(nodes=1, mem="1MiB", extra_args=["--no-pretouch"])
    with Client(cluster.addresses, namespace="m") as c:
        (stats,) = c.stats().values()
        assert "ram_keys" in stats and "metrics_address" not in stats


def test_histogram_quantile_interpolates_within_a_bucket():
    text = """# TYPE gcache_request_seconds histogram
gcache_request_seconds_bucket{le="0.001",op="get"} 0
gcache_request_seconds_bucket{le="0.002",op="get"} 10
gcache_request_seconds_bucket{le="+Inf",op="get"} 10
gcache_request_seconds_count{op="get"} 10
gcache_request_seconds_sum{op="get"} 0.015
"""
    m = parse_text(text)
    assert histogram_quantile(m, "get", 0.5) == pytest.approx(0.0015)
    assert histogram_quantile(m, "put", 0.5) == 0.0


def test_idle_connections_to_the_metrics_port_are_bounded_and_closed(monkeypatch):
    """A probe held 50 half-sent requests open for a minute: 50 threads, and the listen queue
    (5) full. Now idle connections are closed after READ_TIMEOUT_S, at most MAX_CONNECTIONS are
    served at once, and a probe still answers meanwhile."""
    import socket
    import threading
    import urllib.request

    from prometheus_client import CollectorRegistry

    from gcache.ops import health

    monkeypatch.setattr(health, "READ_TIMEOUT_S", 0.5)
    monkeypatch.setattr(health._Quiet, "timeout", 0.5)
    monkeypatch.setattr(health, "MAX_CONNECTIONS", 8)
    srv = health.HealthServer(CollectorRegistry(), lambda: {"up": (True, "")}, lambda: {"up": (True, "")})
    try:
        host, port = srv.address.rsplit(":", 1)
        before = threading.active_count()
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(30)]
        for s in idle:
            s.sendall(b"GET /metr")  # half a request, then nothing
        assert threading.active_count() - before <= 8 + 1
        with urllib.request.urlopen(f"http://{srv.address}/healthz", timeout=5) as r:
            assert r.status == 200
        for s in idle:  # each is closed by the server once it has idled READ_TIMEOUT_S
            assert s.recv(1024) is not None
            s.close()
        assert poll(lambda: threading.active_count() <= before + 1, 10)
    finally:
        srv.stop()


def test_bytes_over_the_local_path_are_counted(make_cluster):
    """A probe: gcache_bytes_total read 0 for traffic over the shared-memory path (the default
    for engines on the daemon's host), so the throughput panel showed nothing for it."""
    from gcache import LocalPath

    cluster = make_cluster(nodes=1, mem="8MiB", extra_args=["--metrics-port", "0", "--no-pretouch"])
    addr = metrics_address(cluster.daemons[0])
    m0 = scrape(addr)
    vals = [np.full(300_000, i, dtype=np.uint8) for i in range(4)]
    with Client(cluster.addresses, namespace="m", local=LocalPath.FORCE, local_min_bytes=0) as c:
        assert c.put([f"k{i}" for i in range(4)], vals) == [0] * 4
        out = [np.empty(300_000, np.uint8) for _ in range(3)]
        assert c.get_into(["k0", "k1", "absent"], out).hits == 2
    m1 = scrape(addr)
    assert delta(m0, m1, 'gcache_bytes_total{direction="in",path="local"}') == 1_200_000
    assert delta(m0, m1, 'gcache_bytes_total{direction="out",path="local"}') == 600_000


def test_every_store_stat_has_a_metric(tiered):
    """A probe: disk_write_errors (a full disk) and other STATS fields had no metric."""
    import re

    import gcache.tier.store as store_mod
    from gcache.server.metrics import STORE_COUNTERS, STORE_GAUGES

    exported = set(STORE_COUNTERS) | set(STORE_GAUGES)
    stats = {k for k in tiered().stats() if not k.startswith("pool_")}
    from pathlib import Path

    source = Path(store_mod.__file__).read_text()
    counted = set(re.findall(r'self\.counters\["(\w+)"(?:\]| if)', source))
    counted |= set(re.findall(r'else "(\w+)"\] \+=', source))
    assert stats | counted <= exported, sorted((stats | counted) - exported)
