"""Fault tests: a real 3-master Raft group and real daemons on loopback.

Figures for the closing note are printed (pytest -s shows them): leader failover time, time to
detect a dead daemon, hits retained after a drain and during a join.
"""

import os
import signal
import threading
import time

import pytest

from gcache import Client, OnNodeError, ServerError, Status
from gcache import protocol as P
from gcache.cluster import LocalCluster
from gcache.meta.master_client import AuthFailed, MasterClient
from gcache.meta.membership import Membership
from gcache.transport import open_connection
from tests.conftest import poll, sigstop


@pytest.fixture
def ha(tmp_path):
    clusters = []

    def make(nodes=3, mem="32MiB", disk=None, master_args=()):
        c = LocalCluster(nodes=nodes, mem=mem, disk=disk, masters=3, root=str(tmp_path / f"c{len(clusters)}"),
                         master_args=list(master_args))
        clusters.append(c)
        return c.start()

    yield make
    for c in clusters:
        c.stop()


def master_client(c):
    return MasterClient(c.master_url, c.token, timeout_s=1.0)


def states(mc):
    return {r["id"]: (r["state"], r["inc"]) for r in mc.membership()["nodes"]}


def test_leader_master_killed_new_leader_fast_and_clients_never_notice(ha):
    c = ha()
    mc = master_client(c)
    leader = poll(lambda: mc.call("Status", {})["master"]["leader"], 5)
    idx = next(i for i, m in enumerate(c.master_procs) if f"--raft {leader}" in " ".join(m.args))
    keys = [f"k{i}" for i in range(300)]
    errors, ops = [], [0]
    stop = threading.Event()

    def load():
        with Client(c.master_url, token=c.token, timeout_s=1.0) as cl:
            cl.put(keys, [b"v"] * len(keys))
            while not stop.is_set():
                try:
                    if cl.get(keys[:50]) != [b"v"] * 50 or not all(s is Status.OK for s in cl.put(keys[:20], [b"v"] * 20)):
                        errors.append("wrong answer")
                    ops[0] += 1
                except Exception as exc:  # noqa: BLE001 - any error fails the test
                    errors.append(repr(exc))

    th = threading.Thread(target=load)
    th.start()
    poll(lambda: ops[0] > 5, 5)
    t0 = time.monotonic()
    c.kill(idx, master=True)
    others = MasterClient([m.address for i, m in enumerate(c.master_procs) if i != idx], c.token, timeout_s=0.5)

    def new_leader():
        try:
            lead = others.call("Status", {})["master"]["leader"]
        except Exception:  # noqa: BLE001 - election in progress
            return None
        return lead if lead and lead != leader else None
    assert poll(new_leader, 2.0, every=0.01), "no new leader within 2 s"
    failover = time.monotonic() - t0
    before = ops[0]
    # daemons keep heartbeating the survivors: nobody is declared down, for longer than --down-after
    watch_until = time.monotonic() + 3.5
    while time.monotonic() < watch_until:
        assert all(s == "up" for s, _ in states(others).values())
    stop.set()
    th.join()
    print(f"\nleader failover: {failover * 1000:.0f} ms; client ops after kill: {ops[0] - before}")
    assert not errors, errors[:3]
    assert ops[0] > before


def test_killed_daemon_is_down_fast_misses_are_bounded_and_disk_keys_return(ha):
    c = ha(mem="4MiB", disk="128MiB")
    mc = master_client(c)
    keys = [f"k{i}" for i in range(400)]
    vals = [os.urandom(64 * 1024) for _ in keys]  # 25 MiB over 12 MiB of RAM: most go to disk
    with Client(c.master_url, token=c.token, timeout_s=1.0, on_node_error=OnNodeError.MISS) as cl:
        for i in range(0, len(keys), 20):
            assert all(s is Status.OK for s in cl.put(keys[i:i + 20], vals[i:i + 20]))
        owners = cl.owners(keys)
        victim = c.daemons[1]
        on_disk = poll(lambda: (s := cl.stats()[victim.node_id])["demote_queue_bytes"] == 0 and s["disk_keys"], 10)
        assert on_disk > 0
        t0 = time.monotonic()
        c.kill(1)
        slowest = 0.0
        while states(mc)[victim.node_id][0] != "down":
            t = time.monotonic()
            got = cl.get(keys[:60])
            slowest = max(slowest, time.monotonic() - t)
            assert all(g is None or bytes(g) == v for g, v in zip(got, vals))
            assert time.monotonic() - t0 < 3.0 + 1.0 + 1.0, "not DOWN within down-after + 1 s (+1 s slack)"
        detect = time.monotonic() - t0
        assert slowest < 1.5, f"a call took {slowest:.2f}s with a dead node"
        assert poll(lambda: cl.membership.epoch and victim.node_id not in {
            n.node_id for n in cl.membership.nodes if n.state.value == "up"}, 3)
        got = cl.get(keys)
        for g, v, o in zip(got, vals, owners):
            if o != victim.node_id:
                assert g is not None and bytes(g) == v  # other nodes' keys unaffected
        c.restart(1)
        assert poll(lambda: states(mc)[victim.node_id] == ("up", 2), 10)
        assert poll(lambda: cl.membership.owners().get(victim.node_id) is not None, 5)
        mine = [i for i, o in enumerate(owners) if o == victim.node_id]
        # its previous incarnation was declared down: what it recovered from disk is not known to
        # be current (its keys were the interim owners' meanwhile), so it was dropped, not served
        poll(lambda: mc.membership()["transition"] is None, 10)
        got = cl.get([keys[i] for i in mine])
        assert all(g is None for g in got), "served values held from before it was declared down"
        with open(victim.log_path) as f:
            assert "dropped" in f.read()
        print(f"\ndead daemon DOWN after {detect:.2f} s (down-after 3 s); slowest call meanwhile "
              f"{slowest * 1000:.0f} ms; after restart none of its {len(mine)} keys served ({on_disk} were on "
              f"its disk, dropped because it had been declared down)")


def test_daemon_restarted_before_it_is_declared_down_keeps_its_disk(ha):
    # down-after long enough that the restart (with disk recovery) beats it even on a busy machine
    c = ha(mem="4MiB", disk="128MiB", master_args=["--suspect-after", "10", "--down-after", "20"])
    mc = master_client(c)
    keys = [f"k{i}" for i in range(300)]
    vals = [os.urandom(64 * 1024) for _ in keys]
    with Client(c.master_url, token=c.token, timeout_s=1.0, on_node_error=OnNodeError.MISS) as cl:
        for i in range(0, len(keys), 20):
            assert all(s is Status.OK for s in cl.put(keys[i:i + 20], vals[i:i + 20]))
        victim = c.daemons[1]
        mine = [i for i, o in enumerate(cl.owners(keys)) if o == victim.node_id]
        on_disk = poll(lambda: (s := cl.stats()[victim.node_id])["demote_queue_bytes"] == 0 and s["disk_keys"], 10)
        assert on_disk > 0
        c.kill(1)
        c.restart(1)
        assert states(mc)[victim.node_id] == ("up", 2)  # never declared down in between

        def enough_back():
            got = cl.get([keys[i] for i in mine])
            return got if sum(g is not None for g in got) >= on_disk else None
        got = poll(enough_back, 10)
        assert got, f"fewer than the {on_disk} keys on its disk came back"
        assert all(g is None or bytes(g) == vals[i] for i, g in zip(mine, got))


def test_rejoined_node_never_serves_a_value_from_before_it_was_declared_down(ha):
    """Issue 16 item 5: write v1, SIGSTOP the owner past down-after, write v2 (it goes to the
    interim owner), SIGCONT, read continuously: never v1."""
    c = ha()
    mc = master_client(c)
    victim = c.daemons[1]
    with Client(c.master_url, token=c.token, timeout_s=1.0, on_node_error=OnNodeError.MISS) as cl:
        keys = [f"k{i}" for i in range(400)]
        mine = [k for k, o in zip(keys, cl.owners(keys)) if o == victim.node_id][:60]
        assert all(s is Status.OK for s in cl.put(mine, [b"v1"] * len(mine)))
        sigstop(victim.pid)
        try:
            assert poll(lambda: states(mc)[victim.node_id][0] == "down", 8)
            assert poll(lambda: victim.node_id not in cl.membership.owners(), 3)
            assert all(s is Status.OK for s in cl.put(mine, [b"v2"] * len(mine)))  # on the interim owners
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        reads, v2_hits, back_at = 0, 0, None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            got = cl.get(mine)
            reads += 1
            assert not any(g is not None and bytes(g) == b"v1" for g in got), "a value from before the DOWN"
            assert all(g is None or bytes(g) == b"v2" for g in got)
            v2_hits += sum(g is not None for g in got)
            if back_at is None and victim.node_id in cl.membership.owners():
                back_at = reads
            if back_at is not None and reads > back_at + 50 and mc.membership()["transition"] is None:
                break
        assert back_at is not None, "the stopped node never came back"
        assert states(mc)[victim.node_id] == ("up", 2)
        got = cl.get(mine)
        assert sum(g is not None for g in got) >= 0.9 * len(mine)  # v2 was handed over to it
        print(f"\nrejoin after SIGSTOP: {reads} reads of {len(mine)} keys, {v2_hits} hits, never v1")


def test_stopped_daemon_never_serves_under_an_old_epoch(ha):
    c = ha()
    mc = master_client(c)
    victim = c.daemons[2]
    with Client(c.master_url, token=c.token, timeout_s=1.0) as cl:
        keys = [f"k{i}" for i in range(200)]
        cl.put(keys, [b"old"] * len(keys))
        old_epoch = cl.membership.epoch
        mine = [k for k, o in zip(keys, cl.owners(keys)) if o == victim.node_id]
    sigstop(victim.pid)
    try:
        assert poll(lambda: states(mc)[victim.node_id][0] == "down", 8)
        down_epoch = mc.membership()["epoch"]
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    conn = open_connection(victim.node_id, victim.address, 2.0, c.token)
    served_epochs, fenced = [], 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(served_epochs) < 20:
        conn.send(P.Op.GET, {"ns": "default", "keys": [k.encode() for k in mine[:5]], "ep": old_epoch}, [],
                  time.monotonic() + 2, 2.0)
        try:
            meta, plen = conn.recv_reply(time.monotonic() + 2)
            conn.discard(plen, time.monotonic() + 2)
            served_epochs.append(meta["ep"])
        except ServerError as exc:
            assert exc.code == P.ErrorCode.FENCED
            fenced += 1
    conn.close()
    assert served_epochs, "never served again after SIGCONT"
    assert min(served_epochs) > down_epoch, "served under the epoch in which it was declared down"
    # it re-registered with a new incarnation before serving
    assert poll(lambda: states(mc)[victim.node_id][1] == 2, 5)
    # ...and stays registered: every master, the leader included, gives the new incarnation a
    # grace period (regression: the leader declared it DOWN again at once when another master
    # had handled its Register)
    deadline = time.monotonic() + 3.5  # longer than --down-after
    while time.monotonic() < deadline:
        assert states(mc)[victim.node_id] in (("up", 2), ("suspect", 2))
        time.sleep(0.05)
    print(f"\nafter SIGCONT: {fenced} requests refused as FENCED, then served at epoch >= {min(served_epochs)} "
          f"(declared down at {down_epoch})")


def test_drain_keeps_99_percent_of_10k_keys(ha):
    c = ha()
    mc = master_client(c)
    keys = [f"key-{i}" for i in range(10_000)]
    with Client(c.master_url, token=c.token, timeout_s=5.0) as cl:
        for i in range(0, len(keys), 500):
            cl.put(keys[i:i + 500], [k.encode() * 8 for k in keys[i:i + 500]])
        victim = c.daemons[0].node_id
        held = sum(o == victim for o in cl.owners(keys))
        t0 = time.monotonic()
        mc.call("Drain", {"node": victim}, timeout_s=5)
        assert poll(lambda: victim not in states(mc), 60), "drain did not finish"
        took = time.monotonic() - t0
        assert poll(lambda: victim not in {n.node_id for n in cl.membership.nodes}, 5)
        got = cl.get(keys)
        hits = sum(g is not None and bytes(g) == k.encode() * 8 for g, k in zip(got, keys))
    print(f"\ndrain of {held} keys took {took:.2f} s; afterwards {hits}/{len(keys)} keys hit")
    assert hits >= 0.99 * len(keys)


def test_a_draining_node_that_hangs_is_removed(ha):
    """Drain a node that is stopped (SIGSTOP): before, it was never judged again, its handover
    stayed open for as long as it stayed stopped, and every read of its keys waited out the
    client's timeout on it. Now, silent past --down-after, it is removed as a completed drain
    would be, the handover closes and reads are fast misses. Stopped before it heard of the
    drain, it has left when it resumes: it registered again as a new member before, which undid
    the operator's drain (a prober); the masters' table that registered it no longer knows it."""
    c = ha()
    mc = master_client(c)
    victim = c.daemons[2]
    with Client(c.master_url, token=c.token, timeout_s=1.0, on_node_error=OnNodeError.MISS) as cl:
        keys = [f"k{i}" for i in range(300)]
        assert all(s is Status.OK for s in cl.put(keys, [b"v"] * len(keys)))
        sigstop(victim.pid)
        try:
            mc.call("Drain", {"node": victim.node_id}, timeout_s=5)
            assert poll(lambda: victim.node_id not in states(mc) and mc.membership()["transition"] is None,
                        15), f"still {states(mc).get(victim.node_id)}"
            assert poll(lambda: victim.node_id not in cl.membership.owners() and cl.membership.previous is None, 5)
            assert all(s is Status.OK for s in cl.put(keys[:50], [b"v2"] * 50))
            t0 = time.monotonic()
            got = cl.get(keys)
            assert time.monotonic() - t0 < 0.5, "a read still waited on the stopped node"
            assert [bytes(g) for g in got[:50]] == [b"v2"] * 50
            assert all(g is None or bytes(g) == b"v" for g in got[50:])
        finally:
            os.kill(victim.pid, signal.SIGCONT)

        def said_left():
            with open(victim.log_path, errors="replace") as f:
                return "has left the cluster" in f.read()

        assert poll(said_left, 15), c.log_tail(victim)
        assert victim.node_id not in states(mc)
        for _ in range(20):  # nothing from before the drain comes back
            got = cl.get(keys[:50])
            assert all(g is None or bytes(g) == b"v2" for g in got)


def test_join_keeps_95_percent_hits_during_and_after_handover(ha):
    c = ha()
    mc = master_client(c)
    keys = [f"key-{i}" for i in range(6_000)]
    rates: list[tuple[float, float]] = []
    stop = threading.Event()
    with Client(c.master_url, token=c.token, timeout_s=5.0) as cl:
        for i in range(0, len(keys), 500):
            cl.put(keys[i:i + 500], [b"x" * 512] * 500)

        def reader():
            i = 0
            while not stop.is_set():
                batch = keys[(i * 200) % len(keys):][:200]
                got = cl.get(batch)
                rates.append((time.monotonic(), sum(g is not None for g in got) / len(batch)))
                i += 1

        th = threading.Thread(target=reader)
        th.start()
        poll(lambda: len(rates) > 3, 5)
        t_join = time.monotonic()
        new = c.add_node()
        assert poll(lambda: (m := mc.membership())["transition"] is None and any(
            r["id"] == new.node_id and r["state"] == "up" for r in m["nodes"]), 30)
        t_done = time.monotonic()
        poll(lambda: len([r for t, r in rates if t > t_done]) >= 5, 10)
        stop.set()
        th.join()
        moved = sum(o == new.node_id for o in cl.owners(keys))
        final = sum(g is not None for g in cl.get(keys)) / len(keys)
    during = [r for t, r in rates if t_join <= t <= t_done]
    after = [r for t, r in rates if t > t_done]
    during_rate = sum(during) / max(1, len(during))
    print(f"\njoin: {moved} keys moved to the new node; hit rate during handover {during_rate:.3f} "
          f"(worst batch {min(during, default=1):.3f}), after {final:.3f}; handover took {t_done - t_join:.2f} s")
    after_rate = sum(after) / max(1, len(after))
    assert moved > 0.15 * len(keys)
    assert during_rate >= 0.95 and after_rate >= 0.95 and final >= 0.95


def test_wrong_token_is_refused_and_the_cluster_is_unaffected(ha):
    c = ha(nodes=2)
    with pytest.raises(AuthFailed):
        MasterClient(c.master_url, "not-the-token").membership()
    mc = master_client(c)  # a follower may not have applied the daemons' registrations yet
    m = Membership.from_master(poll(lambda: (got := mc.membership())["nodes"] and got, 5))
    for token in ("not-the-token", None):
        bad = Client(m, token=token, timeout_s=1.0)
        if token is None:
            bad._pool.token = None  # no HELLO at all
        with pytest.raises(ServerError) as err:
            bad.put_one("k", b"v")
        assert err.value.code == P.ErrorCode.AUTH
        bad.close()
    with Client(c.master_url, token=c.token) as good:
        assert good.put_one("k", b"v") is Status.OK and good.get_one("k") == b"v"
    logs = ""
    for d in c.daemons:
        with open(d.log_path) as f:
            logs += f.read()
    assert "cluster token" in logs


def daemons_know(c, epoch):
    """Whether every daemon of ``c`` is at ``epoch`` (its replies carry the epoch it holds)."""
    for d in c.daemons:
        conn = open_connection(d.node_id, d.address, 2.0, c.token)
        try:
            deadline = time.monotonic() + 2
            conn.send(P.Op.STATS, {}, [], deadline, 2.0)
            meta, _ = conn.recv_reply(deadline)
        finally:
            conn.close()
        if meta.get("ep", -1) < epoch:
            return False
    return True


def test_master_outage_alone_fences_nobody(tmp_path):
    """Issue 16 item 4, the other case: with every master gone nobody can change the
    membership, so the daemons confirm the outage with each other and keep serving under the
    last one, well past --fence-after. (A daemon cut off alone fences: tests/test_faultlab.py.)"""
    fence_after = 0.8
    with LocalCluster(nodes=2, mem="16MiB", masters=1, root=str(tmp_path / "c"),
                      extra_args=["--heartbeat", "0.2", "--fence-after", str(fence_after)]) as c:
        keys = [f"k{i}" for i in range(100)]
        with Client(c.master_url, token=c.token, timeout_s=1.0) as cl:  # any error raises
            assert all(s is Status.OK for s in cl.put(keys, [k.encode() for k in keys]))
            # the outage starts once the join has settled: a daemon that has not yet heard the
            # last epoch (the handover closing) rightly fences when a peer knows a newer one
            mc = master_client(c)
            try:
                assert poll(lambda: (m := mc.membership())["transition"] is None and daemons_know(c, m["epoch"]), 10)
            finally:
                mc.close()
            c.kill(0, master=True)
            t0, reads = time.monotonic(), 0
            while time.monotonic() - t0 < 3 * fence_after:
                assert [bytes(g) for g in cl.get(keys)] == [k.encode() for k in keys]
                reads += 1
        logs = ""
        for d in c.daemons:
            with open(d.log_path) as f:
                logs += f.read()
        assert "outage: no master leader reachable" in logs
        print(f"\nmaster outage: {reads} reads of {len(keys)} keys, all hits, over {3 * fence_after:.1f}s "
              f"(fence-after {fence_after}s)")


def test_a_pushed_handover_copy_is_refused_where_no_handover_is_open(ha):
    """A previous owner's pushed copy ("ho") lands only during a handover the receiver knows of
    (tests/server/test_routing_epochs.py: only where no client wrote or deleted the key, and a
    miss of such a key is final): on a settled cluster the push is refused as FENCED, saying
    why, and nothing it carried is stored."""
    c = ha(nodes=1)
    node = c.daemons[0]
    with Client(c.master_url, token=c.token, timeout_s=2.0) as cl:
        assert cl.put(["new", "gone"], [b"v2", b"v1"]) == [Status.OK, Status.OK]
        assert cl.delete(["gone"]) == [True]
        conn = open_connection(node.node_id, node.address, 2.0, c.token)
        deadline = time.monotonic() + 5
        keys = [b"new", b"gone", b"fresh"]
        ep = cl.membership.epoch  # a push carries the epoch whose ring it was sent by
        assert cl.membership.previous is None  # settled: no handover open
        conn.send(P.Op.PUT, {"ns": "default", "keys": keys, "sizes": [2, 2, 2], "ho": "nodeX", "ep": ep},
                  [memoryview(b"v1"), memoryview(b"v0"), memoryview(b"v1")], deadline, 2.0)
        with pytest.raises(ServerError, match="no handover is open") as err:
            conn.recv_reply(deadline)
        assert err.value.code == P.ErrorCode.FENCED
        conn.close()
        assert cl.get(["new", "gone", "fresh"]) == [b"v2", None, None]


def test_a_master_that_lost_its_quorum_names_no_leader(ha):
    """Kill the leader and one follower: the survivor kept naming the dead leader for as long as
    it stayed alone (pysyncobj keeps an isolated follower's last leader), so its readiness, its
    has_leader metric and `gcache health` said the group was fine while nothing could commit."""
    c = ha(nodes=1)
    mc = master_client(c)
    leader = poll(lambda: mc.call("Status", {})["master"]["leader"], 5)
    idx = next(i for i, m in enumerate(c.master_procs) if f"--raft {leader}" in " ".join(m.args))
    others = [i for i in range(3) if i != idx]
    c.kill(idx, master=True)
    c.kill(others[0], master=True)
    alone = MasterClient([c.master_procs[others[1]].address], c.token, timeout_s=1.0)
    try:
        assert poll(lambda: alone.call("Status", {})["master"]["leader"] is None, 10), "still names a leader"
    finally:
        alone.close()
