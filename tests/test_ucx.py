"""The core round trips over the UCX transport, with UCX over TCP and over shared memory.

Real daemons (``--ucx``) on loopback; UCX_TLS is set in the environment the daemons inherit and
in this process's (the client reads it when it creates its UCX context).
"""

import os
import signal
import time
from contextlib import contextmanager

import numpy as np
import pytest

pytest.importorskip("ucxx", reason="ucxx is not importable (install the ucx extra: pip install -e '.[ucx]')")

from gcache import CallTimeout, Client, ConnectionFailed, OnNodeError, Status
from gcache.cluster import LocalCluster
from gcache.errors import GCacheError
from gcache.transport import (
    Transport,
    ucx,
)
from tests.conftest import poll, sigstop

MiB = 1 << 20
TLS = {"tcp": "tcp", "sm": "posix,cma,self"}


@contextmanager
def ucx_env(tls):
    old = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = tls
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = old


@pytest.fixture(scope="module", params=sorted(TLS))
def ucx_cluster(request, tmp_path_factory):
    """Three --ucx daemons with UCX_TLS set (for them and for this process's clients)."""
    with ucx_env(TLS[request.param]):
        c = LocalCluster(nodes=3, mem="96MiB", root=str(tmp_path_factory.mktemp(request.param)),
                         extra_args=["--ucx", "--no-pretouch", "--max-value", "4MiB"])
        c.start()
        try:
            yield c
        finally:
            c.stop()


def ucx_client(c, **kw):
    client = Client(c.addresses, transport=Transport.UCX, **kw)
    return client


def sizes(n, rng):
    """Log-uniform 1 B .. 4 MiB, with both ends present."""
    s = np.exp(rng.uniform(0, np.log(4 * MiB), n)).astype(np.int64)
    s[0], s[1] = 1, 4 * MiB
    return s


def test_available_here():
    ok, why = ucx.available()
    assert ok, why


def test_round_trip_1B_to_4MiB_byte_exact_over_three_daemons(ucx_cluster):
    rng = np.random.default_rng(11)
    n = 160
    sz = sizes(n, rng)
    blob = rng.integers(0, 256, int(sz.max()) + n, dtype=np.uint8)
    values = [blob[o:o + s] for o, s in zip(rng.integers(0, n, n), sz)]
    keys = [f"page/{i}" for i in range(n)]
    with ucx_client(ucx_cluster, timeout_s=20) as client:
        for i in range(0, n, 16):
            assert client.put(keys[i:i + 16], values[i:i + 16]) == [Status.OK] * len(values[i:i + 16])
        for i in range(0, n, 16):
            bufs = [np.empty(int(s), dtype=np.uint8) for s in sz[i:i + 16]]
            res = client.get_into(keys[i:i + 16], bufs)
            assert res.hits == len(bufs) and res.sizes == [int(s) for s in sz[i:i + 16]]
            for b, v in zip(bufs, values[i:i + 16]):
                assert np.array_equal(b, v)
        got = client.get(keys[:16])  # into new bytearrays
        assert all(bytes(g) == v.tobytes() for g, v in zip(got, values[:16]))
        # scatter put / gather get: one value from several buffers, read back into several
        parts = [np.arange(1000, dtype=np.uint8), np.full(MiB, 7, np.uint8)]
        assert client.put(["sg"], [parts]) == [Status.OK]
        outs = [np.empty(500, np.uint8), np.empty(MiB + 500, np.uint8)]
        assert client.get_into(["sg"], [outs]).hits == 1
        assert np.array_equal(np.concatenate(outs), np.concatenate(parts))
        stats = client.stats()
        assert sum(s["ram_keys"] for s in stats.values()) == n + 1
        assert all(s["ram_keys"] > n / 6 for s in stats.values())  # spread over all three
        conns = [c for idle in client._pool._idle.values() for c in idle]
        assert conns and all(type(c.stream).__name__ == "UcxStream" for c in conns)


def test_misses_refusals_and_small_buffers_keep_the_connection_in_sync(ucx_cluster):
    rng = np.random.default_rng(3)
    big = rng.integers(0, 256, 3 * MiB, dtype=np.uint8)
    with ucx_client(ucx_cluster, timeout_s=10) as client:
        st = client.put(["a", b"", "huge", "big", "b"],
                        [b"1", b"2", np.zeros(4 * MiB + 1, np.uint8), big, b"22"])
        assert st == [Status.OK, Status.BAD_KEY, Status.TOO_LARGE, Status.OK, Status.OK]
        assert client.get(["a", "missing", "huge", "b"]) == [b"1", None, None, b"22"]
        small, ok = np.empty(10, np.uint8), np.empty(3 * MiB, np.uint8)
        res = client.get_into(["big", "big"], [small, ok])
        assert res.status == [Status.BUFFER_TOO_SMALL, Status.OK] and res.sizes[0] == 3 * MiB
        assert np.array_equal(ok, big)
        assert client.exists(["a", "missing"]) == [True, False]
        assert client.delete(["a", "missing"]) == [True, False]
        assert client.get(["a", "b"]) == [None, b"22"]
        assert all("rtt_ms" in r for r in client.ping().values())


def test_dead_daemon_gives_typed_error_or_misses_within_the_timeout(ucx_cluster, request):
    tls = request.node.callspec.params["ucx_cluster"]
    keys = [f"d{i}" for i in range(60)]
    with ucx_env(TLS[tls]), LocalCluster(nodes=2, mem="32MiB", root=str(ucx_cluster.root) + "-dead",
                                         extra_args=["--ucx", "--no-pretouch"]) as c:
        with ucx_client(c, timeout_s=1.0) as client:
            assert client.put(keys, [b"v"] * len(keys)) == [Status.OK] * len(keys)
            owners = client.owners(keys)
            dead = c.addresses[1]
            c.kill(1)
            t0 = time.monotonic()
            with pytest.raises((ConnectionFailed, CallTimeout)):
                client.get(keys)
            assert time.monotonic() - t0 < 1.5
        with ucx_client(c, timeout_s=1.0, on_node_error=OnNodeError.MISS) as client:
            t0 = time.monotonic()
            got = client.get(keys)
            assert time.monotonic() - t0 < 1.5
            assert all((g is None) if o == dead else (g == b"v") for g, o in zip(got, owners))
            st = client.put(keys, [b"w"] * len(keys))
            assert all((s is Status.UNAVAILABLE) == (o == dead) for s, o in zip(st, owners))


def test_stopped_daemon_times_out_then_recovers(ucx_cluster):
    keys = [f"s{i}" for i in range(30)]
    with ucx_client(ucx_cluster, timeout_s=0.5, on_node_error=OnNodeError.MISS) as client:
        assert client.put(keys, [b"v"] * len(keys)) == [Status.OK] * len(keys)
        owners = client.owners(keys)
        pid = ucx_cluster.daemons[2].pid
        sigstop(pid)
        try:
            t0 = time.monotonic()
            got = client.get(keys)
            assert time.monotonic() - t0 < 1.0
            stopped = ucx_cluster.addresses[2]
            assert all((g is None) == (o == stopped) for g, o in zip(got, owners)), (got, owners, stopped)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert client.get(keys) == [b"v"] * len(keys)  # fresh connections after the timeout


def test_daemon_without_ucx_is_refused_clearly(make_cluster):
    c = make_cluster(nodes=1, extra_args=["--no-pretouch"])
    with ucx_client(c, timeout_s=2.0) as client, pytest.raises(GCacheError, match="--ucx"):
        client.get(["k"])


def test_an_authenticated_ucx_connection_may_idle_past_the_handshake_timeout(make_cluster, tmp_path):
    token = tmp_path / "token"
    token.write_text("ucx-token\n")
    c = make_cluster(nodes=1, extra_args=["--ucx", "--no-pretouch", "--token-file", str(token),
                                          "--handshake-timeout", "0.5"])
    with ucx_env(TLS["tcp"]), ucx_client(c, timeout_s=5.0, token="ucx-token") as client:
        assert client.put_one("k", b"v") is Status.OK
        conn = client._pool.get(c.daemons[0].node_id, c.addresses[0])
        client._pool.put(conn)
        time.sleep(1.5)  # idle, authenticated: past the handshake timeout on purpose
        assert conn.idle_ok(), "the daemon closed an authenticated UCX connection that idled"
        assert client.get_one("k") == b"v"


# -- hostile peers (a prober's findings; each test fails before its fix) -----------------------
def _raw_ucx(address, addr_bytes=None):
    """The client's UCX set-up done by hand: (stream, its set-up Connection), or the daemon's
    refusal of ``addr_bytes`` as the worker address."""
    import secrets

    from gcache.protocol import Op
    from gcache.transport import open_connection
    from gcache.transport.ucx import setup

    conn = open_connection("n", address, 5.0, None)
    worker = setup.worker_for("127.0.0.1")
    cid = secrets.randbits(62)
    reply = conn.call(Op.UCX_CONNECT, {"addr": addr_bytes or worker.address.tobytes(), "cid": cid},
                      time.monotonic() + 5)
    ep = setup.endpoint(worker, "127.0.0.1", reply["addr"])
    return ucx.UcxStream(worker, ep, 2 * cid, 2 * cid + 1, conn.stream), conn


def _rss_kb(pid, field="VmHWM"):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.fixture
def ucx_daemon(make_cluster):
    with ucx_env(TLS["tcp"]):
        yield make_cluster(nodes=1, mem="32MiB", extra_args=["--ucx", "--no-pretouch", "--max-value", "4MiB",
                                                              "--progress-timeout", "0.5"])


def test_a_malformed_worker_address_is_refused_and_the_daemon_lives(ucx_daemon):
    """UCX_CONNECT with the single byte 0x02 as the worker address: UCX parsed it with an
    assertion and aborted the daemon (SIGABRT)."""
    from gcache import ServerError
    from gcache.protocol import ErrorCode

    c = ucx_daemon
    for bad in (b"\x02", b"\x02" + os.urandom(60), b"\x12" + os.urandom(60)):
        with pytest.raises(ServerError, match="worker address") as err:
            _raw_ucx(c.addresses[0], bad)
        assert err.value.code == ErrorCode.BAD_META
    assert c.daemons[0].proc.poll() is None
    with ucx_client(c, timeout_s=5.0) as client:
        assert client.put_one("k", b"v") is Status.OK and client.get_one("k") == b"v"


def test_a_huge_message_is_not_staged_whole(ucx_daemon):
    """One tag message of 256 MiB (a PING header padded out): the daemon staged all of it (its
    memory grew by the message's size). Now its connection is closed once the size is seen."""
    from gcache import protocol as P

    c = ucx_daemon
    pid = c.daemons[0].pid
    stream, _conn = _raw_ucx(c.addresses[0])
    before = _rss_kb(pid)
    msg = np.zeros(256 * MiB, np.uint8)
    msg[:P.HEADER_SIZE] = np.frombuffer(P.pack_header(P.Op.PING, 0, 1, 0, 0), np.uint8)
    stream.settimeout(10.0)
    try:
        stream.sendmsg([msg])
    except OSError:
        pass  # the daemon may close the connection first
    with ucx_client(c, timeout_s=5.0) as client:  # still serving
        assert client.put_one("k", b"v") is Status.OK
    grown = _rss_kb(pid) - before
    assert grown < 64 * 1024, f"the daemon's peak memory grew by {grown} KiB"
    stream.close()


def test_a_stalled_ucx_put_is_reset_and_releases_its_reservation(ucx_daemon):
    """A PUT whose header announces 8 MiB of values that never come: over TCP the connection is
    reset after --progress-timeout and the reservation released; over UCX it was held for as long
    as the peer stayed connected."""
    from gcache import protocol as P

    c = ucx_daemon
    with ucx_client(c, timeout_s=5.0) as client:
        base = client.stats()[c.addresses[0]]["ram_used"]
        stream, _conn = _raw_ucx(c.addresses[0])
        meta = P.encode_meta({"ns": "default", "keys": [b"a", b"b"], "sizes": [4 * MiB, 4 * MiB]})
        stream.sendmsg([P.pack_header(P.Op.PUT, 0, 1, len(meta), 8 * MiB) + meta])  # and nothing more
        assert poll(lambda: client.stats()[c.addresses[0]].get("requests_stalled", 0) >= 1, 10)
        assert poll(lambda: client.stats()[c.addresses[0]]["ram_used"] == base, 5)
        stream.close()


def test_a_value_over_max_value_in_a_ucx_batch_is_refused_alone(ucx_daemon):
    """A put batch with one value larger than the daemon's --max-value (and than what it stages
    for a message): the daemon drops that value's message without staging it (a truncating
    receive); before, draining it staged the whole message past the bound and the connection was
    reset, failing every key of the batch."""
    c = ucx_daemon
    with ucx_env(TLS["tcp"]), ucx_client(c, timeout_s=10.0) as client:
        big = np.zeros(20 * MiB, np.uint8)
        st = client.put(["a", "huge", "b"], [b"x" * 1000, big, b"y" * 1000])
        assert st == [Status.OK, Status.TOO_LARGE, Status.OK]
        assert client.get(["a", "b"]) == [b"x" * 1000, b"y" * 1000]


def test_ucx_worker_addresses_of_both_layout_versions_pass_the_check():
    from gcache.transport.ucx import setup

    own = setup.worker_for("127.0.0.1").address.tobytes()
    assert setup.address_error(own) is None
    for version in (0, 1):
        assert setup.address_error(bytes([own[0] & 0xF0 | version]) + own[1:]) is None
    assert "layout version 2" in setup.address_error(bytes([own[0] & 0xF0 | 2]) + own[1:])
    assert "bytes" in setup.address_error(b"\x00")


def test_over_ucx_a_node_whose_address_leads_to_another_daemon_is_refused(ucx_cluster):
    """The UCX dialer greets over the TCP set-up stream like the others: with node ids known
    (not a static address list), the daemon answering must be the node dialled."""
    from gcache.meta.membership import Membership, Node

    a = ucx_cluster.addresses
    right = Membership(0, tuple(Node(f"node{i}", addr) for i, addr in enumerate(a)))
    swapped = Membership(0, (Node("node0", a[1]), Node("node1", a[0]), *right.nodes[2:]))
    keys = [f"swap{i}".encode() for i in range(30)]
    with Client(right, transport=Transport.UCX, timeout_s=10.0) as c:
        assert c.put(keys, [b"v"] * 30) == [Status.OK] * 30
    with Client(swapped, transport=Transport.UCX, timeout_s=10.0) as c, \
            pytest.raises(ConnectionFailed, match="not 'node"):
        c.get(keys)
    with Client(swapped, transport=Transport.UCX, timeout_s=10.0, on_node_error=OnNodeError.MISS) as c:
        got = c.get(keys)
        owners = dict(zip(keys, c.owners(keys)))
        for k, v in zip(keys, got):
            assert v == (b"v" if owners[k] == "node2" else None), (k, owners[k], v)
