"""The Mooncake Store peer, measured inside a private network namespace.

Mooncake Store (PyPI ``mooncake-transfer-engine-non-cuda``) is the open-source system closest
to gcache. Some of its listeners (the embedded HTTP metadata server, transfer-engine ports)
bind 0.0.0.0 whatever they are told, so the whole peer runs under ``unshare -n`` with only
loopback up: nothing it opens is reachable from outside, and fixed ports cannot collide.

Layout inside the namespace (``serve``): ``mooncake_master`` with its HTTP metadata server; a
*holder* process that mounts the global segment (the memory that stores values, like a gcache
daemon's arena); and the measuring client, which mounts no segment, so every byte crosses TCP
between two processes as it does for gcache's remote path. The client uses the zero-copy calls
on registered buffers: ``batch_get_into``, ``batch_is_exist``, and for puts
``batch_upsert_from`` (``batch_put_from`` on a key that exists is a no-op in 0.3.13, so
re-putting the same keys would measure nothing; the first load uses ``batch_put_from``).

The parent (``MooncakePeer``) talks to ``serve`` over pipes, one JSON line per measurement.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from gcache.bench.driver import BenchError, Step, drive
from gcache.bench.records import Record, from_latencies
from gcache.bench.targets import Buffers, Target, Unavailable, keys_per_thread

INSTALL_HINT = "install it with `make bench-peers` (pip install mooncake-transfer-engine-non-cuda; " \
               "apt-get install libibverbs1)"
MASTER_PORT, META_PORT = 50051, 8080
META_URL = f"http://127.0.0.1:{META_PORT}/metadata"


def _store(segment_bytes: int):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", META_URL, segment_bytes, 0, "tcp", "", f"127.0.0.1:{MASTER_PORT}")
    if rc != 0:
        raise BenchError(f"mooncake setup failed with {rc}")
    return s


def hold(segment_bytes: int) -> None:
    """Mount a global segment of ``segment_bytes`` and keep it until stdin closes."""
    store = _store(segment_bytes)  # the segment lives as long as this object
    print("held", flush=True)
    sys.stdin.read()
    store.close()


def _wait_port(port: int, deadline: float) -> None:
    import socket

    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise BenchError(f"mooncake_master did not listen on {port}") from None
            time.sleep(0.05)


def _load(store, keys: list[str], ptrs: list[int], sizes: list[int], timeout_s: float = 10.0) -> None:
    """Put ``keys`` before a measurement. Objects read in the previous measurement stay leased
    (unremovable, unevictable) for the master's lease time, so a full segment is retried."""
    deadline = time.monotonic() + timeout_s
    while True:
        rc = store.batch_put_from(keys, ptrs, sizes)
        if min(rc) >= 0:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"mooncake could not load {len(keys)} x {sizes[0]} B: codes {sorted(set(rc))}")
        store.remove_all()
        time.sleep(0.05)


def measure(store, cmd: dict) -> dict:
    op, size, batch, threads, seconds = cmd["op"], cmd["size"], cmd["batch"], cmd["threads"], cmd["seconds"]
    bufs = Buffers(size, batch, threads)
    arrays = bufs.src + bufs.dst
    for a in arrays:
        if store.register_buffer(a.ctypes.data, a.nbytes) != 0:
            raise BenchError("mooncake register_buffer failed")
    n = keys_per_thread(cmd["mem_budget"], size, batch, threads)
    keys = [[[f"b/{t}/{size}/{i}/{j}" for j in range(batch)] for i in range(n)] for t in range(threads)]
    sp = [[a.ctypes.data + j * size for j in range(batch)] for a in bufs.src]
    dp = [[a.ctypes.data + j * size for j in range(batch)] for a in bufs.dst]
    sizes = [size] * batch
    try:
        for t in range(threads):
            for ks in keys[t]:
                _load(store, ks, sp[t], sizes)
        got = store.batch_get_into(keys[0][0], dp[0], sizes)
        if got != sizes or not np.array_equal(bufs.dst[0], bufs.src[0]):
            raise BenchError(f"mooncake returned wrong or missing bytes ({got[:2]}...)")

        def step_for(t: int) -> Step:
            ks, s, d = keys[t], sp[t], dp[t]
            if op == "put":
                return lambda i: min(store.batch_upsert_from(ks[i % n], s, sizes)) == 0
            if op == "get":
                return lambda i: store.batch_get_into(ks[i % n], d, sizes) == sizes
            return lambda i: all(x == 1 for x in store.batch_is_exist(ks[i % n]))

        timing = drive([step_for(t) for t in range(threads)], seconds, f"mooncake {op}")
    finally:
        store.remove_all()
        for a in arrays:
            store.unregister_buffer(a.ctypes.data)
    rec = from_latencies("mooncake", op, size, batch, threads, timing.elapsed_s, timing.batches,
                         timing.latencies_s)
    return rec.to_json(keep_latencies=True)


def serve(segment_bytes: int, log_dir: str) -> int:
    """Inside the namespace: master, holder, client; then one JSON reply per stdin line."""
    import mooncake

    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    here = os.path.dirname(mooncake.__file__)
    with open(os.path.join(log_dir, "master.log"), "wb") as log:
        master = subprocess.Popen(
            [os.path.join(here, "mooncake_master"), f"--rpc_port={MASTER_PORT}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={META_PORT}", "--metrics_host=127.0.0.1",
             "--enable_metric_reporting=false", "--default_kv_lease_ttl=1000"],
            stdout=log, stderr=subprocess.STDOUT)
    holder = None
    try:
        deadline = time.monotonic() + 30
        _wait_port(MASTER_PORT, deadline)
        _wait_port(META_PORT, deadline)
        with open(os.path.join(log_dir, "holder.log"), "wb") as log:
            holder = subprocess.Popen([sys.executable, "-m", "gcache.bench.mooncake_peer", "hold", str(segment_bytes)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "held":
            raise BenchError("the mooncake segment holder did not start (see holder.log)")
        store = _store(0)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            try:
                print(json.dumps(measure(store, json.loads(line))), flush=True)
            except BenchError as exc:
                print(json.dumps({"error": str(exc)}), flush=True)
        store.close()
        return 0
    finally:
        if holder is not None:
            if holder.stdin:
                holder.stdin.close()
            try:
                holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                holder.kill()
        master.terminate()
        try:
            master.wait(timeout=10)
        except subprocess.TimeoutExpired:
            master.kill()


class MooncakePeer(Target):
    """The parent side: runs ``serve`` under ``unshare -n`` and asks it for each figure."""

    system, transport = "mooncake", "tcp"

    def __init__(self, mem_budget: int, start_timeout_s: float = 60.0) -> None:
        self.mem_budget = mem_budget
        self.log_dir = tempfile.mkdtemp(prefix="gcache-bench-mooncake-")
        inner = f"ip link set lo up && exec {sys.executable} -m gcache.bench.mooncake_peer serve " \
                f"{mem_budget} {self.log_dir}"
        with open(os.path.join(self.log_dir, "serve.log"), "wb") as log:
            self.proc = subprocess.Popen(["unshare", "-n", "sh", "-c", inner], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True)
        line = self._readline(start_timeout_s)
        if not json.loads(line or "{}").get("ready"):
            self.close()
            raise BenchError(f"mooncake peer did not start: {self.log_tail()}")

    def _readline(self, timeout_s: float) -> str:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline() if ready else ""

    def log_tail(self) -> str:
        out = []
        for name in ("serve.log", "holder.log", "master.log"):
            try:
                with open(os.path.join(self.log_dir, name), errors="replace") as f:
                    lines = [ln for ln in f if ln[:1] in ("E", "F") or "Error" in ln]
                out += [f"{name}: {ln.strip()}" for ln in lines[-3:]]
            except OSError:
                pass
        return " | ".join(out) or "(no log)"

    def measure(self, op: str, size: int, batch: int, threads: int, seconds: float) -> Record:
        assert self.proc.stdin is not None
        cmd = {"op": op, "size": size, "batch": batch, "threads": threads, "seconds": seconds,
               "mem_budget": self.mem_budget}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self._readline(max(120.0, seconds * 20)) or '{"error": "no reply"}')
        if "error" in reply:
            raise BenchError(f"mooncake {op}: {reply['error']} ({self.log_tail()})")
        return Record(**reply)

    def close(self) -> None:
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.log_dir, ignore_errors=True)


def make_mooncake_peer(mem_budget: int) -> MooncakePeer | Unavailable:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return Unavailable("mooncake", f"Mooncake Store is not importable ({exc}); {INSTALL_HINT}")
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return Unavailable("mooncake", "needs `unshare` and `ip` to run in a private network namespace")
    try:
        return MooncakePeer(mem_budget)
    except (BenchError, OSError) as exc:
        return Unavailable("mooncake", f"could not start ({exc}); it needs root for `unshare -n`")


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        hold(int(sys.argv[2]))
    elif sys.argv[1] == "serve":
        sys.exit(serve(int(sys.argv[2]), sys.argv[3]))
    else:
        raise SystemExit("usage: python -m gcache.bench.mooncake_peer serve SEGMENT_BYTES LOG_DIR | hold SEGMENT_BYTES")
