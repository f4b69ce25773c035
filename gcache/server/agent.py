"""The daemon's side of membership: register, heartbeat, fencing, and active handover.

* On start the daemon registers (same node id, a new incarnation each time) and then
  heartbeats every master each ``heartbeat_s``. A master that no longer knows this incarnation
  (the node was declared DOWN, or the table restarted) makes the daemon register again.
* Fencing: the heartbeat thread stamps each loop. If it has not run for ``fence_after_s`` (the
  process was stopped, or starved), the daemon refuses data requests until a heartbeat has been
  acknowledged again, re-registering first if it was declared DOWN meanwhile. It therefore never
  serves keys under an epoch in which it was declared dead. (A master outage alone does not
  fence: the data plane keeps serving under the last membership.)
* Handover: whenever a membership arrives in which this node must hand keys over (a node joined
  and took some of its ranges, or this node is draining), it pushes every key it no longer owns
  to the new owner, hottest first, deletes it locally once stored there, and reports
  ``HandoverDone``. Until then clients fall back to it on a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Any

from gcache.errors import GCacheError
from gcache.meta.master_client import AuthFailed, MasterClient
from gcache.meta.membership import Membership
from gcache.meta.ring import HashRing
from gcache.protocol import Status
from gcache.tier.store import Store

log = logging.getLogger("gcache.agent")
HANDOVER_BATCH = 32


class Agent:
    def __init__(self, masters: MasterClient, node_id: str, address: str, capacity: int, store: Store,
                 token: str | None, heartbeat_s: float = 1.0, fence_after_s: float = 2.0) -> None:
        self.masters = masters
        self.node_id = node_id
        self.address = address
        self.capacity = capacity
        self.store = store
        self.token = token
        self.heartbeat_s = heartbeat_s
        self.fence_after_s = fence_after_s
        self.inc = 0
        self.epoch = 0
        self.membership: Membership | None = None
        self._ring: HashRing | None = None
        self._ring_epoch = -1
        self._ring_wanted: Membership | None = None  # newest membership whose ring is not built yet
        self._ring_cond = threading.Condition()
        self._last_tick = 0.0
        self._registered = threading.Event()
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self.handovers = 0
        self.keys_handed_over = 0
        self.left = False  # drained: handed everything over and left the cluster

    # -- what the data plane asks -----------------------------------------------------------
    @property
    def fenced(self) -> bool:
        return (self.left or not self._registered.is_set()
                or time.monotonic() - self._last_tick > self.fence_after_s)

    def owns(self, namespace: str, key: bytes) -> bool:
        ring = self._ring
        return ring is None or self.node_id not in ring.node_ids or ring.owner(namespace, key) == self.node_id

    def note_epoch(self, epoch: int) -> None:
        """A client saw a newer epoch than ours: refresh soon."""
        if epoch > self.epoch:
            with self._changed:
                self._changed.notify_all()

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> Agent:
        threading.Thread(target=self._heartbeat_loop, name="gcache-heartbeat", daemon=True).start()
        threading.Thread(target=self._handover_loop, name="gcache-handover", daemon=True).start()
        threading.Thread(target=self._ring_loop, name="gcache-ring", daemon=True).start()
        return self

    def wait_registered(self, timeout_s: float) -> bool:
        return self._registered.wait(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        with self._ring_cond:
            self._ring_cond.notify_all()

    def _register(self) -> None:
        self._registered.clear()
        out = self.masters.call("Register", {"node": self.node_id, "address": self.address,
                                             "capacity": self.capacity}, timeout_s=5.0)
        self.inc = int(out["inc"])
        self._apply_membership(out["membership"], build_now=True)  # fenced until registered anyway
        self._last_tick = time.monotonic()
        self._registered.set()
        log.info("registered as %s incarnation %d at epoch %d", self.node_id, self.inc, self.epoch)

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set() and not self.left:
            gap = time.monotonic() - self._last_tick if self._last_tick else 0.0
            try:
                if not self._registered.is_set():
                    self._register()
                else:
                    self._heartbeat(gap)
            except AuthFailed as exc:
                log.error("%s", exc)
            except GCacheError as exc:
                log.warning("masters unreachable: %s", exc)
            with self._changed:
                self._changed.wait(self.heartbeat_s)

    def _heartbeat(self, gap: float) -> None:
        # A lease counts from when its heartbeat was *sent*: an answer to a call made before the
        # process was stopped must not unfence it afterwards.
        sent_at = time.monotonic()
        replies = self.masters.call_all("Heartbeat", {"node": self.node_id, "inc": self.inc, "epoch": self.epoch},
                                        timeout_s=min(0.5, self.heartbeat_s))
        if not replies:
            if gap <= self.fence_after_s:  # masters down, but we were never away: keep serving
                self._last_tick = sent_at
            return
        if not any(r.get("ok") for r in replies):
            reason = next((r.get("reason") for r in replies if r.get("reason")), "?")
            log.warning("masters say %s; fencing and registering again", reason)
            self._register()
            return
        epoch = max(int(r["epoch"]) for r in replies)
        if epoch > self.epoch or any(r.get("handover_pending") for r in replies):
            m = self.masters.membership()
            me = next((r for r in m["nodes"] if r["id"] == self.node_id), None)
            if me is None or me["inc"] != self.inc or me["state"] == "down":
                log.warning("membership epoch %d no longer lists this incarnation as live; registering again",
                            m["epoch"])
                self._register()
                return
            self._apply_membership(m)
        self._last_tick = sent_at

    def _apply_membership(self, m: dict[str, Any], build_now: bool = False) -> None:
        """Adopt a membership. Its ring is built by the ring thread (a big ring takes tens of
        ms; the heartbeat loop must not wait for it), or here with ``build_now``."""
        membership = Membership.from_master(m)
        with self._lock:
            if membership.epoch < self.epoch:
                return
            changed = membership.epoch != self.epoch
            self.membership, self.epoch = membership, membership.epoch
            self._transition = m.get("transition")
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
        with self._lock:
            if membership.epoch < self._ring_epoch:
                return
            self._ring, self._ring_epoch = ring, membership.epoch
        with self._changed:
            self._changed.notify_all()

    def _ring_loop(self) -> None:
        """Builds the ring of the newest membership, once per epoch (skipping any that were
        superseded while it was busy)."""
        while not self._stop.is_set():
            with self._ring_cond:
                self._ring_cond.wait_for(lambda: self._ring_wanted is not None or self._stop.is_set())
                membership, self._ring_wanted = self._ring_wanted, None
            if membership is None or membership.epoch <= self._ring_epoch:
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
            t = getattr(self, "_transition", None)
            if t is None or self.node_id not in t["pending"] or t["epoch"] <= done_epoch or self.fenced:
                continue
            if self._ring_epoch < int(t["epoch"]):  # hand over by the ring of that epoch, once built
                continue
            epoch = int(t["epoch"])
            try:
                moved = self._hand_over()
                self.masters.call("HandoverDone", {"node": self.node_id, "epoch": epoch}, timeout_s=5.0)
                done_epoch = epoch
                self.handovers += 1
                log.info("handover for epoch %d done: %d keys moved", epoch, moved)
                me = next((n for n in self.membership.nodes if n.node_id == self.node_id), None) \
                    if self.membership else None
                if me is not None and me.state.value == "draining":
                    self.left = True
                    log.info("drained: every key handed over; this node has left the cluster")
                    return
            except GCacheError as exc:
                log.warning("handover for epoch %d failed (%s); will retry", epoch, exc)

    def _hand_over(self) -> int:
        from gcache.client import Client, OnNodeError

        membership = self.membership
        ring = self._ring
        if membership is None or ring is None:
            return 0
        by_ns: dict[str, list[bytes]] = defaultdict(list)
        for ns, key in self.store.keys_hottest_first():
            if ring.owner(ns, key) != self.node_id:
                by_ns[ns].append(key)
        moved = 0
        with Client(membership, token=self.token, timeout_s=10.0, on_node_error=OnNodeError.MISS) as client:
            for ns, keys in by_ns.items():
                for i in range(0, len(keys), HANDOVER_BATCH):
                    moved += self._push(client, ns, keys[i:i + HANDOVER_BATCH])
        self.keys_handed_over += moved
        return moved

    def _push(self, client: Any, ns: str, keys: list[bytes]) -> int:
        hits = [(k, self.store.acquire((ns, k))) for k in keys]
        present = [(k, h) for k, h in hits if h is not None]
        try:
            status = client.put([k for k, _ in present], [h.view for _, h in present], namespace=ns)
        finally:
            for _, h in present:
                self.store.release(h)
        moved = 0
        for (k, _), st in zip(present, status):
            if st is Status.OK:
                self.store.delete((ns, k))
                moved += 1
        return moved
