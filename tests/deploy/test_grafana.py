"""deploy/grafana/gcache.json only queries metrics that a live daemon, master and router export,
with labels they carry."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gcache.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "gcache.json"
PROMETHEUS_OWN = {"up"}  # series Prometheus itself adds
SCRAPE_LABELS = {"job", "instance"}  # labels Prometheus adds to every series


def exprs(dash: dict) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return out


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label keys matched) for every ``name{...}`` selector in a PromQL expression."""
    out = []
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr):
        keys = {k for k in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(2))}
        out.append((m.group(1), keys))
    return out


def exported(text: str) -> dict[str, set[str]]:
    """name -> label keys seen, for every series a /metrics page declares or carries."""
    names: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            series = {"histogram": ["_bucket", "_count", "_sum"], "summary": ["_count", "_sum"]}.get(kind, [""])
            for suffix in series:
                names.setdefault(name + suffix, set())
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?", line)
            names.setdefault(m.group(1), set()).update(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(3) or ""))
    return names


def fetch(address: str, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def live_metrics(metrics_cluster) -> dict[str, set[str]]:
    from gcache import Client

    c = metrics_cluster
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "router", "serve", "--port", str(port), "--worker",
                               f"http://127.0.0.1:{free_port()}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        with Client(c.master_url, token=c.token, timeout_s=5.0) as cl:  # some traffic: every counter moves
            cl.put_one("k", b"v" * 4096)
            cl.get_one("k")
            cl.get_one("absent")
        pages = []
        for proc in (*c.daemons, c.master_procs[0]):
            with open(proc.ready_file + ".metrics") as f:
                pages.append(fetch(f.read().strip()))
        deadline = time.monotonic() + 60
        while True:
            try:
                pages.append(fetch(f"127.0.0.1:{port}"))
                break
            except OSError:
                assert router.poll() is None and time.monotonic() < deadline, "router did not start"
                time.sleep(0.1)
    finally:
        router.terminate()
        router.wait(timeout=30)
    names: dict[str, set[str]] = {}
    for page in pages:
        for k, v in exported(page).items():
            names.setdefault(k, set()).update(v)
    return names


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["schemaVersion"] >= 36
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["refId"] and t["expr"] for t in p["targets"])
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("throughput", "hit ratio", "latency", "evictions", "arena", "nvme", "epoch", "nodes by state",
                  "queue", "reason"):
        assert topic in titles, topic


def test_every_queried_metric_and_label_is_exported(live_metrics):
    dash = json.loads(DASHBOARD.read_text())
    used = set()
    for expr in exprs(dash):
        for name, keys in selectors(expr):
            used.add(name)
            if name in PROMETHEUS_OWN:
                continue
            assert name in live_metrics, f"the dashboard queries {name}, which nothing exports ({expr})"
            carried = live_metrics[name] | SCRAPE_LABELS
            if live_metrics[name]:  # a labelled family with no child yet shows no label names
                assert keys <= carried, f"{name} has no label {keys - carried} ({expr})"
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (g.strip() for g in group.split(",")):
                owners = [n for n, _ in selectors(expr) if live_metrics.get(n)]
                assert label in SCRAPE_LABELS or any(label in live_metrics[n] for n in owners) or not owners, \
                    f"grouping by {label!r}, which none of {owners} carries ({expr})"
    assert len(used) >= 30
    # and a renamed metric is caught: the check is not vacuous
    assert "gcache_hits_total" in live_metrics and "gcache_hit_total" not in live_metrics
