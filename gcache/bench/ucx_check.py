"""``gcache bench ucx-check``: UCX beside plain TCP, in the same run: 16 x 1 MiB puts and gets
through gcache.Client.

    gcache bench ucx-check [--rounds 30] [--nodes 1]     # or: python -m gcache.bench.ucx_check

For each transport (gcache over TCP; gcache over UCX with UCX_TLS=tcp; gcache over UCX with
UCX_TLS=posix,cma,self) a fresh local cluster of --ucx daemons is started with that environment,
one client moves batches of 16 values of 1 MiB, and the median batch time gives GB/s. The
ceilings are measured in the same run: memcpy of 16 MiB and one raw TCP stream (gcache.bench).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence

from gcache import argtypes

MiB = 1 << 20
#: (row name, transport, UCX_TLS or None for the environment's own)
CASES = (("gcache/tcp", "tcp", None), ("gcache/ucx tcp", "ucx", "tcp"), ("gcache/ucx sm", "ucx", "posix,cma,self"))


def measure(addresses: list[str], transport: str, rounds: int, batch: int, size: int) -> dict[str, float]:
    """GB/s of ``batch`` x ``size`` puts and gets, median of ``rounds`` after 3 warm-up rounds."""
    import numpy as np

    from gcache.client import Client, LocalPath
    from gcache.protocol import Status
    from gcache.transport import Transport

    rng = np.random.default_rng(1)
    values = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(batch)]
    out = [np.empty(size, np.uint8) for _ in range(batch)]
    keys = [f"bench/{i}" for i in range(batch)]
    res = {}
    with Client(addresses, transport=Transport(transport), timeout_s=30, local=LocalPath.OFF) as c:
        for op in ("put", "get"):
            times = []
            for r in range(rounds + 3):
                t0 = time.perf_counter()
                if op == "put":
                    ok = c.put(keys, values) == [Status.OK] * batch
                else:
                    ok = c.get_into(keys, out).hits == batch
                dt = time.perf_counter() - t0
                if not ok:
                    raise RuntimeError(f"ucx-check: {op} failed")
                if r >= 3:  # warm-up: connections, first touches
                    times.append(dt)
            res[op] = batch * size / statistics.median(times) / 1e9
        if not all(np.array_equal(a, b) for a, b in zip(out, values)):
            raise RuntimeError("ucx-check: get returned other bytes than were put")
    return res


def ceilings(size: int, batch: int) -> dict[str, float]:
    """memcpy of one batch and one raw TCP stream (put and get), GB/s."""
    import numpy as np

    from gcache.bench.rawsock import RawSocketPeer

    src, dst = np.ones(size * batch, np.uint8), np.empty(size * batch, np.uint8)
    np.copyto(dst, src)
    t = []
    for _ in range(10):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t.append(time.perf_counter() - t0)
    out = {"memcpy": size * batch / statistics.median(t) / 1e9}
    peer = RawSocketPeer(size * batch)
    try:
        for op in ("put", "get"):
            out[f"raw tcp {op}"] = peer.measure(op, size * batch, 2.0)[0]
    finally:
        peer.close()
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=argtypes.count, default=30, help="timed batches per op (default %(default)s)")
    p.add_argument("--nodes", type=argtypes.count, default=1, help="local daemons (default %(default)s)")
    p.add_argument("--batch", type=argtypes.count, default=16, help="values per batch (default %(default)s)")
    p.add_argument("--size", type=argtypes.count, default=MiB, help="bytes per value (default %(default)s)")


def run_cli(args: argparse.Namespace) -> int:
    from gcache.cluster import LocalCluster
    from gcache.transport import ucx

    ok, why = ucx.available()
    print(f"UCX: {why}")
    rows = []
    for name, transport, tls in CASES:
        if transport == "ucx" and not ok:
            print(f"{name}: skipped ({why})")
            continue
        old = os.environ.get("UCX_TLS")
        if tls:
            os.environ["UCX_TLS"] = tls
        try:
            with LocalCluster(nodes=args.nodes, mem=f"{max(256, 4 * args.batch * args.size // MiB)}MiB",
                              extra_args=["--ucx", "--no-local"]) as cluster:
                rows.append((name, measure(cluster.addresses, transport, args.rounds, args.batch, args.size)))
        finally:
            if old is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = old
    ceil = ceilings(args.size, args.batch)
    print(f"\n{args.batch} x {args.size // 1024} KiB per batch, {args.nodes} daemon(s), median of {args.rounds}")
    print(f"{'':16} {'put GB/s':>9} {'get GB/s':>9}")
    for name, r in rows:
        print(f"{name:16} {r['put']:9.2f} {r['get']:9.2f}")
    for name, v in ceil.items():
        print(f"{'ceiling ' + name:16} {v:9.2f}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gcache.bench.ucx_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
