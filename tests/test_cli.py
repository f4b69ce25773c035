"""The gcache command as a user runs it: up, put/get/exists/stats, bench --json, --help."""

import json
import os
import signal
import subprocess
import sys
import time

GCACHE = [sys.executable, "-m", "gcache"]


def run(*args, env=None, check=True):
    p = subprocess.run([*GCACHE, *args], capture_output=True, text=True, timeout=120, env=env, check=False)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_help_explains_every_command():
    out = run("--help").stdout
    for cmd in ("daemon", "up", "put", "get", "exists", "stats", "clear", "bench"):
        assert cmd in out
    assert "--disk-size" in run("daemon", "--help").stdout


def test_up_then_data_commands_then_ctrl_c(tmp_path):
    up = subprocess.Popen([*GCACHE, "up", "--nodes", "2", "--mem", "32MiB", "--disk", "--disk-size", "64MiB",
                           "--dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        nodes = None
        pids = []
        deadline = time.monotonic() + 30
        while nodes is None and time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line, up.stderr.read()
            if " pid " in line:
                pids.append(int(line.rsplit(" ", 1)[1]))
            if line.startswith("export GCACHE_NODES="):
                nodes = line.strip().split("=", 1)[1]
        assert nodes and nodes.count(",") == 1
        env = {**os.environ, "GCACHE_NODES": nodes}
        assert run("put", "greeting", "hello world", env=env).stdout.strip() == "OK"
        assert run("get", "greeting", env=env).stdout == "hello world"  # the exact bytes
        miss = run("get", "absent", env=env, check=False)
        assert miss.returncode == 1 and "NOT_FOUND" in miss.stderr
        ex = run("exists", "greeting", "absent", env=env, check=False)
        assert ex.stdout.splitlines() == ["greeting\tyes", "absent\tno"]
        stats = json.loads(run("stats", "--json", env=env).stdout)
        assert sum(s["ram_keys"] for s in stats.values()) == 1
        assert "ram used" in run("stats", env=env).stdout
    finally:
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=30)
    assert up.returncode == 0 and "cluster stopped" in out
    assert len(pids) == 2 and not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_get_writes_the_exact_bytes_and_put_reads_stdin(make_cluster):
    """`gcache get KEY > file` appended a newline to the value; stdout now gets the bytes as
    stored, so a value round-trips through put --file - and get byte for byte."""
    env = {**os.environ, "GCACHE_NODES": make_cluster(nodes=1, mem="16MiB").addresses[0]}
    value = bytes(range(256)) + b"no newline at the end"
    p = subprocess.run([*GCACHE, "put", "blob", "--file", "-"], input=value, capture_output=True, env=env,
                       timeout=120, check=False)
    assert p.returncode == 0 and p.stdout == b"OK\n", p.stderr
    p = subprocess.run([*GCACHE, "get", "blob"], capture_output=True, env=env, timeout=120, check=False)
    assert p.returncode == 0 and p.stdout == value, p.stderr
    assert run("put", "empty", "", env=env).stdout.strip() == "OK"  # an empty value, asked for
    p = subprocess.run([*GCACHE, "get", "empty"], capture_output=True, env=env, timeout=120, check=False)
    assert p.returncode == 0 and p.stdout == b""


def test_data_command_without_nodes_says_what_to_do():
    env = {k: v for k, v in os.environ.items() if k != "GCACHE_NODES"}
    p = run("get", "k", env=env, check=False)
    assert p.returncode != 0 and "--nodes" in p.stderr


def test_daemon_refuses_bad_sizes_clearly():
    p = run("daemon", "--listen", "127.0.0.1:0", "--mem", "lots", check=False)
    assert p.returncode == 2 and "cannot read size 'lots'" in p.stderr


def test_bench_json_has_the_documented_schema(tmp_path):
    out = tmp_path / "bench.json"
    p = run("bench", "--nodes", "2", "--mem", "64MiB", "--sizes", "64KiB", "--threads", "1", "--seconds", "0.2",
            "--ops", "put,get", "--peers", "none", "--no-plots", "--no-progress", "--json", str(out))
    assert "ratio" in p.stdout
    doc = json.loads(out.read_text())
    recs = doc["records"]
    assert {(r["system"], r["op"]) for r in recs} == {("socket", "put"), ("socket", "get"),
                                                       ("memcpy", "put"), ("memcpy", "get"),
                                                       ("gcache", "put"), ("gcache", "get")}
    for r in recs:
        for field in ("system", "op", "value_bytes", "batch", "threads", "gbps", "ops_per_s", "p50_ms", "p99_ms",
                      "p999_ms", "ceiling_gbps", "ratio"):
            assert field in r
        assert r["gbps"] > 0 and r["p999_ms"] >= r["p99_ms"] >= r["p50_ms"] > 0
    assert doc["machine"]["cpus"] >= 1


def test_up_with_masters_status_and_drain(tmp_path):
    up = subprocess.Popen([*GCACHE, "up", "--nodes", "2", "--mem", "32MiB", "--masters", "1", "--dir", str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        env = dict(os.environ)
        deadline = time.monotonic() + 30
        while "GCACHE_NODES" not in env and time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line, up.stderr.read()
            if line.startswith("export "):
                k, v = line[len("export "):].strip().split("=", 1)
                env[k] = v
        status = run("status", env=env).stdout
        assert "node0" in status and "node1" in status and status.count("UP") == 2
        # data commands find the cluster and its token the way `gcache up` printed them
        assert run("put", "greeting", "hello", env=env).stdout.strip() == "OK"
        nodes_only = {k: v for k, v in env.items() if k != "GCACHE_MASTERS"}
        # $GCACHE_NODES alone reaches every daemon with the token (a static node list routes by
        # addresses, not the masters' node ids, so only the fan-out commands are meaningful here)
        by_node = json.loads(run("stats", "--json", env=nodes_only).stdout)
        assert len(by_node) == 2 and sum(s["ram_keys"] for s in by_node.values()) == 1
        no_token = {k: v for k, v in env.items() if k not in ("GCACHE_TOKEN_FILE", "GCACHE_TOKEN")}
        assert run("exists", "greeting", "--token-file", env["GCACHE_TOKEN_FILE"],
                   env=no_token).stdout.splitlines() == ["greeting\tyes"]
        assert run("get", "greeting", "--masters", env["GCACHE_MASTERS"], env=nodes_only).stdout == "hello"
        stats = json.loads(run("stats", "--json", env=env).stdout)
        assert sum(s["ram_keys"] for s in stats.values()) == 1
        refused = run("get", "greeting", env=no_token, check=False)
        assert refused.returncode != 0 and "token" in refused.stderr.lower()
        doc = json.loads(run("status", "--json", env=env).stdout)
        assert doc["membership"]["epoch"] >= 2 and doc["master"]["is_leader"]
        out = run("drain", "node0", env=env).stdout
        assert "node0 drained and left the cluster" in out
        assert "node0" not in run("status", env=env).stdout
        bad = run("drain", "node1", env=env, check=False)
        assert bad.returncode == 1 and "last node" in bad.stderr
        refused = run("status", env=no_token, check=False)
        assert refused.returncode == 1 and "token" in refused.stderr
    finally:
        up.send_signal(signal.SIGINT)
        up.communicate(timeout=30)
    assert up.returncode == 0


def test_doctor_reports_every_capability_and_why(tmp_path):
    checks = {c["name"]: c for c in json.loads(run("doctor", "--json", "--disk", str(tmp_path)).stdout)}
    for name in ("memcpy", "tcp", "local shm", "ucx", "rdma", "cuda", "gpudirect rdma", "hugepages", "disk", "default"):
        assert name in checks and checks[name]["detail"]
    assert checks["tcp"]["ok"] and checks["local shm"]["ok"] and "GB/s" in checks["disk"]["detail"]
    assert str(tmp_path) in checks["disk"]["detail"]
    if not os.path.isdir("/sys/class/infiniband"):
        assert not checks["rdma"]["ok"] and "InfiniBand" in checks["rdma"]["detail"]
    assert os.listdir(tmp_path) == []  # the probe file is removed
    text = run("doctor", "--disk", str(tmp_path)).stdout
    assert "default" in text and "local shared memory" in text
