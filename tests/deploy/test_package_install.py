"""Opt-in (``make package-test``; minutes and downloads): the wheel installs into a clean venv
beside sglang 0.5.23's own requirement set and ``pip check`` is clean; and it runs with the
lowest versions pyproject.toml admits.

On a CPU machine sglang's CUDA-only requirements (kernels, CUDA bindings, the CUDA torch) are
replaced by the CPU torch; the only complaints ``pip check`` may then make are about those."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy.packaging_util import CUDA_ONLY, ROOT, lowest_pins, sglang_cpu_requirement_lines

pytestmark = [
    pytest.mark.skipif(os.environ.get("GCACHE_PACKAGE_TEST") != "1",
                       reason="slow (downloads, minutes): run `make package-test`"),
    pytest.mark.timeout(3600),
]


def sh(*cmd, cwd=None, timeout=1800, env=None) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "GCACHE_NODES")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    src = tmp_path_factory.mktemp("src")
    sh("git", "-C", ROOT, "archive", "--format=tar", "-o", src / "src.tar", "HEAD")
    sh("tar", "-xf", src / "src.tar", "-C", src)
    # an isolated build: a fresh environment with only the build-system requirements
    sh(sys.executable, "-m", "build", "--wheel", "--outdir", out, src, env=clean_env())
    (whl,) = out.glob("gcache-*.whl")
    return whl


def new_venv(path: Path) -> Path:
    sh(sys.executable, "-m", "venv", path)
    py = path / "bin" / "python"
    sh(py, "-m", "pip", "install", "-q", "--upgrade", "pip", env=clean_env())
    return py


def test_wheel_beside_sglang_0_5_23_pip_check_clean(wheel, tmp_path):
    py = new_venv(tmp_path / "venv")
    req = tmp_path / "sglang-cpu.txt"
    req.write_text("\n".join(sglang_cpu_requirement_lines()) + "\n")
    pip = [py, "-m", "pip", "install", "-q"]
    # sglang itself without its declared deps (they name the CUDA torch), then its requirement set
    # with the CPU torch and the gcache wheel, resolved together in one pip run
    sh(*pip, "--no-deps", "sglang==0.5.23", env=clean_env())
    sh(*pip, "-r", req, f"{wheel}[router]", env=clean_env())
    p = subprocess.run([py, "-m", "pip", "check"], check=False, capture_output=True, text=True, env=clean_env())
    problems = []
    for line in p.stdout.splitlines():
        m = re.match(r"sglang 0\.5\.23 (?:requires|has requirement) ([A-Za-z0-9_.\-]+)", line)
        if m and canonicalize_name(m.group(1)) in CUDA_ONLY:
            continue  # a CUDA-only requirement, replaced by the CPU torch on purpose
        problems.append(line)
    print(p.stdout)
    assert not problems, "pip check:\n" + "\n".join(problems)
    out = sh(py, "-c", "import sys, gcache, sglang_adapter, router; "
                       "print(gcache.__version__, 'grpc' in sys.modules)", cwd=tmp_path, env=clean_env()).stdout
    assert out.split() == ["0.1.0", "False"]
    assert sh(tmp_path / "venv" / "bin" / "gcache", "--version", cwd=tmp_path, env=clean_env()).stdout.startswith(
        "gcache ")


SMOKE = """
from gcache import Client, Status
from gcache.cluster import LocalCluster
from urllib.request import urlopen
with LocalCluster(nodes=2, mem="16MiB", masters=1, extra_args=["--no-pretouch", "--metrics-port", "0"],
                  master_args=["--metrics-port", "0"]) as c:
    with Client(c.master_url, token=c.token, timeout_s=5.0) as cl:
        assert cl.put_one("k", b"v" * 1000) is Status.OK
        assert bytes(cl.get_one("k")) == b"v" * 1000
    for p in (*c.daemons, *c.master_procs):  # metrics + health endpoints on the oldest prometheus-client
        addr = open(p.ready_file + ".metrics").read().strip()
        assert b"gcache_" in urlopen(f"http://{addr}/metrics").read()
        assert b'"ok": true' in urlopen(f"http://{addr}/readyz").read()
print("smoke ok")
"""


def test_lowest_allowed_versions_run_a_cluster(wheel, tmp_path):
    py = new_venv(tmp_path / "venv")
    low = tmp_path / "lowest.txt"
    low.write_text("\n".join(lowest_pins()) + "\n")
    sh(py, "-m", "pip", "install", "-q", "-c", low, wheel, env=clean_env())
    freeze = sh(py, "-m", "pip", "freeze", env=clean_env()).stdout
    installed = {canonicalize_name(n): Version(v) for n, _, v in
                 (line.partition("==") for line in freeze.splitlines() if "==" in line)}
    for pin in lowest_pins():
        name, version = pin.split("==")
        assert installed.get(canonicalize_name(name)) == Version(version), f"{pin} not installed:\n{freeze}"
    out = sh(py, "-c", SMOKE, cwd=tmp_path, env=clean_env(), timeout=300).stdout
    assert "smoke ok" in out
