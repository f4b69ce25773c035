"""/healthz and /readyz on the metrics port of live daemons and masters, and ``gcache health``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from gcache.cluster import free_port

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
    p = health("--daemon", d0, "--daemon", d1, "--master-metrics", m0, "--masters", cluster.master_url, "--json",
               env=env)
    assert p.returncode == 0, p.stdout + p.stderr
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


def test_unregistered_daemon_and_leaderless_master_are_live_not_ready(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    mport, dport = free_port(), free_port()
    raft = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    # a master whose two peers never start: live, but its group has no leader
    master = subprocess.Popen([*GCACHE, "master", "--listen", f"127.0.0.1:{free_port()}", "--raft", raft[0],
                               "--peers", ",".join(raft), "--token-file", str(token), "--metrics-port", str(mport)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # a daemon whose masters do not answer: live, not registered
    daemon = subprocess.Popen([*GCACHE, "daemon", "--listen", "127.0.0.1:0", "--mem", "8MiB", "--no-pretouch",
                               "--masters", f"gcache://127.0.0.1:{free_port()}", "--token-file", str(token),
                               "--metrics-port", str(dport)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for port in (mport, dport):
            poll(lambda port=port: get(f"127.0.0.1:{port}", "/healthz")[0] == 200, what=f"/healthz on {port}")
        code, body = get(f"127.0.0.1:{dport}", "/readyz")
        assert code == 503 and not body["checks"]["registered"]["ok"] and body["checks"]["arena"]["ok"]
        code, body = get(f"127.0.0.1:{mport}", "/readyz")
        assert code == 503 and body["checks"]["leader"]["detail"] == "no Raft leader"
        p = health("--daemon", f"127.0.0.1:{dport}", "--master-metrics", f"127.0.0.1:{mport}")
        assert p.returncode == 1 and "not registered" in p.stdout and "no Raft leader" in p.stdout
        p = health("--daemon", f"127.0.0.1:{free_port()}", "--json")  # nothing there
        assert p.returncode == 1 and not json.loads(p.stdout)["targets"][0]["live"]
        daemon.terminate()  # SIGTERM while it waits to register: a clean, prompt exit
        assert daemon.wait(timeout=10) == 0
    finally:
        for proc in (master, daemon):
            proc.terminate()
        for proc in (master, daemon):
            proc.wait(timeout=30)


def test_health_without_targets_says_what_to_give():
    env = {k: v for k, v in os.environ.items() if k not in ("GCACHE_MASTERS", "GCACHE_CONFIG")}
    p = health(env=env)
    assert p.returncode == 2 and "--daemon" in p.stderr
