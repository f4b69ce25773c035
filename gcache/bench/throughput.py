"""``gcache bench``: put/get GB/s and per-batch latency, beside the raw-socket ceiling.

Each figure is measured in the same run as the ceiling it is divided by, because the
machines this runs on are shared and noisy. Gets are checked byte-exact once per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from gcache.bench.rawsock import RawSocketPeer
from gcache.client import Client
from gcache.cluster import LocalCluster
from gcache.protocol import Status
from gcache.sizes import format_size, parse_size


@dataclass
class Record:
    system: str
    op: str
    value_bytes: int
    batch: int
    threads: int
    gbps: float
    ops_per_s: float
    p50_ms: float
    p99_ms: float
    ceiling_gbps: float
    ratio: float


def percentile_ms(lat: list[float], q: float) -> float:
    return float(np.percentile(np.array(lat), q) * 1e3) if lat else 0.0


def measure(client: Client, op: str, size: int, batch: int, threads: int, seconds: float,
            batches_per_thread: int) -> tuple[float, list[float]]:
    """Aggregate GB/s and per-batch latencies of ``threads`` threads doing ``op`` for ``seconds``."""
    rng = np.random.default_rng(size * 31 + threads)
    data = [rng.integers(0, 256, size * batch, dtype=np.uint8) for _ in range(threads)]
    keys = [[[f"bench/{t}/{size}/{b}/{j}" for j in range(batch)] for b in range(batches_per_thread)]
            for t in range(threads)]
    lats: list[list[float]] = [[] for _ in range(threads)]
    done = [0] * threads
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads + 1)

    def worker(t: int) -> None:
        views = [data[t][j * size:(j + 1) * size] for j in range(batch)]
        dest = np.empty(size * batch, dtype=np.uint8)
        dviews = [dest[j * size:(j + 1) * size] for j in range(batch)]
        if op == "get":  # make sure the keys are there, and check one batch byte-exact
            for ks in keys[t]:
                client.put(ks, views)
            res = client.get_into(keys[t][0], dviews)
            if res.hits != batch or not np.array_equal(dest, data[t]):
                errors.append(AssertionError(f"get returned wrong or missing bytes ({res.hits}/{batch} hits)"))
        try:
            barrier.wait()
            t_end = time.perf_counter() + seconds
            i = 0
            while True:
                ks = keys[t][i % batches_per_thread]
                t0 = time.perf_counter()
                if op == "put":
                    st = client.put(ks, views)
                    ok = all(s is Status.OK for s in st)
                else:
                    ok = client.get_into(ks, dviews).hits == batch
                lats[t].append(time.perf_counter() - t0)
                if not ok:
                    raise AssertionError(f"{op} of a batch failed")
                done[t] += 1
                i += 1
                if t0 >= t_end:
                    break
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    for th in pool:
        th.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    total = sum(done) * batch * size
    return total / elapsed / 1e9, [x for lat in lats for x in lat]


def run_bench(addresses: list[str], sizes: list[int], batch: int, threads_list: list[int], seconds: float,
              mem_budget: int, progress: bool = True) -> list[Record]:
    from tqdm import tqdm

    steps = [(op, size, th) for size in sizes for op in ("put", "get") for th in threads_list]
    bar = tqdm(total=len(steps) + 2 * len(sizes), desc="bench", disable=not progress, leave=False)
    records: list[Record] = []
    peer = RawSocketPeer(max(sizes) * batch)
    client = Client(addresses, namespace="bench", timeout_s=30.0)
    try:
        ceilings: dict[tuple[str, int], float] = {}
        for size in sizes:
            for op in ("put", "get"):
                bar.set_postfix_str(f"ceiling {op} {format_size(size)}")
                gbps, lat = peer.measure(op, size * batch, seconds)
                ceilings[(op, size)] = gbps
                records.append(Record("socket", op, size, batch, 1, gbps, len(lat) / seconds * batch,
                                      percentile_ms(lat, 50), percentile_ms(lat, 99), gbps, 1.0))
                bar.update()
        for op, size, threads in steps:
            bar.set_postfix_str(f"gcache {op} {format_size(size)} x{threads}")
            per_thread = max(1, min(8, mem_budget // (2 * threads * batch * size)))
            gbps, lat = measure(client, op, size, batch, threads, seconds, per_thread)
            ceiling = ceilings[(op, size)]
            records.append(Record("gcache", op, size, batch, threads, gbps, gbps * 1e9 / size,
                                  percentile_ms(lat, 50), percentile_ms(lat, 99), ceiling, gbps / ceiling))
            bar.update()
    finally:
        bar.close()
        client.close()
        peer.close()
    return records


def format_table(records: list[Record]) -> str:
    head = f"{'system':<7} {'op':<4} {'value':>7} {'batch':>5} {'thr':>3} {'GB/s':>7} {'ops/s':>9} " \
           f"{'p50 ms':>8} {'p99 ms':>8} {'ceiling':>8} {'ratio':>6}"
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(f"{r.system:<7} {r.op:<4} {format_size(r.value_bytes):>7} {r.batch:>5} {r.threads:>3} "
                     f"{r.gbps:>7.2f} {r.ops_per_s:>9.0f} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f} "
                     f"{r.ceiling_gbps:>8.2f} {r.ratio:>6.2f}")
    return "\n".join(lines)


def machine_info() -> dict:
    import msgpack

    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "numpy": np.__version__, "msgpack": msgpack.version}


def run_cli(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    if args.batch < 1 or any(t < 1 for t in threads) or args.seconds <= 0:
        raise SystemExit("gcache bench: --batch, --threads and --seconds must be positive")
    cluster = None
    if args.nodes.isdigit():
        cluster = LocalCluster(nodes=int(args.nodes), mem=args.mem).start()
        addresses = cluster.addresses
        mem_budget = int(args.nodes) * parse_size(args.mem)
        print(f"local cluster: {len(addresses)} daemons, {args.mem} RAM each: {', '.join(addresses)}")
    else:
        addresses = [a for a in args.nodes.split(",") if a]
        mem_budget = 1 << 30
    try:
        records = run_bench(addresses, sizes, args.batch, threads, args.seconds, mem_budget,
                            progress=not args.no_progress)
    finally:
        if cluster is not None:
            cluster.stop()
    print(format_table(records))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "records": [asdict(r) for r in records]}, f, indent=1)
        print(f"wrote {args.json}")
    return 0
