"""The processes of ``gcache bench control-plane`` as the driver sees them: a simulator process
and its pipe, the masters' CPU and memory, the machine's available memory (the bench stops
itself when it runs low), and the small helpers every phase uses."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any

import numpy as np

from gcache.bench.driver import BenchError


def pct(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {"n": 0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"n": len(values), "p50": round(float(np.percentile(a, 50)), 2),
            "p99": round(float(np.percentile(a, 99)), 2), "max": round(float(a.max()), 2)}


def wait_for(pred: Any, timeout_s: float, what: str, every_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(every_s)
    raise BenchError(f"timed out after {timeout_s:.0f}s waiting for {what}")


class SimProc:
    """A simulator process and the pipe the driver talks to it through."""

    def __init__(self, target: Any, *args: Any) -> None:
        ctx = mp.get_context("spawn")  # grpc does not survive fork
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        self.lock = threading.Lock()  # one question at a time on the pipe

    def ask(self, cmd: str, arg: Any = None) -> Any:
        with self.lock:
            self.conn.send((cmd, arg))
            return self.conn.recv()

    def stop(self) -> None:
        try:
            self.ask("stop")
        except (OSError, EOFError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) * 1024
    except (OSError, StopIteration):
        return 0


class MasterSampler(threading.Thread):
    """CPU seconds and peak RSS of each master (its front and core processes together), and the
    peak RSS of the simulator processes."""

    def __init__(self, pids: list[tuple[int, ...]], sims: list[int] | None = None) -> None:
        super().__init__(daemon=True)
        self.pids, self.peak_rss = pids, dict.fromkeys(pids, 0)
        self.sims = list(sims or [])
        self.sim_peak_rss = dict.fromkeys(self.sims, 0)
        self.stop_ev = threading.Event()

    @staticmethod
    def cpu_s(pids: tuple[int, ...]) -> float:
        total = 0.0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except OSError:
                pass
        return total

    def run(self) -> None:
        while not self.stop_ev.wait(0.5):
            for group in self.pids:
                self.peak_rss[group] = max(self.peak_rss[group], sum(rss(p) for p in group))
            for pid in self.sims:
                self.sim_peak_rss[pid] = max(self.sim_peak_rss[pid], rss(pid))


MIN_AVAILABLE_MB = 2048  # the bench stops itself below this much available memory (a shared machine)


def mem_available_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) >> 10
    return 1 << 30


def memory_watchdog(stop: threading.Event, log: Any) -> None:
    """SIGTERM this process (the command's handler unwinds through run()'s cleanup) when the machine runs
    low on memory (a shared machine; the simulated clients' memory once ran away under overload)."""
    while not stop.wait(1.0):
        if mem_available_mb() < MIN_AVAILABLE_MB:
            log(f"  stopping: under {MIN_AVAILABLE_MB} MB of memory available")
            os.kill(os.getpid(), signal.SIGTERM)
            return
