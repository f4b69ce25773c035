"""Clearing a namespace (Op.CLEAR, Client.clear, `gcache clear`): every key of it goes, in RAM and
on disk, for good (a restart brings none back); other namespaces stay; a daemon that did not
acknowledge is reported, never counted as cleared."""

import signal
import subprocess
import sys
import threading
import time

import pytest

from gcache import Client, LocalPath, Status
from gcache import protocol as P
from gcache.errors import ServerError
from gcache.server.handler import Handler, ServerContext
from gcache.tier.store import Store, StoreConfig
from gcache.transport import Connection
from gcache.transport.memory import MemoryStream
from tests.conftest import poll
from tests.server.memory_daemon import serve_then_close

KB = 1024


def _fill(client, ns, n, size=64 * KB, pool=None):
    keys = [f"{ns}-{pool}-k{i}" for i in range(n)]
    for i in range(0, n, 16):
        st = client.put(keys[i:i + 16], [bytes([j % 251]) * size for j in range(i, min(i + 16, n))], namespace=ns,
                        pool=pool)
        assert st == [Status.OK] * len(st)
    return keys


def _gcache_clear(nodes, *args):
    return subprocess.run([sys.executable, "-m", "gcache", "clear", "--nodes", ",".join(nodes), *args],
                          capture_output=True, text=True, timeout=60, check=False)


def _held(client, ns, keys):
    return sum(v is not None for v in client.get(keys, namespace=ns))


def test_clear_deletes_ram_and_disk_keys_for_good_and_leaves_other_namespaces(make_cluster):
    c = make_cluster(nodes=2, mem="4MiB", disk="256MiB")
    with Client(c.addresses, timeout_s=20.0, local=LocalPath.OFF) as client:
        keep = _fill(client, "keep", 16)  # written first: on disk by the end
        old = _fill(client, "old", 200)  # 12.5 MiB through 8 MiB of RAM: most of it goes to disk
        pooled = _fill(client, "old", 8, pool="kv")
        assert poll(lambda: all(s["demote_queue_bytes"] == 0 for s in client.stats().values()), 20)
        stats = client.stats()
        assert sum(s["disk_keys"] for s in stats.values()) > 50 and sum(s["ram_keys"] for s in stats.values()) > 0
        held = sum(client.exists(old + pooled, namespace="old"))
        kept = _held(client, "keep", keep)
        assert kept > 0

        res = client.clear(namespace="old")
        assert res.complete and res.failed == {} and set(res.deleted) == set(c.addresses)
        assert sum(res.deleted.values()) == held
        assert _held(client, "old", old + pooled) == 0
        assert _held(client, "keep", keep) == kept
        assert client.clear(namespace="never-written").deleted == dict.fromkeys(c.addresses, 0)

        on_disk = sum(s["disk_keys"] for s in client.stats().values())
        for i in range(2):  # no resurrection from disk
            c.kill(i, signal.SIGKILL)
            c.restart(i)
        assert _held(client, "old", old + pooled) == 0
        assert 0 < _held(client, "keep", keep) <= on_disk <= kept  # what was on disk of "keep" came back


def test_a_clear_with_a_daemon_down_says_so_and_that_daemon_keeps_its_keys(make_cluster):
    c = make_cluster(nodes=3, mem="16MiB")
    with Client(c.addresses, timeout_s=2.0, connect_timeout_s=0.5, local=LocalPath.OFF) as client:
        keys = _fill(client, "ns", 60, size=KB)
        down = c.addresses[2]
        on_down = [k for k, o in zip(keys, client.owners(keys, namespace="ns")) if o == down]
        assert on_down
        c.kill(2, signal.SIGSTOP)  # alive but not answering: a timeout, not a refused connection
        try:
            res = client.clear(namespace="ns", timeout_s=1.0)
            assert not res.complete and list(res.failed) == [down] and down in res.failed[down]
            assert set(res.deleted) == set(c.addresses[:2])
            cli = _gcache_clear(c.addresses, "-n", "ns", "--yes", "--timeout", "1")
            assert cli.returncode == 1, cli.stderr
            assert f"{down}\tNOT CLEARED" in cli.stdout and "1 of 3 daemons did not acknowledge" in cli.stderr
        finally:
            c.kill(2, signal.SIGCONT)
        assert _held(client, "ns", keys) == len(on_down)  # it kept them: the clear was not complete
        res = client.clear(namespace="ns")
        assert res.complete and res.deleted[down] == len(on_down)
        assert _held(client, "ns", keys) == 0


def test_the_clear_command(make_cluster):
    c = make_cluster(nodes=2, mem="16MiB")

    def gcache(*args):
        return _gcache_clear(c.addresses, *args)

    with Client(c.addresses, namespace="m1", local=LocalPath.OFF) as client:
        keys = _fill(client, "m1", 10, size=KB)
        unconfirmed = gcache("-n", "m1")
        assert unconfirmed.returncode == 2 and "--yes" in unconfirmed.stderr
        assert _held(client, "m1", keys) == 10  # nothing deleted without --yes
        assert gcache("--yes").returncode == 2  # no default namespace
        done = gcache("-n", "m1", "--yes")
        assert done.returncode == 0, done.stderr
        assert "cleared on all 2 daemons (10 keys deleted)" in done.stdout
        assert _held(client, "m1", keys) == 0


@pytest.fixture
def served():
    store = Store(StoreConfig(mem_bytes=8 << 20, pretouch=False))
    ctx = ServerContext(store, "n1", 1 << 20, token="secret")
    client_end, server_end = MemoryStream.pair()
    t = threading.Thread(target=serve_then_close, args=(Handler(server_end, ctx),), daemon=True)
    t.start()
    yield Connection("n1", "n1:1", client_end, 2.0), store
    client_end.close()
    t.join(5)
    store.close()


def test_clear_needs_the_token_and_a_valid_namespace(served):
    conn, store = served
    store.put(("a", b"k"), b"v")
    deadline = time.monotonic() + 5
    with pytest.raises(ServerError) as err:
        conn.call(P.Op.CLEAR, {"ns": "a"}, deadline)
    assert err.value.code == P.ErrorCode.AUTH
    assert store.exists(("a", b"k"))


def test_clear_of_an_unknown_namespace_deletes_nothing_and_bad_ones_are_refused(served):
    conn, store = served
    store.put(("a", b"k"), b"v")
    deadline = time.monotonic() + 5
    conn.hello("secret", deadline)
    assert conn.call(P.Op.CLEAR, {"ns": "b"}, deadline)["n"] == 0
    # a field it does not take (a caller that means a narrower delete) is refused, not ignored
    for bad in ({}, {"ns": ""}, {"ns": 7}, {"ns": "x" * (P.MAX_NS_BYTES + 1)}, {"ns": "a", "keys": [b"k"]}):
        with pytest.raises(ServerError) as err:
            conn.call(P.Op.CLEAR, bad, deadline)
        assert err.value.code == P.ErrorCode.BAD_META
    assert store.exists(("a", b"k"))
    assert conn.call(P.Op.CLEAR, {"ns": "a"}, deadline)["n"] == 1
    assert not store.exists(("a", b"k"))


def test_a_clear_through_the_masters_needs_the_token_and_no_handover_brings_keys_back(tmp_path):
    from gcache.cluster import LocalCluster
    from gcache.meta.master_client import MasterClient

    with LocalCluster(nodes=2, mem="16MiB", masters=1, root=str(tmp_path / "c")) as cl:
        mc = MasterClient(cl.master_url, cl.token, timeout_s=2.0)
        try:
            with Client(cl.master_url, token=cl.token, timeout_s=5.0, local=LocalPath.OFF) as c:
                keys = _fill(c, "ns", 64, size=KB)
                with Client([d.address for d in cl.daemons], token="wrong", local=LocalPath.OFF) as intruder:
                    res = intruder.clear(namespace="ns")
                assert not res.complete and len(res.failed) == 2 and "token" in next(iter(res.failed.values()))
                assert _held(c, "ns", keys) == 64

                res = c.clear(namespace="ns")
                assert res.complete and sum(res.deleted.values()) == 64
                after = _fill(c, "ns", 8, size=KB, pool="new")  # written after the clear: they stay
                cl.add_node()  # a join: the moved keys are handed over to it
                assert poll(lambda: mc.membership()["transition"] is None and len(mc.membership()["nodes"]) == 3,
                            30)
                c.refresh_membership()
                assert _held(c, "ns", keys) == 0
                assert _held(c, "ns", after) == len(after)
                assert c.clear(namespace="ns").deleted.keys() == {d.node_id for d in cl.daemons}
        finally:
            mc.close()


def test_a_membership_that_changes_during_the_clear_is_cleared_again(monkeypatch):
    """A node that joined while the clear ran may have been handed keys of the namespace: the
    client clears again on the new membership (here: in-process daemons, the join simulated)."""
    from gcache.client import ClientConfig
    from gcache.meta.membership import Membership
    from gcache.transport import Transport
    from tests.server.memory_daemon import memory_cluster

    cfg = ClientConfig(transport=Transport.MEMORY, token="t0k", local=LocalPath.OFF)
    with memory_cluster(2, token="t0k", tag="clr") as daemons, Client([daemons[0].address], cfg) as c:
        for d in daemons:
            d.store.put(("ns", b"k"), b"v")
        joined = Membership.from_addresses([d.address for d in daemons], epoch=1)
        refreshes = []  # the first one (before the clear) finds nothing new; the join shows after round 1
        monkeypatch.setattr(c, "refresh_membership",
                            lambda: refreshes.append(1) or len(refreshes) > 1 and c.update_membership(joined))
        res = c.clear(namespace="ns")
        assert len(refreshes) == 3  # before, after round 1 (changed), after round 2 (settled)
        assert res.complete and res.deleted == {daemons[0].address: 1, daemons[1].address: 1}
        assert not any(d.store.exists(("ns", b"k")) for d in daemons)

        epochs = iter(range(2, 10))
        monkeypatch.setattr(c, "refresh_membership", lambda: c.update_membership(
            Membership.from_addresses([d.address for d in daemons], epoch=next(epochs))))
        res = c.clear(namespace="ns")  # it never settles: not complete, and says why
        assert not res.complete and "membership changed" in res.failed["membership"]
