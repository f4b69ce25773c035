"""Opt-in (``make image-test``; debootstrap + apt + pip downloads, minutes): build the image's
filesystem without a container engine. Debian bookworm is debootstrapped into a folder, every
RUN/COPY/ENV/USER of deploy/Containerfile is replayed into it with chroot (in a private mount
namespace), and then, as the image's user, in a private network namespace, the ENTRYPOINT starts
``gcache daemon`` and a put/get goes through it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
MIRROR = "http://deb.debian.org/debian"

pytestmark = [
    pytest.mark.skipif(os.environ.get("GCACHE_IMAGE_TEST") != "1", reason="slow (downloads, minutes): make image-test"),
    pytest.mark.timeout(3600),
]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, argument) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not buf:
            continue
        buf += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            if buf.strip():
                word, _, arg = buf.strip().partition(" ")
                out.append((word.upper(), arg.strip()))
            buf = ""
    return out


def sh(cmd: list[str], timeout: int = 1800, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, **kw)
    assert p.returncode == 0, f"{shlex.join(cmd)}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


def in_root(root: Path, script: str, env: dict[str, str], user: str | None = None, net: bool = True,
            timeout: int = 1800) -> subprocess.CompletedProcess:
    """Run ``script`` with /bin/sh inside ``root`` (private mounts; no network unless ``net``)."""
    envs = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    userspec = f"--userspec={user} " if user else ""
    outer = (f"mount --bind /dev {root}/dev && mount -t proc proc {root}/proc && "
             + ("" if net else "ip link set lo up && ")
             + f"exec chroot {userspec}{root} /usr/bin/env -i {envs} /bin/sh -ec {shlex.quote(script)}")
    flags = ["--mount", "--fork", "--pid"] + ([] if net else ["--net"])
    return sh(["unshare", *flags, "sh", "-ec", outer], timeout=timeout)


def test_containerfile_filesystem_runs_a_daemon(tmp_path):
    for tool in ("debootstrap", "unshare", "chroot"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (make image-test installs debootstrap)")
    steps = instructions(CONTAINERFILE.read_text())
    base = steps[0]
    assert base == ("FROM", "debian:bookworm-slim"), base
    context = tmp_path / "context"
    context.mkdir()
    sh([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(context), str(ROOT)])
    root = tmp_path / "rootfs"
    sh(["debootstrap", "--variant=minbase", "bookworm", str(root), MIRROR], timeout=1800)
    shutil.copy("/etc/resolv.conf", root / "etc" / "resolv.conf")
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
    # what a build host passes a build (--build-arg): its proxy settings and the CA bundle its
    # network needs, so pip inside reaches PyPI as pip outside does
    build_env = {k: v for k, v in os.environ.items() if k.lower() in ("http_proxy", "https_proxy", "no_proxy")}
    ca = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    if os.path.exists(ca):
        shutil.copy(ca, root / "etc" / "build-host-ca.crt")
        build_env["PIP_CERT"] = "/etc/build-host-ca.crt"
    user, entrypoint = None, None
    for word, arg in steps[1:]:
        if word == "RUN":
            in_root(root, arg, {**env, **build_env}, user)
        elif word == "COPY":
            *srcs, dest = arg.split()
            target = root / dest.lstrip("/")
            target.mkdir(parents=True, exist_ok=True)
            for pattern in srcs:
                matched = list(context.glob(pattern))
                assert matched, f"COPY {pattern}: nothing in the build context"
                for f in matched:
                    shutil.copy(f, target / f.name)
        elif word == "ENV":
            k, _, v = arg.partition("=")
            env[k] = v
        elif word == "USER":
            user = arg
        elif word == "ENTRYPOINT":
            entrypoint = " ".join(shlex.quote(a) for a in __import__("json").loads(arg))
        elif word in ("WORKDIR", "EXPOSE", "CMD"):
            continue
        else:
            raise AssertionError(f"the replay does not know {word}")
    assert entrypoint == "gcache" and user == "10001:10001"
    script = f"""
        cd /tmp
        {entrypoint} --version
        {entrypoint} daemon --listen 127.0.0.1:7400 --mem 16MiB --no-pretouch --ready-file /tmp/ready \\
            --metrics-port 9400 > /tmp/daemon.log 2>&1 &
        daemon=$!
        i=0; while [ ! -f /tmp/ready ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
        cat /tmp/daemon.log
        {entrypoint} put greeting "hello from the image" --nodes 127.0.0.1:7400
        {entrypoint} get greeting --nodes 127.0.0.1:7400
        python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9400/readyz').read().decode())"
        id -u
        kill -TERM $daemon
        wait $daemon && echo "daemon stopped cleanly"
    """
    out = in_root(root, script, env, user, net=False, timeout=300).stdout
    assert re.search(r"^gcache \d", out, re.MULTILINE), out
    assert "gcached listening on 127.0.0.1:7400" in out and "OK\nhello from the image\n" in out, out
    assert '"ok": true' in out and "\n10001\n" in out and out.strip().endswith("daemon stopped cleanly"), out
