"""The master's core: Raft, the node table, the failure detector and the UDP heartbeats, in a
process of its own beside the gRPC front (gcache.meta.master).

Why a separate process: Raft's timers (a leader sends every 30 ms, followers elect after 150-300
ms of silence) and the heartbeat listener must keep running while the front serves thousands of
watch streams. In one Python process they share one interpreter lock and one CPU share with the
front: a watcher reconnect storm or a membership fan-out held them off long enough to trigger
elections and declare live daemons down. The core does little and sleeps most of the time, so
the scheduler runs it promptly whatever the front is doing.

The front starts the core and talks to it over a pipe (a ``multiprocessing`` connection between
these two processes only). Front -> core: ``("propose", id, command, timeout_s)``,
``("heartbeat", id, request)``, ``("status", id)``, ``("stop",)``. Core -> front: ``("ready",)`` or
``("failed", message)`` once, ``("reply", id, ok, value)``, and ``("membership", epoch, encoded)``
whenever the epoch moves (the encoded bytes are what every watcher receives). The core dies with
the front (PR_SET_PDEATHSIG), so ``kill -9`` of a master takes its Raft member down with it.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import logging.handlers
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gcache.errors import ConfigError
from gcache.meta import rpc
from gcache.meta.beat import BeatListener
from gcache.meta.detector import REMOVE, FailureDetector
from gcache.meta.nodetable import COMMAND_VERSION, NodeTable
from gcache.meta.raft import ProposalFailed, RaftGroup

log = logging.getLogger("gcache.master")
PR_SET_PDEATHSIG = 1


class _Guarded:
    """The node table behind a lock: Raft applies under it (on its thread), then says so."""

    def __init__(self, table: NodeTable, lock: threading.Lock, changed: threading.Event) -> None:
        self.table, self.lock, self.changed = table, lock, changed

    def apply(self, cmd: dict[str, Any]) -> dict[str, Any]:
        try:
            with self.lock:
                return self.table.apply(cmd)
        finally:
            self.changed.set()

    def snapshot(self) -> bytes:
        with self.lock:
            return self.table.snapshot()

    def restore(self, blob: bytes) -> None:
        with self.lock:
            self.table.restore(blob)
        self.changed.set()


class Core:
    def __init__(self, config: Any, udp: tuple[str, int], conn: Any) -> None:
        """``config``: the master's MasterConfig; ``udp``: where heartbeats arrive."""
        self.config, self.conn = config, conn
        self.table = NodeTable()
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.detector = FailureDetector(config.suspect_after_s, config.down_after_s)
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._in_flight: set[tuple[str, int]] = set()
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="propose")
        self._reports: list[tuple[int, dict[str, Any]]] = []  # handover reports waiting for a batch
        self._reports_cv = threading.Condition()
        self.beats = BeatListener(udp[0], udp[1], config.token, self.heartbeat_reply)
        self.raft = RaftGroup(config.raft, list(config.peers), config.token,
                              _Guarded(self.table, self.lock, self.changed))

    def send(self, msg: tuple[Any, ...]) -> None:
        with self._send_lock:
            self.conn.send(msg)

    # -- requests from the front ----------------------------------------------------------------
    def run(self) -> None:
        self.beats.start()
        for target, name in ((self._publish_loop, "publish"), (self._detect_loop, "failure-detector"),
                             (self._report_loop, "handover-reports")):
            threading.Thread(target=target, name=name, daemon=True).start()
        self.changed.set()
        self.send(("ready",))
        try:
            while True:
                msg = self.conn.recv()
                op = msg[0]
                if op == "stop":
                    break
                if op == "propose":
                    self._pool.submit(self._propose, msg[1], msg[2], msg[3])
                elif op == "heartbeat":
                    self.send(("reply", msg[1], True, self.heartbeat_reply(msg[2])))
                elif op == "status":
                    self.send(("reply", msg[1], True, self.status()))
                elif op == "health":
                    self.send(("reply", msg[1], True, self.health()))
                elif op == "rings":
                    with self.lock:
                        rings = self.table.rings_after(int(msg[2]))
                    self.send(("reply", msg[1], True, rings))
        except (EOFError, OSError):  # the front is gone
            pass
        finally:
            self._stop.set()
            with self._reports_cv:
                self._reports_cv.notify_all()
            self.beats.stop()
            self.raft.close()

    def _stale_report(self, cmd: dict[str, Any]) -> dict[str, Any] | None:
        """A handover report this table already shows to be moot (its transition was superseded
        or has closed) is answered here, without a Raft round: in a fleet every node reports
        after every join, and most reports during a burst of joins are stale. Epochs only grow,
        so a master that lags can only keep a report it could have dropped, never drop a live one."""
        if cmd.get("op") != "handover_done":
            return None
        with self.lock:
            t, epoch = self.table.transition, self.table.epoch
            if (t is not None and int(cmd["epoch"]) < t["epoch"]) or (t is None and int(cmd["epoch"]) <= epoch):
                return {"epoch": epoch, "closed": False}
        return None

    def _unknown_node(self, cmd: dict[str, Any]) -> str | None:
        """A drain of a node the table does not hold is refused here, without a Raft entry, when
        this master leads and has applied all that was committed before (then no caller can know
        of the node); elsewhere it is proposed and refused when applied. Before, every refused
        drain added an entry to the Raft log of every master, names of any size included."""
        if cmd.get("op") != "drain" or not self.raft.applied_all_committed:
            return None
        with self.lock:
            known = cmd["node"] in self.table.nodes
        return None if known else f"unknown node {cmd['node']!r}"

    def _address_taken(self, cmd: dict[str, Any]) -> str | None:
        """A Register at an address another live node holds is refused here, before it is
        proposed: two nodes at one address (two daemons each told the other's address, a host
        re-provisioned under a new node id while the old one still serves) send clients of one
        node to the other. Once that node is declared down its address is free. Checked on this
        master's table, not in NodeTable.apply: a group part upgraded would apply the same
        command differently. Two such Registers in flight at once may both pass."""
        if cmd.get("op") != "register":
            return None
        with self.lock:
            holder = self.table.address_holder(cmd["address"], cmd["node"])
            state = self.table.nodes[holder]["state"] if holder is not None else None
        if holder is None:
            return None
        return (f"address {cmd['address']} is registered to node {holder!r} ({state}); a node may take it only "
                f"once {holder!r} is declared down (give each daemon its own --advertise / --listen address)")

    def _propose(self, req_id: int, cmd: dict[str, Any], timeout_s: float) -> None:
        stale = self._stale_report(cmd)
        if stale is not None:
            self.send(("reply", req_id, True, stale))
            return
        refused = self._unknown_node(cmd) or self._address_taken(cmd)
        if refused is not None:
            self.send(("reply", req_id, False, ("refused", refused)))
            return
        if cmd.get("op") == "handover_done":
            with self._reports_cv:
                self._reports.append((req_id, {"node": cmd["node"], "epoch": cmd["epoch"]}))
                self._reports_cv.notify()
            return
        try:
            if cmd.get("op") == "register":  # the first one numbers a new table's epochs (NodeTable)
                cmd = {**cmd, "base": epoch_base()}
            out = self.raft.propose({"v": COMMAND_VERSION, **cmd}, timeout_s=timeout_s)
            if cmd.get("op") == "register":
                # how long ago each down node was declared down (by the leader's clock, in the
                # replicated table, so whichever master answers agrees): a node cut off from the
                # masters together with its peers may serve on for a while (its outage bound,
                # gcache.server.agent), and the registering node waits until it cannot. Unknown
                # (declared down by an older version): 0, the whole bound.
                with self.lock:
                    out = {**out, "silent": self.table.down_for(epoch_base())}
            self.send(("reply", req_id, True, out))
        except ValueError as exc:
            self.send(("reply", req_id, False, ("refused", str(exc))))
        except ProposalFailed as exc:
            self.send(("reply", req_id, False, ("unavailable", f"no Raft leader: {exc}")))

    def _report_loop(self) -> None:
        """Group commit of handover reports: whatever arrived while the previous batch was being
        committed goes in the next one (one Raft entry for hundreds of reports)."""
        while not self._stop.is_set():
            with self._reports_cv:
                self._reports_cv.wait_for(lambda: self._reports or self._stop.is_set(), 0.5)
                batch, self._reports = self._reports[:512], self._reports[512:]
            if not batch:
                continue
            try:
                out = self.raft.propose({"v": COMMAND_VERSION, "op": "handover_done_many",
                                         "reports": [r for _, r in batch]}, timeout_s=3.0)
                for (req_id, _), result in zip(batch, out["results"]):
                    self.send(("reply", req_id, True, result))
            except (ValueError, ProposalFailed) as exc:
                kind = "refused" if isinstance(exc, ValueError) else "unavailable"
                for req_id, _ in batch:
                    self.send(("reply", req_id, False, (kind, f"no Raft leader: {exc}" if kind == "unavailable"
                                                         else str(exc))))

    def heartbeat_reply(self, req: dict[str, Any]) -> dict[str, Any]:
        """A heartbeat, over UDP (the listener's thread) or relayed from the Heartbeat RPC.
        "leader": only the leader's failure detector declares nodes DOWN, so daemons may want
        its acknowledgement."""
        node, inc = str(req["node"]), int(req["inc"])
        with self.lock:
            rec = self.table.nodes.get(node)
            epoch, born = self.table.epoch, self.table.born
            t = self.table.transition
            pending = t is not None and node in t["pending"]
            state, rec_inc = (rec["state"], rec["inc"]) if rec is not None else (None, None)
        leader = self.raft.is_leader
        if rec is None or rec_inc != inc or state == "down":
            why = "unknown node" if rec is None else ("stale incarnation" if rec_inc != inc else "declared down")
            # born says "this table registered you and has removed you" (agent._removed): only from a
            # table that has applied all that is committed (a new leader may not have applied the
            # node's register yet: a live node would leave for good, a reviewer); 0: unknown
            if not self.raft.applied_all_committed:
                born = 0
            return {"ok": False, "reason": why, "epoch": epoch, "born": born, "leader": leader}
        if req.get("cut") is not True:  # a daemon that hears no leader serves nothing: not alive to us
            self.detector.heard(node, inc)
        return {"ok": True, "epoch": epoch, "state": state, "handover_pending": pending, "leader": leader}

    def status(self) -> dict[str, Any]:
        with self.lock:
            membership = self.table.membership()
        return {"raft": self.raft.status(), "membership": membership, "heartbeat_age_s": self.detector.ages(),
                "udp_heartbeats": self.beats.answered}

    def health(self) -> dict[str, Any]:
        """What the master's /healthz, /readyz and /metrics read (small: no per-node rows)."""
        with self.lock:
            states: dict[str, int] = {}
            for r in self.table.nodes.values():
                states[r["state"]] = states.get(r["state"], 0) + 1
            t = self.table.transition
            out = {"epoch": self.table.epoch, "states": states,
                   "handover_pending": len(t["pending"]) if t else 0}
        return {**out, "raft": self.raft.status()}

    # -- background -------------------------------------------------------------------------------
    def _publish_loop(self) -> None:
        """Send the membership to the front whenever the epoch moves (bursts coalesce)."""
        sent = -1
        while not self._stop.is_set():
            if not self.changed.wait(0.5):
                continue
            self.changed.clear()
            with self.lock:
                epoch = self.table.epoch
                m = self.table.membership() if epoch != sent else None
            if m is not None:
                self.send(("membership", epoch, rpc.pack(m)))
                sent = epoch

    def _detect_loop(self) -> None:
        while not self._stop.wait(0.1):
            if self.detector.leadership(self.raft.is_leader):
                log.info("became Raft leader; failure detection starts with a full grace period")
            with self.lock:
                rows = [(n, r["inc"], r["state"]) for n, r in self.table.nodes.items()]
            for v in self.detector.verdicts(rows):
                if (v.node, v.inc) not in self._in_flight:
                    self._in_flight.add((v.node, v.inc))
                    self._pool.submit(self._set_state, v.node, v.inc, v.state, v.silent_s)

    def _set_state(self, node: str, inc: int, state: str, silent_s: float) -> None:
        try:
            if state == REMOVE:  # a draining node gone silent: out, as its completed drain would be
                self.raft.propose({"v": COMMAND_VERSION, "op": "remove", "node": node}, timeout_s=1.0)
                log.warning("node %s stopped answering while it drained (no heartbeat for %.1fs): removed; its "
                            "handover closes without the keys it had not handed over", node, silent_s)
                return
            self.raft.propose({"v": COMMAND_VERSION, "op": "set_state", "node": node, "inc": inc, "state": state,
                               "at": epoch_base()}, timeout_s=1.0)
            log.warning("node %s is %s (no heartbeat for %.1fs)", node, state.upper(), silent_s)
        except (ValueError, ProposalFailed) as exc:
            log.warning("could not mark %s %s: %s", node, state, exc)
        finally:
            self._in_flight.discard((node, inc))


def epoch_base() -> int:
    """The first epoch (and ring generation) of a new node table: the wall clock in ms. Masters
    keep no state on disk, so a group that was stopped whole starts again from an empty table;
    numbered from the clock, its epochs are above those of the group before it (which moved its
    epoch less than once a millisecond), so daemons and clients that still hold that group's
    membership take the new one instead of dropping it as older."""
    return int(time.time() * 1000)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the front stops the core on a clean exit only
        pass


def log_without_blocking(level: str, fmt: str) -> logging.handlers.QueueListener:
    """Log through a queue: a thread that logs never waits for the log file (on a machine busy
    writing, a write can block for hundreds of ms, and Raft's thread logs too)."""
    q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    out = logging.StreamHandler(sys.stderr)
    out.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(q)]
    root.setLevel(level.upper())
    listener = logging.handlers.QueueListener(q, out)
    listener.start()
    return listener


def core_main(conn: Any, config: Any, udp: tuple[str, int], log_level: str, name: str) -> None:
    """Entry point of the core process (started by the front with multiprocessing)."""
    _die_with_parent()
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front, which stops us
    listener = log_without_blocking(log_level, f"%(asctime)s master[{name}] %(levelname)s %(message)s")
    if parent == 1:
        return
    try:
        core = Core(config, udp, conn)
    except (OSError, ConfigError, ValueError, RuntimeError) as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    gc.freeze()  # everything from start-up lives as long as the process
    gc.set_threshold(50_000, 20, 100)
    try:
        core.run()
    finally:
        listener.stop()
