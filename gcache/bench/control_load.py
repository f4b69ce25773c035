"""The steady phase's load in ``gcache bench control-plane``, run by the driver in threads: new
clients bootstrapping, and a node that joins, is drained and leaves, over and over.

A bootstrap is timed in two parts, to tell where a slow one spent its time: the connection
(TCP and HTTP/2 set-up, until grpc reports the channel ready) and the first message (the watch
request until the membership arrives). A thread also notes how late the driver itself wakes
(its sleeps overshooting): a bootstrap measured by a starved driver is slow for the driver's sake.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gcache.errors import GCacheError
from gcache.meta.master_client import MasterClient


@dataclass
class Bootstraps:
    total: list[float] = field(default_factory=list)  # seconds, inf for a failed one
    connect: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    ready: list[float] = field(default_factory=list)  # the whole Client(), ring included
    started: list[float] = field(default_factory=list)  # wall time of each (total's order)
    driver_lag: list[float] = field(default_factory=list)  # seconds each 10 ms sleep of the driver overshot


def bootstraps(bench: Any, stop: threading.Event, out: Bootstraps) -> None:
    from gcache import Client

    n = 0
    while not stop.wait(bench.c.bootstrap_every_s):
        n += 1
        t0 = time.perf_counter()
        if n % 25 == 0:  # the whole client, ring included
            try:
                with Client(bench.url, token=bench.token):
                    out.ready.append(time.perf_counter() - t0)
            except GCacheError as exc:
                out.ready.append(float("inf"))
                bench.log(f"  client failed: {exc!r}"[:200])
            continue
        out.started.append(time.time())
        try:
            address = random.choice(bench.addresses)
            mc = MasterClient([address], bench.token)
            mc.connect(address, timeout_s=10.0)
            t1 = time.perf_counter()
            call = mc.watch(address)
            next(call)
            t2 = time.perf_counter()
            out.total.append(t2 - t0)
            out.connect.append(t1 - t0)
            out.first.append(t2 - t1)
            call.cancel()
            mc.close()
        except (GCacheError, Exception) as exc:  # noqa: BLE001 - a failed bootstrap is a figure too
            for xs in (out.total, out.connect, out.first):
                if len(xs) < len(out.started):
                    xs.append(float("inf"))
            bench.log(f"  bootstrap failed: {exc!r}"[:200])


def driver_lag(stop: threading.Event, out: Bootstraps) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        time.sleep(0.01)
        out.driver_lag.append(max(0.0, time.perf_counter() - t0 - 0.01))


def churn(bench: Any, stop: threading.Event, changes: list[tuple[int, float]]) -> None:
    """A node joins, is drained and leaves, over and over; each RPC that moves the epoch is
    a measured change. The node heartbeats (from here) while it is a member."""
    k = 0
    every = bench.c.change_every_s
    while not stop.is_set():
        node = f"churn{k}"
        k += 1
        t0 = time.time()
        try:
            out = bench.mc.call("Register", {"node": node, "address": f"127.0.0.2:{k}", "capacity": 1 << 40},
                                timeout_s=5.0)
        except GCacheError as exc:
            bench.log(f"  churn: {exc}"[:200])
            bench.churn_errors += 1
            continue
        changes.append((int(out["epoch"]), t0))
        inc = int(out["inc"])
        beat = threading.Event()

        def heartbeat(node: str = node, inc: int = inc, beat: threading.Event = beat) -> None:
            while not beat.wait(1.0) and not bench.load_stopped.is_set():
                try:
                    bench.mc.call_all("Heartbeat", {"node": node, "inc": inc, "epoch": 0}, timeout_s=0.5)
                except GCacheError:
                    pass

        hb = threading.Thread(target=heartbeat, daemon=True)
        hb.start()
        try:
            if stop.wait(every / 3):
                return
            t0 = time.time()
            changes.append((int(bench.mc.call("Drain", {"node": node}, timeout_s=5.0)["epoch"]), t0))
            if stop.wait(every / 3):
                return
            t0 = time.time()
            epoch = bench.mc.call("Status", {})["membership"]["epoch"]
            out = bench.mc.call("HandoverDone", {"node": node, "epoch": epoch}, timeout_s=5.0)
            changes.append((int(out["epoch"]), t0))
            beat.set()  # it has left
        except GCacheError as exc:
            bench.log(f"  churn: {exc}"[:200])
            bench.churn_errors += 1
            beat.set()
        stop.wait(every / 3)


def slow_bootstraps(out: Bootstraps, changes: list[tuple[int, float]], over_s: float = 0.1,
                    keep: int = 40) -> dict[str, Any]:
    """Where the slow bootstraps (over ``over_s``) were: how many started within 1.5 s after an
    epoch change (a fan-out under way), and the slowest ``keep`` of them split in two."""
    t_changes = sorted(t for _e, t in changes)
    rows: list[dict[str, Any]] = []
    for t, tot, con, first in zip(out.started, out.total, out.connect, out.first, strict=False):
        if tot > over_s:
            before = [tc for tc in t_changes if tc <= t]
            rows.append({"after_change_s": round(t - before[-1], 3) if before else None,
                         "total_ms": round(tot * 1e3, 1), "connect_ms": round(con * 1e3, 1),
                         "first_ms": round(first * 1e3, 1)})
    rows.sort(key=lambda r: -r["total_ms"])
    near = sum(1 for r in rows if r["after_change_s"] is not None and r["after_change_s"] < 1.5)
    return {"n": len(rows), "within_1_5s_of_a_change": near, "slowest": rows[:keep]}
