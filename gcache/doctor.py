"""``gcache doctor``: what this host can use to move bytes, and what gcache will use by default.

Each check says why when something is missing. Nothing here changes the system.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def check_memcpy() -> Check:
    a = np.ones(64 << 20, np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    t = time.perf_counter()
    for _ in range(8):
        np.copyto(b, a)
    return Check("memcpy", True, f"{_gbps(8 * a.nbytes, time.perf_counter() - t)} (the local path's ceiling)")


def check_tcp() -> Check:
    size = 64 << 20
    try:
        lsock = socket.create_server(("127.0.0.1", 0))
    except OSError as exc:
        return Check("tcp", False, f"cannot listen on 127.0.0.1: {exc}")
    port = lsock.getsockname()[1]
    buf = memoryview(bytearray(size))

    def serve() -> None:
        conn, _ = lsock.accept()
        got = 0
        while got < size:
            got += conn.recv_into(buf[got:] if got < size else buf)
        conn.sendall(b"k")
        conn.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    c = socket.create_connection(("127.0.0.1", port))
    data = memoryview(bytearray(size))
    t = time.perf_counter()
    c.sendall(data)
    c.recv(1)
    dt = time.perf_counter() - t
    c.close()
    lsock.close()
    return Check("tcp", True, f"loopback {_gbps(size, dt)} (one stream, one direction)")


def check_local_shm() -> list[Check]:
    out = []
    try:
        fd = os.memfd_create("gcache-doctor", 0)
        os.ftruncate(fd, 1 << 20)
        a, b = socket.socketpair(socket.AF_UNIX)
        socket.send_fds(a, [b"x"], [fd])
        _msg, fds, _f, _a = socket.recv_fds(b, 1, 1)
        mm = mmap.mmap(fds[0], 1 << 20)
        mm.close()
        for f in (fd, *fds):
            os.close(f)
        a.close()
        b.close()
        out.append(Check("local shm", True, "memfd + SCM_RIGHTS work: clients on this host copy straight "
                                            "from the daemon's arena"))
    except (OSError, AttributeError) as exc:
        out.append(Check("local shm", False, f"memfd/SCM_RIGHTS unavailable ({exc}): local clients use TCP"))
    try:
        st = os.statvfs("/dev/shm")
        out.append(Check("/dev/shm", True, f"{st.f_blocks * st.f_frsize / (1 << 30):.1f} GiB "
                                           "(the arena is a memfd; /dev/shm size does not limit it)"))
    except OSError as exc:
        out.append(Check("/dev/shm", False, str(exc)))
    return out


def check_hugepages() -> Check:
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                info[k] = v.strip()
    except OSError as exc:
        return Check("hugepages", False, str(exc))
    thp = "?"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    total = int(info.get("HugePages_Total", "0").split()[0])
    return Check("hugepages", total > 0, f"{total} reserved of {info.get('Hugepagesize', '?')}; transparent: {thp}"
                 + ("" if total else " (none reserved: the arena uses normal pages)"))


def check_ucx() -> Check:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # UCX prints its warnings on stdout
    try:
        from gcache.transport.ucx import available

        ok, why = available()
        return Check("ucx", ok, why)
    except ImportError:
        pass
    try:
        import ucxx

        return Check("ucx", True, f"ucxx {ucxx.__version__} importable (UCX {ucxx.get_ucx_version()})")
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return Check("ucx", False, f"ucxx not usable ({type(exc).__name__}: {exc}); "
                                   "install with: pip install 'gcache[ucx]'")


def check_rdma() -> Check:
    root = "/sys/class/infiniband"
    if not os.path.isdir(root):
        return Check("rdma", False, "no /sys/class/infiniband: the kernel has no InfiniBand/RoCE support here")
    devs = sorted(os.listdir(root))
    if not devs:
        return Check("rdma", False, "InfiniBand support loaded but no RDMA device present")
    try:
        import pyverbs  # noqa: F401

        via = "pyverbs importable"
    except ImportError:
        via = "pyverbs not installed (apt-get install python3-pyverbs); UCX uses verbs by itself"
    return Check("rdma", True, f"devices {', '.join(devs)}; {via}")


def check_cuda() -> list[Check]:
    out = []
    try:
        import torch

        if torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            out.append(Check("cuda", True, f"{len(names)} device(s): {', '.join(names)}; device tensors "
                                           "are staged through pinned host buffers"))
        else:
            out.append(Check("cuda", False, f"torch {torch.__version__} sees no CUDA device "
                                            "(CPU build, or no driver)"))
    except ImportError:
        out.append(Check("cuda", False, "torch not installed (pip install 'gcache[torch]')"))
    peermem = any(os.path.isdir(f"/sys/module/{m}") for m in ("nvidia_peermem", "nv_peer_mem"))
    out.append(Check("gpudirect rdma", peermem, "nvidia_peermem loaded" if peermem else
                     "nvidia_peermem not loaded: NICs cannot DMA into GPU memory; gcache stages through host"))
    return out


def check_disk(directory: str | None, size: int = 256 << 20) -> Check:
    d = directory or tempfile.gettempdir()
    try:
        fd, path = tempfile.mkstemp(prefix="gcache-doctor-", dir=d)
    except OSError as exc:
        return Check("disk", False, f"{d}: not writable ({exc})")
    try:
        data = np.ones(4 << 20, np.uint8)
        t = time.perf_counter()
        for off in range(0, size, len(data)):
            os.pwrite(fd, data.data, off)
        os.fsync(fd)
        w = time.perf_counter() - t
        buf = bytearray(len(data))
        t = time.perf_counter()
        for off in range(0, size, len(buf)):
            os.preadv(fd, [buf], off)
        r = time.perf_counter() - t
        st = os.statvfs(d)
        return Check("disk", True, f"{d}: write+fsync {_gbps(size, w)}, read {_gbps(size, r)} (page cache warm); "
                                   f"{st.f_bavail * st.f_frsize / (1 << 30):.0f} GiB free")
    except OSError as exc:
        return Check("disk", False, f"{d}: {exc}")
    finally:
        os.close(fd)
        os.unlink(path)


def run_checks(disk: str | None) -> list[Check]:
    checks = [check_memcpy(), check_tcp(), *check_local_shm(), check_ucx(), check_rdma(), *check_cuda(),
              check_hugepages(), check_disk(disk)]
    local = next(c for c in checks if c.name == "local shm").ok
    ucx = next(c for c in checks if c.name == "ucx").ok
    default = ("local shared memory to daemons on this host, TCP to the others" if local else "TCP everywhere")
    if ucx:
        default += "; UCX when enabled (daemon --ucx, Client(transport=UCX))"
    checks.append(Check("default", True, default))
    return checks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disk", default=None, help="directory to measure as the NVMe tier (default: the temp dir)")
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    checks = run_checks(args.disk)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
        return 0
    for c in checks:
        print(f"{'ok' if c.ok else '--':<3} {c.name:<15} {c.detail}")
    return 0


