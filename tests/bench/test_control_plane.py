"""`gcache bench control-plane`, small: real masters, simulated daemons and clients, one kill -9
of the leader. Asserts the run is complete and self-consistent, not its timings (a benchmark is
not a test: the figures are in bench/RESULTS.md)."""

from __future__ import annotations

import math

from gcache.bench.control import ControlConfig, run
from gcache.bench.control_report import table


def test_control_plane_bench_small_run():
    rec = run(ControlConfig(watchers=60, daemons=10, seconds=3.0, failovers=1, watcher_procs=1, daemon_procs=1,
                            change_every_s=1.5, bootstrap_every_s=0.2, daemons_per_s=100.0, ramp_per_s=500.0),
              log=lambda _m: None)
    assert rec["watchers"] == 60 and rec["daemons"] == 10
    assert rec["bootstrap_ms"]["n"] > 0 and rec["bootstrap_ms"]["p50"] > 0
    assert rec["changes"] >= 2 and rec["unnotified"] == 0  # every watcher saw every measured change
    assert rec["propagation_ms"]["n"] == rec["changes"] * 60
    assert rec["heartbeat_ms"]["n"] > 0 and len(rec["master_cpu_pct"]) == 3 and min(rec["master_rss_mb"]) > 0
    (fo,) = rec["failovers"]
    assert "error" not in fo and math.isfinite(fo["leader_s"]) and math.isfinite(fo["reattach_s"])
    assert fo["moved"] > 0  # the killed leader held some of the watchers, and they all came back
    assert rec["masters_agree"]
    assert set(rec["targets"]) >= {"bootstrap_p99_ms", "propagation_p99_ms", "false_down", "failover_median_s"}
    assert "| 60 | 10 |" in table([rec])
