"""``gcache bench instructions``: CPU instructions per batch on the client and per request in
the daemon's handler, counted by valgrind's callgrind. Instruction counts do not move with the
machine's load the way wall-clock and CPU time do (2 shared cores), so small changes to the
request path show up here first; the throughput bench says what they are worth.

Each figure is counted twice, over ``n/2`` and ``n`` batches, in a fresh process under
callgrind; the difference over ``n/2`` batches cancels start-up and warm-up:

* client: ``gcache.Client`` (TCP) against a local cluster started once, outside callgrind (the
  daemons are not counted); the client's main thread;
* daemon: ``gcache.server.handler.Handler`` serving a socketpair in the main thread (the
  daemon's per-connection loop, store included), requests sent by a second thread.

    gcache bench instructions --ops exists,get,put --batch 16,128 --nodes 1,3
    PYTHONPATH=/path/to/older/checkout gcache bench instructions ...   # an older build, same way
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from gcache import argtypes
from gcache.sizes import format_size, parse_size

NATIVE = "none (pure Python)"  # what ran the hot loops: gcache has no native extension yet


def counted(out_file: str) -> int:
    """Instructions of a callgrind output file (the ``totals:``, or ``summary:``, line)."""
    with open(out_file) as f:
        m = re.search(r"^(?:totals|summary): (\d+)", f.read(), re.MULTILINE)
    if m is None:
        raise ValueError(f"{out_file}: no totals line (not a callgrind output file?)")
    return int(m.group(1))


def per_batch(small: int, large: int, n_small: int, n_large: int) -> float:
    """Instructions per batch from two runs that differ only in their number of batches."""
    if n_large <= n_small:
        raise ValueError("the second run must have more batches")
    return (large - small) / (n_large - n_small)


def _callgrind(args: list[str], workdir: str, tag: str) -> int:
    """Run ``python -m gcache.bench.instructions --child ...`` under callgrind; the main thread's
    instructions."""
    out = os.path.join(workdir, f"cg.{tag}")
    cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
           sys.executable, "-m", "gcache.bench.instructions", "--child", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} under callgrind failed ({done.returncode}): {done.stderr[-2000:]}")
    return counted(out + "-01")  # thread 1: the main thread


def measure(side: str, op: str, batch: int, size: int, n: int, addresses: list[str], workdir: str) -> float:
    """Instructions per batch (client) or per request (daemon) of ``op`` over ``batch`` keys."""
    base = [side, op, str(batch), str(size), ",".join(addresses) or "-"]
    small = _callgrind([*base, str(n // 2)], workdir, f"{side}.{op}.{batch}.a")
    large = _callgrind([*base, str(n)], workdir, f"{side}.{op}.{batch}.b")
    return per_batch(small, large, n // 2, n)


# -- what runs under callgrind ---------------------------------------------------------------
def _client(op: str, batch: int, size: int, n: int, addresses: list[str]) -> None:
    from gcache import Client

    with Client(addresses, local="off", timeout_s=120, connect_timeout_s=60) as c:
        keys = [[f"k{b}-{i}".encode() for i in range(batch)] for b in range(8)]
        val = os.urandom(size)
        for ks in keys:
            c.put(ks, [val] * batch)
        bufs = [bytearray(size) for _ in range(batch)]
        for i in range(n):
            ks = keys[i % 8]
            if op == "exists":
                c.exists(ks)
            elif op == "get":
                c.get_into(ks, bufs)
            else:
                c.put(ks, [val] * batch)


def _daemon(op: str, batch: int, size: int, n: int) -> None:
    import socket
    import threading

    from gcache.net.stream import SocketStream
    from gcache.protocol import Op
    from gcache.server.handler import Handler, ServerContext
    from gcache.tier.store import Store, StoreConfig
    from gcache.transport.connection import Connection

    store = Store(StoreConfig(mem_bytes=max(64 << 20, 16 * batch * size), pretouch=False))
    a, b = socket.socketpair()
    handler = Handler(SocketStream(a), ServerContext(store, "n0", 1 << 30, None))
    keys = [f"k{i}".encode() for i in range(batch)]
    val = memoryview(os.urandom(size))
    put = ({"ns": "default", "keys": keys, "sizes": [size] * batch}, [val] * batch)

    def client() -> None:
        conn = Connection("n0", "pair", SocketStream(b), 60.0)
        for i in range(n + 1):  # the first put stores the keys
            dl = time.monotonic() + 60
            if op == "put" or i == 0:
                conn.send(Op.PUT, put[0], put[1], dl, 60)
            else:
                conn.send(Op.EXISTS if op == "exists" else Op.GET, {"ns": "default", "keys": keys}, [], dl, 60)
            _meta, plen = conn.recv_reply(dl)
            conn.discard(plen, dl)
        b.shutdown(socket.SHUT_RDWR)

    t = threading.Thread(target=client)
    t.start()
    handler.serve()
    t.join()


def _child(argv: list[str]) -> None:
    side, op, batch, size, addrs, n = argv
    if side == "client":
        _client(op, int(batch), int(size), int(n), addrs.split(","))
    else:
        _daemon(op, int(batch), int(size), int(n))


# -- command line ----------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", default="exists,get,put", help="operations (default %(default)s)")
    p.add_argument("--batch", default="16,128", help="keys per batch, comma-separated (default %(default)s)")
    p.add_argument("--size", default="4KiB", help="value size (default %(default)s)")
    p.add_argument("--nodes", default="1,3", help="local daemons for the client's figures, comma-separated "
                                                  "(default %(default)s)")
    p.add_argument("--batches", type=argtypes.count, default=400,
                   help="batches in the longer of the two runs per figure (default %(default)s; ~15 s a figure)")
    p.add_argument("--side", default="client,daemon", help="client, daemon or both (default %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the records (JSON, and a .md table)")


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"gcache bench instructions: {what} must be comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"gcache bench instructions: {what} must be integers >= 1, got {text!r}")
    return out


def run_cli(args: argparse.Namespace) -> int:
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in ("exists", "get", "put")]
    sides = [s for s in args.side.split(",") if s]
    if bad or not ops or any(s not in ("client", "daemon") for s in sides) or not sides:
        raise SystemExit("gcache bench instructions: --ops takes exists,get,put and --side client,daemon")
    batches, nodes = _ints(args.batch, "--batch"), _ints(args.nodes, "--nodes")
    size = parse_size(args.size)
    if args.batches < 4:
        raise SystemExit("gcache bench instructions: --batches must be >= 4")
    if shutil.which("valgrind") is None:
        print("gcache bench instructions needs valgrind (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    from gcache.bench.records import write_report
    from gcache.cluster import LocalCluster

    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gcache-icount-") as work:
        def add(side: str, op: str, batch: int, n_nodes: int, addresses: list[str]) -> None:
            ins = measure(side, op, batch, size, args.batches, addresses, work)
            records.append({"side": side, "op": op, "batch": batch, "size": size, "nodes": n_nodes,
                            "instructions": round(ins), "per_key": round(ins / batch), "native": NATIVE})
            print(f"{side:6s} {op:6s} {batch:4d} x {format_size(size)} nodes {n_nodes}: {ins:12,.0f} "
                  f"instructions ({ins / batch:,.0f} per key)", flush=True)

        if "daemon" in sides:
            for op in ops:
                for batch in batches:
                    add("daemon", op, batch, 1, [])
        if "client" in sides:
            for n_nodes in nodes:
                with LocalCluster(nodes=n_nodes, mem="256MiB") as cluster:
                    for op in ops:
                        for batch in batches:
                            add("client", op, batch, n_nodes, list(cluster.addresses))
    md = ["| side | op | batch | nodes | instructions | per key |", "|---|---|---|---|---|---|"]
    md += [f"| {r['side']} | {r['op']} | {r['batch']} x {format_size(r['size'])} | {r['nodes']} | "
           f"{r['instructions']:,} | {r['per_key']:,} |" for r in records]
    md.append(f"\nnative code: {NATIVE}; {args.batches // 2} batches counted per figure (callgrind)\n")
    if args.json:
        write_report(args.json, "instructions", records, "\n".join(md), batches=args.batches)
    else:
        print("\n".join(md))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    else:
        ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        add_arguments(ap)
        sys.exit(run_cli(ap.parse_args()))
