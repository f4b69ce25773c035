"""The local path's put leases against stalls, a client's first writable LMAP and connection shedding:
no copy may land in slots given to another value, and a stalled owner costs only its own keys."""

import os
import signal

from gcache import Client, LocalPath, OnNodeError, Status
from gcache.client import fanout
from gcache.client.pool import Pool
from tests.conftest import poll, sigstop
from tests.test_local_batch import keys_of, local_client, warm

KiB = 1 << 10


def ram_used(addr):
    with Client([addr], local=LocalPath.OFF, timeout_s=5.0, connect_timeout_s=5.0) as cl:
        return cl.stats()[addr]["ram_used"]


def expired_warnings(c):
    with open(c.daemons[0].log_path, errors="replace") as f:
        return f.read().count("expired; read pins released")


def test_first_put_stalled_before_its_writable_lmap_never_overwrites_another_key(make_cluster, monkeypatch):
    """A client's first local put on a daemon maps the arena writable (LMAP rw) on the same
    connection, after LALLOC answered. If the client stalls past the lease right there, the
    lease is overdue when the LMAP arrives, and LocalHandler._one_request aborts it after
    serving the LMAP: the slots go back (to the quick list, LIFO), another client's value of
    the same size lands in them, and the stalled client then copies its bytes over that value."""
    c = make_cluster(nodes=1, mem="16MiB", extra_args=["--lease", "0.3"])
    addr = c.addresses[0]
    size = 256 * KiB
    theirs = [bytes([0x30 + i]) * size for i in range(4)]
    real = Pool.writable_arena
    with Client([addr], local=LocalPath.FORCE, local_min_bytes=0, timeout_s=10.0, connect_timeout_s=5.0,
                on_node_error=OnNodeError.MISS) as cl, \
            Client([addr], local=LocalPath.OFF, timeout_s=5.0) as other:
        assert cl.get(["warm"]) == [None]  # a local connection, arena mapped read-only only
        settled = ram_used(addr)
        seen = expired_warnings(c)

        def stalled_then_map(self, conn, deadline):
            # the client stalls (GC pause, SIGSTOP, swap) until the reaper marked the lease overdue
            assert poll(lambda: expired_warnings(c) > seen, 5), "the lease never ran out"
            view = real(self, conn, deadline)  # LMAP rw: the daemon aborts the overdue lease after it
            # another client stores values of the same size meanwhile
            assert other.put([f"other{i}" for i in range(4)], theirs) == [Status.OK] * 4
            return view

        monkeypatch.setattr(Pool, "writable_arena", stalled_then_map)
        st = cl.put([f"mine{i}" for i in range(4)], [b"P" * size] * 4)
        got = other.get([f"other{i}" for i in range(4)])
        assert [bytes(g) if g is not None else None for g in got] == theirs, \
            f"another key's value was overwritten by the stalled put (its statuses: {st})"
        stored = 4 + st.count(Status.OK)
        assert poll(lambda: ram_used(addr) == settled + stored * size, 5)


def test_an_owner_stalled_before_its_lcommit_costs_only_its_own_keys(make_cluster, monkeypatch):
    """A put over two local owners; both answered LALLOC in time; A stops right after (before
    the copies and LCOMMITs). _finish_local finishes the requests one after the other under
    one finish_by: when A's LCOMMIT comes first it blocks until finish_by, and B's LCOMMIT then
    has no time left, so B (healthy, answered in time) loses its keys too. The order of the
    list is the order the replies arrived in; A first is forced here."""

    c = make_cluster(nodes=2, mem="16MiB")
    a, b = c.addresses
    size = 64 * KiB
    real_finish = fanout.Fanout._finish_local
    with local_client(c, timeout_s=1.5, on_node_error=OnNodeError.MISS) as cl:
        ka, kb = keys_of(cl, a, 3, "a"), keys_of(cl, b, 3, "b")
        warm(cl, ka + kb)
        vals = [os.urandom(size) for _ in ka + kb]

        def a_first_then_stall(self, op, local, deadline, failures):
            local.sort(key=lambda item: item[1].node != a)
            sigstop(c.daemons[0].pid)
            return real_finish(self, op, local, deadline, failures)

        monkeypatch.setattr(fanout.Fanout, "_finish_local", a_first_then_stall)
        try:
            st = cl.put(ka + kb, vals)
        finally:
            os.kill(c.daemons[0].pid, signal.SIGCONT)
        monkeypatch.setattr(fanout.Fanout, "_finish_local", real_finish)
        assert st[3:] == [Status.OK] * 3, f"B answered in time and is healthy: {st}"


def test_a_local_put_between_lalloc_and_lcommit_is_never_shed(make_cluster, monkeypatch):
    """At the connection cap the daemon sheds the connection idle the longest. A local
    connection whose LALLOC was answered and whose client is copying into the reserved slots
    is idle by that measure: shedding it aborts its reservations (release_all), another value
    takes the slots, and the client's copy then overwrites that value."""
    c = make_cluster(nodes=1, mem="16MiB", extra_args=["--max-connections", "3"])
    addr = c.addresses[0]
    size = 256 * KiB
    theirs = [bytes([0x30 + i]) * size for i in range(4)]
    real_copy = fanout.copy_all
    with Client([addr], local=LocalPath.FORCE, local_min_bytes=0, timeout_s=10.0, connect_timeout_s=5.0,
                on_node_error=OnNodeError.MISS) as cl:
        assert cl.put(["warm"], [b"w" * size]) == [Status.OK]  # an idle local connection, mapped writable
        settled = ram_used(addr)

        def copy_while_shed(pairs):
            others = [Client([addr], local=LocalPath.OFF, timeout_s=5.0) for _ in range(3)]
            try:
                for o in others:  # newer authenticated connections: the put's connection is idle longest
                    o.stats()
                assert others[-1].put([f"other{i}" for i in range(4)], theirs) == [Status.OK] * 4
            finally:
                for o in others[:-1]:
                    o.close()
            real_copy(pairs)
            others[-1].close()

        monkeypatch.setattr(fanout, "copy_all", copy_while_shed)
        st = cl.put([f"mine{i}" for i in range(4)], [b"P" * size] * 4)
        monkeypatch.setattr(fanout, "copy_all", real_copy)
    with Client([addr], local=LocalPath.OFF, timeout_s=5.0) as other:
        got = other.get([f"other{i}" for i in range(4)])
        assert [bytes(g) if g is not None else None for g in got] == theirs, \
            f"another key's value was overwritten by a put whose connection was shed (its statuses: {st})"
        stored = 1 + 4 + st.count(Status.OK)
        assert poll(lambda: ram_used(addr) == settled - size + stored * size, 5)
