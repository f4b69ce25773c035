"""The daemon's Handler and the client's Connection and fan-out over in-memory streams: protocol
behaviour without processes or sockets."""

import threading
import time

import pytest

from gcache import protocol as P
from gcache.client import Client, ClientConfig, OnNodeError
from gcache.errors import ConnectionFailed, ServerError
from gcache.protocol import Op, Status
from gcache.server.handler import Handler, ServerContext
from gcache.tier.allocator import aligned
from gcache.tier.store import Store, StoreConfig
from gcache.transport import Connection, Transport, open_connection
from gcache.transport.memory import MemoryStream
from tests.conftest import read
from tests.server.memory_daemon import memory_cluster, serve_then_close

MEM = ClientConfig(transport=Transport.MEMORY, token="t0k")


@pytest.fixture
def served():
    """A Handler serving one end of a memory pair; the test holds the other end."""
    store = Store(StoreConfig(mem_bytes=8 << 20, pretouch=False))
    ctx = ServerContext(store, "n1", 1 << 20, token="secret")
    client_end, server_end = MemoryStream.pair()
    t = threading.Thread(target=serve_then_close, args=(Handler(server_end, ctx),), daemon=True)
    t.start()
    yield client_end, store, t
    client_end.close()
    t.join(5)
    store.close()


def test_put_get_exists_delete_over_one_connection(served):
    stream, store, _t = served
    conn = Connection("n1", "n1:1", stream, 2.0)
    deadline = time.monotonic() + 5
    conn.hello("secret", deadline)
    value = memoryview(b"v" * 1000)
    conn.send(Op.PUT, {"ns": "a", "keys": [b"k1", b"k2"], "sizes": [1000, 0]}, [value], deadline, 2.0)
    meta, plen = conn.recv_reply(deadline)
    assert meta["st"] == [Status.OK, Status.OK] and plen == 0
    conn.send(Op.GET, {"ns": "a", "keys": [b"k1", b"nope"]}, [], deadline, 2.0)
    meta, plen = conn.recv_reply(deadline)
    assert meta["st"] == [Status.OK, Status.NOT_FOUND] and meta["sz"] == [1000, 0] and plen == 1000
    got = memoryview(bytearray(1000))
    conn.recv_into(got, deadline)
    assert bytes(got) == bytes(value)
    assert conn.call(Op.EXISTS, {"ns": "a", "keys": [b"k2"]}, deadline)["st"] == [Status.OK]
    assert conn.call(Op.DELETE, {"ns": "a", "keys": [b"k1", b"k1x"]}, deadline)["st"] == [Status.OK, Status.NOT_FOUND]
    assert store.acquire(("a", b"k1")) is None


def test_wrong_token_is_refused_and_the_connection_closed(served):
    stream, _store, handler_thread = served
    conn = Connection("n1", "n1:1", stream, 2.0)
    with pytest.raises(ServerError) as err:
        conn.hello("wrong", time.monotonic() + 5)
    assert err.value.code == P.ErrorCode.AUTH
    handler_thread.join(5)
    assert not handler_thread.is_alive()  # the daemon hung up


def test_refused_request_keeps_the_connection_in_sync(served):
    stream, _store, _t = served
    conn = Connection("n1", "n1:1", stream, 2.0)
    deadline = time.monotonic() + 5
    conn.hello("secret", deadline)
    # sizes do not add up to the payload: refused, payload drained, connection still usable
    conn.send(Op.PUT, {"ns": "a", "keys": [b"k"], "sizes": [5]}, [memoryview(b"abc")], deadline, 2.0)
    with pytest.raises(ServerError) as err:
        conn.recv_reply(deadline)
    assert err.value.code == P.ErrorCode.BAD_META
    assert conn.call(Op.PING, {}, deadline)["node"] == "n1"


def test_bad_magic_is_answered_then_closed(served):
    stream, _store, _t = served
    stream.sendmsg([b"XXXX" + bytes(P.HEADER_SIZE - 4)])
    hdr = memoryview(bytearray(P.HEADER_SIZE))
    stream.settimeout(5)
    n = 0
    while n < P.HEADER_SIZE:
        n += stream.recv_into(hdr[n:])
    _v, _op, flags, _rid, mlen, _plen = P.unpack_header(hdr)
    assert flags & P.FLAG_ERROR
    body = memoryview(bytearray(mlen))
    n = 0
    while n < mlen:
        n += stream.recv_into(body[n:])
    assert P.decode_meta(body)["code"] == P.ErrorCode.BAD_FRAME
    assert stream.recv_into(bytearray(1)) == 0


def test_client_fans_out_over_three_memory_daemons():
    with memory_cluster(3, token="t0k", tag="fan") as daemons, Client([d.address for d in daemons], MEM) as c:
        keys = [f"key-{i}" for i in range(300)]
        values = [bytes([i % 251]) * (1 + i * 37 % 5000) for i in range(300)]
        assert c.put(keys, values) == [Status.OK] * 300
        owners = set(c.owners(keys))
        assert len(owners) == 3  # every daemon got a share
        assert c.get(keys) == values
        assert all(c.exists(keys))
        assert c.delete(keys[:10]) == [True] * 10
        assert c.get(keys[:11]) == [None] * 10 + [values[10]]
        # each daemon holds exactly the keys the ring gives it
        for d in daemons:
            held = {k.decode() for _ns, k in d.store.keys_hottest_first()}
            assert held == {k for k, o in zip(keys[10:], c.owners(keys[10:])) if o == d.address}


def test_a_dead_memory_daemon_becomes_misses_or_an_error():
    with memory_cluster(2, token="t0k", tag="dead") as daemons:
        keys = [f"k{i}" for i in range(50)]
        with Client([d.address for d in daemons], MEM, on_node_error=OnNodeError.MISS) as c:
            assert c.put(keys, [b"x"] * 50) == [Status.OK] * 50
            dead = daemons[0]
            dead.kill()
            got = c.get(keys)
            for k, v, owner in zip(keys, got, c.owners(keys)):
                assert v == (None if owner == dead.address else b"x")
        with Client([d.address for d in daemons], MEM) as c, pytest.raises(ConnectionFailed):
            c.get(keys)


def test_open_connection_refuses_a_wrong_token_with_a_typed_error():
    with memory_cluster(1, token="t0k", tag="tok") as (d,):
        with pytest.raises(ServerError) as err:
            open_connection("n", d.address, 2.0, "bad", Transport.MEMORY)
        assert err.value.code == P.ErrorCode.AUTH
        conn = open_connection("n", d.address, 2.0, "t0k", Transport.MEMORY)
        assert conn.call(Op.PING, {}, time.monotonic() + 5)["node"] == d.address
        conn.close()


def test_a_batch_larger_than_the_arena_stores_every_value_in_turn():
    """A PUT whose values together exceed the arena makes room from its own earlier values, as
    one key at a time would: every key is stored, the last ones survive."""
    values = [bytes([i]) * 100_000 for i in range(16)]  # 1.6 MB into a 1 MiB arena
    with memory_cluster(1, token="t0k", tag="big", mem_bytes=1 << 20) as (d,), Client([d.address], MEM) as c:
        assert c.put([f"k{i}" for i in range(16)], values) == [Status.OK] * 16
        assert c.get(["k15", "k14"]) == [values[15], values[14]]


def test_a_too_small_buffer_mid_reply_keeps_the_other_values_in_place():
    """A GET reply's values are received in one go; one that does not fit its buffer is read and
    dropped in between, so the values after it still land where they belong."""
    with memory_cluster(1, token="t0k", tag="small") as (d,), Client([d.address], MEM) as c:
        values = [b"a" * 3000, b"b" * 5000, b"c" * 7000]
        assert c.put(["x", "y", "z"], values) == [Status.OK] * 3
        bufs = [bytearray(3000), bytearray(100), bytearray(7000)]
        res = c.get_into(["x", "y", "z"], bufs)
        assert res.status == [Status.OK, Status.BUFFER_TOO_SMALL, Status.OK]
        assert res.sizes == [3000, 5000, 7000]
        assert bytes(bufs[0]) == values[0] and bytes(bufs[2]) == values[2] and bytes(bufs[1]) == bytes(100)


def _small_value_daemon():
    """A Handler over a memory pair whose store refuses values over 100,000 bytes (8 MiB arena:
    a PUT's values are reserved and received in runs of at most 512 KiB)."""
    store = Store(StoreConfig(mem_bytes=8 << 20, pretouch=False, max_value_bytes=100_000))
    client_end, server_end = MemoryStream.pair()
    t = threading.Thread(target=serve_then_close, args=(Handler(server_end, ServerContext(store, "n1", 4 << 20, None)),),
                         daemon=True)
    t.start()
    return client_end, store, t


def test_a_put_spanning_several_runs_with_refusals_in_between_stores_the_rest_in_place():
    stream, store, t = _small_value_daemon()
    try:
        conn = Connection("n1", "n1:1", stream, 2.0)
        deadline = time.monotonic() + 5
        keys = [b"a", b"big1", b"b", b"", b"big2", b"c", b"d"]
        sizes = [50_000, 150_000, 60_000, 10_000, 300_000, 70_000, 80_000]
        values = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
        conn.send(Op.PUT, {"ns": "a", "keys": keys, "sizes": sizes}, [memoryview(v) for v in values], deadline, 2.0)
        meta, _plen = conn.recv_reply(deadline)
        ok, big, bad = Status.OK, Status.TOO_LARGE, Status.BAD_KEY
        assert meta["st"] == [ok, big, ok, bad, big, ok, ok]
        for key, value, st in zip(keys, values, meta["st"]):
            if st == ok:
                assert read(store, ("a", key)) == value
        assert store.stats()["ram_used"] == sum(aligned(n) for n, st in zip(sizes, meta["st"]) if st == ok)
        assert conn.call(Op.PING, {}, deadline)["node"] == "n1"  # the refused bytes were drained: in sync
    finally:
        stream.close()
        t.join(5)
        store.close()


@pytest.mark.parametrize(("sizes", "sent", "stored"), [
    ([90_000] * 10, 700_000, 0),  # gone in the second run: the first one's five values, read whole, are
    # not landed either (their client had gone: Handler.write_guard), and their slots are given back
    ([90_000, 150_000, 90_000, 90_000], 50_000, 0),  # gone while the refusal's predecessor is received
])
def test_a_client_gone_mid_put_leaves_no_reservation_behind(sizes, sent, stored):
    stream, store, t = _small_value_daemon()
    try:
        keys = [b"k%d" % i for i in range(len(sizes))]
        raw = P.encode_meta({"ns": "a", "keys": keys, "sizes": sizes})
        head = P.pack_header(Op.PUT, 0, 1, len(raw), sum(sizes))
        stream.sendmsg([head + raw, b"x" * sent])
        stream.close()
        t.join(5)
        assert not t.is_alive()
        assert sum(store.exists(("a", k)) for k in keys) == stored
        assert store.stats()["ram_used"] == aligned(90_000) * stored  # nothing reserved is held
    finally:
        store.close()
