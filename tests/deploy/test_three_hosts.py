"""docs/deploy.md's systemd path, end to end on one machine: three hosts (three addresses in a
private network namespace), one config file each made from deploy/gcache.toml, each running the
units' ExecStart commands; ``gcache health`` and ``gcache status`` see 3 masters and 3 daemons."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_three_hosts_one_config_file_each(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip for a private network namespace")
    p = subprocess.run(["unshare", "--net", sys.executable, "-m", "tests.deploy.three_hosts", str(tmp_path)],
                       check=False, capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                     os.environ.get("PYTHONPATH")]))})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    logs = "\n".join(f"--- {k}\n{v}" for k, v in r["logs"].items())
    assert r["checks"] == [0, 0, 0]  # config problems per host file
    master, daemon = r["alone"]["9300"], r["alone"]["9400"]
    assert master["live"] and not master["ready"] and master["checks"]["leader"]["detail"] == "no Raft leader"
    assert daemon["live"] and not daemon["ready"] and not daemon["checks"]["registered"]["ok"]
    assert daemon["checks"]["arena"]["ok"]
    rc, out = r["alone_health"]
    assert rc == 1 and "not registered" in out and "no Raft leader" in out and "NOT healthy" in out
    assert r["sigterm_exit"][0] == 0 and r["sigterm_exit"][1] < 10
    assert r["health_rc"] == 0, json.dumps(r["health"], indent=1) + logs
    kinds = [t["kind"] for t in r["health"]["targets"]]
    assert kinds.count("master") == 3 and kinds.count("daemon") == 1
    nodes = r["status"]["membership"]["nodes"]
    assert sorted((n["id"], n["state"], n["address"]) for n in nodes) == [
        ("gpu-a", "up", "198.18.0.11:7400"), ("gpu-b", "up", "198.18.0.12:7400"), ("gpu-c", "up", "198.18.0.13:7400")]
    assert r["puts"] == ["OK"] * 30 and r["gets"] == 30, logs
