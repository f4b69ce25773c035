"""A daemon judges a client's routing by the newest ring it has *built*, not the newest epoch it
has heard of, and checks a write again as it lands if that ring changed meanwhile.

The story these guard (seen once in the fault lab, asymmetric cut, under CI load): a node
rejoins; the previous owner n0 learns the new epoch at once but builds its ring in another
thread. If n0 confirmed the epoch to the joiner before routing by its ring, the joiner started
serving while n0 still served old-epoch clients by the old ring: one client wrote key k on the
joiner, another (not yet refreshed) then read k's older copy on n0. And a write admitted under
the old ring could land on n0 after n0's handover had read k's old value and pushed it to the
joiner, which would then serve that old value after the write was acknowledged.

In-process: the real Agent (never started: no masters), Handler, LocalHandler and Store; the
memberships come from the real NodeTable."""

import os
import socket
import threading
import time

import pytest

import gcache.server.agent as agent_mod
from gcache.errors import ServerError
from gcache.meta.membership import Membership
from gcache.meta.nodetable import NodeTable
from gcache.net.stream import PolledSocketStream, SocketStream
from gcache.protocol import Op, Status
from gcache.server.admission import Admission, AdmissionConfig
from gcache.server.agent import Agent
from gcache.server.handler import Handler, ServerContext
from gcache.server.local import LocalHandler, LocalServer
from gcache.tier.allocator import aligned
from gcache.tier.store import Store, StoreConfig
from gcache.tier.valuemeta import NO_META
from gcache.transport import Connection
from tests.conftest import poll, read
from tests.server.memory_daemon import serve_then_close

GiB = 1 << 30
NS = "ns"


def register(t, i):
    t.apply({"v": 1, "op": "register", "node": f"n{i}", "address": f"n{i}:1", "capacity": GiB})


def joins(more, table=None):
    """n0 and n1, then ``more`` nodes join one by one (n2, n3, ...): the membership before and
    after each join, and the table."""
    t = table or NodeTable()
    for i in range(2):
        register(t, i)
    out = [t.membership()]
    for i in range(2, 2 + more):
        register(t, i)
        out.append(t.membership())
    return out, t


def join_then_joiner_down():
    """n0 and n1, then n2 joins, then n2 is declared down: the three memberships, in order."""
    (before, joined), t = joins(1)
    t.apply({"v": 1, "op": "set_state", "node": "n2", "inc": 1, "state": "down"})
    return before, joined, t.membership()


def join():
    """n0 and n1, then n2 joins: (before, after) as the masters publish them."""
    before, joined, _down = join_then_joiner_down()
    return before, joined


def drain():
    """n0, n1 and n2 settled, then n1 is drained: (before, after)."""
    t = NodeTable()
    for i in range(3):
        register(t, i)
    for n in t.membership()["transition"]["pending"]:
        t.apply({"v": 1, "op": "handover_done", "node": n, "epoch": t.epoch})
    before = t.membership()
    assert before["transition"] is None
    t.apply({"v": 1, "op": "drain", "node": "n1"})
    return before, t.membership()


class Announced:
    """Stands in for announce_epoch: the peers confirm only once ``allow`` is set."""

    def __init__(self):
        self.allow = threading.Event()
        self.asked = 0

    def __call__(self, peers, epoch, token, timeout_s):
        self.asked += 1
        if self.allow.is_set():
            return dict.fromkeys(peers, "routes")
        self.allow.wait(timeout_s)
        return {}


class Node:
    """A node (n0 unless told) with an agent at the ``before`` epoch, serving connections over
    socket pairs; ``moved`` is a key it owns before the change and not after, ``kept`` one it
    owns throughout, ``gained`` one it owns only after."""

    def __init__(self, change=join, node_id="n0"):
        self.before, self.after = change()
        self.e1, self.e2 = self.before["epoch"], self.after["epoch"]
        assert self.e2 > self.e1 and self.after["transition"] is not None
        self.store = Store(StoreConfig(mem_bytes=16 << 20, pretouch=False))
        self.agent = Agent(None, node_id, f"{node_id}:1", GiB, self.store, None,  # type: ignore[arg-type]
                           put=lambda *a: [])
        self.agent._apply_membership(self.before, build_now=True)
        self.agent._registered.set()
        self.agent._last_tick = time.monotonic() + 3600  # holds its lease for the test
        self.ctx = ServerContext(self.store, node_id, 1 << 20, agent=self.agent)
        ring1 = Membership.from_master(self.before).build_ring()
        ring2 = Membership.from_master(self.after).build_ring()
        keys = [b"k%d" % i for i in range(400)]

        def key(was, now):
            return next((k for k in keys if (ring1.owner(NS, k) == node_id) == was
                         and (ring2.owner(NS, k) == node_id) == now), None)

        self.moved, self.kept, self.gained = key(True, False), key(True, True), key(False, True)
        self.threads, self.conns = [], []

    def learn_epoch(self):
        """The heartbeat applied the new membership; its ring is queued for the ring thread."""
        self.agent._apply_membership(self.after)
        assert self.agent.epoch == self.e2 and self.agent.routing[0] == self.e1

    def build_ring(self):
        """What the ring thread does once it has built the queued ring."""
        m = Membership.from_master(self.after)
        self.agent._install_ring(m, m.build_ring())
        assert self.agent.routing[0] == self.e2

    def connect(self, local=None):
        a, b = socket.socketpair()
        handler = LocalHandler(SocketStream(a), local) if local is not None else Handler(SocketStream(a), self.ctx)
        t = threading.Thread(target=serve_then_close, args=(handler,), daemon=True)
        t.start()
        conn = Connection("n0", "n0:1", PolledSocketStream(b), 5.0)
        self.threads.append(t)
        self.conns.append(conn)
        return conn

    def close(self):
        for c in self.conns:
            c.close()
        for t in self.threads:
            t.join(5)
        self.store.close()


@pytest.fixture
def announced(monkeypatch):
    fake = Announced()
    monkeypatch.setattr(agent_mod, "announce_epoch", fake)
    # a write waits for the test's next step: not the daemon's 1 s, which a loaded machine can
    # pass between two steps (the write would be refused before the step it waits for)
    monkeypatch.setattr(agent_mod, "WRITE_WAIT_S", 30.0)
    yield fake
    fake.allow.set()


@pytest.fixture
def node(announced):
    n = Node()
    yield n
    n.close()


def call(conn, op, meta, payload=b""):
    """One request; its reply's metadata (a reply payload, a GET's values, is read and dropped)."""
    deadline = time.monotonic() + 5
    conn.send(op, meta, [memoryview(payload)] if payload else [], deadline, 5.0)
    reply, plen = conn.recv_reply(deadline)
    conn.discard(plen, deadline)
    return reply


def change_ring_on_first_touch(node):
    """Build the new ring the moment the handler touches its first key: after the request's
    owner check, before its write lands (the window a real ring change can fall into)."""
    touch = node.agent.touchlog.touch

    def touch_then_change(key):
        touch(key)
        if node.agent.routing[0] < node.e2:
            node.build_ring()

    node.agent.touchlog.touch = touch_then_change


def test_a_node_confirms_an_epoch_only_once_it_routes_by_that_epochs_ring(node):
    c = node.connect()
    assert node.store.put((NS, node.moved), b"old") is Status.OK
    node.learn_epoch()
    # a joiner announcing the new epoch must not be told "known" yet: n0 still routes by the old
    # ring, so an old-epoch client's read of the moved key is still served here
    pong = call(c, Op.PING, {"ep": node.e2})
    assert pong["ep"] == node.e2 and pong["rt"] == node.e1
    assert call(c, Op.GET, {"ns": NS, "keys": [node.moved], "ep": node.e1})["st"] == [Status.OK]
    node.build_ring()
    assert call(c, Op.PING, {"ep": node.e2})["rt"] == node.e2
    # from now on an old-epoch client is refused the moved key (it refreshes and asks the joiner)
    st = call(c, Op.GET, {"ns": NS, "keys": [node.moved, node.kept], "ep": node.e1})["st"]
    assert st == [Status.NOT_OWNER, Status.NOT_FOUND]


def test_a_put_admitted_under_the_old_ring_does_not_land_a_moved_key(node):
    c = node.connect()
    change_ring_on_first_touch(node)
    st = call(c, Op.PUT, {"ns": NS, "keys": [node.moved, node.kept], "sizes": [3, 3], "ep": node.e1}, b"NEWnew")
    assert st["st"] == [Status.NOT_OWNER, Status.OK]
    assert read(node.store, (NS, node.moved)) is None and read(node.store, (NS, node.kept)) == b"new"
    assert node.store.stats()["ram_used"] == aligned(3)  # the refused key's slot was given back


def in_thread(fn, *args):
    out = {}
    t = threading.Thread(target=lambda: out.update(r=fn(*args)), daemon=True)
    t.start()
    return t, out


def ahead_write_waits_then_lands(node, key, **meta):
    """A PUT of ``key`` from a client at the new epoch waits until ``node`` routes by it, then lands."""
    c = node.connect()
    t, out = in_thread(call, c, Op.PUT, {"ns": NS, "keys": [key], "sizes": [3], "ep": node.e2, **meta}, b"new")
    assert poll(lambda: node.agent.write_waits == 1, 5)
    assert not node.store.exists((NS, key))
    node.learn_epoch()
    node.build_ring()
    t.join(5)
    assert out["r"]["st"] == [Status.OK] and read(node.store, (NS, key)) == b"new"


def test_a_write_from_a_client_ahead_waits_until_this_node_routes_by_its_epoch(node):
    ahead_write_waits_then_lands(node, node.kept)


def test_a_write_from_a_client_ahead_is_refused_if_this_node_cannot_catch_up(node, monkeypatch):
    monkeypatch.setattr(agent_mod, "WRITE_WAIT_S", 0.2)
    c = node.connect()
    with pytest.raises(ServerError, match="taking over"):
        call(c, Op.DELETE, {"ns": NS, "keys": [node.kept], "ep": node.e2})
    # the connection is still in step: the next request is served
    assert call(c, Op.EXISTS, {"ns": NS, "keys": [node.kept], "ep": node.e1})["st"] == [Status.NOT_FOUND]


def test_a_node_taking_over_a_draining_nodes_keys_acknowledges_their_writes_once_it_confirmed(announced):
    node = Node(drain, "n0")
    try:
        assert node.gained is not None and node.kept is not None
        c = node.connect()
        node.learn_epoch()
        node.build_ring()  # the gate opens: n1 has not said it routes by the drain's epoch yet
        # a key n0 had all along is written at once
        put = {"ns": NS, "sizes": [3], "ep": node.e2}
        assert call(c, Op.PUT, {**put, "keys": [node.kept]}, b"kkk")["st"] == [Status.OK]
        assert node.agent.write_waits == 0
        # one it takes over from n1 waits: an old-epoch client may still read n1's copy meanwhile
        t, out = in_thread(call, c, Op.PUT, {**put, "keys": [node.gained]}, b"ggg")
        assert poll(lambda: node.agent.write_waits == 1, 5)
        assert not node.store.exists((NS, node.gained))
        announced.allow.set()  # n1 routes by the new ring: it sends old-epoch clients here
        t.join(5)
        assert out["r"]["st"] == [Status.OK] and read(node.store, (NS, node.gained)) == b"ggg"
        assert poll(lambda: not node.agent._gates, 5)
    finally:
        node.close()


def test_a_draining_node_sends_old_epoch_clients_to_the_new_owner_and_serves_fallbacks(announced):
    node = Node(drain, "n1")  # the draining node itself
    try:
        assert node.moved is not None
        assert node.store.put((NS, node.moved), b"old") is Status.OK
        c = node.connect()
        node.learn_epoch()
        node.build_ring()
        assert not node.agent._gates  # it loses keys, it takes none over
        assert call(c, Op.GET, {"ns": NS, "keys": [node.moved], "ep": node.e1})["st"] == [Status.NOT_OWNER]
        assert call(c, Op.PUT, {"ns": NS, "keys": [node.moved], "sizes": [3], "ep": node.e1},
                    b"new")["st"] == [Status.NOT_OWNER]
        # a client on the new epoch that missed on the new owner falls back here
        assert call(c, Op.GET, {"ns": NS, "keys": [node.moved], "ep": node.e2, "fb": 1})["st"] == [Status.OK]
        assert read(node.store, (NS, node.moved)) == b"old"
    finally:
        node.close()


def test_a_delete_admitted_under_the_old_ring_leaves_a_moved_key_to_the_handover(node):
    c = node.connect()
    for k in (node.moved, node.kept):
        assert node.store.put((NS, k), b"old") is Status.OK
    change_ring_on_first_touch(node)
    st = call(c, Op.DELETE, {"ns": NS, "keys": [node.moved, node.kept, b"absent"], "ep": node.e1})["st"]
    # refused, not acknowledged: the client retries on the joiner, where the delete sticks
    assert st[:2] == [Status.NOT_OWNER, Status.OK]
    assert read(node.store, (NS, node.moved)) == b"old" and read(node.store, (NS, node.kept)) is None


def test_a_local_put_leased_under_the_old_ring_commits_only_what_is_still_owned(node):
    admission = Admission(AdmissionConfig(), token_required=False)
    local = LocalServer(node.ctx, f"routing-test-{os.getpid()}-{id(node)}:1", admission)
    try:
        c = node.connect(local)
        got = call(c, Op.LALLOC, {"ns": NS, "keys": [node.moved, node.kept], "sizes": [3, 3], "ep": node.e1})
        assert got["st"] == [Status.OK, Status.OK]
        node.learn_epoch()
        node.build_ring()  # the handover may now read the moved key here and push it to n2
        st = call(c, Op.LCOMMIT, {"ls": got["ls"]})["st"]
        assert st == [Status.NOT_OWNER, Status.OK]
        assert not node.store.exists((NS, node.moved)) and node.store.exists((NS, node.kept))
    finally:
        local.stop()


def test_store_guards_are_checked_under_the_lock_as_writes_land():
    s = Store(StoreConfig(mem_bytes=1 << 20, pretouch=False))
    try:
        res = [s.reserve(2), s.reserve(2), s.reserve(2)]
        for r, v in zip(res, (b"aa", b"bb", b"cc")):
            r.view[:] = v
        calls = []

        def guard():
            calls.append(1)
            return lambda key: key[1] != b"b"

        items = [((NS, k), r, NO_META) for k, r in zip((b"a", b"b", b"c"), res)]
        assert s.commit_many(items, guard) == [1]
        assert calls == [1] and read(s, (NS, b"a")) == b"aa" and read(s, (NS, b"c")) == b"cc"
        assert not s.exists((NS, b"b")) and s.stats()["ram_used"] == 2 * aligned(2)
        assert s.commit_many([], lambda: None) == []
        assert s.put((NS, b"b"), b"bb") is Status.OK
        assert s.delete_many([(NS, b"a"), None, (NS, b"b"), (NS, b"zz")], guard) == [True, None, None, False]
        assert s.exists((NS, b"b")) and not s.exists((NS, b"a"))
    finally:
        s.close()



# -- copies a node still holds of keys it lost, when the ring gives them back -------------------
# (found by an adversarial probe: n2 joins, a client writes newer values of keys that moved to
# n2, n2 dies before n0's handover pushed them (or n2 refused them); once n2 is declared down
# the ring gives the keys back to n0, which served its old copies)

def test_a_node_drops_its_copies_of_keys_it_takes_back_before_routing_by_that_ring(announced):
    before, joined, down = join_then_joiner_down()
    node = Node(lambda: (before, joined))
    try:
        assert node.moved is not None and node.kept is not None
        for k in (node.moved, node.kept):
            assert node.store.put((NS, k), b"old") is Status.OK
        c = node.connect()
        node.learn_epoch()
        node.build_ring()  # n2 owns `moved` now; n0's handover has not pushed it (or failed)
        assert node.store.exists((NS, node.moved))
        # a client that already knows n2 is down reads `moved` here before n0 routes by that
        # epoch: a miss, not n0's old copy (n2 may have acknowledged a newer value meanwhile)
        e3 = down["epoch"]
        st = call(c, Op.GET, {"ns": NS, "keys": [node.moved, node.kept], "ep": e3})["st"]
        assert st == [Status.NOT_FOUND, Status.OK]
        assert call(c, Op.EXISTS, {"ns": NS, "keys": [node.moved], "ep": e3})["st"] == [Status.NOT_FOUND]
        m = Membership.from_master(down)
        node.agent._apply_membership(down)
        node.agent._install_ring(m, m.build_ring())
        assert node.agent.routing[0] == e3
        assert not node.store.exists((NS, node.moved)) and node.agent.dropped_unowned == 1
        assert read(node.store, (NS, node.kept)) == b"old"
        # what clients write now is theirs
        assert call(c, Op.PUT, {"ns": NS, "keys": [node.moved], "sizes": [3], "ep": e3}, b"new")["st"] == [Status.OK]
        assert call(c, Op.GET, {"ns": NS, "keys": [node.moved], "ep": e3})["st"] == [Status.OK]
        assert read(node.store, (NS, node.moved)) == b"new"
    finally:
        node.close()


def test_a_pushed_copy_from_a_node_ahead_lands_only_once_this_node_routes_by_its_epoch(announced):
    """A draining node's pushes carry the drain's epoch: landing before this node routes by it,
    they would be taken for copies held from before (and dropped with them)."""
    node = Node(drain, "n0")
    try:
        assert node.gained is not None
        ahead_write_waits_then_lands(node, node.gained, ho=1)
        assert node.agent.dropped_unowned == 0
    finally:
        node.close()


def test_a_gate_whose_peers_cannot_be_asked_opens_only_after_fence_after(monkeypatch):
    """If asking the previous owners fails outright (e.g. no thread to ask with), the writes of
    the keys taken over wait out fence-after (by then those owners are fenced), not a moment less."""
    def fail(*_args):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(agent_mod, "announce_epoch", fail)
    monkeypatch.setattr(agent_mod, "WRITE_WAIT_S", 30.0)
    node = Node(drain, "n0")
    try:
        node.agent.fence_after_s = 0.6
        c = node.connect()
        node.learn_epoch()
        t0 = time.monotonic()
        node.build_ring()
        t, out = in_thread(call, c, Op.PUT, {"ns": NS, "keys": [node.gained], "sizes": [3], "ep": node.e2}, b"ggg")
        t.join(10)
        assert out["r"]["st"] == [Status.OK] and time.monotonic() - t0 >= 0.6
        assert node.agent.write_waits == 1
    finally:
        node.close()


# -- a node that missed changes of the ring ----------------------------------------------------
# (found by a probe: n0 stopped (SIGSTOP) past fence-after but not declared down; n2 joined and
# was drained, or n2 and n3 joined, meanwhile; clients deleted and overwrote keys on n2. Resumed,
# n0 served its old copies, or pushed them to n3, whose touch log knew nothing of n2's writes.)

def test_a_node_that_missed_a_change_of_the_ring_drops_everything(announced):
    (before, _, after), _t = joins(2)  # two joins this node never sees
    assert after["ring_gen"] == before["ring_gen"] + 2
    node = Node(lambda: (before, after))
    try:
        for k in (node.moved, node.kept):
            assert node.store.put((NS, k), b"old") is Status.OK
        node.learn_epoch()
        node.build_ring()
        assert not node.store.exists((NS, node.kept)) and not node.store.exists((NS, node.moved))
        assert node.agent.dropped_missed == 2 and node.agent.routing_gen == after["ring_gen"]
    finally:
        node.close()


def test_copies_a_handover_has_not_pushed_are_dropped_at_the_next_change_of_the_ring(announced):
    """n0 lost two keys to n2 and has not pushed them when n3 joins: the one n3 takes now is
    dropped (n2 may have taken writes of it, which n3's touch log would not know of); the one
    n2 keeps is still pushed to n2 (whose touch log knows its own writes)."""
    (before, joined, again), _t = joins(2)
    node = Node(lambda: (before, joined))
    try:
        rings = [Membership.from_master(m).build_ring() for m in (before, joined, again)]

        def key(*owners):
            return next(k for k in (b"k%d" % i for i in range(2000))
                        if tuple(r.owner(NS, k) for r in rings) == owners)

        to_n3, stays_n2, kept = key("n0", "n2", "n3"), key("n0", "n2", "n2"), key("n0", "n0", "n0")
        for k in (to_n3, stays_n2, kept):
            assert node.store.put((NS, k), b"old") is Status.OK
        node.learn_epoch()
        node.build_ring()  # n0 routes by the join; its handover has not run
        m = Membership.from_master(again)
        node.agent._apply_membership(again)
        node.agent._install_ring(m, rings[2])
        assert not node.store.exists((NS, to_n3)) and node.agent.dropped_unowned == 1
        assert node.store.exists((NS, stays_n2)) and read(node.store, (NS, kept)) == b"old"
        assert node.agent.dropped_missed == 0
    finally:
        node.close()


class TableMasters:
    """Stands in for the master group's Rings call, answered from a real NodeTable."""

    def __init__(self, table):
        self.table = table

    def call(self, name, request, timeout_s=None):
        assert name == "Rings"
        return {"rings": self.table.rings_after(request["after"])}


def test_a_node_that_missed_a_down_and_a_rejoin_keeps_its_keys(announced):
    """n2 is declared down and re-registers at once: n0 sees the ring generation jump by two,
    gets the ring in between from the masters, and drops nothing (no key of its own ever had
    another owner). Before, it dropped everything (a probe: every node's cache wiped)."""
    (_, before), t = joins(1)  # n0, n1, n2
    t.apply({"v": 1, "op": "set_state", "node": "n2", "inc": 1, "state": "down"})
    register(t, 2)
    after = t.membership()
    assert after["ring_gen"] == before["ring_gen"] + 2
    node = Node(lambda: (before, after))
    node.agent.masters = TableMasters(t)
    try:
        ring0 = Membership.from_master(before).build_ring()
        mine = [k for k in (b"k%d" % i for i in range(300)) if ring0.owner(NS, k) == "n0"]
        for k in mine:
            assert node.store.put((NS, k), b"v") is Status.OK
        node.learn_epoch()
        node.build_ring()
        assert all(node.store.exists((NS, k)) for k in mine) and node.agent.dropped_missed == node.agent.dropped_moved == 0
    finally:
        node.close()


def test_a_node_that_missed_a_join_and_a_drain_drops_only_what_the_joiner_owned(announced):
    (before, joined), t = joins(1)
    t.apply({"v": 1, "op": "drain", "node": "n2"})
    t.apply({"v": 1, "op": "handover_done", "node": "n2", "epoch": t.epoch})  # n2 left
    after = t.membership()
    assert after["ring_gen"] == before["ring_gen"] + 2
    node = Node(lambda: (before, after))
    node.agent.masters = TableMasters(t)
    try:
        r0, r1 = (Membership.from_master(m).build_ring() for m in (before, joined))
        mine = [k for k in (b"k%d" % i for i in range(300)) if r0.owner(NS, k) == "n0"]
        lent = {k for k in mine if r1.owner(NS, k) == "n2"}
        assert lent and len(lent) < len(mine)
        for k in mine:
            assert node.store.put((NS, k), b"v") is Status.OK
        node.learn_epoch()
        node.build_ring()
        assert {k for k in mine if not node.store.exists((NS, k))} == lent
        assert node.agent.dropped_moved == len(lent) and node.agent.dropped_missed == 0
    finally:
        node.close()


def test_a_pushed_copy_from_before_this_node_missed_changes_of_the_ring_is_refused(announced):
    """A previous owner's push queued while this node was stopped (or from before it registered
    again) must not land: other nodes may have owned the key meanwhile and taken writes that this
    node's touch log never saw (a probe: a drain's pushes queued in a stopped joiner's socket
    landed after it was declared down and registered again)."""
    (before, _, after), t = joins(2)
    node = Node(lambda: (before, after))
    node.agent.masters = TableMasters(t)
    try:
        c = node.connect()
        push = {"ns": NS, "keys": [node.kept], "sizes": [3], "ho": 1}
        with pytest.raises(ServerError, match="predate"):  # from before it registered
            call(c, Op.PUT, {**push, "ep": node.e1 - 1}, b"old")
        assert call(c, Op.PUT, {**push, "ep": node.e1}, b"one")["st"] == [Status.OK]
        node.learn_epoch()
        node.build_ring()  # two changes at once: rebuilt from the masters' rings
        assert node.agent.fresh_since == node.e2
        with pytest.raises(ServerError, match="predate"):
            call(c, Op.PUT, {**push, "ep": node.e1}, b"two")
        assert not node.store.exists((NS, node.kept)) or read(node.store, (NS, node.kept)) == b"one"
    finally:
        node.close()


def test_a_pushed_copy_lands_only_while_its_sender_is_handing_over(announced):
    """A previous owner stopped between its last fence check and a push, then resumed after its
    handover had closed, must not land that push: by then the receiver's touch log may have
    forgotten the deletes and overwrites clients made during the handover, so the copy would
    bring an older value back. A push is taken only while a handover is open and, when the push
    names its sender, only from a node that handover waits for."""
    (before, joined), t = joins(1)  # n2 joins: n0 and n1 hand keys over to it
    assert sorted(joined["transition"]["pending"]) == ["n0", "n1"]
    for n in joined["transition"]["pending"]:
        t.apply({"v": 1, "op": "handover_done", "node": n, "epoch": t.epoch})
    closed = t.membership()
    assert closed["transition"] is None and closed["epoch"] > joined["epoch"]
    node = Node(lambda: (before, joined), node_id="n2")
    try:
        node.learn_epoch()
        node.build_ring()
        c = node.connect()
        key = node.gained
        push = {"ns": NS, "keys": [key], "sizes": [3], "ep": node.e2}
        assert call(c, Op.PUT, {**push, "ho": "n0"}, b"one")["st"] == [Status.OK]
        with pytest.raises(ServerError, match="n5 has no handover open"):  # not a node it waits for
            call(c, Op.PUT, {**push, "ho": "n5"}, b"two")
        assert call(c, Op.DELETE, {"ns": NS, "keys": [key], "ep": node.e2})["st"] == [Status.OK]
        node.agent._apply_membership(closed, build_now=True)  # the handover closed
        node.agent.touchlog.clear()  # ...long ago: the touch log no longer remembers the delete
        for ho in ("n0", 1):  # named, or from an older daemon that does not name itself
            with pytest.raises(ServerError, match="no handover is open"):
                call(c, Op.PUT, {**push, "ho": ho}, b"old")
        assert not node.store.exists((NS, key))
        assert call(c, Op.PUT, {**push, "ep": closed["epoch"]}, b"new")["st"] == [Status.OK]  # clients still write
        assert read(node.store, (NS, key)) == b"new"
    finally:
        node.close()


def test_a_pushed_copy_never_undoes_a_clients_write_or_delete(announced):
    """During a handover the new owner stores a previous owner's pushed copy only where no
    client wrote or deleted the key, and tells clients a miss on such a key is final ("tomb")."""
    (before, joined), _t = joins(1)
    node = Node(lambda: (before, joined), node_id="n2")
    try:
        node.learn_epoch()
        node.build_ring()
        ring = Membership.from_master(joined).build_ring()
        new, gone, fresh = [k for k in (b"k%d" % i for i in range(400)) if ring.owner(NS, k) == "n2"][:3]
        c = node.connect()
        ep = node.e2
        assert call(c, Op.PUT, {"ns": NS, "keys": [new, gone], "sizes": [2, 2], "ep": ep}, b"v2v1")["st"] == [0, 0]
        assert call(c, Op.DELETE, {"ns": NS, "keys": [gone], "ep": ep})["st"] == [Status.OK]
        push = {"ns": NS, "keys": [new, gone, fresh], "sizes": [2, 2, 2], "ho": "n0", "ep": ep}
        assert call(c, Op.PUT, push, b"v1v0v1")["st"] == [Status.OK] * 3  # superseded counts as handed over
        reply = call(c, Op.GET, {"ns": NS, "keys": [new, gone, fresh], "ep": ep})
        assert reply["st"] == [Status.OK, Status.NOT_FOUND, Status.OK]
        assert reply.get("tomb") == [1]  # deleted here: no fallback to an older copy
        assert read(node.store, (NS, new)) == b"v2" and read(node.store, (NS, fresh)) == b"v1"
    finally:
        node.close()
