"""``gcache bench control-plane``: the master group under a simulated fleet.

Real master processes (a Raft group), simulated daemons and clients multiplexed in a few
processes (gcache.bench.control_sim), the steady phase's load from the driver's threads
(gcache.bench.control_load), the processes' plumbing in gcache.bench.control_procs. Measured, in
one run per watcher count:

* client bootstrap: a new client's time to its first membership (new connection, one watch
  stream, first message), split into the connection and the first message, with the fronts' own
  view (loop lag, handler start to first message written) and the driver's lag, sampled while
  the load runs; and the full ``Client("gcache://...")`` (which also builds the ring) for a few;
* membership propagation: from the RPC that changed the epoch (a node joins, is drained, leaves)
  to each watcher receiving it; p50/p99/max over every (change, watcher);
* heartbeat RPC latency (each daemon heartbeats each master every second);
* false DOWN: nodes declared DOWN (all simulated daemons are alive), and re-registrations;
* master CPU (% of one core) and peak RSS over the steady phase;
* leader failover under the load: kill -9 the leader, time until another master leads with a
  higher term; and until every watcher of the killed master has re-attached elsewhere (each
  watcher's time too);
* the simulator processes' peak RSS.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from gcache.bench.control_load import Bootstraps, bootstraps, churn, driver_lag, slow_bootstraps
from gcache.bench.control_procs import MasterSampler, SimProc, pct, wait_for
from gcache.bench.control_sim import daemons_process, watchers_process
from gcache.bench.driver import BenchError
from gcache.client.routing import STANDBY_AFTER_S
from gcache.cluster import LocalCluster
from gcache.errors import GCacheError
from gcache.meta.master import FRONT_NICE
from gcache.meta.master_client import MasterClient
from gcache.meta.membership import Membership, NodeState

CORE_AHEAD = 5  # with --nice: the masters' cores this much above the rest of the bench
WATCHER_NICE = 5  # with --nice: the simulated clients this much below the masters' cores and the daemons
TARGETS = {"bootstrap_p99_ms": 100.0, "propagation_p99_ms": 1000.0, "false_down": 0,
           "failover_median_s": 0.5, "reattach_max_s": 2.0}


@dataclass(frozen=True)
class ControlConfig:
    watchers: int = 5000
    daemons: int = 500
    masters: int = 3
    seconds: float = 60.0  # the steady phase: bootstraps, epoch changes, the false-DOWN window
    failovers: int = 5
    watcher_procs: int = 4
    daemon_procs: int = 2
    change_every_s: float = 9.0  # a node joins, is drained, leaves: 3 measured epoch changes per period
    bootstrap_every_s: float = 0.2
    ramp_per_s: float = 250.0  # watchers started per second per process
    daemons_per_s: float = 50.0  # daemons registering per second at start-up
    nice: int = 0  # e.g. -10: every process of the bench ahead of the rest of a shared machine
    standby: bool = False  # simulated clients keep a standby connection (MembershipWatcher(standby=True))
    root: str | None = None

    def __post_init__(self) -> None:
        if self.watchers < 1 or self.daemons < 1 or self.masters not in (1, 3, 5) or self.seconds <= 0:
            raise BenchError("need watchers >= 1, daemons >= 1, masters in 1/3/5, seconds > 0")


class ControlBench:
    def __init__(self, config: ControlConfig, log: Any = print) -> None:
        self.c, self.log = config, log
        self.cluster = LocalCluster(nodes=0, masters=config.masters, root=config.root)
        self.procs: list[SimProc] = []
        self.watcher_procs: list[SimProc] = []
        self.events: list[tuple[float, str, str]] = []  # (wall time, node, "down" | "suspect")
        self._observer: Any = None
        self._status_clients: dict[str, MasterClient] = {}
        self.churn_errors = 0
        self.load_stopped = threading.Event()  # a churn node still a member heartbeats until then

    # -- set-up ---------------------------------------------------------------------------------
    def _master_pids(self) -> list[tuple[int, ...]]:
        """(front, core) process ids of each master."""
        out: list[tuple[int, ...]] = []
        for m in self.cluster.master_procs:
            st = self._status(m.address) or {}
            out.append((m.pid, int(st["core_pid"])) if st.get("core_pid") else (m.pid,))
        return out

    def _renice(self) -> None:
        """Renice every thread of every master process (Linux priorities are per thread); the
        front stays FRONT_NICE below its core, as the master sets it."""
        if not self.c.nice:
            return
        for group in self._master_pids():
            for k, pid in enumerate(group):
                # the cores above everything (Raft's timers), the fronts FRONT_NICE below them
                core = max(-20, self.c.nice - CORE_AHEAD)
                nice = core + FRONT_NICE if k == 0 and len(group) > 1 else core
                try:
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                except OSError as exc:
                    raise BenchError(f"cannot renice master {pid} to {nice}: {exc}") from None

    def start(self) -> None:
        c = self.c
        self.cluster.start()
        self.addresses = [m.address for m in self.cluster.master_procs]
        self.url, self.token = self.cluster.master_url, str(self.cluster.token)
        self._renice()
        self.mc = MasterClient(self.url, self.token, timeout_s=2.0)
        per = -(-c.daemons // c.daemon_procs)
        for first in range(0, c.daemons, per):
            # with the cores, above the rest: each stands for hosts of their own, so the CPU the
            # simulation itself needs must not make them miss heartbeats
            self.procs.append(SimProc(daemons_process, self.addresses, self.token, first, min(per, c.daemons - first),
                                    c.daemons / c.daemons_per_s, max(-20, c.nice - CORE_AHEAD) if c.nice else 0))
        wait_for(lambda: sum(p.ask("registered") for p in self.procs) == c.daemons, 180, "daemons to register")
        wait_for(self._no_transition, 120, "the daemons' handovers to finish", every_s=1.0)
        self.log(f"  {c.daemons} daemons registered and heartbeating")
        from gcache.client.routing import MembershipWatcher

        self._observer = MembershipWatcher(MasterClient(self.url, self.token), self._observe).start()
        per = -(-c.watchers // c.watcher_procs)
        for n in range(0, c.watchers, per):
            # below the simulated daemons: in a fleet they run on other hosts, and here a watcher
            # reconnect storm must not delay the heartbeats the failure detector judges
            p = SimProc(watchers_process, self.addresses, self.token, min(per, c.watchers - n), c.ramp_per_s,
                        c.nice + WATCHER_NICE if c.nice else 0, c.standby)
            self.watcher_procs.append(p)
            self.procs.append(p)
        t0 = time.monotonic()
        wait_for(lambda: sum(p.ask("attached") for p in self.watcher_procs) == c.watchers, 600, "watchers to attach")
        self.log(f"  {c.watchers} watchers attached in {time.monotonic() - t0:.1f}s")
        if c.standby:
            time.sleep(STANDBY_AFTER_S[1])  # their standby connections are open before the steady phase

    def _no_transition(self) -> bool:
        """No handover is open (False too while no master answers: 500 registrations keep them busy)."""
        try:
            return self.mc.call("Status", {"brief": False}, timeout_s=5.0)["membership"]["transition"] is None
        except GCacheError:
            return False

    def _observe(self, m: Membership) -> None:
        now = time.time()
        for n in m.nodes:
            if n.state in (NodeState.DOWN, NodeState.SUSPECT):
                self.events.append((now, n.node_id, n.state.value))

    def declared(self, state: str, since: float, until: float = float("inf")) -> int:
        """Nodes seen in ``state`` between two times (every simulated daemon is alive)."""
        return len({n for t, n, s in self.events if s == state and since <= t <= until})

    def stop_load(self) -> None:
        self.load_stopped.set()
        if self._observer is not None:
            self._observer.stop()
            self._observer = None
        for p in self.procs:
            p.stop()
        self.procs = []

    def stop(self) -> None:
        self.stop_load()
        if hasattr(self, "mc"):
            self.mc.close()
        for mc in self._status_clients.values():
            mc.close()
        self.cluster.stop()

    # -- steady phase ---------------------------------------------------------------------------
    def front_stats(self) -> list[dict[str, Any]]:
        """Each master front's loop lag and new watches' first-message times since the last call."""
        out = []
        for m in self.cluster.master_procs:
            mc = self._status_clients.setdefault(m.address, MasterClient([m.address], self.token, timeout_s=2.0))
            try:
                out.append(mc.call("Status", {"front": True}, timeout_s=5.0).get("front", {}))
            except GCacheError:
                out.append({})
        return out

    def steady(self) -> dict[str, Any]:
        c = self.c
        self.t_steady = time.time()
        sampler = MasterSampler(self._master_pids(), [p.proc.pid for p in self.procs if p.proc.pid is not None])
        sampler.start()
        for p in self.procs:
            if p not in self.watcher_procs:
                p.ask("stats")  # start the heartbeat window now
        self.front_stats()  # start the fronts' windows now
        cpu0 = {group: sampler.cpu_s(group) for group in sampler.pids}
        t_start = time.monotonic()
        stop = threading.Event()
        boots = Bootstraps()
        changes: list[tuple[int, float]] = []
        threads = [threading.Thread(target=bootstraps, args=(self, stop, boots), daemon=True),
                   threading.Thread(target=driver_lag, args=(stop, boots), daemon=True),
                   threading.Thread(target=churn, args=(self, stop, changes), daemon=True)]
        for t in threads:
            t.start()
        time.sleep(c.seconds)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        elapsed = time.monotonic() - t_start
        time.sleep(2.0)  # let the last change reach everyone
        sampler.stop_ev.set()
        fronts = self.front_stats()
        cpu = [round(100 * (sampler.cpu_s(group) - cpu0[group]) / elapsed, 1) for group in sampler.pids]
        beats = [p.ask("stats") for p in self.procs if p not in self.watcher_procs]
        lat = [x for b in beats for x in b["latencies"]]
        per_change: list[list[float]] = [[] for _ in changes]
        for p in self.watcher_procs:
            for i, lats in enumerate(p.ask("propagation", changes)):
                per_change[i].extend(lats)
            p.ask("trim", time.time())
        flat = [x for lats in per_change for x in lats]
        return {
            "bootstrap_ms": pct(boots.total), "client_ready_ms": pct(boots.ready),
            "bootstrap_connect_ms": pct(boots.connect), "bootstrap_first_message_ms": pct(boots.first),
            "slow_bootstraps": slow_bootstraps(boots, changes), "driver_lag_ms": pct(boots.driver_lag),
            "fronts": fronts,
            "propagation_ms": pct(flat), "changes": len(changes),
            "all_notified_ms": pct([max(lats) for lats in per_change if lats]),
            "unnotified": sum(1 for x in flat if x == float("inf")),
            "heartbeat_ms": pct(lat), "heartbeat_failures": sum(b["failures"] for b in beats),
            "heartbeat_over_grpc": sum(b["fallbacks"] for b in beats),
            "reregistered": sum(b["reregistered"] for b in beats),
            "master_cpu_pct": cpu, "master_rss_mb": [round(v / 2**20) for v in sampler.peak_rss.values()],
            "sim_rss_mb": [round(v / 2**20) for v in sampler.sim_peak_rss.values()],
            "steady_s": round(elapsed, 1), "churn_errors": self.churn_errors,
        }

    # -- failover -------------------------------------------------------------------------------
    def _status(self, address: str) -> dict | None:
        mc = self._status_clients.get(address)
        if mc is None:
            mc = self._status_clients[address] = MasterClient([address], self.token, timeout_s=0.5)
        try:
            return mc.call("Status", {"brief": True})["master"]
        except GCacheError:
            return None

    def _leader(self) -> tuple[int] | None:
        for i, m in enumerate(self.cluster.master_procs):
            if (self._status(m.address) or {}).get("is_leader"):
                return (i,)
        return None

    def failover(self) -> dict[str, float]:
        procs = self.cluster.master_procs

        def settled_leader() -> tuple[int] | None:
            """The leader, if the masters that answer agree on it (not in the middle of an election)."""
            sts = [self._status(m.address) for m in procs]
            leaders = [i for i, st in enumerate(sts) if st and st.get("is_leader")]
            answered = [st for st in sts if st]
            lead = sts[leaders[0]] if len(leaders) == 1 else None
            if lead is not None and len(answered) >= 2 and all(
                    st.get("leader") == lead.get("self") for st in answered):
                return (leaders[0],)
            return None

        (leader,) = wait_for(settled_leader, 30, "a leader all masters agree on", every_s=0.05)
        old = self._status(procs[leader].address) or {}
        dead = procs[leader].address
        others = [m.address for i, m in enumerate(procs) if i != leader]
        t_kill, t0 = time.time(), time.monotonic()
        self.cluster.kill(leader, master=True)
        try:
            return self._after_kill(leader, old, dead, others, t_kill, t0)
        finally:
            m = procs[leader]
            if m.proc is not None and m.proc.poll() is not None:  # a failed measurement: put it back
                self.cluster.restart(leader, master=True)
                self._renice()

    def _after_kill(self, leader: int, old: dict, dead: str, others: list[str], t_kill: float,
                    t0: float) -> dict[str, float]:

        def new_leader() -> dict | None:
            for a in others:
                st = self._status(a)
                if st and st.get("is_leader") and (st.get("term") or 0) > (old.get("term") or 0):
                    return st
            return None

        st = wait_for(new_leader, 30, "a new leader", every_s=0.01)
        leader_s = time.monotonic() - t0
        elected_s = (st.get("leader_since") or t_kill) - t_kill  # by the new leader's own account
        wait_for(lambda: sum(p.ask("reattach", (dead, t_kill))["pending"] for p in self.watcher_procs) == 0, 60,
                 "every watcher to re-attach", every_s=0.05)
        moved = [p.ask("reattach", (dead, t_kill, True)) for p in self.watcher_procs]
        reattach_s = max(m["last_s"] for m in moved)
        each = pct([t for m in moved for t in m["times"]], scale=1.0)
        noticed = pct([t for m in moved for t in m["noticed"]], scale=1.0)
        call = pct([t for m in moved for t in m["call"]], scale=1.0)
        self.cluster.restart(leader, master=True)
        self._renice()
        wait_for(lambda: (self._status(dead) or {}).get("leader"), 60, "the restarted master to rejoin")
        # the restarted master holds no watchers yet: a third of them moves to it, as new clients
        # would over time, so that the next failover moves about its share
        for p in self.watcher_procs:
            p.ask("rebalance", (dead, 3.0))
        time.sleep(3.5)
        wait_for(lambda: sum(p.ask("attached") for p in self.watcher_procs) == self.c.watchers, 60,
                 "the watchers to settle after rebalancing")
        time.sleep(1.0)
        return {"leader_s": round(leader_s, 3), "elected_s": round(elected_s, 3), "reattach_s": round(reattach_s, 3),
                "reattach_each_s": each, "reattach_noticed_s": noticed, "reattach_call_s": call, "moved": sum(m["moved"] for m in moved)}


    def masters_agree(self) -> bool:
        """Every master holds the same table (epoch, nodes, states) once the load has stopped."""
        def views() -> list:
            out = []
            for m in self.cluster.master_procs:
                mc = self._status_clients.setdefault(m.address, MasterClient([m.address], self.token, timeout_s=2.0))
                try:
                    mem = mc.call("Status", {})["membership"]
                except GCacheError:
                    return []
                out.append((mem["epoch"], sorted((r["id"], r["state"], r["inc"]) for r in mem["nodes"])))
            return out

        try:
            wait_for(lambda: len({repr(v) for v in views()}) == 1, 30, "the masters to agree", every_s=0.5)
            return True
        except BenchError:
            return False


def run(config: ControlConfig, log: Any = print) -> dict[str, Any]:
    if config.nice:
        os.setpriority(os.PRIO_PROCESS, 0, config.nice)  # the driver (bootstraps, churn, failovers)
    bench = ControlBench(config, log)
    load_before = os.getloadavg()
    try:
        bench.start()
        log(f"  steady load for {config.seconds:.0f}s")
        rec: dict[str, Any] = {"config": asdict(config), **bench.steady()}
        fails: list[dict[str, Any]] = []
        for i in range(config.failovers):
            try:
                fails.append(bench.failover())
            except BenchError as exc:  # recorded, not hidden: the run goes on
                log(f"  failover {i + 1}: {exc}")
                fails.append({"leader_s": float("inf"), "reattach_s": float("inf"), "moved": 0, "error": str(exc)})
                continue
            log(f"  failover {i + 1}: new leader answers in {fails[-1]['leader_s']:.3f}s "
                f"(elected {fails[-1]['elected_s']:.3f}s after the kill), "
                f"{fails[-1]['moved']} watchers re-attached in {fails[-1]['reattach_s']:.3f}s")
        rec["failovers"] = fails
        beats = [p.ask("stats") for p in bench.procs if p not in bench.watcher_procs]
        rec["failover_phase"] = {"heartbeat_ms": pct([x for b in beats for x in b["latencies"]]),
                                 "heartbeat_failures": sum(b["failures"] for b in beats),
                                 "reregistered": sum(b["reregistered"] for b in beats)}
        rec["reregistered"] += rec["failover_phase"]["reregistered"]
        if fails:
            rec["failover_median_s"] = float(np.median([f["leader_s"] for f in fails]))
            rec["reattach_max_s"] = max(f["reattach_s"] for f in fails)
        t0 = bench.t_steady
        rec["false_down"] = bench.declared("down", t0)  # from the steady phase on, failovers included
        rec["suspected"] = bench.declared("suspect", t0)
        rec["setup_false_down"] = bench.declared("down", 0, t0)  # while 500 daemons and the watchers started
        rec["load_avg"] = {"before": [round(x, 1) for x in load_before],
                           "after": [round(x, 1) for x in os.getloadavg()]}
        bench.stop_load()  # then compare the masters' tables
        rec["masters_agree"] = bench.masters_agree()
        rec["watchers"], rec["daemons"] = config.watchers, config.daemons
        rec["targets"] = check(rec)
        return rec
    finally:
        bench.stop()


def check(rec: dict[str, Any]) -> dict[str, bool]:
    out = {"bootstrap_p99_ms": rec["bootstrap_ms"].get("p99", float("inf")) < TARGETS["bootstrap_p99_ms"],
           "propagation_p99_ms": rec["propagation_ms"].get("p99", float("inf")) < TARGETS["propagation_p99_ms"],
           "false_down": rec["false_down"] == 0 and rec["reregistered"] == 0,
           "masters_agree": rec["masters_agree"]}
    if "failover_median_s" in rec:
        out["failover_median_s"] = rec["failover_median_s"] < TARGETS["failover_median_s"]
        out["reattach_max_s"] = rec["reattach_max_s"] < TARGETS["reattach_max_s"]
    return out
