"""Client *processes*: the same gcache measurement run by N processes at once.

Threads in one Python process share a GIL; a fleet's clients are separate processes. Each
worker process builds its own client (its own namespace, so workers never overwrite each
other's keys), loads its keys, reports ready, and starts timing only when every worker is ready
(the parent releases them together). The figures add up: GB/s and keys/s are summed,
latencies are pooled. The record is named ``gcache/<transport>-<N>p``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, replace

from gcache.bench.driver import BenchError
from gcache.bench.records import Record
from gcache.bench.targets import GcacheLocal, GcacheTcp, Target

CLASSES = {"tcp": GcacheTcp, "local": GcacheLocal}


def run_workers(cmds: list[list[str]], seconds: float) -> list[Record]:
    """Start one process per command; when all have said ``ready`` (keys loaded), release them
    together with ``go``; their records (the last stdout line of each, JSON)."""
    workers = [subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for c in cmds]
    try:
        for w in workers:
            line = w.stdout.readline() if w.stdout else ""
            if line.strip() != "ready":
                raise BenchError(f"a worker process failed before timing: {line.strip() or 'no output'}")
        for w in workers:
            assert w.stdin is not None
            w.stdin.write("go\n")
            w.stdin.flush()
        recs = []
        for w in workers:
            out, _ = w.communicate(timeout=seconds * 10 + 120)
            if w.returncode != 0:
                raise BenchError(f"a worker process failed: exit {w.returncode}")
            recs.append(Record(**json.loads(out.strip().splitlines()[-1])))
        return recs
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()


def combine(recs: list[Record], transport: str) -> Record:
    """One record of processes running at once: rates summed, latencies pooled."""
    import numpy as np

    lat = [x for r in recs for x in r.latencies_ms]
    p50, p99, p999 = (float(x) for x in np.percentile(np.asarray(lat), [50, 99, 99.9])) if lat else (0.0,) * 3
    return replace(recs[0], gbps=sum(r.gbps for r in recs), ops_per_s=sum(r.ops_per_s for r in recs),
                   p50_ms=p50, p99_ms=p99, p999_ms=p999, transport=transport, latencies_ms=lat)


def wait_go() -> None:
    """In a worker: say ready (keys loaded), then wait for the parent's go."""
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(1)


class GcacheProcs(Target):
    system = "gcache"

    def __init__(self, transport: str, procs: int, addresses: list[str], mem_budget: int) -> None:
        if transport not in CLASSES:
            raise BenchError(f"--procs supports transports {', '.join(CLASSES)}, not {transport}")
        self.transport = f"{transport}-{procs}p"
        self.base, self.procs, self.addresses, self.mem_budget = transport, procs, addresses, mem_budget

    def measure(self, op: str, size: int, batch: int, threads: int, seconds: float) -> Record:
        cmd = [sys.executable, "-m", "gcache.bench.procs", self.base, ",".join(self.addresses),
               str(self.mem_budget // self.procs), op, str(size), str(batch), str(threads), str(seconds)]
        return combine(run_workers([[*cmd, str(w)] for w in range(self.procs)], seconds), self.transport)

    def close(self) -> None:
        pass


def _worker(argv: list[str]) -> int:
    transport, addresses, mem_budget, op, size, batch, threads, seconds, index = argv

    class Worker(CLASSES[transport]):  # type: ignore[valid-type,misc]
        def before_timing(self) -> None:
            wait_go()

    t = Worker(addresses.split(","), int(mem_budget), namespace=f"bench-p{index}")
    try:
        rec = t.measure(op, int(size), int(batch), int(threads), float(seconds))
    finally:
        t.close()
    print(json.dumps(asdict(rec)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker(sys.argv[1:]))
