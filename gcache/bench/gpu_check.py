"""``gcache bench gpu-check``: the staging path on a host with a CUDA GPU.

    gcache bench gpu-check [--size-mib 1] [--count 64]      # or: python -m gcache.bench.gpu_check

Starts a local cluster, puts CUDA tensors through the pinned staging pool, reads them back into
fresh CUDA tensors, checks them byte-exact, and prints GB/s next to the device<->pinned-host
copy bandwidth measured in the same run (the ceiling staging can reach on this host). Exit 2
when torch sees no CUDA device, 1 when the bytes differ.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from gcache import argtypes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=argtypes.positive, default=1.0, help="bytes per value, in MiB (default 1)")
    p.add_argument("--count", type=argtypes.count, default=64, help="values per batch (default 64)")
    p.add_argument("--rounds", type=argtypes.count, default=5, help="timed rounds (default 5)")


def run_cli(args: argparse.Namespace) -> int:
    import torch

    from gcache.client import Client
    from gcache.cluster import LocalCluster
    from gcache.protocol import Status

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible to torch; nothing to check", file=sys.stderr)
        return 2
    n = int(args.size_mib * (1 << 20)) // 4
    src = [torch.rand(n, device="cuda") for _ in range(args.count)]
    total = n * 4 * args.count
    host = torch.empty(n * 4 * args.count, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.rounds):
        off = 0
        for s in src:
            host[off:off + n * 4].copy_(s.view(torch.uint8), non_blocking=True)
            off += n * 4
    torch.cuda.synchronize()
    d2h = total * args.rounds / (time.perf_counter() - t) / 1e9
    with LocalCluster(nodes=1, mem=f"{max(1, 2 * total >> 30) + 1}GiB") as cluster, Client(cluster.addresses) as c:
        keys = [f"gpu/{i}" for i in range(args.count)]
        t = time.perf_counter()
        for _ in range(args.rounds):
            if c.put(keys, src) != [Status.OK] * args.count:
                raise RuntimeError("gpu-check: a put failed")
        put = total * args.rounds / (time.perf_counter() - t) / 1e9
        dst = [torch.empty_like(s) for s in src]
        t = time.perf_counter()
        for _ in range(args.rounds):
            if c.get_into(keys, dst).hits != args.count:
                raise RuntimeError("gpu-check: a get missed")
        torch.cuda.synchronize()
        get = total * args.rounds / (time.perf_counter() - t) / 1e9
        ok = all(torch.equal(a, b) for a, b in zip(src, dst))
    print(f"device {torch.cuda.get_device_name()}: device->pinned host {d2h:.2f} GB/s")
    print(f"gcache put from CUDA tensors {put:.2f} GB/s ({put / d2h:.2f} of it), get into CUDA tensors "
          f"{get:.2f} GB/s ({get / d2h:.2f}); byte-exact: {ok}")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gcache.bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
