"""``gcache bench control-plane`` command line: runs gcache.bench.control for each watcher count,
prints a table, writes JSON and markdown."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

from gcache import argtypes
from gcache.bench.control import TARGETS, ControlConfig, run
from gcache.bench.control_procs import memory_watchdog
from gcache.bench.driver import BenchError
from gcache.bench.records import machine_info, versions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watchers", default="5000,10000",
                   help="simulated clients (watch streams), comma-separated: one run each (default %(default)s)")
    p.add_argument("--daemons", type=argtypes.count, default=500, help="simulated daemons (default %(default)s)")
    p.add_argument("--masters", type=int, default=3, choices=(1, 3, 5), help="master processes (default %(default)s)")
    p.add_argument("--seconds", type=argtypes.seconds, default=60.0,
                   help="steady phase per run: bootstraps, epoch changes, the false-DOWN window (default %(default)s)")
    p.add_argument("--failovers", type=argtypes.count_or_zero, default=5, help="leader kills per run (default %(default)s)")
    p.add_argument("--watcher-procs", type=argtypes.count, default=4, help="processes the watchers share (default %(default)s)")
    p.add_argument("--daemon-procs", type=argtypes.count, default=2, help="processes the daemons share (default %(default)s)")
    p.add_argument("--nice", type=int, default=0,
                   help="run every process of the bench (masters, simulated daemons and clients, the driver) at "
                        "this priority (e.g. -10, as root), so that a shared machine's other load does not "
                        "starve Raft's 150-300 ms timers and the heartbeats (default: leave them)")
    p.add_argument("--standby", action="store_true",
                   help="simulated clients keep a standby connection to the master they would re-attach to "
                        "(MembershipWatcher(standby=True); off by default, as in the client)")
    p.add_argument("--dir", default=None, help="keep the masters' logs here (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="200 watchers, 50 daemons, 5 s, 1 failover (a smoke run)")
    p.add_argument("--out", default="bench/results", metavar="DIR",
                   help="directory for control_plane.json/.md (default %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the JSON here instead")


def table(records: list[dict[str, Any]]) -> str:
    def f(d: dict, k: str) -> str:
        return "-" if k not in d else f"{d[k]:,.0f}" if d[k] >= 100 else f"{d[k]:.1f}"

    rows = [("| watchers | daemons | bootstrap p50 / p99 ms | client ready p50 ms | propagation p50 / p99 / max ms "
            "| heartbeat p50 / p99 ms | false DOWN | master CPU % | master RSS MB | failover median / max s "
            "| all re-attached max s |"),
            "|" + "---|" * 11]
    for r in records:
        fo = [x["leader_s"] for x in r.get("failovers", [])]
        b, pr, hb = r["bootstrap_ms"], r["propagation_ms"], r["heartbeat_ms"]
        rows.append(
            f"| {r['watchers']:,} | {r['daemons']:,} | {f(b, 'p50')} / {f(b, 'p99')} | {f(r['client_ready_ms'], 'p50')} "
            f"| {f(pr, 'p50')} / {f(pr, 'p99')} / {f(pr, 'max')} | {f(hb, 'p50')} / {f(hb, 'p99')} "
            f"| {r['false_down']} (re-registered {r['reregistered']}) "
            f"| {' / '.join(str(x) for x in r['master_cpu_pct'])} | {' / '.join(str(x) for x in r['master_rss_mb'])} "
            f"| {r.get('failover_median_s', float('nan')):.3f} / {max(fo, default=float('nan')):.3f} "
            f"| {r.get('reattach_max_s', float('nan')):.3f} |")
    return "\n".join(rows)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s cleanup: no master outlives the bench


def run_cli(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    watchdog = threading.Event()
    threading.Thread(target=memory_watchdog, args=(watchdog, print), name="memory-watchdog", daemon=True).start()
    try:
        base: dict[str, Any]
        if args.quick:
            counts, base = [200], {"daemons": 50, "seconds": 5.0, "failovers": 1, "watcher_procs": 2, "daemon_procs": 1}
        else:
            counts = [int(x) for x in str(args.watchers).split(",") if x.strip()]
            base = {"daemons": args.daemons, "seconds": args.seconds, "failovers": args.failovers,
                        "watcher_procs": args.watcher_procs, "daemon_procs": args.daemon_procs}
        records = []
        for w in counts:
            print(f"control plane: {w:,} watchers, {base['daemons']:,} daemons, {args.masters} masters", flush=True)
            root = os.path.join(args.dir, f"w{w}") if args.dir else None
            records.append(run(ControlConfig(watchers=w, masters=args.masters, root=root,
                                             nice=args.nice, standby=args.standby, **base),
                               log=lambda m: print(m, flush=True)))
    except BenchError as exc:
        print(f"gcache bench control-plane: {exc}", file=sys.stderr)
        return 1
    finally:
        watchdog.set()
    md = table(records)
    print()
    print(md)
    path = args.json or os.path.join(args.out, "control_plane.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"kind": "control-plane", "targets": TARGETS, "machine": machine_info(), "versions": versions(),
                   "records": records}, f, indent=2, default=str)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print(f"\nwrote {path}")
    return 0 if all(all(r["targets"].values()) for r in records) else 3
