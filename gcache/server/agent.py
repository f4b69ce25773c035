"""The daemon's side of membership: register, heartbeat, fencing, and active handover.

* On start the daemon registers (same node id, a new incarnation each time) and then
  heartbeats every master each ``heartbeat_s``.
* Fencing (the rule is gcache.server.lease): the daemon serves only while it holds a lease,
  renewed by every heartbeat round the Raft leader acknowledges and lost ``fence_after_s``
  after the last one (the process was stopped or starved, or it is cut off from the leader).
  When no leader answers, its peers decide whether this is a master outage (serve on under the
  last membership) or its own partition (fence). A daemon told it was declared down fences at
  once.
* Rejoin: an incarnation that was declared down (or that the masters forgot) registers again,
  through a round the leader answered, and first drops everything it holds, RAM and disk:
  while it was down its keys were written and deleted on their interim owners, so nothing it
  held from before is known to be current. A restarted daemon keeps what it recovered from
  disk only if its previous incarnation was still up (no other node owned its ranges).
* Handover: whenever a membership arrives in which this node must hand keys over (a node joined
  and took some of its ranges, or this node is draining), it pushes every key it no longer owns
  to the new owner, hottest first, deletes it locally (stored there or not: a copy kept could
  be served again once the ring gives the key back), and reports ``HandoverDone``. Until then
  clients fall back to it on a miss. At the next change of the ring, before it routes by the
  new one, a node drops every copy of a key the ring before gave another node and whose owner
  changes now (taken back, or not handed over yet: gcache.server.handover.held_unowned). One
  that missed changes (the masters' ring generation jumped: it was stopped or cut off) asks the
  masters for the rings in between and drops what moved meanwhile (held_moved), or everything
  without them; a restarted one keeps what it recovered from disk only if the ring generation
  is the one it recorded there.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from gcache.errors import GCacheError
from gcache.meta.master_client import AuthFailed, MasterClient, MasterUnavailable
from gcache.meta.membership import Membership
from gcache.meta.ring import HashRing, RingParams
from gcache.server.handover import PutFn, hand_over, held_moved, held_unowned
from gcache.server.lease import Mode, Verdict, judge, outage_confirmed
from gcache.server.touchlog import TouchLog
from gcache.server.vouch import MAX_PEERS, PeerAsk, announce_epoch
from gcache.tier.store import Store

log = logging.getLogger("gcache.agent")
OWNING = ("up", "suspect")
PROBE_REUSE_S = 0.1  # a peer's question is answered from a master round that started this recently
WRITE_WAIT_S = 1.0  # a write waits at most this long for this node to catch up or to take keys over


class Agent:
    def __init__(self, masters: MasterClient, node_id: str, address: str, capacity: int, store: Store,
                 token: str | None, put: PutFn, heartbeat_s: float = 1.0, fence_after_s: float = 2.0,
                 outage_max_s: float = 15.0) -> None:
        """``put`` carries handover copies to their new owners (gcache.server.handover).
        ``outage_max_s``: how long after the master leader last acknowledged it the daemon may go
        on serving in a master outage its peers confirm (gcache.server.lease)."""
        self.masters = masters
        self.put = put
        self.node_id = node_id
        self.address = address
        self.capacity = capacity
        self.store = store
        self.token = token
        self.heartbeat_s = heartbeat_s
        self.fence_after_s = fence_after_s
        self.outage_max_s = outage_max_s
        self._last_led = 0.0  # when the last round the master leader acknowledged was sent
        self.inc = 0
        self.epoch = 0
        self.membership: Membership | None = None
        # (epoch, ring) this node routes by: the newest membership whose ring is built. Read as one
        # tuple; it trails ``epoch`` while a ring is being built.
        self.routing: tuple[int, HashRing | None] = (-1, None)
        self.routing_gen = -1  # the masters' ring generation of that ring (NodeTable.ring_gen)
        self._noted: tuple[int, int] | None = None  # (ring_gen, inc) last recorded with the NVMe data
        # pushed copies sent by an older epoch than this are refused (Handler): this node
        # registered, or missed changes of the ring, since (others may have owned those keys and
        # taken writes its touch log never saw)
        self.fresh_since = -1
        # (ring routed by before a change, set once the nodes that lost keys in it route by the
        # new one): writes of keys this node took over wait for it (``writable``)
        self._gates: list[tuple[HashRing | None, threading.Event]] = []
        self.write_waits = 0  # writes that waited for this node to catch up or for a takeover
        self._ring_wanted: Membership | None = None  # newest membership whose ring is not built yet
        self._install_lock = threading.Lock()  # one ring change at a time (_install_ring)
        self._fetching = False  # a catch-up fetch of the membership is under way (note_epoch)
        # after its lease lapsed, the node serves again only once it routes by this epoch: the
        # cluster went on without it (a node that took over its keys did not wait for it)
        self._catch_up_to = -1
        self._heard = -1  # the newest epoch a peer or client said exists
        self._ring_cond = threading.Condition()
        self._last_tick = 0.0
        self._registered = threading.Event()
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self.handovers = 0
        self.keys_handed_over = 0
        self.left = False  # drained: handed everything over and left the cluster
        self._registered_at = 0  # the masters' epoch when this incarnation registered (_removed)
        self._was_draining = False  # some membership applied listed this node as draining (_drained_away)
        self.mode = Mode.REGISTERING
        self._transition: dict[str, Any] | None = None  # the newest membership's open handover
        self.touchlog = TouchLog()  # keys clients wrote or deleted here: a handover must not undo them
        self.dropped_keys = 0  # keys dropped on rejoin (held from before a DOWN)
        self.dropped_unowned = 0  # copies of keys the previous ring did not give this node (held_unowned)
        self.dropped_missed = 0  # keys dropped because this node missed changes of the ring it could not rebuild
        self.dropped_moved = 0  # keys dropped because they moved in changes this node missed (rebuilt)
        self.rings_missed = 0  # changes of the ring this node did not see one by one
        self.round_timeout_s = min(0.5, heartbeat_s)
        self._probe_lock = threading.Lock()  # guards _last_round
        self._probe_round = threading.Lock()  # one master round at a time for peers' probes
        self._last_round: tuple[float, bool] = (-1e9, False)  # (sent at, a leader answered)

    def counters(self) -> dict[str, int]:
        """For STATS: handovers done and keys they moved, keys dropped as held from before (a
        rejoin; copies of keys taken back), writes that waited for this node."""
        return {"handovers": self.handovers, "keys_handed_over": self.keys_handed_over,
                "dropped_on_rejoin": self.dropped_keys, "dropped_unowned": self.dropped_unowned,
                "dropped_missed_ring": self.dropped_missed, "dropped_moved": self.dropped_moved,
                "rings_missed": self.rings_missed,
                "write_waits": self.write_waits}

    # -- what the data plane asks -----------------------------------------------------------
    @property
    def fenced(self) -> bool:
        return (self.left or not self._registered.is_set()
                or time.monotonic() - self._last_tick > self.fence_after_s
                or self.routing[0] < self._catch_up_to)

    @property
    def catch_up_to(self) -> int:
        """The epoch this node must route by before it serves again (-1: none)."""
        return self._catch_up_to

    def owns_by(self, ring: HashRing | None, namespace: str, key: bytes) -> bool:
        """Whether ``ring`` gives ``key`` to this node (a draining node, not in the ring, owns
        nothing: an old-epoch client is sent to the key's new owner, and falls back here)."""
        return ring is None or ring.owner(namespace, key) == self.node_id

    def push_refusal(self, sender: str | None) -> str | None:
        """Why a previous owner's pushed copies (from node ``sender``, when named) must not land
        here now, or None. Asked once this node has caught up with the push's epoch. A push
        belongs to an open handover that its sender is part of: one that arrives after its
        handover closed (a sender stopped between its last fence check and the push, then
        resumed) would otherwise be stored once the touch log had forgotten the writes and
        deletes clients made here during that handover, bringing back an older value."""
        t = self._transition
        if t is None:
            return f"no handover is open in epoch {self.epoch} (the copies are from one that has closed)"
        if sender is not None and sender not in t["pending"]:
            return f"node {sender} has no handover open in epoch {self.epoch}"
        return None

    def caught_up(self, client_epoch: int | None, deadline: float | None = None) -> bool:
        """Wait (until ``deadline``, by default ``WRITE_WAIT_S``) until this node routes by
        ``client_epoch`` or a newer one; False if not in time."""
        if client_epoch is None or client_epoch <= self.routing[0]:
            return True
        deadline = time.monotonic() + WRITE_WAIT_S if deadline is None else deadline
        self.note_epoch(client_epoch)
        self.write_waits += 1
        with self._changed:
            return self._changed.wait_for(lambda: self.routing[0] >= client_epoch or self._stop.is_set(),
                                          deadline - time.monotonic()) and not self._stop.is_set()

    def writable(self, namespace: str, keys: list, client_epoch: int | None) -> bool:
        """Before a write: wait (up to ``WRITE_WAIT_S``) until this node routes by the client's
        epoch if the client knows a newer one, and until the previous owners of any of ``keys``
        this node took over in a change they have not confirmed yet route by it too (a node
        taking over a draining node's keys; gates opened by ``_install_ring``). Otherwise a
        client that has not heard of the change could still read the old copy on the previous
        owner after this write was acknowledged. False: not in time (refuse the write)."""
        deadline = time.monotonic() + WRITE_WAIT_S
        if not self.caught_up(client_epoch, deadline):
            return False
        for ring, confirmed in self._gates:
            if confirmed.is_set() or all(self.owns_by(ring, namespace, k) for k in keys if type(k) is bytes):
                continue
            self.write_waits += 1
            if not confirmed.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def note_epoch(self, epoch: int) -> None:
        """A client saw a newer epoch than ours: refresh now. The heartbeat loop is woken, and
        the membership is also fetched apart from it (from any master: followers answer it), so
        that a heartbeat round busy elsewhere (asking the peers while the masters elect a leader)
        does not keep the writes of clients ahead waiting (Agent.writable)."""
        if epoch > self.epoch:
            with self._lock:
                self._heard = max(self._heard, epoch)
                if self._registered.is_set() and self.mode in (Mode.OUTAGE, Mode.CUT_OFF):
                    # the cluster went on without this node and it cannot ask the leader for the
                    # new membership: serve nothing until it routes by it (a node serving on in
                    # what looked like a master outage while one that joined took its keys over)
                    self._catch_up_to = max(self._catch_up_to, epoch)
            with self._changed:
                self._changed.notify_all()
            with self._lock:
                if self._fetching or self.masters is None:
                    return
                self._fetching = True
            threading.Thread(target=self._fetch_membership, name="gcache-catch-up", daemon=True).start()

    def _fetch_membership(self) -> None:
        try:
            m = self.masters.membership()
            me = next((r for r in m["nodes"] if r["id"] == self.node_id), None)
            # only a membership that lists this incarnation live: the heartbeat loop handles the rest
            if (int(m["epoch"]) > self.epoch and self._registered.is_set() and me is not None
                    and me["inc"] == self.inc and me["state"] != "down"):
                self._apply_membership(m)
        except GCacheError as exc:
            log.debug("catch-up membership fetch failed: %s", exc)
        finally:
            with self._lock:
                self._fetching = False

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> Agent:
        threading.Thread(target=self._heartbeat_loop, name="gcache-heartbeat", daemon=True).start()
        threading.Thread(target=self._handover_loop, name="gcache-handover", daemon=True).start()
        threading.Thread(target=self._ring_loop, name="gcache-ring", daemon=True).start()
        return self

    def wait_registered(self, timeout_s: float) -> bool:
        return self._registered.wait(timeout_s)

    def wait_joined(self, timeout_s: float) -> bool:
        """For a request that finds the daemon fenced: if a registration is under way (the
        masters may already route clients here while it waits for the previous owners), wait up
        to ``timeout_s`` for it; whether the daemon now serves."""
        if self.mode is not Mode.REGISTERING:
            return False
        return self._registered.wait(timeout_s) and not self.fenced

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        with self._ring_cond:
            self._ring_cond.notify_all()

    def _register(self) -> None:
        """Register a new incarnation. A daemon that had one (it was declared down or forgotten)
        drops everything first; a fresh process keeps its recovered data only if the previous
        incarnation still owned its ranges."""
        if self._drained_away():
            return
        self._registered.clear()
        self.mode = Mode.REGISTERING
        rejoin = self.inc > 0
        if rejoin:
            self._drop(f"incarnation {self.inc} was declared down or forgotten")
        sent_at = time.monotonic()
        out = self.masters.call("Register", {"node": self.node_id, "address": self.address,
                                             "capacity": self.capacity}, timeout_s=5.0)
        if not rejoin and out.get("was") not in OWNING:
            self._drop(f"the previous incarnation was {out.get('was') or 'unknown to the masters'}")
        elif not rejoin and self.store.recovered_routing != (out["membership"].get("ring_gen"), int(out["inc"]) - 1):
            # its ranges may have moved and come back meanwhile (a join, then a drain) without
            # it being declared down: another node may have owned them and taken writes; or the
            # incarnation the masters saw up did not run with this disk (it ran without one, or
            # the directory is an older copy): that one took writes and deletes this data lacks
            self._drop(f"this node's data was recorded at ring generation / incarnation "
                       f"{self.store.recovered_routing}, the previous incarnation is "
                       f"{(out['membership'].get('ring_gen'), int(out['inc']) - 1)}")
        if not rejoin and out.get("was") in OWNING:
            self.touchlog.distrust()  # clients wrote here before the restart: pushes may be older
        membership = out["membership"]
        if int(membership["epoch"]) < int(out["epoch"]):  # the answering master's core lags
            membership = self.masters.membership_at_least(int(out["epoch"]), timeout_s=2.0)
            if membership is None:
                raise GCacheError(f"no master answers the membership of epoch {out['epoch']} yet")
        self.inc = int(out["inc"])
        self._registered_at = int(out["epoch"])
        self._leader_epoch(int(membership["epoch"]))
        self._apply_membership(membership, build_now=True)  # fenced until registered anyway
        with self._lock:  # copies pushed before this incarnation are not welcome (Handler)
            self.fresh_since = max(self.fresh_since, int(membership["epoch"]))
        self._await_previous_owners(membership)
        self._await_down_nodes(membership, out.get("silent"), sent_at)
        self._last_tick = self._last_led = sent_at
        self.mode = Mode.SERVING
        self._registered.set()
        log.info("registered as %s incarnation %d at epoch %d", self.node_id, self.inc, self.epoch)

    def _removed(self, lead: dict[str, Any]) -> bool:
        """Whether the masters' table that registered this incarnation no longer knows the node.
        Only a drain removes a node (completed, or the node silent while draining), so it was
        drained, though it may never have applied a membership saying so (stopped or cut off
        right after ``gcache drain``: before, it registered again as a new member and undid the
        operator's drain, a prober). A table born after this node registered (the master group
        was restarted whole and lost its state) knows nobody yet: the node registers there."""
        born = lead.get("born")
        if lead.get("reason") != "unknown node" or not isinstance(born, int) or not 0 < born <= self._registered_at:
            return False
        self._was_draining = True
        return self._drained_away()

    def _drained_away(self) -> bool:
        """Whether this node has been draining (by any membership it applied): then a master that
        no longer knows it, or no longer lists this incarnation, means the drain completed (its
        handover report was taken and the node removed), or that it was declared down while
        draining (it hung, and the handover closed without it); either way it has left, and
        registering again would bring back an empty member the operator took out (seen: the
        heartbeat's "unknown node" arrived before the handover loop marked the node left, and the
        node came back as incarnation 1 of a new member, took a third of the ring, and fenced
        every request). A restarted daemon is a new start: it registers. (``_was_draining`` is
        set by _apply_membership, the one place a membership is taken.)"""
        if not self._was_draining:
            return False
        if not self.left:
            self.left = True
            log.info("drained: the masters no longer list this incarnation as draining (its drain completed, or "
                     "it was declared down while draining); this node has left the cluster")
        return True

    def _leader_epoch(self, epoch: int) -> None:
        """The leader says ``epoch`` is the newest: an epoch beyond it that a peer or client named
        (a bug, another master group) is moot, and must not keep this node fenced for good."""
        with self._lock:
            if self._heard > epoch:
                self._heard = -1
            self._catch_up_to = min(self._catch_up_to, epoch)

    def _await_previous_owners(self, m: dict[str, Any]) -> None:
        """Serve only once the nodes that owned our new ranges route by the new ring: until then
        a client that has not heard of the change either could still read an old copy there
        after another one wrote a newer one here. (Knowing the new epoch is not enough: a node
        judges ownership by the newest ring it has *built*.) They learn it from the masters at
        their next heartbeat; told directly (announce_epoch) they refresh at once. One that
        neither answers nor learns it has fenced itself within fence-after (it cannot reach the
        leader), unless it takes this for a master outage with its peers: then within its
        outage bound (``outage_max_s``), which is how long this waits at most."""
        t = m.get("transition") or {}
        prev = {r["id"]: r["address"] for r in t.get("from", ()) if r["id"] != self.node_id}
        # one that neither confirms nor refuses may be serving on in what it takes for a master
        # outage (cut off from the masters with every peer it asks): up to its outage bound. But
        # it asks every other previous owner (when they are few enough to be asked all), so once
        # one of them routes by the new epoch it renews no more: fence-after from then
        self._confirm(prev, self.epoch, time.monotonic() + self.outage_max_s + self.fence_after_s,
                      shorten=len(prev) <= MAX_PEERS)

    def _await_down_nodes(self, m: dict[str, Any], silent: Any, sent_at: float) -> None:
        """Serve only once no node the masters declared down may still serve by an older
        membership. A node cut off from the masters together with every peer it asks takes it
        for a master outage and serves on (up to ``outage_max_s`` after the leader last
        acknowledged it, plus its lease) while the masters declare it down; a node joining then
        would own its keys beside it (clients cut off from the masters too still read there).
        ``silent``: seconds since each down node was declared down (the Register reply; it went
        without the leader's acknowledgement at least that long). Each one declared down within
        that bound is told the new epoch (a node that cannot reach the leader fences at once
        when told, ``note_epoch``) until it confirms, or the bound has passed."""
        if not isinstance(silent, dict):
            return
        bound = self.outage_max_s + self.fence_after_s
        addr = {r["id"]: r["address"] for r in m.get("nodes", ()) if r.get("state") == "down"}
        waits = {n: bound - float(s) for n, s in silent.items()
                 if n in addr and n != self.node_id and isinstance(s, (int, float)) and float(s) < bound}
        if waits:
            self._confirm({n: addr[n] for n in waits}, self.epoch, sent_at + max(waits.values()),
                          "down nodes")

    def _confirm(self, prev: dict[str, str], epoch: int, deadline: float | None = None,
                 what: str = "previous owners", shorten: bool = False) -> None:
        """Announce ``epoch`` to ``prev`` until each says it routes by it (or that it will not
        serve until it does), or ``deadline`` (by default fence-after from now) passed (a
        previous owner that cannot be told cannot reach the leader either: it has fenced by
        then). With ``shorten``, ``prev`` are each other's peers: once one routes by ``epoch``,
        the others are fenced within fence-after."""
        deadline = time.monotonic() + self.fence_after_s if deadline is None else deadline
        beat_at = time.monotonic() + self.heartbeat_s
        while prev and not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("%s %s did not confirm epoch %d in time; going on: they are fenced by now",
                            what, sorted(prev), epoch)
                return
            done = announce_epoch(prev, epoch, self.token, min(0.5, remaining))
            for node in done:
                del prev[node]
            if shorten and prev and "routes" in done.values():
                deadline = min(deadline, time.monotonic() + self.fence_after_s)
            if prev and time.monotonic() >= beat_at:
                # a long wait (down nodes: up to outage-max) runs on the heartbeat thread: keep
                # the masters hearing this incarnation, or they declare it down meanwhile
                beat_at = time.monotonic() + self.heartbeat_s
                try:
                    self._master_round()
                except GCacheError as exc:
                    log.debug("heartbeat while waiting for %s: %s", what, exc)
            if prev:
                self._stop.wait(min(0.02, max(0.0, deadline - time.monotonic())))

    def _drop(self, why: str) -> None:
        self.touchlog.clear()  # writes seen before are superseded: pushed copies are welcome again
        n = self.store.drop_all()
        if n:
            self.dropped_keys += n
            log.warning("dropped %d keys held from before (%s): they may have changed meanwhile", n, why)

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set() and not self.left:
            started = time.monotonic()
            try:
                if self.inc == 0:
                    self._register()
                else:
                    self._heartbeat()
            except AuthFailed as exc:
                log.error("%s", exc)
            except MasterUnavailable as exc:
                log.warning("masters unreachable: %s", exc)
            except GCacheError as exc:  # e.g. a Register refused: its address is another live node's
                log.warning("%s failed: %s", "registration" if self.inc == 0 else "heartbeat round", exc)
            # rounds start every heartbeat_s (a slow round, e.g. asking peers, is not followed by
            # a full extra period, so an outage's lease renewals come often enough)
            with self._changed:
                self._changed.wait(max(0.0, self.heartbeat_s - (time.monotonic() - started)))

    def _master_round(self) -> tuple[float, list[dict]]:
        # A lease counts from when its heartbeat was *sent*: an answer to a call made before the
        # process was stopped must not unfence it afterwards.
        sent_at = time.monotonic()
        beat: dict[str, Any] = {"node": self.node_id, "inc": self.inc, "epoch": self.epoch}
        if self.mode in (Mode.CUT_OFF, Mode.OUTAGE):
            # no leader answer reaches this node, so it serves nothing: a master that hears this
            # heartbeat must not take it for a live node (cut one way, it would stay up and
            # fenced for as long as the cut lasts, its keys unavailable instead of moved)
            beat["cut"] = True
        replies = self.masters.call_all("Heartbeat", beat, timeout_s=self.round_timeout_s)
        led = any(r.get("leader") for r in replies)
        with self._probe_lock:
            if sent_at > self._last_round[0]:
                self._last_round = (sent_at, led)
        return sent_at, replies

    def _heartbeat(self) -> None:
        lapsed = time.monotonic() - self._last_tick > self.fence_after_s  # stopped, starved or cut off
        # cut off or in an outage last round: ask the peers again while this round is waiting
        early = self._peer_ask() if self.mode in (Mode.OUTAGE, Mode.CUT_OFF) else None
        sent_at, replies = self._master_round()
        verdict, lead = judge(replies)
        if verdict is Verdict.REJOIN:
            assert lead is not None
            if self._removed(lead) or self._drained_away():
                return
            log.warning("the master leader says %s; registering again", lead.get("reason", "?"))
            self._register()
            return
        if verdict is Verdict.WAIT_FOR_LEADER:
            self._set_mode(Mode.DOWN, "declared down; fenced until the master leader is reachable to register again")
            self._registered.clear()
            return
        if verdict is Verdict.ASK_PEERS:
            self._ask_peers(sent_at, early)
            return
        assert lead is not None
        if not self._registered.is_set():  # the leader acks an incarnation we had given up on
            self._register()
            return
        if int(lead["epoch"]) > self.epoch or lead.get("handover_pending"):
            # the membership the leader's epoch says exists: a master whose core lags (or is
            # stopped) answers an older one, and renewing the lease on it would let this node
            # serve by a ring the others have moved on from
            m = self.masters.membership_at_least(int(lead["epoch"]), timeout_s=self.round_timeout_s)
            if m is None:
                log.warning("no master answers the membership of epoch %s yet; not renewing the lease",
                            lead["epoch"])
                return
            me = next((r for r in m["nodes"] if r["id"] == self.node_id), None)
            if me is None and not self._was_draining:
                # removed since the leader acknowledged it: the next round's "unknown node" says
                # whether by this table (a drain it never heard of: _removed) or by a new one
                log.warning("membership epoch %d no longer lists this node", m["epoch"])
                return
            if me is None or me["inc"] != self.inc or me["state"] == "down":
                if self._drained_away():
                    return
                log.warning("membership epoch %d no longer lists this incarnation as live; registering again",
                            m["epoch"])
                self._register()
                return
            self._apply_membership(m)
        self._leader_epoch(max(int(lead["epoch"]), self.epoch))
        if lapsed and self._registered.is_set():
            # fenced until it routes by the newest membership it has (_install_ring), fetched in
            # this round or by a catch-up fetch (note_epoch)
            self._catch_up_to = max(self._catch_up_to, self.epoch)
        self._last_tick = self._last_led = sent_at
        self._set_mode(Mode.SERVING, "the master leader acknowledges this node again")

    def _peer_ask(self) -> PeerAsk:
        """Start asking the other owners of the last membership whether they reach a leader."""
        m = self.membership
        peers = {n.node_id: n.address for n in (m.owners().values() if m else ()) if n.node_id != self.node_id}
        return PeerAsk(peers, self.token, self.round_timeout_s + 0.5)

    def _ask_peers(self, sent_at: float, ask: PeerAsk | None) -> None:
        """No leader answered: renew the lease only if every peer confirms a master outage."""
        if not self._registered.is_set():
            return
        ask = ask or self._peer_ask()
        answers = ask.answers()
        with self._lock:
            heard = self._heard
            if heard > self.epoch:
                self._catch_up_to = max(self._catch_up_to, heard)
        if heard > self.epoch:
            self._set_mode(Mode.CUT_OFF, f"epoch {heard} exists (a peer or client said so) and no master leader "
                                         "answers to give it: fenced until this node routes by it")
            return
        if sent_at - self._last_led >= self.outage_max_s:
            self._set_mode(Mode.CUT_OFF, f"no master leader for {self.outage_max_s:g}s (--outage-max): fencing; "
                                         "the masters may have declared this node down and given its keys away")
            return
        if outage_confirmed(self.epoch, list(answers.values())):
            self._last_tick = min(sent_at, ask.started_at)
            self._set_mode(Mode.OUTAGE, f"no master leader reachable by this node or its {len(answers)} peers: "
                                        f"serving under the last membership (epoch {self.epoch})")
            return
        why = ("no peers to confirm a master outage" if not answers else
               ", ".join(f"{n}: {'no answer' if a is None else 'reaches a leader' if a.leader else f'epoch {a.epoch}'}"
                         for n, a in answers.items() if a is None or a.leader or a.epoch > self.epoch))
        self._set_mode(Mode.CUT_OFF, f"no master leader reachable and not a confirmed outage ({why}); "
                                     f"fencing {self.fence_after_s}s after the last acknowledgement")

    def _set_mode(self, mode: Mode, why: str) -> None:
        if mode is not self.mode:
            self.mode = mode
            (log.info if mode is Mode.SERVING else log.warning)("%s: %s", mode.value, why)

    def leader_reachable(self) -> bool:
        """For a peer's lease probe: whether a master round started just now reached the leader
        (one round answers every peer that asks at about the same time)."""
        asked = time.monotonic()
        with self._probe_lock:
            at, led = self._last_round
            if at >= asked - PROBE_REUSE_S:
                return led
        with self._probe_round:  # held across the round: concurrent askers wait and reuse it
            with self._probe_lock:
                at, led = self._last_round
            if at >= asked - PROBE_REUSE_S:
                return led
            try:
                return any(r.get("leader") for r in self._master_round()[1])
            except GCacheError:
                return False

    def _apply_membership(self, m: dict[str, Any], build_now: bool = False) -> None:
        """Adopt a membership. Its ring is built by the ring thread (a big ring takes tens of
        ms; the heartbeat loop must not wait for it), or here with ``build_now``."""
        membership = Membership.from_master(m)
        with self._lock:
            if membership.epoch < self.epoch:
                return
            changed = membership.epoch != self.epoch
            self.membership, self.epoch = membership, membership.epoch
            if any(n.node_id == self.node_id and n.state.value == "draining" for n in membership.nodes):
                self._was_draining = True
            self._transition = m.get("transition")
            self.touchlog.set_handover_open(self._transition is not None)
        if build_now:
            self._install_ring(membership, membership.build_ring())
        else:
            with self._ring_cond:
                self._ring_wanted = membership
                self._ring_cond.notify_all()
        if changed:
            with self._changed:
                self._changed.notify_all()

    def _install_ring(self, membership: Membership, ring: HashRing | None) -> None:
        with self._install_lock:
            self._install_ring_locked(membership, ring)

    def _install_ring_locked(self, membership: Membership, ring: HashRing | None) -> None:
        before, gen = self.routing[1], self.routing_gen
        if membership.epoch < self.routing[0]:
            return
        taken = self._taken_over(before, ring)
        missed = before is not None and ring is not None and gen >= 0 and membership.ring_gen > gen + 1
        if missed:
            self.rings_missed += membership.ring_gen - gen - 1
            between = self._missed_rings(gen, membership.ring_gen)
            if between is None:
                self._drop_missed(membership.ring_gen - gen - 1)
            else:
                assert before is not None and ring is not None  # (missed says so)
                self._drop_moved([before, *between, ring])
        else:
            self._drop_unowned(before, ring)
        with self._lock:
            losing = self._losing(membership, taken)
            if losing:
                confirmed = threading.Event()
                self._gates = [*self._gates, (before, confirmed)]
            if before is None or missed:
                self.fresh_since = membership.epoch  # registered, or missed changes of the ring
            self.routing = (membership.epoch, ring)
            self.routing_gen = membership.ring_gen
        if (membership.ring_gen, self.inc) != self._noted:
            self._noted = (membership.ring_gen, self.inc)
            self.store.note_routing(membership.ring_gen, self.inc)
        if losing:
            try:
                threading.Thread(target=self._close_gate, args=(losing, membership.epoch, confirmed),
                                 name="gcache-takeover", daemon=True).start()
            except RuntimeError:  # no thread to be had: confirm here (the ring thread waits)
                self._close_gate(losing, membership.epoch, confirmed)
        with self._changed:
            self._changed.notify_all()

    def _drop_unowned(self, before: HashRing | None, ring: HashRing | None) -> None:
        """Before routing by ``ring``: drop the copies this node holds of keys ``before`` did not
        give it (gcache.server.handover.held_unowned). No new copy of a key this node gains can
        land meanwhile: a write of it routed by ``before`` is not this node's, one routed by
        ``ring`` waits until this node routes by it (``writable``)."""
        dropped = self._delete(held_unowned(self.store, before, ring, self.node_id))
        if dropped:
            self.dropped_unowned += dropped
            log.warning("dropped %d copies of keys the previous ring did not give this node (taken back, or not "
                        "handed over yet): their owner meanwhile may have acknowledged newer writes", dropped)

    def _delete(self, keys: list[tuple[str, bytes]]) -> int:
        """Delete ``keys`` (the store lock is held per slice of 256, not for them all); how many
        were stored."""
        return sum(sum(1 for d in self.store.delete_many(keys[i:i + 256]) if d) for i in range(0, len(keys), 256))

    def _missed_rings(self, gen: int, new_gen: int) -> list[HashRing] | None:
        """The rings of generations ``gen + 1`` to ``new_gen - 1`` (the masters keep the last
        few: NodeTable.rings_after); None when they cannot be had."""
        if self.masters is None:  # an agent without masters (in-process tests)
            return None
        try:
            got = self.masters.call("Rings", {"after": gen}, timeout_s=2.0).get("rings")
        except GCacheError as exc:
            log.warning("cannot ask the masters for the rings this node missed: %s", exc)
            return None
        if not isinstance(got, list):
            return None
        wanted = [r for r in got if gen < int(r["gen"]) < new_gen]
        if [int(r["gen"]) for r in wanted] != list(range(gen + 1, new_gen)):
            return None
        try:
            return [HashRing({n: float(w) for n, w in r["owners"].items()}, RingParams.from_wire(r["ring"]))
                    for r in wanted]
        except (GCacheError, KeyError, TypeError, ValueError) as exc:
            log.warning("cannot rebuild the rings this node missed: %s", exc)
            return None

    def _drop_moved(self, rings: list[HashRing]) -> None:
        """This node missed the changes between ``rings[0]`` and ``rings[-1]``, and has their
        rings: drop what moved meanwhile (gcache.server.handover.held_moved)."""
        dropped = self._delete(held_moved(self.store, rings, self.node_id))
        self.dropped_moved += dropped
        log.warning("missed %d change(s) of the ring: dropped the %d keys another node owned meanwhile",
                    len(rings) - 2, dropped)

    def _drop_missed(self, missed: int) -> None:
        """This node missed ``missed`` changes of the ring and cannot have their rings (the
        masters keep the last few): it cannot tell which of its keys another node owned
        meanwhile and took writes for, so it drops everything (its touch log stays: it still
        vouches for what clients wrote here)."""
        n = self.store.drop_all()
        self.dropped_missed += n
        log.warning("missed %d change(s) of the ring: dropped all %d keys held (another node may have owned them "
                    "meanwhile)", missed, n)

    def _taken_over(self, before: HashRing | None, ring: HashRing | None) -> set[str] | None:
        """The nodes whose keys this node takes over from ``before`` to ``ring`` while a handover
        is open (None: not known, assume any); computed off the lock (a big ring takes ~0.1 s)."""
        if self._transition is None or before is None or ring is None or not self._registered.is_set():
            return None
        return ring.taken_from(before, self.node_id)

    def _losing(self, membership: Membership, taken: set[str] | None) -> dict[str, str]:
        """Lock held: the nodes this node takes keys over from (``taken``, None: any) in the
        change to ``membership`` that may still serve them by the old ring (the handover's
        pending nodes), when this node serves and routed by a ring before (a registering node
        waits for them in _register instead)."""
        t = self._transition
        if t is None or self.routing[0] < 0 or not self._registered.is_set():
            return {}
        addresses = {n.node_id: n.address for n in membership.nodes}
        return {n: addresses[n] for n in t["pending"]
                if n != self.node_id and n in addresses and (taken is None or n in taken)}

    def _close_gate(self, losing: dict[str, str], epoch: int, confirmed: threading.Event) -> None:
        """Open the gate once ``losing`` confirm ``epoch``; if asking them fails, only once
        fence-after has passed (by then they are fenced), never sooner."""
        deadline = time.monotonic() + self.fence_after_s
        try:
            self._confirm(losing, epoch)
        except Exception:
            log.exception("could not ask %s to confirm epoch %d; writes of the keys taken over wait out "
                          "fence-after (%.1fs)", sorted(losing), epoch, self.fence_after_s)
            self._stop.wait(max(0.0, deadline - time.monotonic()))
        finally:
            confirmed.set()
            with self._lock:
                self._gates = [g for g in self._gates if g[1] is not confirmed]

    def _ring_loop(self) -> None:
        """Builds the ring of the newest membership, once per epoch (skipping any that were
        superseded while it was busy)."""
        while not self._stop.is_set():
            with self._ring_cond:
                self._ring_cond.wait_for(lambda: self._ring_wanted is not None or self._stop.is_set())
                membership, self._ring_wanted = self._ring_wanted, None
            if membership is None or membership.epoch <= self.routing[0]:
                continue
            try:
                self._install_ring(membership, membership.build_ring())
            except GCacheError as exc:  # a membership this version cannot route by: keep the old ring
                log.error("cannot build the ring of epoch %d: %s", membership.epoch, exc)

    # -- handover ---------------------------------------------------------------------------
    def _handover_loop(self) -> None:
        done_epoch = -1
        while not self._stop.is_set():
            with self._changed:
                self._changed.wait(1.0)
            t = self._transition
            if t is None or self.node_id not in t["pending"] or t["epoch"] <= done_epoch or self.fenced:
                continue
            if self.routing[0] < int(t["epoch"]):  # hand over by the ring of that epoch, once built
                continue
            epoch = int(t["epoch"])
            try:
                moved = self._hand_over()
                reply = self.masters.call("HandoverDone", {"node": self.node_id, "epoch": epoch}, timeout_s=5.0)
                done_epoch = epoch
                self.handovers += 1
                log.info("handover for epoch %d done: %d keys moved", epoch, moved)
                me = next((n for n in self.membership.nodes if n.node_id == self.node_id), None) \
                    if self.membership else None
                if me is not None and me.state.value == "draining":
                    # gone only once the masters removed it: a report for a transition that a
                    # newer one superseded is ignored, and this node hands over again for that one
                    m = self.masters.membership_at_least(int(reply.get("epoch", epoch)), timeout_s=5.0)
                    if m is not None and all(r["id"] != self.node_id for r in m["nodes"]):
                        self.left = True
                        log.info("drained: every key handed over; this node has left the cluster")
                        return
                    log.info("drain report for epoch %d not taken (a newer transition); handing over again", epoch)
            except GCacheError as exc:
                log.warning("handover for epoch %d failed (%s); will retry", epoch, exc)

    def _hand_over(self) -> int:
        membership = self.membership
        ring = self.routing[1]
        if membership is None or ring is None:
            return 0
        moved = hand_over(self.store, membership, ring, self.node_id, self.put, fenced=lambda: self.fenced)
        self.keys_handed_over += moved
        return moved
