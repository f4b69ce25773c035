"""A drained node leaves for good: once the masters removed it, a heartbeat reply that no longer
knows it is the drain completing, not a reason to register again.

The race (found by a network-fault probe under load, 2 of 5 drains): the masters take the
node's HandoverDone and delete its record; its next heartbeat comes back "unknown node" before
its handover loop has marked it left, and it registered again, as incarnation 1 of a new
member: it took a share of the ring, refused every request as FENCED, and the other nodes
handed it keys it refused (so they forgot them); or the drain was silently undone.

In-process: the real Agent (not started) and the real NodeTable's memberships; the masters
answer through a recording stand-in, so the order of events is the race's, every time."""

import time

from gcache.meta.nodetable import NodeTable
from gcache.server.agent import Agent
from gcache.tier.store import Store, StoreConfig
from tests.server.test_routing_epochs import register

GiB = 1 << 30


class Masters:
    """Answers heartbeats as the leader does for a node it does not know (or lists otherwise)."""

    def __init__(self, table: NodeTable, reason: str | None) -> None:
        self.table, self.reason, self.calls = table, reason, []

    def call_all(self, name, request, timeout_s=None):
        self.calls.append(name)
        if self.reason is None:  # the leader knows it: a newer epoch to fetch
            return [{"ok": True, "leader": True, "epoch": self.table.epoch}]
        return [{"ok": False, "reason": self.reason, "epoch": self.table.epoch, "born": self.table.born,
                 "leader": True}]

    def call(self, name, request, timeout_s=None):
        self.calls.append(name)
        if name == "Register":
            out = self.table.apply({"v": 1, "op": "register", **request})
            return {**out, "membership": self.table.membership()}
        raise AssertionError(f"unexpected call {name}")

    def membership_at_least(self, epoch, timeout_s=None):
        return self.table.membership()


def drained_n1(reason, how="handover_done"):
    """n0, n1, n2 settled, n1 drained and its handover report taken (``how``; or removed as a
    silent draining node, "remove"): the masters no longer list it; an Agent for n1 that last
    applied the membership in which it was draining."""
    t = NodeTable()
    for i in range(3):
        register(t, i)
    for n in t.membership()["transition"]["pending"]:
        t.apply({"v": 1, "op": "handover_done", "node": n, "epoch": t.epoch})
    t.apply({"v": 1, "op": "drain", "node": "n1"})
    draining = t.membership()
    assert next(r for r in draining["nodes"] if r["id"] == "n1")["state"] == "draining"
    t.apply({"v": 1, "op": how, "node": "n1", "epoch": t.epoch})
    assert all(r["id"] != "n1" for r in t.membership()["nodes"]) and t.membership()["transition"] is None
    masters = Masters(t, reason)
    agent = Agent(masters, "n1", "n1:1", GiB, Store(StoreConfig(mem_bytes=16 << 20, pretouch=False)), None,  # type: ignore[arg-type]
                  put=lambda *a: [])
    agent.inc = 1
    agent._apply_membership(draining, build_now=True)
    agent._registered.set()
    agent._last_tick = agent._last_led = time.monotonic()
    return agent, masters, t


def test_unknown_node_after_the_drain_was_taken_means_left_not_register_again():
    agent, masters, t = drained_n1("unknown node")
    agent._heartbeat()
    assert "Register" not in masters.calls
    assert agent.left and agent.fenced
    assert all(r["id"] != "n1" for r in t.membership()["nodes"])  # not back in the table


def test_a_newer_membership_without_this_node_after_its_drain_means_left():
    agent, masters, _ = drained_n1(None)  # the leader answers ok, with the epoch of the removal
    agent._heartbeat()
    assert "Register" not in masters.calls
    assert agent.left and agent.fenced


def test_a_node_that_was_not_draining_still_registers_again_when_forgotten():
    """The guard is the drain's only: a live member the masters forgot (a master group started
    afresh) registers again, as before."""
    t = NodeTable()
    for i in range(2):
        register(t, i)
    masters = Masters(NodeTable(), "unknown node")  # a new master group: knows nobody
    agent = Agent(masters, "n1", "n1:1", GiB, Store(StoreConfig(mem_bytes=16 << 20, pretouch=False)), None,  # type: ignore[arg-type]
                  put=lambda *a: [])
    agent.inc = 1
    agent._apply_membership(t.membership(), build_now=True)
    agent._registered.set()
    agent._last_tick = agent._last_led = time.monotonic()
    agent._heartbeat()
    assert "Register" in masters.calls
    assert not agent.left


def test_a_node_removed_while_draining_has_left():
    """A draining node that hung is removed (its handover closes without it). When it resumes it
    must not register again: that would undo the drain and bring it back, empty, into the ring,
    after it may have applied the membership without it."""
    agent, masters, t = drained_n1("unknown node", how="remove")
    agent._apply_membership(t.membership(), build_now=True)  # resumed: the newest membership has it no more
    agent._heartbeat()
    assert "Register" not in masters.calls
    assert agent.left and agent.fenced
    assert all(r["id"] != "n1" for r in t.membership()["nodes"])  # not back


def born_table(base=5000):
    """A table whose first registration carried ``base`` (as every master's does), n0..n2 settled."""
    t = NodeTable()
    for i in range(3):
        t.apply({"v": 1, "op": "register", "node": f"n{i}", "address": f"n{i}:1", "capacity": GiB, "base": base})
    for n in t.membership()["transition"]["pending"]:
        t.apply({"v": 1, "op": "handover_done", "node": n, "epoch": t.epoch})
    return t


def live_agent(masters, membership, registered_at):
    agent = Agent(masters, "n1", "n1:1", GiB, Store(StoreConfig(mem_bytes=16 << 20, pretouch=False)), None,  # type: ignore[arg-type]
                  put=lambda *a: [])
    agent.inc, agent._registered_at = 1, registered_at
    agent._apply_membership(membership, build_now=True)
    agent._registered.set()
    agent._last_tick = agent._last_led = time.monotonic()
    return agent


def test_a_node_drained_and_removed_before_it_heard_of_the_drain_has_left():
    """Drained, then stopped or cut off before it applied a membership listing it as draining,
    and removed as a silent draining node: when it resumes the table that registered it answers
    "unknown node". It registered again before, as a new member, undoing the operator's drain
    (a network-partition prober). Only a drain removes a node from a table, so it has left."""
    t = born_table()
    live = t.membership()
    registered_at = t.epoch
    t.apply({"v": 1, "op": "drain", "node": "n1"})
    t.apply({"v": 1, "op": "remove", "node": "n1"})
    masters = Masters(t, "unknown node")
    agent = live_agent(masters, live, registered_at)
    agent._heartbeat()
    assert "Register" not in masters.calls
    assert agent.left and agent.fenced
    assert all(r["id"] != "n1" for r in t.membership()["nodes"])


def test_a_node_a_new_master_group_does_not_know_registers_there():
    """The same answer from a table born after the node registered (the master group was
    restarted whole: masters keep no state on disk), or from a master that does not say when its
    table was born (a version before it), is not a drain: the node registers again."""
    old = born_table(base=5000)
    for born in (old.epoch + 1000, 0):
        masters = Masters(NodeTable(), "unknown node")
        masters.table.born = born
        agent = live_agent(masters, old.membership(), old.epoch)
        agent._heartbeat()
        assert "Register" in masters.calls
        assert not agent.left


def test_a_leader_that_has_not_applied_all_committed_entries_does_not_say_when_its_table_was_born():
    """A new Raft leader answers before it has applied what its predecessor committed: its table
    may lack a register the old leader took. Its "unknown node" with the table's born made a live,
    never-drained node leave for good (a reviewer); it says born 0 (unknown) until it has caught
    up, and the node registers again."""
    import threading
    from types import SimpleNamespace

    from gcache.meta.core import Core

    t = born_table()
    core = Core.__new__(Core)
    core.lock, core.table = threading.Lock(), t
    core.raft = SimpleNamespace(is_leader=True, applied_all_committed=False)
    reply = core.heartbeat_reply({"node": "n9", "inc": 1})
    assert reply["reason"] == "unknown node" and reply["born"] == 0
    core.raft.applied_all_committed = True
    assert core.heartbeat_reply({"node": "n9", "inc": 1})["born"] == t.born > 0
