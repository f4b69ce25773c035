"""/healthz and /readyz on the metrics port of live daemons and masters, and ``gcache health``.
(Live but not ready, a daemon that cannot register and a master without quorum: test_three_hosts.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

GCACHE = [sys.executable, "-m", "gcache"]


def get(address: str, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def poll(fn, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        try:
            out = fn()
            if out:
                return out
        except OSError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def health(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*GCACHE, "health", *args], check=False, capture_output=True, text=True, timeout=60,
                          env=env)


def metrics_address(proc) -> str:
    with open(proc.ready_file + ".metrics") as f:
        return f.read().strip()


def test_ready_daemons_and_master_then_a_drained_node_is_not_ready(metrics_cluster):
    cluster = metrics_cluster
    d0, d1 = (metrics_address(d) for d in cluster.daemons)
    m0 = metrics_address(cluster.master_procs[0])
    code, body = get(d0, "/healthz")
    assert code == 200 and body["ok"] and body["checks"]["serving"]["ok"]
    code, body = get(d0, "/readyz")
    assert code == 200, body
    assert {"serving", "arena", "registered", "not_fenced", "member"} <= set(body["checks"])
    code, body = get(m0, "/readyz")
    assert code == 200 and "leader" in body["checks"]["leader"]["detail"]
    assert "gcache_membership_epoch" in urllib.request.urlopen(f"http://{m0}/metrics", timeout=5).read().decode()

    env = {**os.environ, "GCACHE_TOKEN_FILE": str(cluster.token_file)}
    # a loaded machine can delay a heartbeat past --suspect-after: the master is then rightly not
    # ready until the node is UP again, so wait for a healthy verdict with a deadline
    args = ("--daemon", d0, "--daemon", d1, "--master-metrics", m0, "--masters", cluster.master_url, "--json")

    last: list[subprocess.CompletedProcess] = []

    def healthy():
        last[:] = [health(*args, env=env)]
        return last[0] if last[0].returncode == 0 else None

    try:
        p = poll(healthy, 20, "a healthy verdict")
    except AssertionError:
        raise AssertionError(last[0].stdout + last[0].stderr) from None
    doc = json.loads(p.stdout)
    assert doc["ok"] and len(doc["targets"]) == 4 and all(t["ready"] for t in doc["targets"])

    # a drained node hands its keys over and leaves: still live, no longer ready
    dr = subprocess.run([*GCACHE, "drain", "node0", "--masters", cluster.master_url, "--timeout", "60"],
                        check=False, capture_output=True, text=True, timeout=90, env=env)
    assert dr.returncode == 0, dr.stderr
    poll(lambda: get(d0, "/readyz")[0] == 503, what="node0 not ready")
    code, body = get(d0, "/readyz")
    assert not body["checks"]["member"]["ok"] and get(d0, "/healthz")[0] == 200
    p = health("--daemon", d0, "--daemon", d1, env=env)
    assert p.returncode == 1 and "NOT healthy" in p.stdout and "drained" in p.stdout


def test_health_without_targets_says_what_to_give():
    env = {k: v for k, v in os.environ.items() if k not in ("GCACHE_MASTERS", "GCACHE_CONFIG")}
    p = health(env=env)
    assert p.returncode == 2 and "--daemon" in p.stderr
